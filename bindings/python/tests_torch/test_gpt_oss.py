"""gpt-oss's experts (MXFP4 blocks with interleaved gate/up rows and biases, and the same
dequantized to bf16) loaded by `KTMoEWrapper.load_weights` from checkpoints written by
`safetensors.torch`, against transformers' own `GptOssExperts` on the weights its own MXFP4
decoder (`convert_moe_packed_tensors`) gives: layout, nibble order, interleaving, biases and the
clamped activation (`swiglu_alpha` 1.702, `swiglu_limit` 7) checked by the model's own code."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402
from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts  # noqa: E402

from kt_kernel import KTMoEWrapper  # noqa: E402

E, K, H, I = 8, 2, 160, 96  # H and I multiples of 32 only, as gpt-oss's 2880


def mx_experts(g, rows, cols):
    """Random e2m1 blocks `[E, rows, cols/32, 16]` and e8m0 scales of unit-sized dot products."""
    blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 122, (E, rows, cols // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """An MXFP4 checkpoint, its bf16 dequantization (HF's `[E, H, 2I]` / `[E, I, H]` layout),
    and the transformers module on those weights."""
    g = torch.Generator().manual_seed(0)
    gu_b, gu_s = mx_experts(g, 2 * I, H)
    d_b, d_s = mx_experts(g, H, I)
    gu_bias = (torch.randn(E, 2 * I, generator=g) * 0.5).to(torch.bfloat16)
    d_bias = (torch.randn(E, H, generator=g) * 0.1).to(torch.bfloat16)
    p = "model.layers.0.mlp.experts"
    cfg = transformers.GptOssConfig(num_local_experts=E, num_experts_per_tok=K, hidden_size=H, intermediate_size=I,
                                    num_hidden_layers=1)
    dirs = {}
    mx = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    save_file({f"{p}.gate_up_proj_blocks": gu_b, f"{p}.gate_up_proj_scales": gu_s, f"{p}.gate_up_proj_bias": gu_bias,
               f"{p}.down_proj_blocks": d_b, f"{p}.down_proj_scales": d_s, f"{p}.down_proj_bias": d_bias},
              str(mx / "model.safetensors"))
    experts = GptOssExperts(cfg)
    with torch.no_grad():
        experts.gate_up_proj.copy_(convert_moe_packed_tensors(gu_b, gu_s, dtype=torch.float32))
        experts.down_proj.copy_(convert_moe_packed_tensors(d_b, d_s, dtype=torch.float32))
        experts.gate_up_proj_bias.copy_(gu_bias.float())
        experts.down_proj_bias.copy_(d_bias.float())
    dense = tmp_path_factory.mktemp("gpt-oss-bf16")
    save_file({f"{p}.gate_up_proj": experts.gate_up_proj.detach().to(torch.bfloat16).contiguous(),
               f"{p}.gate_up_proj_bias": gu_bias, f"{p}.down_proj": experts.down_proj.detach().to(torch.bfloat16).contiguous(),
               f"{p}.down_proj_bias": d_bias}, str(dense / "model.safetensors"))
    for d in (mx, dense):
        (d / "config.json").write_text(json.dumps(cfg.to_dict()))
    dirs["mxfp4"], dirs["bf16"] = str(mx), str(dense)
    unbiased = GptOssExperts(cfg)
    unbiased.load_state_dict({**experts.state_dict(), "gate_up_proj_bias": torch.zeros(E, 2 * I),
                              "down_proj_bias": torch.zeros(E, H)})
    return dirs, experts, unbiased


def ours(path, method, parts=1):
    w = KTMoEWrapper(layer_idx=0, num_experts=E, num_experts_per_tok=K, hidden_size=H, moe_intermediate_size=I,
                     gpu_experts_mask=None, cpuinfer_threads=2, threadpool_count=parts, weight_path=path,
                     chunked_prefill_size=64, method=method, swiglu_alpha=1.702, swiglu_limit=7.0)
    w.load_weights()
    return w


def rel_err(a, b):
    return float((a.float() - b).abs().mean() / b.abs().mean())


# KT takes swiglu_alpha/swiglu_limit with MXFP4 and MXFP8 only (MXFP8: bf16 activations, so tighter).
@pytest.mark.parametrize("checkpoint,method,limit", [("mxfp4", "MXFP4", 0.03), ("mxfp4", "MXFP8", 0.01),
                                                     ("bf16", "MXFP4", 0.03)])
@pytest.mark.parametrize("parts", [1, 2])
def test_gpt_oss_experts_match_transformers(gpt_oss, checkpoint, method, limit, parts):
    dirs, experts, unbiased = gpt_oss
    w = ours(dirs[checkpoint], method, parts)
    g = torch.Generator().manual_seed(1)
    for n in (1, 7, 40):
        x = torch.randn(n, H, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
        wts = torch.softmax(torch.randn(n, K, generator=g), -1)
        with torch.no_grad():
            want, without = experts(x.float(), ids, wts), unbiased(x.float(), ids, wts)
        got = w.forward(x, ids, wts)
        assert rel_err(got, want) < limit, f"{checkpoint} {method} n={n}"
        # Not vacuous: the biases move the output far more than the limit.
        assert rel_err(without, want) > 10 * limit


def test_paths_without_biases_refuse_gpt_oss(gpt_oss):
    """SFT layers, layerwise prefill buffers: a clear error naming the biases."""
    from kt_kernel.sft import SFTMoEWrapper

    dirs = gpt_oss[0]
    sft = SFTMoEWrapper(layer_idx=0, num_experts=E, num_experts_per_tok=K, hidden_size=H, moe_intermediate_size=I,
                        num_gpu_experts=0, cpuinfer_threads=2, threadpool_count=1, weight_path=dirs["mxfp4"],
                        chunked_prefill_size=64, method="AMXBF16_SFT", lora_rank=4, lora_alpha=8.0)
    with pytest.raises(ValueError, match="biases"):
        sft.load_weights()
    w = ours(dirs["mxfp4"], "MXFP4")
    buf = torch.zeros(4 * H * I, dtype=torch.uint8)
    p = buf.data_ptr()
    w.submit_write_weight_scale_to_buffer(1, 0, [p], [p], [p], [p])
    with pytest.raises(ValueError, match="biases"):
        w.sync_write_weight_scale_to_buffer()
