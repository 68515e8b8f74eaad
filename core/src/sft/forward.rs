//! The forward with its cache.

use alloc::vec;
use alloc::vec::Vec;
use core::ops::Range;

use half::bf16;

use super::kernels::SftKernels;
use super::lora::{Lora, Proj};
use super::Cache;
use crate::backend::{Backend, TaskShape};
use crate::dtype::bf16_round;
use crate::forward::{ExpertWeights, LayerWeights};
use crate::mat::{copy_columns, MatMut, SharedMut};
use crate::plan::{blocks, target_tasks, Plan, SKIPPED};
use crate::workers::{Carve, WorkerScratch};
use crate::{Error, Executor, LayerFormat, MoeConfig, PackedMatrix, Routing, WeightFormat};

/// Scratch reused across SFT calls; grows to the largest and stays. A call writes what it
/// reads within the call (a backward reads its forward's `Cache`, never this), so the layers of
/// a model may share one.
#[derive(Debug, Default)]
pub struct Workspace {
    pub(crate) plan: Plan,
    pub(crate) scratch: WorkerScratch,
    /// The backward's per-row input gradients, `[rows, H]`.
    pub(crate) dx: Vec<f32>,
    /// A forward's outputs per NUMA part, `[parts, rows, H]`, for a layer of several parts.
    pub(crate) y_parts: Vec<f32>,
}

impl Workspace {
    /// Bytes its buffers hold (the routing plan's small vectors aside).
    pub fn bytes(&self) -> usize {
        self.scratch.bytes() + 4 * (self.dx.len() + self.y_parts.len())
    }
}

/// `out = bf16(Σ_j w_j · y_j)` over each token's computed slots, and `cache` filled: the
/// layer's inference forward with LoRA on every projection (`lora`: `None` runs the base
/// alone, KT's `SkipLoRA`). A layer of several NUMA parts runs each expert's parts in its one
/// task: gate and up by slices of I, down on each part's slice of h into that part's outputs,
/// summed per token as the inference forward's Down and Merge sum them (its bits with B
/// zero); the LoRA terms read the whole of g, u and h, and the down one goes to part 0's
/// outputs.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    exec: &dyn Executor,
    cfg: &MoeConfig,
    w: &LayerWeights,
    lora: Option<&Lora<'_>>,
    input: &[bf16],
    routing: &Routing<'_>,
    out: &mut [bf16],
    cache: &mut Cache,
    ws: &mut Workspace,
) -> Result<(), Error> {
    if let Some(l) = lora {
        l.validate(cfg)?;
    }
    let (n, h, i, k) = (routing.tokens, cfg.hidden, cfg.intermediate, routing.k);
    if input.len() != n * h {
        return Err(Error::ShapeMismatch { what: "hidden_states", expected: n * h, found: input.len() });
    }
    if out.len() != n * h {
        return Err(Error::ShapeMismatch { what: "output", expected: n * h, found: out.len() });
    }
    ws.plan.rebuild(cfg, routing, &[i], 1, 1, 1)?;
    let plan = &ws.plan;
    if let Some(a) = plan.experts.iter().find(|a| w.parts[0].experts[a.id].is_none()) {
        return Err(Error::ExpertNotLoaded { expert: a.id });
    }
    fill_routing(cache, plan, input, routing);
    let (rows, r, parts) = (plan.row_tokens.len(), lora.map_or(0, |l| l.rank), w.parts.len());
    // Each part's outputs where there are several (the cache keeps their sum).
    resize(&mut ws.y_parts, if parts > 1 { parts * rows * h } else { 0 });
    resize(&mut cache.g, rows * i);
    resize(&mut cache.u, rows * i);
    resize(&mut cache.y, rows * h);
    for v in [&mut cache.ax_g, &mut cache.ax_u, &mut cache.ah] {
        resize(v, rows * r);
    }

    let backend = w.backend();
    let max_rows = plan.experts.iter().map(|a| a.rows).max().unwrap_or(0);
    let shape = TaskShape { format: w.format, tokens: max_rows.max(1), rows: h.max(i), cols: h.max(i) };
    let ident = (0..max_rows as u32).collect::<Vec<_>>();
    let pieces = TaskPieces { m: max_rows, h, i, r, parts };
    let blocks = ws.scratch.blocks(exec, pieces.bytes(backend, w.format) + backend.scratch_bytes(shape));
    let Cache { g, u, y, ax_g, ax_u, ah, .. } = cache;
    let (g, u, y) = (SharedMut::new(&mut g[..]), SharedMut::new(&mut u[..]), SharedMut::new(&mut y[..]));
    let (ax_g, ax_u, ah) = (SharedMut::new(&mut ax_g[..]), SharedMut::new(&mut ax_u[..]), SharedMut::new(&mut ah[..]));
    let y_parts = SharedMut::new(&mut ws.y_parts[..]);
    blocks.run(exec, plan.experts.len(), &|e| e, &|e, block| {
        let a = &plan.experts[e];
        let part = |p: usize| w.parts[p].experts[a.id].as_ref().expect("checked above");
        let (m, at) = (a.rows, a.row_range());
        let tokens = &plan.row_tokens[at.clone()];
        let f = w.format;
        // SAFETY (every `rows_of` below): expert e's rows `at` are written by this task only
        // (of each part's outputs too).
        let (g, u, y) = unsafe { (rows_of(&g, &at, i), rows_of(&u, &at, i), rows_of(&y, &at, h)) };
        let mut carve = Carve::new(block);
        let (act, g32, u32_) = (carve.take::<u8>(pieces.act(backend, f)), carve.take(m * i), carve.take(m * i));
        let (hb, lora_f32) = (carve.take::<bf16>(m * i), carve.take::<f32>(pieces.lora()));
        let h_part = carve.take::<bf16>(pieces.h_part());
        let scratch = carve.rest();

        // gate and up: the base by `down` on each part's packed rows (into its columns of I),
        // then LoRA.
        let by_parts = |mat: fn(&ExpertWeights) -> &PackedMatrix, act: &[u8], out: &mut [f32], scratch: &mut [u8]| {
            for (p, range) in w.parts.iter().map(|p| p.range.clone()).enumerate() {
                let view = MatMut::from_slice(&mut out[range.start..], m, range.len(), i);
                backend.down(mat(part(p)), 0..range.len(), act, view, scratch);
            }
        };
        let len = prepare(backend, f.gate, h, input, tokens, act, scratch);
        by_parts(|e| &e.gate, &act[..len], g32, scratch);
        let len = match backend.act_layout_for(f.up, m) != backend.act_layout_for(f.gate, m) {
            true => prepare(backend, f.up, h, input, tokens, act, scratch),
            false => len,
        };
        by_parts(|e| &e.up, &act[..len], u32_, scratch);
        let kernels = backend.sft_kernels();
        if let Some(l) = lora {
            // SAFETY: as above.
            let (axg, axu) = unsafe { (rows_of(&ax_g, &at, l.rank), rows_of(&ax_u, &at, l.rank)) };
            add_lora(kernels, l, Proj::Gate, a.id, cfg, (input, tokens), axg, g32, lora_f32);
            add_lora(kernels, l, Proj::Up, a.id, cfg, (input, tokens), axu, u32_, lora_f32);
        }
        (kernels.glu)(cfg.glu, i, g32, u32_, hb);
        for ((g, u), (g32, u32_)) in g.iter_mut().zip(u.iter_mut()).zip(g32.iter().zip(&*u32_)) {
            (*g, *u) = (bf16::from_f32(*g32), bf16::from_f32(*u32_));
        }

        // down on each part's slice of h into its outputs, then LoRA into part 0's.
        // SAFETY: as above, in part p's outputs (several parts).
        let part_out = |p: usize| unsafe { y_parts.slice_mut((p * rows + at.start) * h..(p * rows + at.end) * h) };
        for (p, range) in w.parts.iter().map(|p| p.range.clone()).enumerate() {
            let ip = range.len();
            let src = match parts {
                1 => &hb[..],
                _ => {
                    copy_columns(hb, i, range.clone(), &mut h_part[..m * ip]);
                    &h_part[..m * ip]
                }
            };
            let len = prepare(backend, f.down, ip, src, &ident[..m], act, scratch);
            let dst = if parts == 1 { &mut *y } else { part_out(p) };
            backend.down(&part(p).down, 0..h, &act[..len], MatMut::from_slice(dst, m, h, h), scratch);
        }
        if let Some(l) = lora {
            // SAFETY: as above.
            let ah = unsafe { rows_of(&ah, &at, l.rank) };
            let dst = if parts == 1 { &mut *y } else { part_out(0) };
            add_lora(kernels, l, Proj::Down, a.id, cfg, (hb, &ident[..m]), ah, dst, lora_f32);
        }
        if parts > 1 {
            y.fill(0.0);
            for p in 0..parts {
                for (y, v) in y.iter_mut().zip(&*part_out(p)) {
                    *y += v;
                }
            }
        }
    });

    // out[t] = Σ_p Σ_j w·y_p in row order, as the inference forward's Down and Merge add it.
    let (slot_rows, wts) = (&plan.slot_rows[..], routing.weights);
    let slot = |s: usize| (slot_rows[s] != SKIPPED).then(|| (slot_rows[s] as usize, wts[s]));
    let part_ys: Vec<&[f32]> = match parts {
        1 => vec![&cache.y[..]],
        _ => ws.y_parts.chunks_exact(rows * h).collect(),
    };
    reduce(exec, (n, k, h), &slot, &part_ys, out);
    Ok(())
}

/// `rows` of `input` (`[_, cols]`) prepared for `format` into the front of `act`; its length.
fn prepare(
    backend: &dyn Backend,
    format: WeightFormat,
    cols: usize,
    input: &[bf16],
    rows: &[u32],
    act: &mut [u8],
    scratch: &mut [u8],
) -> usize {
    let act = &mut act[..backend.act_bytes(format, rows.len(), cols)];
    act.fill(0);
    backend.quantize_act(format, cols, input, rows, act, scratch);
    act.len()
}

/// The buffers an SFT forward task cuts from its worker's block, for experts of up to `m` rows
/// and LoRA of rank `r`.
#[derive(Clone, Copy)]
struct TaskPieces {
    m: usize,
    h: usize,
    i: usize,
    r: usize,
    parts: usize,
}

impl TaskPieces {
    /// Bytes of the largest activations a task prepares (gate/up's of H, down's of I).
    fn act(&self, backend: &dyn Backend, f: LayerFormat) -> usize {
        let (m, h, i) = (self.m, self.h, self.i);
        [backend.act_bytes(f.gate, m, h), backend.act_bytes(f.up, m, h), backend.act_bytes(f.down, m, i)]
            .into_iter()
            .max()
            .unwrap_or(0)
    }

    /// f32 scratch of one projection's LoRA term ([`add_lora`]).
    fn lora(&self) -> usize {
        let d = self.h.max(self.i);
        (self.r * d).max(SftKernels::project_scratch(d))
    }

    /// bf16 of one part's slice of h, copied out where there are several parts.
    fn h_part(&self) -> usize {
        if self.parts > 1 {
            self.m * self.i
        } else {
            0
        }
    }

    /// Bytes of every piece, in the order the task cuts them.
    fn bytes(&self, backend: &dyn Backend, f: LayerFormat) -> usize {
        let mi = self.m * self.i;
        Carve::bytes::<u8>(self.act(backend, f))
            + 2 * Carve::bytes::<f32>(mi)
            + Carve::bytes::<bf16>(mi)
            + Carve::bytes::<f32>(self.lora())
            + Carve::bytes::<bf16>(self.h_part())
    }
}

/// `out[t] = bf16(0 + Σ_p Σ_j w·src_p[row])` for every token `t` over its slots' rows
/// ascending (by expert, then slot: the inference forward's Down adds them so), parts `p`
/// ascending, each part's sum made first, where `slot(t·k + j)` gives `(row, w)` (`None`:
/// skipped), on `exec` in token chunks.
pub(crate) fn reduce(
    exec: &dyn Executor,
    (n, k, h): (usize, usize, usize),
    slot: &(dyn Fn(usize) -> Option<(usize, f32)> + Sync),
    srcs: &[&[f32]],
    out: &mut [bf16],
) {
    let dst = SharedMut::new(out);
    let chunks: Vec<Range<usize>> = blocks(n, target_tasks(exec.workers()), 1).collect();
    exec.parallel_for(chunks.len(), &|c, _| {
        let tokens = chunks[c].clone();
        // SAFETY: token chunks are disjoint.
        let o = unsafe { dst.slice_mut(tokens.start * h..tokens.end * h) };
        let (mut sum, mut acc, mut rows) = (vec![0.0f32; h], vec![0.0f32; h], Vec::with_capacity(k));
        for (t, o) in tokens.zip(o.chunks_exact_mut(h)) {
            sum.fill(0.0);
            rows.clear();
            rows.extend((t * k..(t + 1) * k).filter_map(slot));
            rows.sort_unstable_by_key(|&(row, _)| row);
            for src in srcs {
                acc.fill(0.0);
                for &(row, w) in &rows {
                    for (a, &v) in acc.iter_mut().zip(&src[row * h..][..h]) {
                        *a += w * v;
                    }
                }
                for (s, &a) in sum.iter_mut().zip(&acc) {
                    *s += a;
                }
            }
            o.iter_mut().zip(&sum).for_each(|(o, &s)| *o = bf16_round(s));
        }
    });
}

/// Rows `at` of a `[rows, width]` buffer.
///
/// # Safety
/// No other live reference overlaps those rows.
pub(crate) unsafe fn rows_of<'a, T>(v: &SharedMut<'a, T>, at: &Range<usize>, width: usize) -> &'a mut [T] {
    // SAFETY: the caller's contract.
    unsafe { v.slice_mut(at.start * width..at.end * width) }
}

/// `v` at length `len`, its old values kept (every element is written before it is read).
pub(crate) fn resize<T: Copy + Default>(v: &mut Vec<T>, len: usize) {
    v.resize(len, T::default());
}

/// The cache's input, routing and row maps from `plan`.
fn fill_routing(cache: &mut Cache, plan: &Plan, input: &[bf16], routing: &Routing<'_>) {
    cache.tokens = routing.tokens;
    cache.k = routing.k;
    cache.weights.clear();
    cache.weights.extend_from_slice(routing.weights);
    cache.x.clear();
    cache.x.extend_from_slice(input);
    cache.experts.clone_from(&plan.experts);
    cache.row_tokens.clone_from(&plan.row_tokens);
    cache.row_slots.clone_from(&plan.row_slots);
}

/// Projection `p`'s LoRA term of expert `e` added to `out` (`[rows, out]`) by `kernels`: for
/// each row, `ax = A·input(row)` (kept in `ax`, `[rows, r]`), then `out += s·B·ax`, where the
/// input rows are `rows` of `x` (`[_, in]`). A term that is zero is not added, so a LoRA whose
/// B is zero leaves the base's bits.
#[allow(clippy::too_many_arguments)]
fn add_lora(
    kernels: &SftKernels,
    l: &Lora<'_>,
    p: Proj,
    e: usize,
    cfg: &MoeConfig,
    (x, rows): (&[bf16], &[u32]),
    ax: &mut [f32],
    out: &mut [f32],
    scratch: &mut [f32],
) {
    let (din, _) = p.dims(cfg);
    let (a, b) = l.of(p, e, cfg);
    (kernels.project)(a, din, x, rows, scratch, ax);
    (kernels.expand)(b, l.rank, ax, l.scaling(), scratch, out);
}
