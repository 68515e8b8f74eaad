//! How evenly a plan's GateUp and Down stages spread over a pool's workers, from the plan
//! alone (no timing): each task's weight bytes and operations, the tasks handed out as the pool
//! hands them (the next in stage order to the worker free first), each taking the time a
//! roofline of `ops_per_byte` gives it, `max(bytes, ops / ops_per_byte)`. Bytes are weight
//! elements (one byte each, as int8): the formats scale every task's alike.
#![forbid(unsafe_code)]

use alloc::vec;

use crate::plan::{DownTask, GateUpTask, Plan, StageKind};
use crate::MoeConfig;

/// A stage's spread over the workers: its busiest worker (the last to finish) against their
/// mean.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Spread {
    /// The stage.
    pub stage: StageKind,
    /// Its tasks.
    pub tasks: usize,
    /// The busiest worker's time over the mean time a worker would take with the stage's
    /// work shared evenly.
    pub time: f64,
    /// Its weight bytes over the mean.
    pub bytes: f64,
    /// Its operations over the mean.
    pub ops: f64,
}

/// One task's weight bytes and operations.
#[derive(Clone, Copy, Debug, Default)]
struct Load {
    bytes: f64,
    ops: f64,
}

/// The spreads of `plan`'s GateUp and Down stages (planned for `cfg` with parts of `part_rows`
/// rows of I) over `workers` workers, on a machine whose peak does `ops_per_byte` operations in
/// the time DRAM gives one byte.
pub fn spreads(plan: &Plan, cfg: &MoeConfig, part_rows: &[usize], workers: usize, ops_per_byte: f64) -> [Spread; 2] {
    let tokens = |e: usize| plan.experts[e].rows as f64;
    let h = cfg.hidden as f64;
    let gate_up = plan.stages.gate_up.iter().map(|t: &GateUpTask| {
        let bytes = 2.0 * t.rows.len() as f64 * h;
        Load { bytes, ops: 2.0 * bytes * tokens(t.expert) }
    });
    let all_tokens: f64 = (0..plan.experts.len()).map(tokens).sum();
    let down = plan.stages.down.iter().map(|t: &DownTask| {
        let per_expert = t.rows.len() as f64 * part_rows[t.part] as f64;
        match t.expert {
            Some(e) => Load { bytes: per_expert, ops: 2.0 * per_expert * tokens(e) },
            None => Load { bytes: per_expert * plan.experts.len() as f64, ops: 2.0 * per_expert * all_tokens },
        }
    });
    [spread(StageKind::GateUp, gate_up, workers, ops_per_byte), spread(StageKind::Down, down, workers, ops_per_byte)]
}

/// The spread of `tasks` handed out in order, each to the worker free first (the lowest index
/// among ties), as the pool's shared counter hands them.
fn spread(stage: StageKind, tasks: impl Iterator<Item = Load>, workers: usize, ops_per_byte: f64) -> Spread {
    let workers = workers.max(1);
    let (mut free, mut held) = (vec![0.0f64; workers], vec![Load::default(); workers]);
    let (mut total, mut count) = (Load::default(), 0);
    for t in tasks {
        let w = (0..workers).min_by(|&a, &b| free[a].total_cmp(&free[b])).unwrap_or(0);
        free[w] += t.bytes.max(t.ops / ops_per_byte);
        held[w].bytes += t.bytes;
        held[w].ops += t.ops;
        total.bytes += t.bytes;
        total.ops += t.ops;
        count += 1;
    }
    let busiest = (0..workers).max_by(|&a, &b| free[a].total_cmp(&free[b])).unwrap_or(0);
    let share = |mine: f64, all: f64| if all > 0.0 { mine * workers as f64 / all } else { 1.0 };
    let time: f64 = free.iter().sum();
    Spread {
        stage,
        tasks: count,
        time: share(free[busiest], time),
        bytes: share(held[busiest].bytes, total.bytes),
        ops: share(held[busiest].ops, total.ops),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::target_tasks;
    use crate::rng::{random_routing, SplitMix64};
    use crate::Routing;
    use alloc::vec::Vec;

    /// Ids of `tokens` tokens each naming `k` distinct experts of `experts`, the expert of
    /// popularity rank `r` drawn with weight `1/√(r+1)`: the hottest of 128 about 6× the mean.
    fn skewed_routing(tokens: usize, k: usize, experts: usize, seed: u64) -> Vec<i64> {
        let mut r = SplitMix64::new(seed);
        let mut rank: Vec<usize> = (0..experts).collect();
        for i in (1..experts).rev() {
            rank.swap(i, r.below(i + 1));
        }
        let cum: Vec<f64> = rank
            .iter()
            .scan(0.0, |s, &rk| {
                *s += 1.0 / ((rk + 1) as f64).sqrt();
                Some(*s)
            })
            .collect();
        let mut ids = Vec::with_capacity(tokens * k);
        for _ in 0..tokens {
            let start = ids.len();
            while ids.len() < start + k {
                let x = r.next_f32() as f64 * cum[experts - 1];
                let e = cum.partition_point(|&c| c < x).min(experts - 1) as i64;
                if !ids[start..].contains(&e) {
                    ids.push(e);
                }
            }
        }
        ids
    }

    /// GateUp and Down at 16 and 64 workers, 1024 and 8192 tokens of qwen3-30b-a3b's and
    /// DeepSeek-V3's shapes (k = 8), routed at random and skewed, on panels of 32 rows: the
    /// busiest worker takes at most 1.1× the mean time, on a machine of AMX's ratio of peak to
    /// DRAM and of AVX-512's; or, where H's panels cannot be shared that evenly (7168 rows are
    /// 224 panels: 64 workers take 3 or 4, 4 / 3.5 = 1.14× the mean), at most that bound.
    #[test]
    fn stages_spread_within_a_tenth_of_the_mean() {
        let (mut worst, mut worst_seen) = (Vec::new(), (0.0, alloc::string::String::new()));
        for (experts, hidden, inter) in [(128, 2048, 768), (256, 7168, 2048)] {
            let cfg = MoeConfig { max_tokens: 8192, ..MoeConfig::new(experts, 8, hidden, inter) };
            for tokens in [1024, 8192] {
                for skewed in [false, true] {
                    let (mut ids, w) = random_routing(tokens, 8, experts, 3);
                    if skewed {
                        ids = skewed_routing(tokens, 8, experts, 4);
                    }
                    let routing = Routing { tokens, k: 8, ids: &ids, weights: &w, gpu_mask: None };
                    for workers in [16, 64] {
                        let plan = Plan::build(&cfg, &routing, &[inter], 32, 32, target_tasks(workers)).unwrap();
                        let panels = hidden.div_ceil(32) as f64 / workers as f64;
                        for ops_per_byte in [100.0, 500.0] {
                            for s in spreads(&plan, &cfg, &[inter], workers, ops_per_byte) {
                                let floor = if s.stage == StageKind::Down { panels.ceil() / panels } else { 1.0 };
                                let at = alloc::format!(
                                    "E {experts} H {hidden} n {tokens} skewed {skewed} workers {workers} \
                                     ops/byte {ops_per_byte}: {s:?}"
                                );
                                if s.time / floor.max(1.0) > worst_seen.0 {
                                    worst_seen = (s.time / floor.max(1.0), at.clone());
                                }
                                if s.time > 1.1f64.max(floor) + 1e-9 {
                                    worst.push(at);
                                }
                            }
                        }
                    }
                }
            }
        }
        std::eprintln!("the widest spread over its floor: {:.3} ({})", worst_seen.0, worst_seen.1);
        assert!(worst.is_empty(), "{} spreads past 1.1× the mean:\n{}", worst.len(), worst.join("\n"));
    }
}
