"""The exception hierarchy: every refusal, Python's and the native extension's, is a
``KTKernelError`` and still the built-in exception KT-Kernel raised; the staging buffers are
per thread."""

import threading

import numpy as np
import pytest

import kt_kernel
from kt_kernel import errors
from conftest import make

H = 256


@pytest.mark.parametrize(
    "cls, builtin",
    [
        (errors.KTValueError, ValueError),
        (errors.KTTypeError, TypeError),
        (errors.KTRuntimeError, RuntimeError),
        (errors.KTNotImplementedError, NotImplementedError),
        (errors.KTFileNotFoundError, FileNotFoundError),
    ],
)
def test_each_error_is_a_kt_kernel_error_and_its_builtin(cls, builtin):
    assert issubclass(cls, errors.KTKernelError) and issubclass(cls, builtin)
    assert getattr(kt_kernel, cls.__name__) is cls


def test_python_refusals_raise_the_hierarchy():
    with pytest.raises(errors.KTValueError, match="Unsupported method"):
        kt_kernel.KTMoEWrapper(0, 8, 2, H, 512, None, 1, 1, None, 64, method="NOPE")
    w = make()
    with pytest.raises(errors.KTRuntimeError, match="without a submit_forward"):
        w.sync_forward()
    with pytest.raises(errors.KTTypeError, match="integer"):
        w.submit_forward(np.zeros((1, H), np.float32), np.zeros((1, 2), np.float32), np.ones((1, 2), np.float32))


def test_native_refusals_raise_the_hierarchy():
    """The extension raises ``kt_kernel.errors``' classes: a bad dtype code and an unloaded
    layer, each caught by ``except KTKernelError`` and by KT's built-in."""
    w = make()
    with pytest.raises(errors.KTRuntimeError, match="not loaded"):
        w.forward(np.zeros((1, H), np.float32), np.zeros((1, 2), np.int64), np.ones((1, 2), np.float32))
    with pytest.raises(errors.KTValueError) as e:
        w.moe.load_from_arrays(w.cpu_infer, 0, 0, 0, "f64", list(range(w.num_experts)))
    assert isinstance(e.value, ValueError) and type(e.value).__module__ == "kt_kernel.errors"


def test_threads_stage_into_their_own_buffers():
    """Two threads' forwards of the same shape use different staging buffers."""
    from kt_kernel import _staging

    seen = {}

    def stage(name):
        st = _staging.Staging.get(3, H, 2, np.zeros((3, H), np.float32), False)
        seen[name] = st

    threads = [threading.Thread(target=stage, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["a"] is not seen["b"]
    assert seen["a"].slots[0].at[0] != seen["b"].slots[0].at[0]
