"""``KTMoEFunction``: the SFT layer as a node of torch's autograd graph.

    out = KTMoEFunction.apply(hidden_states, topk_ids, topk_weights, wrapper, *lora_params)

The forward saves its cache in the wrapper; the backward returns the gradients of
``hidden_states`` and ``topk_weights`` and adds the LoRA gradients into the buffers the wrapper
was given by ``init_lora_weights`` (and, for full fine-tuning, the base weights' into
``grad_*_proj_buf``). Pass the trainable parameters after the wrapper (the LoRA ones in
``init_lora_weights``' order, then ``gate_proj_buf``, ``up_proj_buf``, ``down_proj_buf``) so
that torch runs the backward even when no other input needs a gradient: a parameter whose
``.grad`` is ``None`` (``optimizer.zero_grad()`` sets it so) gets its buffer back, zeroed,
before the backward adds to it.
"""

import torch


class KTMoEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_states, topk_ids, topk_weights, wrapper, *lora_params):
        out = wrapper.forward(hidden_states, topk_ids, topk_weights, save_for_backward=True)
        ctx.wrapper = wrapper
        ctx.like = (hidden_states.device, hidden_states.dtype, topk_weights.dtype)
        ctx.lora = lora_params
        return out.to(device=hidden_states.device, dtype=hidden_states.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        device, dtype, wdtype = ctx.like
        for p, g in zip(ctx.lora, ctx.wrapper._param_grads()):
            if p.grad is None:
                g.zero_()
                p.grad = g
        grad_input, grad_weights = ctx.wrapper.backward(grad_output.contiguous())
        grad_input = grad_input.to(device=device, dtype=dtype)
        grad_weights = grad_weights.to(device=device, dtype=wdtype)
        return (grad_input, None, grad_weights, None) + (None,) * len(ctx.lora)
