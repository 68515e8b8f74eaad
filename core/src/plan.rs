//! The task graph of one forward, planned as data.
//!
//! ```text
//!  Gather(e)          x rows of expert e -> prepared activations      (one task per expert that
//!                                                                      prepares its own: below)
//!  GateUp(p,e,rows)   h[e][t][rows] = SwiGLU(gate·x, up·x)            (per part, expert, I-row block)
//!                     and, by the task that finishes (p,e)'s blocks:
//!                     h[e] -> prepared activations for down
//!  Down(p,e,rows)     y[e][t][rows] = down·h                          (per part, expert, H-row block)
//!  Reduce(p,tokens)   out_p[t] = sum over t's rows r: w[r] · y[r]     (per part, token chunk)
//!    or, where y would pass SUM_IN_DOWN_FROM bytes:
//!  Down(p,rows)       out_p[t][rows] = sum over t's rows r: w[r] · (down_e(r)·h[r])[rows]
//!                                                                     (per part, H-row block)
//!  Merge(tokens)      out[t] = bf16(sum_p out_p[t])                   (per token chunk; p ascending;
//!                                                                      with one part, Reduce's or
//!                                                                      Down's tasks do it)
//! ```
//!
//! SwiGLU is fused into GateUp: it is elementwise on the rows the task just produced, and the
//! task that finishes an expert's rows (the last of its blocks to end, counted down in the
//! forward) prepares them for down at once, with no stage of its own to wait for. An expert
//! with one row reads the prepared activations of the first expert with that token as its one
//! row ([`ActiveExpert::act`]): one token's decode prepares its row once, not k times. For
//! many tokens the weighted sum over each token's experts is fused into Down: a Down task owns
//! some rows of H of every token's output, runs each active expert's down on them into a tile
//! of its worker's scratch and adds the tile in, so the results never round-trip through
//! memory (y was 67 MB at 1024 tokens of qwen3-30b-a3b, 1.9 GB at 8192 of DeepSeek-V3). For
//! few tokens Down keeps one expert a task, whose weights then stream in long runs (KT's
//! int8 and int4 decode 10-20% slower the other way), and Reduce sums y. Either way a
//! token's rows are added in ascending order (by expert, then slot), so both give the same
//! bits. Every output element is written by exactly one task and every sum runs in a fixed
//! order, so the result is bit-identical for any number of threads. How many blocks a stage is
//! cut into follows the thread count ([`target_tasks`]), but a block only decides which task
//! computes an element, never how.
#![forbid(unsafe_code)]

use alloc::vec::Vec;
use core::ops::Range;

use crate::{Error, MoeConfig, Routing};

/// Marks a routing slot whose expert is skipped (invalid id or GPU-resident).
pub const SKIPPED: u32 = u32::MAX;

/// Most tasks a stage aims for: [`TASKS_PER_THREAD`] for each of up to 64 threads, so that
/// they end together under skewed routing (`balance`).
pub const TARGET_TASKS: usize = 256;

/// Tasks per thread a stage aims for below [`TARGET_TASKS`]: enough to even out skewed
/// routing, few enough that each task streams long runs of rows: each task's start costs
/// time that software prefetch at its start does not win back (docs/tuning.md, "The
/// forward").
pub const TASKS_PER_THREAD: usize = 4;

/// Bytes of per-row results `y` (all parts, `n·k` rows padded as [`y_stride`] pads
/// them) from which Down sums them into the output itself: about what the caches hold (a
/// large MoE passes it from a few dozen tokens).
pub const SUM_IN_DOWN_FROM: usize = 8 << 20;

/// Bytes of results a Down task aims to hold at once (the largest expert's rows × the task's
/// rows of H, f32): what an L2 holds on the CPUs served, so the sums read them from cache.
pub const DOWN_TILE_BYTES: usize = 512 * 1024;

/// The row stride of the down projection's results (`hidden` floats a row, or a Down task's
/// rows of it): one cache line more than a row, so that a tile's results for consecutive
/// tokens fall in different L1 sets (with `hidden` a multiple of 1024 every row would start in
/// the same set, and a down tile's token stores thrash its ways: docs/tuning.md).
pub fn y_stride(hidden: usize) -> usize {
    hidden + 16
}

/// Rows of H a Down task takes: the stage's share of `hidden` among `tasks`, fewer where the
/// largest expert's `max_rows` results would pass [`DOWN_TILE_BYTES`] (each row padded as
/// [`y_stride`] pads it), a multiple of `gran` and at least one.
pub fn down_rows(hidden: usize, tasks: usize, gran: usize, max_rows: usize) -> usize {
    let gran = gran.max(1);
    let share = hidden.div_ceil(tasks.max(1)).div_ceil(gran) * gran;
    let fits = (DOWN_TILE_BYTES / 4 / max_rows.max(1)).saturating_sub(y_stride(0)) / gran * gran;
    share.min(fits).max(gran)
}

/// Tasks a stage of a forward on `threads` threads aims for.
pub fn target_tasks(threads: usize) -> usize {
    (TASKS_PER_THREAD * threads.max(1)).min(TARGET_TASKS)
}

/// An expert that at least one token is routed to on the CPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ActiveExpert {
    /// Expert id.
    pub id: usize,
    /// Its first row in the concatenated per-expert row lists.
    pub first_row: usize,
    /// Rows (token slots) routed to it.
    pub rows: usize,
    /// The active expert whose prepared gate/up activations it reads: itself, or, where its
    /// one row is a token's, the first active expert whose one row is that token's (whose
    /// Gather task prepares it).
    pub act: usize,
}

impl ActiveExpert {
    /// Its rows in the concatenated row lists.
    pub fn row_range(&self) -> Range<usize> {
        self.first_row..self.first_row + self.rows
    }
}

/// The stages, in execution order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StageKind {
    /// Gather and prepare gate/up activations (of the experts that own them:
    /// [`ActiveExpert::act`]).
    Gather,
    /// gate and up projections with SwiGLU; the task that finishes a (part, expert)'s rows
    /// prepares them for down.
    GateUp,
    /// down projection (and, with tasks of every expert, the weighted sum over each token's
    /// experts).
    Down,
    /// Weighted sum over each token's experts, per part (where Down does not add it).
    Reduce,
    /// Sum of parts, bf16 output (with more than one part; one part's Reduce or Down tasks
    /// write their own tokens' or rows' output).
    Merge,
}

impl StageKind {
    /// The stage's name, as the docs and `kt bench --stages` give it.
    pub const fn name(self) -> &'static str {
        match self {
            StageKind::Gather => "Gather",
            StageKind::GateUp => "GateUp",
            StageKind::Down => "Down",
            StageKind::Reduce => "Reduce",
            StageKind::Merge => "Merge",
        }
    }
}

/// A stage's task: which stage it belongs to, and the NUMA part whose weights or partial output
/// it touches (`None` for Gather and Merge, which serve every part). `expert` fields index
/// [`Plan::experts`].
pub trait StageTask {
    /// Its stage.
    const KIND: StageKind;
    /// Its NUMA part, if it has one.
    fn part(&self) -> Option<usize>;
}

/// See [`StageKind::Gather`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GatherTask {
    /// Active expert index.
    pub expert: usize,
}

/// See [`StageKind::GateUp`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GateUpTask {
    /// NUMA part.
    pub part: usize,
    /// Active expert index.
    pub expert: usize,
    /// Rows of gate/up (local to the part's I slice).
    pub rows: Range<usize>,
}

/// See [`StageKind::Down`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DownTask {
    /// NUMA part.
    pub part: usize,
    /// Active expert index, or `None`: every active expert, summed into the output.
    pub expert: Option<usize>,
    /// Rows of down (H).
    pub rows: Range<usize>,
}

/// See [`StageKind::Reduce`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReduceTask {
    /// NUMA part.
    pub part: usize,
    /// Tokens.
    pub tokens: Range<usize>,
}

/// See [`StageKind::Merge`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MergeTask {
    /// Tokens.
    pub tokens: Range<usize>,
}

macro_rules! stage_task {
    ($task:ty, $kind:ident, $self_:ident => $part:expr) => {
        impl StageTask for $task {
            const KIND: StageKind = StageKind::$kind;
            fn part(&$self_) -> Option<usize> {
                $part
            }
        }
    };
}
stage_task!(GatherTask, Gather, self => None);
stage_task!(GateUpTask, GateUp, self => Some(self.part));
stage_task!(DownTask, Down, self => Some(self.part));
stage_task!(ReduceTask, Reduce, self => Some(self.part));
stage_task!(MergeTask, Merge, self => None);

/// Each stage's tasks, which may run in any order and in parallel; the stages run in the order
/// of the fields.
#[derive(Clone, Debug, Default)]
pub struct Stages {
    /// See [`StageKind::Gather`].
    pub gather: Vec<GatherTask>,
    /// See [`StageKind::GateUp`].
    pub gate_up: Vec<GateUpTask>,
    /// See [`StageKind::Down`].
    pub down: Vec<DownTask>,
    /// See [`StageKind::Reduce`] (empty where Down sums).
    pub reduce: Vec<ReduceTask>,
    /// See [`StageKind::Merge`] (empty with one part).
    pub merge: Vec<MergeTask>,
}

/// The plan of one forward. [`Plan::rebuild`] reuses the vectors of the previous plan, so a
/// forward after warm-up plans without allocating.
#[derive(Clone, Debug, Default)]
pub struct Plan {
    /// Tokens.
    pub tokens: usize,
    /// Slots per token.
    pub k: usize,
    /// Active experts, ascending id.
    pub experts: Vec<ActiveExpert>,
    /// Token of each row; an expert's rows are in ascending (token, slot) order.
    pub row_tokens: Vec<u32>,
    /// Row of each slot `t·k + j`, or [`SKIPPED`].
    pub slot_rows: Vec<u32>,
    /// Slot `t·k + j` of each row.
    pub row_slots: Vec<u32>,
    /// Rows of H each Down task of every expert takes ([`down_rows`]; the last may take fewer)
    /// where Down sums each token's results into the output itself ([`SUM_IN_DOWN_FROM`]), with
    /// no Reduce stage; 0 where Down keeps one expert a task and Reduce sums.
    pub down_rows: usize,
    /// Each stage's tasks.
    pub stages: Stages,
    /// Per expert id: rows routed to it, then its index in `experts` or `usize::MAX`.
    counts: Vec<usize>,
    /// Per active expert: the next row to fill.
    fill: Vec<usize>,
    /// Per token: the first active expert whose one row it is, or `usize::MAX`.
    alone: Vec<usize>,
}

/// Empty `v`, with room for `bound` elements.
fn fresh<T>(v: &mut Vec<T>, bound: usize) {
    v.clear();
    v.reserve(bound);
}

/// Split `len` rows into about `pieces` blocks whose starts are multiples of `gran`.
pub fn blocks(len: usize, pieces: usize, gran: usize) -> impl Iterator<Item = Range<usize>> + Clone {
    let gran = gran.max(1);
    let size = len.div_ceil(pieces.max(1)).div_ceil(gran).max(1) * gran;
    (0..len).step_by(size).map(move |s| s..(s + size).min(len))
}

/// Split `len` rows into `pieces` blocks (fewer where there are fewer granules) of whole
/// granules of `gran` rows but the last, as even as they go: sizes differ by one granule at
/// most, the larger first.
pub fn even_blocks(len: usize, pieces: usize, gran: usize) -> impl Iterator<Item = Range<usize>> + Clone {
    let gran = gran.max(1);
    let granules = len.div_ceil(gran);
    let pieces = pieces.clamp(1, granules.max(1));
    let (base, extra) = (granules / pieces, granules % pieces);
    let start = move |i: usize| ((i * base + i.min(extra)) * gran).min(len);
    (0..pieces).map(start).zip((1..=pieces).map(start)).filter(|(s, e)| e > s).map(|(s, e)| s..e)
}

/// Tokens of an expert from which the plan counts its GateUp work as bound by its operations
/// rather than its weight bytes ([`expert_cost`]): two operations a weight and token take one
/// weight byte's time at 64 tokens on a machine of about 128 operations a DRAM byte, near
/// AVX-512's (about 100; AMX's, about 500, puts it at 250: compute-bound experts are cut finer
/// to cover the difference, and `balance`'s test holds the plans to both).
pub const COMPUTE_BOUND_TOKENS: usize = 64;

/// The relative time of one weight row of an expert of `tokens` tokens: its bytes', or its
/// operations' past [`COMPUTE_BOUND_TOKENS`].
pub fn expert_cost(tokens: usize) -> usize {
    tokens.max(COMPUTE_BOUND_TOKENS)
}

impl Plan {
    /// Plan a forward of `routing` on a layer whose parts own I slices of the given lengths.
    /// `gran_i`/`gran_h` are the backend's row granularity for gate/up and down; each stage
    /// aims for `tasks` tasks ([`target_tasks`]).
    pub fn build(
        cfg: &MoeConfig,
        routing: &Routing<'_>,
        part_rows: &[usize],
        gran_i: usize,
        gran_h: usize,
        tasks: usize,
    ) -> Result<Plan, Error> {
        let mut p = Plan::default();
        p.rebuild(cfg, routing, part_rows, gran_i, gran_h, tasks)?;
        Ok(p)
    }

    /// Whether Down sums each token's results into the output itself (`down_rows` > 0).
    pub fn sum_in_down(&self) -> bool {
        self.down_rows > 0
    }

    /// [`Plan::build`] into `self`, reusing its vectors.
    pub fn rebuild(
        &mut self,
        cfg: &MoeConfig,
        routing: &Routing<'_>,
        part_rows: &[usize],
        gran_i: usize,
        gran_h: usize,
        tasks: usize,
    ) -> Result<(), Error> {
        routing.validate(cfg)?;
        let (n, k, e_count) = (routing.tokens, routing.k, cfg.experts);
        let counts = &mut self.counts;
        counts.clear();
        counts.resize(e_count, 0);
        for t in 0..n {
            for j in 0..k {
                if let Some(e) = routing.expert(t, j, e_count) {
                    counts[e] += 1;
                }
            }
        }
        self.experts.clear();
        self.experts.reserve(e_count);
        self.fill.clear();
        self.fill.reserve(e_count);
        let mut first = 0;
        for (e, c) in counts.iter_mut().enumerate() {
            if *c > 0 {
                let act = self.experts.len();
                self.experts.push(ActiveExpert { id: e, first_row: first, rows: *c, act });
                self.fill.push(first);
                first += *c;
                *c = self.experts.len() - 1;
            } else {
                *c = usize::MAX;
            }
        }
        self.row_tokens.clear();
        self.row_tokens.resize(first, 0);
        self.slot_rows.clear();
        self.slot_rows.resize(n * k, SKIPPED);
        self.row_slots.clear();
        self.row_slots.resize(first, 0);
        for t in 0..n {
            for j in 0..k {
                if let Some(e) = routing.expert(t, j, e_count) {
                    let a = counts[e];
                    self.row_tokens[self.fill[a]] = t as u32;
                    self.row_slots[self.fill[a]] = (t * k + j) as u32;
                    self.slot_rows[t * k + j] = self.fill[a] as u32;
                    self.fill[a] += 1;
                }
            }
        }
        self.alone.clear();
        self.alone.resize(n, usize::MAX);
        for (i, a) in self.experts.iter_mut().enumerate() {
            if a.rows == 1 {
                let first = &mut self.alone[self.row_tokens[a.first_row] as usize];
                if *first == usize::MAX {
                    *first = i;
                }
                a.act = *first;
            }
        }
        (self.tokens, self.k) = (n, k);
        // (Bounded by n·k rows, not the routed ones: the same for every routing of n tokens.)
        let sums = part_rows.len() * n * k * y_stride(cfg.hidden) * 4 > SUM_IN_DOWN_FROM;
        let max_rows = self.experts.iter().map(|a| a.rows).max().unwrap_or(0);
        self.down_rows = if sums { down_rows(cfg.hidden, tasks, gran_h, max_rows) } else { 0 };
        self.fill_stages(n, cfg.hidden, part_rows, gran_i, gran_h, tasks);
        Ok(())
    }

    fn fill_stages(
        &mut self,
        n: usize,
        hidden: usize,
        part_rows: &[usize],
        gran_i: usize,
        gran_h: usize,
        tasks: usize,
    ) {
        let active = self.experts.len();
        let per_expert = tasks.div_ceil(active.max(1));
        // GateUp: each expert in blocks in proportion to its cost (its bytes, or its operations
        // where they pass them), a compute-bound one in half as many again (its cost the least
        // certain), then the stage largest first, so that the pool's workers, each taking the
        // next task when free, end together.
        let total: usize = self.experts.iter().map(|a| expert_cost(a.rows)).sum();
        let pieces = |a: &ActiveExpert| {
            let halves = if a.rows > COMPUTE_BOUND_TOKENS { 3 } else { 2 };
            (halves * tasks * expert_cost(a.rows)).div_ceil(2 * total.max(1))
        };
        let parts = part_rows.len();
        // Capacity for the most tasks any routing of this size makes (`blocks` yields at most
        // `pieces` blocks), so a later forward of no more tokens plans without allocating.
        let e_max = self.counts.len();
        let per_part = tasks + e_max;
        // Rows of H a Down task of every expert takes; 0: one expert a task, and Reduce.
        let d = self.down_rows;
        let slices = parts * hidden.div_ceil(gran_h.max(1));
        let Stages { gather, gate_up, down, reduce, merge } = &mut self.stages;
        fresh(gather, e_max);
        fresh(gate_up, parts * (tasks * 3 / 2 + 1 + e_max));
        fresh(down, slices.max(parts * per_part));
        fresh(reduce, parts * tasks);
        fresh(merge, tasks);
        let owners = self.experts.iter().enumerate().filter(|(i, a)| a.act == *i);
        gather.extend(owners.map(|(expert, _)| GatherTask { expert }));
        for (part, &rows_p) in part_rows.iter().enumerate() {
            for (expert, a) in self.experts.iter().enumerate() {
                let b = even_blocks(rows_p, pieces(a), gran_i);
                gate_up.extend(b.map(|rows| GateUpTask { part, expert, rows }));
                if d == 0 {
                    let b = blocks(hidden, per_expert, gran_h);
                    down.extend(b.map(|rows| DownTask { part, expert: Some(expert), rows }));
                }
            }
            if d > 0 {
                // (Also with no expert active: the tasks clear the part's output.) At least the
                // target's count of slices, evened out, each at most `d` rows.
                let slices = even_blocks(hidden, hidden.div_ceil(d).max(tasks), gran_h);
                down.extend(slices.map(|rows| DownTask { part, expert: None, rows }));
            }
        }
        let experts = &self.experts;
        let cost = |t: &GateUpTask| t.rows.len() * expert_cost(experts[t.expert].rows);
        gate_up.sort_unstable_by_key(|t| (core::cmp::Reverse(cost(t)), t.part, t.expert, t.rows.start));
        let token_chunks = blocks(n, tasks, 1);
        if d == 0 {
            for part in 0..parts {
                reduce.extend(token_chunks.clone().map(|tokens| ReduceTask { part, tokens }));
            }
        }
        if parts > 1 {
            merge.extend(token_chunks.map(|tokens| MergeTask { tokens }));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec;

    #[test]
    fn blocks_cover_exactly() {
        for (len, pieces, gran) in [(768, 8, 1), (768, 8, 16), (7, 64, 4), (1, 3, 8), (1000, 3, 32), (0, 4, 1)] {
            let b: Vec<_> = blocks(len, pieces, gran).collect();
            let mut next = 0;
            for r in &b {
                assert_eq!(r.start, next);
                assert_eq!(r.start % gran, 0);
                assert!(r.end > r.start);
                next = r.end;
            }
            assert_eq!(next, len);
        }
    }

    #[test]
    fn rows_grouped_by_expert_in_token_order() {
        let cfg = MoeConfig::new(4, 2, 8, 8);
        let ids = [3i64, 1, 1, 3, 2, 2, -1, 9];
        let w = [1.0f32; 8];
        let r = Routing { tokens: 4, k: 2, ids: &ids, weights: &w, gpu_mask: None };
        let p = Plan::build(&cfg, &r, &[8], 1, 1, TARGET_TASKS).unwrap();
        let ids: Vec<_> = p.experts.iter().map(|a| (a.id, a.rows)).collect();
        assert_eq!(ids, [(1, 2), (2, 2), (3, 2)]);
        // expert 1: tokens 0,1; expert 2: token 2 twice (duplicate); expert 3: tokens 0,1.
        assert_eq!(p.row_tokens, [0, 1, 2, 2, 0, 1]);
        assert_eq!(p.slot_rows, [4, 0, 1, 5, 2, 3, SKIPPED, SKIPPED]);
    }

    /// An expert with one row reads the prepared activations of the first expert with the same
    /// token as its one row, and only experts reading their own have a Gather task; an expert
    /// of two rows (two tokens, or one token naming it twice) prepares its own.
    #[test]
    fn experts_of_one_token_share_its_prepared_activations() {
        let cfg = MoeConfig::new(8, 2, 8, 8);
        // token 0: experts 0, 4; token 1: 1, 4; token 2: 3, 2; token 3: 5 twice.
        let ids = [0i64, 4, 1, 4, 3, 2, 5, 5];
        let w = [1.0f32; 8];
        let r = Routing { tokens: 4, k: 2, ids: &ids, weights: &w, gpu_mask: None };
        let p = Plan::build(&cfg, &r, &[8], 1, 1, TARGET_TASKS).unwrap();
        let acts: Vec<_> = p.experts.iter().map(|a| (a.id, a.act)).collect();
        // Active indices: 0→0, 1→1, 2→2, 3→3, 4→4, 5→5; expert 3 shares expert 2's (token 2).
        assert_eq!(acts, [(0, 0), (1, 1), (2, 2), (3, 2), (4, 4), (5, 5)]);
        let gathered = [0, 1, 2, 4, 5].map(|expert| GatherTask { expert });
        assert_eq!(p.stages.gather, gathered);
        // One token: every expert reads the first one's.
        let ids1 = [6i64, 1, 7];
        let one = Routing { tokens: 1, k: 3, ids: &ids1, weights: &w[..3], gpu_mask: None };
        let p = Plan::build(&MoeConfig::new(8, 3, 8, 8), &one, &[8], 1, 1, TARGET_TASKS).unwrap();
        assert_eq!(p.experts.iter().map(|a| (a.id, a.act)).collect::<Vec<_>>(), [(1, 0), (6, 0), (7, 0)]);
        assert_eq!(p.stages.gather, [GatherTask { expert: 0 }]);
    }

    /// One part's Reduce (or Down) tasks write the output themselves: no Merge stage.
    #[test]
    fn merge_only_with_parts() {
        let ids: Vec<i64> = (0..12).map(|i| i % 7).collect();
        let w = vec![0.5f32; 12];
        let r = Routing { tokens: 3, k: 4, ids: &ids, weights: &w, gpu_mask: None };
        for parts in [1, 2] {
            let cfg = MoeConfig { parts, ..MoeConfig::new(8, 4, 16, 16) };
            let p = Plan::build(&cfg, &r, &vec![16 / parts; parts], 1, 1, target_tasks(2)).unwrap();
            assert_eq!(p.stages.merge.is_empty(), parts == 1, "{parts} parts");
        }
    }

    #[test]
    fn every_target_covers_every_row_once() {
        let cfg = MoeConfig { parts: 2, ..MoeConfig::new(16, 4, 64, 96) };
        let ids: Vec<i64> = (0..40).map(|i| (i * 7 % 16) as i64).collect();
        let w = vec![0.5f32; 40];
        let r = Routing { tokens: 10, k: 4, ids: &ids, weights: &w, gpu_mask: None };
        for threads in [1, 2, 3, 64] {
            let p = Plan::build(&cfg, &r, &[48, 48], 8, 8, target_tasks(threads)).unwrap();
            covers_every_row(&p);
        }
    }

    /// Down tasks take the stage's share of H, fewer rows where the largest expert's results
    /// would pass DOWN_TILE_BYTES, never fewer than the granularity. They cover H once a part
    /// (summing in Down, past SUM_IN_DOWN_FROM), or once a part and expert (then Reduce sums).
    #[test]
    fn down_tasks_cover_h_once() {
        assert_eq!(down_rows(2048, 8, 32, 64), 256);
        assert_eq!(down_rows(7168, 8, 32, 500), 224); // 500 · (224 + 16) · 4 ≤ 512 KB
        assert_eq!(down_rows(2048, 8, 32, 4096), 32);
        assert_eq!(down_rows(100, 64, 1, 1), 2);
        for (hidden, tokens, sums) in [(96, 10, false), (4096, 300, true)] {
            let cfg = MoeConfig { parts: 2, ..MoeConfig::new(16, 4, hidden, 64) };
            let ids: Vec<i64> = (0..4 * tokens).map(|i| if i % 5 == 0 { -1 } else { (i * 7 % 16) as i64 }).collect();
            let w = vec![0.5f32; 4 * tokens];
            let r = Routing { tokens, k: 4, ids: &ids, weights: &w, gpu_mask: None };
            for threads in [1, 3, 64] {
                let p = Plan::build(&cfg, &r, &[32, 32], 8, 8, target_tasks(threads)).unwrap();
                assert_eq!((p.sum_in_down(), p.stages.reduce.is_empty()), (sums, sums));
                let owners = if sums { vec![None] } else { (0..p.experts.len()).map(Some).collect() };
                for (part, owner) in (0..2).flat_map(|part| owners.iter().map(move |&o| (part, o))) {
                    let mut covered = vec![0; hidden];
                    for DownTask { part: tp, expert, rows } in &p.stages.down {
                        if (*tp, *expert) == (part, owner) {
                            rows.clone().for_each(|r| covered[r] += 1);
                        }
                    }
                    assert!(covered.iter().all(|&c| c == 1), "{threads} threads, part {part}, {owner:?}");
                }
                // Every row's slot, and back.
                for (row, &slot) in p.row_slots.iter().enumerate() {
                    assert_eq!(p.slot_rows[slot as usize], row as u32);
                }
            }
        }
    }

    fn covers_every_row(p: &Plan) {
        for part in 0..2 {
            for (ei, _) in p.experts.iter().enumerate() {
                let mut covered = [0; 48];
                for GateUpTask { part: tp, expert, rows } in &p.stages.gate_up {
                    if *tp == part && *expert == ei {
                        rows.clone().for_each(|r| covered[r] += 1);
                    }
                }
                assert!(covered.iter().all(|&c| c == 1));
            }
        }
    }
}
