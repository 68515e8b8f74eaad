//! The `Backend` trait: what a compute backend (reference, AVX2, AVX-512, AMX, llamafile...)
//! provides, and its life cycle for one layer:
//!
//! ```text
//!  load:     serves(format, rows, cols)?  ->  pack(matrix)            (once, in parallel)
//!  forward:  scratch_bytes(...)           ->  the executor gives each worker that much, once
//!            act_layout / act_bytes       ->  quantize_act            (once per layout and expert)
//!            gate_up / down                                           (per task, worker's scratch)
//! ```
//!
//! **For backend authors.** A backend *must* compute each output element in a fixed order that
//! does not depend on the row range or thread it runs on (results are bit-identical for any
//! thread count), *must not* allocate in `quantize_act`, `gate_up` or `down` (ask for scratch
//! instead: a forward after warm-up performs no heap allocation), and *must not* panic on
//! shapes it said it serves. A backend *should* choose a matrix's kernels once, when it packs
//! it, and keep them in its representation ([`PackedMatrix::inner`]): a call then goes from
//! the trait to the chosen kernel with no feature test or format match on the way. A format it
//! does not serve is simply not claimed, and another backend runs it.

use alloc::boxed::Box;
use core::any::Any;
use core::fmt::Debug;
use core::ops::Range;

use half::bf16;

use crate::bias::GateUpBias;
use crate::mat::MatMut;
use crate::swiglu::Glu;
use crate::{Error, LayerFormat, QuantMatrix, WeightFormat};

/// A matrix in a backend's own layout. The backend that packed it is the only one that reads
/// `inner`; everyone else sees the shape, the byte count and which backend packed it.
pub struct PackedMatrix {
    packed_by: &'static str,
    format: WeightFormat,
    rows: usize,
    cols: usize,
    bytes: usize,
    inner: Box<dyn Any + Send + Sync>,
}

impl PackedMatrix {
    /// Wrap the representation backend `packed_by` (its [`Backend::name`]) made of a
    /// `rows × cols` matrix taking `bytes` bytes.
    pub fn new<T: Any + Send + Sync>(
        packed_by: &'static str,
        format: WeightFormat,
        rows: usize,
        cols: usize,
        bytes: usize,
        inner: T,
    ) -> Self {
        PackedMatrix { packed_by, format, rows, cols, bytes, inner: Box::new(inner) }
    }
    /// The backend that packed it: [`crate::forward::LayerWeights`] accepts it only into a
    /// layer of that backend, so every kernel is handed its own layout.
    pub fn packed_by(&self) -> &'static str {
        self.packed_by
    }
    /// The format it was packed from.
    pub fn format(&self) -> WeightFormat {
        self.format
    }
    /// Output rows.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Input columns.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Bytes held (what a decode streams from memory).
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    /// The backend's representation, if it is a `T`.
    pub fn get<T: Any>(&self) -> Option<&T> {
        self.inner.downcast_ref()
    }

    /// The backend's representation, which the backend packed as a `T`: what its `gate_up`
    /// and `down` read (the kernels chosen for the matrix among it).
    ///
    /// # Panics
    /// If it is not a `T`: another backend packed it. A layer admits only its own backend's
    /// matrices ([`crate::forward::LayerWeights`]); a direct caller of [`Backend`] must too.
    #[track_caller]
    pub fn inner<T: Any>(&self) -> &T {
        match self.inner.downcast_ref() {
            Some(t) => t,
            None => panic!("a matrix packed by `{}` was handed to another backend", self.packed_by),
        }
    }
}

impl Debug for PackedMatrix {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "PackedMatrix({} {}x{}, {} bytes, {})", self.format, self.rows, self.cols, self.bytes, self.packed_by)
    }
}

/// The instruction family a format's inner loop runs on: a description of the kernel, from
/// which a benchmark picks the peak to judge it against.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Instructions {
    /// Plain scalar code (the reference backend).
    Scalar,
    /// f32 fused multiply-add on vectors (bf16/fp8/f16 weights widened to f32).
    FmaF32,
    /// int8 products summed by pairs (`vpmaddubsw`/`vpmaddwd`, AVX2).
    Int8Pairs,
    /// int8 products summed by fours into i32 (`vpdpbusd`, AVX-VNNI or AVX512-VNNI).
    Int8Vnni,
    /// f32 fused multiply-add on 512-bit registers (AVX-512F).
    FmaF32Zmm,
    /// int8 products summed by pairs on 512-bit registers (AVX-512BW without VNNI).
    Int8PairsZmm,
    /// bf16 pairs' products summed into f32 on 512-bit registers (`vdpbf16ps`, AVX512-BF16).
    Bf16DotZmm,
    /// int8 tiles (`tdpbusd`, AMX-INT8) for many tokens, [`Instructions::Int8Vnni`] for few.
    AmxInt8,
    /// bf16 tiles (`tdpbf16ps`, AMX-BF16) for many tokens, [`Instructions::Bf16DotZmm`] for few.
    AmxBf16,
}

/// Which prepared-activation layout a backend's kernels for a format read. Two formats with the
/// same layout share one prepared copy; a forward prepares each distinct layout once per expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ActLayout(pub u32);

/// What one forward asks of a backend's scratch: its largest task.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TaskShape {
    /// The layer's formats.
    pub format: LayerFormat,
    /// Most tokens (rows of activations) one task sees.
    pub tokens: usize,
    /// Most weight rows one `gate_up` or `down` task computes (a forward passes the most any
    /// routing could give it: a part's intermediate rows or `hidden`).
    pub rows: usize,
    /// Widest activation row one task reads (hidden, or a part's intermediate size).
    pub cols: usize,
}

/// A compute backend. Object-safe; used as `&'static dyn Backend`.
pub trait Backend: Send + Sync + Debug {
    /// Short name, unique among backends; also its `KT_KERNEL_CPU_VARIANT` value.
    fn name(&self) -> &'static str;

    /// KT's name for what runs (`kt_kernel.__cpu_variant__`): the backend's name, or for a
    /// backend that picks its instructions at run time, the sub-variant it picked.
    fn variant(&self) -> &'static str {
        self.name()
    }

    /// `Ok` if this CPU can run the backend, else the missing feature.
    fn cpu_support(&self) -> Result<(), &'static str>;

    /// Whether it runs `format` on a `rows × cols` matrix. This is the whole of selection: the
    /// best backend of the registry that serves every matrix of a layer runs it.
    fn serves(&self, format: WeightFormat, rows: usize, cols: usize) -> bool;

    /// Row blocks handed to `gate_up`/`down` start at multiples of this (a microkernel's tile).
    fn row_granularity(&self, _format: WeightFormat) -> usize {
        1
    }

    /// Pack one logical matrix into the backend's layout (at load time). The result names this
    /// backend ([`PackedMatrix::packed_by`]).
    fn pack(&self, m: &QuantMatrix) -> Result<PackedMatrix, Error>;

    /// Pack a per-row int8 or int4 matrix given in KT's packed bytes
    /// ([`crate::format::kt_packed`], a converted file's tensor) with its per-row scales, by
    /// copying, if this backend keeps that order for this shape; `None` if it does not (the
    /// loader then unpacks it and calls [`Backend::pack`]).
    fn pack_kt(
        &self,
        _format: WeightFormat,
        _rows: usize,
        _cols: usize,
        _bytes: &[u8],
        _scales: &[f32],
    ) -> Option<Result<PackedMatrix, Error>> {
        None
    }

    /// The activation layout `format`'s kernels read (for a backend whose layout depends on
    /// the token count: at the counts where it does not, [`Backend::act_layout_for`]).
    fn act_layout(&self, format: WeightFormat) -> ActLayout;

    /// The activation layout `format`'s kernels read for an expert of `tokens` tokens: what
    /// `quantize_act` prepares for that many rows. A forward prepares one copy for gate and up
    /// where theirs agree. The default is [`Backend::act_layout`], for a backend whose layout
    /// is the same at every count.
    fn act_layout_for(&self, format: WeightFormat, _tokens: usize) -> ActLayout {
        self.act_layout(format)
    }

    /// Bytes of prepared activations for `rows` tokens of width `cols` (scratch is 64-aligned).
    /// *Must* be at most linear in `rows` up to 64 bytes: the forward sizes its buffers by
    /// `act_bytes(all rows) + 64` per expert, whatever the routing.
    fn act_bytes(&self, format: WeightFormat, rows: usize, cols: usize) -> usize;

    /// The SFT forward's LoRA products and SwiGLU ([`crate::sft::SftKernels`]); the SwiGLU
    /// must be the one `gate_up` runs, so that an SFT forward with zero LoRA keeps the
    /// inference forward's bits.
    fn sft_kernels(&self) -> &'static crate::sft::SftKernels {
        &crate::sft::PORTABLE
    }

    /// Bytes of scratch one task may use at most, for tasks up to `shape`. Each worker owns a
    /// buffer this large (64-byte aligned), allocated once and handed to every task it runs.
    fn scratch_bytes(&self, _shape: TaskShape) -> usize {
        0
    }

    /// Prepare activations: row `i` of the result is `src[rows[i]·cols ..][..cols]`, converted
    /// (bf16 kept, or int8 per token with scales) into `dst[..act_bytes(format, rows.len(), cols)]`.
    fn quantize_act(
        &self,
        format: WeightFormat,
        cols: usize,
        src: &[bf16],
        rows: &[u32],
        dst: &mut [u8],
        scratch: &mut [u8],
    );

    /// `h[t][r - rows.start] = glu.apply(g, u)` (`bf16(silu(bf16(g)) · bf16(u))` for plain
    /// SwiGLU) with `g`, `u` the gate and up rows `r` applied to activation row `t` (plus
    /// `bias.gate[r]`, `bias.up[r]` in f32 where given), for `t < h.rows()`. `act_gate` and
    /// `act_up` are prepared for each one's format (the same slice when their layouts agree).
    #[allow(clippy::too_many_arguments)]
    fn gate_up(
        &self,
        gate: &PackedMatrix,
        up: &PackedMatrix,
        rows: Range<usize>,
        act_gate: &[u8],
        act_up: &[u8],
        glu: Glu,
        bias: Option<GateUpBias<'_>>,
        h: MatMut<'_, bf16>,
        scratch: &mut [u8],
    );

    /// `y[t][r - rows.start] = down row r · activation row t`, in f32.
    fn down(&self, down: &PackedMatrix, rows: Range<usize>, act: &[u8], y: MatMut<'_, f32>, scratch: &mut [u8]);

    /// The instruction family `format`'s kernels run on, on this CPU.
    fn instructions(&self, format: WeightFormat) -> Instructions;
}
