//! How the pool's threads claim a stage's tasks: the shared atomic counter the pool uses, or
//! crossbeam-deque (a global injector, batches stolen into per-thread deques). Both run on the
//! same persistent pool and the same MoE forward with Zipf-skewed routing (a few hot experts
//! get most tokens, as real routers do), so only the claiming differs.
//! `cargo bench -p kt-host --bench claim`

use std::sync::Arc;

use crossbeam_deque::{Injector, Steal, Worker};
use kt_core::rng::SplitMix64;
use kt_core::testing::random_input;
use kt_core::{Executor, MoeConfig, WeightFormat};
use kt_host::pool::Pool;
use kt_host::{LayerOptions, MoeLayer};

const THREADS: usize = 2;

/// The pool, claiming through crossbeam-deque instead of its counter.
struct DequeClaim(Pool);

impl Executor for DequeClaim {
    fn parallel_for(&self, n_tasks: usize, f: &(dyn Fn(usize, usize) + Sync)) {
        let injector = Injector::new();
        (0..n_tasks).for_each(|t| injector.push(t));
        // One claiming loop per thread; each drains the injector in batches.
        self.0.parallel_for(self.0.threads(), &|_, w| {
            let local = Worker::new_fifo();
            loop {
                let t = local.pop().or_else(|| loop {
                    match injector.steal_batch_and_pop(&local) {
                        Steal::Success(t) => break Some(t),
                        Steal::Empty => break None,
                        Steal::Retry => {}
                    }
                });
                match t {
                    Some(t) => f(t, w),
                    None => return,
                }
            }
        });
    }

    fn workers(&self) -> usize {
        self.0.threads()
    }
}

/// `n` tokens × `k` distinct experts drawn with P(e) ∝ 1/(e+1).
fn zipf_routing(n: usize, k: usize, experts: usize, seed: u64) -> (Vec<i64>, Vec<f32>) {
    let mut r = SplitMix64::new(seed);
    let cdf: Vec<f32> = (0..experts)
        .scan(0.0f32, |s, e| {
            *s += 1.0 / (e as f32 + 1.0);
            Some(*s)
        })
        .collect();
    let total = cdf[experts - 1];
    let mut ids = Vec::new();
    for _ in 0..n {
        let mut row: Vec<i64> = Vec::new();
        while row.len() < k {
            let u = r.next_f32() * total;
            let e = cdf.partition_point(|&c| c < u).min(experts - 1) as i64;
            if !row.contains(&e) {
                row.push(e);
            }
        }
        ids.extend(row);
    }
    (ids, vec![1.0 / k as f32; n * k])
}

fn layer(exec: Arc<dyn Executor>, format: WeightFormat) -> MoeLayer {
    let cfg = MoeConfig { max_tokens: 256, ..MoeConfig::new(64, 8, 1024, 512) };
    let opts = LayerOptions::executor(exec);
    let mut r = SplitMix64::new(7);
    let mut gen = |len: usize| (0..len).map(|_| r.next_f32() - 0.5).collect::<Vec<f32>>();
    let (h, i) = (cfg.hidden, cfg.intermediate);
    let one = [gen(i * h), gen(i * h), gen(h * i)];
    MoeLayer::from_f32(&cfg, format, |_| Some(one.clone()), &opts).unwrap()
}

fn run(bencher: divan::Bencher, exec: Arc<dyn Executor>, format: WeightFormat, n: usize) {
    let l = layer(exec, format);
    let input = random_input(n, l.config().hidden, 3);
    let (ids, w) = zipf_routing(n, l.config().top_k, l.config().experts, 5);
    let mut out = vec![kt_core::bf16::ZERO; input.len()];
    bencher.bench_local(|| l.forward_into(&input, &ids, &w, None, &mut out).unwrap());
}

#[divan::bench(args = [1, 16, 128])]
fn counter_int4(bencher: divan::Bencher, n: usize) {
    run(bencher, Arc::new(Pool::new(THREADS)), WeightFormat::Int4Row, n);
}

#[divan::bench(args = [1, 16, 128])]
fn deque_int4(bencher: divan::Bencher, n: usize) {
    run(bencher, Arc::new(DequeClaim(Pool::new(THREADS))), WeightFormat::Int4Row, n);
}

#[divan::bench(args = [1, 16, 128])]
fn counter_bf16(bencher: divan::Bencher, n: usize) {
    run(bencher, Arc::new(Pool::new(THREADS)), WeightFormat::Bf16, n);
}

#[divan::bench(args = [1, 16, 128])]
fn deque_bf16(bencher: divan::Bencher, n: usize) {
    run(bencher, Arc::new(DequeClaim(Pool::new(THREADS))), WeightFormat::Bf16, n);
}

fn main() {
    divan::main();
}
