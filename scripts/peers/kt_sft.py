"""Times KT-Kernel's own SFT MoE (its wheel's kt_kernel.sft, driven through KTMoEWrapper(mode="sft"))
on a preset's layer: the best forward-with-cache and backward over a few reps, per token count.
Run by scripts/peer-kt-sft.sh with the wheel's package first on PYTHONPATH and torch installed."""

import argparse
import time

import torch
from kt_kernel import KTMoEWrapper

PRESETS = {"qwen3-30b-a3b": (128, 8, 2048, 768), "deepseek-v2-lite": (64, 6, 2048, 1408)}

ap = argparse.ArgumentParser()
ap.add_argument("--preset", default="qwen3-30b-a3b", choices=PRESETS)
ap.add_argument("--method", default="AMXBF16_SFT")
ap.add_argument("--tokens", default="256,1024")
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--rank", type=int, default=16)
ap.add_argument("--reps", type=int, default=5)
a = ap.parse_args()
E, K, H, I = PRESETS[a.preset]
R = a.rank
tokens = [int(t) for t in a.tokens.split(",")]
w = KTMoEWrapper(layer_idx=0, num_experts=E, num_experts_per_tok=K, hidden_size=H, moe_intermediate_size=I,
                 num_gpu_experts=0, gpu_experts_mask=None, cpuinfer_threads=a.threads, threadpool_count=1,
                 weight_path="", chunked_prefill_size=max(tokens), method=a.method, mode="sft", lora_rank=R,
                 lora_alpha=2.0 * R)
g = torch.Generator().manual_seed(0)
gate, up = [(torch.randn(E, I, H, generator=g) / H**0.5).bfloat16() for _ in range(2)]
down = (torch.randn(E, H, I, generator=g) / I**0.5).bfloat16()
w.load_weights_from_tensors(gate, up, down, torch.arange(E))
shapes = [(E, R, H), (E, I, R), (E, R, H), (E, I, R), (E, R, I), (E, H, R)]
lora = [(0.01 * torch.randn(*s, generator=g)).bfloat16() for s in shapes]
w.init_lora_weights(*lora, *[torch.zeros_like(x) for x in lora])
for n in tokens:
    x = torch.randn(n, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
    wt = torch.rand(n, K, generator=g)
    go = torch.randn(n, H, generator=g).bfloat16()
    fwd, bwd = [], []
    for _ in range(a.reps):
        t = time.perf_counter()
        w.forward(x, ids, wt, save_for_backward=True)
        fwd.append(time.perf_counter() - t)
        t = time.perf_counter()
        w.backward(go)
        bwd.append(time.perf_counter() - t)
    print(f"RESULT n={n} forward {min(fwd) * 1e3:.2f} backward {min(bwd) * 1e3:.2f}", flush=True)
