"""Duck-typed tensors: torch tensors (``data_ptr``/``shape``/``dtype``/``device``), numpy arrays,
anything with ``__array_interface__`` and host DLPack producers (``__dlpack__``), without
importing torch unless the caller passed one."""

import numpy as np

from .errors import KTTypeError

# Native element types: name -> (numpy dtype or None, torch dtype name, bytes)
_TORCH_NAMES = {"torch.bfloat16": "bf16", "torch.float16": "f16", "torch.float32": "f32"}


def is_torch(x):
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr") and hasattr(x, "device")


def on_cuda(x):
    return is_torch(x) and getattr(x.device, "type", "cpu") != "cpu"


def torch_module():
    import torch

    return torch


def host(x):
    """``x`` itself when numpy can read it (or it is a torch tensor), else a numpy view of a
    DLPack producer (jax, cupy on the host, ...); numpy's ``asarray`` does not read DLPack."""
    if is_torch(x) or isinstance(x, np.ndarray) or hasattr(x, "__array_interface__") or hasattr(x, "__array__"):
        return x
    if hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except (BufferError, TypeError, RuntimeError) as e:
            raise KTTypeError(f"{type(x).__name__}: a DLPack tensor numpy cannot read on the host ({e})") from e
    return x


def float_code(x):
    """'bf16' | 'f16' | 'f32' for a float tensor or array, else None."""
    if is_torch(x):
        return _TORCH_NAMES.get(str(x.dtype))
    name = np.asarray(x).dtype.name if not hasattr(x, "dtype") else np.dtype(x.dtype).name
    return {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}.get(name)


def shape(x):
    return tuple(int(d) for d in x.shape)


def to_host_array(x, what):
    """A C-contiguous numpy array (or CPU torch tensor) viewing or copying ``x``, plus its address."""
    if is_torch(x):
        t = x.detach()
        if on_cuda(t):
            t = t.cpu()
        t = t.contiguous()
        return t, int(t.data_ptr())
    try:
        a = np.ascontiguousarray(x)
    except Exception as e:  # noqa: BLE001 - report what was passed
        raise KTTypeError(f"{what}: expected a torch tensor or an array, got {type(x).__name__}") from e
    return a, int(a.ctypes.data)


def int_array(x, what):
    """``x`` as a 1-D/2-D int64 numpy array (for maps and ids on the host)."""
    if is_torch(x):
        x = x.detach().cpu().numpy()
    a = np.asarray(host(x))
    if a.dtype.kind not in "iu":
        raise KTTypeError(f"{what}: expected an integer tensor, got dtype {a.dtype}")
    return a.astype(np.int64, copy=False)
