//! # kt-x86-sft
//!
//! The SFT passes' rank-r LoRA products, SwiGLU and SiLU's derivative on AVX2/FMA vectors, for
//! every x86 backend (`Backend::sft_kernels`): the SwiGLU is [`kt_x86::swiglu::glu_row`], the one
//! their `gate_up` runs, so with B zero the SFT forward keeps the inference forward's bits.
#![cfg(target_arch = "x86_64")]

use core::arch::x86_64::*;

use half::bf16;
use kt_core::sft::{add_scaled, widen_rows, LoraBack, SftKernels, OUTER_ROWS, PORTABLE};
use kt_core::swiglu::Glu;

/// The kernels for this CPU at 8 lanes: AVX2 and FMA where it has them, else [`PORTABLE`]. The
/// choice is made here, when a backend hands out its kernels, not in every call.
pub fn kernels() -> &'static SftKernels {
    if kt_x86::isa::avx2_fma().is_ok() {
        &AVX2
    } else {
        &PORTABLE
    }
}

/// [`kernels`] with the rank-r products at 16 lanes where the CPU has AVX-512F (the avx512 and
/// amx backends'; those products in half the time, docs/tuning.md) and this crate was built by
/// a rustc whose AVX-512 intrinsics are stable (1.89: `build.rs`).
pub fn kernels_512() -> &'static SftKernels {
    #[cfg(vnni_intrinsics)]
    if kt_x86::isa::avx2_fma().is_ok() && is_x86_feature_detected!("avx512f") {
        return &AVX512;
    }
    kernels()
}

/// The AVX2/FMA kernels: handed out by [`kernels`] only where the CPU runs them, which is what
/// every function of this table relies on.
static AVX2: SftKernels = SftKernels { project, expand, glu, glu_backward, lora_backward, outer };

/// [`AVX2`] with the products at 16 lanes: handed out by [`kernels_512`] only where the CPU has
/// AVX2, FMA and AVX-512F.
#[cfg(vnni_intrinsics)]
static AVX512: SftKernels = SftKernels {
    project: project512,
    expand: expand512,
    glu,
    glu_backward,
    lora_backward: lora_backward512,
    outer: outer512,
};

#[cfg(vnni_intrinsics)]
fn project512(a: &[bf16], din: usize, x: &[bf16], rows: &[u32], xw: &mut [f32], ax: &mut [f32]) {
    // SAFETY: in AVX512's table only, which kernels_512 hands out where the CPU has AVX2, FMA
    // and AVX-512F.
    unsafe { project_avx512(a, din, x, rows, xw, ax) }
}

#[cfg(vnni_intrinsics)]
fn expand512(b: &[bf16], r: usize, ax: &[f32], s: f32, bt: &mut [f32], out: &mut [f32]) {
    // SAFETY: as in project512.
    unsafe { expand_avx512(b, r, ax, s, bt, out) }
}

#[cfg(vnni_intrinsics)]
fn lora_backward512(args: LoraBack<'_>) {
    // SAFETY: as in project512.
    unsafe { lora_backward_avx512(args) }
}

#[cfg(vnni_intrinsics)]
fn outer512(gout: &[f32], x: &[bf16], rows: &[u32], scale: f32, grad: &mut [bf16]) {
    // SAFETY: as in project512.
    unsafe { outer_avx512(gout, x, rows, scale, grad) }
}

fn project(a: &[bf16], din: usize, x: &[bf16], rows: &[u32], xw: &mut [f32], ax: &mut [f32]) {
    // SAFETY: in the AVX2 and AVX512 tables only, which kernels and kernels_512 hand out where
    // the CPU has AVX2 and FMA.
    unsafe { project_avx2(a, din, x, rows, xw, ax) }
}

fn expand(b: &[bf16], r: usize, ax: &[f32], s: f32, bt: &mut [f32], out: &mut [f32]) {
    // SAFETY: as in project.
    unsafe { expand_avx2(b, r, ax, s, bt, out) }
}

fn glu(glu: Glu, width: usize, g: &[f32], u: &[f32], out: &mut [bf16]) {
    let rows = g.chunks_exact(width).zip(u.chunks_exact(width)).zip(out.chunks_exact_mut(width));
    for ((g, u), out) in rows {
        // SAFETY: as in project.
        unsafe { kt_x86::swiglu::glu_row(glu, g, u, out) };
    }
}

fn glu_backward(glu: Glu, g: &[f32], u: &[f32], dh: &[f32], dg: &mut [f32], du: &mut [f32]) {
    if !glu.is_silu() {
        // The clamped variants element by element.
        return (PORTABLE.glu_backward)(glu, g, u, dh, dg, du);
    }
    // SAFETY: as in project.
    unsafe { glu_backward_avx2(g, u, dh, dg, du) }
}

fn lora_backward(args: LoraBack<'_>) {
    // SAFETY: as in project.
    unsafe { lora_backward_avx2(args) }
}

fn outer(gout: &[f32], x: &[bf16], rows: &[u32], scale: f32, grad: &mut [bf16]) {
    // SAFETY: as in project.
    unsafe { outer_avx2(gout, x, rows, scale, grad) }
}

/// SiLU's derivative 8 lanes at a time with the SwiGLU kernels' exp; the tail as [`PORTABLE`].
///
/// # Safety
/// AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
unsafe fn glu_backward_avx2(g: &[f32], u: &[f32], dh: &[f32], dg: &mut [f32], du: &mut [f32]) {
    let n = dg.len().min(du.len()).min(dh.len()).min(g.len()).min(u.len());
    let body = n / 8 * 8;
    // SAFETY: AVX2/FMA enabled here; i + 8 <= body <= every slice's length.
    unsafe {
        let one = _mm256_set1_ps(1.0);
        for i in (0..body).step_by(8) {
            let (gv, uv, dv) = (_mm256_loadu_ps(&g[i]), _mm256_loadu_ps(&u[i]), _mm256_loadu_ps(&dh[i]));
            let e = kt_x86::swiglu::exp8(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv), _mm256_set1_ps(88.0)));
            let sig = _mm256_div_ps(one, _mm256_add_ps(one, e));
            // dh·u·σ·(1 + g·(1 − σ)), and dh·g·σ.
            let slope = _mm256_fmadd_ps(gv, _mm256_sub_ps(one, sig), one);
            _mm256_storeu_ps(&mut dg[i], _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(dv, uv), sig), slope));
            _mm256_storeu_ps(&mut du[i], _mm256_mul_ps(dv, _mm256_mul_ps(gv, sig)));
        }
    }
    (PORTABLE.glu_backward)(Glu::SILU, &g[body..n], &u[body..n], &dh[body..n], &mut dg[body..n], &mut du[body..n]);
}

/// The vector width the products run at: AVX2's 8 lanes ([`Y`]) or AVX-512's 16 ([`Z`]).
/// Every method needs its type's instructions (AVX2 and FMA, or AVX-512F): it is inlined into
/// the `#[target_feature]` kernels below.
trait Lanes: Copy {
    const N: usize;
    unsafe fn zero() -> Self;
    unsafe fn splat(x: f32) -> Self;
    unsafe fn load(p: *const f32) -> Self;
    unsafe fn store(self, p: *mut f32);
    /// `N` bf16 as f32.
    unsafe fn widen(p: *const bf16) -> Self;
    /// `a·b + c`.
    unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self;
    unsafe fn sum(self) -> f32;
    /// `old + s·acc` where `acc` is not zero, else `old` (its bits).
    unsafe fn add_nonzero(old: Self, s: Self, acc: Self) -> Self;
}

#[derive(Clone, Copy)]
struct Y(__m256);

#[cfg(vnni_intrinsics)]
#[derive(Clone, Copy)]
struct Z(__m512);

impl Lanes for Y {
    const N: usize = 8;
    #[inline(always)]
    unsafe fn zero() -> Self {
        // SAFETY: register-only intrinsics of this type's instructions, which the inlining caller's
        // target features provide ([`Lanes`]).
        unsafe { Y(_mm256_setzero_ps()) }
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        // SAFETY: register-only intrinsics of this type's instructions, which the inlining caller's
        // target features provide ([`Lanes`]).
        unsafe { Y(_mm256_set1_ps(x)) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: this type's instructions, from the caller's features ([`Lanes`]); `p` points at
        // `N` readable values (the caller's contract).
        unsafe { Y(_mm256_loadu_ps(p)) }
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: this type's instructions, from the caller's features ([`Lanes`]); `p` points at
        // `N` writable values (the caller's contract).
        unsafe { _mm256_storeu_ps(p, self.0) }
    }
    #[inline(always)]
    unsafe fn widen(p: *const bf16) -> Self {
        // SAFETY: this type's instructions, from the caller's features ([`Lanes`]); `p` points at
        // `N` readable values (the caller's contract).
        unsafe { Y(widen8(p)) }
    }
    #[inline(always)]
    unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self {
        // SAFETY: register-only intrinsics of this type's instructions, which the inlining caller's
        // target features provide ([`Lanes`]).
        unsafe { Y(_mm256_fmadd_ps(a.0, b.0, c.0)) }
    }
    #[inline(always)]
    unsafe fn sum(self) -> f32 {
        // SAFETY: register-only intrinsics of this type's instructions, which the inlining caller's
        // target features provide ([`Lanes`]).
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(self.0), _mm256_extractf128_ps::<1>(self.0));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
        }
    }
    #[inline(always)]
    unsafe fn add_nonzero(old: Self, s: Self, acc: Self) -> Self {
        // SAFETY: register-only intrinsics of this type's instructions, which the inlining caller's
        // target features provide ([`Lanes`]).
        unsafe {
            let nonzero = _mm256_cmp_ps::<_CMP_NEQ_UQ>(acc.0, _mm256_setzero_ps());
            Y(_mm256_blendv_ps(old.0, _mm256_add_ps(old.0, _mm256_mul_ps(s.0, acc.0)), nonzero))
        }
    }
}

#[cfg(vnni_intrinsics)]
#[allow(clippy::incompatible_msrv)] // Built from rustc 1.89 only (this crate's `build.rs`).
impl Lanes for Z {
    const N: usize = 16;
    #[inline(always)]
    unsafe fn zero() -> Self {
        // SAFETY: register-only intrinsics of this type's instructions, which the inlining caller's
        // target features provide ([`Lanes`]).
        unsafe { Z(_mm512_setzero_ps()) }
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        // SAFETY: register-only intrinsics of this type's instructions, which the inlining caller's
        // target features provide ([`Lanes`]).
        unsafe { Z(_mm512_set1_ps(x)) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: this type's instructions, from the caller's features ([`Lanes`]); `p` points at
        // `N` readable values (the caller's contract).
        unsafe { Z(_mm512_loadu_ps(p)) }
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: this type's instructions, from the caller's features ([`Lanes`]); `p` points at
        // `N` writable values (the caller's contract).
        unsafe { _mm512_storeu_ps(p, self.0) }
    }
    #[inline(always)]
    unsafe fn widen(p: *const bf16) -> Self {
        // SAFETY: this type's instructions, from the caller's features ([`Lanes`]); `p` points at
        // `N` readable values (the caller's contract).
        unsafe { Z(_mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()))))) }
    }
    #[inline(always)]
    unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self {
        // SAFETY: register-only intrinsics of this type's instructions, which the inlining caller's
        // target features provide ([`Lanes`]).
        unsafe { Z(_mm512_fmadd_ps(a.0, b.0, c.0)) }
    }
    #[inline(always)]
    unsafe fn sum(self) -> f32 {
        // SAFETY: register-only intrinsics of this type's instructions, which the inlining caller's
        // target features provide ([`Lanes`]).
        unsafe {
            let h = _mm256_add_ps(
                _mm512_castps512_ps256(self.0),
                _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(self.0))),
            );
            Y(h).sum()
        }
    }
    #[inline(always)]
    unsafe fn add_nonzero(old: Self, s: Self, acc: Self) -> Self {
        // SAFETY: register-only intrinsics of this type's instructions, which the inlining caller's
        // target features provide ([`Lanes`]).
        unsafe {
            let nonzero = _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(acc.0, _mm512_setzero_ps());
            Z(_mm512_mask_add_ps(old.0, nonzero, old.0, _mm512_mul_ps(s.0, acc.0)))
        }
    }
}

/// 8 bf16 as f32.
///
/// # Safety
/// AVX2; 8 readable values at `p`.
#[inline(always)]
unsafe fn widen8(p: *const bf16) -> __m256 {
    // SAFETY: the caller's contract.
    unsafe { _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast())))) }
}

/// Up to 4 rows of x (widened into `xw`) against up to 2 rows of A at a time: each A load
/// feeds 4 FMAs, 8 accumulators in flight.
///
/// # Safety
/// `V`'s instructions (inlined into the `#[target_feature]` kernels).
#[inline(always)]
unsafe fn project_body<V: Lanes>(a: &[bf16], din: usize, x: &[bf16], rows: &[u32], xw: &mut [f32], ax: &mut [f32]) {
    let r = a.len() / din.max(1);
    if r == 0 {
        return;
    }
    for (rows, ax) in rows.chunks(4).zip(ax.chunks_mut(4 * r)) {
        for (j, &row) in rows.iter().enumerate() {
            for (w, v) in xw[j * din..][..din].iter_mut().zip(&x[row as usize * din..][..din]) {
                *w = v.to_f32();
            }
        }
        let mut q = 0;
        while q < r {
            // SAFETY: the caller's contract; the rows and A rows named are inside their slices.
            unsafe {
                match (rows.len(), (r - q).min(2)) {
                    (4, 2) => block::<V, 4, 2>(a, din, q, xw, r, ax),
                    (4, _) => block::<V, 4, 1>(a, din, q, xw, r, ax),
                    (3, 2) => block::<V, 3, 2>(a, din, q, xw, r, ax),
                    (3, _) => block::<V, 3, 1>(a, din, q, xw, r, ax),
                    (2, 2) => block::<V, 2, 2>(a, din, q, xw, r, ax),
                    (2, _) => block::<V, 2, 1>(a, din, q, xw, r, ax),
                    (_, 2) => block::<V, 1, 2>(a, din, q, xw, r, ax),
                    _ => block::<V, 1, 1>(a, din, q, xw, r, ax),
                }
            }
            q += 2;
        }
    }
}

/// `ax[j][q + i] = A[q + i] · xw[j]` for `j < R`, `i < Q`.
///
/// # Safety
/// `V`'s instructions; `xw` holds R rows of `din`, A rows `q + Q`.
#[inline(always)]
unsafe fn block<V: Lanes, const R: usize, const Q: usize>(
    a: &[bf16],
    din: usize,
    q: usize,
    xw: &[f32],
    r: usize,
    ax: &mut [f32],
) {
    let body = din / V::N * V::N;
    // SAFETY: the caller's contract; k + N <= body <= din.
    unsafe {
        let mut acc = [[V::zero(); Q]; R];
        for k in (0..body).step_by(V::N) {
            let w: [V; Q] = core::array::from_fn(|i| V::widen(a.as_ptr().add((q + i) * din + k)));
            for (j, acc) in acc.iter_mut().enumerate() {
                let xv = V::load(xw.as_ptr().add(j * din + k));
                for i in 0..Q {
                    acc[i] = V::fmadd(w[i], xv, acc[i]);
                }
            }
        }
        for (j, acc) in acc.iter().enumerate() {
            for i in 0..Q {
                let tail: f32 = (body..din).map(|k| a[(q + i) * din + k].to_f32() * xw[j * din + k]).sum();
                ax[j * r + q + i] = acc[i].sum() + tail;
            }
        }
    }
}

/// B transposed and widened into `bt` (`[r, dout]`), then `out += s·ax·Bᵀ` by [`gemm`].
///
/// # Safety
/// `V`'s instructions and AVX2.
#[inline(always)]
unsafe fn expand_body<V: Lanes>(b: &[bf16], r: usize, ax: &[f32], s: f32, bt: &mut [f32], out: &mut [f32]) {
    if r == 0 {
        return;
    }
    let dout = b.len() / r;
    // SAFETY: the caller's contract; b is [dout, r], bt holds dout·r.
    unsafe {
        transpose(b, r, dout, bt);
        gemm::<V>(ax, r, &bt[..r * dout], s, out);
    }
}

/// `out[j][o] += s · Σ_q a[j][q] · b[q][o]` (`a` `[J, q]`, `b` `[q, O]`, `out` `[J, O]`)
/// wherever that sum is not zero, 4 rows of `a` at a time.
///
/// # Safety
/// `V`'s instructions.
#[inline(always)]
unsafe fn gemm<V: Lanes>(a: &[f32], q: usize, b: &[f32], s: f32, out: &mut [f32]) {
    if q == 0 {
        return;
    }
    let o = b.len() / q;
    for (a, out) in a.chunks(4 * q).zip(out.chunks_mut(4 * o)) {
        // SAFETY: the caller's contract; a holds the rows' q values, out their o.
        unsafe {
            match a.len() / q {
                4 => rows_out::<V, 4>(b, q, o, a, s, out),
                3 => rows_out::<V, 3>(b, q, o, a, s, out),
                2 => rows_out::<V, 2>(b, q, o, a, s, out),
                _ => rows_out::<V, 1>(b, q, o, a, s, out),
            }
        }
    }
}

/// [`SftKernels::lora_backward`]'s four products as [`gemm`]s: `gb = gout·B`, `gin += s·gb·A`,
/// `grad B += goutᵀ·ax`, `grad A += gbᵀ·input` (the portable loops are `y += c·x` over rows of
/// 16 for the rank-wide ones, where a stored row carried each sum from one step to the next).
///
/// # Safety
/// `V`'s instructions.
#[inline(always)]
unsafe fn lora_backward_body<V: Lanes>(LoraBack { a, b, s, gout, ax, x, rows, gin, grads }: LoraBack<'_>) {
    let (m, r) = (rows.len(), ax.len() / rows.len().max(1));
    if r == 0 {
        return;
    }
    let dout = b.len() / r;
    let widened = |v: &[bf16]| v.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
    // SAFETY: the caller's contract; every shape as `gemm` wants it.
    unsafe {
        let mut gb = vec![0.0f32; m * r];
        gemm::<V>(gout, dout, &widened(b), 1.0, &mut gb);
        gemm::<V>(&gb, r, &widened(a), s, gin);
        let Some((ga, gbm, scale)) = grads else { return };
        let mut acc = vec![0.0f32; dout * r];
        gemm::<V>(&transposed(gout, m, dout), m, ax, 1.0, &mut acc);
        add_scaled(gbm, &acc, s * scale);
        outer_body::<V>(&gb, x, rows, s * scale, ga);
    }
}

/// [`SftKernels::outer`] as [`gemm`]s of [`OUTER_ROWS`] output rows: `acc = gout[:, rows]ᵀ·x`.
///
/// # Safety
/// `V`'s instructions.
#[inline(always)]
unsafe fn outer_body<V: Lanes>(gout: &[f32], x: &[bf16], rows: &[u32], scale: f32, grad: &mut [bf16]) {
    let m = rows.len();
    let dout = gout.len() / m.max(1);
    if m == 0 || dout == 0 {
        return;
    }
    let din = grad.len() / dout;
    let xw = widen_rows(x, rows, din);
    let gt = transposed(gout, m, dout);
    let mut acc = vec![0.0f32; OUTER_ROWS.min(dout) * din];
    for (ob, grad) in grad.chunks_mut(OUTER_ROWS * din.max(1)).enumerate() {
        let acc = &mut acc[..grad.len()];
        acc.fill(0.0);
        let nb = grad.len() / din.max(1);
        // SAFETY: the caller's contract; `gt`'s rows ob·OUTER_ROWS.. hold m values each.
        unsafe { gemm::<V>(&gt[ob * OUTER_ROWS * m..][..nb * m], m, &xw, 1.0, acc) };
        add_scaled(grad, acc, scale);
    }
}

/// `v` (`[rows, cols]`) transposed.
fn transposed(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0.0f32; v.len()];
    for (i, row) in v.chunks_exact(cols.max(1)).enumerate() {
        for (j, &e) in row.iter().enumerate() {
            t[j * rows + i] = e;
        }
    }
    t
}

/// The AVX2 and AVX-512 instances of the generic kernels.
macro_rules! instances {
    ($($(#[$attr:meta])* $name:ident = $body:ident::<$v:ty>($($arg:ident: $ty:ty),*) with $features:literal;)*) => {$(
        /// # Safety
        #[doc = concat!("The CPU has ", $features, ".")]
        $(#[$attr])*
        #[target_feature(enable = $features)]
        unsafe fn $name($($arg: $ty),*) {
            // SAFETY: forwarded; the features are enabled here.
            unsafe { $body::<$v>($($arg),*) }
        }
    )*};
}

instances! {
    project_avx2 = project_body::<Y>(a: &[bf16], din: usize, x: &[bf16], rows: &[u32], xw: &mut [f32], ax: &mut [f32]) with "avx2,fma";
    #[cfg(vnni_intrinsics)]
    project_avx512 = project_body::<Z>(a: &[bf16], din: usize, x: &[bf16], rows: &[u32], xw: &mut [f32], ax: &mut [f32]) with "avx2,fma,avx512f";
    expand_avx2 = expand_body::<Y>(b: &[bf16], r: usize, ax: &[f32], s: f32, bt: &mut [f32], out: &mut [f32]) with "avx2,fma";
    #[cfg(vnni_intrinsics)]
    expand_avx512 = expand_body::<Z>(b: &[bf16], r: usize, ax: &[f32], s: f32, bt: &mut [f32], out: &mut [f32]) with "avx2,fma,avx512f";
    lora_backward_avx2 = lora_backward_body::<Y>(args: LoraBack<'_>) with "avx2,fma";
    #[cfg(vnni_intrinsics)]
    lora_backward_avx512 = lora_backward_body::<Z>(args: LoraBack<'_>) with "avx2,fma,avx512f";
    outer_avx2 = outer_body::<Y>(gout: &[f32], x: &[bf16], rows: &[u32], scale: f32, grad: &mut [bf16]) with "avx2,fma";
    #[cfg(vnni_intrinsics)]
    outer_avx512 = outer_body::<Z>(gout: &[f32], x: &[bf16], rows: &[u32], scale: f32, grad: &mut [bf16]) with "avx2,fma,avx512f";
}

/// `bt[q][o] = b[o][q]` as f32, 8×8 blocks in registers (element by element, the strided
/// stores took three times the products' time), the edges one by one.
///
/// # Safety
/// AVX2 (inlined into the kernels); `b` `[dout, r]`, `bt` at least `r · dout`.
#[inline(always)]
unsafe fn transpose(b: &[bf16], r: usize, dout: usize, bt: &mut [f32]) {
    let (ob, qb) = (dout / 8 * 8, r / 8 * 8);
    // SAFETY: the caller's contract; o + 8 <= ob <= dout and q + 8 <= qb <= r.
    unsafe {
        for o in (0..ob).step_by(8) {
            for q in (0..qb).step_by(8) {
                let v: [__m256; 8] = core::array::from_fn(|i| widen8(b.as_ptr().add((o + i) * r + q)));
                let t = |lo: bool, x: __m256, y: __m256| {
                    if lo {
                        _mm256_unpacklo_ps(x, y)
                    } else {
                        _mm256_unpackhi_ps(x, y)
                    }
                };
                let t = [
                    t(true, v[0], v[1]),
                    t(false, v[0], v[1]),
                    t(true, v[2], v[3]),
                    t(false, v[2], v[3]),
                    t(true, v[4], v[5]),
                    t(false, v[4], v[5]),
                    t(true, v[6], v[7]),
                    t(false, v[6], v[7]),
                ];
                let u = [
                    _mm256_shuffle_ps::<0x44>(t[0], t[2]),
                    _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
                    _mm256_shuffle_ps::<0x44>(t[1], t[3]),
                    _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
                    _mm256_shuffle_ps::<0x44>(t[4], t[6]),
                    _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
                    _mm256_shuffle_ps::<0x44>(t[5], t[7]),
                    _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
                ];
                for j in 0..4 {
                    _mm256_storeu_ps(
                        bt.as_mut_ptr().add((q + j) * dout + o),
                        _mm256_permute2f128_ps::<0x20>(u[j], u[j + 4]),
                    );
                    _mm256_storeu_ps(
                        bt.as_mut_ptr().add((q + j + 4) * dout + o),
                        _mm256_permute2f128_ps::<0x31>(u[j], u[j + 4]),
                    );
                }
            }
        }
    }
    for o in 0..dout {
        let qs = if o < ob { qb..r } else { 0..r };
        for q in qs {
            bt[q * dout + o] = b[o * r + q].to_f32();
        }
    }
}

/// [`gemm`] for `R` rows (`r`: the summed length, `dout`: the output width): 2 vectors of
/// outputs a step (8 independent sums for 4 rows: with one row's 2 the FMAs' latency was the
/// bound), then 1, then one by one.
///
/// # Safety
/// `V`'s instructions; `ax` `[R, r]`, `out` `[R, dout]`, `bt` `[r, dout]`.
#[inline(always)]
unsafe fn rows_out<V: Lanes, const R: usize>(bt: &[f32], r: usize, dout: usize, ax: &[f32], s: f32, out: &mut [f32]) {
    // SAFETY: the caller's contract; every vector read or written lies below `done <= dout`.
    unsafe {
        let mut done = 0;
        done = outputs::<V, R, 2>(bt, r, dout, ax, s, out, done);
        done = outputs::<V, R, 1>(bt, r, dout, ax, s, out, done);
        for (ax, out) in ax.chunks_exact(r).zip(out.chunks_exact_mut(dout)) {
            for (o, out) in out.iter_mut().enumerate().skip(done) {
                let d = (0..r).fold(0.0f32, |d, q| ax[q].mul_add(bt[q * dout + o], d));
                if d != 0.0 {
                    *out += s * d;
                }
            }
        }
    }
}

/// Outputs `from..` of [`rows_out`] in steps of `W` vectors while whole steps fit; where it
/// stopped.
///
/// # Safety
/// As [`rows_out`].
#[inline(always)]
unsafe fn outputs<V: Lanes, const R: usize, const W: usize>(
    bt: &[f32],
    r: usize,
    dout: usize,
    ax: &[f32],
    s: f32,
    out: &mut [f32],
    from: usize,
) -> usize {
    let step = W * V::N;
    let end = from + (dout - from) / step * step;
    // SAFETY: the caller's contract; o + step <= end <= dout, q < r, j < R.
    unsafe {
        let sv = V::splat(s);
        for o in (from..end).step_by(step) {
            let mut acc = [[V::zero(); W]; R];
            for q in 0..r {
                let w: [V; W] = core::array::from_fn(|h| V::load(bt.as_ptr().add(q * dout + o + h * V::N)));
                for (j, acc) in acc.iter_mut().enumerate() {
                    let c = V::splat(*ax.get_unchecked(j * r + q));
                    for h in 0..W {
                        acc[h] = V::fmadd(c, w[h], acc[h]);
                    }
                }
            }
            for (j, acc) in acc.iter().enumerate() {
                for (h, &acc) in acc.iter().enumerate() {
                    let at = out.as_mut_ptr().add(j * dout + o + h * V::N);
                    V::add_nonzero(V::load(at), sv, acc).store(at);
                }
            }
        }
    }
    end
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    fn bf16s(n: usize, seed: u32) -> Vec<bf16> {
        values(n, seed).into_iter().map(bf16::from_f32).collect()
    }

    /// Against the portable kernels on odd shapes: every row count 1-9 (blocks of 4 and their
    /// remainders), ranks 1-5, 8, 9 and 16 (pairs of A rows and the odd one; B's 8×8
    /// transposes and their edges), widths with and without an 8- or 16-wide tail, both lane
    /// widths (the 16-lane set runs the 8-lane one where AVX-512F is missing), gathered rows with duplicates; a zero B leaves `out`'s bits (a -0.0
    /// too).
    #[test]
    fn the_vector_kernels_agree_with_the_portable_ones() {
        if let Err(missing) = kt_x86::isa::avx2_fma() {
            kt_core::skip_isa!(missing);
            return;
        }
        let mut cases = 0;
        for (din, dout) in [(8, 16), (13, 5), (64, 48), (100, 37)] {
            for r in [1, 2, 3, 4, 5, 8, 9, 16] {
                for m in 1..=9 {
                    let a = bf16s(r * din, (din * r + m) as u32);
                    let x = bf16s(6 * din, 7);
                    let rows: Vec<u32> = (0..m).map(|j| (j * 5 % 6) as u32).collect();
                    let mut xw = vec![0.0; SftKernels::project_scratch(din)];
                    let (mut want, mut got) = (vec![0.0; m * r], vec![0.0; m * r]);
                    (PORTABLE.project)(&a, din, &x, &rows, &mut xw, &mut want);
                    for k in [kernels(), kernels_512()] {
                        (k.project)(&a, din, &x, &rows, &mut xw, &mut got);
                        for (w, g) in want.iter().zip(&got) {
                            assert!((w - g).abs() <= 1e-5 * (din as f32), "project din {din} r {r} m {m}: {w} vs {g}");
                        }
                    }
                    let b = bf16s(dout * r, 11 + m as u32);
                    let base = values(m * dout, 3);
                    let mut bt = vec![0.0; dout * r];
                    let mut want = base.clone();
                    (PORTABLE.expand)(&b, r, &values(m * r, 5), 0.5, &mut bt, &mut want);
                    for k in [kernels(), kernels_512()] {
                        let mut got = base.clone();
                        (k.expand)(&b, r, &values(m * r, 5), 0.5, &mut bt, &mut got);
                        for (w, g) in want.iter().zip(&got) {
                            assert!(
                                (w - g).abs() <= 1e-5 * (r as f32 + 1.0),
                                "expand dout {dout} r {r} m {m}: {w} vs {g}"
                            );
                        }
                        let zero = vec![bf16::ZERO; dout * r];
                        let mut signed = base.clone();
                        signed[0] = -0.0;
                        let mut got = signed.clone();
                        (k.expand)(&zero, r, &values(m * r, 5), 0.5, &mut bt, &mut got);
                        assert!(got.iter().zip(&signed).all(|(g, w)| g.to_bits() == w.to_bits()), "zero B changed out");
                    }
                    cases += 1;
                }
            }
        }
        assert_eq!(cases, 4 * 8 * 9);
    }

    /// SiLU's derivative within 1e-6 relative of the portable one (the exp differs), over
    /// a range that reaches both clamps and a tail; the LoRA backward's within f32 rounding of
    /// the portable one's (rank 3 with odd widths: every product's edges; rank 16: their
    /// vector bodies).
    #[test]
    fn the_backward_kernels_agree_with_the_portable_ones() {
        if let Err(missing) = kt_x86::isa::avx2_fma() {
            kt_core::skip_isa!(missing);
            return;
        }
        let n = 203;
        let g: Vec<f32> = (0..n).map(|i| (i as f32 - 100.0) * 0.93).collect();
        let (u, dh) = (values(n, 8), values(n, 9));
        let mut want = (vec![0.0; n], vec![0.0; n]);
        let mut got = (vec![0.0; n], vec![0.0; n]);
        (PORTABLE.glu_backward)(Glu::SILU, &g, &u, &dh, &mut want.0, &mut want.1);
        (kernels().glu_backward)(Glu::SILU, &g, &u, &dh, &mut got.0, &mut got.1);
        for (w, v) in want.0.iter().chain(&want.1).zip(got.0.iter().chain(&got.1)) {
            assert!((w - v).abs() <= 1e-6 * w.abs().max(1e-3), "{w} vs {v}");
        }
        for (r, din, dout, m) in [(3, 37, 21, 5), (16, 40, 48, 6)] {
            let (a, b, x) = (bf16s(r * din, 1), bf16s(dout * r, 2), bf16s(4 * din, 3));
            let (gout, ax) = (values(m * dout, 4), values(m * r, 5));
            let rows: Vec<u32> = (0..m).map(|j| (j * 3 % 4) as u32).collect();
            let run = |k: &SftKernels| {
                let (mut gin, mut ga, mut gb) = (values(m * din, 6), bf16s(r * din, 7), bf16s(dout * r, 8));
                let grads = Some((&mut ga[..], &mut gb[..], 0.5));
                let args =
                    LoraBack { a: &a, b: &b, s: 2.0, gout: &gout, ax: &ax, x: &x, rows: &rows, gin: &mut gin, grads };
                (k.lora_backward)(args);
                (gin, ga, gb)
            };
            let (want_gin, want_ga, want_gb) = run(&PORTABLE);
            for k in [kernels(), kernels_512()] {
                let (gin, ga, gb) = run(k);
                for (g, w) in gin.iter().zip(&want_gin) {
                    assert!((g - w).abs() <= 1e-4 * (dout as f32), "r {r}: grad input {g} vs {w}");
                }
                for (g, w) in ga.iter().chain(&gb).zip(want_ga.iter().chain(&want_gb)) {
                    // bf16 sums: a last-bit difference in f32 may round to the next bf16.
                    let (g, w) = (g.to_f32(), w.to_f32());
                    assert!((g - w).abs() <= 1e-2 * w.abs().max(1e-2), "r {r}: grad {g} vs {w}");
                }
            }
        }
    }

    /// A matrix's gradient within f32 rounding of the portable one's: output rows below, at and
    /// past a block of [`OUTER_ROWS`] (the last block short), widths with and without a vector
    /// tail, 1-9 rows gathered with duplicates, added to a gradient that is not zero.
    #[test]
    fn the_outer_product_agrees_with_the_portable_one() {
        if let Err(missing) = kt_x86::isa::avx2_fma() {
            kt_core::skip_isa!(missing);
            return;
        }
        for (dout, din) in [(3, 37), (64, 48), (70, 40), (129, 17)] {
            for m in 1..=9 {
                let (gout, x) = (values(m * dout, m as u32), bf16s(5 * din, 2));
                let rows: Vec<u32> = (0..m).map(|j| (j * 3 % 5) as u32).collect();
                let start = bf16s(dout * din, 3);
                let mut want = start.clone();
                (PORTABLE.outer)(&gout, &x, &rows, 0.5, &mut want);
                for k in [kernels(), kernels_512()] {
                    let mut got = start.clone();
                    (k.outer)(&gout, &x, &rows, 0.5, &mut got);
                    for (g, w) in got.iter().zip(&want) {
                        let (g, w) = (g.to_f32(), w.to_f32());
                        assert!((g - w).abs() <= 1e-2 * w.abs().max(1e-2), "{dout}x{din} m {m}: {g} vs {w}");
                    }
                }
            }
        }
    }

    #[test]
    fn the_glu_is_the_row_kernels() {
        if let Err(missing) = kt_x86::isa::avx2_fma() {
            kt_core::skip_isa!(missing);
            return;
        }
        let (width, m) = (40, 3);
        let (g, u) = (values(width * m, 1), values(width * m, 2));
        let mut want = vec![bf16::ZERO; width * m];
        for ((g, u), out) in g.chunks(width).zip(u.chunks(width)).zip(want.chunks_mut(width)) {
            // SAFETY: AVX2 and FMA checked above.
            unsafe { kt_x86::swiglu::glu_row(Glu::SILU, g, u, out) };
        }
        let mut got = vec![bf16::ZERO; width * m];
        (kernels().glu)(Glu::SILU, width, &g, &u, &mut got);
        assert_eq!(got, want);
    }
}
