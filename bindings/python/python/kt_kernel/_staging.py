"""Staging buffers: where a forward's inputs are copied for the native task to read by address
when it runs (pinned for torch on a CUDA machine), and where its output lands; and each Python
thread's pass through the layers. A CUDA stream's submit and sync are host functions on that
stream, so CUDA graphs can capture them.

Everything here is per Python thread (``threading.local``), so threads driving different layers
at once never write each other's buffers; only the capture sizes (``KTMoEWrapper.set_capture_batch_sizes``,
KT's process-wide setting) are shared, behind a lock.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

from . import _tensors as T


class _CaptureSizes:
    """The token counts whose staging buffers are kept forever (CUDA graph captures)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sizes: list[int] = []

    def set(self, sizes: list[int]) -> None:
        with self._lock:
            self._sizes = [int(n) for n in sizes]

    def get(self) -> list[int]:
        with self._lock:
            return list(self._sizes)

    def __contains__(self, n: object) -> bool:
        return n in self._sizes


CAPTURE_SIZES = _CaptureSizes()


def ptr(x: Any) -> int:
    """The address of a torch tensor's or a numpy array's data."""
    return int(x.data_ptr()) if T.is_torch(x) else int(x.ctypes.data)


class Slot:
    """One slot's staging buffers (KT keeps two per token count) and their addresses."""

    def __init__(self, alloc: Callable[[tuple[int, ...], Any], Any], n: int, h: int, k: int, act: Any) -> None:
        self.input = alloc((n, h), act)
        self.ids = alloc((n, k), "i64")
        self.ids_deferred = alloc((n, k), "i64")
        self.weights = alloc((n, k), "f32")
        self.output = alloc((n, h), act)
        self.at = (ptr(self.input), ptr(self.ids), ptr(self.ids_deferred), ptr(self.weights), ptr(self.output))


class Pass(threading.local):
    """What one Python thread's forwards share: its staging buffers and its pass through the
    layers (the deferred-expert hand-over and the slot order). KT keeps these process-wide;
    here they are freed with the thread."""

    def __init__(self) -> None:
        self.staging: dict[tuple[Any, ...], Staging] = {}
        self.pending: Staging | None = None  # the staging set whose ``deferred_out`` the next layer adds
        self.last_layer: int | None = None  # the last layer submitted (a lower index starts a new pass)
        self.ordinal = 0


THIS_THREAD = Pass()


class Staging:
    """Staging buffers for one token count and tensor kind; kept forever for captured sizes,
    else only the last one used (as KT's ``KExpertsCPUBuffer``), per Python thread."""

    @classmethod
    def get(cls, n: int, h: int, k: int, like: Any, torch: bool) -> Staging:
        cache = THIS_THREAD.staging
        key = (n, h, k, like.dtype, str(like.device) if torch else None)
        st = cache.get(key)
        if st is None:
            for old in [kk for kk in cache if kk[0] not in CAPTURE_SIZES]:
                del cache[old]
            st = cache[key] = Staging(n, h, k, like)
        return st

    def __init__(self, n: int, h: int, k: int, like: Any) -> None:
        self.torch = T.is_torch(like)
        alloc: Callable[[tuple[int, ...], Any], Any]
        if self.torch:
            torch = T.torch_module()
            pin = torch.cuda.is_available()
            dt = {"bf16": torch.bfloat16, "f32": torch.float32, "i64": torch.int64, "i32": torch.int32}

            def alloc(shape: tuple[int, ...], code: Any) -> Any:
                return torch.zeros(shape, dtype=dt[code], pin_memory=pin)

            act: Any = "bf16"  # KT's kernels consume bf16; copy_ converts
            self.code = "bf16"
            self.output_dev = torch.zeros((n, h), dtype=like.dtype, device=like.device)
        else:
            np_dt = {"i64": np.int64, "f32": np.float32, "i32": np.int32}

            def alloc(shape: tuple[int, ...], code: Any) -> Any:
                return np.zeros(shape, dtype=np_dt.get(code, code))

            act = np.dtype(like.dtype) if T.float_code(like) else np.dtype(np.float32)
            self.code = T.float_code(np.zeros(1, act)) or "f32"
        self.slots = [Slot(alloc, n, h, k, act), Slot(alloc, n, h, k, act)]
        self.deferred_out = alloc((n, h), act)
        self.bsz = alloc((1,), "i32")
        self.bsz[0] = n
        self.bsz_at, self.deferred_at = ptr(self.bsz), ptr(self.deferred_out)

    def put(self, dst: Any, src: Any, stream: int) -> None:
        """Copy ``src`` into the staging buffer ``dst`` (converting dtype). A torch copy from the
        GPU is non-blocking only with a stream: the task then runs after it as a host function
        on that stream; without one, the CPU task reads ``dst`` as soon as it is queued."""
        if self.torch:
            dst.copy_(src.reshape(dst.shape), non_blocking=bool(stream))
        elif T.is_torch(src):
            np.copyto(dst, src.detach().cpu().numpy().reshape(dst.shape), casting="unsafe")
        else:
            np.copyto(dst, np.asarray(src).reshape(dst.shape), casting="unsafe")


Staged = tuple[Staging, Slot, tuple[int, ...], Any]


def collect(cpu_infer: Any, staged: Staged, stream: int, allow: int) -> Any:
    """Wait for a staged forward (``(staging, slot, input shape, ticket)``; ``allow`` tasks may
    still run: its deferred experts) and return its output as the input was shaped."""
    st, slot, xs, ticket = staged
    if stream:
        cpu_infer.sync_with_cuda_stream(stream, allow)
    elif ticket is None:  # submitted on a stream, synced without one
        cpu_infer.sync(allow)
    else:
        # This forward's own task (its deferred experts may still run): other threads' tasks in
        # the shared queue neither hold it back nor let it return early.
        cpu_infer.sync_until(ticket)
    if st.torch:
        st.output_dev.copy_(slot.output, non_blocking=bool(stream))
        return st.output_dev.reshape(xs)
    # numpy: with a stream the result is ready only after the stream syncs, so the persistent
    # buffer is returned (as KT does); on the CPU path, a copy the caller owns.
    return slot.output.reshape(xs) if stream else slot.output.copy().reshape(xs)
