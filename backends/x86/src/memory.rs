//! Buffers for packed weights.

use kt_core::aligned::AlignedBuf;

/// A zeroed buffer for `len` bytes of packed weights, on huge pages where it is large: the
/// hardware prefetchers stop at 4 KiB page boundaries and decode streams megabytes per expert.
/// 2 MiB-aligned and `MADV_HUGEPAGE` before first touch (a no-op where transparent huge pages
/// are off).
pub fn weight_buffer(len: usize) -> AlignedBuf {
    const HUGE: usize = 2 << 20;
    if len < HUGE / 2 {
        return AlignedBuf::zeroed(len);
    }
    AlignedBuf::zeroed_advised(len, HUGE, |p, len| {
        #[cfg(target_os = "linux")]
        // SAFETY: the range lies inside the buffer's own allocation; madvise only sets a hint.
        unsafe {
            libc::madvise(p.cast(), len, libc::MADV_HUGEPAGE);
        }
    })
}
