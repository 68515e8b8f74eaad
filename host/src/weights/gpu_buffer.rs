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
use kt_core::Executor;

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
        tp * self.rank_bytes(hidden, intermediate, tp).iter().sum::<usize>()
    }

    /// Bytes [`write_expert`] writes into each of a rank's buffers `[w13, w13_scale, w2,
    /// w2_scale]` for an expert of `hidden` H and `intermediate` I over `tp` ranks (which
    /// divide I into parts of whole scale blocks, as [`write_expert`] requires).
    pub fn rank_bytes(self, hidden: usize, intermediate: usize, tp: usize) -> [usize; 4] {
        let (num, den) = self.weight_bytes();
        let part = intermediate / tp.max(1);
        let [w13_scale, w2_scale] = match self.scale_block() {
            None => [0, 0],
            // One scale a row: gate's and up's rows of the rank, and all of down's rows.
            Some((_, usize::MAX, size)) => [2 * part * size, hidden * size],
            Some((rb, cb, size)) => {
                [2 * part.div_ceil(rb) * hidden.div_ceil(cb) * size, hidden.div_ceil(rb) * part.div_ceil(cb) * size]
            }
        };
        [2 * part * hidden * num / den, w13_scale, hidden * part * num / den, w2_scale]
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

/// What one expert's write does: blocks of the checkpoint's rows, each row cut into equal
/// slices that go to one destination each (one slice a row but for down over several ranks),
/// copied as is or (MXFP4's scales) widened from e8m0 codes to bf16. Planned first, then run in
/// parallel ([`Plan::run`]): one thread's copy reaches a fraction of a server's memory
/// bandwidth, and the fork writes experts one at a time.
#[derive(Default)]
struct Plan<'a> {
    pieces: Vec<Piece<'a>>,
}

struct Piece<'a> {
    /// Whole rows.
    src: &'a [u8],
    /// Bytes a row.
    row: usize,
    /// Slice `k` of row `r` goes to `dsts[k] + r · (bytes a slice written)`.
    dsts: Vec<*mut u8>,
    /// e8m0 codes written as 2-byte bf16 values.
    widen: bool,
}

/// Source bytes a task of [`Plan::run`] copies at most (or one row), for a write of `total`
/// bytes on `threads`: two tasks a thread, of 128 to 512 KB. Larger tasks stream longer, up to
/// the point where one thread idles at the end (docs/tuning.md, "Layerwise writes"); on
/// many threads the lower bound shares an expert out (a qwen3 bf16 expert among 64 threads).
fn chunk(total: usize, threads: usize) -> usize {
    (total / (2 * threads.max(1))).clamp(128 << 10, 512 << 10)
}

/// A host buffer, written front to back.
struct Dst(*mut u8);

impl<'a> Plan<'a> {
    /// Append whole rows `src` of `row` bytes, slice `k` of each row at `dsts[k]`, widened from
    /// e8m0 codes to bf16 if `widen`.
    fn put(&mut self, src: &'a [u8], row: usize, dsts: &mut [Dst], widen: bool) {
        debug_assert!(row > 0 && src.len() % row == 0 && row % dsts.len() == 0);
        let written = src.len() / dsts.len() * if widen { 2 } else { 1 };
        let at = dsts
            .iter_mut()
            .map(|d| {
                let at = d.0;
                d.0 = at.wrapping_add(written);
                at
            })
            .collect();
        self.pieces.push(Piece { src, row, dsts: at, widen });
    }

    /// Carry the plan out on `exec`'s threads, each task at most `chunk` source bytes of one
    /// piece (or one row).
    ///
    /// # Safety
    /// Every destination has room for what it is given and none overlaps another or a source;
    /// nothing else uses those bytes meanwhile.
    unsafe fn run(&self, exec: &dyn Executor, chunk: usize) {
        let tasks: Vec<(&Piece<'_>, usize, usize)> = self
            .pieces
            .iter()
            .flat_map(|p| {
                let (rows, per) = (p.src.len() / p.row, (chunk / p.row).max(1));
                (0..rows.div_ceil(per)).map(move |t| (p, t * per, ((t + 1) * per).min(rows)))
            })
            .collect();
        let send = SendTasks(&tasks);
        exec.parallel_for(tasks.len(), &|t, _| {
            let (p, r0, r1) = send.tasks()[t];
            // SAFETY: the caller's contract; tasks write disjoint rows.
            unsafe { p.write(r0, r1) };
        });
    }
}

/// A plan's tasks shared with the pool's threads.
struct SendTasks<'t, 'p, 'a>(&'t [(&'p Piece<'a>, usize, usize)]);

// SAFETY: the raw destination pointers are written by one task each (disjoint rows), and the
// sources are shared reads.
unsafe impl Sync for SendTasks<'_, '_, '_> {}

impl<'t, 'p, 'a> SendTasks<'t, 'p, 'a> {
    /// The tasks (a method, so that a closure captures the wrapper, not its field).
    fn tasks(&self) -> &'t [(&'p Piece<'a>, usize, usize)] {
        self.0
    }
}

impl Piece<'_> {
    /// Write rows `r0..r1`.
    ///
    /// # Safety
    /// As [`Plan::run`].
    unsafe fn write(&self, r0: usize, r1: usize) {
        let slice = self.row / self.dsts.len();
        let out = if self.widen { 2 * slice } else { slice };
        // SAFETY: the caller's contract; the checkpoint's bytes do not overlap a host buffer.
        unsafe {
            if let [dst] = self.dsts[..] {
                // One slice a row: the rows are one run in both places.
                return self.copy_out(&self.src[r0 * self.row..r1 * self.row], dst.add(r0 * out));
            }
            let rows = &self.src[r0 * self.row..r1 * self.row];
            if !self.widen {
                // Short slices (down's rows over the ranks): copied in line, not a call each.
                return kt_x86::copy::row_slices(rows, self.row, &self.dsts, r0 * out);
            }
            for (i, r) in rows.chunks_exact(self.row).enumerate() {
                for (k, &dst) in self.dsts.iter().enumerate() {
                    self.copy_out(&r[k * slice..(k + 1) * slice], dst.add((r0 + i) * out));
                }
            }
        }
    }

    /// Copy `src` to `dst`, or widen its codes there.
    ///
    /// # Safety
    /// `dst` has room for `src` (twice that if widened) and overlaps nothing else in use.
    unsafe fn copy_out(&self, src: &[u8], dst: *mut u8) {
        // SAFETY: the caller's contract.
        unsafe {
            if self.widen {
                mxfp4::scales_bf16(src, core::slice::from_raw_parts_mut(dst, 2 * src.len()));
            } else {
                core::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len());
            }
        }
    }
}

impl Matrix<'_> {
    /// Plan rows `r0..r1` of the weights at `dst`.
    fn weight_rows<'p>(&'p self, enc: GpuEncoding, (r0, r1): (usize, usize), dst: &mut Dst, plan: &mut Plan<'p>) {
        let row = self.row_bytes(enc);
        plan.put(&self.weights[r0 * row..r1 * row], row, std::slice::from_mut(dst), false);
    }

    /// Plan every row of the weights split into one column slice per `dsts` (down over the
    /// GPU ranks), slice `k` of each row at `dsts[k]`.
    fn split_rows<'p>(&'p self, enc: GpuEncoding, dsts: &mut [Dst], plan: &mut Plan<'p>) {
        plan.put(&self.weights, self.row_bytes(enc), dsts, false);
    }

    fn row_bytes(&self, enc: GpuEncoding) -> usize {
        let (num, den) = enc.weight_bytes();
        self.cols * num / den
    }

    /// Plan the scales of rows `r0..r1` (whole scale blocks) at `dsts`, each row's scales split
    /// into one column slice per destination.
    fn scale_rows<'p>(&'p self, enc: GpuEncoding, (r0, r1): (usize, usize), dsts: &mut [Dst], plan: &mut Plan<'p>) {
        let Some((rb, cb, size)) = enc.scale_block() else { return };
        let stored = if enc == GpuEncoding::Mxfp4 { 1 } else { size };
        let row = self.cols.div_ceil(cb.min(self.cols)) * stored;
        let src = &self.scales[r0 / rb * row..r1.div_ceil(rb) * row];
        plan.put(src, row, dsts, enc == GpuEncoding::Mxfp4);
    }
}

/// Write expert `e` of layer `layer` (`hidden` H, `intermediate` I) into `ranks` (one per GPU
/// tensor-parallel rank), in the checkpoint's encoding, which is returned; the copies run on
/// `exec`'s threads.
///
/// # Safety
/// Each rank's buffers hold the sizes the module docs give for its encoding (bytes for
/// `2·I/tp × H` and `H × I/tp` weights and their scales), writable and not otherwise in use.
pub unsafe fn write_expert(
    ck: &Checkpoint,
    (layer, e): (usize, usize),
    (hidden, intermediate): (usize, usize),
    ranks: &[RankBuffers],
    exec: &dyn Executor,
) -> Result<GpuEncoding, WeightError> {
    let layout = Layout::detect(ck, layer)?;
    if layout.has_biases(ck) {
        return Err(layout.biases_refused(ck, "the fork's layerwise prefill buffers"));
    }
    let (enc, mats) = expert(ck, &layout, e, hidden, intermediate)?;
    let [gate, up, down] = &mats;
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
    let scaled = enc.scale_block().is_some();
    if scaled && ranks.iter().any(|b| b.w13_scale == 0 || b.w2_scale == 0) {
        return Err(shape_error(format!("layerwise prefill: the checkpoint's experts are {enc:?}, which needs scale buffers, and a scale pointer is 0")));
    }
    let dsts = |at: fn(&RankBuffers) -> usize| -> Vec<Dst> { ranks.iter().map(|b| Dst(at(b) as *mut u8)).collect() };
    let (mut w13, mut w13_scale) = (dsts(|b| b.w13), dsts(|b| b.w13_scale));
    let mut plan = Plan::default();
    // Down's rows split by column between the ranks, each row's slices in turn: its bytes are
    // read once, front to back.
    down.split_rows(enc, &mut dsts(|b| b.w2), &mut plan);
    match enc.scale_block() {
        // One scale a row: every rank gets all of down's.
        Some((_, usize::MAX, _)) => {
            for w2_scale in &mut dsts(|b| b.w2_scale) {
                down.scale_rows(enc, (0, hidden), std::slice::from_mut(w2_scale), &mut plan);
            }
        }
        Some(_) => down.scale_rows(enc, (0, hidden), &mut dsts(|b| b.w2_scale), &mut plan),
        None => {}
    }
    for r in 0..tp {
        let rows = (r * part, (r + 1) * part);
        gate.weight_rows(enc, rows, &mut w13[r], &mut plan);
        up.weight_rows(enc, rows, &mut w13[r], &mut plan);
        if scaled {
            gate.scale_rows(enc, rows, std::slice::from_mut(&mut w13_scale[r]), &mut plan);
            up.scale_rows(enc, rows, std::slice::from_mut(&mut w13_scale[r]), &mut plan);
        }
    }
    let total = plan.pieces.iter().map(|p| p.src.len()).sum();
    // SAFETY: the caller's contract: each buffer holds what the module docs give for this rank,
    // which is exactly what the plan gives it.
    unsafe { plan.run(exec, chunk(total, exec.workers())) };
    Ok(enc)
}

/// The encoding [`write_expert`] would write expert `e` of `layout`'s layer in.
pub(super) fn encoding(
    ck: &Checkpoint,
    layout: &Layout,
    e: usize,
    h: usize,
    i: usize,
) -> Result<GpuEncoding, WeightError> {
    expert(ck, layout, e, h, i).map(|(enc, _)| enc)
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
    let stem = |p: usize| layout.expert_stem(e, p);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::ThreadExecutor;

    /// Two tasks a thread, of 128 to 512 KB: a qwen3 bf16 expert (9.44 MB) in 512 KB tasks on
    /// two threads, 128 KB on 64; a small expert on two threads in two 128 KB tasks or more.
    #[test]
    fn tasks_are_two_a_thread_within_their_bounds() {
        assert_eq!(chunk(9_437_184, 2), 512 << 10);
        assert_eq!(chunk(9_437_184, 64), 128 << 10);
        assert_eq!(chunk(2_000_000, 4), 250_000);
        assert_eq!(chunk(100_000, 2), 128 << 10);
        assert_eq!(chunk(100_000, 0), 128 << 10);
    }

    /// A plan's pieces cut into tasks at every chunk size, run by three threads, write what the
    /// textbook does: rows split over one to three destinations, copied or widened, an empty
    /// piece, pieces of fewer bytes than a chunk and of more.
    #[test]
    fn a_plan_cut_into_tasks_writes_every_slice_where_it_belongs() {
        let src: Vec<u8> = (0..720u32).map(|i| (i * 37 % 251) as u8).collect();
        // (source range, bytes a row, destinations, widen)
        let pieces = [
            (0, 0, 4, 1, false),
            (0, 60, 6, 1, false),
            (60, 120, 6, 3, true),
            (120, 360, 12, 2, false),
            (360, 720, 30, 3, true),
        ];
        let exec = ThreadExecutor::new(3);
        for chunk in [1, 2, 5, 7, 64, 65, 600, 4096] {
            // Each destination its own buffer (one a piece and slice), a guard byte past its end.
            let mut bufs: Vec<Vec<Vec<u8>>> = pieces
                .iter()
                .map(|&(a, b, _, n, widen)| vec![vec![0xAA; (b - a) / n * if widen { 2 } else { 1 } + 1]; n])
                .collect();
            let mut plan = Plan::default();
            for (&(a, b, row, _, widen), bs) in pieces.iter().zip(&mut bufs) {
                let mut dsts: Vec<Dst> = bs.iter_mut().map(|v| Dst(v.as_mut_ptr())).collect();
                plan.put(&src[a..b], row, &mut dsts, widen);
            }
            // SAFETY: each destination holds its slices of its piece.
            unsafe { plan.run(&exec, chunk) };
            for (&(a, b, row, n, widen), bs) in pieces.iter().zip(&bufs) {
                for (k, buf) in bs.iter().enumerate() {
                    let slice = row / n;
                    let want: Vec<u8> = src[a..b]
                        .chunks(row)
                        .flat_map(|r| r[k * slice..(k + 1) * slice].to_vec())
                        .flat_map(|c| if widen { mxfp4::scale_bf16(c).to_le_bytes().to_vec() } else { vec![c] })
                        .collect();
                    assert_eq!(buf[..want.len()], want[..], "chunk {chunk}, piece {a}..{b}, slice {k}");
                    assert_eq!(buf[want.len()], 0xAA, "chunk {chunk}, piece {a}..{b}, slice {k}: wrote past its end");
                }
            }
        }
    }
}
