"""Import surface, KT's constructor signature and validation, masks and helpers."""

import inspect
import os
import subprocess
import sys

import numpy as np
import pytest

import kt_kernel
from kt_kernel import KTMoEWrapper, generate_gpu_experts_masks
from conftest import make

KT_SIGNATURE = [
    ("layer_idx", inspect.Parameter.empty),
    ("num_experts", inspect.Parameter.empty),
    ("num_experts_per_tok", inspect.Parameter.empty),
    ("hidden_size", inspect.Parameter.empty),
    ("moe_intermediate_size", inspect.Parameter.empty),
    # KT makes these required; upstream SGLang passes num_gpu_experts instead of the mask, so
    # they default to None here (a missing thread or chunk size is still a TypeError).
    ("gpu_experts_mask", None),
    ("cpuinfer_threads", None),
    ("threadpool_count", None),
    ("weight_path", None),
    ("chunked_prefill_size", None),
    ("cpu_save", False),
    ("max_deferred_experts_per_token", None),
    ("method", "AMXINT4"),
    ("numa_nodes", None),
    ("mode", "inference"),
    ("num_gpu_experts", 0),
    ("lora_rank", 16),
    ("lora_alpha", 32.0),
    ("lora_dropout", 0.0),
    ("max_cache_depth", 1),
    ("group_size", 128),
    ("zero_point", True),
    ("full_weight_grad", False),
    ("swiglu_limit", 0.0),
    ("swiglu_alpha", 0.0),
]


def _import_with(variant):
    """`__cpu_variant__` and `__int8_kernel__` of a fresh interpreter with KT_KERNEL_CPU_VARIANT."""
    env = dict(os.environ, KT_KERNEL_CPU_VARIANT=variant)
    code = "import kt_kernel; print(kt_kernel.__cpu_variant__, kt_kernel.__int8_kernel__)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_forced_variant_is_what_the_module_reports():
    r = _import_with("reference")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["reference", "reference"]
    # An unknown value fails the import, listing this build's values.
    r = _import_with("sse9")
    assert r.returncode != 0
    assert "sse9" in r.stderr and "reference" in r.stderr and "valid values" in r.stderr


def _cpu_flags():
    if not os.path.exists("/proc/cpuinfo"):
        return set()
    line = next((l for l in open("/proc/cpuinfo") if l.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


# KT's AVX-512 sub-variants, widest first, with the flags each needs (KT's progressive rule).
AVX512_VARIANTS = [
    ("avx512_bf16", {"avx512f", "avx512bw", "avx512_vnni", "avx512vbmi", "avx512_bf16"}),
    ("avx512_vbmi", {"avx512f", "avx512bw", "avx512_vnni", "avx512vbmi"}),
    ("avx512_vnni", {"avx512f", "avx512bw", "avx512_vnni"}),
    ("avx512_base", {"avx512f", "avx512bw"}),
]


def test_cpu_variant_is_the_backend_that_runs_here():
    """The default variant is KT's name of the best backend this CPU runs (not a fixed string)."""
    assert sys.modules["kt_kernel_ext"] is kt_kernel.kt_kernel_ext
    flags = _cpu_flags()
    avx512 = [name for name, need in AVX512_VARIANTS if need <= flags]
    if {"amx_tile", "amx_int8", "amx_bf16", "avx512_bf16"} <= flags and kt_kernel.__cpu_variant__ == "amx":
        # AMX CPUs run the amx backend unless Linux refuses the tile state (then avx512 serves).
        assert kt_kernel.__int8_kernel__ == "amx-int8"
    elif avx512:
        assert kt_kernel.__cpu_variant__ == avx512[0]
        vnni = "avx512_vnni" in flags
        assert kt_kernel.__int8_kernel__ == ("avx512-vnni" if vnni else "avx512-maddubs")
    elif {"avx2", "fma"} <= flags:
        assert kt_kernel.__cpu_variant__ == "avx2"
        assert kt_kernel.__int8_kernel__ == "avx2-maddubs"
    else:
        assert kt_kernel.__cpu_variant__ == "reference"


@pytest.mark.parametrize("variant, need", AVX512_VARIANTS)
def test_each_avx512_sub_variant_can_be_forced(variant, need):
    """KT's variant strings force our sub-variants, and every method runs on each against the
    numpy MoE (test_forward's test in a process with the variant forced); one the CPU lacks
    fails the import, naming why."""
    r = _import_with(variant)
    if not need <= _cpu_flags():
        assert r.returncode != 0 and "lacks" in r.stderr, r.stderr
        return
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == variant
    here = os.path.dirname(os.path.abspath(__file__))
    test = os.path.join(here, "test_forward.py") + "::test_each_method_matches_the_fp32_moe"
    env = dict(os.environ, KT_KERNEL_CPU_VARIANT=variant)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
        env=env, cwd=here, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]


# Ours, after KT's parameters (keyword arguments KT's callers never pass).
OUR_PARAMETERS = [("scales", "absmax")]


def test_constructor_signature_is_kts():
    """KT's parameters in KT's order with KT's defaults, then ours."""
    params = list(inspect.signature(KTMoEWrapper.__new__).parameters.values())[1:]
    assert [(p.name, p.default) for p in params] == KT_SIGNATURE + OUR_PARAMETERS


def test_factory_returns_a_backend_object():
    w = make()
    assert not isinstance(w, KTMoEWrapper)
    for m in ("load_weights", "load_weights_from_tensors", "submit_forward", "sync_forward", "forward", "select_deferred_experts"):
        assert callable(getattr(w, m))
    assert w.gpu_experts_mask.dtype == bool and w.gpu_experts_mask.shape == (8,)


@pytest.mark.parametrize(
    "kwargs, exc, needle",
    [
        ({"method": "AMXINT3"}, ValueError, "Supported methods"),
        ({"method": "BF16", "swiglu_limit": 7.0}, ValueError, "MXFP4/MXFP8"),
        ({"mode": "train"}, ValueError, "mode"),
        ({"method": "SYCL_GPTQ_INT4"}, NotImplementedError, "SYCL_GPTQ_INT4"),
        ({"method": "MXFP4", "swiglu_limit": -1.0}, ValueError, "swiglu_limit and swiglu_alpha must be finite"),
        ({"method": "AMXINT4_1_SFT", "mode": "sft"}, NotImplementedError, "AMXINT4_1_SFT"),
        ({"num_experts_per_tok": 9}, ValueError, "num_experts_per_tok"),
        ({"hidden_size": 0}, ValueError, "hidden_size"),
        ({"numa_nodes": [0]}, ValueError, "numa_nodes"),
        ({"cpuinfer_threads": 1}, ValueError, "cpuinfer_threads"),
    ],
)
def test_bad_constructor_arguments(kwargs, exc, needle):
    args = dict(
        layer_idx=0,
        num_experts=8,
        num_experts_per_tok=2,
        hidden_size=256,
        moe_intermediate_size=512,
        gpu_experts_mask=None,
        cpuinfer_threads=2,
        threadpool_count=2,
        weight_path="/nonexistent",
        chunked_prefill_size=16,
    )
    args.update(kwargs)
    with pytest.raises(exc, match=needle):
        KTMoEWrapper(**args)


def _args(**kw):
    args = dict(layer_idx=0, num_experts=8, num_experts_per_tok=2, hidden_size=256, moe_intermediate_size=512,
                cpuinfer_threads=2, threadpool_count=2, weight_path="/nonexistent", chunked_prefill_size=16,
                method="BF16")
    args.update(kw)
    return args


def test_upstream_sglang_passes_num_gpu_experts_without_a_mask():
    """Upstream SGLang: num_gpu_experts=N and no gpu_experts_mask puts experts 0..N-1 on the GPU;
    KT's fork passes the mask; neither puts every expert on the CPU."""
    w = KTMoEWrapper(**_args(num_gpu_experts=3))
    assert w.gpu_experts_mask.tolist() == [True] * 3 + [False] * 5
    assert w.num_gpu_experts == 3
    assert not KTMoEWrapper(**_args()).gpu_experts_mask.any()
    mask = np.zeros(8, bool)
    mask[[1, 5]] = True
    both = KTMoEWrapper(**_args(gpu_experts_mask=mask, num_gpu_experts=2))
    assert both.gpu_experts_mask.tolist() == mask.tolist()
    with pytest.raises(ValueError, match="puts 2 experts on the GPU but num_gpu_experts is 3"):
        KTMoEWrapper(**_args(gpu_experts_mask=mask, num_gpu_experts=3))
    with pytest.raises(ValueError, match="num_gpu_experts must be between 0 and num_experts"):
        KTMoEWrapper(**_args(num_gpu_experts=9))
    with pytest.raises(TypeError, match="cpuinfer_threads"):
        KTMoEWrapper(**_args(cpuinfer_threads=None))


def test_capture_sizes_round_trip():
    KTMoEWrapper.set_capture_batch_sizes([1, 2, 4, 8])
    assert KTMoEWrapper.get_capture_batch_sizes() == [1, 2, 4, 8]
    KTMoEWrapper.clear_buffer_cache()
    KTMoEWrapper.set_capture_batch_sizes([])


def test_generate_gpu_experts_masks():
    freq = np.array([[5, 1, 9], [7, 0, 3]], dtype=np.float32)
    m = generate_gpu_experts_masks(freq, 3)
    assert m.dtype == bool and m.shape == (2, 3)
    assert m.tolist() == [[True, False, True], [True, False, False]]  # 9, 7, 5
    assert not generate_gpu_experts_masks(freq, 0).any()
    assert generate_gpu_experts_masks(freq, 99).all()


def test_select_deferred_experts_follows_kts_batch_rule():
    w = make()
    ids = np.array([[0, 1, 2], [3, 0, 4]])
    scores = np.array([[0.5, 0.3, 0.2], [0.6, 0.1, 0.3]], dtype=np.float32)
    imm, dfr = w.select_deferred_experts(ids, scores, 1)
    # protected: expert 0 (token 0's top) and 3 (token 1's top); 0 is protected in token 1 too.
    assert imm.tolist() == [[0, -1, -1], [3, 0, -1]]
    assert dfr.tolist() == [[-1, 1, 2], [-1, -1, 4]]
    imm, dfr = w.select_deferred_experts(ids, scores, 0)
    assert (imm == -1).all() and (dfr == ids).all()


def test_load_weights_from_a_missing_path_names_it():
    with pytest.raises(FileNotFoundError, match="/nonexistent/kt-weights"):
        make().load_weights(np.arange(8, dtype=np.int64))
