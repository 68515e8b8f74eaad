"""The errors ``kt_kernel`` raises, Python's and the native extension's alike.

Every one derives from :class:`KTKernelError` and from the built-in exception its kind has
always been (``ValueError``, ``TypeError``, ``RuntimeError``...), so ``except ValueError``
clauses written for KT-Kernel keep catching what they caught::

    try:
        wrapper.load_weights()
    except kt_kernel.KTKernelError as e:  # anything kt_kernel refused
        ...
"""

from __future__ import annotations

__all__ = [
    "KTKernelError",
    "KTValueError",
    "KTTypeError",
    "KTRuntimeError",
    "KTNotImplementedError",
    "KTFileNotFoundError",
]


class KTKernelError(Exception):
    """Base of every error ``kt_kernel`` raises."""


class KTValueError(KTKernelError, ValueError):
    """An argument, a shape, a size, a method or a file's contents that is not what was expected
    (the message names it and what was expected)."""


class KTTypeError(KTKernelError, TypeError):
    """A tensor or argument of the wrong kind or dtype."""


class KTRuntimeError(KTKernelError, RuntimeError):
    """A call out of order (a sync without a submit, weights not loaded), or a failure while
    the engine ran a task (the message says which)."""


class KTNotImplementedError(KTKernelError, NotImplementedError):
    """A method or option KT-Kernel names that this build does not run."""


class KTFileNotFoundError(KTKernelError, FileNotFoundError):
    """A ``weight_path`` that does not exist."""
