//! The forward with its cache.

use alloc::vec;
use alloc::vec::Vec;
use core::ops::Range;

use half::bf16;

use super::kernels::SftKernels;
use super::lora::{Lora, Proj};
use super::Cache;
use crate::backend::{Backend, TaskShape};
use crate::forward::LayerWeights;
use crate::mat::{MatMut, SharedMut};
use crate::plan::{blocks, target_tasks, Plan, SKIPPED};
use crate::workers::{Carve, WorkerScratch};
use crate::{Error, Executor, LayerFormat, MoeConfig, Routing, WeightFormat};

/// Scratch reused across SFT calls; grows to the largest and stays.
#[derive(Debug, Default)]
pub struct Workspace {
    pub(crate) plan: Plan,
    pub(crate) scratch: WorkerScratch,
    /// The backward's per-row input gradients, `[rows, H]`.
    pub(crate) dx: Vec<f32>,
}

/// What an SFT layer must be: one part (the LoRA down product reads all of h) and plain
/// SwiGLU (the backward differentiates `silu`).
pub(crate) fn check_layer(cfg: &MoeConfig, w: &LayerWeights) -> Result<(), Error> {
    if w.parts.len() != 1 {
        return Err(Error::InvalidConfig {
            field: "parts (threadpool_count)",
            value: w.parts.len(),
            expected: "1: an SFT layer runs as one part".into(),
        });
    }
    if !cfg.glu.is_silu() {
        return Err(Error::InvalidConfig {
            field: "swiglu_limit / swiglu_alpha",
            value: cfg.glu.limit() as usize,
            expected: "0: SFT runs plain SwiGLU".into(),
        });
    }
    Ok(())
}

/// `out = bf16(Σ_j w_j · y_j)` over each token's computed slots, and `cache` filled: the
/// layer's inference forward with LoRA on every projection (`lora`: `None` runs the base
/// alone, KT's `SkipLoRA`).
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
    check_layer(cfg, w)?;
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
    let (rows, r) = (plan.row_tokens.len(), lora.map_or(0, |l| l.rank));
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
    let pieces = TaskPieces { m: max_rows, h, i, r };
    let blocks = ws.scratch.blocks(exec, pieces.bytes(backend, w.format) + backend.scratch_bytes(shape));
    let Cache { g, u, y, ax_g, ax_u, ah, .. } = cache;
    let (g, u, y) = (SharedMut::new(&mut g[..]), SharedMut::new(&mut u[..]), SharedMut::new(&mut y[..]));
    let (ax_g, ax_u, ah) = (SharedMut::new(&mut ax_g[..]), SharedMut::new(&mut ax_u[..]), SharedMut::new(&mut ah[..]));
    blocks.run(exec, plan.experts.len(), &|e| e, &|e, block| {
        let a = &plan.experts[e];
        let ew = w.parts[0].experts[a.id].as_ref().expect("checked above");
        let (m, at) = (a.rows, a.row_range());
        let tokens = &plan.row_tokens[at.clone()];
        let f = w.format;
        // SAFETY (every `rows_of` below): expert e's rows `at` are written by this task only.
        let (g, u, y) = unsafe { (rows_of(&g, &at, i), rows_of(&u, &at, i), rows_of(&y, &at, h)) };
        let mut carve = Carve::new(block);
        let (act, g32, u32_) = (carve.take::<u8>(pieces.act(backend, f)), carve.take(m * i), carve.take(m * i));
        let (hb, lora_f32) = (carve.take::<bf16>(m * i), carve.take::<f32>(pieces.lora()));
        let scratch = carve.rest();

        // gate and up: the base by `down` on the packed rows, then LoRA.
        let len = prepare(backend, f.gate, h, input, tokens, act, scratch);
        backend.down(&ew.gate, 0..i, &act[..len], MatMut::from_slice(g32, m, i, i), scratch);
        let len = match backend.act_layout(f.up) != backend.act_layout(f.gate) {
            true => prepare(backend, f.up, h, input, tokens, act, scratch),
            false => len,
        };
        backend.down(&ew.up, 0..i, &act[..len], MatMut::from_slice(u32_, m, i, i), scratch);
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

        // down on h, then LoRA.
        let len = prepare(backend, f.down, i, hb, &ident[..m], act, scratch);
        backend.down(&ew.down, 0..h, &act[..len], MatMut::from_slice(&mut y[..], m, h, h), scratch);
        if let Some(l) = lora {
            // SAFETY: as above.
            let ah = unsafe { rows_of(&ah, &at, l.rank) };
            add_lora(kernels, l, Proj::Down, a.id, cfg, (hb, &ident[..m]), ah, y, lora_f32);
        }
    });

    // out[t] = Σ_j w·y in slot order, as the inference forward's Reduce and Merge add it.
    let (y, slot_rows, wts) = (&cache.y[..], &plan.slot_rows[..], routing.weights);
    let slot = |s: usize| (slot_rows[s] != SKIPPED).then(|| (slot_rows[s] as usize, wts[s]));
    reduce(exec, (n, k, h), &slot, y, out);
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

    /// Bytes of every piece, in the order the task cuts them.
    fn bytes(&self, backend: &dyn Backend, f: LayerFormat) -> usize {
        let mi = self.m * self.i;
        Carve::bytes::<u8>(self.act(backend, f))
            + 2 * Carve::bytes::<f32>(mi)
            + Carve::bytes::<bf16>(mi)
            + Carve::bytes::<f32>(self.lora())
    }
}

/// `out[t] = bf16(0 + Σ_j w·src[row])` for every token `t` over its slots `j` ascending, where
/// `slot(t·k + j)` gives `(row, w)` (`None`: skipped), on `exec` in token chunks.
pub(crate) fn reduce(
    exec: &dyn Executor,
    (n, k, h): (usize, usize, usize),
    slot: &(dyn Fn(usize) -> Option<(usize, f32)> + Sync),
    src: &[f32],
    out: &mut [bf16],
) {
    let dst = SharedMut::new(out);
    let chunks: Vec<Range<usize>> = blocks(n, target_tasks(exec.workers()), 1).collect();
    exec.parallel_for(chunks.len(), &|c, _| {
        let tokens = chunks[c].clone();
        // SAFETY: token chunks are disjoint.
        let o = unsafe { dst.slice_mut(tokens.start * h..tokens.end * h) };
        let mut acc = vec![0.0f32; h];
        for (t, o) in tokens.zip(o.chunks_exact_mut(h)) {
            acc.fill(0.0);
            for (row, w) in (t * k..(t + 1) * k).filter_map(slot) {
                for (a, &v) in acc.iter_mut().zip(&src[row * h..][..h]) {
                    *a += w * v;
                }
            }
            for (o, &a) in o.iter_mut().zip(&acc) {
                *o = bf16::from_f32(0.0 + a);
            }
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
    cache.row_slots.clear();
    cache.row_slots.resize(plan.row_tokens.len(), SKIPPED);
    for (slot, &row) in plan.slot_rows.iter().enumerate() {
        if row != SKIPPED {
            cache.row_slots[row as usize] = slot as u32;
        }
    }
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
