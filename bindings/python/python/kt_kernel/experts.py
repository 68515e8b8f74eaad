"""``KTMoEWrapper`` with KT-Kernel's signature, defaults, method names and errors, returning a
backend object with KT's methods; ``generate_gpu_experts_masks``.

The native engine (``kt_kernel_ext.CpuInfer``) is process-wide: the first wrapper's
``cpuinfer_threads``/``threadpool_count``/``numa_nodes`` build it, later ones share it (as KT).
Forward tasks read pinned staging buffers by address when they run, so with a CUDA stream the
submit and the sync are host functions on that stream and CUDA graphs can capture them.
"""

import os
import threading

import numpy as np

from . import _tensors as T
from . import kt_kernel_ext as ext

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
    {"AMXINT4", "AMXINT8", "RAWINT4", "FP8", "BF16", "FP8_PERCHANNEL", "GPTQ_INT4", "LLAMAFILE", "MXFP4", "MXFP8"}
)


def _gpu_mask(mask, num_gpu_experts, num_experts):
    """The GPU-resident experts, given either way SGLang gives them: KT's fork passes
    ``gpu_experts_mask`` (``[E]`` bool), upstream SGLang passes ``num_gpu_experts`` (the experts
    with ids below it stay on the GPU) and no mask; neither means every expert on the CPU. Both
    are accepted when they agree on how many experts the GPU holds."""
    n = int(num_gpu_experts or 0)
    if not 0 <= n <= int(num_experts):
        raise ValueError(f"num_gpu_experts must be between 0 and num_experts ({num_experts}), got {num_gpu_experts}")
    if mask is None:
        if n == 0:
            return None
        m = np.zeros(int(num_experts), dtype=bool)
        m[:n] = True
        return m
    on_gpu = int(mask.bool().sum()) if T.is_torch(mask) else int(np.asarray(T.host(mask)).astype(bool).sum())
    if n and on_gpu != n:
        raise ValueError(
            f"gpu_experts_mask puts {on_gpu} experts on the GPU but num_gpu_experts is {n}: pass one of "
            "them (num_gpu_experts puts experts 0..n-1 on the GPU), or both in agreement"
        )
    return mask


class KTMoEWrapper:
    """Factory: ``KTMoEWrapper(...)`` returns the backend object for ``method`` (as KT's does,
    ``isinstance(w, KTMoEWrapper)`` is False)."""

    def __new__(
        cls,
        layer_idx,
        num_experts,
        num_experts_per_tok,
        hidden_size,
        moe_intermediate_size,
        gpu_experts_mask=None,
        cpuinfer_threads=None,
        threadpool_count=None,
        weight_path=None,
        chunked_prefill_size=None,
        cpu_save=False,
        max_deferred_experts_per_token=None,
        method="AMXINT4",
        numa_nodes=None,
        mode="inference",
        num_gpu_experts=0,
        lora_rank=16,
        lora_alpha=32.0,
        lora_dropout=0.0,
        max_cache_depth=1,
        group_size=128,
        zero_point=True,
        full_weight_grad=False,
        swiglu_limit=0.0,
        swiglu_alpha=0.0,
    ):
        if mode not in ("inference", "sft"):
            raise ValueError(f"Unsupported mode: {mode!r}. Supported modes: ['inference', 'sft']")
        methods = INFERENCE_METHODS if mode == "inference" else SFT_METHODS
        if method not in methods:
            raise ValueError(f"Unsupported method for mode={mode!r}: {method!r}. Supported methods: {sorted(methods)}")
        if (swiglu_limit != 0.0 or swiglu_alpha != 0.0) and method not in ("MXFP4", "MXFP8", "MXFP4_SFT"):
            raise ValueError(
                f"swiglu_limit/swiglu_alpha are only supported for MXFP4/MXFP8 inference and MXFP4_SFT, got method={method!r} "
                f"swiglu_limit={swiglu_limit} swiglu_alpha={swiglu_alpha}"
            )
        for name, v in [
            ("cpuinfer_threads", cpuinfer_threads),
            ("threadpool_count", threadpool_count),
            ("chunked_prefill_size", chunked_prefill_size),
        ]:
            if v is None:
                raise TypeError(f"KTMoEWrapper() missing required argument: {name!r}")
        gpu_experts_mask = _gpu_mask(gpu_experts_mask, num_gpu_experts, num_experts)
        common = dict(
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
            raise NotImplementedError(
                f"kt_kernel (kt-kernel-rs): method {method} has no CPU backend in this build yet; "
                f"working methods: {sorted(WORKING_METHODS)}"
            )
        return NativeMoEWrapper(
            **common,
            max_deferred_experts_per_token=max_deferred_experts_per_token,
            swiglu_limit=swiglu_limit,
            swiglu_alpha=swiglu_alpha,
        )

    @staticmethod
    def set_capture_batch_sizes(capture_bs):
        _Staging.capture_sizes = [int(n) for n in capture_bs]

    @staticmethod
    def get_capture_batch_sizes():
        return list(_Staging.capture_sizes)

    @staticmethod
    def clear_buffer_cache():
        _THREAD.staging.clear()


def generate_gpu_experts_masks(activation_freq, num_gpu_experts):
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
        raise ValueError(f"activation_freq must be [num_layers, num_experts], got shape {freq.shape}")
    n = max(0, min(int(num_gpu_experts), freq.size))
    mask = np.zeros(freq.size, dtype=bool)
    mask[np.argsort(-freq.ravel(), kind="stable")[:n]] = True
    return mask.reshape(freq.shape)


def select_deferred_experts(expert_ids, expert_scores, protected_k):
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


class _Slot:
    """One slot's staging buffers (KT keeps two per token count) and their addresses."""

    def __init__(self, alloc, n, h, k, act):
        self.input = alloc((n, h), act)
        self.ids = alloc((n, k), "i64")
        self.ids_deferred = alloc((n, k), "i64")
        self.weights = alloc((n, k), "f32")
        self.output = alloc((n, h), act)
        p = _Staging.ptr
        self.at = (p(self.input), p(self.ids), p(self.ids_deferred), p(self.weights), p(self.output))


class _PerThread(threading.local):
    """What one Python thread's forwards share: its staging buffers (so threads driving
    different layers at once never write each other's) and its pass through the layers (the
    deferred-expert hand-over and the slot order). KT keeps these process-wide; they are freed
    with the thread."""

    def __init__(self):
        self.staging = {}
        self.pending = None  # the staging set whose ``deferred_out`` the next layer adds
        self.last_layer = None  # the last layer submitted (a lower index starts a new pass)
        self.ordinal = 0


_THREAD = _PerThread()


class _Staging:
    """Staging buffers for one token count and tensor kind; kept forever for captured sizes,
    else only the last one used (as KT's ``KExpertsCPUBuffer``), per Python thread."""

    capture_sizes = []

    @classmethod
    def get(cls, n, h, k, like, torch):
        cache = _THREAD.staging
        key = (n, h, k, like.dtype, str(like.device) if torch else None)
        st = cache.get(key)
        if st is None:
            for old in [kk for kk in cache if kk[0] not in cls.capture_sizes]:
                del cache[old]
            st = cache[key] = _Staging(n, h, k, like)
        return st

    def __init__(self, n, h, k, like):
        self.torch = T.is_torch(like)
        if self.torch:
            torch = T.torch_module()
            pin = torch.cuda.is_available()
            dt = {"bf16": torch.bfloat16, "f32": torch.float32, "i64": torch.int64, "i32": torch.int32}

            def alloc(shape, code):
                return torch.zeros(shape, dtype=dt[code], pin_memory=pin)

            act = "bf16"  # KT's kernels consume bf16; copy_ converts
            self.code = "bf16"
            self.output_dev = torch.zeros((n, h), dtype=like.dtype, device=like.device)
        else:
            np_dt = {"i64": np.int64, "f32": np.float32, "i32": np.int32}

            def alloc(shape, code):
                return np.zeros(shape, dtype=np_dt.get(code, code))

            act = np.dtype(like.dtype) if T.float_code(like) else np.dtype(np.float32)
            self.code = T.float_code(np.zeros(1, act))
        self.slots = [_Slot(alloc, n, h, k, act), _Slot(alloc, n, h, k, act)]
        self.deferred_out = alloc((n, h), act)
        self.bsz = alloc((1,), "i32")
        self.bsz[0] = n
        self.bsz_at, self.deferred_at = self.ptr(self.bsz), self.ptr(self.deferred_out)

    @staticmethod
    def ptr(x):
        return int(x.data_ptr()) if T.is_torch(x) else int(x.ctypes.data)

    def put(self, dst, src, stream):
        """Copy ``src`` into the staging buffer ``dst`` (converting dtype). A torch copy from the
        GPU is non-blocking only with a stream: the task then runs after it as a host function
        on that stream; without one, the CPU task reads ``dst`` as soon as it is queued."""
        if self.torch:
            dst.copy_(src.reshape(dst.shape), non_blocking=bool(stream))
        elif T.is_torch(src):
            np.copyto(dst, src.detach().cpu().numpy().reshape(dst.shape), casting="unsafe")
        else:
            np.copyto(dst, np.asarray(src).reshape(dst.shape), casting="unsafe")


def _collect(cpu_infer, staged, stream, allow):
    """Wait for a staged forward (``(staging, slot, input shape, ticket)``; ``allow`` tasks may
    still run: its deferred experts) and return its output as the input was shaped."""
    st, slot, xs, ticket = staged
    if stream:
        cpu_infer.sync_with_cuda_stream(stream, allow)
    elif ticket is None:  # submitted on a stream, synced without one
        cpu_infer.sync(allow)
    else:
        # This forward's own task (its deferred experts may still run): other threads' tasks in
        # the shared queue neither hold it back nor let it return early.
        cpu_infer.sync_until(ticket)
    if st.torch:
        st.output_dev.copy_(slot.output, non_blocking=bool(stream))
        return st.output_dev.reshape(xs)
    # numpy: with a stream the result is ready only after the stream syncs, so the persistent
    # buffer is returned (as KT does); on the CPU path, a copy the caller owns.
    return slot.output.reshape(xs) if stream else slot.output.copy().reshape(xs)


_CPU_INFER = []


def check_sizes(num_experts, num_experts_per_tok, hidden_size, moe_intermediate_size, cpuinfer_threads,
                threadpool_count, chunked_prefill_size):
    """KT's ValueError for a size that is not positive, naming it."""
    for name, v in locals().items():
        if int(v) <= 0:
            raise ValueError(f"{name} must be positive, got {v}")


def skip_gpu_experts():
    """``KT_KERNEL_SKIP_GPU_EXPERTS``: ``1`` leaves the experts the mask puts on the GPU at load
    out of CPU memory (for a server that never updates the mask in place); unset or ``0`` keeps
    every expert, as KT does."""
    v = os.environ.get("KT_KERNEL_SKIP_GPU_EXPERTS", "0")
    if v not in ("0", "1"):
        raise ValueError(f"KT_KERNEL_SKIP_GPU_EXPERTS must be 0 or 1, got {v!r}")
    return v == "1"


def cpu_infer(cpuinfer_threads, threadpool_count, numa_nodes):
    """The process's one engine (KT's: the first configuration wins): ``cpuinfer_threads``
    threads in ``threadpool_count`` sub-pools on ``numa_nodes``."""
    if not _CPU_INFER:
        tp, threads = int(threadpool_count), int(cpuinfer_threads)
        counts = [threads // tp + (1 if i < threads % tp else 0) for i in range(tp)]
        _CPU_INFER.append(ext.CpuInfer(counts, None if numa_nodes is None else list(numa_nodes)))
    return _CPU_INFER[0]


class ExpertWeights:
    """Loading a layer's experts into ``self.moe`` (the native layer), shared by the inference
    and the SFT wrappers."""

    def _own_mask(self, mask):
        """The wrapper's own ``[E]`` bool mask, read live by every forward (update it in place)."""
        e = self.num_experts
        if mask is not None and T.shape(mask) != (e,):
            raise ValueError(f"gpu_experts_mask must have shape [{e}], got {T.shape(mask)}")
        if T.is_torch(mask):
            torch = T.torch_module()
            own = torch.zeros(e, dtype=torch.bool, pin_memory=torch.cuda.is_available())
            own.copy_(mask.to(torch.bool))
            return own
        own = np.zeros(e, dtype=bool)
        if mask is not None:
            own[:] = np.asarray(T.host(mask)).astype(bool)
        return own

    def load_weights(self, physical_to_logical_map_cpu=None):
        """Load this layer from ``weight_path`` and block until done (as KT's): for LLAMAFILE a
        GGUF model (a ``.gguf`` file, split files, or a directory of them) run in its own
        types; else KT's converted INT4/INT8 files (inference only), or a Hugging Face
        safetensors checkpoint (a directory, sharded or not, or one file) in any layout KT's
        loaders detect, bf16 / f16 / f32 / fp8 / int4, quantized on the CPU to this wrapper's
        method."""
        if self.weight_path is None:
            raise ValueError("weight_path is None: pass the checkpoint directory, or use load_weights_from_tensors")
        if not os.path.exists(self.weight_path):
            raise FileNotFoundError(f"weight_path {self.weight_path!r} does not exist")
        self.moe.load_from_checkpoint(self.cpu_infer, os.fspath(self.weight_path), self.layer_idx, self._map(physical_to_logical_map_cpu))

    def load_weights_from_tensors(self, gate_proj, up_proj, down_proj, physical_to_logical_map_cpu=None):
        """Quantize bf16/f16/f32 ``gate_proj``/``up_proj`` ``[E, I, H]`` and ``down_proj``
        ``[E, H, I]`` to this wrapper's method on the CPU (any method, not only KT's INT4/INT8)."""
        e, h, i = self.num_experts, self.hidden_size, self.moe_intermediate_size
        arrays, code = [], None
        for name, x, want in [("gate_proj", gate_proj, (e, i, h)), ("up_proj", up_proj, (e, i, h)), ("down_proj", down_proj, (e, h, i))]:
            x = T.host(x)
            if T.shape(x) != want:
                raise ValueError(f"{name} must have shape {list(want)}, got {list(T.shape(x))}")
            c = T.float_code(x)
            if c is None:
                if T.is_torch(x):
                    raise TypeError(f"{name}: expected bfloat16, float16 or float32, got {x.dtype}")
                x, c = np.asarray(x, dtype=np.float32), "f32"
            if code is not None and c != code:
                raise TypeError(f"gate_proj, up_proj and down_proj must share a dtype, got {code} and {c}")
            code = c
            arrays.append(T.to_host_array(x, name))
        m = self._map(physical_to_logical_map_cpu)
        (g, gp), (u, up), (d, dp) = arrays
        self.moe.load_from_arrays(self.cpu_infer, gp, up, dp, code, m)
        del g, u, d

    def _map(self, m):
        e = self.num_experts
        if m is None:
            return list(range(e))
        a = T.int_array(m, "physical_to_logical_map_cpu")
        if a.shape != (e,):
            raise ValueError(f"physical_to_logical_map_cpu must have shape [{e}], got {list(a.shape)}")
        return [int(v) for v in a]



class NativeMoEWrapper(ExpertWeights):
    """The backend object ``KTMoEWrapper`` returns (KT's ``BaseMoEWrapper`` surface)."""

    def __init__(
        self,
        layer_idx,
        num_experts,
        num_experts_per_tok,
        hidden_size,
        moe_intermediate_size,
        gpu_experts_mask,
        cpuinfer_threads,
        threadpool_count,
        weight_path,
        chunked_prefill_size,
        max_deferred_experts_per_token,
        method,
        numa_nodes,
        swiglu_limit=0.0,
        swiglu_alpha=0.0,
    ):
        check_sizes(num_experts, num_experts_per_tok, hidden_size, moe_intermediate_size, cpuinfer_threads,
                    threadpool_count, chunked_prefill_size)
        if num_experts_per_tok > num_experts:
            raise ValueError(f"num_experts_per_tok ({num_experts_per_tok}) > num_experts ({num_experts})")
        if numa_nodes is not None and len(numa_nodes) != threadpool_count:
            raise ValueError(f"numa_nodes has {len(numa_nodes)} entries but threadpool_count is {threadpool_count}")
        if cpuinfer_threads < threadpool_count:
            raise ValueError(
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
            _Staging.ptr(self.gpu_experts_mask),
            float(swiglu_limit or 0.0),
            float(swiglu_alpha or 0.0),
            skip_gpu_experts(),
        )
        self._staging = None
        self._submitted_deferred = False
        self._write = None

    # -- forward ---------------------------------------------------------------------------

    def submit_forward(self, hidden_states, topk_ids, topk_weights, cuda_stream=0):
        h, k = self.hidden_size, self.num_experts_per_tok
        hidden_states, topk_ids, topk_weights = T.host(hidden_states), T.host(topk_ids), T.host(topk_weights)
        torch = T.is_torch(hidden_states)
        if not torch and not isinstance(hidden_states, np.ndarray):
            hidden_states = np.asarray(hidden_states)
        xs = tuple(hidden_states.shape)
        if not xs or xs[-1] != h:
            raise ValueError(f"hidden_states must be [N, {h}], got shape {list(xs)}")
        n = 1
        for dim in xs[:-1]:
            n *= int(dim)
        if n > self.chunked_prefill_size:
            raise ValueError(
                f"{n} tokens in one forward exceeds chunked_prefill_size={self.chunked_prefill_size}; "
                "split the batch or raise chunked_prefill_size"
            )
        for name, t in [("topk_ids", topk_ids), ("topk_weights", topk_weights)]:
            if tuple(t.shape) != (n, k):
                raise ValueError(f"{name} must be [{n}, {k}] (tokens, num_experts_per_tok), got {list(t.shape)}")
        if T.is_torch(topk_ids):
            if topk_ids.dtype.is_floating_point:
                raise TypeError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
        elif np.asarray(topk_ids).dtype.kind not in "iu":
            raise TypeError(f"topk_ids must be an integer array, got {np.asarray(topk_ids).dtype}")
        if not torch and hidden_states.dtype.kind != "f":
            hidden_states = hidden_states.astype(np.float32)

        # Deferred experts wait to be added by the next KT layer of this thread's pass (whatever
        # its index: KT drops them when the next model layer is dense).
        me = _THREAD
        if me.last_layer is None or self.layer_idx <= me.last_layer:
            me.pending, me.ordinal = None, 0  # a new pass: nothing carries over
        stream = int(cuda_stream or 0)
        st = _Staging.get(n, h, k, hidden_states, torch)
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

    def sync_forward(self, hidden_states=None, cuda_stream=0):
        if self._staging is None:
            raise RuntimeError("sync_forward without a submit_forward")
        return _collect(self.cpu_infer, self._staging, int(cuda_stream or 0), 1 if self._submitted_deferred else 0)

    def forward(self, hidden_states, topk_ids, topk_weights, cuda_stream=0):
        self.submit_forward(hidden_states, topk_ids, topk_weights, cuda_stream)
        return self.sync_forward(hidden_states, cuda_stream)

    # -- layerwise prefill ------------------------------------------------------------------

    def submit_write_weight_scale_to_buffer(
        self, gpu_tp_count, expert_id, w13_weight_ptrs, w13_scale_ptrs, w2_weight_ptrs, w2_scale_ptrs
    ):
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
            raise RuntimeError("a write is already submitted: call sync_write_weight_scale_to_buffer first")
        tp = int(gpu_tp_count)
        lists = [w13_weight_ptrs, w13_scale_ptrs, w2_weight_ptrs, w2_scale_ptrs]
        names = ["w13_weight_ptrs", "w13_scale_ptrs", "w2_weight_ptrs", "w2_scale_ptrs"]
        for name, ptrs in zip(names, lists):
            if len(ptrs) != tp:
                raise ValueError(f"{name} has {len(ptrs)} addresses, expected gpu_tp_count = {tp}")
        ptrs = [[int(p) for p in ptrs] for ptrs in lists]
        result = {}

        def run():
            try:
                result["encoding"] = self.moe.write_gpu_expert(self.cpu_infer, int(expert_id), *ptrs)
            except BaseException as e:  # re-raised by the sync, on the caller's thread
                result["error"] = e

        t = threading.Thread(target=run, name="kt-write-expert", daemon=True)
        t.start()
        self._write = (t, result)

    def sync_write_weight_scale_to_buffer(self):
        """Wait for the write :meth:`submit_write_weight_scale_to_buffer` started (nothing to
        wait for: returns at once, as KT's) and raise its error, if any."""
        if self._write is None:
            return
        t, result = self._write
        self._write = None
        t.join()
        if "error" in result:
            raise result["error"]

    def select_deferred_experts(self, expert_ids, expert_scores, protected_k):
        return select_deferred_experts(expert_ids, expert_scores, protected_k)
