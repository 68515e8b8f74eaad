//! 64-byte aligned, zero-initialised byte buffers for packed weights and scratch: cache-line
//! aligned so SIMD kernels may use aligned loads and no two threads' regions share a line edge
//! by accident of the allocator.

use alloc::alloc::{alloc_zeroed, dealloc, handle_alloc_error};
use core::alloc::Layout;
use core::ptr::NonNull;

/// Alignment of every [`AlignedBuf`].
pub const ALIGN: usize = 64;

/// Round `n` up to a multiple of [`ALIGN`].
#[inline]
pub const fn round_up(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

/// An owned, zeroed byte buffer aligned to at least 64 bytes.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    align: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out &[u8].
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes, 64-byte aligned.
    pub fn zeroed(len: usize) -> Self {
        Self::zeroed_aligned(len, ALIGN)
    }

    /// A zeroed buffer of `len` bytes aligned to `align` (a power of two ≥ 64).
    pub fn zeroed_aligned(len: usize, align: usize) -> Self {
        let align = align.max(ALIGN);
        if len == 0 {
            return AlignedBuf { ptr: NonNull::<[u8; ALIGN]>::dangling().cast(), len: 0, align };
        }
        let layout = Self::layout(len, align);
        // SAFETY: layout has non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| handle_alloc_error(layout));
        AlignedBuf { ptr, len, align }
    }

    fn layout(len: usize, align: usize) -> Layout {
        // align is a power of two and len < isize::MAX for any allocation that can succeed.
        Layout::from_size_align(len, align).unwrap_or_else(|_| handle_alloc_error(Layout::new::<u8>()))
    }

    /// Make the buffer at least `len` bytes long. Contents are not kept when it grows: scratch
    /// is rewritten by every use.
    pub fn ensure(&mut self, len: usize) {
        if self.len < len {
            *self = AlignedBuf::zeroed_aligned(len, self.align);
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// `true` when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised (zeroed) bytes, or dangling with len 0.
        unsafe { core::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self gives exclusive access.
        unsafe { core::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Default for AlignedBuf {
    fn default() -> Self {
        AlignedBuf::zeroed(0)
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.len != 0 {
            // SAFETY: allocated in `zeroed_aligned` with this exact layout.
            unsafe { dealloc(self.ptr.as_ptr(), Self::layout(self.len, self.align)) }
        }
    }
}

impl core::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_zeroed() {
        let mut b = AlignedBuf::zeroed(100);
        assert_eq!(b.as_slice().as_ptr() as usize % ALIGN, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice()[99] = 7;
        b.ensure(50);
        assert_eq!(b.as_slice()[99], 7);
        b.ensure(1000);
        assert_eq!(b.len(), 1000);
        assert_eq!(AlignedBuf::default().as_slice().len(), 0);
        let big = AlignedBuf::zeroed_aligned(3 << 20, 2 << 20);
        assert_eq!(big.as_slice().as_ptr() as usize % (2 << 20), 0);
    }
}
