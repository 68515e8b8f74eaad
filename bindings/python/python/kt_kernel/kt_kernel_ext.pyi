"""The native extension (Rust, pyo3). Its classes take raw addresses of C-contiguous host
buffers: the Python wrappers (``KTMoEWrapper``, ``kt_kernel.sft``) own those buffers and keep
them alive while a task may read them. Errors it raises are ``kt_kernel.errors``' classes."""

from typing import Optional, Sequence

__version__: str
__backend__: str
__cpu_variant__: str
__cpu_features__: str
__int8_kernel__: str

def cuda_host_blocks() -> int: ...
def topology() -> tuple[str, int, int, int]: ...
def convert(
    input: str,
    output: str,
    method: str = "AMXINT8",
    parts: int = 2,
    threads: int = 0,
    backward: bool = False,
    scales: str = "absmax",
) -> tuple[int, int]: ...
def gguf_dequantize(path: str, name: str) -> tuple[list[int], bytes]: ...

class CpuInfer:
    """The engine: sub-pools of ``subpool_thread_count[i]`` threads (on NUMA node
    ``subpool_numa_map[i]``) and KT's task queue."""

    def __init__(self, subpool_thread_count: Sequence[int], subpool_numa_map: Optional[Sequence[int]] = None) -> None: ...
    @property
    def threads(self) -> int: ...
    @property
    def placement(self) -> str: ...
    @property
    def scratch_bytes(self) -> int: ...
    @property
    def pending(self) -> int: ...
    def sync(self, allow_n_pending: int = 0) -> None: ...
    def sync_until(self, ticket: int) -> None: ...
    def sync_with_cuda_stream(self, stream: int, allow_n_pending: int = 0) -> None: ...
    def take_stream_error(self) -> None: ...

class Moe:
    """One inference layer; ``mask_ptr`` addresses its live ``[E]`` bool GPU mask (0: none)."""

    def __init__(
        self,
        infer: CpuInfer,
        experts: int,
        top_k: int,
        hidden: int,
        intermediate: int,
        max_tokens: int,
        method: str,
        mask_ptr: int,
        swiglu_limit: float = 0.0,
        swiglu_alpha: float = 0.0,
        skip_gpu_experts: bool = False,
        scales: str = "absmax",
    ) -> None: ...
    def load_from_arrays(
        self, infer: CpuInfer, gate: int, up: int, down: int, dtype: str, map: Sequence[int]
    ) -> None: ...
    def load_from_checkpoint(self, infer: CpuInfer, path: str, layer: int, map: Sequence[int]) -> None: ...
    def write_gpu_expert(
        self,
        infer: CpuInfer,
        expert: int,
        w13: Sequence[int],
        w13_scale: Sequence[int],
        w2: Sequence[int],
        w2_scale: Sequence[int],
    ) -> str: ...
    def submit_forward(
        self,
        infer: CpuInfer,
        stream: int,
        bsz: int,
        input: int,
        input_dtype: str,
        ids: int,
        weights: int,
        output: int,
        output_dtype: str,
        addend: int = 0,
    ) -> Optional[int]:
        """Queue a forward reading the staging buffers at these addresses when it runs; returns its
        ticket (``None`` when queued on ``stream``)."""
    @property
    def bytes(self) -> int: ...
    @property
    def loaded(self) -> bool: ...
    @property
    def backend(self) -> Optional[str]: ...

class SftMoe:
    """One SFT layer (forward with cache, backward, LoRA by address)."""

    def __init__(
        self,
        experts: int,
        top_k: int,
        hidden: int,
        intermediate: int,
        max_tokens: int,
        method: str,
        max_cache_depth: int = 1,
        group_size: int = 128,
        lora: bool = True,
        backward_weights: str = "bf16",
        mask_ptr: int = 0,
        swiglu_limit: float = 0.0,
        swiglu_alpha: float = 0.0,
    ) -> None: ...
    def load_from_arrays(
        self, infer: CpuInfer, gate: int, up: int, down: int, dtype: str, map: Sequence[int]
    ) -> None: ...
    def load_from_quantized(self, infer: CpuInfer, ptrs: Sequence[int], scale_dtype: str, map: Sequence[int]) -> None: ...
    def load_from_checkpoint(self, infer: CpuInfer, path: str, layer: int, map: Sequence[int]) -> None: ...
    def set_lora(self, rank: int, alpha: float, ptrs: tuple[int, int, int, int, int, int]) -> None: ...
    def set_lora_grads(self, ptrs: Optional[tuple[int, int, int, int, int, int]]) -> None: ...
    def set_base_grads(self, ptrs: Optional[tuple[int, int, int]]) -> None: ...
    def submit_forward(
        self,
        infer: CpuInfer,
        n: int,
        input: int,
        input_dtype: str,
        ids: int,
        weights: int,
        output: int,
        output_dtype: str,
        save: bool,
    ) -> int: ...
    def submit_backward(
        self,
        infer: CpuInfer,
        n: int,
        grad_output: int,
        grad_output_dtype: str,
        grad_input: int,
        grad_input_dtype: str,
        grad_weights: int,
        grad_scale: float,
    ) -> int: ...
    def submit_forward_inference(
        self,
        infer: CpuInfer,
        stream: int,
        bsz: int,
        input: int,
        input_dtype: str,
        ids: int,
        weights: int,
        output: int,
        output_dtype: str,
    ) -> Optional[int]: ...
    @property
    def cache_depth(self) -> int: ...
    @property
    def cache_bytes(self) -> int: ...
    def clear_cache(self) -> None: ...
    @property
    def loaded(self) -> bool: ...
    @property
    def backend(self) -> Optional[str]: ...
    @property
    def weight_bytes(self) -> int: ...
