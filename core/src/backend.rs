//! The `Backend` trait: what a compute backend (reference, AVX2, AVX-512, AMX, llamafile...)
//! provides. A backend's life cycle for one matrix: `supports` → `pack` (at load, in parallel
//! across experts) → `act_bytes`/`quantize_act` (per forward) → `gate_up`/`down` (per task).
//!
//! Backends *must* compute each output element in a fixed order that does not depend on the
//! row range or thread they run on, so that a forward is bit-identical for any thread count.

use alloc::boxed::Box;
use core::any::Any;
use core::fmt::Debug;
use core::ops::Range;

use half::bf16;

use crate::mat::MatMut;
use crate::{Error, QuantMatrix, WeightFormat};

/// A matrix in a backend's own layout. The backend that packed it is the only one that reads
/// `inner`; everyone else sees the shape and the byte count.
pub struct PackedMatrix {
    format: WeightFormat,
    rows: usize,
    cols: usize,
    bytes: usize,
    inner: Box<dyn Any + Send + Sync>,
}

impl PackedMatrix {
    /// Wrap a backend's packed representation of a `rows × cols` matrix taking `bytes` bytes.
    pub fn new<T: Any + Send + Sync>(format: WeightFormat, rows: usize, cols: usize, bytes: usize, inner: T) -> Self {
        PackedMatrix { format, rows, cols, bytes, inner: Box::new(inner) }
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
}

impl Debug for PackedMatrix {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "PackedMatrix({} {}x{}, {} bytes)", self.format, self.rows, self.cols, self.bytes)
    }
}

/// A compute backend. Object-safe; used as `&'static dyn Backend`.
pub trait Backend: Send + Sync + Debug {
    /// Short name, also its `KT_KERNEL_CPU_VARIANT` value: `reference`, `avx2`, `avx512`, `amx`.
    fn name(&self) -> &'static str;

    /// Higher is preferred when several can run.
    fn priority(&self) -> u32;

    /// `Ok` if this CPU can run the backend, else the missing feature.
    fn cpu_support(&self) -> Result<(), &'static str>;

    /// Can it run `format` on a `rows × cols` matrix? Declining is fine: the next backend serves.
    fn supports(&self, format: WeightFormat, rows: usize, cols: usize) -> bool;

    /// Row blocks handed to `gate_up`/`down` start at multiples of this (a microkernel's tile).
    fn row_granularity(&self, _format: WeightFormat) -> usize {
        1
    }

    /// Pack one logical matrix into the backend's layout (at load time).
    fn pack(&self, m: &QuantMatrix) -> Result<PackedMatrix, Error>;

    /// Bytes of prepared activations for `rows` tokens of width `cols` (scratch is 64-aligned).
    fn act_bytes(&self, format: WeightFormat, rows: usize, cols: usize) -> usize;

    /// Prepare activations: row `i` of the result is `src[rows[i]·cols ..][..cols]`, converted
    /// (bf16 kept, or int8 per token with scales) into `dst[..act_bytes(format, rows.len(), cols)]`.
    fn quantize_act(&self, format: WeightFormat, cols: usize, src: &[bf16], rows: &[u32], dst: &mut [u8]);

    /// `h[t][r - rows.start] = bf16(silu(bf16(g)) · bf16(u))` with `g`, `u` the gate and up rows
    /// `r` applied to activation row `t`, for `t < h.rows()`.
    fn gate_up(&self, gate: &PackedMatrix, up: &PackedMatrix, rows: Range<usize>, act: &[u8], h: MatMut<'_, bf16>);

    /// `y[t][r - rows.start] = down row r · activation row t`, in f32.
    fn down(&self, down: &PackedMatrix, rows: Range<usize>, act: &[u8], y: MatMut<'_, f32>);

    /// Whether the int8 dot kernels for `format` run on VNNI's `vpdpbusd` on this CPU: a
    /// benchmark then sets them against the VNNI peak, not the AVX2 one.
    fn uses_vnni(&self, _format: WeightFormat) -> bool {
        false
    }
}
