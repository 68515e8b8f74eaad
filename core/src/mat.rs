//! `MatMut`: a mutable, row-strided 2-D view, the output argument of every kernel. Rows are
//! tokens, columns the output rows of the weight block the task owns.
//!
//! Tasks of one stage write disjoint column blocks of the same token-major buffer; `SharedMut`
//! is the one place that hands such views out, under the plan's disjointness guarantee.

use core::marker::PhantomData;
use core::ops::Range;
use core::ptr::NonNull;

/// A `rows × cols` mutable view with row stride `stride` (elements).
pub struct MatMut<'a, T> {
    ptr: NonNull<T>,
    rows: usize,
    cols: usize,
    stride: usize,
    _life: PhantomData<&'a mut T>,
}

// SAFETY: MatMut is a unique borrow of its elements, like &mut [T].
unsafe impl<T: Send> Send for MatMut<'_, T> {}

impl<'a, T> MatMut<'a, T> {
    /// A view over a slice. Panics if the slice is too short (a caller bug, not user input).
    pub fn from_slice(s: &'a mut [T], rows: usize, cols: usize, stride: usize) -> Self {
        assert!(cols <= stride || rows <= 1, "MatMut: cols {cols} > stride {stride}");
        assert!(rows == 0 || (rows - 1) * stride + cols <= s.len(), "MatMut: slice too short");
        MatMut { ptr: NonNull::from(s).cast(), rows, cols, stride, _life: PhantomData }
    }

    /// Rows (tokens).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Row `r` (`cols` elements).
    pub fn row_mut(&mut self, r: usize) -> &mut [T] {
        assert!(r < self.rows, "MatMut row {r} out of {}", self.rows);
        // SAFETY: rows/cols/stride were checked against the borrowed region at construction.
        unsafe { core::slice::from_raw_parts_mut(self.ptr.as_ptr().add(r * self.stride), self.cols) }
    }
}

/// A mutable buffer that tasks running in parallel write in disjoint regions.
pub(crate) struct SharedMut<'a, T> {
    ptr: *mut T,
    len: usize,
    _life: PhantomData<&'a mut [T]>,
}

// SAFETY: access goes through the unsafe methods whose contract forbids overlapping regions.
unsafe impl<T: Send> Sync for SharedMut<'_, T> {}
// SAFETY: as above.
unsafe impl<T: Send> Send for SharedMut<'_, T> {}

impl<'a, T> SharedMut<'a, T> {
    pub(crate) fn new(s: &'a mut [T]) -> Self {
        SharedMut { ptr: s.as_mut_ptr(), len: s.len(), _life: PhantomData }
    }

    /// # Safety
    /// No other live reference (from this or another call) may overlap `range`.
    pub(crate) unsafe fn slice_mut(&self, range: Range<usize>) -> &'a mut [T] {
        assert!(range.start <= range.end && range.end <= self.len, "SharedMut range out of bounds");
        // SAFETY: in bounds (checked); exclusivity is the caller's contract.
        unsafe { core::slice::from_raw_parts_mut(self.ptr.add(range.start), range.len()) }
    }

    /// A `rows × cols` view at `offset` with row stride `stride`.
    ///
    /// # Safety
    /// No other live reference may overlap the elements of the view.
    pub(crate) unsafe fn mat_mut(&self, offset: usize, rows: usize, cols: usize, stride: usize) -> MatMut<'a, T> {
        assert!(rows == 0 || offset + (rows - 1) * stride + cols <= self.len, "SharedMut view out of bounds");
        MatMut {
            // SAFETY: offset is in bounds (checked above) and ptr is non-null.
            ptr: unsafe { NonNull::new_unchecked(self.ptr.add(offset)) },
            rows,
            cols,
            stride,
            _life: PhantomData,
        }
    }
}

/// Columns `r` of the rows of `src` (row-major, `cols` wide) into `dst` (`r.len()` wide): a
/// NUMA part's slice of a matrix whose columns the parts split.
pub fn copy_columns<T: Copy>(src: &[T], cols: usize, r: Range<usize>, dst: &mut [T]) {
    if r.is_empty() || cols == 0 {
        return;
    }
    for (row, out) in src.chunks_exact(cols).zip(dst.chunks_exact_mut(r.len())) {
        out.copy_from_slice(&row[r.clone()]);
    }
}

/// [`copy_columns`] into a new matrix.
pub fn columns<T: Copy + Default>(src: &[T], cols: usize, r: Range<usize>) -> alloc::vec::Vec<T> {
    let mut out = alloc::vec![T::default(); src.len() / cols.max(1) * r.len()];
    copy_columns(src, cols, r, &mut out);
    out
}

/// The inverse of [`copy_columns`]: columns `r` of `dst` (`cols` wide) set from `src`
/// (`r.len()` wide).
pub fn set_columns<T: Copy>(dst: &mut [T], cols: usize, r: Range<usize>, src: &[T]) {
    if r.is_empty() || cols == 0 {
        return;
    }
    for (row, part) in dst.chunks_exact_mut(cols).zip(src.chunks_exact(r.len())) {
        row[r.clone()].copy_from_slice(part);
    }
}
