"""The wheel scripts/python.sh builds installs and runs where neither hwloc nor Rust is: a
manylinux wheel that auditwheel accepts, installed offline into a fresh venv, imported and run
in a private mount namespace where the system's libhwloc and libudev are unreadable and the
Rust toolchain is gone."""

import glob
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]

# Run inside the namespace by the fresh venv's Python: no toolchain, no system hwloc, then a
# forward against numpy, and where the topology came from.
CHECK = textwrap.dedent(
    """
    import ctypes, shutil
    import numpy as np
    assert shutil.which("cargo") is None and shutil.which("rustc") is None, "Rust is still reachable"
    for lib in ["libhwloc.so.15", "libudev.so.1"]:
        try:
            ctypes.CDLL(lib)
        except OSError:
            pass
        else:
            raise AssertionError(lib + " still loads from the system")
    import kt_kernel
    from kt_kernel import KTMoEWrapper, kt_kernel_ext
    maps = open("/proc/self/maps").read()
    assert "kt_kernel.libs/libhwloc" in maps, "the bundled hwloc is not the one loaded"
    e, k, h, i = 4, 2, 128, 256
    w = KTMoEWrapper(layer_idx=0, num_experts=e, num_experts_per_tok=k, hidden_size=h,
                     moe_intermediate_size=i, cpuinfer_threads=2, threadpool_count=1,
                     weight_path="/nonexistent", chunked_prefill_size=8, method="BF16")
    r = np.random.default_rng(0)
    g, u = (r.standard_normal((e, i, h)).astype(np.float32) / 16 for _ in range(2))
    d = r.standard_normal((e, h, i)).astype(np.float32) / 16
    w.load_weights_from_tensors(g, u, d)
    x = r.standard_normal((3, h)).astype(np.float32)
    ids = np.array([[0, 1], [2, 3], [1, 2]], np.int64)
    ws = np.full((3, 2), 0.5, np.float32)
    out = w.forward(x, ids, ws)
    ref = np.zeros_like(x)
    for t in range(3):
        for j in range(2):
            a, b = g[ids[t, j]] @ x[t], u[ids[t, j]] @ x[t]
            ref[t] += ws[t, j] * (d[ids[t, j]] @ (a / (1 + np.exp(-a)) * b))
    err = np.abs(out - ref).sum() / np.abs(ref).sum()
    assert err < 0.02, err
    print("topology", *kt_kernel_ext.topology(), "backend", kt_kernel.__cpu_variant__, "err %.4f" % err)
    """
)


def wheel():
    found = glob.glob(str(ROOT / "target" / "wheels" / "kt_kernel-*.whl"))
    if not found:
        pytest.skip("no wheel in target/wheels: run scripts/python.sh first")
    return pathlib.Path(found[0])


def test_the_wheel_is_manylinux_and_bundles_hwloc():
    w = wheel()
    assert "manylinux_" in w.name, w.name
    show = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(w)], capture_output=True, text=True)
    assert show.returncode == 0, show.stderr
    assert "is consistent with the following platform tag" in " ".join(show.stdout.split()), show.stdout
    listing = subprocess.run([sys.executable, "-m", "zipfile", "-l", str(w)], capture_output=True, text=True).stdout
    assert "kt_kernel.libs/libhwloc" in listing, listing


def test_installs_and_runs_without_hwloc_or_rust(tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    w = wheel()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index"]
    links = ["--find-links", str(ROOT / "target" / "wheelhouse"), "--find-links", str(w.parent)]
    subprocess.run(pip + links + [str(w)], check=True)
    (tmp_path / "check.py").write_text(CHECK)

    # The system's libraries become unreadable (/dev/null bound over each file), the toolchain
    # directories empty: as on a machine that never had them.
    # (Debian's own Rust, which scripts/test-aarch64.sh installs, is hidden the same way.)
    hide = sorted({os.path.realpath(p) for p in glob.glob("/usr/lib/x86_64-linux-gnu/libhwloc.so*")
                   + glob.glob("/usr/lib/x86_64-linux-gnu/libudev.so*")
                   + [p for p in ("/usr/bin/cargo", "/usr/bin/rustc", "/bin/cargo", "/bin/rustc") if os.path.exists(p)]})
    rust = [d for d in {os.environ.get("CARGO_HOME", os.path.expanduser("~/.cargo")),
                        os.environ.get("RUSTUP_HOME", os.path.expanduser("~/.rustup"))} if os.path.isdir(d)]
    script = "\n".join(
        ["set -e"]
        + [f"mount --bind /dev/null '{p}'" for p in hide]
        + [f"mount -t tmpfs tmpfs '{d}'" for d in rust]
        + [f"exec env -i PATH=/usr/bin:/bin HOME=/nonexistent '{venv}/bin/python' '{tmp_path}/check.py'"]
    )
    run = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                         capture_output=True, text=True, cwd=tmp_path)
    if run.returncode != 0 and "mount" in run.stderr and "topology" not in run.stdout:
        if "ermission" in run.stderr or "not permitted" in run.stderr:
            pytest.skip(f"no private mount namespace here: {run.stderr.strip()}")
    assert run.returncode == 0, run.stdout + run.stderr
    print(run.stdout.strip(), f"(hidden: {hide}, {rust})")
    assert run.stdout.startswith("topology hwloc "), run.stdout
