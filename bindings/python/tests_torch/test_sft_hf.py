"""kt_kernel.sft.attach on a tiny Hugging Face Qwen3-MoE built by transformers from a config (no
download): a few optimizer steps of LoRA fine-tuning (and of full fine-tuning) through the CPU's
SFT layers track the same model trained with its own experts (a torch LoRA on the same bf16 base
weights) within 1e-3 of the loss, and the loss falls."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kt_kernel.sft import KTExperts, attach  # noqa: E402

R, ALPHA = 4, 8.0
LORA_NAMES = {"gate_lora_a", "gate_lora_b", "up_lora_a", "up_lora_b", "down_lora_a", "down_lora_b",
              "ga", "gb", "ua", "ub", "da", "db"}


def tiny_model(seed=0):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, max_position_embeddings=64, norm_topk_prob=True)
    torch.manual_seed(seed)
    return transformers.Qwen3MoeForCausalLM(cfg).float()


class TorchLoraExperts(torch.nn.Module):
    """The experts with LoRA in torch (fp32 on the bf16-rounded base weights KT holds)."""

    def __init__(self, experts, kt):
        super().__init__()
        self.gate_up = experts.gate_up_proj.detach().to(torch.bfloat16).float()
        self.down = experts.down_proj.detach().to(torch.bfloat16).float()
        self.i = self.down.shape[2]
        self.s = ALPHA / R
        for name, p in zip(("ga", "gb", "ua", "ub", "da", "db"), kt.lora_parameters()):
            self.register_parameter(name, torch.nn.Parameter(p.detach().float().clone()))

    def base(self):
        return self.gate_up, self.down

    def forward(self, x, idx, w):
        out = torch.zeros_like(x)
        gate_up, down = self.base()
        for e in range(gate_up.shape[0]):
            tok, slot = torch.where(idx == e)
            if len(tok) == 0:
                continue
            xe = x[tok]
            g = xe @ gate_up[e, :self.i].T + self.s * (xe @ self.ga[e].T) @ self.gb[e].T
            u = xe @ gate_up[e, self.i:].T + self.s * (xe @ self.ua[e].T) @ self.ub[e].T
            h = torch.nn.functional.silu(g) * u
            y = h @ down[e].T + self.s * (h @ self.da[e].T) @ self.db[e].T
            out.index_add_(0, tok, y * w[tok, slot, None])
        return out


def train_side_by_side(ours, ref, params, ids, steps=5, lr=5.0):
    """SGD on ``params(model)`` of both models, step by step: the losses agree within 1e-3 and
    ours falls by 1% or more."""
    opts = [torch.optim.SGD(params(m), lr=lr) for m in (ours, ref)]
    losses = []
    for _ in range(steps):
        step = []
        for model, opt in zip((ours, ref), opts):
            opt.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            step.append(float(loss.detach()))
        losses.append(step)
    for ours_loss, ref_loss in losses:
        assert abs(ours_loss - ref_loss) <= 1e-3 * ref_loss, losses
    assert losses[-1][0] < 0.99 * losses[0][0], losses


def test_attach_replaces_the_experts_and_training_tracks_torch():
    ours = tiny_model()
    ref = copy.deepcopy(ours)
    layers = attach(ours, lora_rank=R, lora_alpha=ALPHA, method="AMXBF16_SFT", cpuinfer_threads=2, max_tokens=64)
    assert len(layers) == 2 and all(isinstance(m, KTExperts) for m in layers)
    assert not any("gate_up_proj" in n for n, _ in ours.named_parameters())
    blocks = [layer.mlp for layer in ref.model.layers]
    for block, kt in zip(blocks, layers):
        block.experts = TorchLoraExperts(block.experts, kt)

    # LoRA-only fine-tuning, so the loss moves by the experts' LoRA alone: at this learning rate a
    # LoRA scale off by half shows from the second step (0.3%, growing to 8%).
    def lora(model):
        return [p for n, p in model.named_parameters() if n.split(".")[-1] in LORA_NAMES]

    for model in (ours, ref):
        keep = set(map(id, lora(model)))
        for p in model.parameters():
            p.requires_grad_(id(p) in keep)
    assert len(lora(ours)) == len(lora(ref)) == 12
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    train_side_by_side(ours, ref, lora, ids)
    # The LoRA parameters moved (B starts at zero), and with no graph nothing is cached.
    assert all(float(kt.gate_lora_b.detach().float().abs().sum()) > 0 for kt in layers)
    with torch.no_grad():
        ours(input_ids=ids)
    assert all(kt.wrapper.moe.cache_depth == 0 for kt in layers)


class TorchFullExperts(TorchLoraExperts):
    """``TorchLoraExperts`` whose base weights train too: bf16 parameters, fp32 arithmetic."""

    def __init__(self, experts, kt):
        super().__init__(experts, kt)
        self.gate_up = torch.nn.Parameter(experts.gate_up_proj.detach().to(torch.bfloat16))
        self.down = torch.nn.Parameter(experts.down_proj.detach().to(torch.bfloat16))

    def base(self):
        return self.gate_up.float(), self.down.float()


def test_full_fine_tuning_tracks_torch():
    """attach(full_weight_grad=True): the experts' base weights and LoRA train; each optimizer
    step's base weights are packed before the next forward; the loss tracks torch's own experts
    trained the same way (bf16 parameters on both sides) within 1e-3."""
    ours = tiny_model(5)
    ref = copy.deepcopy(ours)
    layers = attach(ours, lora_rank=R, lora_alpha=ALPHA, cpuinfer_threads=2, max_tokens=64, full_weight_grad=True)
    for kt in layers:
        assert [p.shape for p in kt.base_parameters()] == [(8, 32, 64), (8, 32, 64), (8, 64, 32)]
    for block, kt in zip([layer.mlp for layer in ref.model.layers], layers):
        block.experts = TorchFullExperts(block.experts, kt)

    def experts(model):
        return [p for n, p in model.named_parameters() if ".experts." in n]

    for model in (ours, ref):
        keep = set(map(id, experts(model)))
        for p in model.parameters():
            p.requires_grad_(id(p) in keep)
    assert len(experts(ours)) == 2 * 9 and len(experts(ref)) == 2 * 8
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(6))
    before = layers[0].gate_proj.detach().clone()
    train_side_by_side(ours, ref, experts, ids)
    assert not torch.equal(layers[0].gate_proj.detach(), before)


def test_attach_refuses_what_it_cannot_run():
    bad = tiny_model()
    bad.config.model_type = "llama"
    with pytest.raises(ValueError, match="model_type 'llama' is not supported"):
        attach(bad)
    act = tiny_model()
    act.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match="must be silu"):
        attach(act)


def test_adapters_round_trip_and_refuse_mismatches(tmp_path):
    from kt_kernel.sft import load_adapter, save_adapter

    trained = tiny_model()
    layers = attach(trained, lora_rank=R, lora_alpha=ALPHA, cpuinfer_threads=2, max_tokens=64, seed=3)
    with torch.no_grad():
        for kt in layers:
            for p in kt.lora_parameters():
                p.add_(torch.randn(p.shape).to(p.dtype))
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = trained(input_ids=ids).logits
    save_adapter(trained, tmp_path / "adapter")
    assert {p.name for p in (tmp_path / "adapter").iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert len(saved) == 2 * 8 * 3 * 2  # layers, experts, projections, A and B
    key = "base_model.model.model.layers.1.mlp.experts.7.down_proj.lora_B.weight"
    assert torch.equal(saved[key], layers[1].down_lora_b[7])

    fresh = tiny_model()
    fresh_layers = attach(fresh, lora_rank=R, lora_alpha=ALPHA, cpuinfer_threads=2, max_tokens=64)
    before = [p.data_ptr() for kt in fresh_layers for p in kt.lora_parameters()]
    load_adapter(fresh, tmp_path / "adapter")
    assert [p.data_ptr() for kt in fresh_layers for p in kt.lora_parameters()] == before  # in place
    with torch.no_grad():
        got = fresh(input_ids=ids).logits
    assert torch.equal(got, want)

    other = tiny_model()
    attach(other, lora_rank=2 * R, lora_alpha=ALPHA, cpuinfer_threads=2, max_tokens=64)
    with pytest.raises(ValueError, match="adapter r is 4, the attached model's is 8"):
        load_adapter(other, tmp_path / "adapter")
    with pytest.raises(ValueError, match="call kt_kernel.sft.attach"):
        save_adapter(tiny_model(), tmp_path / "none")
    # A write that fails half way leaves no adapter file behind, whole or partial.
    blocked = tmp_path / "blocked"
    (blocked / "adapter_config.json").mkdir(parents=True)
    with pytest.raises(IsADirectoryError):
        save_adapter(trained, blocked)
    assert {p.name for p in blocked.iterdir()} == {"adapter_config.json"}
