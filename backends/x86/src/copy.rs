//! Rows copied out in slices, one per destination (SGLang's layerwise buffers: down's rows cut
//! over the GPU ranks). A `memcpy` call per slice costs about as much as copying it when slices
//! are a few hundred bytes (768 for a qwen3 bf16 down row at tp 2); with AVX-512 the copy runs in
//! line, 256 bytes a step and the tail masked (docs/tuning.md, "Layerwise writes").

/// The byte mask of a 512-bit register's first `n` bytes (all of them from 64 on).
pub fn first_bytes(n: usize) -> u64 {
    if n >= 64 {
        u64::MAX
    } else {
        (1u64 << n) - 1
    }
}

/// Rows of `src` (`row` bytes each) cut into `dsts.len()` equal slices: slice `k` of row `i`
/// to `dsts[k] + first + i·slice`.
///
/// # Safety
/// Each destination is writable for `first + rows·slice` bytes, and none overlaps `src` or
/// another destination.
pub unsafe fn row_slices(src: &[u8], row: usize, dsts: &[*mut u8], first: usize) {
    if dsts.is_empty() || row == 0 {
        return;
    }
    #[cfg(all(target_arch = "x86_64", vnni_intrinsics))]
    if is_x86_feature_detected!("avx512bw") {
        // SAFETY: AVX-512F/BW checked; the rest is the caller's contract.
        return unsafe { row_slices_512(src, row, dsts, first) };
    }
    let slice = row / dsts.len();
    for (i, r) in src.chunks_exact(row).enumerate() {
        for (k, &d) in dsts.iter().enumerate() {
            // SAFETY: the caller's contract.
            unsafe { core::ptr::copy_nonoverlapping(r[k * slice..].as_ptr(), d.add(first + i * slice), slice) };
        }
    }
}

/// [`row_slices`] in 512-bit registers.
///
/// # Safety
/// As [`row_slices`]; AVX-512F/BW present.
#[cfg(all(target_arch = "x86_64", vnni_intrinsics))]
#[allow(clippy::incompatible_msrv)]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn row_slices_512(src: &[u8], row: usize, dsts: &[*mut u8], first: usize) {
    use core::arch::x86_64::*;
    let slice = row / dsts.len();
    // SAFETY: the caller's contract; every load lies in a slice of `src`, every store in a
    // destination's slice (the last 64 bytes masked to the slice's end).
    unsafe {
        for (i, r) in src.chunks_exact(row).enumerate() {
            for (k, &d) in dsts.iter().enumerate() {
                let (s, d) = (r[k * slice..].as_ptr(), d.add(first + i * slice));
                let mut j = 0;
                // Four registers loaded before any is stored.
                while j + 256 <= slice {
                    let v = [0, 64, 128, 192].map(|o| _mm512_loadu_si512(s.add(j + o).cast()));
                    for (o, v) in [0, 64, 128, 192].into_iter().zip(v) {
                        _mm512_storeu_si512(d.add(j + o).cast(), v);
                    }
                    j += 256;
                }
                // Whole registers unmasked: a masked store of a full register costs more
                // (docs/tuning.md, "Layerwise writes").
                while j + 64 <= slice {
                    _mm512_storeu_si512(d.add(j).cast(), _mm512_loadu_si512(s.add(j).cast()));
                    j += 64;
                }
                if j < slice {
                    let m = first_bytes(slice - j);
                    _mm512_mask_storeu_epi8(d.add(j).cast(), m, _mm512_maskz_loadu_epi8(m, s.add(j).cast()));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every slice where it belongs and nothing past it, for slices shorter than a register,
    /// of whole registers, of whole 256-byte steps and between, over 1-3 destinations, with
    /// and without an offset: the vector path where the CPU has AVX-512, else the plain one.
    #[test]
    fn each_slice_lands_at_its_destination() {
        for slice in [1, 7, 63, 64, 65, 200, 256, 300, 768, 1000] {
            for n in 1..=3 {
                let (rows, first, row) = (5, 3 * slice, n * slice);
                let src: Vec<u8> = (0..rows * row).map(|i| (i * 31 % 251) as u8).collect();
                let mut bufs = vec![vec![0xAAu8; first + rows * slice + 1]; n];
                let dsts: Vec<*mut u8> = bufs.iter_mut().map(|b| b.as_mut_ptr()).collect();
                // SAFETY: each buffer holds `first + rows·slice` bytes and a guard.
                unsafe { row_slices(&src, row, &dsts, first) };
                for (k, b) in bufs.iter().enumerate() {
                    let want: Vec<u8> = src.chunks(row).flat_map(|r| r[k * slice..(k + 1) * slice].to_vec()).collect();
                    assert!(b[..first].iter().all(|&x| x == 0xAA), "slice {slice}, {n} dsts: wrote before {first}");
                    assert_eq!(b[first..first + want.len()], want[..], "slice {slice}, {n} dsts, destination {k}");
                    assert_eq!(b[first + want.len()], 0xAA, "slice {slice}, {n} dsts: wrote past the end");
                }
            }
        }
    }
}
