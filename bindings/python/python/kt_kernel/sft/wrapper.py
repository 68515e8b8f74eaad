"""``SFTMoEWrapper``: KT-Kernel's SFT MoE wrapper surface (``kt_kernel/sft/base.py`` and
``amx.py`` of its wheel) on the native ``SftMoe``. Tensors by duck typing: torch tensors (any
device; results come back as CPU bf16 tensors, or on ``output_device``) or numpy arrays (results
float32). LoRA matrices and their gradients are bf16: torch ``bfloat16`` tensors, or numpy
``uint16`` arrays of bf16 bits (``ml_dtypes.bfloat16`` too), C-contiguous on the CPU; their
addresses are kept (zero-copy), so the caller keeps them alive and updates them in place."""

from typing import Any, Optional, Sequence

import numpy as np

from .. import _tensors as T
from .. import kt_kernel_ext as ext
from .._layer import ExpertWeights, check_sizes, cpu_infer, gpu_mask
from .._staging import Staged, Staging, collect
from ..errors import KTNotImplementedError, KTRuntimeError, KTTypeError, KTValueError


def _bf16_address(x, name, shape):
    """The address of a C-contiguous CPU bf16 tensor or array of ``shape``."""
    if T.shape(x) != tuple(shape):
        raise KTValueError(f"{name} must have shape {list(shape)}, got {list(T.shape(x))}")
    if T.is_torch(x):
        if str(x.dtype) != "torch.bfloat16":
            raise KTTypeError(f"{name} must be bfloat16, got {x.dtype}")
        if T.on_cuda(x) or not x.is_contiguous():
            raise KTValueError(f"{name} must be a contiguous CPU tensor (its address is kept), got device {x.device}")
        return int(x.data_ptr())
    a = x if isinstance(x, np.ndarray) else None
    if a is None or a.dtype.name not in ("uint16", "bfloat16") or not a.flags.c_contiguous:
        kind = a.dtype.name if a is not None else type(x).__name__
        raise KTTypeError(f"{name} must be a C-contiguous bf16 array (torch.bfloat16, or numpy uint16 bits), got {kind}")
    return int(a.ctypes.data)


def _bytes(x, name, shape):
    """A tensor of stored bytes (uint8, or torch ``float8_e4m3fn``) as a C-contiguous uint8 array
    of ``shape``."""
    if T.is_torch(x):
        x = x.detach().cpu().contiguous()
        if "float8" in str(x.dtype):
            x = x.view(T.torch_module().uint8)
        x = x.numpy()
    a = np.ascontiguousarray(np.asarray(T.host(x)))
    if a.dtype != np.uint8 or a.shape != tuple(shape):
        raise KTValueError(f"{name} must be uint8 (or float8_e4m3fn) {list(shape)}, got {a.dtype} {list(a.shape)}")
    return a


def _scales(x, name, shape):
    """Scales of ``shape`` as ``(array, address, bytes per element)``."""
    if T.shape(x) != tuple(shape):
        raise KTValueError(f"{name} must have shape {list(shape)}, got {list(T.shape(x))}")
    a, ptr = T.to_host_array(T.host(x), name)
    return a, ptr, (a.element_size() if T.is_torch(a) else a.itemsize)


def _scale_code(a):
    """'bf16' or 'f32' for a scales array (numpy uint16: bf16 bits), else None."""
    code = T.float_code(a) or ("bf16" if not T.is_torch(a) and a.dtype == np.uint16 else None)
    return code if code in ("bf16", "f32") else None


def _bf16_bits(a):
    """A float array as C-contiguous bf16 bits (uint16), rounded to nearest even; bf16
    arrays (``uint16`` bits or ``ml_dtypes.bfloat16``) as they are."""
    if a.dtype.name in ("uint16", "bfloat16"):
        return np.ascontiguousarray(a).view(np.uint16)
    b = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def _bf16_values(bits):
    """bf16 bits (uint16) as float32."""
    return (np.asarray(bits).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


class SFTMoEWrapper(ExpertWeights):
    """One MoE layer's routed experts for LoRA fine-tuning, KT's constructor and methods."""

    def __init__(
        self,
        layer_idx: int,
        num_experts: int,
        num_experts_per_tok: int,
        hidden_size: int,
        moe_intermediate_size: int,
        num_gpu_experts: int = 0,
        cpuinfer_threads: int = 1,
        threadpool_count: int = 1,
        weight_path: Optional[str] = None,
        chunked_prefill_size: int = 512,
        lora_rank: int = 16,
        lora_alpha: float = 32.0,
        lora_dropout: float = 0.0,
        max_cache_depth: int = 1,
        method: str = "AMXBF16_SFT",
        group_size: int = 128,
        full_weight_grad: bool = False,
        backward_weights: str = "bf16",
        gpu_experts_mask: Any = None,
        numa_nodes: Optional[Sequence[int]] = None,
        swiglu_limit: float = 0.0,
        swiglu_alpha: float = 0.0,
    ) -> None:
        check_sizes(num_experts, num_experts_per_tok, hidden_size, moe_intermediate_size, cpuinfer_threads,
                    threadpool_count, chunked_prefill_size)
        full_weight_grad = bool(full_weight_grad)
        if lora_rank < 0 or (lora_rank == 0 and not full_weight_grad):
            raise KTValueError(
                f"lora_rank must be positive in LoRA mode, got {lora_rank} (rank 0 is full fine-tuning: "
                "pass full_weight_grad=True)"
            )
        if lora_rank > 0 and not lora_alpha > 0:
            raise KTValueError(f"lora_alpha must be positive, got {lora_alpha}")
        if lora_dropout != 0.0:
            raise KTNotImplementedError(f"lora_dropout {lora_dropout}: LoRA dropout is not implemented (use 0.0)")
        if full_weight_grad and method in ("AMXFP8_SFT", "MXFP4_SFT"):
            raise KTValueError(f"{method} supports frozen-base LoRA only (full_weight_grad=False)")
        if max_cache_depth <= 0:
            raise KTValueError(f"max_cache_depth must be positive, got {max_cache_depth}")
        self.layer_idx = int(layer_idx)
        self.num_experts = int(num_experts)
        self.num_experts_per_tok = int(num_experts_per_tok)
        self.hidden_size = int(hidden_size)
        self.moe_intermediate_size = int(moe_intermediate_size)
        # Experts on the GPU (KT's mask, or upstream's first num_gpu_experts): the CPU layer
        # leaves their slots out of the output and the gradients (their grad_weights are 0).
        # The wrapper's own mask is read live by every forward: update it in place.
        self.gpu_experts_mask = self._own_mask(gpu_mask(gpu_experts_mask, num_gpu_experts, num_experts))
        self.num_gpu_experts = int(self.gpu_experts_mask.sum())
        self.weight_path = weight_path
        self.chunked_prefill_size = int(chunked_prefill_size)
        self.lora_rank = int(lora_rank)
        self.lora_alpha = float(lora_alpha)
        self.lora_scaling = self.lora_alpha / self.lora_rank if self.lora_rank else 0.0
        self._full_weight_grad = full_weight_grad
        self.max_cache_depth = int(max_cache_depth)
        self.method = method
        self._is_skip_lora = method.endswith("_SkipLoRA") or self.lora_rank == 0
        self.cpu_infer = cpu_infer(cpuinfer_threads, threadpool_count, numa_nodes)
        self.moe = ext.SftMoe(
            self.num_experts,
            self.num_experts_per_tok,
            self.hidden_size,
            self.moe_intermediate_size,
            self.chunked_prefill_size,
            method,
            self.max_cache_depth,
            int(group_size),
            not self._is_skip_lora,
            backward_weights,
            int(self.gpu_experts_mask.data_ptr()) if T.is_torch(self.gpu_experts_mask) else int(self.gpu_experts_mask.ctypes.data),
            float(swiglu_limit),
            float(swiglu_alpha),
        )
        self.swiglu_limit, self.swiglu_alpha = float(swiglu_limit), float(swiglu_alpha)
        self._lora: Optional[list[Any]] = None
        self._grads: Optional[list[Any]] = None
        # (kind, ticket, output buffers, inputs kept alive until the task has read them)
        self._pending: Optional[tuple[str, Any, Any, tuple[Any, ...]]] = None
        self._serving: Optional[Staged] = None
        self.gate_proj_buf: Any = None
        self.up_proj_buf: Any = None
        self.down_proj_buf: Any = None
        self.grad_gate_proj_buf: Any = None
        self.grad_up_proj_buf: Any = None
        self.grad_down_proj_buf: Any = None

    # -- weights (load_weights, load_weights_from_tensors: ExpertWeights) --------------------

    @property
    def _weights_loaded(self):
        return self.moe.loaded

    def _lora_shapes(self):
        e, h, i, r = self.num_experts, self.hidden_size, self.moe_intermediate_size, self.lora_rank
        return [("gate_lora_a", (e, r, h)), ("gate_lora_b", (e, i, r)), ("up_lora_a", (e, r, h)),
                ("up_lora_b", (e, i, r)), ("down_lora_a", (e, r, i)), ("down_lora_b", (e, h, r))]

    def init_lora_weights(
        self,
        gate_lora_a, gate_lora_b, up_lora_a, up_lora_b, down_lora_a, down_lora_b,
        grad_gate_lora_a, grad_gate_lora_b, grad_up_lora_a, grad_up_lora_b, grad_down_lora_a, grad_down_lora_b,
    ) -> None:
        """Register the six bf16 LoRA matrices (A ``[E, r, in]``, B ``[E, out, r]``) and their
        gradients (same shapes; the backward adds to them): their addresses are kept."""
        mats = [gate_lora_a, gate_lora_b, up_lora_a, up_lora_b, down_lora_a, down_lora_b]
        grads = [grad_gate_lora_a, grad_gate_lora_b, grad_up_lora_a, grad_up_lora_b, grad_down_lora_a, grad_down_lora_b]
        shapes = self._lora_shapes()
        ptrs = [_bf16_address(x, n, s) for x, (n, s) in zip(mats, shapes)]
        gptrs = [_bf16_address(x, "grad_" + n, s) for x, (n, s) in zip(grads, shapes)]
        self.moe.set_lora(self.lora_rank, self.lora_alpha, ptrs)
        self.moe.set_lora_grads(gptrs)
        (self.gate_lora_a, self.gate_lora_b, self.up_lora_a, self.up_lora_b, self.down_lora_a, self.down_lora_b) = mats
        self._lora, self._grads = mats, grads

    @property
    def _lora_initialized(self):
        return self._lora is not None

    def update_lora_weights(self) -> None:
        """Register the LoRA tensors' addresses again: the kernels read them in place, so an
        optimizer step that updates them in place needs nothing; call this when they were
        replaced by new storage."""
        if self._lora is None or self._grads is None:
            raise KTRuntimeError("LoRA weights not initialized. Call init_lora_weights() first.")
        self.init_lora_weights(*self._lora, *self._grads)

    def load_rawint4_weights(self, weights: Any, physical_to_logical_map_cpu: Any = None) -> None:
        """``RAWINT4_SFT``: load a compressed-tensors int4 model's experts as they are stored
        (``kt_kernel.sft.RAWINT4ExpertWeights``: packed uint8 ``[E, rows, cols/2]`` and bf16 or
        f32 scales ``[E, rows, cols/32]``, torch tensors or numpy arrays, bf16 as uint16 bits),
        without quantizing them again."""
        if self.method != "RAWINT4_SFT":
            raise KTValueError(f"load_rawint4_weights() needs method RAWINT4_SFT, got {self.method!r}")
        if int(getattr(weights, "group_size", 32)) != 32:
            raise KTValueError(f"RAWINT4 SFT needs group_size 32, got {weights.group_size}")
        e = self.num_experts
        stored = []
        for name, rows, cols in self._projections():
            p = _bytes(getattr(weights, f"{name}_proj"), f"{name}_proj", (e, rows, cols // 2))
            s = _scales(getattr(weights, f"{name}_scale"), f"{name}_scale", (e, rows, cols // 32))
            stored.append([(p, int(p.ctypes.data) + x * p[0].nbytes) for x in range(e)])
            stored.append([(s[0], s[1] + x * rows * (cols // 32) * s[2]) for x in range(e)])
        self._load_stored(stored, physical_to_logical_map_cpu)

    def load_block_fp8_weights(self, weights: Any, physical_to_logical_map_cpu: Any = None) -> None:
        """``AMXFP8_SFT``: load an FP8 model's experts as they are stored (KT's
        ``BlockFP8ExpertWeights``: per projection a list of ``E`` e4m3 matrices, torch
        ``float8_e4m3fn`` or numpy uint8 bytes, and of ``E`` f32 (or bf16) ``weight_scale_inv``
        scales, one per 128×128 block), without quantizing them again."""
        if self.method != "AMXFP8_SFT":
            raise KTValueError(f"load_block_fp8_weights() needs method AMXFP8_SFT, got {self.method!r}")
        if tuple(getattr(weights, "block_size", (128, 128))) != (128, 128):
            raise KTValueError(f"AMXFP8_SFT needs block_size (128, 128), got {weights.block_size}")
        e = self.num_experts
        stored = []
        for name, rows, cols in self._projections():
            ws, ss = getattr(weights, f"{name}_proj"), getattr(weights, f"{name}_scale")
            if len(ws) != e or len(ss) != e:
                raise KTValueError(f"{name}: expected {e} experts' weights and scales, got {len(ws)} and {len(ss)}")
            ps = [_bytes(w, f"{name}_proj[{x}]", (rows, cols)) for x, w in enumerate(ws)]
            sc = [_scales(s, f"{name}_scale[{x}]", (rows // 128, cols // 128)) for x, s in enumerate(ss)]
            stored.append([(p, int(p.ctypes.data)) for p in ps])
            stored.append([(s[0], s[1]) for s in sc])
        self._load_stored(stored, physical_to_logical_map_cpu)

    def load_mxfp4_weights(self, experts_data: Any, physical_to_logical_map_cpu: Any = None) -> None:
        """``MXFP4_SFT``: load an MXFP4 model's experts as they are stored (KT's dict of per-expert
        lists ``gate``, ``up``, ``down``: e2m1 nibbles, uint8 ``[rows, cols/2]``, the even column
        low; ``gate_scale``, ``up_scale``, ``down_scale``: bf16 (or f32) powers of two
        ``[rows, cols/32]``), without quantizing them again."""
        if self.method != "MXFP4_SFT":
            raise KTValueError(f"load_mxfp4_weights() needs method MXFP4_SFT, got {self.method!r}")
        if not isinstance(experts_data, dict):
            raise KTTypeError(f"MXFP4 experts must be a dict of per-expert lists, got {type(experts_data).__name__}")
        e = self.num_experts
        stored = []
        for name, rows, cols in self._projections():
            ws, ss = experts_data.get(name), experts_data.get(f"{name}_scale")
            if not isinstance(ws, (list, tuple)) or not isinstance(ss, (list, tuple)) or len(ws) != e or len(ss) != e:
                raise KTValueError(f"MXFP4 {name} and {name}_scale must each be a list of {e} expert tensors")
            ps = [_bytes(w, f"{name}[{x}]", (rows, cols // 2)) for x, w in enumerate(ws)]
            sc = [_scales(s, f"{name}_scale[{x}]", (rows, cols // 32)) for x, s in enumerate(ss)]
            stored.append([(p, int(p.ctypes.data)) for p in ps])
            stored.append([(s[0], s[1]) for s in sc])
        self._load_stored(stored, physical_to_logical_map_cpu)

    def _projections(self):
        h, i = self.hidden_size, self.moe_intermediate_size
        return [("gate", i, h), ("up", i, h), ("down", h, i)]

    def _load_stored(self, stored, physical_to_logical_map_cpu):
        """Hand the native layer six ``(array, address)`` lists (gate, its scales, up, ..., one
        entry per logical expert), the scales' dtype read from them, and block until loaded."""
        codes = {_scale_code(a) for lst in stored[1::2] for a, _ in lst}
        if len(codes) != 1 or None in codes:
            raise KTTypeError("the scales must all be bf16 (torch bfloat16 or uint16 bits) or all float32")
        ptrs = [stored[k][x][1] for x in range(self.num_experts) for k in range(6)]
        self.moe.load_from_quantized(self.cpu_infer, ptrs, codes.pop(), self._map(physical_to_logical_map_cpu))
        del stored

    # -- full fine-tuning -------------------------------------------------------------------

    def init_full_weight_grad_buffers(self, gate_proj: Any, up_proj: Any, down_proj: Any) -> None:
        """Full fine-tuning (``full_weight_grad=True``): bf16 copies of the base weights as
        parameters (``gate_proj_buf``, ``up_proj_buf`` ``[E, I, H]``, ``down_proj_buf``
        ``[E, H, I]``, in slot order: ``nn.Parameter`` for torch input, numpy bf16 bits
        otherwise) and zeroed gradients of the same shapes (``grad_*_proj_buf``) that every
        backward adds to (times ``optimizer_grad_scale``), with respect to the dequantized
        weights the forward ran. After an optimizer step on the parameters,
        ``update_base_weights()`` packs them into the layer again."""
        if not self._full_weight_grad:
            raise KTRuntimeError("init_full_weight_grad_buffers needs a wrapper built with full_weight_grad=True")
        e, h, i = self.num_experts, self.hidden_size, self.moe_intermediate_size
        shapes = [("gate_proj", gate_proj, (e, i, h)), ("up_proj", up_proj, (e, i, h)), ("down_proj", down_proj, (e, h, i))]
        params, grads = [], []
        for name, x, shape in shapes:
            if T.shape(x) != shape:
                raise KTValueError(f"{name} must have shape {list(shape)}, got {list(T.shape(x))}")
            if T.is_torch(x):
                torch = T.torch_module()
                p = torch.nn.Parameter(x.detach().to(device="cpu", dtype=torch.bfloat16).contiguous(), requires_grad=True)
                g = torch.zeros(shape, dtype=torch.bfloat16)
            else:
                p, g = _bf16_bits(np.asarray(T.host(x))), np.zeros(shape, dtype=np.uint16)
            params.append(p)
            grads.append(g)
        ptrs = [_bf16_address(g, "grad_" + n, s) for g, (n, _, s) in zip(grads, shapes)]
        self.moe.set_base_grads(ptrs)
        (self.gate_proj_buf, self.up_proj_buf, self.down_proj_buf) = params
        (self.grad_gate_proj_buf, self.grad_up_proj_buf, self.grad_down_proj_buf) = grads

    def update_base_weights(self) -> None:
        """Pack the base parameters (``*_proj_buf``, updated by the optimizer) into the layer
        in its method's format, as ``load_weights_from_tensors`` does; saved forwards are
        dropped. Nothing to do without ``full_weight_grad``."""
        if not self.moe.loaded:
            raise KTRuntimeError("Weights not loaded. Call load_weights() or load_weights_from_tensors() first.")
        if not self._full_weight_grad:
            return
        if self.gate_proj_buf is None:
            raise KTRuntimeError("Base weight buffers not initialized. Call init_full_weight_grad_buffers() first.")
        bufs = [self.gate_proj_buf, self.up_proj_buf, self.down_proj_buf]
        if T.is_torch(bufs[0]):
            bufs = [b.detach() for b in bufs]
        else:
            bufs = [_bf16_values(b) for b in bufs]
        self.load_weights_from_tensors(*bufs)

    def _param_grads(self):
        """The gradient buffers the backward adds to: the LoRA ones (``init_lora_weights``'
        order), then the base ones when full fine-tuning."""
        base = [self.grad_gate_proj_buf, self.grad_up_proj_buf, self.grad_down_proj_buf]
        return list(self._grads or []) + ([] if base[0] is None else base)

    # -- forward / backward ----------------------------------------------------------------

    def _check_ready(self):
        if not self.moe.loaded:
            raise KTRuntimeError("Weights not loaded. Call load_weights() or load_weights_from_tensors() first.")
        if self._lora is None and not self._is_skip_lora:
            raise KTRuntimeError("LoRA weights not initialized. Call init_lora_weights() first.")

    def _host_floats(self, x, name, rows):
        x = T.host(x)
        if T.shape(x) != (rows, self.hidden_size):
            raise KTValueError(f"{name} must have shape [{rows}, {self.hidden_size}], got {list(T.shape(x))}")
        if T.float_code(x) is None:
            x = np.asarray(x, dtype=np.float32)
        a, p = T.to_host_array(x, name)
        return a, p, T.float_code(a)

    def _out(self, like, shape, torch_dtype="bfloat16"):
        """A result buffer: a CPU torch tensor for torch input, else a float32 array."""
        if T.is_torch(like):
            torch = T.torch_module()
            t = torch.empty(shape, dtype=getattr(torch, torch_dtype))
            return t, int(t.data_ptr()), "bf16" if torch_dtype == "bfloat16" else "f32"
        a = np.empty(shape, dtype=np.float32)
        return a, int(a.ctypes.data), "f32"

    def submit_forward(self, hidden_states: Any, expert_ids: Any, weights: Any, save_for_backward: bool = True) -> None:
        """Queue a forward (non-blocking); ``sync_forward`` returns its output."""
        self._check_ready()
        n, k = int(T.shape(hidden_states)[0]), self.num_experts_per_tok
        if n > self.chunked_prefill_size:
            raise KTValueError(
                f"qlen ({n}) exceeds chunked_prefill_size ({self.chunked_prefill_size}). "
                "Increase chunked_prefill_size or reduce qlen to avoid buffer overrun."
            )
        x, xp, xc = self._host_floats(hidden_states, "hidden_states", n)
        ids = np.ascontiguousarray(T.int_array(expert_ids, "expert_ids"))
        if ids.shape != (n, k):
            raise KTValueError(f"expert_ids shape {tuple(ids.shape)} must be ({n}, {k}).")
        w = weights.detach().cpu().float().numpy() if T.is_torch(weights) else np.asarray(T.host(weights))
        w = np.ascontiguousarray(w, dtype=np.float32)
        if w.shape != (n, k):
            raise KTValueError(f"weights shape {tuple(w.shape)} must be ({n}, {k}).")
        out, op, oc = self._out(hidden_states, (n, self.hidden_size))
        ticket = self.moe.submit_forward(self.cpu_infer, n, xp, xc, int(ids.ctypes.data), int(w.ctypes.data), op, oc, bool(save_for_backward))
        self._pending = ("forward", ticket, out, (x, ids, w))
        return None

    def _wait(self, kind):
        if self._pending is None or self._pending[0] != kind:
            raise KTRuntimeError(f"No pending {kind}. Call submit_{kind}{'_async' if kind == 'backward' else ''}() first.")
        _, ticket, out, _keep = self._pending
        self._pending = None
        self.cpu_infer.sync_until(ticket)
        return out

    @staticmethod
    def _to(x, device):
        return x if device is None or not T.is_torch(x) else x.to(device=device, non_blocking=True)

    def sync_forward(self, output_device: Any = None) -> Any:
        """Wait for the queued forward and return its ``[n, H]`` output."""
        return self._to(self._wait("forward"), output_device)

    def forward(
        self, hidden_states: Any, expert_ids: Any, weights: Any, save_for_backward: bool = True, output_device: Any = None
    ) -> Any:
        """``Σ_j weights[t,j]·expert(x_t)`` with LoRA on every projection, saving what the
        backward needs when ``save_for_backward`` (up to ``max_cache_depth`` forwards)."""
        self.submit_forward(hidden_states, expert_ids, weights, save_for_backward)
        return self.sync_forward(output_device)

    def submit_backward_async(self, grad_output: Any, optimizer_grad_scale: float = 1.0) -> None:
        """Queue the backward of the newest saved forward; ``sync_backward`` returns
        ``(grad_input, grad_weights)``. The LoRA gradients are added to, times
        ``optimizer_grad_scale``."""
        self._check_ready()
        if self.moe.cache_depth == 0:
            raise KTRuntimeError("No forward cache available. Call forward(save_for_backward=True) first.")
        n = int(T.shape(grad_output)[0])
        g, gp, gc = self._host_floats(grad_output, "grad_output", n)
        gi, gip, gic = self._out(grad_output, (n, self.hidden_size))
        gw, gwp, _ = self._out(grad_output, (n, self.num_experts_per_tok), "float32")
        ticket = self.moe.submit_backward(self.cpu_infer, n, gp, gc, gip, gic, gwp, float(optimizer_grad_scale))
        self._pending = ("backward", ticket, (gi, gw), (g,))

    def sync_backward(self, output_device: Any = None) -> tuple[Any, Any]:
        """Wait for the queued backward and return ``(grad_input, grad_weights)``."""
        gi, gw = self._wait("backward")
        return self._to(gi, output_device), self._to(gw, output_device)

    def backward(self, grad_output: Any, output_device: Any = None, optimizer_grad_scale: float = 1.0) -> tuple[Any, Any]:
        """``(grad_input [n, H], grad_weights [n, k])`` of the newest saved forward (which it
        drops); the LoRA gradients registered by ``init_lora_weights`` are added to."""
        self.submit_backward_async(grad_output, optimizer_grad_scale)
        return self.sync_backward(output_device)

    # -- serving (SGLang's LoRA experts) ---------------------------------------------------

    def submit_forward_inference(self, hidden_states: Any, expert_ids: Any, weights: Any, cuda_stream: int = 0) -> None:
        """A forward for serving (SGLang's LoRA experts), saving nothing, staged as the inference
        wrapper stages: inputs copied into per-token-count staging buffers (pinned host memory
        for torch), with a CUDA stream the copies and the task queued on the stream (the task
        runs as a host function after the copies, so CUDA-graph replays reuse it);
        ``sync_forward_inference`` returns the output on the input's device."""
        self._check_ready()
        x = T.host(hidden_states)
        torch = T.is_torch(x)
        if not torch and not isinstance(x, np.ndarray):
            x = np.asarray(x)
        n, h, k = int(T.shape(x)[0]), self.hidden_size, self.num_experts_per_tok
        if T.shape(x) != (n, h):
            raise KTValueError(f"hidden_states must have shape [N, {h}], got {list(T.shape(x))}")
        if n > self.chunked_prefill_size:
            raise KTValueError(f"qlen ({n}) exceeds chunked_prefill_size ({self.chunked_prefill_size})")
        for name, t in [("expert_ids", expert_ids), ("weights", weights)]:
            if T.shape(t) != (n, k):
                raise KTValueError(f"{name} must have shape [{n}, {k}], got {list(T.shape(t))}")
        if not torch and x.dtype.kind != "f":
            x = x.astype(np.float32)
        stream = int(cuda_stream or 0)
        st = Staging.get(n, h, k, x, torch)
        slot = st.slots[self.layer_idx % 2]
        st.put(slot.input, x, stream)
        st.put(slot.ids, T.host(expert_ids), stream)
        st.put(slot.weights, T.host(weights), stream)
        x_at, ids_at, _, w_at, out_at = slot.at
        ticket = self.moe.submit_forward_inference(self.cpu_infer, stream, st.bsz_at, x_at, st.code, ids_at, w_at,
                                                   out_at, st.code)
        self._serving = (st, slot, (n, h), ticket)

    def sync_forward_inference(self, cuda_stream: int = 0) -> Any:
        """Wait for the forward :meth:`submit_forward_inference` queued and return its output."""
        staged, self._serving = self._serving, None
        if staged is None:
            raise KTRuntimeError("sync_forward_inference without a submit_forward_inference")
        return collect(self.cpu_infer, staged, int(cuda_stream or 0), 0)

    # -- cache ------------------------------------------------------------------------------

    @property
    def _cache_depth(self):
        return self.moe.cache_depth

    @property
    def cache_bytes(self) -> int:
        """Bytes the saved forwards hold."""
        return self.moe.cache_bytes

    def clear_cache(self) -> None:
        """Drop every saved forward."""
        self.moe.clear_cache()
