"""Hugging Face MoE models with their routed experts on the CPU's SFT layers (torch).

    import transformers
    from kt_kernel.sft import attach

    model = transformers.AutoModelForCausalLM.from_pretrained(path)      # or from_config
    attach(model, lora_rank=16, lora_alpha=32.0, method="AMXBF16_SFT", cpuinfer_threads=32)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

``attach`` finds the architecture from ``model.config.model_type`` (Qwen3-MoE, Qwen2-MoE,
Mixtral, DeepSeek-V2, DeepSeek-V3) and replaces each MoE block's routed-experts module, the
transformers (>= 5) ``<Arch>Experts`` with fused ``gate_up_proj [E, 2I, H]`` and ``down_proj
[E, H, I]``, by a ``KTExperts``: the same ``forward(hidden_states, top_k_index,
top_k_weights)``, its base weights quantized once into ``method`` and frozen, and six bf16 LoRA
parameters (A ``[E, r, in]`` PEFT's uniform init, B ``[E, out, r]`` zero, so training starts
from the model's own outputs). The router, attention and everything else stay the model's;
gradients reach them through the experts' input and routing weights.
"""

import math
import re

import torch

from ..errors import KTValueError
from .autograd import KTMoEFunction
from .wrapper import SFTMoEWrapper

SUPPORTED = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3")
_NAMES = ("gate_lora_a", "gate_lora_b", "up_lora_a", "up_lora_b", "down_lora_a", "down_lora_b")


class KTExperts(torch.nn.Module):
    """A transformers ``<Arch>Experts`` module's drop-in on an ``SFTMoEWrapper``."""

    def __init__(self, experts: torch.nn.Module, layer_idx: int, top_k: int, lora_rank: int = 16,
                 lora_alpha: float = 32.0, method: str = "AMXBF16_SFT", cpuinfer_threads: int = 1,
                 threadpool_count: int = 1, max_tokens: int = 4096, max_cache_depth: int = 1, seed: int = 0,
                 full_weight_grad: bool = False) -> None:
        super().__init__()
        gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
        e, two_i, h = gate_up.shape
        i = two_i // 2
        if tuple(down.shape) != (e, h, i):
            raise KTValueError(f"down_proj must have shape [{e}, {h}, {i}] for gate_up_proj {list(gate_up.shape)}, "
                             f"got {list(down.shape)}")
        self.layer_idx, self.top_k = int(layer_idx), int(top_k)
        self.wrapper = SFTMoEWrapper(layer_idx, e, top_k, h, i, cpuinfer_threads=cpuinfer_threads,
                                     threadpool_count=threadpool_count, chunked_prefill_size=max_tokens,
                                     lora_rank=lora_rank, lora_alpha=lora_alpha, max_cache_depth=max_cache_depth,
                                     method=method, full_weight_grad=full_weight_grad)
        host = lambda t: t.to(device="cpu", dtype=torch.bfloat16 if t.dtype not in (torch.float32, torch.float16,
                                                                                   torch.bfloat16) else t.dtype)
        base = [host(gate_up[:, :i]).contiguous(), host(gate_up[:, i:]).contiguous(), host(down).contiguous()]
        self.wrapper.load_weights_from_tensors(*base)
        self._full = bool(full_weight_grad)
        if self._full:
            # The base weights as bf16 parameters ([E, I, H], [E, I, H], [E, H, I]); the layer packs
            # them again before a forward that follows an update (see `forward`).
            self.wrapper.init_full_weight_grad_buffers(*base)
            w = self.wrapper
            for name, p, grad in [("gate_proj", w.gate_proj_buf, w.grad_gate_proj_buf),
                                  ("up_proj", w.up_proj_buf, w.grad_up_proj_buf),
                                  ("down_proj", w.down_proj_buf, w.grad_down_proj_buf)]:
                p.grad = grad
                self.register_parameter(name, p)
            self._base_versions = self._versions()
        g = torch.Generator().manual_seed(seed + layer_idx)
        r = lora_rank
        shapes = [(h, (e, r, h)), (r, (e, i, r)), (h, (e, r, h)), (r, (e, i, r)), (i, (e, r, i)), (r, (e, h, r))]
        for name, (fan_in, shape) in zip(_NAMES if r else (), shapes):
            if name.endswith("_a"):
                bound = 1.0 / math.sqrt(fan_in)
                value = (torch.rand(shape, generator=g) * 2 - 1) * bound
            else:
                value = torch.zeros(shape)
            p = torch.nn.Parameter(value.to(torch.bfloat16))
            p.grad = torch.zeros_like(p)
            self.register_parameter(name, p)
        params = self.lora_parameters()
        if params:
            self.wrapper.init_lora_weights(*params, *[p.grad for p in params])

    def lora_parameters(self) -> list[torch.nn.Parameter]:
        """The six LoRA parameters, in ``init_lora_weights``' order (none at rank 0)."""
        return [getattr(self, n) for n in _NAMES if hasattr(self, n)]

    def base_parameters(self) -> list[torch.nn.Parameter]:
        """The base weights' parameters when full fine-tuning (``gate_proj``, ``up_proj``,
        ``down_proj``), else none."""
        return [getattr(self, n) for n in ("gate_proj", "up_proj", "down_proj") if self._full]

    def _versions(self):
        return [p._version for p in self.base_parameters()]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        if self._full and self._versions() != self._base_versions:
            # An optimizer step changed the base weights in place: pack them again.
            self.wrapper.update_base_weights()
            self._base_versions = self._versions()
        if torch.is_grad_enabled():
            params = self.lora_parameters() + self.base_parameters()
            out = KTMoEFunction.apply(x, top_k_index, top_k_weights, self.wrapper, *params)
        else:
            # No graph: nothing will call the backward, so keep no cache.
            out = self.wrapper.forward(x, top_k_index, top_k_weights, save_for_backward=False)
            out = out.to(device=x.device, dtype=x.dtype)
        return out.reshape(shape)

    def extra_repr(self) -> str:
        w = self.wrapper
        return (f"layer {self.layer_idx}, experts {w.num_experts}, top_k {self.top_k}, hidden {w.hidden_size}, "
                f"intermediate {w.moe_intermediate_size}, {w.method}, rank {w.lora_rank}, alpha {w.lora_alpha}")


def _experts_modules(model):
    """``(path, parent, attribute name, module)`` for every routed-experts module of ``model``."""
    found = []
    for parent_path, parent in model.named_modules():
        for name, child in parent.named_children():
            p = dict(child.named_parameters(recurse=False))
            if isinstance(p.get("gate_up_proj"), torch.Tensor) and p["gate_up_proj"].dim() == 3 \
                    and isinstance(p.get("down_proj"), torch.Tensor) and p["down_proj"].dim() == 3:
                found.append((f"{parent_path}.{name}" if parent_path else name, parent, name, child))
    return found


def attach(model: torch.nn.Module, lora_rank: int = 16, lora_alpha: float = 32.0, method: str = "AMXBF16_SFT",
           cpuinfer_threads: int = 1, threadpool_count: int = 1, max_tokens: int = 4096, max_cache_depth: int = 1,
           seed: int = 0, full_weight_grad: bool = False) -> list[KTExperts]:
    """Replace every routed-experts module of a Hugging Face MoE ``model`` by a ``KTExperts``
    (in place) and freeze nothing else; returns the new modules, one per MoE layer in order.
    ``max_tokens`` bounds the tokens (batch × sequence) of one forward. ``full_weight_grad``
    trains the experts' base weights too (their bf16 parameters ``gate_proj``, ``up_proj``,
    ``down_proj``, packed again before the first forward after an optimizer step);
    ``lora_rank=0`` with it is full fine-tuning without LoRA."""
    cfg = model.config
    kind = getattr(cfg, "model_type", None)
    if kind not in SUPPORTED:
        raise KTValueError(f"model_type {kind!r} is not supported; kt_kernel.sft.attach supports {', '.join(SUPPORTED)}")
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise KTValueError(f"the experts' activation must be silu (SwiGLU), the config has hidden_act={act!r}")
    top_k = int(cfg.num_experts_per_tok)
    found = _experts_modules(model)
    if not found:
        raise KTValueError(f"no routed-experts module (fused gate_up_proj [E, 2I, H] and down_proj [E, H, I]) in this "
                         f"{kind} model: kt_kernel.sft.attach needs transformers >= 5")
    layers = []
    for n, (path, parent, name, experts) in enumerate(found):
        # The decoder layer's index (what SGLang's KT layers are keyed by), else the order found.
        m = re.search(r"layers\.(\d+)\.", path + ".")
        layer_idx = int(m.group(1)) if m else n
        kt = KTExperts(experts, layer_idx, top_k, lora_rank, lora_alpha, method, cpuinfer_threads, threadpool_count,
                       max_tokens, max_cache_depth, seed, full_weight_grad)
        setattr(parent, name, kt)
        layers.append(kt)
    return layers


_PROJ = (("gate_proj", "gate_lora"), ("up_proj", "up_lora"), ("down_proj", "down_lora"))
_PREFIX = "base_model.model."


def _attached(model):
    """``(path, KTExperts)`` of every attached experts module."""
    found = [(path, m) for path, m in model.named_modules() if isinstance(m, KTExperts)]
    if not found:
        raise KTValueError("the model has no KTExperts: call kt_kernel.sft.attach(model, ...) first")
    return found


def save_adapter(model: torch.nn.Module, directory: str) -> None:
    """Write the experts' LoRA as a PEFT adapter directory: ``adapter_config.json`` (``r``,
    ``lora_alpha``, the target projections) and ``adapter_model.safetensors`` with PEFT's key for
    each expert's projection, ``base_model.model.<path>.<e>.<gate|up|down>_proj.lora_<A|B>.weight``
    (A ``[r, in]``, B ``[out, r]``, bf16): the layout SGLang's KT fork reads for
    ``--kt-expert-lora-path``."""
    import json
    import os

    from safetensors.torch import save_file

    found = _attached(model)
    tensors = {}
    for path, kt in found:
        for proj, stem in _PROJ:
            a, b = getattr(kt, stem + "_a").detach(), getattr(kt, stem + "_b").detach()
            for e in range(a.shape[0]):
                tensors[f"{_PREFIX}{path}.{e}.{proj}.lora_A.weight"] = a[e].contiguous()
                tensors[f"{_PREFIX}{path}.{e}.{proj}.lora_B.weight"] = b[e].contiguous()
    first = found[0][1].wrapper
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": first.lora_rank, "lora_alpha": first.lora_alpha,
              "target_modules": [p for p, _ in _PROJ], "lora_dropout": 0.0, "bias": "none",
              "base_model_name_or_path": getattr(model.config, "_name_or_path", "") or None,
              "base_model_type": model.config.model_type, "kt_kernel_method": first.method}
    os.makedirs(directory, exist_ok=True)
    # Each file under a temporary name, renamed when both are whole; on an error, what this
    # call wrote is removed: no partial adapter is left.
    names = [os.path.join(directory, n) for n in ("adapter_model.safetensors", "adapter_config.json")]
    written = []
    try:
        written.append(names[0] + ".tmp")
        save_file(tensors, names[0] + ".tmp")
        with open(names[1] + ".tmp", "w") as f:
            written.append(names[1] + ".tmp")
            json.dump(config, f, indent=2)
        for name in names:
            os.replace(name + ".tmp", name)
            written[written.index(name + ".tmp")] = name
    except BaseException:
        for path in written:
            if os.path.isfile(path):
                os.remove(path)
        raise


def load_adapter(model: torch.nn.Module, directory: str) -> None:
    """Read a PEFT adapter of the experts (``save_adapter``'s layout, with or without PEFT's
    ``base_model.model.`` prefix) into the attached ``model``'s LoRA parameters, in place (the SFT
    layers keep reading the same storage). Every expert's tensors must be there with their
    shapes, and the rank and alpha must be the model's."""
    import json
    import os

    from safetensors.torch import load_file

    found = _attached(model)
    with open(os.path.join(directory, "adapter_config.json")) as f:
        config = json.load(f)
    first = found[0][1].wrapper
    for key, have in [("r", first.lora_rank), ("lora_alpha", first.lora_alpha)]:
        if config.get(key) != have:
            raise KTValueError(f"adapter {key} is {config.get(key)!r}, the attached model's is {have!r}")
    tensors = load_file(os.path.join(directory, "adapter_model.safetensors"))

    def tensor(name, shape):
        for key in (_PREFIX + name, name):
            if key in tensors:
                t = tensors[key]
                if tuple(t.shape) != tuple(shape):
                    raise KTValueError(f"adapter tensor {key!r} has shape {list(t.shape)}, expected {list(shape)}")
                return t
        raise KTValueError(f"adapter lacks {_PREFIX + name!r}")

    with torch.no_grad():
        for path, kt in found:
            for proj, stem in _PROJ:
                a, b = getattr(kt, stem + "_a"), getattr(kt, stem + "_b")
                for e in range(a.shape[0]):
                    a[e].copy_(tensor(f"{path}.{e}.{proj}.lora_A.weight", a.shape[1:]).to(a.dtype))
                    b[e].copy_(tensor(f"{path}.{e}.{proj}.lora_B.weight", b.shape[1:]).to(b.dtype))
