//! [`Matrix`]: a matrix as the amx backend packs it, with the kernels chosen for it, once,
//! when it was packed.

use crate::kernels::{tile_kernel, TileRun};
use crate::tile::TileOps;

/// The AVX-512 kernels' matrix (`kt_zmm::Matrix`: its bytes and vector kernel) and, where
/// tiles run it, its tile kernel with the tokens per expert from which it runs on it.
pub struct Matrix<T> {
    /// The packed bytes and the vector kernel, which runs below the tile threshold.
    pub simd: kt_zmm::Matrix,
    tiles: Option<(usize, TileRun<T>)>,
}

impl<T: TileOps> Matrix<T> {
    /// `simd` with its tile kernel, on tiles from `from` tokens (None: never).
    pub fn new(simd: kt_zmm::Matrix, from: Option<usize>) -> Self {
        let tiles = tile_kernel::<T>(&simd.w).and_then(|run| Some((from?, run)));
        Matrix { simd, tiles }
    }
}

impl<T> Matrix<T> {
    /// Its tile kernel where an expert of `n` tokens runs on tiles.
    pub fn on_tiles(&self, n: usize) -> Option<TileRun<T>> {
        self.tiles.and_then(|(from, run)| (n >= from).then_some(run))
    }
}
