//! The tile peaks `kt bench` judges the AMX kernels by: the kernels' own 2×2 block of
//! 16 × 16 × 64-byte tiles with A and B loaded from L1 every step (not tiles kept in registers,
//! which no kernel can do).

use crate::kernels::{step, store_c, BF16, MAX_RUN, US8};
use crate::tile::{Amx, TileConfig, TileOps, COLSB, ROWS};
use kt_zmm::pack::PANEL;

/// Operations of one step: four tile products of 16 × 16 outputs over 64 bytes of K, a
/// multiply and an add per K value: 64 int8 values (`tdpbusd`), or 32 bf16 ones
/// (`tdpbf16ps`, half the operations in the same time).
pub const fn ops_per_step(bf16: bool) -> u64 {
    let k = if bf16 { COLSB / 2 } else { COLSB };
    4 * (ROWS * ROWS * k) as u64 * 2
}

/// Run `steps` steps (`bf16`: `tdpbf16ps`, else `tdpbusd`) on this thread's tiles; `Err` names
/// what the CPU lacks. Multiply the steps by [`ops_per_step`] for the operations done.
pub fn block_steps(bf16: bool, steps: u64) -> Result<(), &'static str> {
    kt_x86::isa::request_amx()?;
    #[repr(align(64))]
    struct Buf([u8; 2 * ROWS * COLSB]);
    let (a, b) = (Buf([1; 2 * ROWS * COLSB]), Buf([1; 2 * ROWS * COLSB]));
    let mut c = [[0u32; PANEL]; MAX_RUN];
    let mut t = Amx;
    // SAFETY: AMX granted (above); A and B hold two 16 × 64-byte tiles each, C four.
    unsafe {
        t.config(&TileConfig::block(MAX_RUN, COLSB));
        for _ in 0..steps {
            if bf16 {
                step::<Amx, BF16>(&mut t, (a.0.as_ptr(), COLSB), (b.0.as_ptr(), ROWS * COLSB, COLSB), true);
            } else {
                step::<Amx, US8>(&mut t, (a.0.as_ptr(), COLSB), (b.0.as_ptr(), ROWS * COLSB, COLSB), true);
            }
        }
        store_c(&mut t, &mut c, true);
    }
    crate::tile::release();
    std::hint::black_box(c);
    Ok(())
}
