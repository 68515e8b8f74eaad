//! The float types (f32, f16, bf16): rows converted to f32 a block of columns at a time and
//! dotted with every token by FMA.

use super::*;

/// Columns of the float rows converted at a time, into a buffer on the stack.
pub(super) const FLOAT_COLS: usize = 256;

/// Float rows: per block of [`FLOAT_COLS`] columns, each row converted to f32 once and dotted
/// with every token; the blocks' sums added in column order.
///
/// # Safety
/// The CPU has the features the function enables or its caller's do (AVX2, FMA, F16C; VNNI or AVX-512 in `on_vnni`/`on_zmm`), and its slices hold what its doc says.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn float(
    t: GgmlType,
    rows: [&[u8]; R],
    nr: usize,
    cols: usize,
    act: &[f32],
    n: usize,
    out: &mut [[f32; R]],
) {
    let mut buf = [[0.0f32; FLOAT_COLS]; R];
    out[..n].fill([0.0; R]);
    let elem = t.block_bytes();
    for c0 in (0..cols).step_by(FLOAT_COLS) {
        let width = FLOAT_COLS.min(cols - c0);
        for (b, src) in buf.iter_mut().zip(rows).take(nr) {
            let (b, src) = (&mut b[..width], &src[c0 * elem..(c0 + width) * elem]);
            let mut c = 0;
            if t == GgmlType::F16 {
                while c + 8 <= width {
                    // SAFETY: 16 bytes of src and 8 floats of b at c.
                    unsafe {
                        let h = _mm_loadu_si128(src.as_ptr().add(2 * c).cast());
                        _mm256_storeu_ps(b.as_mut_ptr().add(c), _mm256_cvtph_ps(h));
                    }
                    c += 8;
                }
            }
            ggml::dequantize_row(t, &src[c * elem..], &mut b[c..]);
        }
        for (tok, o) in out[..n].iter_mut().enumerate() {
            let x = &act[tok * cols + c0..tok * cols + c0 + width];
            for (i, w) in buf.iter().enumerate().take(nr) {
                // SAFETY: AVX2 and FMA by this function's features.
                o[i] += unsafe { dot_f32(&w[..width], x) };
            }
        }
    }
}

/// `Σ w·x` in four 8-lane accumulators, then the tail in order.
///
/// # Safety
/// The CPU supports AVX2 and FMA; `x` is at least as long as `w`.
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(super) unsafe fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut c = 0;
    while c + 32 <= w.len() {
        for (k, a) in acc.iter_mut().enumerate() {
            // SAFETY: c + 8k + 8 ≤ len for both slices; AVX2 and FMA by the caller's features.
            unsafe {
                let wv = _mm256_loadu_ps(w.as_ptr().add(c + 8 * k));
                *a = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x.as_ptr().add(c + 8 * k)), *a);
            }
        }
        c += 32;
    }
    // SAFETY: AVX by the caller's features.
    let mut s = unsafe { hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]))) };
    for j in c..w.len() {
        s += w[j] * x[j];
    }
    s
}
