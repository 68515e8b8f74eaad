"""``KTMoEWrapper`` with KT-Kernel's signature, defaults, method names and errors, returning a
backend object with KT's methods; ``generate_gpu_experts_masks``.

The native engine (``kt_kernel_ext.CpuInfer``) is process-wide: the first wrapper's
``cpuinfer_threads``/``threadpool_count``/``numa_nodes`` build it, later ones share it (as KT).
Forward tasks read staging buffers (``_staging``) by address when they run.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import numpy as np

from . import _tensors as T
from . import kt_kernel_ext as ext
from ._layer import ExpertWeights, check_sizes, cpu_infer, gpu_mask, skip_gpu_experts
from ._staging import CAPTURE_SIZES, THIS_THREAD, Staged, Staging, collect, ptr
from .errors import KTNotImplementedError, KTRuntimeError, KTTypeError, KTValueError

if TYPE_CHECKING:
    from .sft import SFTMoEWrapper

__all__ = ["KTMoEWrapper", "NativeMoEWrapper", "generate_gpu_experts_masks", "select_deferred_experts"]
# (ExpertWeights, check_sizes, cpu_infer, skip_gpu_experts: importable from here as before.)

INFERENCE_METHODS = frozenset(
    {
        "AMXINT4",
        "AMXINT8",
        "RAWINT4",
        "FP8",
        "BF16",
        "FP8_PERCHANNEL",
        "GPTQ_INT4",
        "SYCL_GPTQ_INT4",
        "MXFP4",
        "MXFP8",
        "LLAMAFILE",
        "MOE_INT4",
        "MOE_INT8",
    }
)
SFT_METHODS = frozenset(
    {
        "AMXBF16_SFT",
        "AMXFP8_SFT",
        "INT8_SFT",
        "AMXINT8_SFT",
        "AMXINT4_SFT",
        "AMXINT4_1_SFT",
        "AMXINT4_KGroup_SFT",
        "AMXINT4_1KGroup_SFT",
        "RAWINT4_SFT",
        "MXFP4_SFT",
    }
    | {f"{m}_SkipLoRA" for m in ("AMXBF16_SFT", "AMXINT8_SFT", "AMXINT4_SFT", "AMXINT4_1_SFT", "AMXINT4_KGroup_SFT", "AMXINT4_1KGroup_SFT")}
)
# Methods with a CPU backend in this build (online quantization from tensors).
WORKING_METHODS = frozenset(
    {"AMXINT4", "AMXINT8", "MOE_INT4", "MOE_INT8", "RAWINT4", "FP8", "BF16", "FP8_PERCHANNEL", "GPTQ_INT4", "LLAMAFILE",
     "MXFP4", "MXFP8"}
)


class KTMoEWrapper:
    """Factory: ``KTMoEWrapper(...)`` returns the backend object for ``method`` (as KT's does,
    ``isinstance(w, KTMoEWrapper)`` is False)."""

    def __new__(  # type: ignore[misc]
        cls,
        layer_idx: int,
        num_experts: int,
        num_experts_per_tok: int,
        hidden_size: int,
        moe_intermediate_size: int,
        gpu_experts_mask: Any = None,
        cpuinfer_threads: Optional[int] = None,
        threadpool_count: Optional[int] = None,
        weight_path: Optional[str] = None,
        chunked_prefill_size: Optional[int] = None,
        cpu_save: bool = False,
        max_deferred_experts_per_token: Optional[int] = None,
        method: str = "AMXINT4",
        numa_nodes: Optional[Sequence[int]] = None,
        mode: str = "inference",
        num_gpu_experts: int = 0,
        lora_rank: int = 16,
        lora_alpha: float = 32.0,
        lora_dropout: float = 0.0,
        max_cache_depth: int = 1,
        group_size: int = 128,
        zero_point: bool = True,
        full_weight_grad: bool = False,
        swiglu_limit: float = 0.0,
        swiglu_alpha: float = 0.0,
        scales: str = "absmax",
    ) -> Union[NativeMoEWrapper, SFTMoEWrapper]:
        if mode not in ("inference", "sft"):
            raise KTValueError(f"Unsupported mode: {mode!r}. Supported modes: ['inference', 'sft']")
        if scales not in ("absmax", "mse"):
            raise KTValueError(f"Unsupported scales: {scales!r}. Supported: ['absmax', 'mse']")
        if mode == "sft" and scales != "absmax":
            raise KTValueError("scales='mse' is for inference layers; SFT layers quantize with absmax")
        methods = INFERENCE_METHODS if mode == "inference" else SFT_METHODS
        if method not in methods:
            raise KTValueError(f"Unsupported method for mode={mode!r}: {method!r}. Supported methods: {sorted(methods)}")
        if (swiglu_limit != 0.0 or swiglu_alpha != 0.0) and method not in ("MXFP4", "MXFP8", "MXFP4_SFT"):
            raise KTValueError(
                f"swiglu_limit/swiglu_alpha are only supported for MXFP4/MXFP8 inference and MXFP4_SFT, got method={method!r} "
                f"swiglu_limit={swiglu_limit} swiglu_alpha={swiglu_alpha}"
            )
        for name, v in [
            ("cpuinfer_threads", cpuinfer_threads),
            ("threadpool_count", threadpool_count),
            ("chunked_prefill_size", chunked_prefill_size),
        ]:
            if v is None:
                raise KTTypeError(f"KTMoEWrapper() missing required argument: {name!r}")
        gpu_experts_mask = gpu_mask(gpu_experts_mask, num_gpu_experts, num_experts)
        common: dict[str, Any] = dict(
            layer_idx=layer_idx,
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            hidden_size=hidden_size,
            moe_intermediate_size=moe_intermediate_size,
            gpu_experts_mask=gpu_experts_mask,
            cpuinfer_threads=cpuinfer_threads,
            threadpool_count=threadpool_count,
            weight_path=weight_path,
            chunked_prefill_size=chunked_prefill_size,
            method=method,
            numa_nodes=numa_nodes,
        )
        if mode == "sft":
            from .sft import SFTMoEWrapper

            return SFTMoEWrapper(
                **common,
                lora_rank=lora_rank,
                lora_alpha=lora_alpha,
                lora_dropout=lora_dropout,
                max_cache_depth=max_cache_depth,
                group_size=group_size,
                full_weight_grad=full_weight_grad,
                swiglu_limit=swiglu_limit,
                swiglu_alpha=swiglu_alpha,
            )
        if method not in WORKING_METHODS:
            raise KTNotImplementedError(
                f"kt_kernel (kt-kernel-rs): method {method} has no CPU backend in this build yet; "
                f"working methods: {sorted(WORKING_METHODS)}"
            )
        return NativeMoEWrapper(
            **common,
            max_deferred_experts_per_token=max_deferred_experts_per_token,
            swiglu_limit=swiglu_limit,
            swiglu_alpha=swiglu_alpha,
            scales=scales,
        )

    @staticmethod
    def set_capture_batch_sizes(capture_bs: Sequence[int]) -> None:
        """The token counts whose staging buffers are kept (CUDA graph captures), process-wide."""
        CAPTURE_SIZES.set(list(capture_bs))

    @staticmethod
    def get_capture_batch_sizes() -> list[int]:
        return CAPTURE_SIZES.get()

    @staticmethod
    def clear_buffer_cache() -> None:
        """Drop this thread's staging buffers."""
        THIS_THREAD.staging.clear()


def generate_gpu_experts_masks(activation_freq: Any, num_gpu_experts: int) -> Any:
    """Bool ``[L, E]``: the ``num_gpu_experts`` most frequent (layer, expert) pairs over the whole
    table (clamped to ``[0, L*E]``), as a torch tensor for a torch input, else numpy."""
    if T.is_torch(activation_freq):
        torch = T.torch_module()
        freq = activation_freq.detach().to("cpu", torch.float64)
        n = max(0, min(int(num_gpu_experts), freq.numel()))
        mask = torch.zeros(freq.numel(), dtype=torch.bool)
        if n:
            mask[torch.topk(freq.flatten(), n).indices] = True
        return mask.reshape(freq.shape)
    freq = np.asarray(activation_freq, dtype=np.float64)
    if freq.ndim != 2:
        raise KTValueError(f"activation_freq must be [num_layers, num_experts], got shape {freq.shape}")
    n = max(0, min(int(num_gpu_experts), freq.size))
    mask = np.zeros(freq.size, dtype=bool)
    mask[np.argsort(-freq.ravel(), kind="stable")[:n]] = True
    return mask.reshape(freq.shape)


def select_deferred_experts(expert_ids: Any, expert_scores: Any, protected_k: int) -> tuple[Any, Any]:
    """KT's rule: an expert id is protected for the whole batch if it is among any token's
    ``protected_k`` highest-scored; returns (immediate ids, deferred ids), the other entries -1."""
    if T.is_torch(expert_ids):
        torch = T.torch_module()
        ids = expert_ids.to(torch.long)
        if protected_k <= 0:
            return torch.full_like(ids, -1), ids.clone()
        top = torch.topk(expert_scores, protected_k, dim=-1).indices
        protected_ids = torch.gather(ids, -1, top).flatten()
        keep = torch.isin(ids, protected_ids)
        return torch.where(keep, ids, -1), torch.where(keep, -1, ids)
    ids = np.asarray(expert_ids).astype(np.int64)
    if protected_k <= 0:
        return np.full_like(ids, -1), ids.copy()
    scores = np.asarray(expert_scores, dtype=np.float32)
    top = np.argsort(-scores, axis=-1, kind="stable")[..., :protected_k]
    keep = np.isin(ids, np.take_along_axis(ids, top, axis=-1).ravel())
    return np.where(keep, ids, -1), np.where(keep, -1, ids)


class NativeMoEWrapper(ExpertWeights):
    """The backend object ``KTMoEWrapper`` returns (KT's ``BaseMoEWrapper`` surface)."""

    def __init__(
        self,
        layer_idx: int,
        num_experts: int,
        num_experts_per_tok: int,
        hidden_size: int,
        moe_intermediate_size: int,
        gpu_experts_mask: Any,
        cpuinfer_threads: int,
        threadpool_count: int,
        weight_path: Optional[str],
        chunked_prefill_size: int,
        max_deferred_experts_per_token: Optional[int],
        method: str,
        numa_nodes: Optional[Sequence[int]],
        swiglu_limit: float = 0.0,
        swiglu_alpha: float = 0.0,
        scales: str = "absmax",
    ) -> None:
        check_sizes(num_experts, num_experts_per_tok, hidden_size, moe_intermediate_size, cpuinfer_threads,
                    threadpool_count, chunked_prefill_size)
        if num_experts_per_tok > num_experts:
            raise KTValueError(f"num_experts_per_tok ({num_experts_per_tok}) > num_experts ({num_experts})")
        if numa_nodes is not None and len(numa_nodes) != threadpool_count:
            raise KTValueError(f"numa_nodes has {len(numa_nodes)} entries but threadpool_count is {threadpool_count}")
        if cpuinfer_threads < threadpool_count:
            raise KTValueError(
                f"cpuinfer_threads ({cpuinfer_threads}) < threadpool_count ({threadpool_count}): "
                "every NUMA sub-pool needs at least one thread"
            )
        self.layer_idx = int(layer_idx)
        self.num_experts = int(num_experts)
        self.num_experts_per_tok = int(num_experts_per_tok)
        self.hidden_size = int(hidden_size)
        self.moe_intermediate_size = int(moe_intermediate_size)
        self.weight_path = weight_path
        self.chunked_prefill_size = int(chunked_prefill_size)
        self.max_deferred_experts_per_token = int(max_deferred_experts_per_token or 0)
        self.method = method
        self.gpu_experts_mask = self._own_mask(gpu_experts_mask)
        self.num_gpu_experts = int(self.gpu_experts_mask.sum())
        self.cpu_infer = cpu_infer(cpuinfer_threads, threadpool_count, numa_nodes)
        self.moe = ext.Moe(
            self.cpu_infer,
            self.num_experts,
            self.num_experts_per_tok,
            self.hidden_size,
            self.moe_intermediate_size,
            self.chunked_prefill_size,
            method,
            ptr(self.gpu_experts_mask),
            float(swiglu_limit or 0.0),
            float(swiglu_alpha or 0.0),
            skip_gpu_experts(),
            scales,
        )
        self._staging: Optional[Staged] = None
        self._submitted_deferred = False
        self._write: Optional[tuple[threading.Thread, dict[str, Any]]] = None

    # -- forward ---------------------------------------------------------------------------

    def submit_forward(self, hidden_states: Any, topk_ids: Any, topk_weights: Any, cuda_stream: int = 0) -> None:
        """Queue this layer's forward of ``hidden_states`` ``[..., H]`` routed by ``topk_ids`` and
        ``topk_weights`` ``[N, k]`` (on ``cuda_stream``'s order where given); returns at once."""
        h, k = self.hidden_size, self.num_experts_per_tok
        hidden_states, topk_ids, topk_weights = T.host(hidden_states), T.host(topk_ids), T.host(topk_weights)
        torch = T.is_torch(hidden_states)
        if not torch and not isinstance(hidden_states, np.ndarray):
            hidden_states = np.asarray(hidden_states)
        xs = tuple(hidden_states.shape)
        if not xs or xs[-1] != h:
            raise KTValueError(f"hidden_states must be [N, {h}], got shape {list(xs)}")
        n = 1
        for dim in xs[:-1]:
            n *= int(dim)
        if n > self.chunked_prefill_size:
            raise KTValueError(
                f"{n} tokens in one forward exceeds chunked_prefill_size={self.chunked_prefill_size}; "
                "split the batch or raise chunked_prefill_size"
            )
        for name, t in [("topk_ids", topk_ids), ("topk_weights", topk_weights)]:
            if tuple(t.shape) != (n, k):
                raise KTValueError(f"{name} must be [{n}, {k}] (tokens, num_experts_per_tok), got {list(t.shape)}")
        if T.is_torch(topk_ids):
            if topk_ids.dtype.is_floating_point:
                raise KTTypeError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
        elif np.asarray(topk_ids).dtype.kind not in "iu":
            raise KTTypeError(f"topk_ids must be an integer array, got {np.asarray(topk_ids).dtype}")
        if not torch and hidden_states.dtype.kind != "f":
            hidden_states = hidden_states.astype(np.float32)

        # Deferred experts wait to be added by the next KT layer of this thread's pass (whatever
        # its index: KT drops them when the next model layer is dense).
        me = THIS_THREAD
        if me.last_layer is None or self.layer_idx <= me.last_layer:
            me.pending, me.ordinal = None, 0  # a new pass: nothing carries over
        stream = int(cuda_stream or 0)
        st = Staging.get(n, h, k, hidden_states, torch)
        # Alternate slots by KT-layer order in the pass (KT uses layer_idx % 2, which hands a
        # layer the slot whose deferred task may still be reading when a dense layer sits between).
        slot = st.slots[me.ordinal % 2]
        st.put(slot.input, hidden_states, stream)
        st.put(slot.weights, topk_weights, stream)
        d = min(self.max_deferred_experts_per_token, k)
        if d > 0:
            imm, dfr = select_deferred_experts(topk_ids, topk_weights, k - d)
            st.put(slot.ids, imm, stream)
            st.put(slot.ids_deferred, dfr, stream)
        else:
            st.put(slot.ids, topk_ids, stream)

        addend = st.deferred_at if me.pending is st else 0
        x_at, ids_at, dfr_at, w_at, out_at = slot.at
        ticket = self.moe.submit_forward(self.cpu_infer, stream, st.bsz_at, x_at, st.code, ids_at, w_at, out_at, st.code, addend)
        if d > 0:
            self.moe.submit_forward(self.cpu_infer, stream, st.bsz_at, x_at, st.code, dfr_at, w_at, st.deferred_at, st.code, 0)
        me.pending = st if d > 0 else None
        me.last_layer = self.layer_idx
        me.ordinal += 1
        self._submitted_deferred = d > 0
        self._staging = (st, slot, xs, ticket)

    def sync_forward(self, hidden_states: Any = None, cuda_stream: int = 0) -> Any:
        """Wait for the forward :meth:`submit_forward` queued and return its output, shaped as its
        input (a torch tensor on the input's device, or a numpy array)."""
        if self._staging is None:
            raise KTRuntimeError("sync_forward without a submit_forward")
        return collect(self.cpu_infer, self._staging, int(cuda_stream or 0), 1 if self._submitted_deferred else 0)

    def forward(self, hidden_states: Any, topk_ids: Any, topk_weights: Any, cuda_stream: int = 0) -> Any:
        """:meth:`submit_forward`, then :meth:`sync_forward`."""
        self.submit_forward(hidden_states, topk_ids, topk_weights, cuda_stream)
        return self.sync_forward(hidden_states, cuda_stream)

    # -- layerwise prefill ------------------------------------------------------------------

    def submit_write_weight_scale_to_buffer(
        self,
        gpu_tp_count: int,
        expert_id: int,
        w13_weight_ptrs: Sequence[int],
        w13_scale_ptrs: Sequence[int],
        w2_weight_ptrs: Sequence[int],
        w2_scale_ptrs: Sequence[int],
    ) -> None:
        """KT fork's layerwise prefill (``--kt-gpu-prefill-token-threshold``): write slot
        ``expert_id`` into one set of host buffers per GPU tensor-parallel rank (addresses), in
        the GPU layer's layout and the checkpoint's encoding: ``w13`` = the rank's gate rows then
        its up rows ``[2·I/tp, H]``, ``w2`` = its columns of down ``[H, I/tp]``; bf16 (scale
        addresses unused, 0), fp8 e4m3 with f32 128×128-block or per-row scales,
        compressed-tensors int4 with bf16 ``[rows, cols/g]`` scales, or MXFP4 (DeepSeek-V4-Flash)
        e2m1 nibbles with its e8m0 scales as bf16 ``[rows, cols/32]``. Runs in the background;
        :meth:`sync_write_weight_scale_to_buffer` waits for it and raises its error. Needs the
        layer loaded by :meth:`load_weights` from a Hugging Face safetensors checkpoint."""
        if self._write is not None:
            raise KTRuntimeError("a write is already submitted: call sync_write_weight_scale_to_buffer first")
        tp = int(gpu_tp_count)
        lists = [w13_weight_ptrs, w13_scale_ptrs, w2_weight_ptrs, w2_scale_ptrs]
        names = ["w13_weight_ptrs", "w13_scale_ptrs", "w2_weight_ptrs", "w2_scale_ptrs"]
        for name, ptrs in zip(names, lists):
            if len(ptrs) != tp:
                raise KTValueError(f"{name} has {len(ptrs)} addresses, expected gpu_tp_count = {tp}")
        addrs = [[int(p) for p in ps] for ps in lists]
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["encoding"] = self.moe.write_gpu_expert(self.cpu_infer, int(expert_id), *addrs)
            except BaseException as e:  # re-raised by the sync, on the caller's thread
                result["error"] = e

        t = threading.Thread(target=run, name="kt-write-expert", daemon=True)
        t.start()
        self._write = (t, result)

    def sync_write_weight_scale_to_buffer(self) -> None:
        """Wait for the write :meth:`submit_write_weight_scale_to_buffer` started (nothing to
        wait for: returns at once, as KT's) and raise its error, if any."""
        if self._write is None:
            return
        t, result = self._write
        self._write = None
        t.join()
        if "error" in result:
            raise result["error"]

    def select_deferred_experts(self, expert_ids: Any, expert_scores: Any, protected_k: int) -> tuple[Any, Any]:
        return select_deferred_experts(expert_ids, expert_scores, protected_k)
