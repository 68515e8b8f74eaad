//! The backward of a cached forward.

use alloc::borrow::Cow;
use alloc::vec;
use alloc::vec::Vec;
use core::ops::Range;

use half::bf16;

use super::forward::{reduce, resize, rows_of, Workspace};
use super::kernels::{LoraBack, SftKernels};
use super::lora::{Lora, LoraGrads, Proj};
use super::transposes::BackwardWeights;
use super::Cache;
use crate::aligned::AlignedBuf;
use crate::backend::TaskShape;
use crate::forward::LayerWeights;
use crate::mat::{columns, set_columns, MatMut, SharedMut};
use crate::{Backend, Error, Executor, MoeConfig, PackedMatrix};

/// Where a backward writes.
#[derive(Debug)]
pub struct Backward<'a> {
    /// `[tokens, H]`: the gradient of the layer's input.
    pub grad_input: &'a mut [bf16],
    /// `[tokens, k]`: `⟨grad_output_t, y_tj⟩`, the routing weights' gradient (0 for slots
    /// the CPU did not compute).
    pub grad_weights: &'a mut [f32],
    /// The LoRA matrices' gradients, added to (`None`: the base alone, KT's `SkipLoRA`).
    pub lora: Option<LoraGrads<'a>>,
    /// The base weights' gradients, added to (`None`: frozen base, the LoRA case).
    pub base: Option<BaseGrads<'a>>,
    /// What the LoRA and base gradients' contributions are multiplied by before they are added
    /// (KT's `optimizer_grad_scale`; 1 for none).
    pub grad_scale: f32,
}

/// Where the backward adds the base weights' gradients for full fine-tuning (`+=`, bf16 as KT
/// keeps them), with respect to their dequantized values, per slot in the layer's shapes.
#[derive(Debug)]
pub struct BaseGrads<'a> {
    /// `[E, I, H]`.
    pub gate: &'a mut [bf16],
    /// `[E, I, H]`.
    pub up: &'a mut [bf16],
    /// `[E, H, I]`.
    pub down: &'a mut [bf16],
}

impl BaseGrads<'_> {
    /// Check every gradient's length against `cfg`.
    pub fn validate(&self, cfg: &MoeConfig) -> Result<(), Error> {
        let want = cfg.experts * cfg.intermediate * cfg.hidden;
        let found =
            [("grad_gate_proj", self.gate.len()), ("grad_up_proj", self.up.len()), ("grad_down_proj", self.down.len())];
        match found.into_iter().find(|&(_, len)| len != want) {
            Some((what, found)) => Err(Error::ShapeMismatch { what, expected: want, found }),
            None => Ok(()),
        }
    }
}

/// The backward of the forward `cache` holds, for the upstream gradient `grad_output`
/// (`[tokens, H]`), with the layer's weights `w`, their transposes `back` and the same `lora`
/// the forward ran with.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    exec: &dyn Executor,
    cfg: &MoeConfig,
    w: &LayerWeights,
    back: &BackwardWeights,
    lora: Option<&Lora<'_>>,
    cache: &Cache,
    grad_output: &[bf16],
    out: Backward<'_>,
    ws: &mut Workspace,
) -> Result<(), Error> {
    let (n, h, i, k) = (cache.tokens, cfg.hidden, cfg.intermediate, cache.k);
    let check = |what, expected: usize, found: usize| match expected == found {
        true => Ok(()),
        false => Err(Error::ShapeMismatch { what, expected, found }),
    };
    check("grad_output", n * h, grad_output.len())?;
    check("grad_input", n * h, out.grad_input.len())?;
    check("grad_weights", n * k, out.grad_weights.len())?;
    if let Some(l) = lora {
        l.validate(cfg)?;
        check("LoRA rank (the forward's)", cache.ax_g.len(), cache.row_tokens.len() * l.rank)?;
        if let Some(g) = &out.lora {
            g.validate(cfg, l.rank)?;
        }
    }
    if let Some(b) = &out.base {
        b.validate(cfg)?;
    }
    if let Some(a) = cache.experts.iter().find(|a| back.experts.get(a.id).is_none_or(Option::is_none)) {
        return Err(Error::ExpertNotLoaded { expert: a.id });
    }
    let Backward { grad_input, grad_weights, lora: grads, base, grad_scale } = out;
    let rows = cache.row_tokens.len();
    resize(&mut ws.dx, rows * h);
    grad_weights.fill(0.0);

    let backend = w.backend();
    let max_rows = cache.experts.iter().map(|a| a.rows).max().unwrap_or(0);
    let shape = TaskShape { format: w.format, tokens: max_rows.max(1), rows: h.max(i), cols: h.max(i) };
    let ident: Vec<u32> = (0..max_rows as u32).collect();
    let blocks = ws.scratch.blocks(exec, backend.scratch_bytes(shape));
    let (dx, gw) = (SharedMut::new(&mut ws.dx[..]), SharedMut::new(grad_weights));
    let grads = grads.map(|g| [g.gate_a, g.gate_b, g.up_a, g.up_b, g.down_a, g.down_b].map(SharedMut::new));
    let base = base.map(|b| [b.gate, b.up, b.down].map(SharedMut::new));
    let hi = h * i;
    blocks.run(exec, cache.experts.len(), &|e| e, &|e, scratch| {
        let a = &cache.experts[e];
        let slices = back.experts[a.id].as_deref().expect("checked above");
        let (m, at) = (a.rows, a.row_range());
        let mut prod = Product { backend, ident: &ident[..m], scratch };
        let kernels = backend.sft_kernels();
        // This expert's slices of the LoRA gradients ([`Lora::of`]'s order: A, then B).
        let lora_grads = |p: Proj| {
            let (din, dout) = p.dims(cfg);
            let r = lora.map_or(0, |l| l.rank);
            let at = match p {
                Proj::Gate => 0,
                Proj::Up => 2,
                Proj::Down => 4,
            };
            // SAFETY: expert `a.id`'s slices are written by its one task.
            grads.as_ref().map(|g| unsafe {
                (
                    g[at].slice_mut(a.id * r * din..(a.id + 1) * r * din),
                    g[at + 1].slice_mut(a.id * dout * r..(a.id + 1) * dout * r),
                    grad_scale,
                )
            })
        };

        // Each row's share of the upstream gradient, gy = w·grad_output, and ⟨grad_output, y⟩.
        let mut gy = vec![0.0f32; m * h];
        for (row, gy) in at.clone().zip(gy.chunks_exact_mut(h)) {
            let slot = cache.row_slots[row] as usize;
            let go = &grad_output[(slot / k) * h..][..h];
            let wt = cache.weights[slot];
            let mut s = 0.0f32;
            for ((gy, go), y) in gy.iter_mut().zip(go).zip(&cache.y[row * h..][..h]) {
                *gy = wt * go.to_f32();
                s += go.to_f32() * y;
            }
            // SAFETY: each slot has one row, and the row is this task's.
            unsafe { gw.slice_mut(slot..slot + 1)[0] = s };
        }

        // SAFETY: expert `a.id`'s slices are written by its one task.
        let base_grad = |p: usize| base.as_ref().map(|b| unsafe { b[p].slice_mut(a.id * hi..(a.id + 1) * hi) });

        // down: dh = W_dᵀ·gy (+ LoRA), then through SwiGLU at the g and u it saw (bf16).
        let mut dh = prod.down_t(&back.ranges, slices, &gy, m, i);
        let (mut g32, mut u32_) = (vec![0.0f32; m * i], vec![0.0f32; m * i]);
        widen(&cache.g[at.start * i..at.end * i], &mut g32);
        widen(&cache.u[at.start * i..at.end * i], &mut u32_);
        if lora.is_some() || base.is_some() {
            // h as the forward made it: the backend's SwiGLU.
            let mut hb = vec![bf16::ZERO; m * i];
            (kernels.glu)(cfg.glu, i, &g32, &u32_, &mut hb);
            if let Some(l) = lora {
                let ah = &cache.ah[at.start * l.rank..at.end * l.rank];
                let input = (&hb[..], &ident[..m]);
                lora_backward(kernels, l, Proj::Down, a.id, cfg, (&gy, ah), input, &mut dh, lora_grads(Proj::Down));
            }
            if let Some(gd) = base_grad(2) {
                (kernels.outer)(&gy, &hb, &ident[..m], grad_scale, gd);
            }
        }
        let (mut dg, mut du) = (vec![0.0f32; m * i], vec![0.0f32; m * i]);
        (kernels.glu_backward)(cfg.glu, &g32, &u32_, &dh, &mut dg, &mut du);
        if let (Some(gg), Some(gu)) = (base_grad(0), base_grad(1)) {
            let tokens = &cache.row_tokens[at.clone()];
            (kernels.outer)(&dg, &cache.x, tokens, grad_scale, gg);
            (kernels.outer)(&du, &cache.x, tokens, grad_scale, gu);
        }

        // gate and up: dx = Σ_slices W_gᵀ·dg + W_uᵀ·du (+ LoRA).
        let mut d = prod.gate_up_t(&back.ranges, slices, (&dg, &du), m, (i, h));
        if let Some(l) = lora {
            let x = (&cache.x[..], &cache.row_tokens[at.clone()]);
            let r = l.rank;
            let (axg, axu) = (&cache.ax_g[at.start * r..at.end * r], &cache.ax_u[at.start * r..at.end * r]);
            lora_backward(kernels, l, Proj::Gate, a.id, cfg, (&dg, axg), x, &mut d, lora_grads(Proj::Gate));
            lora_backward(kernels, l, Proj::Up, a.id, cfg, (&du, axu), x, &mut d, lora_grads(Proj::Up));
        }
        // SAFETY: expert e's rows are this task's.
        unsafe { rows_of(&dx, &at, h) }.copy_from_slice(&d);
    });

    // grad_input[t] = Σ_j dx of its slots, j ascending.
    let rows = slot_rows(cache);
    reduce(exec, (n, k, h), &|s| rows[s].map(|r| (r, 1.0)), &[&ws.dx], grad_input);
    Ok(())
}

/// Each slot's row, `None` where the slot was skipped.
fn slot_rows(cache: &Cache) -> Vec<Option<usize>> {
    let mut v = vec![None; cache.tokens * cache.k];
    for (row, &slot) in cache.row_slots.iter().enumerate() {
        v[slot as usize] = Some(row);
    }
    v
}

/// A task's products with a transposed base matrix.
struct Product<'a, 's> {
    backend: &'a dyn Backend,
    ident: &'a [u32],
    scratch: &'s mut [u8],
}

impl Product<'_, '_> {
    /// `dh = W_dᵀ·gy` (`[m, I]`) from the transposes' slices, each giving its columns of I.
    fn down_t(
        &mut self,
        ranges: &[Range<usize>],
        slices: &[[PackedMatrix; 3]],
        gy: &[f32],
        m: usize,
        i: usize,
    ) -> Vec<f32> {
        if let [[_, _, wd]] = slices {
            return self.times(wd, gy, m, i);
        }
        let mut dh = vec![0.0f32; m * i];
        for (r, [_, _, wd]) in ranges.iter().zip(slices) {
            let part = self.times(wd, gy, m, r.len());
            set_columns(&mut dh, i, r.clone(), &part);
        }
        dh
    }

    /// `dx = W_gᵀ·dg + W_uᵀ·du` (`[m, H]`) from the transposes' slices: each multiplies its
    /// columns of `dg` and `du` (`[m, I]`), summed slice by slice, gate before up.
    fn gate_up_t<'v>(
        &mut self,
        ranges: &[Range<usize>],
        slices: &[[PackedMatrix; 3]],
        (dg, du): (&'v [f32], &'v [f32]),
        m: usize,
        (i, h): (usize, usize),
    ) -> Vec<f32> {
        let mut d: Option<Vec<f32>> = None;
        for (r, [wg, wu, _]) in ranges.iter().zip(slices) {
            let cols = |v: &'v [f32]| -> Cow<'v, [f32]> {
                match r.len() == i {
                    true => Cow::Borrowed(v),
                    false => Cow::Owned(columns(v, i, r.clone())),
                }
            };
            for (w, v) in [(wg, dg), (wu, du)] {
                let e = self.times(w, &cols(v), m, h);
                match d.as_mut() {
                    None => d = Some(e),
                    Some(d) => d.iter_mut().zip(e).for_each(|(d, e)| *d += e),
                }
            }
        }
        d.unwrap_or_else(|| vec![0.0f32; m * h])
    }

    /// `Wᵀ·v` of each of `m` rows of `v` (`[m, cols]`, rounded to bf16 and prepared as the
    /// activations of the transposes' format): `[m, rows]` in f32.
    fn times(&mut self, wt: &PackedMatrix, v: &[f32], m: usize, rows: usize) -> Vec<f32> {
        let (cols, format, scratch) = (wt.cols(), wt.format(), &mut *self.scratch);
        let vb: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
        let mut act = AlignedBuf::zeroed(self.backend.act_bytes(format, m, cols));
        self.backend.quantize_act(format, cols, &vb, self.ident, act.as_mut_slice(), scratch);
        let mut out = vec![0.0f32; m * rows];
        self.backend.down(wt, 0..rows, act.as_slice(), MatMut::from_slice(&mut out, m, rows, rows), scratch);
        out
    }
}

/// Projection `p`'s LoRA backward for expert `e`'s rows by `kernels` ([`LoraBack`]): `gout`
/// (`[m, out]`) is the gradient of its output, `ax` (`[m, r]`) the forward's `A·input`, the
/// input rows are `rows` of `x`; `grads` this expert's gradients of A and B (`None`: none
/// asked for) and what their contributions are scaled by.
#[allow(clippy::too_many_arguments)]
fn lora_backward(
    kernels: &SftKernels,
    l: &Lora<'_>,
    p: Proj,
    e: usize,
    cfg: &MoeConfig,
    (gout, ax): (&[f32], &[f32]),
    (x, rows): (&[bf16], &[u32]),
    gin: &mut [f32],
    grads: Option<(&mut [bf16], &mut [bf16], f32)>,
) {
    let (a, b) = l.of(p, e, cfg);
    (kernels.lora_backward)(LoraBack { a, b, s: l.scaling(), gout, ax, x, rows, gin, grads });
}

/// bf16 values as f32, into `out`.
fn widen(v: &[bf16], out: &mut [f32]) {
    for (o, v) in out.iter_mut().zip(v) {
        *o = v.to_f32();
    }
}
