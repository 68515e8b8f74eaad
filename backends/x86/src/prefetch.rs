//! Two-level software prefetch for kernels that stream packed weights once: L1 prefetches
//! alone keep too few lines in flight to reach DRAM bandwidth on a Xeon, so each stream also
//! prefetches further ahead into L2.

use core::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
use std::sync::OnceLock;

/// Prefetch `p + l1` into L1 and `p + l2` into L2.
#[inline(always)]
pub fn ahead(p: *const u8, l1: usize, l2: usize) {
    // SAFETY: prefetch never faults, even past the end of an allocation, and needs only SSE
    // (part of x86-64).
    unsafe {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(l1).cast());
        _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(l2).cast());
    }
}

/// Prefetch `p + l2` into L2 only.
#[inline(always)]
pub fn to_l2(p: *const u8, l2: usize) {
    // SAFETY: as in `ahead`.
    unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(l2).cast()) };
}

/// Whether a kernel that streams its weights once, as decode does, prefetches them into L1
/// as well as L2 ([`ahead`] rather than [`to_l2`]). Not on AMD family 19h with AVX-512, where
/// the L1 prefetch beside the L2 one slows the stream; elsewhere both, where L1 prefetches
/// alone kept too few lines in flight (docs/tuning.md, "Decode tiles prefetch").
pub fn l1_at_decode() -> bool {
    !zen4()
}

/// Whether the GGUF kernels' 32-column tiles, at decode, ask for each line of the third tile
/// ahead into L2 besides the next into L1 and the one after into L2 (`kt_backend_llamafile`;
/// not its K-quant kernels, which measured slower with it): where it was measured to pay, AMD
/// family 19h with AVX-512 (docs/tuning.md, "GGUF kernels").
pub fn far_at_decode() -> bool {
    zen4()
}

/// Zen 4: AMD family 19h with AVX-512 (Zen 3, the same family without it, runs the GGUF
/// kernels too, unmeasured with these choices).
fn zen4() -> bool {
    static ZEN4: OnceLock<bool> = OnceLock::new();
    *ZEN4.get_or_init(|| crate::isa::amd_family() == Some(0x19) && std::arch::is_x86_feature_detected!("avx512f"))
}

/// K groups (or scale blocks) ahead of the one in hand whose scales a kernel prefetches with
/// [`scales`]: a K-group or MX matrix's scales are a second stream beside its weights, 1/32 to
/// 1/4 of their bytes, which the hardware prefetchers left behind (the scale loads held most
/// of mxfp4 decode's kernel samples: docs/tuning.md, "scales prefetched").
pub const SCALE_GROUPS_AHEAD: usize = 8;

/// Prefetch a kernel's scales at `p` into L1 and 1 KB further into L2.
#[inline(always)]
pub fn scales(p: *const u8) {
    ahead(p, 0, 1024);
}

/// Prefetch share `i` of `n` of `bytes` into L2, a line at a time: a range that a loop of `n`
/// steps brings in while it computes, step `i` at a time (a panel's next rows while the tiles
/// work on this one's).
#[inline(always)]
pub fn share_to_l2(bytes: &[u8], i: usize, n: usize) {
    let share = bytes.len().div_ceil(n.max(1)).next_multiple_of(64);
    let end = ((i + 1) * share).min(bytes.len());
    let mut at = i * share;
    while at < end {
        // SAFETY: as in `ahead`; the address is inside `bytes`.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(bytes.as_ptr().add(at).cast()) };
        at += 64;
    }
}
