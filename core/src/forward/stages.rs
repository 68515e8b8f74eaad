//! The forward's stages, one function each, in the order [`super::forward`] runs them. Each
//! takes its own stage's tasks ([`crate::plan::Stages`]) and the buffers it reads and writes;
//! what every stage reads is in [`Call`].

use core::ops::Range;
use core::sync::atomic::{AtomicUsize, Ordering};

use half::bf16;

use super::workspace::{Layout, Sizes};
use super::{ExpertWeights, LayerWeights};
use crate::dtype::bf16_round;
use crate::mat::{MatMut, SharedMut};
use crate::plan::{y_stride, ActiveExpert, DownTask, GateUpTask, GatherTask, MergeTask, Plan, ReduceTask, StageTask};
use crate::workers::{Blocks, Carve};
use crate::{Backend, Executor, LayerFormat, MoeConfig};

/// What every stage of one forward reads.
pub(super) struct Call<'a> {
    pub exec: &'a dyn Executor,
    pub cfg: &'a MoeConfig,
    pub w: &'a LayerWeights,
    pub input: &'a [bf16],
    /// The routing's weights, `[tokens, k]`.
    pub weights: &'a [f32],
    pub plan: &'a Plan,
    pub layout: &'a Layout,
    pub sizes: Sizes,
    /// The workers' scratch blocks.
    pub blocks: Blocks<'a>,
    /// The bf16 output, `[tokens, H]`.
    pub out: SharedMut<'a, bf16>,
}

impl<'a> Call<'a> {
    fn backend(&self) -> &'static dyn Backend {
        self.w.backend()
    }

    fn format(&self) -> LayerFormat {
        self.w.format
    }

    /// Part `p`'s weights of active expert `e`.
    fn expert(&self, p: usize, e: usize) -> &ExpertWeights {
        self.w.parts[p].experts[self.plan.experts[e].id].as_ref().expect("checked by Workspace::prepare")
    }

    /// `f(task, its worker's scratch)` for every task, named to the executor as its stage;
    /// nothing for a stage without tasks. Part tasks go to their part's sub-pool; Gather and
    /// Merge tasks are spread over all.
    fn run<T: StageTask + Sync>(&self, tasks: &[T], f: &(dyn Fn(&T, &mut [u8]) + Sync)) {
        if tasks.is_empty() {
            return;
        }
        self.exec.label(T::KIND.name());
        self.blocks.run(self.exec, tasks.len(), &|i| tasks[i].part().unwrap_or(i), &|i, scratch| f(&tasks[i], scratch))
    }

    /// Columns `cols` of token `t`'s output row onwards (`cols` may pass the row's end).
    ///
    /// # Safety
    /// The caller's task owns them (a Down task of one part its rows of H of every token, a
    /// Reduce or Merge task its tokens), and holds one such borrow at a time.
    unsafe fn out_cols(&self, t: usize, cols: Range<usize>) -> &'a mut [bf16] {
        let hd = self.cfg.hidden;
        // SAFETY: forwarded from the caller: no other task touches these elements meanwhile.
        unsafe { self.out.slice_mut(t * hd + cols.start..t * hd + cols.end) }
    }
}

/// Gather: each owner expert's token rows, prepared for gate's layout (and up's where it
/// differs) into its `act_x` blocks.
pub(super) fn gather(c: &Call<'_>, tasks: &[GatherTask], act_x: &mut [u8]) {
    let (backend, f, hd) = (c.backend(), c.format(), c.cfg.hidden);
    let dst = SharedMut::new(act_x);
    c.run(tasks, &|&GatherTask { expert: e }, scratch| {
        let tokens = &c.plan.row_tokens[c.plan.experts[e].row_range()];
        let [g, u] = &c.layout.x_blocks[e];
        // SAFETY: each active expert's act_x blocks are written by its one Gather task.
        backend.quantize_act(f.gate, hd, c.input, tokens, unsafe { dst.slice_mut(g.clone()) }, scratch);
        if u != g {
            // SAFETY: as above.
            backend.quantize_act(f.up, hd, c.input, tokens, unsafe { dst.slice_mut(u.clone()) }, scratch);
        }
    });
}

/// GateUp: `h = SwiGLU(gate·x, up·x)` per (part, expert, block of I rows); the task that
/// finishes a (part, expert)'s blocks prepares its `h` rows for down into its `act_h` block.
pub(super) fn gate_up(c: &Call<'_>, tasks: &[GateUpTask], act_x: &[u8], h: &mut [bf16], act_h: &mut [u8]) {
    let (backend, f, l) = (c.backend(), c.format(), c.layout);
    let active = c.plan.experts.len();
    let left: &[AtomicUsize] = &l.gate_up_left[..c.w.parts.len() * active];
    left.iter().for_each(|l| l.store(0, Ordering::Relaxed));
    for t in tasks {
        left[t.part * active + t.expert].fetch_add(1, Ordering::Relaxed);
    }
    let (h, dst) = (SharedMut::new(h), SharedMut::new(act_h));
    c.run(tasks, &|t, scratch| {
        let GateUpTask { part: p, expert: e, ref rows } = *t;
        let (a, ip, i) = (&c.plan.experts[e], l.part_rows[p], p * active + e);
        let base = l.h_base[p] + a.first_row * ip;
        // SAFETY: GateUp tasks of one (part, expert) own disjoint column blocks of its rows.
        let view = unsafe { h.mat_mut(base + rows.start, a.rows, rows.len(), ip) };
        let (ew, [g, u]) = (c.expert(p, e), &l.x_blocks[e]);
        let bias = c.w.bias(a.id).map(|b| b.gate_up(c.w.parts[p].range.clone()));
        backend.gate_up(
            &ew.gate,
            &ew.up,
            rows.clone(),
            &act_x[g.clone()],
            &act_x[u.clone()],
            c.cfg.glu,
            bias,
            view,
            scratch,
        );
        // The last of (p, e)'s tasks to finish (AcqRel: after the others' writes to its rows)
        // prepares them for down.
        if left[i].fetch_sub(1, Ordering::AcqRel) == 1 {
            // SAFETY: every GateUp task of (p, e) has finished writing its rows, and only this
            // one reads them or writes (p, e)'s act_h block.
            let (src, d) = unsafe { (h.slice_mut(base..base + a.rows * ip), dst.slice_mut(l.h_blocks[i].clone())) };
            backend.quantize_act(f.down, ip, src, &l.ident[..a.rows], d, scratch);
        }
    });
}

/// Down: `y = down·h` per (part, expert, block of H rows) into `y`; or, where the plan sums in
/// Down (a task of every expert), each task's rows of H of every token summed into `out_parts`
/// (and with one part written to the output).
pub(super) fn down(c: &Call<'_>, tasks: &[DownTask], act_h: &[u8], y: &mut [f32], out_parts: &mut [f32]) {
    let (backend, l, s) = (c.backend(), c.layout, c.sizes);
    let (n, hd, ys) = (c.plan.tokens, c.cfg.hidden, y_stride(c.cfg.hidden));
    let (parts, active) = (c.w.parts.len(), c.plan.experts.len());
    let (y, dst) = (SharedMut::new(y), SharedMut::new(out_parts));
    c.run(tasks, &|t, block| {
        let DownTask { part: p, expert: owner, ref rows } = *t;
        let down = |e: usize, y: MatMut<'_, f32>, scratch: &mut [u8]| {
            let h = &act_h[l.h_blocks[p * active + e].clone()];
            backend.down(&c.expert(p, e).down, rows.clone(), h, y, scratch)
        };
        let Some(e) = owner else {
            // Every expert on these rows of H, each one's results summed in at once.
            let (scratch, rest) = block.split_at_mut(s.backend_scratch);
            let results = Carve::new(rest).take::<f32>(s.tile);
            let stride = y_stride(rows.len());
            // SAFETY: the part's Down tasks own disjoint column blocks of its output rows; each
            // borrow ends before the next.
            let out_row =
                |t: usize| unsafe { dst.slice_mut((p * n + t) * hd + rows.start..(p * n + t) * hd + rows.end) };
            for t in 0..n {
                out_row(t).fill(0.0);
            }
            for (e, a) in c.plan.experts.iter().enumerate() {
                let y = MatMut::from_slice(&mut results[..a.rows * stride], a.rows, rows.len(), stride);
                down(e, y, scratch);
                // Down's bias once per slot: with the first part's share.
                let bias = c.w.bias(a.id).filter(|_| p == 0).map(|b| &b.down[rows.clone()]);
                add_rows(c.plan, a, 0..n, (&results[..], stride, 0), c.weights, bias, &out_row);
            }
            if parts == 1 {
                for t in 0..n {
                    let sum = &*out_row(t);
                    // SAFETY: this task owns these rows of H of every token's output.
                    merge_parts(1, |_| sum, unsafe { c.out_cols(t, rows.clone()) });
                }
            }
            return;
        };
        let a = &c.plan.experts[e];
        let at = (p * s.rows_total + a.first_row) * ys + rows.start;
        // SAFETY: Down tasks of one (part, expert) own disjoint column blocks of its rows.
        down(e, unsafe { y.mat_mut(at, a.rows, rows.len(), ys) }, block);
    });
}

/// Reduce: each token's rows of `y` weighted and summed into its part's `out_parts` row (and
/// with one part written to the output), per (part, token chunk).
pub(super) fn reduce(c: &Call<'_>, tasks: &[ReduceTask], y: &[f32], out_parts: &mut [f32]) {
    let (n, hd, ys) = (c.plan.tokens, c.cfg.hidden, y_stride(c.cfg.hidden));
    let (parts, rows_total) = (c.w.parts.len(), c.sizes.rows_total);
    let dst = SharedMut::new(out_parts);
    c.run(tasks, &|t, _| {
        let ReduceTask { part: p, ref tokens } = *t;
        // SAFETY: Reduce tasks of one part own disjoint token chunks; each borrow ends before
        // the next.
        let out_row = |t: usize| unsafe { dst.slice_mut((p * n + t) * hd..(p * n + t + 1) * hd) };
        for t in tokens.clone() {
            out_row(t).fill(0.0);
        }
        for a in &c.plan.experts {
            let bias = c.w.bias(a.id).filter(|_| p == 0).map(|b| &b.down[..]);
            let y = (&y[p * rows_total * ys..], ys, a.first_row);
            add_rows(c.plan, a, tokens.clone(), y, c.weights, bias, &out_row);
        }
        if parts == 1 {
            for t in tokens.clone() {
                let sum = &*out_row(t);
                // SAFETY: this task owns these tokens' output rows.
                merge_parts(1, |_| sum, unsafe { c.out_cols(t, 0..hd) });
            }
        }
    });
}

/// Merge: the parts' `out_parts` rows summed in ascending part order into the bf16 output, per
/// token chunk (with more than one part).
pub(super) fn merge(c: &Call<'_>, tasks: &[MergeTask], out_parts: &[f32]) {
    let (n, hd, parts) = (c.plan.tokens, c.cfg.hidden, c.w.parts.len());
    let parts_out = &out_parts[..parts * n * hd];
    c.run(tasks, &|t, _| {
        let tokens = &t.tokens;
        let at = tokens.start * hd;
        let part = |p: usize| &parts_out[p * n * hd + at..];
        // SAFETY: this task owns these tokens' output rows.
        merge_parts(parts, part, unsafe { c.out_cols(tokens.start, 0..tokens.len() * hd) });
    });
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
fn merge_parts<'a>(parts: usize, part: impl Fn(usize) -> &'a [f32], out: &mut [bf16]) {
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
