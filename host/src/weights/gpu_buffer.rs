//! One expert written in the GPU layer's layout, for SGLang's layerwise prefill (KT's
//! `write_weight_scale_to_buffer`: above a token threshold the KT fork runs a whole MoE layer on
//! the GPU, filling its experts from host buffers one at a time). For each GPU tensor-parallel
//! rank `r` of `tp`, `w13` holds the rank's `I/tp` gate rows then its up rows, `w2` every down
//! row's `I/tp` columns of the rank, row-major, in the checkpoint's own encoding (what SGLang's
//! GPU layer holds):
//!
//! | checkpoint | weights | scales (`w13`: gate's then up's) |
//! |---|---|---|
//! | bf16, f16, f32 | bf16 | none |
//! | fp8 e4m3, 128 × 128 block scales | e4m3 bytes | f32 `[rows/128, cols/128]` |
//! | fp8 e4m3, one scale a row | e4m3 bytes | f32 `[rows]` |
//! | MXFP8 (e4m3, e8m0 scale per 32 columns) | e4m3 bytes | its e8m0 codes `[rows, cols/32]` as stored |
//! | compressed-tensors int4 | its packed nibbles as stored | bf16 `[rows, cols/g]` |
//! | MXFP4 (DeepSeek-V4-Flash) | its packed e2m1 nibbles as stored | bf16 `[rows, cols/32]`, each `2^(code − 127)` |
//!
//! (The fork stages MXFP4 scales as bf16 and widens them into its f32 scale tensor: a bf16 holds
//! every e8m0 value exactly.)
//!
//! The bytes come from the checkpoint, not from the CPU's packed copy (which is quantized for
//! the CPU's kernels and need not be the checkpoint's encoding).

use std::borrow::Cow;

use half::bf16;
use safetensors::Dtype;

use kt_core::format::mx::MX_BLOCK;

use super::load::floats;
use super::{expert_f32, mxfp4, Checkpoint, ExpertLayout, Layout, WeightError};

/// How an expert is encoded in the GPU buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuEncoding {
    /// bf16 weights, no scales.
    Bf16,
    /// e4m3 weights, f32 scales per 128 × 128 block.
    Fp8Block,
    /// e4m3 weights, one f32 scale per row.
    Fp8Row,
    /// e4m3 weights, e8m0 scale codes (bytes) per 32 columns of a row.
    Mxfp8,
    /// Packed int4 nibbles, bf16 scales per `group` columns of a row.
    Int4 {
        /// Columns per scale.
        group: usize,
    },
    /// Packed e2m1 nibbles, bf16 scales (the e8m0 values) per 32 columns of a row.
    Mxfp4,
}

impl GpuEncoding {
    /// (numerator, denominator) of weight bytes per element.
    fn weight_bytes(self) -> (usize, usize) {
        match self {
            GpuEncoding::Bf16 => (2, 1),
            GpuEncoding::Fp8Block | GpuEncoding::Fp8Row | GpuEncoding::Mxfp8 => (1, 1),
            GpuEncoding::Int4 { .. } | GpuEncoding::Mxfp4 => (1, 2),
        }
    }

    /// Bytes (weights and scales) [`write_expert`] writes for one expert of `hidden` H and
    /// `intermediate` I over `tp` ranks.
    pub fn expert_bytes(self, hidden: usize, intermediate: usize, tp: usize) -> usize {
        let (num, den) = self.weight_bytes();
        let scales = match self.scale_block() {
            None => 0,
            // One scale per row: gate's and up's rows, and every rank's share of down's rows.
            Some((_, usize::MAX, size)) => (2 * intermediate + tp * hidden) * size,
            Some((rb, cb, size)) => {
                (2 * intermediate.div_ceil(rb) * hidden.div_ceil(cb) + hidden.div_ceil(rb) * intermediate.div_ceil(cb))
                    * size
            }
        };
        3 * hidden * intermediate * num / den + scales
    }

    /// (rows, columns) of weights per scale and bytes per scale; `None` without scales.
    fn scale_block(self) -> Option<(usize, usize, usize)> {
        match self {
            GpuEncoding::Bf16 => None,
            GpuEncoding::Fp8Block => Some((128, 128, 4)),
            GpuEncoding::Fp8Row => Some((1, usize::MAX, 4)),
            GpuEncoding::Mxfp8 => Some((1, MX_BLOCK, 1)),
            GpuEncoding::Int4 { group } => Some((1, group, 2)),
            GpuEncoding::Mxfp4 => Some((1, MX_BLOCK, 2)),
        }
    }
}

/// One GPU rank's four host buffers (addresses; a scale address may be 0 for bf16).
#[derive(Clone, Copy, Debug)]
pub struct RankBuffers {
    /// `[2·I/tp, H]` gate and up.
    pub w13: usize,
    /// Their scales.
    pub w13_scale: usize,
    /// `[H, I/tp]` down.
    pub w2: usize,
    /// Its scales.
    pub w2_scale: usize,
}

/// One projection: its weights (the checkpoint's bytes where they are the GPU encoding) and
/// scales, row-major in the GPU encoding (MXFP4's: the e8m0 codes, widened as they are written).
struct Matrix<'a> {
    cols: usize,
    weights: Cow<'a, [u8]>,
    scales: Cow<'a, [u8]>,
}

/// A host buffer, written front to back.
struct Dst(*mut u8);

impl Dst {
    /// Append `b`.
    ///
    /// # Safety
    /// The buffer has room for `b` after what was written.
    unsafe fn put(&mut self, b: &[u8]) {
        // SAFETY: the caller's contract; the checkpoint's bytes do not overlap a host buffer.
        unsafe {
            core::ptr::copy_nonoverlapping(b.as_ptr(), self.0, b.len());
            self.0 = self.0.add(b.len());
        }
    }

    /// Append e8m0 scale codes as the bf16 values they stand for.
    ///
    /// # Safety
    /// The buffer has room for `2 · codes.len()` bytes after what was written.
    unsafe fn put_e8m0_as_bf16(&mut self, codes: &[u8]) {
        for (i, &c) in codes.iter().enumerate() {
            // SAFETY: the caller's contract.
            unsafe { self.0.add(2 * i).cast::<u16>().write_unaligned(mxfp4::scale_bf16(c).to_le()) };
        }
        // SAFETY: as above.
        self.0 = unsafe { self.0.add(2 * codes.len()) };
    }
}

impl Matrix<'_> {
    /// Append rows `r0..r1`, columns `c0..c1` of the weights to `dst`, in row order.
    ///
    /// # Safety
    /// As [`Dst::put`], for those bytes.
    unsafe fn weight_rows(&self, enc: GpuEncoding, r0: usize, r1: usize, c0: usize, c1: usize, dst: &mut Dst) {
        let (num, den) = enc.weight_bytes();
        let row = self.cols * num / den;
        if (c0, c1) == (0, self.cols) {
            // Whole rows are one run of bytes: one copy (fp8's 2 KB rows copied one by one ran
            // at 0.6 of bf16's 4 KB ones).
            // SAFETY: the caller's contract.
            return unsafe { dst.put(&self.weights[r0 * row..r1 * row]) };
        }
        for r in r0..r1 {
            // SAFETY: the caller's contract.
            unsafe { dst.put(&self.weights[r * row + c0 * num / den..r * row + c1 * num / den]) };
        }
    }

    /// Rows `0..rows` split into column slices of `part` columns, slice `k` of each row appended
    /// to `dsts[k]` (one whole-row copy for a single slice).
    ///
    /// # Safety
    /// As [`Dst::put`], for each destination's slices.
    unsafe fn split_rows(&self, enc: GpuEncoding, rows: usize, part: usize, dsts: &mut [Dst]) {
        if let [dst] = dsts {
            // SAFETY: the caller's contract.
            return unsafe { self.weight_rows(enc, 0, rows, 0, self.cols, dst) };
        }
        let (num, den) = enc.weight_bytes();
        let (row, chunk) = (self.cols * num / den, part * num / den);
        for r in 0..rows {
            for (k, dst) in dsts.iter_mut().enumerate() {
                // SAFETY: the caller's contract.
                unsafe { dst.put(&self.weights[r * row + k * chunk..r * row + (k + 1) * chunk]) };
            }
        }
    }

    /// Append the scales of rows `r0..r1`, columns `c0..c1` (whole scale blocks) to `dst`, in
    /// row order.
    ///
    /// # Safety
    /// As [`Dst::put`], for those bytes.
    unsafe fn scale_rows(&self, enc: GpuEncoding, r0: usize, r1: usize, c0: usize, c1: usize, dst: &mut Dst) {
        let Some((rb, cb, size)) = enc.scale_block() else { return };
        let per_row = self.cols.div_ceil(cb.min(self.cols));
        let (c0, c1) = if cb == usize::MAX { (0, 1) } else { (c0 / cb, c1.div_ceil(cb)) };
        let stored = if enc == GpuEncoding::Mxfp4 { 1 } else { size };
        for r in r0 / rb..r1.div_ceil(rb) {
            let src = &self.scales[(r * per_row + c0) * stored..(r * per_row + c1) * stored];
            // SAFETY: the caller's contract.
            unsafe {
                match enc {
                    GpuEncoding::Mxfp4 => dst.put_e8m0_as_bf16(src),
                    _ => dst.put(src),
                }
            }
        }
    }
}

/// Write expert `e` of layer `layer` (`hidden` H, `intermediate` I) into `ranks` (one per GPU
/// tensor-parallel rank), in the checkpoint's encoding, which is returned.
///
/// # Safety
/// Each rank's buffers hold the sizes the module docs give for its encoding (bytes for
/// `2·I/tp × H` and `H × I/tp` weights and their scales), writable and not otherwise in use.
pub unsafe fn write_expert(
    ck: &Checkpoint,
    layer: usize,
    e: usize,
    hidden: usize,
    intermediate: usize,
    ranks: &[RankBuffers],
) -> Result<GpuEncoding, WeightError> {
    let layout = Layout::detect(ck, layer)?;
    if layout.has_biases(ck) {
        return Err(layout.biases_refused(ck, "the fork's layerwise prefill buffers"));
    }
    let (enc, [gate, up, down]) = expert(ck, &layout, e, hidden, intermediate)?;
    let tp = ranks.len();
    let shape_error = |detail: String| WeightError::Config { path: ck.dir().to_path_buf(), detail };
    let part = intermediate / tp.max(1);
    let align = match enc.scale_block() {
        Some((rb, cb, _)) if cb != usize::MAX => rb.max(cb),
        _ => 2,
    };
    if tp == 0 || intermediate % tp != 0 || part % align != 0 {
        return Err(shape_error(format!(
            "layerwise prefill: {tp} GPU ranks must split the intermediate size {intermediate} into parts of a \
             multiple of {align} ({enc:?})"
        )));
    }
    if enc.scale_block().is_some() && ranks.iter().any(|b| b.w13_scale == 0 || b.w2_scale == 0) {
        return Err(shape_error(format!("layerwise prefill: the checkpoint's experts are {enc:?}, which needs scale buffers, and a scale pointer is 0")));
    }
    // Down's rows split by column between the ranks: each row's slices written in turn, so its
    // bytes are read once, front to back (rank by rank, every rank's pass strided over them).
    let mut w2: Vec<Dst> = ranks.iter().map(|b| Dst(b.w2 as *mut u8)).collect();
    // SAFETY: the caller's contract: each rank's w2 holds its I/tp columns of every row.
    unsafe { down.split_rows(enc, hidden, part, &mut w2) };
    for (r, b) in ranks.iter().enumerate() {
        let (r0, r1) = (r * part, (r + 1) * part);
        // SAFETY: the caller's contract: each buffer holds what the module docs give for this
        // rank, which is exactly what is appended to it here.
        unsafe {
            let w13 = &mut Dst(b.w13 as *mut u8);
            gate.weight_rows(enc, r0, r1, 0, hidden, w13);
            up.weight_rows(enc, r0, r1, 0, hidden, w13);
            if enc.scale_block().is_some() {
                let w13_scale = &mut Dst(b.w13_scale as *mut u8);
                gate.scale_rows(enc, r0, r1, 0, hidden, w13_scale);
                up.scale_rows(enc, r0, r1, 0, hidden, w13_scale);
                down.scale_rows(enc, 0, hidden, r0, r1, &mut Dst(b.w2_scale as *mut u8));
            }
        }
    }
    Ok(enc)
}

/// Expert `e`'s gate, up and down in the checkpoint's encoding.
fn expert<'a>(
    ck: &'a Checkpoint,
    layout: &Layout,
    e: usize,
    h: usize,
    i: usize,
) -> Result<(GpuEncoding, [Matrix<'a>; 3]), WeightError> {
    let shapes = [(i, h), (i, h), (h, i)];
    let weight = |p: usize| layout.expert_tensor(e, p, "weight");
    let stem = |p: usize| weight(p).strip_suffix(".weight").map(str::to_owned).unwrap_or_else(|| weight(p));
    let per_expert = layout.kind != ExpertLayout::Fused;
    let fp8 = per_expert && ck.get(&weight(0)).is_some_and(|t| t.dtype == Dtype::F8_E4M3);
    let int4 = per_expert && ck.contains(&format!("{}.weight_packed", stem(0)));
    if per_expert && (0..3).all(|p| mxfp4::is_mxfp4(ck, &stem(p), shapes[p].0, shapes[p].1)) {
        let m = |p: usize| -> Result<Matrix<'a>, WeightError> {
            let (w, s) = mxfp4::stored(ck, &stem(p), shapes[p].0, shapes[p].1)?;
            Ok(Matrix { cols: shapes[p].1, weights: Cow::Borrowed(w), scales: Cow::Borrowed(s) })
        };
        return Ok((GpuEncoding::Mxfp4, [m(0)?, m(1)?, m(2)?]));
    }
    if !fp8 && !int4 {
        // bf16 tensors of one expert each are the GPU encoding already: borrowed, as fp8's.
        let bf16_tensor =
            |p: usize| ck.get(&weight(p)).filter(|t| t.dtype == Dtype::BF16 && t.shape == [shapes[p].0, shapes[p].1]);
        if per_expert && (0..3).all(|p| bf16_tensor(p).is_some()) {
            let m = |p: usize| Matrix {
                cols: shapes[p].1,
                weights: Cow::Borrowed(ck.bytes(bf16_tensor(p).expect("checked"))),
                scales: Cow::Borrowed(&[]),
            };
            return Ok((GpuEncoding::Bf16, [m(0), m(1), m(2)]));
        }
        let f = expert_f32(ck, layout, e, h, i)?;
        let m = |p: usize, v: &[f32]| Matrix {
            cols: shapes[p].1,
            weights: Cow::Owned(bf16_bytes(v)),
            scales: Cow::Borrowed(&[]),
        };
        return Ok((GpuEncoding::Bf16, [m(0, &f[0]), m(1, &f[1]), m(2, &f[2])]));
    }
    let mut enc = None;
    let mut mats = Vec::with_capacity(3);
    for (p, &(rows, cols)) in shapes.iter().enumerate() {
        let (wname, sname, want) = match fp8 {
            true => (weight(p), scale_name(ck, &stem(p))?, vec![rows, cols]),
            false => (format!("{}.weight_packed", stem(p)), format!("{}.weight_scale", stem(p)), vec![rows, cols / 8]),
        };
        let get = |n: &str| ck.get(n).ok_or_else(|| WeightError::Missing { name: n.into() });
        let (w, s) = (get(&wname)?, get(&sname)?);
        let weights = ck.bytes(w);
        let packed_u8 = !fp8 && matches!(w.dtype, Dtype::U8 | Dtype::I8) && w.shape == [rows, cols / 2];
        if w.shape != want && !packed_u8 {
            return Err(WeightError::Shape { name: wname, expected: want, found: w.shape.clone() });
        }
        let this = match fp8 {
            true if matches!(s.dtype, Dtype::U8 | Dtype::F8_E8M0) => {
                mxfp4::codes(ck, &sname, rows, cols)?;
                GpuEncoding::Mxfp8
            }
            true if s.shape == [rows] || s.shape == [rows, 1] => GpuEncoding::Fp8Row,
            true if s.shape == [rows.div_ceil(128), cols.div_ceil(128)] => GpuEncoding::Fp8Block,
            false if s.shape.len() == 2 && s.shape[0] == rows && s.shape[1] > 0 && cols % s.shape[1] == 0 => {
                GpuEncoding::Int4 { group: cols / s.shape[1] }
            }
            _ => {
                let expected = if fp8 { vec![rows.div_ceil(128), cols.div_ceil(128)] } else { vec![rows, cols / 32] };
                return Err(WeightError::Shape { name: sname, expected, found: s.shape.clone() });
            }
        };
        if enc.is_some_and(|e| e != this) {
            return Err(WeightError::Config {
                path: ck.dir().to_path_buf(),
                detail: format!("expert {e}'s projections are encoded differently ({enc:?} and {this:?})"),
            });
        }
        enc = Some(this);
        // Scales stored in the GPU's dtype (int4's bf16, fp8's f32) are borrowed too.
        let scales = match (this, s.dtype) {
            (GpuEncoding::Int4 { .. }, Dtype::BF16)
            | (GpuEncoding::Fp8Block | GpuEncoding::Fp8Row, Dtype::F32)
            | (GpuEncoding::Mxfp8, _) => Cow::Borrowed(ck.bytes(s)),
            (GpuEncoding::Int4 { .. }, _) => Cow::Owned(bf16_bytes(&floats(&sname, s.dtype, ck.bytes(s))?)),
            _ => floats(&sname, s.dtype, ck.bytes(s))?.iter().flat_map(|&x| x.to_le_bytes()).collect(),
        };
        mats.push(Matrix { cols, weights: Cow::Borrowed(weights), scales });
    }
    let [g, u, d]: [Matrix; 3] = mats.try_into().map_err(|_| WeightError::Missing { name: weight(0) })?;
    Ok((enc.expect("three projections"), [g, u, d]))
}

/// `v` rounded to bf16, as little-endian bytes.
fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes()).collect()
}

/// The fp8 scale tensor's name: `weight_scale_inv` (DeepSeek) or `weight_scale`.
fn scale_name(ck: &Checkpoint, stem: &str) -> Result<String, WeightError> {
    [format!("{stem}.weight_scale_inv"), format!("{stem}.weight_scale")]
        .into_iter()
        .find(|n| ck.contains(n))
        .ok_or_else(|| WeightError::Missing { name: format!("{stem}.weight_scale_inv (or .weight_scale)") })
}
