"""Soak of the Python package as SGLang drives it, beside `kt soak` (the Rust MoeLayer path)
in the same run: passes through several layers (four methods) with deferred experts, random
routing (invalid ids included), token counts from 1 to chunked_prefill_size, and every layer's
GPU mask flipped in place between two states. Every output is compared bit for bit with the
first pass of the same inputs (made in the warm-up, which reaches every buffer size); RSS and
open descriptors are printed every 1000 forwards. Fails (exit 1) on a differing output, RSS
growth after the warm-up above --max-rss-growth-mib, more open descriptors, or a failed
`kt soak`. Run it with scripts/soak.sh."""

import argparse
import os
import subprocess
import sys
import time

import numpy as np

E, K, H, I, CHUNK = 16, 4, 128, 256, 64
METHODS = ["AMXINT8", "BF16", "AMXINT4", "FP8"]


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def fds():
    return len(os.listdir("/proc/self/fd"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--forwards", type=int, default=100_000, help="forwards to check after the warm-up")
    ap.add_argument("--seconds", type=float, default=float("inf"), help="stop earlier after this long")
    ap.add_argument("--max-rss-growth-mib", type=float, default=1.0)
    ap.add_argument("--kt", help="the kt binary: run `kt soak` at the same time")
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()

    rust = None
    if a.kt:
        cmd = [a.kt, "soak", "--forwards", str(a.forwards), "--threads", "1"]
        if a.seconds != float("inf"):
            cmd += ["--seconds", str(a.seconds)]
        rust = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    from kt_kernel import KTMoEWrapper

    rng = np.random.default_rng(a.seed)
    masks = [np.zeros(E, dtype=bool) for _ in METHODS]
    states = [[np.zeros(E, dtype=bool), rng.random(E) < 0.25] for _ in METHODS]
    layers = []
    for li, method in enumerate(METHODS):
        w = KTMoEWrapper(layer_idx=li, num_experts=E, num_experts_per_tok=K, hidden_size=H,
                         moe_intermediate_size=I, gpu_experts_mask=masks[li], cpuinfer_threads=1,
                         threadpool_count=1, weight_path="/nonexistent", chunked_prefill_size=CHUNK,
                         max_deferred_experts_per_token=1, method=method)
        g, u = (rng.standard_normal((E, I, H)).astype(np.float32) / np.sqrt(H) for _ in range(2))
        d = rng.standard_normal((E, H, I)).astype(np.float32) / np.sqrt(I)
        w.load_weights_from_tensors(g, u, d)
        layers.append(w)
    cases = []
    for c in range(32):
        n = CHUNK if c == 0 else int(rng.integers(1, CHUNK + 1))
        ids = np.stack([rng.choice(E, K, replace=False) for _ in range(n)]).astype(np.int64)
        ids[rng.random((n, K)) < 0.03] = -1
        ws = rng.random((n, K)).astype(np.float32)
        cases.append((rng.standard_normal((n, H)).astype(np.float32), ids, ws))

    def run_pass(c, m):
        for li, w in enumerate(layers):
            masks[li][:] = states[li][m]  # in place: the wrapper reads the mask live
        x, ids, ws = cases[c]
        return [w.forward(x, ids, ws) for w in layers]

    reference = {(c, m): run_pass(c, m) for c in range(len(cases)) for m in range(2)}
    start, r0, f0 = time.time(), rss(), fds()
    report = lambda n: print(f"python soak: {n} forwards, {n / max(time.time() - start, 1e-9):.0f}/s, "
                             f"RSS {rss() / 2**20:.1f} MiB, {fds()} open fds", flush=True)
    report(0)
    done, failure = 0, None
    while done < a.forwards and time.time() - start < a.seconds and failure is None:
        c, m = int(rng.integers(len(cases))), int(rng.integers(2))
        for li, (got, want) in enumerate(zip(run_pass(c, m), reference[(c, m)])):
            if not np.array_equal(got, want):
                failure = f"forward {done + li}: layer {li}, case {c}, mask {m} differs from its first pass"
        before = done
        done += len(layers)
        if done // 1000 != before // 1000:
            report(done)
    if done % 1000:
        report(done)
    growth = rss() - r0
    if failure is None and growth > a.max_rss_growth_mib * 2**20:
        failure = f"RSS grew by {growth / 2**20:.2f} MiB after the warm-up (more than {a.max_rss_growth_mib} MiB)"
    if failure is None and fds() > f0:
        failure = f"open file descriptors grew from {f0} to {fds()}"
    print(f"python soak: {'FAILED: ' + failure if failure else 'passed'}, {done} forwards checked, "
          f"RSS {growth:+d} bytes after the warm-up", flush=True)
    ok = failure is None
    if rust is not None:
        out, _ = rust.communicate()
        sys.stdout.write(out)
        ok = ok and rust.returncode == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
