//! Prepared activations, K zero-padded to the format's unit (`pack::unit_k`):
//!
//! ```text
//!  float kinds [rows × Kp] f32 (FMA kernels), or [rows × Kp] bf16 (`dot`: the pairs
//!              `vdpbf16ps` broadcasts, at the bf16 level)
//!  int kinds   [rows × Kp] u8 = int8 + 128, then [rows × groups] f32 scales (4-byte aligned)
//!  K-group     [rows × Kp] i8, then [rows × groups] f32 scales, then [rows × groups] i32
//!   kinds      −o·Σ of the group's int8 values: where the kernels' sums of (w + o)·x start
//!              (they take the weights unsigned, offset by o: see `kernels`)
//! ```
//!
//! int8 values are quantized exactly as the reference backend does (per token, or per K-group
//! for `int4-gG` and `mxfp4`); padding is a zero (0x80 offset, 0 signed).

use core::arch::x86_64::*;

use half::bf16;
use kt_core::format::int8_row;
use kt_core::WeightFormat;
use kt_x86::int4::unsigned_weights;

use crate::pack::unit_k;

/// Scale groups per token row.
pub fn groups(f: WeightFormat, cols: usize) -> usize {
    f.act_group().map_or(1, |g| cols / g)
}

/// K padded to a whole unit.
pub fn padded(f: WeightFormat, cols: usize) -> usize {
    cols.next_multiple_of(unit_k(f))
}

/// Whether `f`'s int8 activations are kept signed, with their groups' sums: the K-group kinds.
pub fn signed(f: WeightFormat) -> bool {
    f.act_group().is_some()
}

/// End of the int8 part, where the scales start; for float kinds, the whole.
fn first_part(f: WeightFormat, rows: usize, cols: usize, dot: bool) -> usize {
    let kp = padded(f, cols);
    match f {
        f if f.int_activations() => (rows * kp).next_multiple_of(4),
        _ if dot => 2 * rows * kp,
        _ => 4 * rows * kp,
    }
}

/// Bytes of `rows` prepared rows; `dot`: float kinds in bf16 for `vdpbf16ps`.
pub fn bytes(f: WeightFormat, rows: usize, cols: usize, dot: bool) -> usize {
    let per_group = match f {
        f if signed(f) => 8,
        f if f.int_activations() => 4,
        _ => 0,
    };
    first_part(f, rows, cols, dot) + per_group * rows * groups(f, cols)
}

/// The layout `f`'s kernels read: formats with the same value share one prepared copy.
pub fn layout(f: WeightFormat, dot: bool) -> u32 {
    match f {
        WeightFormat::Bf16 => 10 + u32::from(dot),
        WeightFormat::Int8Row => 1,
        WeightFormat::Int4Row => 2,
        // mxfp4 reads what int4-g32 reads.
        f => f.act_group().map_or(u32::from(dot), |g| 1000 + g as u32),
    }
}

/// Scratch [`prepare`] needs: one token row in f32 (for a row with a non-finite value).
pub fn scratch_bytes(cols: usize) -> usize {
    4 * cols
}

/// Quantize one group of a token row into `q` (int8, + 128 unless `SIGNED`) and return its scale: the
/// reference's `int8_row::quantize_row`, 16 values at a time. The same bits: the max, the
/// scalar `int8_row::scale` and `1 / d`, one product per value and its round to nearest even are
/// the same operations; `None` (nothing written) for a group with an infinite or NaN value,
/// which the caller quantizes the scalar way.
///
/// # Safety
/// The CPU has AVX-512F/BW/VL; `q` holds `x.len()` bytes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn quantize_group<const SIGNED: bool>(x: &[bf16], q: &mut [u8]) -> Option<f32> {
    let n = x.len();
    let mask = |i: usize| if n - i >= 16 { 0xFFFF } else { (1u16 << (n - i)) - 1 };
    // SAFETY: masked loads read only the lanes below n.
    let load = |i: usize| unsafe {
        let h = _mm256_maskz_loadu_epi16(mask(i), x.as_ptr().add(i).cast());
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    };
    let sign = _mm512_set1_epi32(i32::MAX);
    let mut m = _mm512_setzero_ps();
    for i in (0..n).step_by(16) {
        let a = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(load(i)), sign));
        // A NaN lane keeps the running max, as `f32::max` does.
        m = _mm512_max_ps(a, m);
    }
    let amax = _mm512_reduce_max_ps(m);
    if !amax.is_finite() {
        return None;
    }
    let d = int8_row::scale(amax);
    let inv = 1.0 / d;
    let inv = if d != 0.0 && inv.is_finite() { inv } else { 0.0 };
    let (vinv, flip) = (_mm512_set1_ps(inv), _mm_set1_epi8(if SIGNED { 0 } else { -128 }));
    for i in (0..n).step_by(16) {
        // |v · inv| ≤ 127.5: the conversion rounds to nearest even, the narrowing saturates; a
        // NaN value gives 0, as the reference's saturating cast does.
        let p = _mm512_mul_ps(load(i), vinv);
        let ordered = _mm512_cmp_ps_mask::<_CMP_ORD_Q>(p, p);
        let r = _mm512_cvtsepi32_epi8(_mm512_maskz_cvtps_epi32(ordered, p));
        let (r, at) = (_mm_xor_si128(r, flip), q.as_mut_ptr().wrapping_add(i));
        // SAFETY: 16 lanes below n, or the masked store writes only those; whole registers
        // unmasked (a full-mask masked store costs on Zen 5, as in `kt_x86::copy`).
        unsafe {
            if n - i >= 16 {
                _mm_storeu_si128(at.cast(), r)
            } else {
                _mm_mask_storeu_epi8(at.cast(), mask(i), r)
            }
        };
    }
    Some(d)
}

/// Prepare rows `rows` of `src` for format `f` into `dst` (`dot`: float kinds in bf16);
/// `scratch` holds [`scratch_bytes`]. The CPU has AVX-512F/BW/VL (the backend's floor).
pub fn prepare(
    f: WeightFormat,
    cols: usize,
    src: &[bf16],
    rows: &[u32],
    dst: &mut [u8],
    scratch: &mut [u8],
    dot: bool,
) {
    let row = |i: usize| &src[rows[i] as usize * cols..(rows[i] as usize + 1) * cols];
    let kp = padded(f, cols);
    let (first, rest) = dst.split_at_mut(first_part(f, rows.len(), cols, dot));
    if dot && !f.int_activations() {
        let b: &mut [bf16] = bytemuck::cast_slice_mut(first);
        for (i, o) in b.chunks_exact_mut(kp).enumerate() {
            o[..cols].copy_from_slice(row(i));
            o[cols..].fill(bf16::ZERO);
        }
        return;
    }
    if !f.int_activations() {
        let d: &mut [f32] = bytemuck::cast_slice_mut(first);
        for (i, o) in d.chunks_exact_mut(kp).enumerate() {
            for (o, v) in o.iter_mut().zip(row(i)) {
                *o = v.to_f32();
            }
            o[cols..].fill(0.0);
        }
        return;
    }
    let (g, signed) = (groups(f, cols), signed(f));
    let gw = cols / g;
    let (scales, starts) = rest.split_at_mut(4 * rows.len() * g);
    let scales: &mut [f32] = bytemuck::cast_slice_mut(scales);
    let starts: &mut [i32] = bytemuck::cast_slice_mut(&mut starts[..if signed { 4 * rows.len() * g } else { 0 }]);
    let offset = unsigned_weights(f).1;
    let x: &mut [f32] = bytemuck::cast_slice_mut(&mut scratch[..4 * cols]);
    let flip = if signed { 0 } else { 0x80 };
    for i in 0..rows.len() {
        let qrow = &mut first[i * kp..(i + 1) * kp];
        qrow[cols..].fill(flip);
        for gi in 0..g {
            let (src, q) = (&row(i)[gi * gw..(gi + 1) * gw], &mut qrow[gi * gw..(gi + 1) * gw]);
            // SAFETY: the backend runs only where the CPU has AVX-512F/BW/VL (cpu_support).
            let vector = unsafe {
                if signed {
                    quantize_group::<true>(src, q)
                } else {
                    quantize_group::<false>(src, q)
                }
            };
            scales[i * g + gi] = match vector {
                Some(d) => d,
                None => {
                    for (o, v) in x.iter_mut().zip(src) {
                        *o = v.to_f32();
                    }
                    let (vals, d) = int8_row::quantize_row(&x[..gw]);
                    for (o, v) in q.iter_mut().zip(vals) {
                        *o = v as u8 ^ flip;
                    }
                    d
                }
            };
            if signed {
                starts[i * g + gi] = -offset * q.iter().map(|&v| i32::from(v as i8)).sum::<i32>();
            }
        }
    }
}

/// A view of prepared activations: float rows (`x`, or `x16` for the dot kernels) or int8
/// rows with their scales (`q`, `scales`, `starts`); the fields of the other kind are empty.
/// One struct for both, so a matrix's kernel (chosen when it was packed) reads its own kind
/// without a match per call.
#[derive(Clone, Copy, Default)]
pub struct Act<'a> {
    /// f32 rows (float formats, not `dot`).
    pub x: &'a [f32],
    /// bf16 rows (float formats, `dot`).
    pub x16: &'a [bf16],
    /// int8 (+ 128, or signed with their groups' sums: [`signed`]) rows.
    pub q: &'a [u8],
    /// Values (or bytes) per row: K padded to a unit.
    pub kp: usize,
    /// `[row][group]` scales of the int8 rows.
    pub scales: &'a [f32],
    /// Scale groups per row.
    pub groups: usize,
    /// `[row][group]` −o·Σ of the signed int8 values, o the weights' offset
    /// (`unsigned_weights`): where the group's sums start ([`signed`] kinds; else empty).
    pub starts: &'a [i32],
}

impl<'a> Act<'a> {
    /// The view of `rows` rows of K = `cols` prepared by [`prepare`] for `f` (`dot` as there).
    pub fn parse(f: WeightFormat, cols: usize, rows: usize, b: &'a [u8], dot: bool) -> Act<'a> {
        let kp = padded(f, cols);
        let (first, rest) = b.split_at(first_part(f, rows, cols, dot));
        match f {
            f if f.int_activations() => {}
            _ if dot => return Act { x16: bytemuck::cast_slice(first), kp, ..Act::default() },
            _ => return Act { x: bytemuck::cast_slice(first), kp, ..Act::default() },
        }
        let g = groups(f, cols);
        let (scales, starts) = rest.split_at(4 * rows * g);
        let starts = if signed(f) { bytemuck::cast_slice(&starts[..4 * rows * g]) } else { &[][..] };
        Act { q: &first[..rows * kp], kp, scales: bytemuck::cast_slice(scales), groups: g, starts, ..Act::default() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vector_quantization_gives_the_references_bits() {
        let isa = ["avx512f", "avx512bw", "avx512vl"];
        if !(is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl"))
        {
            kt_core::skip_isa!(format!("one of AVX-512 {isa:?}"));
            return;
        }
        let mut r = kt_core::rng::SplitMix64::new(17);
        let mut rows: Vec<Vec<f32>> = Vec::new();
        for n in 1..70 {
            rows.push((0..n).map(|_| r.uniform([0.01, 1.0, 300.0][n % 3])).collect());
        }
        rows.push(vec![0.0; 40]);
        rows.push(vec![1e-39; 33]); // subnormal amax: 1/d overflows, the row is zeros
        rows.push((0..48).map(|i| if i == 7 { f32::NAN } else { i as f32 - 20.0 }).collect());
        for x in rows {
            let src: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            let wide: Vec<f32> = src.iter().map(|v| v.to_f32()).collect();
            let (want, d) = int8_row::quantize_row(&wide);
            let (mut q, mut s) = (vec![0u8; src.len()], vec![0u8; src.len()]);
            // SAFETY: AVX-512F/BW/VL checked above.
            let got = unsafe { [quantize_group::<false>(&src, &mut q), quantize_group::<true>(&src, &mut s)] };
            assert_eq!(got.map(|d| d.map(f32::to_bits)), [Some(d.to_bits()); 2], "scale, {} values", src.len());
            let (signed, offset): (Vec<u8>, Vec<u8>) = want.map(|v| (v as u8, v as u8 ^ 0x80)).unzip();
            assert_eq!((q, s), (offset, signed), "{} values", src.len());
        }
        let mut q = vec![0u8; 4];
        let inf = [bf16::ONE, bf16::INFINITY, bf16::ZERO, bf16::ONE];
        // SAFETY: as above.
        assert_eq!(unsafe { quantize_group::<false>(&inf, &mut q) }, None, "non-finite groups go the scalar way");
    }
}
