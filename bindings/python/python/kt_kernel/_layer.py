"""What the inference and the SFT wrappers share: the process's one native engine, KT's size
checks, the GPU-expert mask, and loading a layer's experts into the native layer."""

from __future__ import annotations

import os
import threading
from typing import Any, Optional, Sequence

import numpy as np

from . import _tensors as T
from . import kt_kernel_ext as ext
from .errors import KTFileNotFoundError, KTTypeError, KTValueError


class _Engine:
    """The process's one native engine (``kt_kernel_ext.CpuInfer``), as KT's: the first
    wrapper's ``cpuinfer_threads``/``threadpool_count``/``numa_nodes`` build it, later ones
    share it. Shared on purpose; built once under a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engine: Optional[ext.CpuInfer] = None

    def get(self, cpuinfer_threads: int, threadpool_count: int, numa_nodes: Optional[Sequence[int]]) -> ext.CpuInfer:
        with self._lock:
            if self._engine is None:
                tp, threads = int(threadpool_count), int(cpuinfer_threads)
                counts = [threads // tp + (1 if i < threads % tp else 0) for i in range(tp)]
                self._engine = ext.CpuInfer(counts, None if numa_nodes is None else [int(n) for n in numa_nodes])
            return self._engine


ENGINE = _Engine()


def cpu_infer(cpuinfer_threads: int, threadpool_count: int, numa_nodes: Optional[Sequence[int]]) -> ext.CpuInfer:
    """The process's one engine (KT's: the first configuration wins): ``cpuinfer_threads``
    threads in ``threadpool_count`` sub-pools on ``numa_nodes``."""
    return ENGINE.get(cpuinfer_threads, threadpool_count, numa_nodes)


def check_sizes(
    num_experts: int,
    num_experts_per_tok: int,
    hidden_size: int,
    moe_intermediate_size: int,
    cpuinfer_threads: int,
    threadpool_count: int,
    chunked_prefill_size: int,
) -> None:
    """KT's ValueError for a size that is not positive, naming it."""
    for name, v in locals().items():
        if int(v) <= 0:
            raise KTValueError(f"{name} must be positive, got {v}")


def skip_gpu_experts() -> bool:
    """``KT_KERNEL_SKIP_GPU_EXPERTS``: ``1`` leaves the experts the mask puts on the GPU at load
    out of CPU memory (for a server that never updates the mask in place); unset or ``0`` keeps
    every expert, as KT does."""
    v = os.environ.get("KT_KERNEL_SKIP_GPU_EXPERTS", "0")
    if v not in ("0", "1"):
        raise KTValueError(f"KT_KERNEL_SKIP_GPU_EXPERTS must be 0 or 1, got {v!r}")
    return v == "1"


def gpu_mask(mask: Any, num_gpu_experts: Optional[int], num_experts: int) -> Any:
    """The GPU-resident experts, given either way SGLang gives them: KT's fork passes
    ``gpu_experts_mask`` (``[E]`` bool), upstream SGLang passes ``num_gpu_experts`` (the experts
    with ids below it stay on the GPU) and no mask; neither means every expert on the CPU. Both
    are accepted when they agree on how many experts the GPU holds."""
    n = int(num_gpu_experts or 0)
    if not 0 <= n <= int(num_experts):
        raise KTValueError(f"num_gpu_experts must be between 0 and num_experts ({num_experts}), got {num_gpu_experts}")
    if mask is None:
        if n == 0:
            return None
        m = np.zeros(int(num_experts), dtype=bool)
        m[:n] = True
        return m
    on_gpu = int(mask.bool().sum()) if T.is_torch(mask) else int(np.asarray(T.host(mask)).astype(bool).sum())
    if n and on_gpu != n:
        raise KTValueError(
            f"gpu_experts_mask puts {on_gpu} experts on the GPU but num_gpu_experts is {n}: pass one of "
            "them (num_gpu_experts puts experts 0..n-1 on the GPU), or both in agreement"
        )
    return mask


class ExpertWeights:
    """Loading a layer's experts into ``self.moe`` (the native layer), shared by the inference
    and the SFT wrappers."""

    num_experts: int
    hidden_size: int
    moe_intermediate_size: int
    layer_idx: int
    weight_path: Any
    moe: Any
    cpu_infer: ext.CpuInfer

    def _own_mask(self, mask: Any) -> Any:
        """The wrapper's own ``[E]`` bool mask, read live by every forward (update it in place)."""
        e = self.num_experts
        if mask is not None and T.shape(mask) != (e,):
            raise KTValueError(f"gpu_experts_mask must have shape [{e}], got {T.shape(mask)}")
        if T.is_torch(mask):
            torch = T.torch_module()
            own = torch.zeros(e, dtype=torch.bool, pin_memory=torch.cuda.is_available())
            own.copy_(mask.to(torch.bool))
            return own
        own = np.zeros(e, dtype=bool)
        if mask is not None:
            own[:] = np.asarray(T.host(mask)).astype(bool)
        return own

    def load_weights(self, physical_to_logical_map_cpu: Any = None) -> None:
        """Load this layer from ``weight_path`` and block until done (as KT's): for LLAMAFILE a
        GGUF model (a ``.gguf`` file, split files, or a directory of them) run in its own
        types; else KT's converted INT4/INT8 files (inference only), or a Hugging Face
        safetensors checkpoint (a directory, sharded or not, or one file) in any layout KT's
        loaders detect, bf16 / f16 / f32 / fp8 / int4, quantized on the CPU to this wrapper's
        method."""
        if self.weight_path is None:
            raise KTValueError("weight_path is None: pass the checkpoint directory, or use load_weights_from_tensors")
        if not os.path.exists(self.weight_path):
            raise KTFileNotFoundError(f"weight_path {self.weight_path!r} does not exist")
        self.moe.load_from_checkpoint(
            self.cpu_infer, os.fspath(self.weight_path), self.layer_idx, self._map(physical_to_logical_map_cpu)
        )

    def load_weights_from_tensors(
        self, gate_proj: Any, up_proj: Any, down_proj: Any, physical_to_logical_map_cpu: Any = None
    ) -> None:
        """Quantize bf16/f16/f32 ``gate_proj``/``up_proj`` ``[E, I, H]`` and ``down_proj``
        ``[E, H, I]`` to this wrapper's method on the CPU (any method, not only KT's INT4/INT8)."""
        e, h, i = self.num_experts, self.hidden_size, self.moe_intermediate_size
        arrays, code = [], None
        for name, x, want in [
            ("gate_proj", gate_proj, (e, i, h)),
            ("up_proj", up_proj, (e, i, h)),
            ("down_proj", down_proj, (e, h, i)),
        ]:
            x = T.host(x)
            if T.shape(x) != want:
                raise KTValueError(f"{name} must have shape {list(want)}, got {list(T.shape(x))}")
            c = T.float_code(x)
            if c is None:
                if T.is_torch(x):
                    raise KTTypeError(f"{name}: expected bfloat16, float16 or float32, got {x.dtype}")
                x, c = np.asarray(x, dtype=np.float32), "f32"
            if code is not None and c != code:
                raise KTTypeError(f"gate_proj, up_proj and down_proj must share a dtype, got {code} and {c}")
            code = c
            arrays.append(T.to_host_array(x, name))
        m = self._map(physical_to_logical_map_cpu)
        (g, gp), (u, up), (d, dp) = arrays
        self.moe.load_from_arrays(self.cpu_infer, gp, up, dp, code, m)
        del g, u, d

    def _map(self, m: Any) -> list[int]:
        e = self.num_experts
        if m is None:
            return list(range(e))
        a = T.int_array(m, "physical_to_logical_map_cpu")
        if a.shape != (e,):
            raise KTValueError(f"physical_to_logical_map_cpu must have shape [{e}], got {list(a.shape)}")
        return [int(v) for v in a]
