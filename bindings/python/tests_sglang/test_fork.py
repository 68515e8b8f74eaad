"""KT's fork (sglang-kt 0.7.2): its `KTEPWrapperMethod` with a GPU-expert mask (experts
anywhere in the id range on the GPU, their ids remapped to GPU slots), its CPU stream and
staging buffer, deferred experts, and the mask updated in place between steps."""

import json
import os
import pathlib
import types

import pytest
import torch

from conftest import E, H, I, K, LAYERS, LIMITS, check_step, clamped_glu, moe, rel_err

if not os.path.isdir(os.path.join(os.environ["KT_SGLANG_ROOT"], "sglang_kt_sgl_kernel_payload")):
    pytest.skip("KT_SGLANG_ROOT is not KT's fork sglang-kt 0.7.2", allow_module_level=True)


class _Stream:
    """Stands in for torch.cuda.Stream: work on it runs in order on the CPU."""

    cuda_stream = 0

    def __init__(self, *a, **k):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return event or _Event()


class _Event:
    """Stands in for torch.cuda.Event."""

    def __init__(self, *a, **k):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _StreamContext:
    def __init__(self, stream):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


torch.cuda.Stream, torch.cuda.Event, torch.cuda.stream = _Stream, _Event, _StreamContext
torch.cuda.current_stream = lambda *a, **k: _Stream()

import sglang.srt.distributed.parallel_state as parallel_state  # noqa: E402
import sglang.srt.eplb.expert_location_dispatch as location  # noqa: E402
import sglang.srt.layers.moe.kt_ep_wrapper as kt_ep  # noqa: E402
from sglang.srt.layers.moe.fused_moe_triton import FusedMoE  # noqa: E402
from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig  # noqa: E402
from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput  # noqa: E402
from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase  # noqa: E402


FP4 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


# What `marlin_permute_scales` (SGLang's own, run by the fork's int4 layerwise pipeline) did to a
# scale tensor of each shape: its element j is the input's `MARLIN_SCALES[shape][j]`.
MARLIN_SCALES = {}


def dequantized(layer, name):
    """A GPU weight as fp32 `[E, rows, cols]`: bf16; fp8 e4m3 times its `_scale_inv`: f32
    128×128 blocks, or MXFP8's e8m0 codes (uint8) per 32 columns of a row; V4-Flash's MXFP4
    (int8 pairs of e2m1, the even column low) times its f32 scale per 32 columns; or, in a
    compressed-tensors int4 layer, `_packed`: GPTQ's `[E, K/8, N]` int32 (8 nibbles along K,
    the low first, each holding q + 8: what `gptq_marlin_repack` takes, which the tests stand in
    by the identity) times the bf16 `_scale` `[E, K/g, N]` after `marlin_permute_scales`."""
    if hasattr(layer, name + "_packed"):
        s = getattr(layer, name + "_scale")
        # (The fork views the repacked words in Marlin's shape, `[E, K/16, 2N]`.)
        words = getattr(layer, name + "_packed").reshape(s.shape[0], -1, s.shape[2])
        q = torch.stack([(words >> (4 * j)) & 15 for j in range(8)], 2).flatten(1, 2) - 8  # [E, K, N]
        order = MARLIN_SCALES[tuple(s.shape[1:])]
        s = s.flatten(1)[:, torch.argsort(order)].reshape(s.shape).float()
        return (q.float() * s.repeat_interleave(q.shape[1] // s.shape[1], 1)).transpose(1, 2)
    w, s = getattr(layer, name), getattr(layer, name + "_scale_inv", None)
    if s is None and w.dtype == torch.float8_e4m3fn:
        return w.float() * getattr(layer, name + "_scale")  # one f32 scale a row, [E, rows, 1]
    if w.dtype == torch.int8:
        b = w.view(torch.uint8).long()
        v = torch.stack([FP4[b & 15], FP4[b >> 4]], -1).flatten(-2)
        return v * s.float().repeat_interleave(32, -1)
    w = w.float()
    if s is None:
        return w
    if s.dtype == torch.uint8:
        return w * (2.0 ** (s.float() - 127)).repeat_interleave(32, -1)
    return w * s.repeat_interleave(128, -2).repeat_interleave(128, -1)


def layer_moe(layer, dispatch_output):
    """The GPU MoE kernel's result, in torch fp32 from the layer's own weights: slot `s` of
    `layer.w13_weight` (gate rows then up rows) and `layer.w2_weight` serves id `s`, -1 none."""
    x, topk = dispatch_output.hidden_states, dispatch_output.topk_output
    w13, w2 = dequantized(layer, "w13_weight"), dequantized(layer, "w2_weight")
    w = {"gate": w13[:, :I], "up": w13[:, I:], "down": w2}
    if hasattr(layer, "w13_weight_bias"):
        b = layer.w13_weight_bias
        w.update(gate_bias=b[:, :I], up_bias=b[:, I:], down_bias=layer.w2_weight_bias)
    runner = layer.moe_runner_config
    if runner.gemm1_alpha is not None:
        w["glu"] = clamped_glu(runner.gemm1_alpha, runner.gemm1_clamp_limit)
    return StandardCombineInput(hidden_states=moe(x, topk.topk_ids, topk.topk_weights, w, lambda e: True).to(x.dtype))


class GpuMoe(FusedMoEMethodBase):
    """Stands in for the GPU method the fork wraps: its weights for the GPU experts (bf16, as
    SGLang's loader leaves them) and its kernel (`layer_moe`) over the ids the wrapper remapped
    to GPU slots (CPU ones -1), each slot's logical expert read from the mask."""

    def __init__(self, weights, mask):
        self.weights, self.mask = weights, mask

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, **kw):
        layer.register_parameter("w13_weight", torch.nn.Parameter(torch.empty(num_experts, 2 * I, H, dtype=params_dtype),
                                                                  requires_grad=False))
        layer.register_parameter("w2_weight", torch.nn.Parameter(torch.empty(num_experts, H, I, dtype=params_dtype),
                                                                 requires_grad=False))
        self.load_gpu_experts(layer)

    def load_gpu_experts(self, layer):
        """What SGLang's weight loader puts in the GPU slots: the mask's experts in id order, in
        bf16 or the model's own GPU encoding (`gpu`), and their biases for a model with them."""
        w, logical = self.weights[layer.layer_idx], torch.where(self.mask)[0]
        if "gpu" in w:
            for name, t in w["gpu"].items():
                setattr(layer, name, torch.nn.Parameter(t[logical], requires_grad=False))
            return
        layer.w13_weight.data = torch.cat([w["gate"][logical], w["up"][logical]], 1).to(layer.w13_weight.dtype)
        layer.w2_weight.data = w["down"][logical].to(layer.w2_weight.dtype)
        if "gate_bias" in w:
            layer.w13_weight_bias = torch.cat([w["gate_bias"][logical], w["up_bias"][logical]], 1)
            layer.w2_weight_bias = w["down_bias"][logical]

    def create_moe_runner(self, layer, moe_runner_config):
        pass

    def apply(self, layer, dispatch_output):
        return layer_moe(layer, dispatch_output)


# The merge keeps the CPU result alive on the GPU stream (CUDA's caching allocator): nothing
# to keep alive on the CPU.
torch.Tensor.record_stream = lambda self, stream: None


def build(path, weights, method, mask, deferred, threshold=None, quant_config=None, runner=None):
    identity = torch.arange(E).repeat(LAYERS, 1)
    location.get_global_expert_location_metadata = lambda: types.SimpleNamespace(physical_to_logical_map_cpu=identity)
    parallel_state._TP = types.SimpleNamespace(world_size=1, rank_in_group=0)  # one tensor-parallel rank
    layers = []
    for li in range(LAYERS):
        cfg = kt_ep.KTConfig(layer_idx=li, gpu_experts_mask=mask.clone(), cpuinfer_threads=2, threadpool_count=1,
                             weight_path=path, chunked_prefill_size=64, max_deferred_experts_per_token=deferred,
                             method=method, num_layers=LAYERS, gpu_prefill_token_threshold=threshold)
        gpu = GpuMoe(weights, cfg.gpu_experts_mask)
        m = kt_ep.KTEPWrapperMethod(gpu, cfg)
        # The model's FusedMoE layer, without its constructor (which needs the launcher's
        # distributed state): what the fork's full-layer context copies and quantizes.
        layer = FusedMoE.__new__(FusedMoE)
        torch.nn.Module.__init__(layer)
        layer.layer_idx, layer.top_k, layer.num_experts = li, K, E
        layer.intermediate_size_per_partition, layer.moe_tp_size = I, 1
        layer.quant_config, layer.use_triton_kernels = quant_config, False
        layer.moe_runner_config = MoeRunnerConfig(activation="silu", num_experts=E, top_k=K, **(runner or {}))
        m.create_weights(layer, E, H, I, torch.bfloat16)
        m.process_weights_after_loading(layer)
        m.create_moe_runner(layer, layer.moe_runner_config)
        layers.append((m, layer))
    return layers


def move_experts(m, layer, on_gpu):
    """What the fork's dynamic expert update does to a layer: new mappings, the wrapper's mask
    updated in place (KT reads it by pointer), the new GPU experts' weights in the GPU slots."""
    mask, to_gpu, _ = kt_ep.update_gpu_expert_mappings(on_gpu, E, torch.device("cpu"))
    kt_ep.update_kt_wrapper_masks(m.wrapper, mask)
    m.gpu_experts_mask.copy_(mask)
    m.gpu_experts_mask_cuda, m.logical_to_gpu_index_cuda = mask.clone(), to_gpu
    m.logical_to_gpu_index = to_gpu.clone()
    m.gpu_method.load_gpu_experts(layer)


@pytest.mark.parametrize("method", list(LIMITS))
@pytest.mark.parametrize("gpu_ids,deferred", [([1, 4, 6], None), ([], None), ([0, 7], 1)])
def test_layers_match_a_torch_moe(model, method, gpu_ids, deferred):
    """`check_step` at several token counts; before the third step the GPU experts move, the
    mask updated in place."""
    path, weights = model
    mask = torch.zeros(E, dtype=torch.bool)
    mask[gpu_ids] = True
    layers = build(path, weights, method, mask, deferred)
    g = torch.Generator().manual_seed(len(gpu_ids))
    for step, n in enumerate((1, 5, 64, 3)):
        if step == 2 and gpu_ids:
            for m, layer in layers:
                move_experts(m, layer, torch.tensor(sorted({(i + 3) % E for i in gpu_ids})))
        check_step(layers, weights, n, g, deferred, LIMITS[method], f"{method} step {step}")


@pytest.fixture
def full_gpu_layers(monkeypatch):
    """The fork's layerwise prefill (`--kt-gpu-prefill-token-threshold`) with SGLang's own
    full-layer context (`SharedFullContext`: its unquantized GPU method's weights, its
    double-buffered shared-memory host buffers, its write/copy pipeline over our
    `submit_write_weight_scale_to_buffer`); stood in: that method's GPU kernel (`layer_moe`
    over the weights the context copied: the token counts it was called with, and its
    results). The context is a process-wide singleton, fresh for each test; the fork pins the
    calling thread to one core while it writes, undone after."""
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsFusedMoEMethod
    from sglang.srt.layers.quantization.fp8 import Fp8MoEMethod
    from sglang.srt.layers.quantization.mxfp4_deepseek import DeepSeekMxfp4MoEMethod
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod

    calls, outputs = [], []

    def full_layer(self, layer, dispatch_output):
        calls.append(dispatch_output.hidden_states.shape[0])
        outputs.append(layer_moe(layer, dispatch_output))
        return outputs[-1]

    for gpu_method in (UnquantizedFusedMoEMethod, Fp8MoEMethod, DeepSeekMxfp4MoEMethod, CompressedTensorsFusedMoEMethod):
        monkeypatch.setattr(gpu_method, "apply", full_layer)
        # The GPU kernels' own weight preparation (DeepGEMM's scale layout, triton_kernels'
        # swizzle, Marlin's repack), run on every load.
        monkeypatch.setattr(gpu_method, "process_weights_after_loading", lambda self, layer: None)
    # The int4 pipeline's per-expert Marlin repack (a CUDA kernel): the identity, so the layer
    # keeps the GPTQ layout it is given; its scale permutation is SGLang's own, recorded.
    monkeypatch.setattr(kt_ep, "gptq_marlin_repack", lambda w, perm, k, n, bits: w, raising=False)
    permute = kt_ep.marlin_permute_scales

    def marlin_permute_scales(s, *args):
        MARLIN_SCALES[tuple(s.shape)] = permute(torch.arange(s.numel()).reshape(s.shape), *args).flatten()
        return permute(s, *args)

    monkeypatch.setattr(kt_ep, "marlin_permute_scales", marlin_permute_scales)
    monkeypatch.setattr(kt_ep, "_SHARED_FULL_CONTEXT", None)
    cpus = os.sched_getaffinity(0)
    yield calls, outputs
    os.sched_setaffinity(0, cpus)
    kt_ep._SHARED_FULL_CONTEXT = None


def fp8_checkpoint(d, block, seed):
    """An fp8 checkpoint of `LAYERS` layers with power-of-two scales per `block` (rows, cols):
    (128, 128), DeepSeek-V3's f32 `weight_scale_inv`; (1, 32), MXFP8's e8m0 codes (uint8, the
    fork's MiniMax-M3); or (1, 0), one f32 `weight_scale` `[rows, 1]` a row in a
    compressed-tensors "float-quantized" model (channel strategy); and its values (exact in
    fp32 and bf16)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors, layers, per_row = {}, [], block == (1, 0)
    for li in range(LAYERS):
        values = {}
        for p, (rows, cols) in {"gate": (I, H), "up": (I, H), "down": (H, I)}.items():
            br, bc = (1, cols) if per_row else block
            wide = lambda t: t.repeat_interleave(br, 1).repeat_interleave(bc, 2)  # noqa: E731
            # Each block's magnitude its own (×2^-2..2^2), so are its scales.
            spread = 2.0 ** torch.randint(-2, 3, (E, rows // br, cols // bc), generator=g).float()
            w = torch.randn(E, rows, cols, generator=g) / cols**0.5 * wide(spread)
            s = 2.0 ** torch.ceil(torch.log2(w.abs().reshape(E, rows // br, br, cols // bc, bc).amax((2, 4)) / 448))
            codes = (w / wide(s)).to(torch.float8_e4m3fn)
            values[p] = codes.float() * wide(s)
            stored = s if block != (1, 32) else (torch.log2(s) + 127).to(torch.uint8)
            scale = "weight_scale" if per_row else "weight_scale_inv"
            for x in range(E):
                stem = f"model.layers.{li}.mlp.experts.{x}.{p}_proj"
                tensors[f"{stem}.weight"], tensors[f"{stem}.{scale}"] = codes[x].contiguous(), stored[x].contiguous()
        layers.append(values)
    save_file(tensors, str(d / "model.safetensors"))
    cfg = {"num_experts": E, "num_experts_per_tok": K, "hidden_size": H, "moe_intermediate_size": I,
           "num_hidden_layers": LAYERS}
    if per_row:
        fp8 = {"type": "float", "num_bits": 8, "symmetric": True}
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**fp8, "strategy": "channel", "dynamic": False},
                                          "input_activations": {**fp8, "strategy": "token", "dynamic": True}}}}
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d), layers


def v4_checkpoint(d, shape, layers, seed):
    """A DeepSeek-V4-Flash MXFP4 checkpoint (`layers.L.ffn.experts.e.{w1,w3,w2}`: int8 pairs of
    e2m1, the even column low, and F8_E8M0 `scale` per 32 columns; every block holds a ±6, so
    MXFP4 requantizes it exactly) of experts `shape` (E, H, I) in `layers`, written by
    `safetensors.torch`; its values by layer."""
    from safetensors.torch import save_file

    (e, h, i), g = shape, torch.Generator().manual_seed(seed)
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    tensors, values = {}, {}
    for li in layers:
        values[li], stored = {}, {}
        for p, w, rows, cols in [("gate", "w1", i, h), ("up", "w3", i, h), ("down", "w2", h, i)]:
            c = torch.randint(0, 16, (e, rows, cols), generator=g, dtype=torch.uint8)
            c[..., ::32] = 7
            x = torch.randint(121, 125, (e, rows, cols // 32), generator=g, dtype=torch.uint8)
            values[li][p] = FP4[c.long()] * (2.0 ** (x.float() - 127)).repeat_interleave(32, dim=-1)
            packed = (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)
            stored[p] = (packed, 2.0 ** (x.float() - 127))
            for x_ in range(e):
                tensors[f"layers.{li}.ffn.experts.{x_}.{w}.weight"] = packed[x_].contiguous()
                tensors[f"layers.{li}.ffn.experts.{x_}.{w}.scale"] = x[x_].view(e8m0) if e8m0 else x[x_]
        # What SGLang's loader puts in a V4 GPU layer: the packed pairs, f32 scales.
        (gw, gs), (uw, us), (dw, ds) = stored["gate"], stored["up"], stored["down"]
        values[li]["gpu"] = {"w13_weight": torch.cat([gw, uw], 1), "w13_weight_scale_inv": torch.cat([gs, us], 1),
                             "w2_weight": dw, "w2_weight_scale_inv": ds}
    save_file(tensors, str(d / "model.safetensors"))
    return values


@pytest.fixture(scope="module")
def v4_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("v4-flash")
    values = v4_checkpoint(d, (E, H, I), range(LAYERS), 15)
    cfg = {"n_routed_experts": E, "num_experts_per_tok": K, "hidden_size": H, "moe_intermediate_size": I,
           "num_hidden_layers": LAYERS}
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d), [values[li] for li in range(LAYERS)]


def int4_checkpoint(d, seed):
    """A compressed-tensors int4 checkpoint (Kimi-K2's "pack-quantized": `weight_packed` int32
    of 8 nibbles q + 8 along a row, the low first, bf16 `weight_scale` per 32 columns) of
    `LAYERS` layers, written by `safetensors.torch`; its values by layer."""
    from safetensors.torch import save_file

    g, tensors, layers = torch.Generator().manual_seed(seed), {}, []
    for li in range(LAYERS):
        values = {}
        for p, (rows, cols) in {"gate": (I, H), "up": (I, H), "down": (H, I)}.items():
            q = torch.randint(-7, 8, (E, rows, cols), generator=g)
            s = (torch.rand(E, rows, cols // 32, generator=g) * 2 + 1).div(7 * cols**0.5).to(torch.bfloat16)
            values[p] = q.float() * s.float().repeat_interleave(32, -1)
            words = sum((q[..., j::8] + 8).to(torch.int32) << (4 * j) for j in range(8))
            for x in range(E):
                stem = f"model.layers.{li}.mlp.experts.{x}.{p}_proj"
                tensors[f"{stem}.weight_packed"], tensors[f"{stem}.weight_scale"] = words[x].contiguous(), s[x].contiguous()
        layers.append(values)
    save_file(tensors, str(d / "model.safetensors"))
    scheme = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 32, "dynamic": False,
              "symmetric": True, "actorder": None}
    quant = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
             "config_groups": {"group_0": {"weights": scheme, "targets": ["Linear"]}}}
    cfg = {"num_experts": E, "num_experts_per_tok": K, "hidden_size": H, "moe_intermediate_size": I,
           "num_hidden_layers": LAYERS, "quantization_config": quant}
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d), layers


@pytest.fixture(scope="module")
def int4_model(tmp_path_factory):
    return int4_checkpoint(tmp_path_factory.mktemp("int4-moe"), 16)


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    return fp8_checkpoint(tmp_path_factory.mktemp("fp8-moe"), (128, 128), 11)


@pytest.fixture(scope="module")
def fp8_channel_model(tmp_path_factory):
    return fp8_checkpoint(tmp_path_factory.mktemp("fp8-channel-moe"), (1, 0), 17)


@pytest.fixture(scope="module")
def mxfp8_model(tmp_path_factory):
    return fp8_checkpoint(tmp_path_factory.mktemp("mxfp8-moe"), (1, 32), 14)


def compressed_tensors(path):
    """SGLang's quantization config of a compressed-tensors model (the `quantization_config` of
    its `config.json`)."""
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    config = json.loads((pathlib.Path(path) / "config.json").read_text())["quantization_config"]
    return CompressedTensorsConfig.from_config(config)


@pytest.mark.parametrize("method,checkpoint", [(m, "bf16") for m in LIMITS]
                         + [("FP8", "fp8"), ("FP8_PERCHANNEL", "fp8-channel"), ("MXFP8", "mxfp8"), ("MXFP4", "v4")])
def test_layerwise_prefill_runs_the_layer_from_our_writes(request, monkeypatch, method, checkpoint, full_gpu_layers):
    """Steps at and above the threshold run every expert of each layer on the "GPU" from the
    bytes our wrapper wrote in the checkpoint's encoding (bf16 whatever the CPU method, or the
    fp8 models' e4m3 bytes with their block scales or MXFP8 codes, or V4-Flash's e2m1 pairs with
    their scales staged as bf16: so their error is the output's bf16 rounding, far under the
    CPU method's), steps below it the hybrid path; the GPU experts move between steps (which
    the context copies from the original layer's slots for a bf16 model). V4-Flash's GPU method
    is the fork's `DeepSeekMxfp4MoEMethod`, which it wraps around the FP8 one when asked
    (`SGLANG_V4_USE_TRITON_KERNELS=1`; the server's MXFP4 precision stood in)."""
    import sglang.srt.layers.quantization.mxfp4_deepseek as mxfp4_deepseek
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    fixture = {"bf16": "model", "fp8": "fp8_model", "fp8-channel": "fp8_channel_model", "mxfp8": "mxfp8_model",
               "v4": "v4_model"}[checkpoint]
    path, weights = request.getfixturevalue(fixture)
    block_fp8 = Fp8Config(is_checkpoint_fp8_serialized=True, weight_block_size=[128, 128])
    quant = {"bf16": None, "fp8": block_fp8, "v4": block_fp8,
             "mxfp8": Fp8Config(is_checkpoint_fp8_serialized=True, use_mxfp8=True)}.get(checkpoint)
    if checkpoint == "fp8-channel":
        quant = compressed_tensors(path)
    if checkpoint == "v4":
        monkeypatch.setenv("SGLANG_V4_USE_TRITON_KERNELS", "1")
        server = types.SimpleNamespace(flashinfer_mxfp4_moe_precision="default")
        monkeypatch.setattr(mxfp4_deepseek, "get_global_server_args", lambda: server)
    mask = torch.zeros(E, dtype=torch.bool)
    mask[[2, 5]] = True
    layers = build(path, weights, method, mask, None, threshold=32, quant_config=quant)
    g = torch.Generator().manual_seed(3)
    for step, n in enumerate((40, 5, 64, 31)):
        if step == 2:
            for m, layer in layers:
                move_experts(m, layer, torch.tensor([0, 5, 6]))
        full = n >= 32
        check_step(layers, weights, n, g, None, 0.005 if full else LIMITS[method], f"{method} step {step}")
        calls, outputs = full_gpu_layers
        assert calls == ([n] * LAYERS if full else []), f"step {step}: {calls}"
        calls.clear()
        outputs.clear()


def test_int4_layerwise_prefill_reads_our_writes_until_the_forks_own_restore_fails(int4_model, full_gpu_layers):
    """A compressed-tensors int4 model (Kimi-K2's RAWINT4) with a threshold of 32 tokens: below
    it the hybrid path; at 40 tokens the fork's int4 pipeline (`_prepare_weight_int4`: our
    writes into its shared-memory double buffers, its per-expert transpose to GPTQ's `[K/8, N]`,
    Marlin's repack (the identity here) and SGLang's own `marlin_permute_scales`) fills the
    full layer, whose output (the stood-in kernel's, from those weights) is the fp32 MoE's to
    bf16 rounding. Then the fork itself fails: `_restore_raw_attrs` remakes the int32 weight
    its Marlin view reshaped as an `nn.Parameter` that requires grad, which torch refuses for
    integers (sglang-kt 0.7.2, whatever CPU package; KT-Kernel's wrapper meets the same)."""
    from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatchOutput
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    path, weights = int4_model
    mask = torch.zeros(E, dtype=torch.bool)
    mask[[2, 5]] = True
    layers = build(path, weights, "RAWINT4", mask, None, threshold=32, quant_config=compressed_tensors(path))
    g = torch.Generator().manual_seed(5)
    check_step(layers, weights, 7, g, None, 0.04, "RAWINT4 hybrid step")
    (m, layer), calls, outputs = layers[0], *full_gpu_layers
    assert calls == []
    x = torch.randn(40, H, generator=g).to(torch.bfloat16)
    logits = torch.randn(40, E, generator=g)
    w, ids = torch.topk(torch.softmax(logits, -1), K)
    ids = ids.to(torch.int32)
    want = moe(x, ids.clone(), w, weights[0], lambda e: True)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="floating point and complex dtype can require"):
        m.apply(layer, StandardDispatchOutput(x, None, StandardTopKOutput(w, ids, logits)))
    assert calls == [40]
    assert rel_err(outputs[0].hidden_states.float(), want) < 0.005


@pytest.fixture(scope="module")
def gpt_oss_model(tmp_path_factory):
    """A gpt-oss MXFP4 checkpoint of `LAYERS` layers (fused e2m1 blocks and e8m0 scales, gate's
    and up's rows interleaved, bf16 expert biases), written by `safetensors.torch`, and its
    values (exact in fp32 and bf16) with the model's clamped activation."""
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("gpt-oss")
    g = torch.Generator().manual_seed(12)
    tensors, layers = {}, []

    def mx(p, rows, cols):
        b = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
        s = torch.randint(119, 123, (E, rows, cols // 32), generator=g, dtype=torch.uint8)
        tensors[f"{p}_blocks"], tensors[f"{p}_scales"] = b, s
        v = torch.stack([FP4[(b & 15).long()], FP4[(b >> 4).long()]], -1).reshape(E, rows, cols // 32, 32)
        return (v * 2.0 ** (s.float() - 127)[..., None]).reshape(E, rows, cols)

    for li in range(LAYERS):
        p = f"model.layers.{li}.mlp.experts"
        gu, down = mx(f"{p}.gate_up_proj", 2 * I, H), mx(f"{p}.down_proj", H, I)
        gu_bias = (torch.randn(E, 2 * I, generator=g) * 0.5).to(torch.bfloat16)
        tensors[f"{p}.gate_up_proj_bias"] = gu_bias
        tensors[f"{p}.down_proj_bias"] = (torch.randn(E, H, generator=g) * 0.1).to(torch.bfloat16)
        layers.append({"gate": gu[:, 0::2], "up": gu[:, 1::2], "down": down, "gate_bias": gu_bias[:, 0::2].float(),
                       "up_bias": gu_bias[:, 1::2].float(), "down_bias": tensors[f"{p}.down_proj_bias"].float(),
                       "glu": clamped_glu(1.702, 7.0)})
    save_file(tensors, str(d / "model.safetensors"))
    cfg = {"num_local_experts": E, "num_experts_per_tok": K, "hidden_size": H, "intermediate_size": I,
           "num_hidden_layers": LAYERS, "swiglu_limit": 7.0}
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d), layers


def test_gpt_oss_experts_run_through_the_forks_wrapper(gpt_oss_model):
    """The fork wraps every FusedMoE, gpt-oss's too: with `--kt-method MXFP4` its wrapper passes
    the model's `gemm1_alpha`/`gemm1_clamp_limit` as `swiglu_alpha`/`swiglu_limit` and calls
    `load_weights` on the checkpoint, whose CPU experts then run with their biases (which
    KT-Kernel's own MoE has no place for), GPU experts beside them, the mask moved between
    steps."""
    path, weights = gpt_oss_model
    mask = torch.zeros(E, dtype=torch.bool)
    mask[[1, 6]] = True
    layers = build(path, weights, "MXFP4", mask, None, runner={"gemm1_alpha": 1.702, "gemm1_clamp_limit": 7.0})
    g = torch.Generator().manual_seed(13)
    for step, n in enumerate((1, 5, 33)):
        if step == 2:
            for m, layer in layers:
                move_experts(m, layer, torch.tensor([0, 3]))
        check_step(layers, weights, n, g, None, 0.04, f"gpt-oss step {step}")


def test_expert_lora_adapters_serve_through_the_forks_path(tmp_path):
    """An adapter trained with kt_kernel.sft (attach + save_adapter) read by the fork's
    `--kt-expert-lora-path` loader, then served by the fork's call sequence (SFT wrapper,
    init_lora_weights, submit/sync_forward_inference): the same tensors, and the output of the
    trained layer bit for bit."""
    transformers = pytest.importorskip("transformers")
    import copy

    from kt_kernel import KTMoEWrapper
    from kt_kernel.sft import attach, save_adapter

    cfg = transformers.Qwen3MoeConfig(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      num_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).float()
    base = copy.deepcopy(model.model.layers[1].mlp.experts)
    layers = attach(model, lora_rank=4, lora_alpha=8.0, cpuinfer_threads=2, max_tokens=64)
    with torch.no_grad():
        for kt in layers:
            for p in kt.lora_parameters():
                p.add_((0.05 * torch.randn(p.shape)).to(p.dtype))
    save_adapter(model, tmp_path)

    lw = kt_ep._load_kt_expert_lora_weights(str(tmp_path), 1, 8, 64, 32)
    names = ["gate_lora_a", "gate_lora_b", "up_lora_a", "up_lora_b", "down_lora_a", "down_lora_b"]
    assert (lw.rank, lw.alpha) == (4, 8.0)
    for n in names:
        assert torch.equal(getattr(lw, n), getattr(layers[1], n).detach()), n

    method = kt_ep._map_kt_method_to_sft_method("BF16")
    kt_ep._validate_kt_sft_runtime(method)
    w = KTMoEWrapper(layer_idx=1, num_experts=8, num_experts_per_tok=2, hidden_size=64, moe_intermediate_size=32,
                     gpu_experts_mask=None, cpuinfer_threads=2, threadpool_count=1, weight_path=None,
                     chunked_prefill_size=64, method=method, mode="sft", num_gpu_experts=0, lora_rank=lw.rank,
                     lora_alpha=lw.alpha, max_cache_depth=1)
    kt_ep._configure_kt_sft_wrapper_for_serving(w, method)
    gate_up = base.gate_up_proj.detach()
    w.load_weights_from_tensors(gate_up[:, :32].contiguous(), gate_up[:, 32:].contiguous(),
                                base.down_proj.detach().contiguous())
    w.init_lora_weights(*[getattr(lw, n) for n in names], *[torch.zeros_like(getattr(lw, n)) for n in names])
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 64, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(7)])
    wts = torch.rand(7, 2, generator=g)
    w.submit_forward_inference(x, ids, wts, 0)
    served = w.sync_forward_inference(0)
    with torch.no_grad():
        trained = layers[1](x, ids, wts)
    assert torch.equal(served.to(torch.bfloat16), trained.to(torch.bfloat16))


def _lora_and_inputs(e, h, i, k, g, rank=4, n=7):
    """Random bf16 LoRA matrices of `rank` for a layer of (e, h, i), and `n` tokens routed to k."""
    shapes = [(e, rank, h), (e, i, rank), (e, rank, h), (e, i, rank), (e, rank, i), (e, h, rank)]
    lora = [(0.05 * torch.randn(*s, generator=g)).to(torch.bfloat16) for s in shapes]
    x = torch.randn(n, h, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    return lora, x, ids, torch.rand(n, k, generator=g)


def _serve(w, lora, x, ids, wts):
    """The fork's serving calls on a loaded SFT wrapper: its output, copied (the staging buffer
    it comes in is reused by the next forward)."""
    w.init_lora_weights(*lora, *[torch.zeros_like(t) for t in lora])
    w.submit_forward_inference(x, ids, wts, 0)
    return w.sync_forward_inference(0).clone()


def test_rawint4_expert_lora_serving_loads_the_checkpoint_as_stored(tmp_path):
    """The fork's `--kt-expert-lora-path` on a compressed-tensors int4 model (method RAWINT4):
    its runtime probe, its checkpoint reader (`_load_rawint4_sft_weights`: our
    `get_rawint4_checkpoint_contract`, `MOEArchConfig`, `load_rawint4_experts_from_checkpoint_files`)
    and `load_rawint4_weights` serve the layer's own nibbles and scales: the output of the same
    layer quantized from their values (which requantize exactly: every group holds a ±7) bit for
    bit. A zero-point scheme is refused."""
    import json

    from safetensors.torch import save_file

    from kt_kernel import KTMoEWrapper

    e, k, h, i, layer = 8, 2, 64, 32, 1
    g = torch.Generator().manual_seed(7)
    tensors, values = {}, {}
    for name, rows, cols in [("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)]:
        q = torch.randint(-7, 8, (e, rows, cols), generator=g)
        q[..., ::32] = 7 * (torch.randint(0, 2, (e, rows, cols // 32), generator=g) * 2 - 1)
        s = (torch.rand(e, rows, cols // 32, generator=g) * 0.015 + 0.005).to(torch.bfloat16)
        values[name] = q.float() * s.float().repeat_interleave(32, dim=-1)
        nib = (q + 8).to(torch.int32)
        words = sum(nib[..., j::8] << (4 * j) for j in range(8))  # 8 nibbles an int32, low first
        for x in range(e):
            stem = f"model.layers.{layer}.mlp.experts.{x}.{name}"
            tensors[f"{stem}.weight_packed"] = words[x].contiguous()
            tensors[f"{stem}.weight_scale"] = s[x].contiguous()
            tensors[f"{stem}.weight_shape"] = torch.tensor([rows, cols], dtype=torch.int64)
    save_file(tensors, str(tmp_path / "model-00001-of-00001.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: "model-00001-of-00001.safetensors" for n in tensors}}))
    scheme = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 32, "dynamic": False,
              "symmetric": True, "actorder": None, "block_structure": None}
    quant = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
             "config_groups": {"group_0": {"weights": scheme, "targets": ["Linear"]}}}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quant}))

    method = kt_ep._map_kt_method_to_sft_method("RAWINT4")
    assert method == "RAWINT4_SFT"
    kt_ep._validate_kt_sft_runtime(method)
    raw = kt_ep._load_rawint4_sft_weights(weight_path=str(tmp_path), layer_idx=layer, num_experts=e, hidden_size=h,
                                          moe_intermediate_size=i, num_experts_per_tok=k)
    shapes = [(ln.shape, ln.dtype) for ln in (raw.gate_proj, raw.gate_scale, raw.down_proj)]
    assert shapes == [((e, i, h // 2), torch.uint8), ((e, i, h // 32), torch.bfloat16), ((e, h, i // 2), torch.uint8)]
    common = dict(layer_idx=layer, num_experts=e, num_experts_per_tok=k, hidden_size=h, moe_intermediate_size=i,
                  gpu_experts_mask=None, cpuinfer_threads=2, threadpool_count=1, weight_path=None,
                  chunked_prefill_size=64, mode="sft", num_gpu_experts=0, lora_rank=4, lora_alpha=8.0)
    lora, x, ids, wts = _lora_and_inputs(e, h, i, k, g)
    outs = []
    for served in (True, False):
        w = KTMoEWrapper(method=method if served else "AMXINT4_KGroup_SFT", group_size=32, **common)
        if served:
            kt_ep._configure_kt_sft_wrapper_for_serving(w, method)
            w.load_rawint4_weights(raw, torch.arange(e))
        else:
            w.load_weights_from_tensors(values["gate_proj"], values["up_proj"], values["down_proj"])
        outs.append(_serve(w, lora, x, ids, wts))
    assert torch.equal(outs[0], outs[1])

    quant["config_groups"]["group_0"]["weights"] = {**scheme, "symmetric": False, "zero_point": True}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quant}))
    with pytest.raises(ValueError, match="group_0"):
        kt_ep._load_rawint4_sft_weights(weight_path=str(tmp_path), layer_idx=layer, num_experts=e, hidden_size=h,
                                        moe_intermediate_size=i, num_experts_per_tok=k)


def test_fp8_expert_lora_serving_loads_the_checkpoint_as_stored(tmp_path):
    """The fork's `--kt-expert-lora-path` on a block-FP8 model (method FP8): its runtime probe,
    its checkpoint reader (`_load_native_fp8_sft_weights`: our `MOEArchConfig`,
    `load_block_fp8_experts_from_checkpoint_files`) and `load_block_fp8_weights` serve the
    layer's own e4m3 bytes and scales: the output of the same layer quantized from their values
    (which requantize exactly: power-of-two scales, a ±448 in every block) bit for bit."""
    import json

    from safetensors.torch import save_file

    from kt_kernel import KTMoEWrapper

    e, k, h, i, layer = 4, 2, 256, 128, 1
    g = torch.Generator().manual_seed(8)
    tensors, values = {}, {}
    for name, rows, cols in [("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)]:
        w = (torch.randn(e, rows, cols, generator=g) * 100).clamp(-440, 440).to(torch.float8_e4m3fn)
        w[:, ::128, ::128] = 448.0
        s = 2.0 ** torch.randint(-12, -8, (e, rows // 128, cols // 128), generator=g).float()
        values[name] = w.float() * s.repeat_interleave(128, 1).repeat_interleave(128, 2)
        for x in range(e):
            stem = f"model.layers.{layer}.mlp.experts.{x}.{name}"
            tensors[f"{stem}.weight"] = w[x].contiguous()
            tensors[f"{stem}.weight_scale_inv"] = s[x].contiguous()
    save_file(tensors, str(tmp_path / "model-00001-of-00001.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: "model-00001-of-00001.safetensors" for n in tensors}}))

    method = kt_ep._map_kt_method_to_sft_method("FP8")
    assert method == "AMXFP8_SFT"
    kt_ep._validate_kt_sft_runtime(method)
    raw = kt_ep._load_native_fp8_sft_weights(weight_path=str(tmp_path), layer_idx=layer, num_experts=e, hidden_size=h,
                                             moe_intermediate_size=i, num_experts_per_tok=k)
    assert len(raw.gate_proj) == e and raw.down_scale[0].dtype == torch.float32
    common = dict(layer_idx=layer, num_experts=e, num_experts_per_tok=k, hidden_size=h, moe_intermediate_size=i,
                  gpu_experts_mask=None, cpuinfer_threads=2, threadpool_count=1, weight_path=None,
                  chunked_prefill_size=64, mode="sft", num_gpu_experts=0, lora_rank=4, lora_alpha=8.0,
                  method=method)
    lora, x, ids, wts = _lora_and_inputs(e, h, i, k, g)
    outs = []
    for served in (True, False):
        w = KTMoEWrapper(**common)
        if served:
            kt_ep._configure_kt_sft_wrapper_for_serving(w, method)
            assert w.share_backward_bb
            w.load_block_fp8_weights(raw, torch.arange(e))
        else:
            w.load_weights_from_tensors(values["gate_proj"], values["up_proj"], values["down_proj"])
        outs.append(_serve(w, lora, x, ids, wts))
    assert torch.equal(outs[0], outs[1])


def test_mxfp4_expert_lora_serving_reads_the_v4_checkpoint(tmp_path):
    """The fork's `--kt-expert-lora-path` on a DeepSeek-V4-Flash MXFP4 model (method MXFP4): the
    SFT wrapper built with the fork's own arguments (its GPU-expert mask, group 32, no zero
    point, its swiglu_limit) loads the checkpoint's e2m1 experts with `load_weights` and serves
    the output of the same layer made from their values, bit for bit (MXFP4 requantizes
    exactly), GPU experts left out."""
    from kt_kernel import KTMoEWrapper

    e, k, h, i, layer = 8, 2, 64, 32, 1
    g = torch.Generator().manual_seed(9)
    w = v4_checkpoint(tmp_path, (e, h, i), [layer], 9)[layer]
    values = [w["gate"], w["up"], w["down"]]

    method = kt_ep._map_kt_method_to_sft_method("MXFP4")
    assert method == "MXFP4_SFT"
    kt_ep._validate_kt_sft_runtime(method)
    mask = torch.zeros(e, dtype=torch.bool)
    mask[3] = True
    common = dict(layer_idx=layer, num_experts=e, num_experts_per_tok=k, hidden_size=h, moe_intermediate_size=i,
                  gpu_experts_mask=mask, cpuinfer_threads=2, threadpool_count=1, numa_nodes=None,
                  chunked_prefill_size=64, group_size=32, zero_point=False, swiglu_limit=7.0, method=method,
                  mode="sft", num_gpu_experts=0, lora_rank=4, lora_alpha=8.0, max_cache_depth=1)
    lora, x, ids, wts = _lora_and_inputs(e, h, i, k, g)
    outs = []
    for served in (True, False):
        w = KTMoEWrapper(weight_path=str(tmp_path) if served else None, **common)
        if served:
            kt_ep._configure_kt_sft_wrapper_for_serving(w, method)
            w.load_weights(torch.arange(e))
        else:
            w.load_weights_from_tensors(*values)
        outs.append(_serve(w, lora, x, ids, wts))
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], torch.zeros_like(outs[0]))
