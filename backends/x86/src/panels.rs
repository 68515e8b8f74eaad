//! The walk that hands a task's rows to a kernel: rows `rows` of a matrix cut at multiples of
//! the kernel's panel, each panel with the rows of it the task owns (the first and last may be
//! partial when the task's range does not start or end on a panel boundary), or cut into
//! panels from the task's first row; and a forward's tokens in runs a kernel takes at once
//! (docs/architecture.md's glossary: panel, run).
#![forbid(unsafe_code)]

use core::ops::Range;

/// The rows of one panel a task owns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PanelRows {
    /// The panel's index in the matrix (its first row is `index · panel`).
    pub index: usize,
    /// The matrix rows of this panel the task owns.
    pub rows: Range<usize>,
}

impl PanelRows {
    /// Those rows as offsets inside the panel.
    pub fn in_panel(&self, panel: usize) -> Range<usize> {
        self.rows.start - self.index * panel..self.rows.end - self.index * panel
    }
}

/// The panels of `panel` rows that rows `rows` touch, in order.
pub fn panels(rows: Range<usize>, panel: usize) -> impl Iterator<Item = PanelRows> {
    let panel = panel.max(1);
    let end = if rows.is_empty() { 0 } else { rows.end.div_ceil(panel) };
    (rows.start / panel..end).map(move |index| PanelRows {
        index,
        rows: (index * panel).max(rows.start)..((index + 1) * panel).min(rows.end),
    })
}

/// Rows `rows` cut into panels of `panel` rows counted from `rows.start` (the last may be
/// shorter): for kernels whose panels need not start at multiples of the panel.
pub fn panels_from(rows: Range<usize>, panel: usize) -> impl Iterator<Item = Range<usize>> {
    let panel = panel.max(1);
    rows.clone().step_by(panel).map(move |r0| r0..(r0 + panel).min(rows.end))
}

/// `(first, count)` of each run of at most `max` tokens out of `n`.
pub fn token_runs(n: usize, max: usize) -> impl Iterator<Item = (usize, usize)> {
    let max = max.max(1);
    (0..n).step_by(max).map(move |t0| (t0, max.min(n - t0)))
}

/// `(first, count)` of the fewest runs of at most `max` tokens out of `n`, as even as they go
/// (16 tokens in runs of 12: 8 + 8, not 12 + 4), so no run is left with few tokens to share
/// each weight load.
pub fn balanced_token_runs(n: usize, max: usize) -> impl ExactSizeIterator<Item = (usize, usize)> + Clone {
    let runs = n.div_ceil(max.max(1));
    let (base, extra) = n.checked_div(runs).map_or((0, 0), |b| (b, n % runs));
    (0..runs).map(move |i| (i * base + i.min(extra), base + usize::from(i < extra)))
}

/// Call `$f::<N>(args)` for the run-time token count `$n`, one arm per count listed: kernels
/// take their run's token count as a const generic (so its accumulators are registers), and a
/// backend lists the counts its runs come in. Any other count is a bug of the caller.
///
/// `kt_x86::by_tokens!(nt; 1 2 3; kernel(w, p))` is `match nt { 1 => kernel::<1>(w, p), … }`.
#[macro_export]
macro_rules! by_tokens {
    ($n:expr; $($k:literal)+; $f:ident $args:tt) => {
        match $n {
            $($k => $f::<$k> $args,)+
            n => unreachable!("a run of {n} tokens"),
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panels_cover_the_rows_once_and_align_to_the_panel() {
        for (rows, tile) in [(0..48, 16), (5..37, 16), (3..4, 4), (7..7, 4), (0..10, 1), (13..130, 32)] {
            let tiles: Vec<PanelRows> = panels(rows.clone(), tile).collect();
            let mut next = rows.start;
            for t in &tiles {
                assert_eq!(t.rows.start, next, "{rows:?}/{tile}");
                let inside = t.rows.end > t.rows.start && t.rows.end <= (t.index + 1) * tile;
                assert!(inside && t.rows.start >= t.index * tile, "{rows:?}/{tile}: {t:?}");
                assert!(t.in_panel(tile).end <= tile);
                next = t.rows.end;
            }
            assert_eq!(next, rows.end.max(rows.start), "{rows:?}/{tile}");
        }
        let b: Vec<_> = panels_from(5..16, 4).collect();
        assert_eq!(b, [5..9, 9..13, 13..16]);
        assert_eq!(panels_from(3..3, 4).count(), 0);
        let t: Vec<_> = token_runs(13, 6).collect();
        assert_eq!(t, [(0, 6), (6, 6), (12, 1)]);
        assert_eq!(token_runs(0, 6).count(), 0);
        fn count<const N: usize>(x: usize) -> usize {
            N * 10 + x
        }
        for n in 1..=3 {
            assert_eq!(by_tokens!(n; 1 2 3; count(7)), n * 10 + 7);
        }
        let t: Vec<_> = balanced_token_runs(16, 12).collect();
        assert_eq!(t, [(0, 8), (8, 8)]);
        let t: Vec<_> = balanced_token_runs(25, 12).collect();
        assert_eq!(t, [(0, 9), (9, 8), (17, 8)]);
        assert_eq!(balanced_token_runs(12, 12).collect::<Vec<_>>(), [(0, 12)]);
        assert_eq!(balanced_token_runs(0, 12).count(), 0);
        for n in 0..100 {
            let t: Vec<_> = balanced_token_runs(n, 12).collect();
            assert_eq!(t.iter().map(|r| r.1).sum::<usize>(), n);
            assert!(t.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0 && w[0].1 >= w[1].1 && w[0].1 - w[1].1 <= 1));
            assert!(t.iter().all(|r| r.1 >= 1 && r.1 <= 12));
        }
    }
}
