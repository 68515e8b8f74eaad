//! Runs a [`Plan`] on a layer's backend and an executor: the one forward pass every caller uses.
//! Every buffer lives in the [`Workspace`] and only grows, so a forward after warm-up (a call
//! with at least as many tokens) performs no heap allocation.
//!
//! - `weights`: the layer's packed experts ([`LayerWeights`]); `packing`: quantizing and
//!   packing one expert into them;
//! - `workspace`: the buffers and their sizes ([`Workspace`]);
//! - `stages`: one function per stage, each given its own stage's typed tasks.
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

mod packing;
mod stages;
mod weights;
mod workspace;

use half::bf16;

pub use self::packing::{dequantized_expert_f32, pack_expert, pack_expert_f32, pack_part, pack_part_f32, ExpertF32};
pub use self::weights::{ExpertWeights, LayerWeights, PartWeights};
pub use self::workspace::Workspace;
use crate::mat::SharedMut;
pub use crate::plan::y_stride;
#[cfg(doc)]
use crate::plan::Plan;
use crate::{Error, Executor, MoeConfig, Routing};

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
    let (n, hd) = (routing.tokens, cfg.hidden);
    if input.len() != n * hd {
        return Err(Error::ShapeMismatch { what: "hidden_states", expected: n * hd, found: input.len() });
    }
    if out.len() != n * hd {
        return Err(Error::ShapeMismatch { what: "output", expected: n * hd, found: out.len() });
    }
    let sizes = ws.prepare(exec, cfg, w, routing)?;
    let Workspace { plan, layout, bufs, scratch } = ws;
    let c = stages::Call {
        exec,
        cfg,
        w,
        input,
        weights: routing.weights,
        plan,
        layout,
        sizes,
        blocks: scratch.blocks(exec, sizes.worker_bytes()),
        out: SharedMut::new(out),
    };
    let s = &plan.stages;
    stages::gather(&c, &s.gather, bufs.act_x.as_mut_slice());
    stages::gate_up(&c, &s.gate_up, bufs.act_x.as_slice(), &mut bufs.h, bufs.act_h.as_mut_slice());
    stages::down(&c, &s.down, bufs.act_h.as_slice(), &mut bufs.y, &mut bufs.out_parts);
    stages::reduce(&c, &s.reduce, &bufs.y, &mut bufs.out_parts);
    stages::merge(&c, &s.merge, &bufs.out_parts);
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
