//! [`Matrix`]: a packed matrix with the microkernel chosen for it, once, when it was packed.

use kt_core::{PackedMatrix, QuantMatrix};

use crate::kernels::{max_run, panel_kernel, PanelRun};
use crate::pack::{self, Packed};

/// A matrix in 16-row panels and the panel kernel that runs it.
pub struct Matrix {
    /// The packed bytes and scales.
    pub w: Packed,
    /// Its panels' microkernel.
    pub run: PanelRun,
    /// Most tokens in one of its runs.
    pub max_run: usize,
}

impl Matrix {
    /// `m` packed, named `name`'s.
    pub fn pack(name: &'static str, m: &QuantMatrix) -> PackedMatrix {
        let w = pack::pack(m);
        let matrix = Matrix { run: panel_kernel(&w), max_run: max_run(&w), w };
        PackedMatrix::new(name, m.format(), m.rows(), m.cols(), matrix.w.bytes(), matrix)
    }
}
