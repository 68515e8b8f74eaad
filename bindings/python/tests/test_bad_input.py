"""docs/reliability.md's bad-input table, walked: every row's input is made here and what a
user sees (a CLI's one stderr line, or a Python exception's type and text) must be the row's
text exactly (temporary paths written <tmp>); a row without a case, or a case without a row,
fails. `python test_bad_input.py` prints the rows as the code has them now."""

import functools
import os
import pathlib
import re
import shutil
import subprocess

import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import make, routing, write_config, write_safetensors

ROOT = pathlib.Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "reliability.md"
E, K, H, I = 8, 2, 256, 512


@functools.cache
def kt_binary():
    """The kt CLI of this checkout with its default features (target/debug/kt may be the
    reference-only build `cargo test --no-default-features` leaves there)."""
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "kt-host", "--bin", "kt"], cwd=ROOT, check=True)
    return str(ROOT / os.environ.get("CARGO_TARGET_DIR", "target") / "release" / "kt")


def cli(tmp, *args, env=None):
    """What `kt args` prints on stderr: exactly one line, exit status 2 (1 for kt soak)."""
    full = dict(os.environ, **(env or {}))
    r = subprocess.run([kt_binary(), *args], capture_output=True, text=True, env=full, cwd=tmp)
    assert r.returncode in (1, 2), (args, r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def py(fn):
    try:
        fn()
    except Exception as e:  # the text a user sees
        return f"{type(e).__name__}: {e}"
    raise AssertionError("no error raised")


# -- inputs ----------------------------------------------------------------------------------


def hf_checkpoint(d, drop_expert=None, config=True):
    """A small f16 DeepSeek-named checkpoint with E experts in layer 0."""
    d.mkdir(parents=True, exist_ok=True)
    r = np.random.default_rng(0)
    t = {}
    for e in range(E):
        if e == drop_expert:
            continue
        for p, s in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            t[f"model.layers.0.mlp.experts.{e}.{p}_proj.weight"] = (r.standard_normal(s) / 16).astype(np.float16)
    save_file(t, str(d / "model.safetensors"))
    if config:
        write_config(d, E, K, H, I, 1)
    return d


def kt_moe_kernel_files(d):
    """What KT-Kernel's converter writes for MOE_INT8: KT's merged keys, no method recorded."""
    d.mkdir(parents=True, exist_ok=True)
    save_file({f"blk.0.ffn_{p}_exps.{e}.numa.{n}.weight": np.zeros(H * I, np.int8)
               for p in ("gate", "up", "down") for e in range(E) for n in range(2)}, str(d / "model.safetensors"))
    return d


def gpt_oss_checkpoint(d):
    """gpt-oss's experts dequantized (fused, interleaved gate/up, with expert biases), layer 0."""
    d.mkdir(parents=True, exist_ok=True)
    r = np.random.default_rng(3)
    p = "model.layers.0.mlp.experts"
    shapes = {"gate_up_proj": (E, H, 2 * I), "gate_up_proj_bias": (E, 2 * I), "down_proj": (E, I, H),
              "down_proj_bias": (E, H)}
    save_file({f"{p}.{n}": (r.standard_normal(s) / 16).astype(np.float32) for n, s in shapes.items()},
              str(d / "model.safetensors"))
    write_config(d, E, K, H, I, 1)
    return d


def projections():
    """(expert, projection, rows, cols, tensor stem) of every expert matrix of layer 0."""
    for e in range(E):
        for p, (rows, cols) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            yield e, p, rows, cols, f"model.layers.0.mlp.experts.{e}.{p}_proj"


def mxfp8_checkpoint(d, nan_at=None):
    """An MXFP8 checkpoint (e4m3 weights, e8m0 codes per 32 columns), one scale code 255 at
    expert/projection `nan_at`."""
    d.mkdir(parents=True, exist_ok=True)
    r = np.random.default_rng(4)
    t = {}
    for e, p, rows, cols, stem in projections():
        t[f"{stem}.weight"] = ("F8_E4M3", (rows, cols), r.integers(0, 0x70, (rows, cols), dtype=np.uint8).tobytes())
        s = np.full((rows, cols // 32), 120, np.uint8)
        if (e, p) == nan_at:
            s[3, 2] = 0xFF
        t[f"{stem}.weight_scale_inv"] = ("F8_E8M0", s.shape, s.tobytes())
    # By hand: numpy's safetensors API has no float8.
    write_safetensors(d / "model.safetensors", t)
    write_config(d, E, K, H, I, 1)
    return d


def int4_checkpoint(d, nan_at):
    """A compressed-tensors int4 checkpoint (Kimi-K2's layout, groups of 32), one f16 scale a
    NaN at expert/projection `nan_at`."""
    d.mkdir(parents=True, exist_ok=True)
    r = np.random.default_rng(5)
    t = {}
    for e, p, rows, cols, stem in projections():
        t[f"{stem}.weight_packed"] = r.integers(-2**31, 2**31, (rows, cols // 8), dtype=np.int64).astype(np.int32)
        s = np.full((rows, cols // 32), 0.01, np.float16)
        if (e, p) == nan_at:
            s[0, 3] = np.nan
        t[f"{stem}.weight_scale"] = s
    save_file(t, str(d / "model.safetensors"))
    write_config(d, E, K, H, I, 1)
    return d


def converted(tmp, method="int8", parts="1"):
    src = hf_checkpoint(tmp / "hf")
    out = tmp / f"kt-{method}-{parts}"
    r = subprocess.run([kt_binary(), "convert", "--input", str(src), "--output", str(out), "--method", method,
                        "--parts", parts, "--threads", "1"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return out


def shard(out):
    return sorted(out.glob("model-0*.safetensors"))[0]


def gguf_file(tmp, cut=None, junk=False):
    from test_gguf import moe_meta, moe_tensors, write

    p = tmp / "model.gguf"
    write(p, moe_tensors(("Q4_K", "Q4_K", "Q6_K"), 0, np.random.default_rng(1)), moe_meta(blocks=1))
    data = p.read_bytes()
    if junk:
        data = b"PK\x03\x04" + bytes(100)
    elif cut is not None:
        data = data[:cut] if cut > 0 else data[:cut]
    p.write_bytes(data)
    return p


def bench(tmp, weights, *extra, env=None):
    return cli(tmp, "bench", "--weights", str(weights), "--tokens", "1", "--min-time", "0", *extra, env=env)


def wrapper(**kw):
    # Two sub-pools, as the other tests' wrappers: the first wrapper of a process builds the pool
    # every later one shares (as KT), so a one-part pool made here would change theirs.
    args = dict(layer_idx=0, num_experts=E, num_experts_per_tok=K, hidden_size=H, moe_intermediate_size=I,
                cpuinfer_threads=2, threadpool_count=2, weight_path="/nonexistent", chunked_prefill_size=8,
                method="BF16")
    args.update(kw)
    from kt_kernel import KTMoEWrapper

    return KTMoEWrapper(**args)


def sft_wrapper(**kw):
    from kt_kernel.sft import SFTMoEWrapper

    args = dict(layer_idx=0, num_experts=E, num_experts_per_tok=K, hidden_size=H, moe_intermediate_size=I,
                num_gpu_experts=0, cpuinfer_threads=2, threadpool_count=2, weight_path="/nonexistent",
                chunked_prefill_size=8, method="AMXBF16_SFT", lora_rank=4, lora_alpha=8.0)
    args.update(kw)
    return SFTMoEWrapper(**args)


def loaded():
    w = make(e=E, h=H, i=I, chunk=8)
    r = np.random.default_rng(2)
    w.load_weights_from_tensors(*(r.standard_normal(s).astype(np.float32) / 16 for s in [(E, I, H), (E, I, H), (E, H, I)]))
    return w


def tokens(n, h=H):
    return np.zeros((n, h), np.float32)


def read_only_output(tmp):
    """kt convert into a read-only mount (a private mount namespace: root only)."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not installed")
    src = hf_checkpoint(tmp / "hf")
    (tmp / "ro").mkdir()
    script = f"mount -t tmpfs -o ro tmpfs '{tmp}/ro' || exit 99\nexec '{kt_binary()}' convert --input '{src}' --output '{tmp}/ro/out'"
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], capture_output=True, text=True)
    if r.returncode == 99 or "unshare:" in r.stderr:
        pytest.skip(f"no private mount namespace here: {r.stderr.strip()}")
    return r.stderr.strip()


# Row id -> how to make it (tmp: a fresh directory) and return what the user sees.
CASES = {
    # Files
    "gguf-truncated": lambda t: bench(t, gguf_file(t, cut=-1000)),
    "gguf-header-cut": lambda t: bench(t, gguf_file(t, cut=40)),
    "gguf-not-gguf": lambda t: bench(t, gguf_file(t, junk=True)),
    "safetensors-truncated": lambda t: (lambda o: (shard(o).write_bytes(shard(o).read_bytes()[:-5000]), bench(t, o, "--method", "int8"))[1])(converted(t)),
    "safetensors-offsets": lambda t: (lambda o: (shard(o).write_bytes(shard(o).read_bytes().replace(b'"data_offsets":[0,', b'"data_offsets":[8,', 1)), bench(t, o, "--method", "int8"))[1])(converted(t)),
    "safetensors-header-cut": lambda t: (lambda o: (shard(o).write_bytes(shard(o).read_bytes()[:100]), bench(t, o, "--method", "int8"))[1])(converted(t)),
    "safetensors-not-json": lambda t: (lambda o: (shard(o).write_bytes(b"\x0a\x00\x00\x00\x00\x00\x00\x00{not json}"), bench(t, o, "--method", "int8"))[1])(converted(t)),
    "checkpoint-missing-expert": lambda t: py(lambda: wrapper(weight_path=str(hf_checkpoint(t / "m", drop_expert=7))).load_weights()),
    "checkpoint-empty-dir": lambda t: py(lambda: wrapper(weight_path=str(t)).load_weights()),
    "checkpoint-no-config": lambda t: bench(t, hf_checkpoint(t / "m", config=False)),
    "checkpoint-biased-convert": lambda t: cli(t, "convert", "--input", str(gpt_oss_checkpoint(t / "m")), "--output",
                                               str(t / "out"), "--method", "int8"),
    "checkpoint-biased-sft": lambda t: py(lambda: sft_wrapper(weight_path=str(gpt_oss_checkpoint(t / "m"))).load_weights()),
    "checkpoint-mx-scale-nan": lambda t: py(
        lambda: wrapper(method="MXFP8", weight_path=str(mxfp8_checkpoint(t / "m", nan_at=(5, "up")))).load_weights()),
    "checkpoint-int4-scale-nan": lambda t: py(
        lambda: wrapper(method="RAWINT4", weight_path=str(int4_checkpoint(t / "m", nan_at=(5, "up")))).load_weights()),
    "converted-parts": lambda t: bench(t, converted(t, parts="2"), "--method", "int8"),
    "converted-method": lambda t: bench(t, converted(t), "--method", "int4"),
    "converted-by-kt-moe-kernel": lambda t: py(
        lambda: wrapper(method="MOE_INT8", weight_path=str(kt_moe_kernel_files(t / "kt"))).load_weights()),
    # Command line
    "convert-method": lambda t: cli(t, "convert", "--input", str(t), "--output", str(t / "o"), "--method", "int3"),
    "convert-layers": lambda t: cli(t, "convert", "--input", str(t), "--output", str(t / "o"), "--layers", "5-2"),
    "convert-parts": lambda t: cli(t, "convert", "--input", str(t), "--output", str(t / "o"), "--parts", "0"),
    "convert-input": lambda t: cli(t, "convert", "--input", str(t / "nope"), "--output", str(t / "o")),
    "convert-read-only": read_only_output,
    "bench-preset": lambda t: cli(t, "bench", "--preset", "gpt-5"),
    "bench-method": lambda t: cli(t, "bench", "--method", "int5"),
    "bench-threads": lambda t: cli(t, "bench", "--threads", "0"),
    "bench-tokens": lambda t: cli(t, "bench", "--tokens", "1,x"),
    "soak-layers": lambda t: cli(t, "soak", "--layers", "0"),
    # Environment
    "env-variant-unknown": lambda t: cli(t, "bench", "--tokens", "1", "--min-time", "0", "--hidden", "256", "--intermediate", "512", "--experts", "8", env={"KT_KERNEL_CPU_VARIANT": "avx1024"}),
    "env-variant-format": lambda t: cli(t, "bench", "--tokens", "1", "--min-time", "0", "--hidden", "256", "--intermediate", "512", "--experts", "8", "--method", "q4_k", env={"KT_KERNEL_CPU_VARIANT": "avx2"}),
    # Python
    "py-method": lambda t: py(lambda: wrapper(method="INT3")),
    "py-mask-and-count": lambda t: py(lambda: wrapper(gpu_experts_mask=np.zeros(E, bool), num_gpu_experts=2)),
    "py-top-k": lambda t: py(lambda: wrapper(num_experts_per_tok=E + 1)),
    "py-numa-nodes": lambda t: py(lambda: wrapper(numa_nodes=[0, 1], threadpool_count=1)),
    "py-not-loaded": lambda t: py(lambda: wrapper().forward(tokens(1), *routing(1, K, E, 0))),
    "py-too-many-tokens": lambda t: py(lambda: loaded().forward(tokens(9), *routing(9, K, E, 0))),
    "py-hidden": lambda t: py(lambda: loaded().forward(tokens(2, H + 1), *routing(2, K, E, 0))),
    "py-ids-shape": lambda t: py(lambda: loaded().forward(tokens(2), routing(3, K, E, 0)[0], routing(2, K, E, 0)[1])),
    "py-ids-float": lambda t: py(lambda: loaded().forward(tokens(2), routing(2, K, E, 0)[1], routing(2, K, E, 0)[1])),
    "py-sync-first": lambda t: py(lambda: loaded().sync_forward()),
    "py-tensor-shapes": lambda t: py(lambda: wrapper().load_weights_from_tensors(*(np.zeros(s, np.float32) for s in [(E, I, H), (E, H, I), (E, H, I)]))),
}


def documented():
    """{id: text} from the table (text in a code span; `\\|` is a literal bar)."""
    rows = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"^\| `([a-z0-9-]+)` \|.*\| (`+)(.*?)\2 \|$", line)
        if m:
            rows[m.group(1)] = m.group(3).strip().replace("\\|", "|")
    return rows


def seen(case_id, tmp):
    return CASES[case_id](tmp).replace(str(tmp), "<tmp>")


def test_every_row_has_a_case_and_every_case_a_row():
    assert sorted(documented()) == sorted(CASES)


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_what_the_user_sees_is_the_documented_text(case_id, tmp_path):
    want = documented().get(case_id)
    assert want is not None, f"{case_id}: no row in {DOC}"
    assert seen(case_id, tmp_path) == want


if __name__ == "__main__":
    import tempfile

    for cid in CASES:
        with tempfile.TemporaryDirectory() as d:
            try:
                print(f"{cid}\t{seen(cid, pathlib.Path(d))}")
            except BaseException as e:  # noqa: BLE001 (a skip, for the listing)
                print(f"{cid}\t?? {type(e).__name__}: {e}")
