"""kt_kernel.sft with real torch on the CPU: KTMoEFunction in an autograd graph against torch's
own autograd of an fp32 MoE with LoRA on the same (bf16) weights, every gradient (the base
weights' too, for full fine-tuning); LoRA and base parameters trained by a torch optimizer
through the registered gradient buffers."""

import torch

from kt_kernel import KTMoEWrapper
from kt_kernel.sft import KTMoEFunction

E, K, H, I, R, ALPHA = 8, 2, 256, 128, 4, 8.0
S = ALPHA / R


def bf16(x):
    return x.to(torch.bfloat16).to(torch.float32)


def make(seed=0):
    g = torch.Generator().manual_seed(seed)
    base = [bf16(torch.randn(E, I, H, generator=g) / H**0.5), bf16(torch.randn(E, I, H, generator=g) / H**0.5),
            bf16(torch.randn(E, H, I, generator=g) / I**0.5)]
    shapes = [(E, R, H), (E, I, R), (E, R, H), (E, I, R), (E, R, I), (E, H, R)]
    lora = [bf16(0.1 * torch.randn(*s, generator=g)) for s in shapes]
    w = KTMoEWrapper(layer_idx=0, num_experts=E, num_experts_per_tok=K, hidden_size=H, moe_intermediate_size=I,
                     cpuinfer_threads=2, threadpool_count=1, weight_path=None, chunked_prefill_size=64,
                     method="AMXBF16_SFT", mode="sft", lora_rank=R, lora_alpha=ALPHA)
    w.load_weights_from_tensors(*[b.to(torch.bfloat16) for b in base])
    params = [torch.nn.Parameter(m.to(torch.bfloat16)) for m in lora]
    for p in params:
        p.grad = torch.zeros_like(p)
    w.init_lora_weights(*params, *[p.grad for p in params])
    return w, base, lora, params


def routing(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = bf16(torch.randn(n, H, generator=g))
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
    wts = torch.rand(n, K, generator=g) * 0.9 + 0.1
    return x, ids, wts


def torch_moe(x, ids, wts, base, lora):
    gate, up, down = base
    ga, gb, ua, ub, da, db = lora
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(K):
            e = int(ids[t, j])
            g = gate[e] @ x[t] + S * gb[e] @ (ga[e] @ x[t])
            u = up[e] @ x[t] + S * ub[e] @ (ua[e] @ x[t])
            h = torch.nn.functional.silu(g) * u
            out[t] = out[t] + wts[t, j] * (down[e] @ h + S * db[e] @ (da[e] @ h))
    return out


def rel(a, b):
    return float((a.detach().float() - b.detach()).abs().sum() / b.detach().abs().sum().clamp_min(1e-30))


def test_autograd_function_matches_torch_autograd():
    w, base, lora, params = make()
    x, ids, wts = routing(9, 1)
    go = torch.randn(9, H, generator=torch.Generator().manual_seed(2))
    # torch's own autograd in fp32 on the same values.
    xr, wr = x.clone().requires_grad_(), wts.clone().requires_grad_()
    lr = [m.clone().requires_grad_() for m in lora]
    (torch_moe(xr, ids, wr, base, lr) * go).sum().backward()
    # Ours, as a node of the graph.
    xo, wo = x.clone().to(torch.bfloat16).requires_grad_(), wts.clone().requires_grad_()
    out = KTMoEFunction.apply(xo, ids, wo, w, *params)
    assert out.dtype == torch.bfloat16 and out.shape == (9, H)
    assert rel(out, torch_moe(x, ids, wts, base, lora)) < 1e-2
    (out.float() * go).sum().backward()
    assert rel(xo.grad, xr.grad) < 2e-2
    assert rel(wo.grad, wr.grad) < 2e-2
    for name, p, r in zip(["gate_a", "gate_b", "up_a", "up_b", "down_a", "down_b"], params, lr):
        assert rel(p.grad, r.grad) < 2e-2, name


def test_an_optimizer_trains_the_lora_parameters():
    """SGD on the LoRA parameters toward a target made by other LoRA matrices: the loss falls,
    as torch's own fp32 model trained the same way."""
    w, base, lora, params = make(3)
    g = torch.Generator().manual_seed(5)
    target_lora = [m + 0.05 * torch.randn(m.shape, generator=g) for m in lora]
    x, ids, wts = routing(16, 4)
    target = torch_moe(x, ids, wts, base, target_lora).detach()
    ours = torch.optim.SGD(params, lr=0.2)
    ref = [m.clone().requires_grad_() for m in lora]
    theirs = torch.optim.SGD(ref, lr=0.2)
    losses, ref_losses = [], []
    for _ in range(8):
        ours.zero_grad()  # sets .grad to None: the function gives the buffers back, zeroed
        out = KTMoEFunction.apply(x.to(torch.bfloat16), ids, wts, w, *params)
        loss = ((out.float() - target) ** 2).mean()
        loss.backward()
        ours.step()
        losses.append(float(loss.detach()))
        theirs.zero_grad()
        ref_loss = ((torch_moe(x, ids, wts, base, ref) - target) ** 2).mean()
        ref_loss.backward()
        theirs.step()
        ref_losses.append(float(ref_loss.detach()))
    assert losses[-1] < 0.8 * losses[0], losses
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) < 0.05 * b, (losses, ref_losses)


def make_full(seed):
    """A layer for full fine-tuning with LoRA: its base parameters are the wrapper's
    ``*_proj_buf``."""
    g = torch.Generator().manual_seed(seed)
    base = [bf16(torch.randn(E, I, H, generator=g) / H**0.5), bf16(torch.randn(E, I, H, generator=g) / H**0.5),
            bf16(torch.randn(E, H, I, generator=g) / I**0.5)]
    shapes = [(E, R, H), (E, I, R), (E, R, H), (E, I, R), (E, R, I), (E, H, R)]
    lora = [bf16(0.1 * torch.randn(*s, generator=g)) for s in shapes]
    w = KTMoEWrapper(layer_idx=0, num_experts=E, num_experts_per_tok=K, hidden_size=H, moe_intermediate_size=I,
                     cpuinfer_threads=2, threadpool_count=1, weight_path=None, chunked_prefill_size=64,
                     method="AMXBF16_SFT", mode="sft", lora_rank=R, lora_alpha=ALPHA, full_weight_grad=True)
    w.load_weights_from_tensors(*[b.to(torch.bfloat16) for b in base])
    params = [torch.nn.Parameter(m.to(torch.bfloat16)) for m in lora]
    w.init_lora_weights(*params, *[torch.zeros_like(p) for p in params])
    w.init_full_weight_grad_buffers(*base)
    return w, base, lora, params + [w.gate_proj_buf, w.up_proj_buf, w.down_proj_buf]


def test_full_weight_gradients_match_torch_autograd():
    w, base, lora, params = make_full(6)
    assert all(isinstance(p, torch.nn.Parameter) and p.dtype == torch.bfloat16 for p in params)
    x, ids, wts = routing(9, 7)
    go = torch.randn(9, H, generator=torch.Generator().manual_seed(8))
    br, lr = [m.clone().requires_grad_() for m in base], [m.clone().requires_grad_() for m in lora]
    (torch_moe(x, ids, wts, br, lr) * go).sum().backward()
    out = KTMoEFunction.apply(x.to(torch.bfloat16), ids, wts, w, *params)
    (out.float() * go).sum().backward()
    for name, p, r in zip(["gate_proj", "up_proj", "down_proj"], params[6:], br):
        assert p.grad is not None and p.grad.data_ptr() != 0, name
        assert rel(p.grad, r.grad) < 2e-2, name
    for name, p, r in zip(["gate_a", "gate_b", "up_a", "up_b", "down_a", "down_b"], params, lr):
        assert rel(p.grad, r.grad) < 2e-2, name


def test_full_fine_tuning_trains_base_and_lora():
    """SGD on the base and LoRA parameters, ``update_base_weights()`` after each step, against
    torch's model trained the same way (fp32 arithmetic on bf16 parameters, as ours: an update
    below a weight's bf16 step is lost on both sides): the same losses within 5%, falling."""
    w, base, lora, params = make_full(9)
    g = torch.Generator().manual_seed(10)
    target_base = [m + 0.02 * torch.randn(m.shape, generator=g) for m in base]
    x, ids, wts = routing(16, 11)
    target = torch_moe(x, ids, wts, target_base, lora).detach()
    ours = torch.optim.SGD(params, lr=0.1)
    ref = [m.to(torch.bfloat16).requires_grad_() for m in lora + base]
    theirs = torch.optim.SGD(ref, lr=0.1)
    losses, ref_losses = [], []
    for _ in range(6):
        ours.zero_grad()
        out = KTMoEFunction.apply(x.to(torch.bfloat16), ids, wts, w, *params)
        loss = ((out.float() - target) ** 2).mean()
        loss.backward()
        ours.step()
        w.update_base_weights()
        losses.append(float(loss.detach()))
        theirs.zero_grad()
        ref_loss = ((torch_moe(x, ids, wts, [m.float() for m in ref[6:]], [m.float() for m in ref[:6]]) - target) ** 2).mean()
        ref_loss.backward()
        theirs.step()
        ref_losses.append(float(ref_loss.detach()))
    assert losses[-1] < 0.8 * losses[0], losses
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) < 0.05 * b, (losses, ref_losses)
