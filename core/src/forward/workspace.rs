//! The forward's scratch and its arithmetic: where each expert's prepared activations and
//! results lie, and how large each buffer must be so that a forward after one of at least as
//! many tokens allocates nothing.

use alloc::vec::Vec;
use core::ops::Range;
use core::sync::atomic::AtomicUsize;

use half::bf16;

use super::LayerWeights;
use crate::aligned::{round_up, AlignedBuf, ALIGN};
use crate::backend::TaskShape;
use crate::plan::{target_tasks, y_stride, Plan, DOWN_TILE_BYTES, SUM_IN_DOWN_FROM};
use crate::workers::{Carve, WorkerScratch};
use crate::{Error, Executor, MoeConfig, Routing};

/// Scratch reused across forwards; grows to the largest call and stays. A forward writes what
/// it reads within the call, so forwards of different layers may share one (one at a time).
#[derive(Debug, Default)]
pub struct Workspace {
    pub(super) plan: Plan,
    pub(super) layout: Layout,
    pub(super) bufs: Buffers,
    /// The workers' scratch, one block each of what `Backend::scratch_bytes` asks for.
    pub(super) scratch: WorkerScratch,
}

impl Workspace {
    /// Bytes its buffers hold (the routing plan's small vectors aside): what a forward of the
    /// most tokens it has seen keeps for the next.
    pub fn bytes(&self) -> usize {
        let b = &self.bufs;
        let f32s = b.y.len() + b.out_parts.len() + self.layout.ident.len();
        b.act_x.len() + b.act_h.len() + self.scratch.bytes() + 2 * b.h.len() + 4 * f32s
    }
}

/// Where each active expert's blocks lie in [`Buffers`], per forward.
#[derive(Debug, Default)]
pub(super) struct Layout {
    /// Per active expert, where its gate and its up activations are in `act_x`.
    pub x_blocks: Vec<[Range<usize>; 2]>,
    /// Per part and active expert, where its down activations are in `act_h`.
    pub h_blocks: Vec<Range<usize>>,
    /// Per part, its first element in `h`.
    pub h_base: Vec<usize>,
    /// Per part, the rows of I it owns.
    pub part_rows: Vec<usize>,
    /// `0, 1, 2, ...`: the rows of an expert's `h`, each its own activation row.
    pub ident: Vec<u32>,
    /// Per part and active expert, its GateUp tasks not yet finished: the last one to finish
    /// prepares its down activations.
    pub gate_up_left: Vec<AtomicUsize>,
}

/// The forward's data between stages (token-major, experts' rows contiguous in plan order).
#[derive(Debug, Default)]
pub(super) struct Buffers {
    /// Per active expert, x rows prepared for gate's layout, then for up's if it differs.
    pub act_x: AlignedBuf,
    /// Per part, per expert, prepared h rows (64-byte aligned blocks).
    pub act_h: AlignedBuf,
    /// Per part, `[rows_total × I_p]`: GateUp writes column blocks.
    pub h: Vec<bf16>,
    /// Down's results, rows [`y_stride`] apart, where Reduce sums them.
    pub y: Vec<f32>,
    /// Per part, `[tokens × H]`: Down or Reduce writes.
    pub out_parts: Vec<f32>,
}

/// What [`Workspace::prepare`] derived for the stages.
#[derive(Clone, Copy, Debug)]
pub(super) struct Sizes {
    /// Rows of all active experts together.
    pub rows_total: usize,
    /// Bytes of a worker's block that the backend's kernels use (64-byte aligned).
    pub backend_scratch: usize,
    /// f32s of a Down task's results tile, where Down sums (0 where Reduce does).
    pub tile: usize,
    /// f32s a worker's block keeps for that tile, whatever the routing.
    pub tile_bound: usize,
}

impl Workspace {
    /// Plan a forward of `routing` on `w` and lay out and grow the buffers for it.
    pub(super) fn prepare(
        &mut self,
        exec: &dyn Executor,
        cfg: &MoeConfig,
        w: &LayerWeights,
        routing: &Routing<'_>,
    ) -> Result<Sizes, Error> {
        let (backend, f) = (w.backend(), w.format);
        let (n, hd) = (routing.tokens, cfg.hidden);
        let Workspace { plan, layout: l, bufs, .. } = self;
        l.part_rows.clear();
        l.part_rows.extend(w.parts.iter().map(|p| p.range.len()));
        let gran_h = backend.row_granularity(f.down);
        plan.rebuild(
            cfg,
            routing,
            &l.part_rows,
            backend.row_granularity(f.gate),
            gran_h,
            target_tasks(exec.workers()),
        )?;
        for a in &plan.experts {
            if w.parts.iter().any(|p| p.experts.get(a.id).is_none_or(Option::is_none)) {
                return Err(Error::ExpertNotLoaded { expert: a.id });
            }
        }
        let (rows_total, parts) = (plan.row_tokens.len(), w.parts.len());
        // Per active expert, its gate activations and, where up's kernels read another layout
        // for its token count, its up activations (else up reads gate's).
        let own_up = |rows: usize| backend.act_layout_for(f.up, rows) != backend.act_layout_for(f.gate, rows);
        l.x_blocks.clear();
        l.x_blocks.reserve(cfg.experts);
        let mut x_total = 0;
        let mut block = |bytes: usize| {
            let r = x_total..x_total + bytes;
            x_total += round_up(bytes);
            r
        };
        for (i, a) in plan.experts.iter().enumerate() {
            if a.act != i {
                // Its token's first expert prepared them (an earlier one).
                l.x_blocks.push(l.x_blocks[a.act].clone());
                continue;
            }
            let g = block(backend.act_bytes(f.gate, a.rows, hd));
            let u = if own_up(a.rows) { block(backend.act_bytes(f.up, a.rows, hd)) } else { g.clone() };
            l.x_blocks.push([g, u]);
        }
        let experts = &plan.experts;
        let ah_total = lay_out(
            &mut l.h_blocks,
            parts * cfg.experts,
            l.part_rows.iter().flat_map(|&ip| experts.iter().map(move |a| backend.act_bytes(f.down, a.rows, ip))),
        );
        l.h_base.clear();
        l.h_base.extend(l.part_rows.iter().scan(0, |at, &ip| Some(core::mem::replace(at, *at + rows_total * ip))));
        // Buffers are sized by bounds that depend on the token count, not on how the tokens are
        // routed, so a forward after one of at least as many tokens allocates nothing. Blocks of
        // prepared activations each start on a 64-byte boundary: the sum of an expert's blocks
        // is at most the bytes of all rows at once plus 64 per expert and layout.
        let max_rows = experts.iter().map(|a| a.rows).max().unwrap_or(0);
        let blocks = cfg.experts.min(rows_total) * 2 * ALIGN;
        // (Up apart for some token count: only where its format is not gate's.)
        let up_bytes = if f.up != f.gate { backend.act_bytes(f.up, rows_total, hd) } else { 0 };
        let x_bound = backend.act_bytes(f.gate, rows_total, hd) + up_bytes + blocks;
        let ah_bound = l.part_rows.iter().map(|&ip| backend.act_bytes(f.down, rows_total, ip) + blocks).sum::<usize>();
        // Scratch for the largest task any routing of `n` tokens makes: an expert holds at most
        // `n` rows (more only where a token names it twice), a task at most a part's rows or
        // `hidden`.
        let cols = l.part_rows.iter().fold(hd, |m, &ip| m.max(ip));
        let shape = TaskShape { format: f, tokens: max_rows.max(n), rows: cols, cols };
        // A Down task's results tile: within DOWN_TILE_BYTES, or of the fewest rows of H where
        // the largest expert's rows alone pass it (`plan::down_rows`), so bounded without the
        // routing.
        let (tile, tile_bound) = match plan.sum_in_down() {
            true => {
                let tile = max_rows * y_stride(plan.down_rows);
                (tile, (DOWN_TILE_BYTES / 4).max(max_rows.max(n) * y_stride(gran_h)).max(tile))
            }
            false => (0, 0),
        };
        bufs.act_x.ensure(x_total.max(x_bound));
        bufs.act_h.ensure(ah_total.max(ah_bound));
        grow(&mut bufs.h, rows_total * cfg.intermediate);
        // y only where Reduce sums, so below SUM_IN_DOWN_FROM: a forward after one of more
        // tokens finds it grown.
        grow(&mut bufs.y, (parts * n * routing.k * y_stride(hd)).min(SUM_IN_DOWN_FROM / 4));
        grow(&mut bufs.out_parts, parts * n * hd);
        if l.ident.len() < rows_total {
            l.ident = (0..rows_total as u32).collect();
        }
        if l.gate_up_left.len() < parts * cfg.experts {
            l.gate_up_left = (0..parts * cfg.experts).map(|_| AtomicUsize::new(0)).collect();
        }
        // (The tile after the backend's scratch starts 64-byte aligned, as Carve wants.)
        let backend_scratch = round_up(backend.scratch_bytes(shape));
        Ok(Sizes { rows_total, backend_scratch, tile, tile_bound })
    }
}

impl Sizes {
    /// Bytes of each worker's block: the backend's scratch, then the Down tile.
    pub(super) fn worker_bytes(&self) -> usize {
        self.backend_scratch + Carve::bytes::<f32>(self.tile_bound)
    }
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
