"""kt_kernel: CPU experts for CPU/GPU hybrid MoE inference (kt-kernel-rs).

A drop-in replacement for KT-Kernel's Python package as SGLang uses it::

    from kt_kernel import KTMoEWrapper, generate_gpu_experts_masks

One native extension (``kt_kernel.kt_kernel_ext``) serves every x86-64 CPU: the backend is chosen
at run time (``KT_KERNEL_CPU_VARIANT`` forces one, ``KT_KERNEL_DEBUG=1`` explains the choice).
Works with torch tensors, numpy arrays, anything with ``__array_interface__`` and host DLPack
producers; torch is not required. Every error it raises derives from ``KTKernelError``
(``kt_kernel.errors``) and from the built-in exception of its kind.
"""

import sys

from . import kt_kernel_ext

sys.modules.setdefault("kt_kernel_ext", kt_kernel_ext)

__version__ = kt_kernel_ext.__version__
__cpu_variant__ = kt_kernel_ext.__cpu_variant__
__int8_kernel__ = kt_kernel_ext.__int8_kernel__

from .errors import (  # noqa: E402
    KTFileNotFoundError,
    KTKernelError,
    KTNotImplementedError,
    KTRuntimeError,
    KTTypeError,
    KTValueError,
)
from .experts import KTMoEWrapper, generate_gpu_experts_masks  # noqa: E402

__all__ = [
    "KTMoEWrapper",
    "generate_gpu_experts_masks",
    "kt_kernel_ext",
    "__version__",
    "__cpu_variant__",
    "KTKernelError",
    "KTValueError",
    "KTTypeError",
    "KTRuntimeError",
    "KTNotImplementedError",
    "KTFileNotFoundError",
]
