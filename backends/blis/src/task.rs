//! A task of the blis backend: the matrices it runs (gate and up, or down alone), their
//! activations, its tokens and rows, and its room in the worker's scratch.

use core::ops::Range;

use crate::act::Act;
use crate::library::Library;
use crate::matrix::Matrix;

/// Rows `rows` of the matrices `ms` against their activations `acts` of `n` tokens, in `room`.
pub struct Task<'t, 'a, 'r, const N: usize> {
    /// The library whose microkernel and block sizes the matrices were packed for.
    pub lib: &'t Library,
    /// The matrices.
    pub ms: [&'t Matrix; N],
    /// Their activations.
    pub acts: [&'t Act<'a>; N],
    /// Tokens.
    pub n: usize,
    /// Rows, from a multiple of NR.
    pub rows: Range<usize>,
    /// The room.
    pub room: &'t mut Room<'r>,
}

/// Tokens whose A micropanels are packed at once (and whose results a panel keeps).
pub fn mc(lib: &Library) -> usize {
    lib.mr * 96usize.div_ceil(lib.mr)
}

/// Floats of one token run's A micropanel, kept a multiple of 16 (64 bytes: the
/// microkernels' aligned loads).
pub fn a_stride(lib: &Library, cols: usize) -> usize {
    (cols * lib.mr).next_multiple_of(16)
}

/// A task's room, for up to two matrices (gate and up, or down alone): their A micropanels,
/// one KC slice of a panel's B micropanel and the results of a panel for MC tokens.
pub struct Room<'a> {
    pub(crate) a: [&'a mut [f32]; 2],
    pub(crate) b: [&'a mut [f32]; 2],
    pub(crate) c: [&'a mut [f32]; 2],
}

/// The next 64-byte-aligned `n` floats of `bytes` and the bytes after them.
fn carve(bytes: &mut [u8], n: usize) -> (&mut [f32], &mut [u8]) {
    let skip = bytes.as_ptr().align_offset(64);
    let (head, rest) = bytes[skip..].split_at_mut((4 * n).next_multiple_of(64));
    (bytemuck::cast_slice_mut(&mut head[..4 * n]), rest)
}

/// Floats of each of a [`Room`]'s parts: (A, B, C).
fn parts(lib: &Library, cols: usize) -> (usize, usize, usize) {
    (mc(lib) / lib.mr * a_stride(lib, cols), lib.kc * lib.nr, mc(lib) * lib.nr)
}

/// Bytes of a [`Room`] for K = `cols`.
pub fn room_bytes(lib: &Library, cols: usize) -> usize {
    let (a, b, c) = parts(lib, cols);
    4 * 2 * (a + b + c) + 7 * 64
}

impl<'a> Room<'a> {
    /// The room in `scratch` (at least [`room_bytes`]).
    pub fn new(lib: &Library, cols: usize, scratch: &'a mut [u8]) -> Room<'a> {
        let (na, nb, nc) = parts(lib, cols);
        let (a0, rest) = carve(scratch, na);
        let (a1, rest) = carve(rest, na);
        let (b0, rest) = carve(rest, nb);
        let (b1, rest) = carve(rest, nb);
        let (c0, rest) = carve(rest, nc);
        let (c1, _) = carve(rest, nc);
        Room { a: [a0, a1], b: [b0, b1], c: [c0, c1] }
    }
}
