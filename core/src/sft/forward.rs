//! The forward with its cache.

use alloc::vec;
use alloc::vec::Vec;
use core::ops::Range;

use half::bf16;

use super::lora::{Lora, Proj};
use super::Cache;
use crate::aligned::AlignedBuf;
use crate::backend::TaskShape;
use crate::forward::LayerWeights;
use crate::mat::{MatMut, SharedMut};
use crate::plan::{blocks, target_tasks, Plan, SKIPPED};
use crate::workers::WorkerScratch;
use crate::{Error, Executor, MoeConfig, Routing};

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
    let blocks = ws.scratch.blocks(exec, backend.scratch_bytes(shape));
    let Cache { g, u, y, ax_g, ax_u, ah, .. } = cache;
    let (g, u, y) = (SharedMut::new(&mut g[..]), SharedMut::new(&mut u[..]), SharedMut::new(&mut y[..]));
    let (ax_g, ax_u, ah) = (SharedMut::new(&mut ax_g[..]), SharedMut::new(&mut ax_u[..]), SharedMut::new(&mut ah[..]));
    blocks.run(exec, plan.experts.len(), &|e| e, &|e, scratch| {
        let a = &plan.experts[e];
        let ew = w.parts[0].experts[a.id].as_ref().expect("checked above");
        let (m, at) = (a.rows, a.row_range());
        let tokens = &plan.row_tokens[at.clone()];
        let f = w.format;
        // SAFETY (every `rows_of` below): expert e's rows `at` are written by this task only.
        let (g, u, y) = unsafe { (rows_of(&g, &at, i), rows_of(&u, &at, i), rows_of(&y, &at, h)) };

        // gate and up: the base by `down` on the packed rows, then LoRA.
        let mut act = AlignedBuf::zeroed(backend.act_bytes(f.gate, m, h));
        backend.quantize_act(f.gate, h, input, tokens, act.as_mut_slice(), scratch);
        let (mut g32, mut u32_) = (vec![0.0f32; m * i], vec![0.0f32; m * i]);
        backend.down(&ew.gate, 0..i, act.as_slice(), MatMut::from_slice(&mut g32, m, i, i), scratch);
        if backend.act_layout(f.up) != backend.act_layout(f.gate) {
            act = AlignedBuf::zeroed(backend.act_bytes(f.up, m, h));
            backend.quantize_act(f.up, h, input, tokens, act.as_mut_slice(), scratch);
        }
        backend.down(&ew.up, 0..i, act.as_slice(), MatMut::from_slice(&mut u32_, m, i, i), scratch);
        if let Some(l) = lora {
            let x = |row: usize| &input[tokens[row] as usize * h..][..h];
            // SAFETY: as above.
            let (axg, axu) = unsafe { (rows_of(&ax_g, &at, l.rank), rows_of(&ax_u, &at, l.rank)) };
            add_lora(l, Proj::Gate, a.id, cfg, x, axg, &mut g32);
            add_lora(l, Proj::Up, a.id, cfg, x, axu, &mut u32_);
        }
        let mut hb = vec![bf16::ZERO; m * i];
        for (((hb, g), u), (g32, u32_)) in hb.iter_mut().zip(g.iter_mut()).zip(u.iter_mut()).zip(g32.iter().zip(&u32_))
        {
            *hb = cfg.glu.apply(*g32, *u32_);
            (*g, *u) = (bf16::from_f32(*g32), bf16::from_f32(*u32_));
        }

        // down on h, then LoRA.
        let mut act = AlignedBuf::zeroed(backend.act_bytes(f.down, m, i));
        backend.quantize_act(f.down, i, &hb, &ident[..m], act.as_mut_slice(), scratch);
        backend.down(&ew.down, 0..h, act.as_slice(), MatMut::from_slice(&mut y[..], m, h, h), scratch);
        if let Some(l) = lora {
            // SAFETY: as above.
            let ah = unsafe { rows_of(&ah, &at, l.rank) };
            add_lora(l, Proj::Down, a.id, cfg, |row| &hb[row * i..][..i], ah, y);
        }
    });

    // out[t] = Σ_j w·y in slot order, as the inference forward's Reduce and Merge add it.
    let (y, slot_rows, wts) = (&cache.y[..], &plan.slot_rows[..], routing.weights);
    let slot = |s: usize| (slot_rows[s] != SKIPPED).then(|| (slot_rows[s] as usize, wts[s]));
    reduce(exec, (n, k, h), &slot, y, out);
    Ok(())
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

/// Projection `p`'s LoRA term of expert `e` added to `out` (`[rows, out]`): for each row,
/// `ax = A·input(row)` (kept in `ax`, `[rows, r]`), then `out += s·B·ax`. A term that is zero
/// is not added, so a LoRA whose B is zero leaves the base's bits.
pub(crate) fn add_lora<'x>(
    l: &Lora<'_>,
    p: Proj,
    e: usize,
    cfg: &MoeConfig,
    input: impl Fn(usize) -> &'x [bf16],
    ax: &mut [f32],
    out: &mut [f32],
) {
    let (din, dout) = p.dims(cfg);
    let (a, b) = l.of(p, e, cfg);
    let (r, s) = (l.rank, l.scaling());
    let a = widen(a);
    let b = widen(b);
    let mut x = vec![0.0f32; din];
    for (row, (ax, out)) in ax.chunks_exact_mut(r).zip(out.chunks_exact_mut(dout)).enumerate() {
        for (x, v) in x.iter_mut().zip(input(row)) {
            *x = v.to_f32();
        }
        for (q, ax) in ax.iter_mut().enumerate() {
            *ax = dot(&a[q * din..][..din], &x);
        }
        for (o, out) in out.iter_mut().enumerate() {
            let d = dot(&b[o * r..][..r], ax);
            if d != 0.0 {
                *out += s * d;
            }
        }
    }
}

/// `Σ a[i]·b[i]`, in 8 interleaved partial sums added at the end (independent chains the
/// compiler puts in vector registers; one chain in order ran the rank-r products at a scalar
/// add's latency: the SFT forward took 2.7× the inference forward at qwen3-30b-a3b n=256).
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac.remainder().iter().zip(bc.remainder()).map(|(a, b)| a * b).sum();
    for (a, b) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] += a[l] * b[l];
        }
    }
    ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail
}

/// bf16 values as f32.
pub(crate) fn widen(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|v| v.to_f32()).collect()
}
