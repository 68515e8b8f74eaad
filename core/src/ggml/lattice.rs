//! ggml's lattice ("i-quant") types below 4 bits per weight, as the DeepSeek and Kimi GGUFs of
//! 1.6-3.4 bits use them: each grid index names the levels of 8 columns (iq1, iq2) or 4 (iq3)
//! from a fixed table ([`super::grids`]), with a sign bit per column (iq2, iq3) or a ±1/8
//! shift per 8 or 32 columns (iq1), and a small integer scale per 16 or 32 columns.
//!
//! Every type's value is `d·m·L / 2^SHIFT` for an integer scale `m` and an integer level `L`
//! (the grid level with its sign, or `8·level ± 1` for iq1). gguf-py computes
//! `d·(0.5 + ls)·0.25·level·sign` and the like; powers of two commute with rounding, so
//! `round(round(d·m)·L)·2^-SHIFT` is the same number, bit for bit.

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::grids::{IQ1S_GRID8, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID};
use super::QK_K;

/// A 256-column lattice block as 32 groups of 8 columns.
pub trait Lattice: Pod {
    /// Value = `d · scale · level / 2^SHIFT`.
    const SHIFT: u32;
    /// The largest |level| ([`Lattice::levels`] after signs), for overflow bounds.
    const MAX_LEVEL: u8;
    /// Has sign bits ([`Lattice::signs`] is not always 0); else has a shift
    /// ([`Lattice::shift`]).
    const SIGNS: bool = true;
    /// The f16 super-scale `d`, its bits.
    fn d_bits(&self) -> u16;
    /// The f16 super-scale `d`.
    #[inline]
    fn d(&self) -> f32 {
        f16::from_bits(self.d_bits()).to_f32()
    }
    /// The integer scale `m` of columns `16h..16h + 16`.
    fn scale(&self, h: usize) -> u8;
    /// The levels of columns `8g..8g + 8` before signs and shift, one i8 each (iq1's times 8).
    fn grid(&self, g: usize) -> u64;
    /// Bit k set: column `8g + k` is negated (none for iq1, whose grid carries signs).
    fn signs(&self, g: usize) -> u8;
    /// [`Lattice::signs`] is ggml's even-parity expansion (`ksigns`) of 7 stored bits,
    /// [`Lattice::sign_bits`]: a kernel can then map those bits to its own form in one lookup.
    const EVEN_SIGNS: bool = false;
    /// The 7 stored sign bits of columns `8g..8g + 8` (the low bits; the others are not
    /// cleared) of an [`Lattice::EVEN_SIGNS`] type.
    #[inline]
    fn sign_bits(&self, _g: usize) -> u32 {
        0
    }
    /// Added to each level of columns `8g..8g + 8`: iq1's ±1 (its ±1/8 shift), else 0.
    #[inline]
    fn shift(&self, _g: usize) -> i8 {
        0
    }

    /// The signed levels of columns `8g..8g + 8`.
    #[inline]
    fn levels(&self, g: usize) -> [i8; 8] {
        let (lv, s, a) = (self.grid(g).to_le_bytes(), self.signs(g), self.shift(g));
        core::array::from_fn(|k| if s >> k & 1 == 1 { -(lv[k] as i8) } else { lv[k] as i8 } + a)
    }

    /// The 256 values.
    fn dequantize(&self, y: &mut [f32]) {
        let (d, unit) = (self.d(), 1.0 / (1u32 << Self::SHIFT) as f32);
        for (g, y) in y[..QK_K].chunks_exact_mut(8).enumerate() {
            let dm = d * f32::from(self.scale(g / 2));
            for (y, l) in y.iter_mut().zip(self.levels(g)) {
                *y = dm * f32::from(l) * unit;
            }
        }
    }
}

/// ggml's sign bytes (`ksigns`) of the 128 stored 7-bit fields: the eighth bit makes the
/// count of set bits even. [`Lattice::signs`] reads one; the kernels build theirs from it.
pub const KSIGNS: [u8; 128] = {
    let mut t = [0u8; 128];
    let mut i = 0;
    while i < 128 {
        t[i] = i as u8 | ((i.count_ones() & 1) as u8) << 7;
        i += 1;
    }
    t
};

/// [`KSIGNS`] of the low 7 bits of `i`, from a static: without `popcnt` in the baseline
/// target, `count_ones` is a dozen operations.
#[inline]
fn ksigns(i: u32) -> u8 {
    static TABLE: [u8; 128] = KSIGNS;
    TABLE[(i & 0x7F) as usize]
}

#[inline]
fn u16_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[2 * i], b[2 * i + 1]])
}

#[inline]
fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
}

/// Two 4-level iq3 grid entries as one 8-column group.
#[inline]
fn pair(grid: &[u32], i0: usize, i1: usize) -> u64 {
    u64::from(grid[i0]) | (u64::from(grid[i1]) << 32)
}

/// The `i`-th 4-bit field of `b`, low nibbles first.
#[inline]
fn nibble(b: &[u8], i: usize) -> u32 {
    u32::from(b[i / 2] >> (4 * (i % 2))) & 0xF
}

/// `2·n + 1` for a scale field `n`.
#[inline]
fn odd(n: u32) -> u8 {
    (2 * n + 1) as u8
}

/// iq2_xxs (2.06 bits): per 32 columns 4 grid bytes, then 4 × 7 sign bits and a 4-bit scale.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIq2Xxs {
    /// f16 super-scale.
    pub d: [u8; 2],
    /// 8 × (4 grid indices, a u32 of signs and scale).
    pub qs: [u8; 64],
}

impl Lattice for BlockIq2Xxs {
    const SHIFT: u32 = 3;
    const MAX_LEVEL: u8 = 43;
    fn d_bits(&self) -> u16 {
        u16::from_le_bytes(self.d)
    }
    #[inline]
    fn scale(&self, h: usize) -> u8 {
        odd(u32_at(&self.qs, 2 * (h / 2) + 1) >> 28)
    }
    #[inline]
    fn grid(&self, g: usize) -> u64 {
        IQ2XXS_GRID[usize::from(self.qs[8 * (g / 4) + g % 4])]
    }
    #[inline]
    fn signs(&self, g: usize) -> u8 {
        ksigns(self.sign_bits(g))
    }
    const EVEN_SIGNS: bool = true;
    #[inline]
    fn sign_bits(&self, g: usize) -> u32 {
        u32_at(&self.qs, 2 * (g / 4) + 1) >> (7 * (g % 4))
    }
}

/// iq2_xs (2.31 bits): a u16 per 8 columns (9-bit grid index, 7 sign bits), a 4-bit scale per
/// 16 columns.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIq2Xs {
    /// f16 super-scale.
    pub d: [u8; 2],
    /// 32 little-endian u16.
    pub qs: [u8; 64],
    /// Two scales per byte.
    pub scales: [u8; 8],
}

impl Lattice for BlockIq2Xs {
    const SHIFT: u32 = 3;
    const MAX_LEVEL: u8 = 43;
    fn d_bits(&self) -> u16 {
        u16::from_le_bytes(self.d)
    }
    #[inline]
    fn scale(&self, h: usize) -> u8 {
        odd(nibble(&self.scales, h))
    }
    #[inline]
    fn grid(&self, g: usize) -> u64 {
        IQ2XS_GRID[usize::from(u16_at(&self.qs, g) & 511)]
    }
    #[inline]
    fn signs(&self, g: usize) -> u8 {
        ksigns(self.sign_bits(g))
    }
    const EVEN_SIGNS: bool = true;
    #[inline]
    fn sign_bits(&self, g: usize) -> u32 {
        u32::from(u16_at(&self.qs, g) >> 9)
    }
}

/// iq2_s (2.56 bits): a 10-bit grid index and a sign byte per 8 columns, a 4-bit scale per 16.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIq2S {
    /// f16 super-scale.
    pub d: [u8; 2],
    /// Low 8 bits of the grid indices.
    pub qs: [u8; 32],
    /// Sign bits, a byte per 8 columns.
    pub signs: [u8; 32],
    /// High 2 bits of the grid indices, four per byte.
    pub qh: [u8; 8],
    /// Two scales per byte.
    pub scales: [u8; 8],
}

impl Lattice for BlockIq2S {
    const SHIFT: u32 = 3;
    const MAX_LEVEL: u8 = 43;
    fn d_bits(&self) -> u16 {
        u16::from_le_bytes(self.d)
    }
    #[inline]
    fn scale(&self, h: usize) -> u8 {
        odd(nibble(&self.scales, h))
    }
    #[inline]
    fn grid(&self, g: usize) -> u64 {
        let hi = usize::from(self.qh[g / 4] >> (2 * (g % 4))) & 3;
        IQ2S_GRID[usize::from(self.qs[g]) | hi << 8]
    }
    #[inline]
    fn signs(&self, g: usize) -> u8 {
        self.signs[g]
    }
}

/// iq3_xxs (3.06 bits): a grid byte per 4 columns; per 32 columns 4 × 7 sign bits and a 4-bit
/// scale.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIq3Xxs {
    /// f16 super-scale.
    pub d: [u8; 2],
    /// Grid indices.
    pub qs: [u8; 64],
    /// 8 little-endian u32 of signs and scale.
    pub scales_signs: [u8; 32],
}

impl Lattice for BlockIq3Xxs {
    const SHIFT: u32 = 2;
    const MAX_LEVEL: u8 = 62;
    fn d_bits(&self) -> u16 {
        u16::from_le_bytes(self.d)
    }
    #[inline]
    fn scale(&self, h: usize) -> u8 {
        odd(u32_at(&self.scales_signs, h / 2) >> 28)
    }
    #[inline]
    fn grid(&self, g: usize) -> u64 {
        pair(&IQ3XXS_GRID, usize::from(self.qs[2 * g]), usize::from(self.qs[2 * g + 1]))
    }
    #[inline]
    fn signs(&self, g: usize) -> u8 {
        ksigns(self.sign_bits(g))
    }
    const EVEN_SIGNS: bool = true;
    #[inline]
    fn sign_bits(&self, g: usize) -> u32 {
        u32_at(&self.scales_signs, g / 4) >> (7 * (g % 4))
    }
}

/// iq3_s (3.44 bits): a 9-bit grid index per 4 columns, a sign byte per 8, a 4-bit scale per 32.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIq3S {
    /// f16 super-scale.
    pub d: [u8; 2],
    /// Low 8 bits of the grid indices.
    pub qs: [u8; 64],
    /// Ninth bits of the grid indices, eight per byte.
    pub qh: [u8; 8],
    /// Sign bits, a byte per 8 columns.
    pub signs: [u8; 32],
    /// Two scales per byte.
    pub scales: [u8; 4],
}

impl Lattice for BlockIq3S {
    const SHIFT: u32 = 0;
    const MAX_LEVEL: u8 = 15;
    fn d_bits(&self) -> u16 {
        u16::from_le_bytes(self.d)
    }
    #[inline]
    fn scale(&self, h: usize) -> u8 {
        odd(nibble(&self.scales, h / 2))
    }
    #[inline]
    fn grid(&self, g: usize) -> u64 {
        let i = |j: usize| usize::from(self.qs[j]) | (usize::from(self.qh[j / 8] >> (j % 8)) & 1) << 8;
        pair(&IQ3S_GRID, i(2 * g), i(2 * g + 1))
    }
    #[inline]
    fn signs(&self, g: usize) -> u8 {
        self.signs[g]
    }
}

/// iq1's shift of the levels: -1 or +1 (eighths).
#[inline]
fn iq1_shift(minus: bool) -> i8 {
    if minus {
        -1
    } else {
        1
    }
}

/// iq1_s (1.56 bits): per 32 columns 4 grid bytes and a u16 of their high 3 bits each, a 3-bit
/// scale and the shift's sign.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIq1S {
    /// f16 super-scale.
    pub d: [u8; 2],
    /// Low 8 bits of the grid indices.
    pub qs: [u8; 32],
    /// 8 little-endian u16: 4 × 3 index bits, the scale, the shift's sign (bit 15).
    pub qh: [u8; 16],
}

impl Lattice for BlockIq1S {
    const SHIFT: u32 = 3;
    const MAX_LEVEL: u8 = 9;
    const SIGNS: bool = false;
    fn d_bits(&self) -> u16 {
        u16::from_le_bytes(self.d)
    }
    #[inline]
    fn scale(&self, h: usize) -> u8 {
        odd(u32::from(u16_at(&self.qh, h / 2) >> 12) & 7)
    }
    #[inline]
    fn grid(&self, g: usize) -> u64 {
        let qh = u16_at(&self.qh, g / 4);
        IQ1S_GRID8[usize::from(self.qs[g]) | (usize::from(qh >> (3 * (g % 4))) & 7) << 8]
    }
    #[inline]
    fn signs(&self, _: usize) -> u8 {
        0
    }
    #[inline]
    fn shift(&self, g: usize) -> i8 {
        iq1_shift(u16_at(&self.qh, g / 4) & 0x8000 != 0)
    }
}

/// iq1_m (1.75 bits): per 8 columns a grid byte and a nibble (3 high index bits, the shift's
/// sign); a 3-bit scale per 16 columns; the f16 `d` spread over the scales' top nibbles.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIq1M {
    /// Low 8 bits of the grid indices.
    pub qs: [u8; 32],
    /// A nibble per 8 columns.
    pub qh: [u8; 16],
    /// 4 little-endian u16: 4 × 3 scale bits, and 4 bits of `d`.
    pub scales: [u8; 8],
}

impl Lattice for BlockIq1M {
    const SHIFT: u32 = 3;
    const MAX_LEVEL: u8 = 9;
    const SIGNS: bool = false;
    fn d_bits(&self) -> u16 {
        let w = |i: usize| u16_at(&self.scales, i) & 0xF000;
        (w(0) >> 12) | (w(1) >> 8) | (w(2) >> 4) | w(3)
    }
    #[inline]
    fn scale(&self, h: usize) -> u8 {
        odd(u32::from(u16_at(&self.scales, h / 4) >> (3 * (h % 4))) & 7)
    }
    #[inline]
    fn grid(&self, g: usize) -> u64 {
        let nib = self.qh[g / 2] >> (4 * (g % 2));
        IQ1S_GRID8[usize::from(self.qs[g]) | usize::from(nib & 7) << 8]
    }
    #[inline]
    fn signs(&self, _: usize) -> u8 {
        0
    }
    #[inline]
    fn shift(&self, g: usize) -> i8 {
        iq1_shift(self.qh[g / 2] >> (4 * (g % 2)) & 8 != 0)
    }
}
