//! Runs a [`Plan`] on a layer's backend and an executor: the one forward pass every caller uses.
//! Every buffer lives in the [`Workspace`] and only grows, so a forward after warm-up (a call
//! with at least as many tokens) performs no heap allocation.
//!
//! Scratch layout (all token-major, experts' rows contiguous in plan order):
//!
//! ```text
//!  act_x : per active expert, x rows prepared for gate's layout, then for up's if it differs
//!  scratch: per worker, what the backend asks for its largest task (Backend::scratch_bytes),
//!          then, where Down sums, a Down task's results tile (its largest expert's rows × its
//!          H rows, f32)
//!  h     : per part p, [rows_total × I_p] bf16                  GateUp writes column blocks
//!  act_h : per part, per expert, prepared h rows               (64-byte aligned blocks)
//!  y     : per part, [rows_total × H] f32 (where Reduce sums)   Down writes column blocks
//!  out_p : per part, [tokens × H] f32                           Down or Reduce writes
//! ```

use alloc::vec;
use alloc::vec::Vec;
use core::ops::Range;
use core::sync::atomic::{AtomicUsize, Ordering};

use half::bf16;

use crate::aligned::{round_up, AlignedBuf};
use crate::backend::TaskShape;
use crate::bias::ExpertBias;
use crate::dtype::bf16_round;
use crate::mat::{MatMut, SharedMut};
use crate::plan::{target_tasks, ActiveExpert, Plan, StageKind, Task, DOWN_TILE_BYTES, SUM_IN_DOWN_FROM};
use crate::workers::{Carve, WorkerScratch};
use crate::{Backend, Error, Executor, LayerFormat, MoeConfig, PackedMatrix, QuantMatrix, Routing};

/// One expert's packed matrices for one part: gate/up `[I_p, H]`, down `[H, I_p]`.
#[derive(Debug)]
pub struct ExpertWeights {
    /// gate_proj rows of the part.
    pub gate: PackedMatrix,
    /// up_proj rows of the part.
    pub up: PackedMatrix,
    /// down_proj columns of the part.
    pub down: PackedMatrix,
}

impl ExpertWeights {
    /// Bytes of the three matrices.
    pub fn bytes(&self) -> usize {
        self.gate.bytes() + self.up.bytes() + self.down.bytes()
    }
}

/// The experts of one NUMA part.
#[derive(Debug)]
pub struct PartWeights {
    /// The slice of I this part owns.
    pub range: Range<usize>,
    /// Indexed by expert id; `None` for experts not loaded (GPU-resident).
    pub experts: Vec<Option<ExpertWeights>>,
}

/// All packed weights of one layer and the backend that packed them, which is the backend
/// that runs it: a matrix packed by another is refused when it is installed.
#[derive(Debug)]
pub struct LayerWeights {
    backend: &'static dyn Backend,
    /// The formats the matrices were packed from.
    pub format: LayerFormat,
    /// One entry per NUMA part.
    pub parts: Vec<PartWeights>,
    /// Expert biases by expert id (gpt-oss's); empty for a layer without any.
    biases: Vec<Option<ExpertBias>>,
    /// H, which down's biases have.
    hidden: usize,
}

impl LayerWeights {
    /// A layer run by `backend` with no expert loaded yet.
    pub fn empty(
        cfg: &MoeConfig,
        format: impl Into<LayerFormat>,
        backend: &'static dyn Backend,
    ) -> Result<Self, Error> {
        let format = format.into();
        cfg.validate_for(format)?;
        let parts = cfg
            .part_ranges(format)?
            .into_iter()
            .map(|range| PartWeights { range, experts: (0..cfg.experts).map(|_| None).collect() })
            .collect();
        Ok(LayerWeights { backend, format, parts, biases: Vec::new(), hidden: cfg.hidden })
    }

    /// The backend that packed the weights and runs the layer.
    pub fn backend(&self) -> &'static dyn Backend {
        self.backend
    }

    /// Install expert `e` (one [`ExpertWeights`] per part, as [`pack_expert`] returns). Its
    /// matrices must have been packed by the layer's backend from the layer's formats.
    pub fn set_expert(&mut self, e: usize, per_part: Vec<ExpertWeights>) -> Result<(), Error> {
        if e >= self.parts.first().map_or(0, |p| p.experts.len()) {
            let expected = self.parts.first().map_or(0, |p| p.experts.len());
            return Err(Error::ShapeMismatch { what: "expert id (below the layer's experts)", expected, found: e });
        }
        if per_part.len() != self.parts.len() {
            return Err(Error::ShapeMismatch {
                what: "parts of an expert",
                expected: self.parts.len(),
                found: per_part.len(),
            });
        }
        for w in &per_part {
            let found = LayerFormat { gate: w.gate.format(), up: w.up.format(), down: w.down.format() };
            if found != self.format {
                return Err(Error::FormatMismatch { expert: e, expected: self.format, found });
            }
            if let Some(m) = [&w.gate, &w.up, &w.down].into_iter().find(|m| m.packed_by() != self.backend.name()) {
                return Err(Error::PackedByOther { layer: self.backend.name(), packed_by: m.packed_by() });
            }
        }
        for (p, w) in self.parts.iter_mut().zip(per_part) {
            p.experts[e] = Some(w);
        }
        Ok(())
    }

    /// Give expert `e` biases (of the layer's full H and I, checked against its parts).
    pub fn set_bias(&mut self, e: usize, bias: ExpertBias) -> Result<(), Error> {
        let experts = self.parts.first().map_or(0, |p| p.experts.len());
        if e >= experts {
            return Err(Error::ShapeMismatch {
                what: "expert id (below the layer's experts)",
                expected: experts,
                found: e,
            });
        }
        let intermediate = self.parts.last().map_or(0, |p| p.range.end);
        bias.validate(self.hidden, intermediate)?;
        if self.biases.is_empty() {
            self.biases = (0..experts).map(|_| None).collect();
        }
        self.biases[e] = Some(bias);
        Ok(())
    }

    /// Expert `e`'s biases, if it has any.
    pub fn bias(&self, e: usize) -> Option<&ExpertBias> {
        self.biases.get(e).and_then(Option::as_ref)
    }

    /// Bytes of expert `e` over all parts (0 if not loaded).
    pub fn expert_bytes(&self, e: usize) -> usize {
        self.parts.iter().filter_map(|p| p.experts[e].as_ref()).map(ExpertWeights::bytes).sum()
    }

    /// Bytes of every loaded expert.
    pub fn bytes(&self) -> usize {
        (0..self.parts.first().map_or(0, |p| p.experts.len())).map(|e| self.expert_bytes(e)).sum()
    }
}

/// One expert in f32, row-major: gate and up `[I, H]`, down `[H, I]`.
#[derive(Clone, Copy, Debug)]
pub struct ExpertF32<'a> {
    /// gate_proj.
    pub gate: &'a [f32],
    /// up_proj.
    pub up: &'a [f32],
    /// down_proj.
    pub down: &'a [f32],
}

/// Quantize one f32 expert per part (each part's slice quantized on its own, as KT's converter
/// does: down's per-row scales cover only the part's columns) and pack it with `backend`.
pub fn pack_expert_f32(
    backend: &dyn Backend,
    cfg: &MoeConfig,
    format: impl Into<LayerFormat>,
    x: ExpertF32<'_>,
) -> Result<Vec<ExpertWeights>, Error> {
    let format = format.into();
    cfg.part_ranges(format)?.into_iter().map(|r| pack_part_f32(backend, cfg, format, x, r)).collect()
}

/// The part of [`pack_expert_f32`] that owns rows `part` of I (one of `cfg.part_ranges`).
pub fn pack_part_f32(
    backend: &dyn Backend,
    cfg: &MoeConfig,
    format: LayerFormat,
    x: ExpertF32<'_>,
    part: Range<usize>,
) -> Result<ExpertWeights, Error> {
    let (h, i) = (cfg.hidden, cfg.intermediate);
    for (what, m) in [("gate_proj", x.gate), ("up_proj", x.up), ("down_proj", x.down)] {
        if m.len() != h * i {
            return Err(Error::ShapeMismatch { what, expected: h * i, found: m.len() });
        }
    }
    let r = part;
    let rows = |f, m: &[f32]| QuantMatrix::quantize(f, r.len(), h, &m[r.start * h..r.end * h]);
    let down = crate::mat::columns(x.down, i, r.clone());
    Ok(ExpertWeights {
        gate: backend.pack(&rows(format.gate, x.gate)?)?,
        up: backend.pack(&rows(format.up, x.up)?)?,
        down: backend.pack(&QuantMatrix::quantize(format.down, h, r.len(), &down)?)?,
    })
}

/// What a layer packed by [`pack_expert_f32`] multiplies by: each part's slices quantized to
/// `format` and dequantized again, put back together (gate and up `[I, H]`, down `[H, I]`).
pub fn dequantized_expert_f32(
    cfg: &MoeConfig,
    format: impl Into<LayerFormat>,
    x: ExpertF32<'_>,
) -> Result<[Vec<f32>; 3], Error> {
    let format = format.into();
    let (h, i) = (cfg.hidden, cfg.intermediate);
    for (what, m) in [("gate_proj", x.gate), ("up_proj", x.up), ("down_proj", x.down)] {
        if m.len() != h * i {
            return Err(Error::ShapeMismatch { what, expected: h * i, found: m.len() });
        }
    }
    let (mut g, mut u, mut d) = (vec![0.0f32; i * h], vec![0.0f32; i * h], vec![0.0f32; h * i]);
    for r in cfg.part_ranges(format)? {
        let rows = |f, m: &[f32], out: &mut [f32]| -> Result<(), Error> {
            let q = QuantMatrix::quantize(f, r.len(), h, &m[r.start * h..r.end * h])?;
            out[r.start * h..r.end * h].copy_from_slice(&q.dequantize());
            Ok(())
        };
        rows(format.gate, x.gate, &mut g)?;
        rows(format.up, x.up, &mut u)?;
        let down = crate::mat::columns(x.down, i, r.clone());
        let q = QuantMatrix::quantize(format.down, h, r.len(), &down)?.dequantize();
        crate::mat::set_columns(&mut d, i, r, &q);
    }
    Ok([g, u, d])
}

/// Slice already-quantized matrices into parts (exact) and pack them with `backend`.
pub fn pack_expert(
    backend: &dyn Backend,
    cfg: &MoeConfig,
    gate: &QuantMatrix,
    up: &QuantMatrix,
    down: &QuantMatrix,
) -> Result<Vec<ExpertWeights>, Error> {
    let format = LayerFormat { gate: gate.format(), up: up.format(), down: down.format() };
    cfg.part_ranges(format)?.into_iter().map(|r| pack_part(backend, cfg, gate, up, down, r)).collect()
}

/// The part of [`pack_expert`] that owns rows `part` of I (one of `cfg.part_ranges`).
pub fn pack_part(
    backend: &dyn Backend,
    cfg: &MoeConfig,
    gate: &QuantMatrix,
    up: &QuantMatrix,
    down: &QuantMatrix,
    part: Range<usize>,
) -> Result<ExpertWeights, Error> {
    let (h, i) = (cfg.hidden, cfg.intermediate);
    for (what, m, rows, cols) in [("gate_proj", gate, i, h), ("up_proj", up, i, h), ("down_proj", down, h, i)] {
        if (m.rows(), m.cols()) != (rows, cols) {
            return Err(Error::ShapeMismatch { what, expected: rows * cols, found: m.rows() * m.cols() });
        }
    }
    Ok(ExpertWeights {
        gate: backend.pack(&gate.slice_rows(part.clone())?)?,
        up: backend.pack(&up.slice_rows(part.clone())?)?,
        down: backend.pack(&down.slice_cols(part)?)?,
    })
}

/// Scratch reused across forwards; grows to the largest call and stays. A forward writes what
/// it reads within the call, so forwards of different layers may share one (one at a time).
#[derive(Debug, Default)]
pub struct Workspace {
    plan: Plan,
    act_x: AlignedBuf,
    act_h: AlignedBuf,
    h: Vec<bf16>,
    /// Down's results, rows [`y_stride`] apart, where Reduce sums them.
    y: Vec<f32>,
    out_parts: Vec<f32>,
    ident: Vec<u32>,
    /// The workers' scratch, one block each of what `Backend::scratch_bytes` asks for.
    scratch: WorkerScratch,
    /// Per active expert, where its gate and its up activations are in `act_x`.
    x_blocks: Vec<[Range<usize>; 2]>,
    /// Per part and active expert, where its down activations are in `act_h`.
    h_blocks: Vec<Range<usize>>,
    /// Per part and active expert, its GateUp tasks not yet finished: the last one to finish
    /// prepares its down activations.
    gate_up_left: Vec<AtomicUsize>,
    part_rows: Vec<usize>,
    h_base: Vec<usize>,
}

impl Workspace {
    /// Bytes its buffers hold (the routing plan's small vectors aside): what a forward of the
    /// most tokens it has seen keeps for the next.
    pub fn bytes(&self) -> usize {
        let f32s = self.y.len() + self.out_parts.len() + self.ident.len();
        self.act_x.len() + self.act_h.len() + self.scratch.bytes() + 2 * self.h.len() + 4 * f32s
    }
}

/// The row stride of the down projection's results (`hidden` floats a row, or a Down task's
/// rows of it): one cache line more than a row, so that a tile's results for consecutive
/// tokens fall in different L1 sets.
/// With `hidden` a multiple of 1024 (2048, 4096, 7168) every row starts in the same set, and a
/// down tile's 33 token stores thrashed its 12 ways: an AVX-512 q4_K down projection ran 20%
/// faster with the extra line (`benches/dots.rs` of the llamafile backend, down, 33 tokens,
/// which writes its results this way too).
pub fn y_stride(hidden: usize) -> usize {
    hidden + 16
}

/// Make scratch at least `len` long; it never shrinks, so a prefill after a decode re-zeroes
/// nothing. A grown buffer is a fresh allocation: for the large f32 ones the allocator hands
/// out untouched zero pages, which the part's own tasks then touch first, on its NUMA node.
fn grow<T: Copy + Default>(v: &mut Vec<T>, len: usize) {
    if v.len() < len {
        *v = alloc::vec![T::default(); len];
    }
}

/// Lay blocks of the given lengths one after another, each at a 64-byte boundary, into `out`;
/// returns the bytes they span.
fn lay_out(out: &mut Vec<Range<usize>>, bound: usize, lens: impl Iterator<Item = usize>) -> usize {
    out.clear();
    out.reserve(bound);
    let mut at = 0;
    for l in lens {
        out.push(at..at + l);
        at += round_up(l);
    }
    at
}

/// `out(t) += w · y` for each row of expert `a` whose token `t` lies in `tokens`, in row order,
/// with `w` its slot's weight and `y` its results (row `first + i` of `ys`, rows `stride`
/// apart, as wide as `out(t)`), then `w · bias` (down's, where given, as wide): the weighted
/// sum the Reduce stage and a Down task of every expert both make, the same bits.
fn add_rows<'o>(
    plan: &Plan,
    a: &ActiveExpert,
    tokens: Range<usize>,
    (ys, stride, first): (&[f32], usize, usize),
    weights: &[f32],
    bias: Option<&[f32]>,
    out: &dyn Fn(usize) -> &'o mut [f32],
) {
    // An expert's rows are in token order.
    let row_tokens = &plan.row_tokens[a.row_range()];
    let from = row_tokens.partition_point(|&t| (t as usize) < tokens.start);
    let to = row_tokens.partition_point(|&t| (t as usize) < tokens.end);
    for i in from..to {
        let (acc, wt) = (out(row_tokens[i] as usize), weights[plan.row_slots[a.first_row + i] as usize]);
        let width = acc.len();
        for (o, &v) in acc.iter_mut().zip(&ys[(first + i) * stride..][..width]) {
            *o += wt * v;
        }
        for (o, &v) in acc.iter_mut().zip(bias.unwrap_or_default()) {
            *o += wt * v;
        }
    }
}

/// `out = bf16(0 + part(0) + part(1) + ...)` elementwise over `parts` parts in ascending order,
/// in blocks that vectorize: the Merge stage's sum, and with one part what Reduce and Down
/// write at once (`0 + x`, as the stage would: a −0 sum becomes +0).
fn merge<'a>(parts: usize, part: impl Fn(usize) -> &'a [f32], out: &mut [bf16]) {
    const BLOCK: usize = 64;
    let mut acc = [0.0f32; BLOCK];
    for (c, o) in out.chunks_mut(BLOCK).enumerate() {
        let acc = &mut acc[..o.len()];
        acc.fill(0.0);
        for p in 0..parts {
            acc.iter_mut().zip(&part(p)[c * BLOCK..]).for_each(|(a, &v)| *a += v);
        }
        o.iter_mut().zip(&*acc).for_each(|(o, &a)| *o = bf16_round(a));
    }
}

/// `out[n,H] = Σ_j w[t,j] · expert_{ids[t,j]}(input[t])` over the CPU-resident experts, on the
/// backend that packed `w`.
pub fn forward(
    exec: &dyn Executor,
    cfg: &MoeConfig,
    w: &LayerWeights,
    input: &[bf16],
    routing: &Routing<'_>,
    out: &mut [bf16],
    ws: &mut Workspace,
) -> Result<(), Error> {
    let backend = w.backend;
    let (n, hd) = (routing.tokens, cfg.hidden);
    let LayerFormat { gate: gate_fmt, up: up_fmt, down: down_fmt } = w.format;
    if input.len() != n * hd {
        return Err(Error::ShapeMismatch { what: "hidden_states", expected: n * hd, found: input.len() });
    }
    if out.len() != n * hd {
        return Err(Error::ShapeMismatch { what: "output", expected: n * hd, found: out.len() });
    }
    ws.part_rows.clear();
    ws.part_rows.extend(w.parts.iter().map(|p| p.range.len()));
    let (gran_i, gran_h) = (backend.row_granularity(gate_fmt), backend.row_granularity(down_fmt));
    ws.plan.rebuild(cfg, routing, &ws.part_rows, gran_i, gran_h, target_tasks(exec.workers()))?;
    let (plan, part_rows) = (&ws.plan, &ws.part_rows[..]);
    for a in &plan.experts {
        if w.parts.iter().any(|p| p.experts.get(a.id).is_none_or(Option::is_none)) {
            return Err(Error::ExpertNotLoaded { expert: a.id });
        }
    }
    let (rows_total, ys) = (plan.row_tokens.len(), y_stride(hd));
    let parts = w.parts.len();
    // Per active expert, its gate activations and, where up's kernels read another layout,
    // its up activations (else up reads gate's).
    let own_up = backend.act_layout(up_fmt) != backend.act_layout(gate_fmt);
    ws.x_blocks.clear();
    ws.x_blocks.reserve(cfg.experts);
    let mut x_total = 0;
    let mut block = |bytes: usize| {
        let r = x_total..x_total + bytes;
        x_total += round_up(bytes);
        r
    };
    for (i, a) in plan.experts.iter().enumerate() {
        if a.act != i {
            // Its token's first expert prepared them (an earlier one).
            ws.x_blocks.push(ws.x_blocks[a.act].clone());
            continue;
        }
        let g = block(backend.act_bytes(gate_fmt, a.rows, hd));
        let u = if own_up { block(backend.act_bytes(up_fmt, a.rows, hd)) } else { g.clone() };
        ws.x_blocks.push([g, u]);
    }
    let ah_total = lay_out(
        &mut ws.h_blocks,
        parts * cfg.experts,
        part_rows.iter().flat_map(|&ip| plan.experts.iter().map(move |a| backend.act_bytes(down_fmt, a.rows, ip))),
    );
    ws.h_base.clear();
    ws.h_base.extend(part_rows.iter().scan(0, |at, &ip| Some(core::mem::replace(at, *at + rows_total * ip))));
    // Buffers are sized by bounds that depend on the token count, not on how the tokens are
    // routed, so a forward after one of at least as many tokens allocates nothing. Blocks of
    // prepared activations each start on a 64-byte boundary: the sum of an expert's blocks is at
    // most the bytes of all rows at once plus 64 per expert and layout.
    let max_rows = plan.experts.iter().map(|a| a.rows).max().unwrap_or(0);
    let blocks = cfg.experts.min(rows_total) * 2 * crate::aligned::ALIGN;
    let up_bytes = if own_up { backend.act_bytes(up_fmt, rows_total, hd) } else { 0 };
    let x_bound = backend.act_bytes(gate_fmt, rows_total, hd) + up_bytes + blocks;
    let ah_bound = part_rows.iter().map(|&ip| backend.act_bytes(down_fmt, rows_total, ip) + blocks).sum::<usize>();
    // Scratch for the largest task any routing of `n` tokens makes: an expert holds at most `n`
    // rows (more only where a token names it twice), a task at most a part's rows or `hidden`.
    let cols = part_rows.iter().fold(hd, |m, &ip| m.max(ip));
    let shape = TaskShape { format: w.format, tokens: max_rows.max(n), rows: cols, cols };
    // A Down task's results tile: within DOWN_TILE_BYTES, or of the fewest rows of H where the
    // largest expert's rows alone pass it (`plan::down_rows`), so bounded without the routing.
    let (tile, tile_bound) = match plan.sum_in_down() {
        true => {
            let tile = max_rows * y_stride(plan.down_rows);
            (tile, (DOWN_TILE_BYTES / 4).max(max_rows.max(n) * y_stride(gran_h)).max(tile))
        }
        false => (0, 0),
    };
    ws.act_x.ensure(x_total.max(x_bound));
    ws.act_h.ensure(ah_total.max(ah_bound));
    grow(&mut ws.h, rows_total * cfg.intermediate);
    // y only where Reduce sums, so below SUM_IN_DOWN_FROM: a forward after one of more tokens
    // finds it grown.
    grow(&mut ws.y, (parts * n * routing.k * ys).min(SUM_IN_DOWN_FROM / 4));
    grow(&mut ws.out_parts, parts * n * hd);
    if ws.ident.len() < rows_total {
        ws.ident = (0..rows_total as u32).collect();
    }
    if ws.gate_up_left.len() < parts * cfg.experts {
        ws.gate_up_left = (0..parts * cfg.experts).map(|_| AtomicUsize::new(0)).collect();
    }
    let (x_blocks, h_blocks, h_base) = (&ws.x_blocks[..], &ws.h_blocks[..], &ws.h_base[..]);
    let active = plan.experts.len();
    let expert = |p: usize, e: usize| w.parts[p].experts[plan.experts[e].id].as_ref().expect("checked above");
    // (The tile after it starts 64-byte aligned, as Carve wants.)
    let backend_scratch = round_up(backend.scratch_bytes(shape));
    let blocks = ws.scratch.blocks(exec, backend_scratch + Carve::bytes::<f32>(tile_bound));
    let out_dst = SharedMut::new(out);
    // Columns `cols` of token `t`'s output row onwards (`cols` may pass the row's end).
    // SAFETY: its callers take what their task owns (a Down task of one part its rows of H of
    // every token, a Reduce or Merge task its tokens), one borrow at a time.
    let out_cols = |t: usize, cols: Range<usize>| unsafe { out_dst.slice_mut(t * hd + cols.start..t * hd + cols.end) };
    // Part tasks go to their part's sub-pool; Gather and Merge tasks are spread over all. Each
    // task gets its worker's scratch.
    let run = |tasks: &[Task], f: &(dyn Fn(&Task, &mut [u8]) + Sync)| {
        blocks.run(exec, tasks.len(), &|i| tasks[i].part().unwrap_or(i), &|i, scratch| f(&tasks[i], scratch))
    };

    for stage in plan.stages.iter().filter(|s| !s.tasks.is_empty()) {
        exec.label(stage.kind.name());
        match stage.kind {
            StageKind::Gather => {
                let dst = SharedMut::new(ws.act_x.as_mut_slice());
                run(&stage.tasks, &|t, scratch| {
                    let Task::Gather { expert: e } = *t else { unreachable!() };
                    let tokens = &plan.row_tokens[plan.experts[e].row_range()];
                    let [g, u] = &x_blocks[e];
                    // SAFETY: each active expert's act_x blocks are written by its one Gather task.
                    backend.quantize_act(gate_fmt, hd, input, tokens, unsafe { dst.slice_mut(g.clone()) }, scratch);
                    if own_up {
                        // SAFETY: as above.
                        backend.quantize_act(up_fmt, hd, input, tokens, unsafe { dst.slice_mut(u.clone()) }, scratch);
                    }
                });
            }
            StageKind::GateUp => {
                let left = &ws.gate_up_left[..parts * active];
                left.iter().for_each(|l| l.store(0, Ordering::Relaxed));
                for t in &stage.tasks {
                    let Task::GateUp { part: p, expert: e, .. } = *t else { unreachable!() };
                    left[p * active + e].fetch_add(1, Ordering::Relaxed);
                }
                let (act_x, ident) = (ws.act_x.as_slice(), &ws.ident[..]);
                let (h, dst) = (SharedMut::new(&mut ws.h[..]), SharedMut::new(ws.act_h.as_mut_slice()));
                run(&stage.tasks, &|t, scratch| {
                    let Task::GateUp { part: p, expert: e, ref rows } = *t else { unreachable!() };
                    let (a, ip, i) = (&plan.experts[e], part_rows[p], p * active + e);
                    let base = h_base[p] + a.first_row * ip;
                    // SAFETY: GateUp tasks of one (part, expert) own disjoint column blocks of its rows.
                    let view = unsafe { h.mat_mut(base + rows.start, a.rows, rows.len(), ip) };
                    let (ew, [g, u]) = (expert(p, e), &x_blocks[e]);
                    let (ag, au) = (&act_x[g.clone()], &act_x[u.clone()]);
                    let bias = w.bias(a.id).map(|b| b.gate_up(w.parts[p].range.clone()));
                    backend.gate_up(&ew.gate, &ew.up, rows.clone(), ag, au, cfg.glu, bias, view, scratch);
                    // The last of (p, e)'s tasks to finish (AcqRel: after the others' writes to
                    // its rows) prepares them for down.
                    if left[i].fetch_sub(1, Ordering::AcqRel) == 1 {
                        // SAFETY: every GateUp task of (p, e) has finished writing its rows,
                        // and only this one reads them or writes (p, e)'s act_h block.
                        let (src, d) =
                            unsafe { (h.slice_mut(base..base + a.rows * ip), dst.slice_mut(h_blocks[i].clone())) };
                        backend.quantize_act(down_fmt, ip, src, &ident[..a.rows], d, scratch);
                    }
                });
            }
            StageKind::Down => {
                let (act_h, y) = (ws.act_h.as_slice(), SharedMut::new(&mut ws.y[..]));
                let dst = SharedMut::new(&mut ws.out_parts[..]);
                run(&stage.tasks, &|t, block| {
                    let Task::Down { part: p, expert: owner, ref rows } = *t else { unreachable!() };
                    let down = |e: usize, y: MatMut<'_, f32>, scratch: &mut [u8]| {
                        let h = &act_h[h_blocks[p * active + e].clone()];
                        backend.down(&expert(p, e).down, rows.clone(), h, y, scratch)
                    };
                    let Some(e) = owner else {
                        // Every expert on these rows of H, each one's results summed in at once.
                        let (scratch, rest) = block.split_at_mut(backend_scratch);
                        let results = Carve::new(rest).take::<f32>(tile);
                        let stride = y_stride(rows.len());
                        // SAFETY: the part's Down tasks own disjoint column blocks of its
                        // output rows; each borrow ends before the next.
                        let out_row = |t: usize| unsafe {
                            dst.slice_mut((p * n + t) * hd + rows.start..(p * n + t) * hd + rows.end)
                        };
                        for t in 0..n {
                            out_row(t).fill(0.0);
                        }
                        for (e, a) in plan.experts.iter().enumerate() {
                            let y = MatMut::from_slice(&mut results[..a.rows * stride], a.rows, rows.len(), stride);
                            down(e, y, scratch);
                            // Down's bias once per slot: with the first part's share.
                            let bias = w.bias(a.id).filter(|_| p == 0).map(|b| &b.down[rows.clone()]);
                            add_rows(plan, a, 0..n, (&results[..], stride, 0), routing.weights, bias, &out_row);
                        }
                        if parts == 1 {
                            for t in 0..n {
                                let sum = &*out_row(t);
                                merge(1, |_| sum, out_cols(t, rows.clone()));
                            }
                        }
                        return;
                    };
                    let a = &plan.experts[e];
                    let at = (p * rows_total + a.first_row) * ys + rows.start;
                    // SAFETY: Down tasks of one (part, expert) own disjoint column blocks of its rows.
                    down(e, unsafe { y.mat_mut(at, a.rows, rows.len(), ys) }, block);
                });
            }
            StageKind::Reduce => {
                let (y, dst) = (&ws.y[..], SharedMut::new(&mut ws.out_parts[..]));
                run(&stage.tasks, &|t, _| {
                    let Task::Reduce { part: p, ref tokens } = *t else { unreachable!() };
                    // SAFETY: Reduce tasks of one part own disjoint token chunks; each borrow
                    // ends before the next.
                    let out_row = |t: usize| unsafe { dst.slice_mut((p * n + t) * hd..(p * n + t + 1) * hd) };
                    for t in tokens.clone() {
                        out_row(t).fill(0.0);
                    }
                    for a in &plan.experts {
                        let bias = w.bias(a.id).filter(|_| p == 0).map(|b| &b.down[..]);
                        let y = (&y[p * rows_total * ys..], ys, a.first_row);
                        add_rows(plan, a, tokens.clone(), y, routing.weights, bias, &out_row);
                    }
                    if parts == 1 {
                        for t in tokens.clone() {
                            let sum = &*out_row(t);
                            merge(1, |_| sum, out_cols(t, 0..hd));
                        }
                    }
                });
            }
            StageKind::Merge => {
                let parts_out = &ws.out_parts[..parts * n * hd];
                run(&stage.tasks, &|t, _| {
                    let Task::Merge { ref tokens } = *t else { unreachable!() };
                    let at = tokens.start * hd;
                    let part = |p: usize| &parts_out[p * n * hd + at..];
                    merge(parts, part, out_cols(tokens.start, 0..tokens.len() * hd));
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::REFERENCE;
    use crate::testing::{random_experts, OnlyFormat};
    use crate::WeightFormat;

    static OTHER: OnlyFormat = OnlyFormat { name: "other", format: WeightFormat::Bf16, cpu: Ok(()) };

    #[test]
    fn a_layer_takes_only_matrices_its_backend_packed_in_its_formats() {
        let cfg = MoeConfig::new(2, 1, 32, 32);
        let [g, u, d] = &random_experts(&cfg, 1)[0];
        let x = ExpertF32 { gate: g, up: u, down: d };
        let mut layer = LayerWeights::empty(&cfg, WeightFormat::Bf16, &OTHER).unwrap();
        let by_reference = pack_expert_f32(&REFERENCE, &cfg, WeightFormat::Bf16, x).unwrap();
        let e = layer.set_expert(0, by_reference).unwrap_err();
        assert_eq!(e, Error::PackedByOther { layer: "other", packed_by: "reference" });
        let int8 = pack_expert_f32(&OTHER, &cfg, WeightFormat::Int8Row, x).unwrap();
        assert!(matches!(layer.set_expert(0, int8).unwrap_err(), Error::FormatMismatch { expert: 0, .. }));
        let own = || pack_expert_f32(&OTHER, &cfg, WeightFormat::Bf16, x).unwrap();
        assert!(matches!(layer.set_expert(2, own()).unwrap_err(), Error::ShapeMismatch { .. }));
        layer.set_expert(1, own()).unwrap();
        assert_eq!(layer.expert_bytes(0), 0);
        assert!(layer.expert_bytes(1) > 0);
    }

    /// The forward names each stage to its executor before the stage's one call, in the
    /// plan's order (what `kt bench --stages` times): one part at one token Gather, GateUp,
    /// Down, Reduce; two parts add Merge.
    #[test]
    fn each_stage_is_named_before_its_call() {
        use alloc::vec::Vec;
        use std::sync::Mutex;

        /// Serial, recording each call's label (None: a call with none).
        struct Names(Mutex<(Option<&'static str>, Vec<Option<&'static str>>)>);
        impl Executor for Names {
            fn parallel_for(&self, n_tasks: usize, f: &(dyn Fn(usize, usize) + Sync)) {
                let mut s = self.0.lock().unwrap();
                let label = s.0.take();
                s.1.push(label);
                drop(s);
                crate::SerialExecutor.parallel_for(n_tasks, f);
            }
            fn workers(&self) -> usize {
                1
            }
            fn label(&self, what: &'static str) {
                self.0.lock().unwrap().0 = Some(what);
            }
        }
        for (parts, want) in [
            (1, &["Gather", "GateUp", "Down", "Reduce"][..]),
            (2, &["Gather", "GateUp", "Down", "Reduce", "Merge"][..]),
        ] {
            let cfg = MoeConfig { parts, ..MoeConfig::new(4, 2, 64, 64) };
            let layer = crate::testing::build_layer(&REFERENCE, &cfg, WeightFormat::Bf16, &random_experts(&cfg, 3));
            let input = crate::testing::random_input(1, 64, 5);
            let (ids, w) = crate::rng::random_routing(1, 2, 4, 7);
            let routing = Routing { tokens: 1, k: 2, ids: &ids, weights: &w, gpu_mask: None };
            let names = Names(Mutex::new((None, Vec::new())));
            crate::testing::run(&names, &cfg, &layer, &input, &routing);
            let got: Vec<_> = names.0.into_inner().unwrap().1;
            assert_eq!(got, want.iter().map(|&n| Some(n)).collect::<Vec<_>>(), "{parts} part(s)");
        }
    }
}
