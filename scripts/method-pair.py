"""Two methods of KTMoEWrapper on the same fp16 experts through the wheel: whether their outputs
have the same bits, and each one's forward time (best and median of alternated rounds), e.g.
KT's MOE_INT8 against AMXINT8, whose numerics it runs:

    target/pyenv/bin/python scripts/method-pair.py MOE_INT8 AMXINT8 [--tokens 1,256]

A qwen3-30b-a3b layer (128 experts, 8 a token, 2048 × 768), 2 threads.
"""
import argparse
import time

import numpy as np
from kt_kernel import KTMoEWrapper

E, K, H, I = 128, 8, 2048, 768


def wrapper(method):
    return KTMoEWrapper(layer_idx=0, num_experts=E, num_experts_per_tok=K, hidden_size=H, moe_intermediate_size=I,
                        gpu_experts_mask=None, cpuinfer_threads=2, threadpool_count=2, numa_nodes=None,
                        weight_path="/nonexistent", chunked_prefill_size=1024, method=method)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("methods", nargs=2)
    p.add_argument("--tokens", default="1,256")
    a = p.parse_args()
    r = np.random.default_rng(1)
    g, u = ((r.standard_normal((E, I, H)) * 0.02).astype(np.float16) for _ in range(2))
    d = (r.standard_normal((E, H, I)) * 0.02).astype(np.float16)
    ws = {m: wrapper(m) for m in a.methods}
    for w in ws.values():
        w.load_weights_from_tensors(g, u, d)
    for n in map(int, a.tokens.split(",")):
        x = r.standard_normal((n, H)).astype(np.float32)
        ids = np.stack([r.choice(E, K, replace=False) for _ in range(n)]).astype(np.int64)
        wt = np.full((n, K), 1.0 / K, np.float32)
        a0, a1 = (ws[m].forward(x, ids, wt) for m in a.methods)
        times = {m: [] for m in a.methods}
        reps = max(1, 50 // n)
        for _ in range(7):
            for m, w in ws.items():
                t = time.perf_counter()
                for _ in range(reps):
                    w.forward(x, ids, wt)
                times[m].append((time.perf_counter() - t) / reps * 1e3)
        line = ", ".join(f"{m} {min(v):.3f} ms (median {sorted(v)[3]:.3f})" for m, v in times.items())
        print(f"n = {n}: {line}; outputs {'bit-identical' if np.array_equal(a0, a1) else 'differ'}")


if __name__ == "__main__":
    main()
