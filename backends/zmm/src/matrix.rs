//! [`Matrix`]: a packed matrix with the microkernel chosen for it, once, when it was packed.

use kt_core::{Error, PackedMatrix, QuantMatrix, WeightFormat};

use crate::kernels::{panel_kernel, PanelRun};
use crate::level::Level;
use crate::pack::{self, Packed};

/// A matrix packed for one [`Level`] and the panel kernel that level runs on it. Made only by
/// a [`Zmm`](crate::Zmm) (whose level this CPU runs), so its kernel runs here.
pub struct Matrix {
    /// The packed bytes and scales.
    pub w: Packed,
    /// Its panels' microkernel.
    run: PanelRun,
}

impl Matrix {
    /// `m` packed for `level`'s kernels.
    pub(crate) fn pack(m: &QuantMatrix, level: Level) -> Matrix {
        Matrix::with_kernel(pack::pack(m, level), level)
    }

    /// KT's packed bytes taken as they are where its layout holds the shape
    /// (`Backend::pack_kt`), else `None`.
    pub(crate) fn from_kt(
        level: Level,
        format: WeightFormat,
        rows: usize,
        cols: usize,
        bytes: &[u8],
        scales: &[f32],
    ) -> Option<Result<Matrix, Error>> {
        pack::kt_order(format, rows, cols)
            .then(|| Ok(Matrix::with_kernel(pack::from_kt(format, rows, cols, bytes, scales)?, level)))
    }

    fn with_kernel(w: Packed, level: Level) -> Matrix {
        Matrix { run: panel_kernel(level, &w), w }
    }

    /// Its panels' microkernel: runs on this CPU ([`Matrix`]'s maker's contract).
    pub fn run(&self) -> PanelRun {
        self.run
    }

    /// Wrapped for the backend named `name`.
    pub fn named(self, name: &'static str) -> PackedMatrix {
        let w = &self.w;
        PackedMatrix::new(name, w.format, w.rows, w.cols, w.bytes(), self)
    }
}
