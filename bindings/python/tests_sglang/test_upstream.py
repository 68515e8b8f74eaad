"""Upstream SGLang 0.5.23's `KTEPWrapperMethod` over this package: it passes
`num_gpu_experts=N` (experts below N on the GPU) and no mask, which KT-Kernel 0.7.2 rejects
with a TypeError. Several layers, token counts across the chunk, deferred experts."""

import os
import types

import pytest
import torch

from conftest import E, H, I, K, LAYERS, LIMITS, check_step, moe

if not os.path.isfile(os.path.join(os.environ["KT_SGLANG_ROOT"], "sglang/srt/arg_groups/overrides.py")):
    pytest.skip("KT_SGLANG_ROOT is not upstream sglang 0.5.23", allow_module_level=True)

import sglang.srt.eplb.expert_location_dispatch as location  # noqa: E402
import sglang.srt.layers.moe.kt_ep_wrapper as kt_ep  # noqa: E402
from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput  # noqa: E402
from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase  # noqa: E402


class GpuMoe(FusedMoEMethodBase):
    """Stands in for the GPU method SGLang wraps: its experts (the ids it is given, CPU ones
    masked to -1 by the wrapper) in torch fp32."""

    def __init__(self, weights):
        self.weights = weights

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, **kw):
        self.num_experts = num_experts

    def create_moe_runner(self, layer, moe_runner_config):
        pass

    def apply(self, layer, dispatch_output):
        x, topk = dispatch_output.hidden_states, dispatch_output.topk_output
        assert bool((topk.topk_ids < self.num_experts).all()), "a CPU expert reached the GPU method"
        out = moe(x, topk.topk_ids, topk.topk_weights, self.weights[layer.layer_idx], lambda e: True)
        return StandardCombineInput(hidden_states=out.to(x.dtype))


def build(path, weights, method, num_gpu, deferred):
    identity = torch.arange(E).repeat(LAYERS, 1)
    location.get_global_expert_location_metadata = lambda: types.SimpleNamespace(physical_to_logical_map_cpu=identity)
    kt_ep.get_parallel = lambda: types.SimpleNamespace(tp_rank=0)
    layers = []
    for li in range(LAYERS):
        cfg = kt_ep.KTConfig(layer_idx=li, num_gpu_experts=num_gpu, cpuinfer_threads=2, threadpool_count=1,
                             weight_path=path, chunked_prefill_size=64, max_deferred_experts_per_token=deferred,
                             method=method, num_layers=LAYERS)
        m = kt_ep.KTEPWrapperMethod(GpuMoe(weights), cfg)
        layer = torch.nn.Module()
        layer.layer_idx, layer.top_k, layer.intermediate_size_per_partition, layer.moe_tp_size = li, K, I, 1
        m.create_weights(layer, E, H, I, torch.bfloat16)
        m.process_weights_after_loading(layer)
        m.create_moe_runner(layer, types.SimpleNamespace(activation="silu", num_local_experts=E))
        layers.append((m, layer))
    return layers


@pytest.mark.parametrize("method", list(LIMITS))
@pytest.mark.parametrize("num_gpu,deferred", [(3, None), (0, None), (2, 1)])
def test_layers_match_a_torch_moe(model, method, num_gpu, deferred):
    path, weights = model
    layers = build(path, weights, method, num_gpu, deferred)
    g = torch.Generator().manual_seed(num_gpu)
    for n in (1, 5, 64):
        check_step(layers, weights, n, g, deferred, LIMITS[method], method)
