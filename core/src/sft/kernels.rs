//! The SFT forward's own vector work, outside `gate_up`/`down`: LoRA's rank-r products and the
//! SwiGLU between the projections. A backend supplies its vector versions
//! ([`crate::Backend::sft_kernels`]); [`PORTABLE`] is the plain Rust one (its loops compile for
//! the build's baseline, SSE2 on x86-64, where the SFT forward spent more time in them than in
//! the base products).

use alloc::vec;

use half::bf16;

use crate::swiglu::Glu;

/// [`SftKernels::project`]: `(a, din, x, rows, xw, ax)`.
pub type ProjectFn = fn(&[bf16], usize, &[bf16], &[u32], &mut [f32], &mut [f32]);
/// [`SftKernels::expand`]: `(b, r, ax, s, bt, out)`.
pub type ExpandFn = fn(&[bf16], usize, &[f32], f32, &mut [f32], &mut [f32]);
/// [`SftKernels::glu_backward`]: `(glu, g, u, dh, dg, du)`.
pub type GluBackwardFn = fn(Glu, &[f32], &[f32], &[f32], &mut [f32], &mut [f32]);
/// [`SftKernels::outer`]: `(gout, x, rows, scale, grad)`.
pub type OuterFn = fn(&[f32], &[bf16], &[u32], f32, &mut [bf16]);

/// Function pointers, so one backend crate can hand the same kernels to several backends.
#[derive(Debug)]
pub struct SftKernels {
    /// `ax[j][q] = Σ_k a[q][k] · x[rows[j]·din + k]`: `a` `[r, din]`, `ax` `[rows.len(), r]`;
    /// `xw` scratch of at least [`SftKernels::project_scratch`] f32.
    pub project: ProjectFn,
    /// `out[j][o] += s · Σ_q b[o][q] · ax[j][q]` wherever that sum is not zero (so a zero B
    /// leaves `out`'s bits): `b` `[dout, r]`, `ax` `[m, r]`, `out` `[m, dout]`; `bt` scratch of
    /// `dout · r` f32.
    pub expand: ExpandFn,
    /// `out = glu(g, u)` row by row of `width`, with the SwiGLU the backend's `gate_up` runs.
    pub glu: fn(glu: Glu, width: usize, g: &[f32], u: &[f32], out: &mut [bf16]),
    /// `(dg, du)` of `h = glu(g, u)` given `dh`, element by element (g, u: the bf16 values
    /// the SwiGLU saw; [`Glu::backward`]).
    pub glu_backward: GluBackwardFn,
    /// One projection's LoRA backward ([`LoraBack`]).
    pub lora_backward: fn(LoraBack<'_>),
    /// `grad += scale · Σ_j gout[j]ᵀ·x[rows[j]]`: the gradient of a matrix `[dout, din]`
    /// (bf16) that maps the input rows `rows` of `x` (`[_, din]`) to outputs whose gradient
    /// is `gout` (`[rows.len(), dout]`): a base weight's, or LoRA's A. Each element is summed
    /// over the rows in order in f32 and added to the bf16 gradient once; a few output rows at
    /// a time ([`OUTER_ROWS`]), so the f32 sums of a whole `[I, H]` matrix are never held.
    pub outer: OuterFn,
}

/// Output rows of [`SftKernels::outer`]'s f32 block: 64 rows of H = 7168 are 1.8 MB.
pub const OUTER_ROWS: usize = 64;

/// One projection's LoRA backward for an expert's `m` rows: `gin += s·Aᵀ·(Bᵀ·gout)`
/// (`[m, in]`), and, where there are gradients, `grad B += scale·s·Σ_rows gout·axᵀ`,
/// `grad A += scale·s·Σ_rows (Bᵀ·gout)·inputᵀ`, each summed over the rows in order in f32 and
/// added to the bf16 gradient once.
#[derive(Debug)]
pub struct LoraBack<'a> {
    /// `[r, in]`.
    pub a: &'a [bf16],
    /// `[out, r]`.
    pub b: &'a [bf16],
    /// `alpha / r`.
    pub s: f32,
    /// `[m, out]`: the gradient of the projection's output.
    pub gout: &'a [f32],
    /// `[m, r]`: the forward's `A·input`.
    pub ax: &'a [f32],
    /// `[_, in]`, whose rows `rows` are the input rows.
    pub x: &'a [bf16],
    /// Which rows of `x` are the input rows, in order.
    pub rows: &'a [u32],
    /// `[m, in]`, added to.
    pub gin: &'a mut [f32],
    /// This expert's gradients of A and B, and the scale of their contributions.
    pub grads: Option<(&'a mut [bf16], &'a mut [bf16], f32)>,
}

impl SftKernels {
    /// f32 values of the `xw` scratch [`SftKernels::project`] needs for rows of `din`.
    pub const fn project_scratch(din: usize) -> usize {
        4 * din
    }
}

/// The plain Rust kernels (the reference backend's, and any backend's without its own).
pub static PORTABLE: SftKernels = SftKernels { project, expand, glu, glu_backward, lora_backward, outer };

fn project(a: &[bf16], din: usize, x: &[bf16], rows: &[u32], xw: &mut [f32], ax: &mut [f32]) {
    let r = a.len() / din.max(1);
    let xw = &mut xw[..din];
    for (&row, ax) in rows.iter().zip(ax.chunks_exact_mut(r.max(1))) {
        for (w, v) in xw.iter_mut().zip(&x[row as usize * din..][..din]) {
            *w = v.to_f32();
        }
        for (q, ax) in ax.iter_mut().enumerate() {
            *ax = dot(&a[q * din..][..din], xw);
        }
    }
}

fn expand(b: &[bf16], r: usize, ax: &[f32], s: f32, _bt: &mut [f32], out: &mut [f32]) {
    let dout = b.len() / r.max(1);
    for (ax, out) in ax.chunks_exact(r.max(1)).zip(out.chunks_exact_mut(dout.max(1))) {
        for (o, out) in out.iter_mut().enumerate() {
            let d = dot(&b[o * r..][..r], ax);
            if d != 0.0 {
                *out += s * d;
            }
        }
    }
}

fn glu(glu: Glu, _width: usize, g: &[f32], u: &[f32], out: &mut [bf16]) {
    for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
        *o = glu.apply(g, u);
    }
}

fn glu_backward(glu: Glu, g: &[f32], u: &[f32], dh: &[f32], dg: &mut [f32], du: &mut [f32]) {
    for ((((dg, du), &dh), &g), &u) in dg.iter_mut().zip(du).zip(dh).zip(g).zip(u) {
        (*dg, *du) = glu.backward(g, u, dh);
    }
}

/// [`SftKernels::lora_backward`] as loops of the `y += c·x` kind.
fn lora_backward(LoraBack { a, b, s, gout, ax, x, rows, gin, grads }: LoraBack<'_>) {
    let r = ax.len() / rows.len().max(1);
    if r == 0 {
        return;
    }
    let (din, dout) = (a.len() / r, b.len() / r);
    let widened = |v: &[bf16]| v.iter().map(|v| v.to_f32()).collect::<alloc::vec::Vec<f32>>();
    let (a, b) = (widened(a), widened(b));
    // gb[row][q] = Σ_o gout[row][o]·B[o][q]
    let mut gb = vec![0.0f32; rows.len() * r];
    for (gb, gout) in gb.chunks_exact_mut(r).zip(gout.chunks_exact(dout)) {
        for (o, &go) in gout.iter().enumerate() {
            for (gb, &b) in gb.iter_mut().zip(&b[o * r..][..r]) {
                *gb += go * b;
            }
        }
    }
    for (gin, gb) in gin.chunks_exact_mut(din).zip(gb.chunks_exact(r)) {
        for (q, &g) in gb.iter().enumerate() {
            for (gin, &a) in gin.iter_mut().zip(&a[q * din..][..din]) {
                *gin += s * g * a;
            }
        }
    }
    let Some((ga, gbm, scale)) = grads else { return };
    // grad B [out, r]
    let mut acc = vec![0.0f32; dout * r];
    for (gout, ax) in gout.chunks_exact(dout).zip(ax.chunks_exact(r)) {
        for (acc, &go) in acc.chunks_exact_mut(r).zip(gout) {
            for (acc, &x) in acc.iter_mut().zip(ax) {
                *acc += go * x;
            }
        }
    }
    add_scaled(gbm, &acc, s * scale);
    outer(&gb, x, rows, s * scale, ga);
}

fn outer(gout: &[f32], x: &[bf16], rows: &[u32], scale: f32, grad: &mut [bf16]) {
    let m = rows.len();
    let dout = gout.len() / m.max(1);
    if m == 0 || dout == 0 {
        return;
    }
    let din = grad.len() / dout;
    let xw = widen_rows(x, rows, din);
    let mut acc = vec![0.0f32; OUTER_ROWS.min(dout) * din];
    for (ob, grad) in grad.chunks_mut(OUTER_ROWS * din.max(1)).enumerate() {
        let acc = &mut acc[..grad.len()];
        acc.fill(0.0);
        for (gout, xr) in gout.chunks_exact(dout).zip(xw.chunks_exact(din.max(1))) {
            for (acc, &g) in acc.chunks_exact_mut(din.max(1)).zip(&gout[ob * OUTER_ROWS..]) {
                for (acc, &x) in acc.iter_mut().zip(xr) {
                    *acc += g * x;
                }
            }
        }
        add_scaled(grad, acc, scale);
    }
}

/// Rows `rows` of `x` (`[_, din]`) as f32, `[rows.len(), din]`.
pub fn widen_rows(x: &[bf16], rows: &[u32], din: usize) -> alloc::vec::Vec<f32> {
    let mut xw = vec![0.0f32; rows.len() * din];
    for (xw, &row) in xw.chunks_exact_mut(din.max(1)).zip(rows) {
        for (w, v) in xw.iter_mut().zip(&x[row as usize * din..][..din]) {
            *w = v.to_f32();
        }
    }
    xw
}

/// `grad = bf16(grad + s·acc)`, element by element.
#[inline(always)]
pub fn add_scaled(grad: &mut [bf16], acc: &[f32], s: f32) {
    for (g, &a) in grad.iter_mut().zip(acc) {
        *g = bf16::from_f32(g.to_f32() + s * a);
    }
}

/// `Σ a[i]·b[i]`, in 8 interleaved partial sums added at the end (independent chains the
/// compiler puts in vector registers; one chain in order ran the rank-r products at a scalar
/// add's latency).
fn dot(a: &[bf16], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac.remainder().iter().zip(bc.remainder()).map(|(a, b)| a.to_f32() * b).sum();
    for (a, b) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] += a[l].to_f32() * b[l];
        }
    }
    ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail
}
