//! The SFT half of the conformance suite: a textbook forward and backward in f64 on the same
//! (dequantized) weights, and the checks every backend's SFT passes are held to.

use alloc::format;
use alloc::string::String;
use alloc::vec;
use alloc::vec::Vec;

use half::bf16;

use super::lora::Proj;
use super::{
    backward, forward, lora_of, random_lora, Backward, BackwardWeights, BaseGrads, Cache, Lora, LoraGrads,
    TransposeFormat, Workspace,
};
use crate::rng::SplitMix64;
use crate::swiglu::Glu;
use crate::testing::{
    build_layer, dequantized, mean_rel_err, random_experts, random_input, scenario_routing, Expert, Scenario,
};
use crate::{Backend, Executor, MoeConfig, Routing, WeightFormat};

/// What the textbook computes: the output `[n, H]`, then for an upstream gradient the input's
/// `[n, H]`, the routing weights' `[n, k]` and the six LoRA gradients.
pub struct Textbook {
    /// Output.
    pub out: Vec<f64>,
    /// Input gradient.
    pub grad_input: Vec<f64>,
    /// Routing weights' gradient.
    pub grad_weights: Vec<f64>,
    /// Each slot's `‖grad_output_t‖·‖y_tj‖ / √H`: the size of a dot product of two random
    /// vectors of those norms, against which its error is judged (one such dot can cancel to
    /// near zero, and a relative error of it then says nothing).
    pub dot_scale: Vec<f64>,
    /// LoRA gradients, [`Lora`]'s order.
    pub grad_lora: [Vec<f64>; 6],
    /// Base weights' gradients: gate, up `[E, I, H]`, down `[E, H, I]`.
    pub grad_base: [Vec<f64>; 3],
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + libm::exp(-x))
}

/// The layer's gated activation in f64 and its partial derivatives `(h, ∂h/∂g, ∂h/∂u)`: plain
/// SwiGLU `silu(g)·u`; with a limit the gate clamped to at most it and up to `±limit`; with
/// alpha both clamped to `±limit` (if any) and `g·σ(alpha·g)·(u + 1)`. A clamp that holds
/// passes no gradient.
pub(crate) fn gated(glu: Glu, g: f64, u: f64) -> (f64, f64, f64) {
    let (l, a) = (f64::from(glu.limit()), f64::from(glu.alpha()));
    let lo = if a > 0.0 { -l } else { f64::NEG_INFINITY };
    let (gc, uc) = if l > 0.0 { (g.clamp(lo, l), u.clamp(-l, l)) } else { (g, u) };
    let pg = if l > 0.0 && !(lo..=l).contains(&g) { 0.0 } else { 1.0 };
    let pu = if l > 0.0 && !(-l..=l).contains(&u) { 0.0 } else { 1.0 };
    if a > 0.0 {
        let s = sigmoid(a * gc);
        (gc * s * (uc + 1.0), pg * (uc + 1.0) * s * (1.0 + a * gc * (1.0 - s)), pu * gc * s)
    } else {
        let s = sigmoid(gc);
        (gc * s * uc, pg * uc * s * (1.0 + gc * (1.0 - s)), pu * gc * s)
    }
}

/// `y = W·x + s·B·(A·x)` for one expert's `W [out, in]`, `A [r, in]`, `B [out, r]`; returns
/// `(y, A·x)`.
fn proj(w: &[f32], a: &[bf16], b: &[bf16], s: f64, x: &[f64], r: usize) -> (Vec<f64>, Vec<f64>) {
    let din = x.len();
    let dout = w.len() / din;
    let ax: Vec<f64> = (0..r).map(|q| (0..din).map(|i| f64::from(a[q * din + i].to_f32()) * x[i]).sum()).collect();
    let y = (0..dout)
        .map(|o| {
            let base: f64 = (0..din).map(|i| f64::from(w[o * din + i]) * x[i]).sum();
            base + s * (0..r).map(|q| f64::from(b[o * r + q].to_f32()) * ax[q]).sum::<f64>()
        })
        .collect();
    (y, ax)
}

/// Projection backward: `gin = Wᵀ·gout + s·Aᵀ·(Bᵀ·gout)`, and `grad A += s·(Bᵀ·gout)·xᵀ`,
/// `grad B += s·gout·axᵀ`, `grad W += gout·xᵀ` into the expert's slices of the gradients.
fn proj_back(
    (w, a, b): (&[f32], &[bf16], &[bf16]),
    s: f64,
    (x, ax, gout): (&[f64], &[f64], &[f64]),
    r: usize,
    (ga, gb, gw): (&mut [f64], &mut [f64], &mut [f64]),
) -> Vec<f64> {
    let (din, dout) = (x.len(), gout.len());
    for (gw, &go) in gw.chunks_exact_mut(din).zip(gout) {
        for (gw, &x) in gw.iter_mut().zip(x) {
            *gw += go * x;
        }
    }
    let bg: Vec<f64> = (0..r).map(|q| (0..dout).map(|o| f64::from(b[o * r + q].to_f32()) * gout[o]).sum()).collect();
    for o in 0..dout {
        for q in 0..r {
            gb[o * r + q] += s * gout[o] * ax[q];
        }
    }
    for q in 0..r {
        for i in 0..din {
            ga[q * din + i] += s * bg[q] * x[i];
        }
    }
    (0..din)
        .map(|i| {
            let base: f64 = (0..dout).map(|o| f64::from(w[o * din + i]) * gout[o]).sum();
            base + s * (0..r).map(|q| f64::from(a[q * din + i].to_f32()) * bg[q]).sum::<f64>()
        })
        .collect()
}

/// The textbook forward and backward of an SFT layer with experts `w` (f32, as the kernels
/// see them), LoRA `l`, input `x`, routing `rt` and upstream gradient `go` (`[n, H]`); the
/// backward's products multiply by `wb` (`w` itself, or what quantized transposes hold).
#[allow(clippy::too_many_arguments)]
pub fn textbook(
    cfg: &MoeConfig,
    w: &[Expert],
    wb: &[Expert],
    l: &Lora<'_>,
    x: &[bf16],
    rt: &Routing<'_>,
    go: &[f64],
) -> Textbook {
    let (h, i, k, r, s) = (cfg.hidden, cfg.intermediate, rt.k, l.rank, f64::from(l.scaling()));
    let mut t = Textbook {
        out: vec![0.0; rt.tokens * h],
        grad_input: vec![0.0; rt.tokens * h],
        grad_weights: vec![0.0; rt.tokens * k],
        dot_scale: vec![0.0; rt.tokens * k],
        grad_lora: [l.gate_a, l.gate_b, l.up_a, l.up_b, l.down_a, l.down_b].map(|m| vec![0.0; m.len()]),
        grad_base: [(); 3].map(|_| vec![0.0; cfg.experts * h * i]),
    };
    for tok in 0..rt.tokens {
        let xt: Vec<f64> = x[tok * h..][..h].iter().map(|v| f64::from(v.to_f32())).collect();
        let got = &go[tok * h..][..h];
        for j in 0..k {
            let Some(e) = rt.expert(tok, j, cfg.experts) else { continue };
            let wt = f64::from(rt.weights[tok * k + j]);
            let [wg, wu, wd] = &w[e];
            let [bwg, bwu, bwd] = &wb[e];
            let of = |p| l.of(p, e, cfg);
            let ((ag, bg), (au, bu), (ad, bd)) = (of(Proj::Gate), of(Proj::Up), of(Proj::Down));
            let (g, axg) = proj(wg, ag, bg, s, &xt, r);
            let (u, axu) = proj(wu, au, bu, s, &xt, r);
            // A clamped variant at g and u rounded to bf16, as the layer rounds them before its
            // activation: where a clamp holds is decided there, and a value within a rounding of
            // the limit would otherwise flip its gradient on or off.
            let at = |v: f64| if cfg.glu.is_silu() { v } else { f64::from(bf16::from_f64(v).to_f32()) };
            let act: Vec<(f64, f64, f64)> = g.iter().zip(&u).map(|(&g, &u)| gated(cfg.glu, at(g), at(u))).collect();
            let hh: Vec<f64> = act.iter().map(|a| a.0).collect();
            let (y, ah) = proj(wd, ad, bd, s, &hh, r);
            for (o, y) in t.out[tok * h..][..h].iter_mut().zip(&y) {
                *o += wt * y;
            }
            t.grad_weights[tok * k + j] = got.iter().zip(&y).map(|(a, b)| a * b).sum();
            let norm = |v: &[f64]| libm::sqrt(v.iter().map(|x| x * x).sum::<f64>());
            t.dot_scale[tok * k + j] = norm(got) * norm(&y) / libm::sqrt(h as f64);
            let gy: Vec<f64> = got.iter().map(|g| wt * g).collect();
            let [ga_g, gb_g, ga_u, gb_u, ga_d, gb_d] = &mut t.grad_lora;
            let [gw_g, gw_u, gw_d] = &mut t.grad_base;
            let at = |len: usize| e * len..(e + 1) * len;
            let (a_d, b_d, w_e) = (at(r * i), at(h * r), at(h * i));
            let gd = (&mut ga_d[a_d], &mut gb_d[b_d], &mut gw_d[w_e.clone()]);
            let dh = proj_back((bwd, ad, bd), s, (&hh, &ah, &gy), r, gd);
            let dg: Vec<f64> = (0..i).map(|o| dh[o] * act[o].1).collect();
            let du: Vec<f64> = (0..i).map(|o| dh[o] * act[o].2).collect();
            let (a_g, b_g, a_u, b_u) = (at(r * h), at(i * r), at(r * h), at(i * r));
            let gg = (&mut ga_g[a_g], &mut gb_g[b_g], &mut gw_g[w_e.clone()]);
            let dxg = proj_back((bwg, ag, bg), s, (&xt, &axg, &dg), r, gg);
            let dxu =
                proj_back((bwu, au, bu), s, (&xt, &axu, &du), r, (&mut ga_u[a_u], &mut gb_u[b_u], &mut gw_u[w_e]));
            for ((gi, a), b) in t.grad_input[tok * h..][..h].iter_mut().zip(&dxg).zip(&dxu) {
                *gi += a + b;
            }
        }
    }
    t
}

/// `kind` transposes of `experts` for a layer of `cfg` in `format`, and what they hold (each
/// expert's matrices as the backward multiplies by them, in the forward's shapes).
fn transposes(
    backend: &'static dyn Backend,
    cfg: &MoeConfig,
    format: WeightFormat,
    kind: TransposeFormat,
    experts: &[Expert],
) -> Result<(BackwardWeights, Vec<Expert>), crate::Error> {
    let (h, i) = (cfg.hidden, cfg.intermediate);
    let (f, ranges) = BackwardWeights::layout(backend, cfg, format.into(), kind)?;
    let mut back = BackwardWeights::new(cfg.experts, ranges.clone());
    let mut held = Vec::new();
    for (e, [g, u, d]) in experts.iter().enumerate() {
        back.set(e, Some(BackwardWeights::pack(backend, cfg, (f, &ranges), [g, u, d])?))?;
        let (mut wg, mut wu, mut wd) = (vec![0.0f32; i * h], vec![0.0f32; i * h], vec![0.0f32; h * i]);
        for (r, [tg, tu, td]) in ranges.iter().zip(BackwardWeights::quantize(cfg, (f, &ranges), [g, u, d])?) {
            let (tg, tu, td) = (tg.dequantize(), tu.dequantize(), td.dequantize());
            let ip = r.len();
            for (row, c) in (0..h).flat_map(|row| (0..ip).map(move |c| (row, c))) {
                wg[(r.start + c) * h + row] = tg[row * ip + c];
                wu[(r.start + c) * h + row] = tu[row * ip + c];
                wd[row * i + r.start + c] = td[c * h + row];
            }
        }
        held.push([wg, wu, wd]);
    }
    Ok((back, held))
}

/// Formats and tolerances the SFT suite runs: the float formats to 1e-2 (forward) and 2e-2
/// (gradients), those with int8 activations to 3e-2 both (their activation quantization).
fn cases() -> [(WeightFormat, f64, f64); 4] {
    [
        (WeightFormat::Bf16, 1e-2, 2e-2),
        (WeightFormat::Fp8Block, 1e-2, 2e-2),
        (WeightFormat::Int8Row, 3e-2, 3e-2),
        (WeightFormat::Int4Group { group: 32 }, 3e-2, 3e-2),
    ]
}

/// The failing SFT cases of `backend` on `exec`, each as a line (empty when it conforms): for
/// each format it serves, in layers of one and two NUMA parts with transposes in bf16 and in the
/// layer's format, with B zero the output is the inference forward's bit for bit; with
/// random LoRA the output and every gradient are within the tolerance of the textbook on the
/// dequantized weights (the base weights' too), over token counts 1-9 and the routing
/// scenarios (skipped ids, masked experts, duplicates); a backward with no LoRA or base
/// gradients asked for gives the same input and weight gradients.
pub fn sft_failures(backend: &'static dyn Backend, exec: &dyn Executor) -> Vec<String> {
    let mut failures = Vec::new();
    let (r, alpha) = (4, 8.0);
    for (format, tol_out, tol_grad) in cases() {
        let cfg = MoeConfig { max_tokens: 16, ..MoeConfig::new(4, 2, 256, 128) };
        if cfg.validate_for(format).is_err() || !backend.serves(format, 128, 256) || !backend.serves(format, 256, 128) {
            continue;
        }
        let name = |what: &str| format!("{} {format} {what}", backend.name());
        let experts = random_experts(&cfg, 31);
        // One NUMA part and two (whose forward sums the parts as the inference forward does),
        // each with what its kernels multiply by; transposes in bf16 (of that) and in the
        // layer's format (KT's: of the original weights, per part).
        let layers = [1, 2].map(|parts| {
            let cfg = MoeConfig { parts, ..cfg };
            cfg.validate_for(format).ok()?;
            let deq = dequantized(&cfg, format, &experts);
            let back = [TransposeFormat::Bf16, TransposeFormat::Layer].map(|kind| {
                let source = if kind == TransposeFormat::Bf16 { &deq } else { &experts };
                match transposes(backend, &cfg, format, kind, source) {
                    Ok(t) => Some(t),
                    Err(e) => {
                        failures.push(name(&format!("{kind:?} transposes: {e}")));
                        None
                    }
                }
            });
            Some((build_layer(backend, &cfg, format, &experts), cfg, deq, back))
        });
        let zero = random_lora(&cfg, r, true, 5);
        let mats = random_lora(&cfg, r, false, 6);
        let scenarios = [Scenario::Random, Scenario::Skewed, Scenario::InvalidIds, Scenario::Masked];
        // Plain SwiGLU and KT's clamped variants (a limit that holds for a good share of the
        // values here: g and u are about unit Gaussians).
        let glus = [Glu::SILU, Glu::new(1.0, 0.0).expect("valid"), Glu::new(1.0, 1.702).expect("valid")];
        let table =
            [(1, 0, 1, 0, 0), (2, 1, 2, 1, 1), (5, 2, 1, 1, 2), (7, 3, 2, 0, 0), (9, 0, 2, 1, 0), (6, 1, 1, 0, 1)];
        for (tokens, s, parts, kind, glu) in table {
            let s = scenarios[s];
            let Some((layer, cfg, deq, back)) = &layers[parts - 1] else { continue };
            let Some((back, wb)) = &back[kind] else { continue };
            let kind = [TransposeFormat::Bf16, TransposeFormat::Layer][kind];
            // The clamped variants with float activations only: int8 activations move g and u by
            // about 1%, so where a clamp holds differs from the textbook's for many values.
            let glu = if format.int_activations() { Glu::SILU } else { glus[glu] };
            let cfg = &MoeConfig { glu, ..*cfg };
            let x = random_input(tokens, cfg.hidden, 40 + tokens as u64);
            let (ids, wts, mask) = scenario_routing(s, tokens, cfg, 50 + tokens as u64);
            let rt = Routing { tokens, k: cfg.top_k, ids: &ids, weights: &wts, gpu_mask: mask.as_deref() };
            let case =
                |what: &str| name(&format!("n{tokens} {s:?} parts {parts} {kind:?} transposes {:?} {what}", cfg.glu));
            let (mut ws, mut cache) = (Workspace::default(), Cache::default());
            let mut out = vec![bf16::ZERO; tokens * cfg.hidden];
            // B zero: the inference forward's bits.
            let want = crate::testing::run(exec, cfg, layer, &x, &rt);
            if let Err(e) =
                forward(exec, cfg, layer, Some(&lora_of(&zero, r, alpha)), &x, &rt, &mut out, &mut cache, &mut ws)
            {
                failures.push(case(&format!("forward failed: {e}")));
                continue;
            }
            if out.iter().zip(&want).any(|(a, b)| a.to_f32().to_bits() != b.to_bits()) {
                failures.push(case("with B zero, the output differs from the inference forward's"));
            }
            // Random LoRA against the textbook.
            let l = lora_of(&mats, r, alpha);
            forward(exec, cfg, layer, Some(&l), &x, &rt, &mut out, &mut cache, &mut ws).expect("ran above");
            let mut rng = SplitMix64::new(60 + tokens as u64);
            let go: Vec<bf16> = (0..tokens * cfg.hidden).map(|_| bf16::from_f32(rng.gaussian())).collect();
            let go64: Vec<f64> = go.iter().map(|v| f64::from(v.to_f32())).collect();
            let tb = textbook(cfg, deq, wb, &l, &x, &rt, &go64);
            let outf: Vec<f32> = out.iter().map(|v| v.to_f32()).collect();
            let err = mean_rel_err(&outf, &tb.out);
            if err > tol_out {
                failures.push(case(&format!("output rel err {err:.3e} > {tol_out}")));
            }
            let mut grads = random_lora(cfg, r, false, 7);
            let before = grads.clone();
            let mut gi = vec![bf16::ZERO; tokens * cfg.hidden];
            let mut gw = vec![0.0f32; tokens * cfg.top_k];
            let [ga, gb, ua, ub, da, db] = &mut grads;
            let lg = LoraGrads { gate_a: ga, gate_b: gb, up_a: ua, up_b: ub, down_a: da, down_b: db };
            let mut base = [(); 3].map(|_| vec![bf16::ZERO; cfg.experts * cfg.hidden * cfg.intermediate]);
            let [bg, bu, bd] = &mut base;
            let bgrads = Some(BaseGrads { gate: bg, up: bu, down: bd });
            let outs =
                Backward { grad_input: &mut gi, grad_weights: &mut gw, lora: Some(lg), base: bgrads, grad_scale: 1.0 };
            if let Err(e) = backward(exec, cfg, layer, back, Some(&l), &cache, &go, outs, &mut ws) {
                failures.push(case(&format!("backward failed: {e}")));
                continue;
            }
            let scale = tb.dot_scale.iter().sum::<f64>().max(f64::MIN_POSITIVE);
            let err = gw.iter().zip(&tb.grad_weights).map(|(a, b)| (f64::from(*a) - b).abs()).sum::<f64>() / scale;
            if err > tol_grad {
                failures.push(case(&format!("grad_weights error {err:.3e} of the dots' size > {tol_grad}")));
            }
            let mut check = |what: &str, got: Vec<f32>, want: &[f64]| {
                let err = mean_rel_err(&got, want);
                if err > tol_grad || got.iter().any(|v| !v.is_finite()) {
                    failures.push(case(&format!("{what} rel err {err:.3e} > {tol_grad}")));
                }
            };
            check("grad_input", gi.iter().map(|v| v.to_f32()).collect(), &tb.grad_input);

            let names = ["grad gate_a", "grad gate_b", "grad up_a", "grad up_b", "grad down_a", "grad down_b"];
            for ((g, b), (want, what)) in grads.iter().zip(&before).zip(tb.grad_lora.iter().zip(names)) {
                // What the backward added.
                let added: Vec<f32> = g.iter().zip(b).map(|(g, b)| g.to_f32() - b.to_f32()).collect();
                if want.iter().any(|&v| v != 0.0) {
                    check(what, added, want);
                }
            }
            for ((g, want), what) in
                base.iter().zip(&tb.grad_base).zip(["grad gate_proj", "grad up_proj", "grad down_proj"])
            {
                check(what, g.iter().map(|v| v.to_f32()).collect(), want);
            }
            // No LoRA or base gradients asked for: the same input and weight gradients.
            let (mut gi2, mut gw2) = (vec![bf16::ZERO; gi.len()], vec![0.0f32; gw.len()]);
            let outs =
                Backward { grad_input: &mut gi2, grad_weights: &mut gw2, lora: None, base: None, grad_scale: 1.0 };
            backward(exec, cfg, layer, back, Some(&l), &cache, &go, outs, &mut ws).expect("ran above");
            if gi2 != gi || gw2.iter().zip(&gw).any(|(a, b)| a.to_bits() != b.to_bits()) {
                failures.push(case("a backward without LoRA gradients changes the input or weight gradients"));
            }
        }
    }
    failures
}
