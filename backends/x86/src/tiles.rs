//! The walk that hands a task's rows to a kernel: rows `rows` of a matrix cut at multiples of
//! the kernel's row tile, each tile with the rows of it the task owns (the first and last may
//! be partial when the task's range does not start or end on a tile boundary), or cut into
//! tiles from the task's first row; and a forward's tokens in runs a kernel takes at once.
#![forbid(unsafe_code)]

use core::ops::Range;

/// One row tile of a task.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowTile {
    /// The tile's index in the matrix (its first row is `index · tile`).
    pub index: usize,
    /// The matrix rows of this tile the task owns.
    pub rows: Range<usize>,
}

impl RowTile {
    /// Those rows as offsets inside the tile.
    pub fn in_tile(&self, tile: usize) -> Range<usize> {
        self.rows.start - self.index * tile..self.rows.end - self.index * tile
    }
}

/// The tiles of `tile` rows that rows `rows` touch, in order.
pub fn row_tiles(rows: Range<usize>, tile: usize) -> impl Iterator<Item = RowTile> {
    let tile = tile.max(1);
    let end = if rows.is_empty() { 0 } else { rows.end.div_ceil(tile) };
    (rows.start / tile..end)
        .map(move |index| RowTile { index, rows: (index * tile).max(rows.start)..((index + 1) * tile).min(rows.end) })
}

/// Rows `rows` cut into blocks of `tile` rows counted from `rows.start` (the last may be
/// shorter): for kernels whose tiles need not start at multiples of the tile.
pub fn row_blocks(rows: Range<usize>, tile: usize) -> impl Iterator<Item = Range<usize>> {
    let tile = tile.max(1);
    rows.clone().step_by(tile).map(move |r0| r0..(r0 + tile).min(rows.end))
}

/// `(first, count)` of each run of at most `max` tokens out of `n`.
pub fn token_tiles(n: usize, max: usize) -> impl Iterator<Item = (usize, usize)> {
    let max = max.max(1);
    (0..n).step_by(max).map(move |t0| (t0, max.min(n - t0)))
}

/// `(first, count)` of the fewest runs of at most `max` tokens out of `n`, as even as they go
/// (16 tokens in tiles of 12: 8 + 8, not 12 + 4), so no run is left with few tokens to share
/// each weight load.
pub fn balanced_token_tiles(n: usize, max: usize) -> impl Iterator<Item = (usize, usize)> {
    let runs = n.div_ceil(max.max(1));
    let (base, extra) = n.checked_div(runs).map_or((0, 0), |b| (b, n % runs));
    (0..runs).map(move |i| (i * base + i.min(extra), base + usize::from(i < extra)))
}

/// Call `$f::<N>(args)` for the run-time token count `$n`, one arm per count listed: kernels
/// take their tile's token count as a const generic (so its accumulators are registers), and a
/// backend lists the counts its tiles come in. Any other count is a bug of the caller.
///
/// `kt_x86::by_tokens!(nt; 1 2 3; kernel(w, p))` is `match nt { 1 => kernel::<1>(w, p), … }`.
#[macro_export]
macro_rules! by_tokens {
    ($n:expr; $($k:literal)+; $f:ident $args:tt) => {
        match $n {
            $($k => $f::<$k> $args,)+
            n => unreachable!("a tile of {n} tokens"),
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_cover_the_rows_once_and_align_to_the_tile() {
        for (rows, tile) in [(0..48, 16), (5..37, 16), (3..4, 4), (7..7, 4), (0..10, 1), (13..130, 32)] {
            let tiles: Vec<RowTile> = row_tiles(rows.clone(), tile).collect();
            let mut next = rows.start;
            for t in &tiles {
                assert_eq!(t.rows.start, next, "{rows:?}/{tile}");
                let inside = t.rows.end > t.rows.start && t.rows.end <= (t.index + 1) * tile;
                assert!(inside && t.rows.start >= t.index * tile, "{rows:?}/{tile}: {t:?}");
                assert!(t.in_tile(tile).end <= tile);
                next = t.rows.end;
            }
            assert_eq!(next, rows.end.max(rows.start), "{rows:?}/{tile}");
        }
        let b: Vec<_> = row_blocks(5..16, 4).collect();
        assert_eq!(b, [5..9, 9..13, 13..16]);
        assert_eq!(row_blocks(3..3, 4).count(), 0);
        let t: Vec<_> = token_tiles(13, 6).collect();
        assert_eq!(t, [(0, 6), (6, 6), (12, 1)]);
        assert_eq!(token_tiles(0, 6).count(), 0);
        fn count<const N: usize>(x: usize) -> usize {
            N * 10 + x
        }
        for n in 1..=3 {
            assert_eq!(by_tokens!(n; 1 2 3; count(7)), n * 10 + 7);
        }
        let t: Vec<_> = balanced_token_tiles(16, 12).collect();
        assert_eq!(t, [(0, 8), (8, 8)]);
        let t: Vec<_> = balanced_token_tiles(25, 12).collect();
        assert_eq!(t, [(0, 9), (9, 8), (17, 8)]);
        assert_eq!(balanced_token_tiles(12, 12).collect::<Vec<_>>(), [(0, 12)]);
        assert_eq!(balanced_token_tiles(0, 12).count(), 0);
        for n in 0..100 {
            let t: Vec<_> = balanced_token_tiles(n, 12).collect();
            assert_eq!(t.iter().map(|r| r.1).sum::<usize>(), n);
            assert!(t.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0 && w[0].1 >= w[1].1 && w[0].1 - w[1].1 <= 1));
            assert!(t.iter().all(|r| r.1 >= 1 && r.1 <= 12));
        }
    }
}
