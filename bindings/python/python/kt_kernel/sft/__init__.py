"""kt_kernel.sft: LoRA fine-tuning of MoE experts on the CPU (KT-Kernel's SFT MoE).

Importing ``kt_kernel`` does not import this module. ``KTMoEWrapper(mode="sft", ...)`` returns
the same wrapper as ``SFTMoEWrapper(...)``::

    from kt_kernel.sft import SFTMoEWrapper, KTMoEFunction

The base weights stay frozen in an inference format (``AMXBF16_SFT``: bf16, ``AMXINT8_SFT``,
``AMXINT4_SFT``, ``AMXINT4_KGroup_SFT``, ``AMXFP8_SFT``, ``RAWINT4_SFT``: a compressed-tensors
int4 model's own weights, see ``stored``; ``*_SkipLoRA``: no LoRA; or trained too, with
``full_weight_grad``); every
projection of every expert gets ``x·Wᵀ + (alpha/rank)·(x·Aᵀ)·Bᵀ`` with the caller's bf16 A and B,
whose gradients the backward adds to (zero-copy, as KT). ``KTMoEFunction`` (torch) makes the
layer a node of torch's autograd graph; ``attach(model, ...)`` (torch, transformers >= 5) puts
the routed experts of a Hugging Face Qwen3-MoE, Qwen2-MoE, Mixtral or DeepSeek-V2/V3 model on
these layers, with LoRA parameters to train (``save_adapter`` / ``load_adapter``: the LoRA as a
PEFT-style adapter directory).
"""

from .wrapper import SFTMoEWrapper

_STORED = ("MOEArchConfig", "RAWINT4ExpertWeights", "BlockFP8ExpertWeights", "get_rawint4_runtime", "get_fp8_runtime",
           "get_mxfp4_runtime",
           "get_rawint4_checkpoint_contract", "load_rawint4_experts_from_checkpoint_files",
           "load_block_fp8_experts_from_checkpoint_files")

AMXSFTMoEWrapper = SFTMoEWrapper
BaseSFTMoEWrapper = SFTMoEWrapper


def __getattr__(name):
    # torch is imported only for what needs it.
    if name == "KTMoEFunction":
        from .autograd import KTMoEFunction

        return KTMoEFunction
    if name in ("attach", "KTExperts", "save_adapter", "load_adapter"):
        from . import hf

        return getattr(hf, name)
    if name in _STORED:
        from . import stored

        return getattr(stored, name)
    raise AttributeError(f"module 'kt_kernel.sft' has no attribute {name!r}")


__all__ = ["SFTMoEWrapper", "AMXSFTMoEWrapper", "BaseSFTMoEWrapper", "KTMoEFunction", "attach", "KTExperts", "save_adapter",
           "load_adapter", *_STORED]
