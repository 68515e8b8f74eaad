//! [`Matrix`]: a packed matrix with the microkernel chosen for it, once, when it was packed.

use kt_core::{Error, PackedMatrix, QuantMatrix, WeightFormat};

use crate::kernels::{panel_kernel, stage_fp8, staged_kernel, PanelRun, StagedRun};
use crate::level::Level;
use crate::pack::{self, Packed};

/// A matrix packed for one [`Level`] and the panel kernel that level runs on it. Made only by
/// a [`Zmm`](crate::Zmm) (whose level this CPU runs), so its kernel runs here.
pub struct Matrix {
    /// The packed bytes and scales.
    pub w: Packed,
    /// Its panels' microkernel.
    run: PanelRun,
    /// The microkernel on a panel decoded once for all of a task's token tiles, where this
    /// level and format have one.
    staged: Option<StagedRun>,
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
        Matrix { run: panel_kernel(level, &w), staged: staged_kernel(level, &w), w }
    }

    /// Its panels' microkernel: runs on this CPU ([`Matrix`]'s maker's contract).
    pub fn run(&self) -> PanelRun {
        self.run
    }

    /// Bytes a panel staged takes, where this matrix's tiles can read one ([`Matrix::stage`]).
    pub fn stage_bytes(&self) -> Option<usize> {
        self.staged.map(|_| 2 * self.w.panel_bytes())
    }

    /// Panel `p` decoded into `stage` ([`Matrix::stage_bytes`] long), and the microkernel that
    /// reads it there; `None` where this matrix has no staged kernel.
    pub fn stage(&self, p: usize, stage: &mut [u8]) -> Option<StagedRun> {
        let run = self.staged?;
        // SAFETY: a staged kernel exists only at the bf16 level (VBMI included), which this CPU
        // runs (the maker's contract), for fp8 in pairs, which `stage_fp8` decodes.
        unsafe { stage_fp8(&self.w, p, stage) };
        Some(run)
    }

    /// Wrapped for the backend named `name`.
    pub fn named(self, name: &'static str) -> PackedMatrix {
        let w = &self.w;
        PackedMatrix::new(name, w.format, w.rows, w.cols, w.bytes(), self)
    }
}
