//! An expert's projections where at least one of them runs on AMX tiles (`kernels::on_amx`),
//! a panel of 32 rows at a time: each matrix's rows against every token (tiles for a type that
//! runs on them, its prepared activations then in the tile layout; the vector kernels for
//! another), then SwiGLU or the copy out. The task's scratch:
//!
//! ```text
//!  | Scratch (vector kernels) | gate Panel | up Panel | Acc | Sums | Block | gate [n][32] | up [n][32] | [n][R] |
//! ```

use core::ops::Range;

use half::bf16;
use kt_core::bias::GateUpBias;
use kt_core::ggml::GgmlType;
use kt_core::mat::MatMut;
use kt_core::swiglu::Glu;
use kt_x86::amx::TileOps;
use kt_x86::panels::{balanced_token_runs, panels_from};
use kt_x86::swiglu::glu_row;

use crate::kernels::on_amx::{self, Acc, Block, Panel, Sums, ACT_BYTES, MAX_TOKENS, PANEL};
use crate::kernels::{Scratch, R};
use crate::matrix::Matrix;

/// A task's scratch for the tile path.
struct Work<'a> {
    panels: [Panel<'a>; 2],
    /// Gate's (or down's) and up's results for the panel, `[token][row]`.
    res: [&'a mut [[f32; PANEL]]; 2],
    room: Room<'a>,
}

/// What computing one panel of one matrix uses.
struct Room<'a> {
    vector: &'a mut Scratch,
    acc: &'a mut Acc,
    sums: &'a mut Sums,
    block: &'a mut Block,
    /// A vector kernel's results for one row tile.
    rows: &'a mut [[f32; R]],
}

/// Bytes of a [`Work`] for `n` tokens, activations of `cols` columns and matrices of types
/// `t` (gate's and up's, or down's twice).
pub fn bytes(n: usize, cols: usize, t: [GgmlType; 2]) -> usize {
    let fixed = size_of::<Scratch>() + size_of::<Acc>() + size_of::<Sums>() + size_of::<Block>();
    fixed + t.iter().map(|&t| on_amx::panel_bytes(t, cols)).sum::<usize>() + 4 * n * (2 * PANEL + R)
}

fn work(bytes: &mut [u8], n: usize, cols: usize, [tg, tu]: [GgmlType; 2]) -> Work<'_> {
    let (vector, rest) = Scratch::from_bytes(bytes);
    let (g, rest) = Panel::from_bytes(rest, tg, cols);
    let (u, rest) = Panel::from_bytes(rest, tu, cols);
    let (acc, rest) = rest.split_at_mut(size_of::<Acc>());
    let (sums, rest) = rest.split_at_mut(size_of::<Sums>());
    let (block, rest) = rest.split_at_mut(size_of::<Block>());
    let (gr, rest) = rest.split_at_mut(4 * n * PANEL);
    let (ur, rest) = rest.split_at_mut(4 * n * PANEL);
    let room = Room {
        vector,
        acc: bytemuck::from_bytes_mut(acc),
        sums: bytemuck::from_bytes_mut(sums),
        block: bytemuck::from_bytes_mut(block),
        rows: bytemuck::cast_slice_mut(&mut rest[..4 * n * R]),
    };
    Work { panels: [g, u], res: [bytemuck::cast_slice_mut(gr), bytemuck::cast_slice_mut(ur)], room }
}

/// One matrix of a task: its packed rows, prepared activations, and whether it runs on tiles.
pub struct Operand<'a> {
    pub m: &'a Matrix,
    pub act: &'a [u8],
    pub tiles: bool,
}

/// Rows `rows` (≤ [`PANEL`]) of `m` against the `n` tokens, into `res[t][..rows.len()]`.
///
/// # Safety
/// `T`'s contract, AVX2, FMA, F16C and (on tiles) AVX-512F present; `m.act` prepared for `m.w`
/// with `n` tokens, in the tile layout iff `m.tiles`.
unsafe fn panel_rows<T: TileOps>(
    tiles: &mut T,
    m: &Operand<'_>,
    rows: Range<usize>,
    n: usize,
    panel: &mut Panel<'_>,
    room: &mut Room<'_>,
    res: &mut [[f32; PANEL]],
) {
    let (w, nr) = (&m.m.w, rows.len());
    let Room { vector, acc, sums, block, rows: out } = room;
    // SAFETY (whole body): the caller's contract.
    unsafe {
        if m.tiles {
            on_amx::unpack(w, rows.start, nr, panel);
            let acts = &m.act[..w.slices * n * ACT_BYTES];
            // The next panel's rows, brought in while the first token block computes.
            let at = (rows.end * w.row_bytes).min(w.data.len());
            let next = &w.data[at..(at + PANEL * w.row_bytes).min(w.data.len())];
            for (t0, nt) in balanced_token_runs(n, MAX_TOKENS) {
                let next = if t0 == 0 { next } else { &[] };
                on_amx::block(tiles, w.t, panel, w.slices, acts, (n, t0, nt), (acc, sums), block, next);
                for (r, b) in res[t0..t0 + nt].iter_mut().zip(block.iter()) {
                    r[..nr].copy_from_slice(&b[..nr]);
                }
            }
        } else if n == 1 {
            m.m.gemv(rows, m.act, &mut res[0][..nr]);
        } else {
            for tile in panels_from(rows.clone(), R) {
                m.m.panel_run(tile.start, tile.len(), m.act, n, out, vector);
                let at = tile.start - rows.start;
                for (r, o) in res.iter_mut().zip(out.iter()) {
                    r[at..at + tile.len()].copy_from_slice(&o[..tile.len()]);
                }
            }
        }
    }
}

/// [`kt_core::Backend::gate_up`] with gate or up (or both) on tiles.
///
/// # Safety
/// As [`panel_rows`], for both operands; `scratch` holds [`bytes`]`(n, cols)`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gate_up<T: TileOps + Default>(
    gate: Operand<'_>,
    up: Operand<'_>,
    rows: Range<usize>,
    glu: Glu,
    bias: Option<GateUpBias<'_>>,
    mut h: MatMut<'_, bf16>,
    scratch: &mut [u8],
) {
    let n = h.rows();
    let types = [gate.m.w.t, up.m.w.t];
    let Work { panels: [mut pg, mut pu], res: [gr, ur], mut room } = work(scratch, n, gate.m.w.cols, types);
    let mut tiles = T::default();
    for panel in panels_from(rows.clone(), PANEL) {
        // SAFETY: the caller's contract.
        unsafe {
            panel_rows(&mut tiles, &gate, panel.clone(), n, &mut pg, &mut room, gr);
            panel_rows(&mut tiles, &up, panel.clone(), n, &mut pu, &mut room, ur);
        }
        let at = panel.start - rows.start;
        for t in 0..n {
            if let Some(b) = bias {
                b.add(panel.start, 0..panel.len(), &mut gr[t], &mut ur[t]);
            }
            // 16 rows at a time, as the vector path's chunks fall (the same values either way).
            for c in panels_from(0..panel.len(), 16) {
                let o = &mut h.row_mut(t)[at + c.start..at + c.end];
                // SAFETY: AVX2 and FMA by the caller's contract.
                unsafe { glu_row(glu, &gr[t][c.clone()], &ur[t][c.clone()], o) };
            }
        }
    }
}

/// [`kt_core::Backend::down`] on tiles.
///
/// # Safety
/// As [`panel_rows`]; `scratch` holds [`bytes`]`(n, cols)`.
pub unsafe fn down<T: TileOps + Default>(
    d: Operand<'_>,
    rows: Range<usize>,
    mut y: MatMut<'_, f32>,
    scratch: &mut [u8],
) {
    let n = y.rows();
    let Work { panels: [mut p, _], res: [res, _], mut room } = work(scratch, n, d.m.w.cols, [d.m.w.t; 2]);
    let mut tiles = T::default();
    for panel in panels_from(rows.clone(), PANEL) {
        // SAFETY: the caller's contract.
        unsafe { panel_rows(&mut tiles, &d, panel.clone(), n, &mut p, &mut room, res) };
        let at = panel.start - rows.start;
        for (t, r) in res[..n].iter().enumerate() {
            y.row_mut(t)[at..at + panel.len()].copy_from_slice(&r[..panel.len()]);
        }
    }
}
