"""The Python hand-off at a prefill chunk: ``wrapper.forward`` of 8192 bf16 tokens of H 7168
(DeepSeek-V3's width) through a layer with almost nothing to compute (k 1, I 32), so what it
times is the staging copies, the dtype conversions and the output's merge. Needs torch (bf16
tensors, as SGLang passes them): run it with the environment scripts/sglang-env.sh makes,

    ~/.cache/kt-kernel-rs/sglang/env/bin/python scripts/handoff.py [--tokens N] [--reps R] [--threads T]

and compare wheels in alternated runs (docs/python.md, "Overhead")."""

import argparse
import os
import statistics
import time

import torch

from kt_kernel import KTMoEWrapper

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--tokens", type=int, default=8192)
p.add_argument("--reps", type=int, default=15)
p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
a = p.parse_args()
E, K, H, I = 8, 1, 7168, 32
w = KTMoEWrapper(layer_idx=0, num_experts=E, num_experts_per_tok=K, hidden_size=H, moe_intermediate_size=I,
                 cpuinfer_threads=a.threads, threadpool_count=1, weight_path=None, chunked_prefill_size=a.tokens,
                 method="BF16")
g = torch.Generator().manual_seed(0)
w.load_weights_from_tensors(*(torch.randn(s, generator=g) * 0.02 for s in [(E, I, H), (E, I, H), (E, H, I)]))
x = torch.randn(a.tokens, H, generator=g).to(torch.bfloat16)
ids = torch.randint(0, E, (a.tokens, K), generator=g)
ws = torch.rand(a.tokens, K, generator=g)
for _ in range(3):
    out = w.forward(x, ids, ws)
ts = []
for _ in range(a.reps):
    t = time.perf_counter()
    out = w.forward(x, ids, ws)
    ts.append((time.perf_counter() - t) * 1e3)
check = float(out.float().abs().sum())
print(f"{a.tokens} tokens: best {min(ts):.1f} ms, median {statistics.median(ts):.1f} ms (output |sum| {check:.6e})")
