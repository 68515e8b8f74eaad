//! Runs a [`Plan`] on a backend and an executor: the one forward pass every caller uses.
//!
//! Scratch layout (all token-major, experts' rows contiguous in plan order):
//!
//! ```text
//!  act_x : per active expert, backend-prepared x rows          (64-byte aligned blocks)
//!  h     : per part p, [rows_total × I_p] bf16                  GateUp writes column blocks
//!  act_h : per part, per expert, prepared h rows               (64-byte aligned blocks)
//!  y     : per part, [rows_total × H] f32                       Down writes column blocks
//!  out_p : per part, [tokens × H] f32                           Reduce writes token chunks
//! ```

use alloc::vec::Vec;
use core::ops::Range;

use half::bf16;

use crate::aligned::{round_up, AlignedBuf};
use crate::mat::SharedMut;
use crate::plan::{target_tasks, Plan, StageKind, Task, SKIPPED};
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

/// All packed weights of one layer.
#[derive(Debug)]
pub struct LayerWeights {
    /// The formats the matrices were packed from.
    pub format: LayerFormat,
    /// One entry per NUMA part.
    pub parts: Vec<PartWeights>,
}

impl LayerWeights {
    /// A layer with no expert loaded yet.
    pub fn empty(cfg: &MoeConfig, format: impl Into<LayerFormat>) -> Result<Self, Error> {
        let format = format.into();
        cfg.validate_for(format)?;
        let parts = cfg
            .part_ranges(format)?
            .into_iter()
            .map(|range| PartWeights { range, experts: (0..cfg.experts).map(|_| None).collect() })
            .collect();
        Ok(LayerWeights { format, parts })
    }

    /// Install expert `e` (one [`ExpertWeights`] per part, as [`pack_expert`] returns).
    pub fn set_expert(&mut self, e: usize, per_part: Vec<ExpertWeights>) {
        for (p, w) in self.parts.iter_mut().zip(per_part) {
            p.experts[e] = Some(w);
        }
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
    let down: Vec<f32> = (0..h).flat_map(|row| x.down[row * i + r.start..row * i + r.end].iter().copied()).collect();
    Ok(ExpertWeights {
        gate: backend.pack(&rows(format.gate, x.gate)?)?,
        up: backend.pack(&rows(format.up, x.up)?)?,
        down: backend.pack(&QuantMatrix::quantize(format.down, h, r.len(), &down)?)?,
    })
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

/// Scratch reused across forwards; grows to the largest call and stays.
#[derive(Debug, Default)]
pub struct Workspace {
    act_x: AlignedBuf,
    act_h: AlignedBuf,
    h: Vec<bf16>,
    /// Down's results, rows [`y_stride`] apart.
    y: Vec<f32>,
    out_parts: Vec<f32>,
    ident: Vec<u32>,
}

/// The row stride of the down projection's results `y` (`hidden` floats a row): one cache line
/// more than a row, so that a tile's results for consecutive tokens fall in different L1 sets.
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

/// Prefix offsets of 64-byte rounded blocks: `off[i]..off[i] + len[i]` for each block.
fn offsets(lens: impl Iterator<Item = usize>) -> (Vec<usize>, Vec<usize>, usize) {
    let (mut off, mut len, mut at) = (Vec::new(), Vec::new(), 0);
    for l in lens {
        off.push(at);
        len.push(l);
        at += round_up(l);
    }
    (off, len, at)
}

/// `out[n,H] = Σ_j w[t,j] · expert_{ids[t,j]}(input[t])` over the CPU-resident experts.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    backend: &dyn Backend,
    exec: &dyn Executor,
    cfg: &MoeConfig,
    w: &LayerWeights,
    input: &[bf16],
    routing: &Routing<'_>,
    out: &mut [bf16],
    ws: &mut Workspace,
) -> Result<(), Error> {
    let (n, hd, k, fmt, down_fmt) = (routing.tokens, cfg.hidden, routing.k, w.format.gate, w.format.down);
    if input.len() != n * hd {
        return Err(Error::ShapeMismatch { what: "hidden_states", expected: n * hd, found: input.len() });
    }
    if out.len() != n * hd {
        return Err(Error::ShapeMismatch { what: "output", expected: n * hd, found: out.len() });
    }
    let part_rows: Vec<usize> = w.parts.iter().map(|p| p.range.len()).collect();
    let (gran_i, gran_h) = (backend.row_granularity(fmt), backend.row_granularity(down_fmt));
    let plan = Plan::build(cfg, routing, &part_rows, gran_i, gran_h, target_tasks(exec.workers()))?;
    for a in &plan.experts {
        if w.parts.iter().any(|p| p.experts.get(a.id).is_none_or(Option::is_none)) {
            return Err(Error::ExpertNotLoaded { expert: a.id });
        }
    }
    let (rows_total, ys) = (plan.row_tokens.len(), y_stride(hd));
    let parts = w.parts.len();
    let (x_off, x_len, x_total) = offsets(plan.experts.iter().map(|a| backend.act_bytes(fmt, a.rows, hd)));
    let (ah_off, ah_len, ah_total) = offsets(
        part_rows.iter().flat_map(|&ip| plan.experts.iter().map(move |a| backend.act_bytes(down_fmt, a.rows, ip))),
    );
    let h_base: Vec<usize> =
        part_rows.iter().scan(0, |at, &ip| Some(core::mem::replace(at, *at + rows_total * ip))).collect();
    let max_rows = plan.experts.iter().map(|a| a.rows).max().unwrap_or(0);
    ws.act_x.ensure(x_total);
    ws.act_h.ensure(ah_total);
    grow(&mut ws.h, rows_total * cfg.intermediate);
    grow(&mut ws.y, parts * rows_total * ys);
    grow(&mut ws.out_parts, parts * n * hd);
    if ws.ident.len() < max_rows {
        ws.ident = (0..max_rows as u32).collect();
    }
    let active = plan.experts.len();
    let expert = |p: usize, e: usize| w.parts[p].experts[plan.experts[e].id].as_ref().expect("checked above");
    // Part tasks go to their part's sub-pool; Gather and Merge tasks are spread over all.
    let run = |tasks: &[Task], f: &(dyn Fn(&Task) + Sync)| {
        exec.parallel_for_grouped(tasks.len(), &|i| tasks[i].part().unwrap_or(i), &|i, _| f(&tasks[i]))
    };

    for stage in &plan.stages {
        match stage.kind {
            StageKind::Gather => {
                let dst = SharedMut::new(ws.act_x.as_mut_slice());
                run(&stage.tasks, &|t| {
                    let Task::Gather { expert: e } = *t else { unreachable!() };
                    // SAFETY: each active expert's act_x block is written by its one Gather task.
                    let d = unsafe { dst.slice_mut(x_off[e]..x_off[e] + x_len[e]) };
                    backend.quantize_act(fmt, hd, input, &plan.row_tokens[plan.experts[e].row_range()], d);
                });
            }
            StageKind::GateUp => {
                let (act_x, h) = (ws.act_x.as_slice(), SharedMut::new(&mut ws.h[..]));
                run(&stage.tasks, &|t| {
                    let Task::GateUp { part: p, expert: e, ref rows } = *t else { unreachable!() };
                    let (a, ip) = (&plan.experts[e], part_rows[p]);
                    // SAFETY: GateUp tasks of one (part, expert) own disjoint column blocks of its rows.
                    let view = unsafe { h.mat_mut(h_base[p] + a.first_row * ip + rows.start, a.rows, rows.len(), ip) };
                    let ew = expert(p, e);
                    backend.gate_up(&ew.gate, &ew.up, rows.clone(), &act_x[x_off[e]..x_off[e] + x_len[e]], view);
                });
            }
            StageKind::PrepareDown => {
                let (h, ident, dst) = (&ws.h[..], &ws.ident[..], SharedMut::new(ws.act_h.as_mut_slice()));
                run(&stage.tasks, &|t| {
                    let Task::PrepareDown { part: p, expert: e } = *t else { unreachable!() };
                    let (a, ip, i) = (&plan.experts[e], part_rows[p], p * active + e);
                    let src = &h[h_base[p] + a.first_row * ip..h_base[p] + (a.first_row + a.rows) * ip];
                    // SAFETY: one PrepareDown task per (part, expert) block.
                    let d = unsafe { dst.slice_mut(ah_off[i]..ah_off[i] + ah_len[i]) };
                    backend.quantize_act(down_fmt, ip, src, &ident[..a.rows], d);
                });
            }
            StageKind::Down => {
                let (act_h, y) = (ws.act_h.as_slice(), SharedMut::new(&mut ws.y[..]));
                run(&stage.tasks, &|t| {
                    let Task::Down { part: p, expert: e, ref rows } = *t else { unreachable!() };
                    let (a, i) = (&plan.experts[e], p * active + e);
                    let at = (p * rows_total + a.first_row) * ys + rows.start;
                    // SAFETY: Down tasks of one (part, expert) own disjoint column blocks of its rows.
                    let view = unsafe { y.mat_mut(at, a.rows, rows.len(), ys) };
                    backend.down(&expert(p, e).down, rows.clone(), &act_h[ah_off[i]..ah_off[i] + ah_len[i]], view);
                });
            }
            StageKind::Reduce => {
                let (y, dst) = (&ws.y[..], SharedMut::new(&mut ws.out_parts[..]));
                run(&stage.tasks, &|t| {
                    let Task::Reduce { part: p, ref tokens } = *t else { unreachable!() };
                    // SAFETY: Reduce tasks of one part own disjoint token chunks.
                    let acc = unsafe { dst.slice_mut((p * n + tokens.start) * hd..(p * n + tokens.end) * hd) };
                    for (ti, acc) in tokens.clone().zip(acc.chunks_exact_mut(hd)) {
                        acc.fill(0.0);
                        for j in 0..k {
                            let r = plan.slot_rows[ti * k + j];
                            if r == SKIPPED {
                                continue;
                            }
                            let wt = routing.weights[ti * k + j];
                            let yr = &y[(p * rows_total + r as usize) * ys..][..hd];
                            for (o, &v) in acc.iter_mut().zip(yr) {
                                *o += wt * v;
                            }
                        }
                    }
                });
            }
            StageKind::Merge => {
                let (parts_out, dst) = (&ws.out_parts[..], SharedMut::new(&mut out[..]));
                run(&stage.tasks, &|t| {
                    let Task::Merge { ref tokens } = *t else { unreachable!() };
                    // SAFETY: Merge tasks own disjoint token chunks of the output.
                    let o = unsafe { dst.slice_mut(tokens.start * hd..tokens.end * hd) };
                    for (i, o) in o.iter_mut().enumerate() {
                        let at = tokens.start * hd + i;
                        let s = (0..parts).fold(0.0f32, |s, p| s + parts_out[p * n * hd + at]);
                        *o = bf16::from_f32(s);
                    }
                });
            }
        }
    }
    Ok(())
}
