//! The AMX tile seam: the few tile instructions the kernels use, behind [`TileOps`], with two
//! implementations: [`Amx`], the instructions themselves through `asm!` (their intrinsics and
//! target features are unstable), and [`Emulator`], a scalar model of them, so the tile loops,
//! layouts and edge cases (short last blocks, odd token counts) are tested on CPUs without AMX.
//! Shared here by the two backends with tile kernels (`amx` for KT's formats, `llamafile` for
//! GGML's), so a thread's tile configuration is tracked in one place whichever ran last.
//!
//! ```text
//!  tile t: rows(t) × colsb(t) bytes (≤ 16 × 64), set by a 64-byte configuration (palette 1)
//!  tdpbusd  c, a, b:  c[m][n] (i32) += Σ_k Σ_i a[m][4k+i] (u8) · b[k][4n+i] (i8)
//!  tdpbssd  c, a, b:  the same with a signed
//!  tdpbf16ps c, a, b: c[m][n] (f32) += Σ_k (a[m][2k]·b[k][2n] + a[m][2k+1]·b[k][2n+1])
//! ```
//!
//! Tile registers are named by const generics (0-7): the instruction text holds the number.

use core::arch::asm;
use std::cell::Cell;

/// Most rows of a tile, and bytes of one of its rows.
pub const ROWS: usize = 16;
/// Bytes of a tile row.
pub const COLSB: usize = 64;

/// A palette-1 tile configuration: the shape of each of the 8 tiles (memory layout as
/// `ldtilecfg` reads it: byte 0 palette, 16-31 bytes per row as u16, 48-55 rows).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(C, align(64))]
pub struct TileConfig([u8; 64]);

impl TileConfig {
    /// Every tile unused.
    pub const fn new() -> Self {
        let mut b = [0u8; 64];
        b[0] = 1;
        TileConfig(b)
    }

    /// Tile `t` holds `rows` rows of `colsb` bytes.
    pub const fn with(mut self, t: usize, rows: usize, colsb: usize) -> Self {
        assert!(t < 8 && rows <= ROWS && colsb <= COLSB);
        self.0[16 + 2 * t] = colsb as u8;
        self.0[48 + t] = rows as u8;
        self
    }

    /// The kernels' 2×2 block for `tokens` (≤ 32) tokens stepping `k` bytes of K: C0-C3 the
    /// token halves × two 16-column halves (64-byte rows), A4 and A5 the token halves' `k`
    /// bytes each, B6 and B7 `k / 4` rows of 64 bytes; the second token half's tiles only
    /// when there is one.
    pub const fn block(tokens: usize, k: usize) -> Self {
        let (h0, h1) = (if tokens < ROWS { tokens } else { ROWS }, tokens.saturating_sub(ROWS));
        let c = Self::new().with(0, h0, COLSB).with(1, h0, COLSB).with(4, h0, k);
        let c = c.with(6, k / 4, COLSB).with(7, k / 4, COLSB);
        match h1 {
            0 => c,
            _ => c.with(2, h1, COLSB).with(3, h1, COLSB).with(5, h1, k),
        }
    }

    /// Rows of tile `t`.
    pub fn rows(&self, t: usize) -> usize {
        usize::from(self.0[48 + t])
    }

    /// Bytes per row of tile `t`.
    pub fn colsb(&self, t: usize) -> usize {
        usize::from(self.0[16 + 2 * t])
    }
}

impl Default for TileConfig {
    fn default() -> Self {
        Self::new()
    }
}

/// The tile instructions the kernels use. Loads and stores move `rows(t)` rows of `colsb(t)`
/// bytes, row `r` at `p + r·stride`.
///
/// # Safety
/// Every method is `unsafe`: the implementation's CPU contract ([`Amx`]: AMX with the tile
/// permission granted) and, for loads and stores, `rows(t)` rows of `colsb(t)` bytes readable
/// (writable) at `p + r·stride`; the operands' shapes must agree as the instruction requires.
pub trait TileOps {
    /// Make `cfg` the tile configuration (a no-op when it already is).
    ///
    /// # Safety
    /// The trait's contract.
    unsafe fn config(&mut self, cfg: &TileConfig);
    /// Tile `T` = 0.
    ///
    /// # Safety
    /// The trait's contract.
    unsafe fn zero<const T: u8>(&mut self);
    /// Load tile `T` from `p` with `stride` bytes between rows.
    ///
    /// # Safety
    /// The trait's contract.
    unsafe fn load<const T: u8>(&mut self, p: *const u8, stride: usize);
    /// Store tile `T` to `p` with `stride` bytes between rows.
    ///
    /// # Safety
    /// The trait's contract.
    unsafe fn store<const T: u8>(&mut self, p: *mut u8, stride: usize);
    /// `C += A (u8) · B (i8)` in i32.
    ///
    /// # Safety
    /// The trait's contract.
    unsafe fn dpbusd<const C: u8, const A: u8, const B: u8>(&mut self);
    /// `C += A (i8) · B (i8)` in i32.
    ///
    /// # Safety
    /// The trait's contract.
    unsafe fn dpbssd<const C: u8, const A: u8, const B: u8>(&mut self);
    /// `C += A (bf16) · B (bf16)` in f32.
    ///
    /// # Safety
    /// The trait's contract.
    unsafe fn dpbf16ps<const C: u8, const A: u8, const B: u8>(&mut self);
}

thread_local! {
    /// The configuration this thread's tiles hold (`None`: released or never set).
    static CONFIGURED: Cell<Option<TileConfig>> = const { Cell::new(None) };
}

/// The AMX instructions. Each thread's configuration is tracked, so `config` with the shape
/// the thread already holds costs nothing; [`release`] returns the tile state to the OS's
/// initial one (what a worker does before it parks, so a context switch saves no tile data).
#[derive(Clone, Copy, Debug, Default)]
pub struct Amx;

impl TileOps for Amx {
    #[inline]
    unsafe fn config(&mut self, cfg: &TileConfig) {
        if CONFIGURED.get() != Some(*cfg) {
            // SAFETY: AMX present and permitted (the trait's contract); `cfg` is 64 readable
            // bytes, declared read by the asm (ggml's `_tile_loadconfig` under GCC 12 let the
            // compiler drop the stores of the configuration, and the first tile op trapped).
            unsafe { asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly, preserves_flags)) };
            CONFIGURED.set(Some(*cfg));
        }
    }

    #[inline(always)]
    unsafe fn zero<const T: u8>(&mut self) {
        // SAFETY: the trait's contract.
        unsafe { asm!("tilezero tmm{t}", t = const T, options(nomem, nostack, preserves_flags)) };
    }

    #[inline(always)]
    unsafe fn load<const T: u8>(&mut self, p: *const u8, stride: usize) {
        // SAFETY: the trait's contract.
        unsafe {
            asm!("tileloadd tmm{t}, [{p} + {s}*1]", t = const T, p = in(reg) p, s = in(reg) stride,
                options(nostack, readonly, preserves_flags))
        };
    }

    #[inline(always)]
    unsafe fn store<const T: u8>(&mut self, p: *mut u8, stride: usize) {
        // SAFETY: the trait's contract.
        unsafe {
            asm!("tilestored [{p} + {s}*1], tmm{t}", t = const T, p = in(reg) p, s = in(reg) stride,
                options(nostack, preserves_flags))
        };
    }

    #[inline(always)]
    unsafe fn dpbusd<const C: u8, const A: u8, const B: u8>(&mut self) {
        // SAFETY: the trait's contract.
        unsafe {
            asm!("tdpbusd tmm{c}, tmm{a}, tmm{b}", c = const C, a = const A, b = const B,
                options(nomem, nostack, preserves_flags))
        };
    }

    #[inline(always)]
    unsafe fn dpbssd<const C: u8, const A: u8, const B: u8>(&mut self) {
        // SAFETY: the trait's contract.
        unsafe {
            asm!("tdpbssd tmm{c}, tmm{a}, tmm{b}", c = const C, a = const A, b = const B,
                options(nomem, nostack, preserves_flags))
        };
    }

    #[inline(always)]
    unsafe fn dpbf16ps<const C: u8, const A: u8, const B: u8>(&mut self) {
        // SAFETY: the trait's contract.
        unsafe {
            asm!("tdpbf16ps tmm{c}, tmm{a}, tmm{b}", c = const C, a = const A, b = const B,
                options(nomem, nostack, preserves_flags))
        };
    }
}

/// One whole-tile product `C += A · B` from 16-row, 64-byte-stride tiles (A's rows `4·kd`
/// bytes, B `kd` rows), returning C after: `op` 0 `tdpbf16ps`, 1 `tdpbusd`, 2 `tdpbssd` (the
/// codes of `examples/tile_dump.rs`'s records, which the emulator is checked against).
///
/// # Safety
/// `T`'s contract ([`Amx`]: AMX present and permitted); `1 ≤ kd ≤ 16`.
pub unsafe fn product<T: TileOps>(
    t: &mut T,
    op: u8,
    kd: usize,
    a: &[u8; 1024],
    b: &[u8; 1024],
    c: &[u8; 1024],
) -> [u8; 1024] {
    let cfg = TileConfig::new().with(0, ROWS, COLSB).with(1, ROWS, 4 * kd).with(2, kd, COLSB);
    let mut after = [0u8; 1024];
    // SAFETY: every tile is 16 rows of 64 bytes at a 64-byte stride; the rest is the caller's.
    unsafe {
        t.config(&cfg);
        t.load::<0>(c.as_ptr(), COLSB);
        t.load::<1>(a.as_ptr(), COLSB);
        t.load::<2>(b.as_ptr(), COLSB);
        match op {
            0 => t.dpbf16ps::<0, 1, 2>(),
            1 => t.dpbusd::<0, 1, 2>(),
            _ => t.dpbssd::<0, 1, 2>(),
        }
        t.store::<0>(after.as_mut_ptr(), COLSB);
    }
    after
}

/// Where the tile instructions come from, and whether this CPU has them.
pub trait Tiles: TileOps + Default + 'static {
    /// `Ok` if the tiles can run here (for the hardware: the CPU's flags and Linux's
    /// permission, asked once per process), else what is missing.
    fn available() -> Result<(), &'static str>;
}

impl Tiles for Amx {
    fn available() -> Result<(), &'static str> {
        crate::isa::request_amx()
    }
}

impl Tiles for Emulator {
    fn available() -> Result<(), &'static str> {
        Ok(())
    }
}

#[cfg(all(feature = "tile-floor", not(vnni_intrinsics)))]
compile_error!("the tile-floor feature needs rustc 1.89 or later (its 512-bit intrinsics)");
#[cfg(feature = "tile-floor")]
mod floor;
#[cfg(feature = "tile-floor")]
pub use floor::Floor;

/// The tiles the backends' hardware instances run: [`Amx`], or with the `tile-floor`
/// feature `Floor` (products that do nothing, for measuring the rest; wrong results).
#[cfg(not(feature = "tile-floor"))]
pub type Hardware = Amx;
/// The tiles the backends' hardware instances run: [`Amx`], or with the `tile-floor`
/// feature `Floor` (products that do nothing, for measuring the rest; wrong results).
#[cfg(feature = "tile-floor")]
pub type Hardware = Floor;

/// Whether the [`Hardware`] tiles run here (for [`Amx`]: the CPU's flags and Linux's
/// permission), else what is missing.
pub fn hardware_available() -> Result<(), &'static str> {
    Hardware::available()
}

/// `KT_AMX_TILE_FROM`: tokens per expert from which every format runs on tiles, in place of
/// the backends' measured thresholds (for the benchmark that measures them); read once.
pub fn tile_from_env() -> Option<usize> {
    static FROM: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *FROM.get_or_init(|| std::env::var("KT_AMX_TILE_FROM").ok().and_then(|v| v.parse().ok()).map(|n: usize| n.max(1)))
}

/// Tokens per expert from which an expert runs on tiles (None: never, its vector kernels
/// always): a backend instance's own threshold `fixed` (the tests' instances), or for 0
/// `KT_AMX_TILE_FROM` if set, else its format's measured threshold `measured`.
pub fn tile_from(fixed: usize, measured: Option<usize>) -> Option<usize> {
    match fixed {
        0 => tile_from_env().or(measured),
        fixed => Some(fixed),
    }
}

/// Release this thread's tiles (`tilerelease`) if it configured them: the tile state returns to
/// its initial one, which context switches do not save. Costs nothing on a thread that holds
/// none (and so on a CPU without AMX).
pub fn release() {
    if CONFIGURED.take().is_some() {
        // SAFETY: a configuration was loaded on this thread, so AMX is present and permitted.
        unsafe { asm!("tilerelease", options(nomem, nostack, preserves_flags)) };
    }
}

/// A scalar model of the tile registers and instructions, for tests on any CPU. Its integer
/// results are the hardware's exactly. For `tdpbf16ps` it follows what the hardware was
/// recorded doing (`backends/amx/tests/data`, a Sapphire Rapids-class Xeon), not the SDM's
/// pseudo-code (two rounded additions per pair): each pair's two products are summed with one
/// rounding, then added to C; a product with a zero or denormal factor is +0, one below the
/// normal range is a zero of its sign, C's denormals are zeros of theirs. That gives the
/// hardware's bits for one pair (K = 4 bytes); over more pairs the hardware sums in an order of
/// its own (neither sequential nor one rounding per K), so longer bf16 products agree to
/// rounding only.
#[derive(Clone)]
pub struct Emulator {
    cfg: TileConfig,
    tiles: [[u8; ROWS * COLSB]; 8],
}

impl Default for Emulator {
    fn default() -> Self {
        Emulator { cfg: TileConfig::new(), tiles: [[0; ROWS * COLSB]; 8] }
    }
}

impl Emulator {
    /// `rows(t)`, `colsb(t)`, checked configured (the hardware raises #UD otherwise).
    fn shape(&self, t: u8) -> (usize, usize) {
        let (r, c) = (self.cfg.rows(usize::from(t)), self.cfg.colsb(usize::from(t)));
        assert!(r > 0 && c > 0, "tile {t} used but not configured");
        (r, c)
    }

    fn i32_at(&self, t: u8, m: usize, n: usize) -> i32 {
        let at = m * COLSB + 4 * n;
        i32::from_le_bytes(self.tiles[usize::from(t)][at..at + 4].try_into().unwrap())
    }

    fn put(&mut self, t: u8, m: usize, n: usize, v: [u8; 4]) {
        let at = m * COLSB + 4 * n;
        self.tiles[usize::from(t)][at..at + 4].copy_from_slice(&v);
    }

    /// The shapes of C, A, B checked as the hardware checks them; (M, K in dwords, N).
    fn dims(&self, c: u8, a: u8, b: u8) -> (usize, usize, usize) {
        let ((cr, cc), (ar, ac), (br, bc)) = (self.shape(c), self.shape(a), self.shape(b));
        assert!(cr == ar && cc == bc && ac == 4 * br, "tile shapes disagree: C {cr}x{cc}, A {ar}x{ac}, B {br}x{bc}");
        (cr, br, cc / 4)
    }

    /// `C += A · B` in i32, A's bytes read by `a_value`, B's signed (products exact, the sum
    /// wrapping as the hardware's does).
    fn int8_product<const C: u8, const A: u8, const B: u8>(&mut self, a_value: impl Fn(u8) -> i32) {
        let (mm, kk, nn) = self.dims(C, A, B);
        let (a, b) = (self.tiles[usize::from(A)], self.tiles[usize::from(B)]);
        for m in 0..mm {
            for n in 0..nn {
                let mut acc = self.i32_at(C, m, n);
                for k in 0..kk {
                    for i in 0..4 {
                        let x = a_value(a[m * COLSB + 4 * k + i]);
                        let w = i32::from(b[k * COLSB + 4 * n + i] as i8);
                        acc = acc.wrapping_add(x * w);
                    }
                }
                self.put(C, m, n, acc.to_le_bytes());
            }
        }
    }
}

/// The product of two bf16 (exact in f32) as `tdpbf16ps` forms it: +0 when either is zero or
/// denormal, a zero of its sign below the normal range.
fn bf16_product(a: u16, b: u16) -> f32 {
    if a & 0x7f80 == 0 || b & 0x7f80 == 0 {
        return 0.0;
    }
    ftz(f32::from_bits(u32::from(a) << 16) * f32::from_bits(u32::from(b) << 16))
}

/// `f` with a denormal flushed to zero (keeping the sign).
fn ftz(f: f32) -> f32 {
    if f.is_subnormal() {
        f32::from_bits(f.to_bits() & 0x8000_0000)
    } else {
        f
    }
}

impl TileOps for Emulator {
    unsafe fn config(&mut self, cfg: &TileConfig) {
        // ldtilecfg zeroes every tile.
        *self = Emulator { cfg: *cfg, ..Emulator::default() };
    }

    unsafe fn zero<const T: u8>(&mut self) {
        self.shape(T);
        self.tiles[usize::from(T)].fill(0);
    }

    unsafe fn load<const T: u8>(&mut self, p: *const u8, stride: usize) {
        let (rows, colsb) = self.shape(T);
        let tile = &mut self.tiles[usize::from(T)];
        tile.fill(0);
        for r in 0..rows {
            // SAFETY: the trait's contract: rows × colsb readable at p + r·stride.
            let src = unsafe { core::slice::from_raw_parts(p.add(r * stride), colsb) };
            tile[r * COLSB..r * COLSB + colsb].copy_from_slice(src);
        }
    }

    unsafe fn store<const T: u8>(&mut self, p: *mut u8, stride: usize) {
        let (rows, colsb) = self.shape(T);
        for r in 0..rows {
            // SAFETY: the trait's contract: rows × colsb writable at p + r·stride.
            let dst = unsafe { core::slice::from_raw_parts_mut(p.add(r * stride), colsb) };
            dst.copy_from_slice(&self.tiles[usize::from(T)][r * COLSB..r * COLSB + colsb]);
        }
    }

    unsafe fn dpbusd<const C: u8, const A: u8, const B: u8>(&mut self) {
        self.int8_product::<C, A, B>(i32::from);
    }

    unsafe fn dpbssd<const C: u8, const A: u8, const B: u8>(&mut self) {
        self.int8_product::<C, A, B>(|x| i32::from(x as i8));
    }

    unsafe fn dpbf16ps<const C: u8, const A: u8, const B: u8>(&mut self) {
        let (mm, kk, nn) = self.dims(C, A, B);
        let (a, b) = (self.tiles[usize::from(A)], self.tiles[usize::from(B)]);
        let h = |t: &[u8; ROWS * COLSB], at: usize| u16::from_le_bytes([t[at], t[at + 1]]);
        for m in 0..mm {
            for n in 0..nn {
                let mut acc = ftz(f32::from_bits(self.i32_at(C, m, n) as u32));
                for k in 0..kk {
                    let p = |i: usize| bf16_product(h(&a, m * COLSB + 4 * k + 2 * i), h(&b, k * COLSB + 4 * n + 2 * i));
                    acc = ftz(acc + ftz(p(0) + p(1)));
                }
                self.put(C, m, n, acc.to_bits().to_le_bytes());
            }
        }
    }
}
