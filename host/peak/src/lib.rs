//! # kt-peak
//!
//! One thread's instruction peaks: register-only loops of independent chains of the
//! instructions the kernels run on, in inline asm so the compiler cannot hoist their
//! loop-invariant work. `kt bench`'s roofline times them on the pool's threads; the kernels'
//! divan benches time them beside the kernels, so each run carries its own peak.
#![cfg(target_arch = "x86_64")]

/// A loop of one instruction family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loop {
    /// 12 chains of `vfmadd231ps ymm` (2 flops a lane).
    Fma,
    /// 8 chains of `vpmaddubsw → vpmaddwd → vpaddd` on ymm (2 ops a byte pair).
    Int8,
    /// 14 chains of `vpdpbusd` in the widest registers the CPU runs it on ([`VnniForm::best`]).
    Vnni,
    /// 14 chains of `vfmadd231ps zmm`.
    Fma512,
    /// [`Loop::Int8`] on zmm.
    Int8Zmm,
    /// 14 chains of `vdpbf16ps zmm` (a bf16 pair's two products and two adds count 4).
    Bf16Zmm,
}

impl Loop {
    /// Operations one iteration counts, `None` where this CPU lacks the instructions.
    pub fn ops(self) -> Option<u64> {
        let avx2 = is_x86_feature_detected!("avx2");
        Some(match self {
            Loop::Fma if avx2 && is_x86_feature_detected!("fma") => 12 * 8 * 2,
            Loop::Int8 if avx2 => 8 * 32 * 2,
            Loop::Vnni => 14 * VnniForm::best()?.bytes() * 2,
            Loop::Fma512 if avx512() => 14 * 16 * 2,
            Loop::Int8Zmm if avx512() => 8 * 64 * 2,
            Loop::Bf16Zmm if avx512() && is_x86_feature_detected!("avx512bf16") => 14 * 16 * 4,
            _ => return None,
        })
    }

    /// Run `iters` iterations; `false` (having run nothing) where this CPU lacks the
    /// instructions ([`Loop::ops`]).
    pub fn run(self, iters: u64) -> bool {
        if self.ops().is_none() {
            return false;
        }
        // SAFETY (every arm): register-only arithmetic, every register used declared
        // clobbered (the zmm ones by their ymm names, `chains_asm`'s note); the CPU has the
        // instructions (`ops` checked).
        unsafe {
            match self {
                Loop::Fma => fma_avx2(iters),
                Loop::Int8 => int8_avx2(iters),
                Loop::Vnni => vnni(VnniForm::best().expect("ops checked"), iters),
                Loop::Fma512 | Loop::Int8Zmm | Loop::Bf16Zmm => zmm(self, iters),
            }
        }
        true
    }
}

/// Which encoding of `vpdpbusd`, on which registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VnniForm {
    /// AVX-VNNI (VEX), ymm.
    Vex,
    /// AVX512-VNNI with AVX512VL (EVEX), ymm.
    Evex,
    /// AVX512-VNNI (EVEX), zmm.
    Zmm,
}

impl VnniForm {
    /// The widest form this CPU runs (zmm with AVX512-VNNI: nearly twice the 256-bit form with
    /// two 512-bit units), `None` without VNNI.
    pub fn best() -> Option<VnniForm> {
        if is_x86_feature_detected!("avx512vnni") && avx512() {
            return Some(VnniForm::Zmm);
        }
        if is_x86_feature_detected!("avxvnni") {
            return Some(VnniForm::Vex);
        }
        if is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl") {
            return Some(VnniForm::Evex);
        }
        None
    }

    /// Byte pairs one `vpdpbusd` multiplies.
    fn bytes(self) -> u64 {
        if self == VnniForm::Zmm {
            64
        } else {
            32
        }
    }
}

fn avx512() -> bool {
    is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")
}

/// `$iters` rounds of one `$op` (e.g. `vpdpbusd` with its encoding prefix) per accumulator, 14
/// accumulators, on registers `$r` ("ymm" or "zmm"), the two sources set up by `$init8` and
/// `$init9`. The registers are set up and declared clobbered by their ymm names (a VEX write
/// clears the rest of a zmm): zmm operands would need the `avx512f` target feature, stable only
/// from rustc 1.89 (the workspace builds from 1.85), and the function running it never inlines
/// and keeps nothing in the upper halves the zmm loop overwrites (`vzeroupper` clears them after).
macro_rules! chains_asm {
    ($iters:expr, $op:literal, $r:literal) => {
        chains_asm!($iters, $op, $r, "vpcmpeqb ymm8, ymm8, ymm8\nvpabsb ymm8, ymm8", "vmovdqa ymm9, ymm8")
    };
    ($iters:expr, $op:literal, $r:literal, $init8:literal, $init9:literal) => {
        std::arch::asm!(
            "vpxor ymm0, ymm0, ymm0", "vpxor ymm1, ymm1, ymm1", "vpxor ymm2, ymm2, ymm2",
            "vpxor ymm3, ymm3, ymm3", "vpxor ymm4, ymm4, ymm4", "vpxor ymm5, ymm5, ymm5",
            "vpxor ymm6, ymm6, ymm6", "vpxor ymm7, ymm7, ymm7", "vpxor ymm10, ymm10, ymm10",
            "vpxor ymm11, ymm11, ymm11", "vpxor ymm12, ymm12, ymm12", "vpxor ymm13, ymm13, ymm13",
            "vpxor ymm14, ymm14, ymm14", "vpxor ymm15, ymm15, ymm15",
            $init8, $init9,
            "2:",
            concat!($op, " ", $r, "0, ", $r, "8, ", $r, "9"), concat!($op, " ", $r, "1, ", $r, "8, ", $r, "9"),
            concat!($op, " ", $r, "2, ", $r, "8, ", $r, "9"), concat!($op, " ", $r, "3, ", $r, "8, ", $r, "9"),
            concat!($op, " ", $r, "4, ", $r, "8, ", $r, "9"), concat!($op, " ", $r, "5, ", $r, "8, ", $r, "9"),
            concat!($op, " ", $r, "6, ", $r, "8, ", $r, "9"), concat!($op, " ", $r, "7, ", $r, "8, ", $r, "9"),
            concat!($op, " ", $r, "10, ", $r, "8, ", $r, "9"), concat!($op, " ", $r, "11, ", $r, "8, ", $r, "9"),
            concat!($op, " ", $r, "12, ", $r, "8, ", $r, "9"), concat!($op, " ", $r, "13, ", $r, "8, ", $r, "9"),
            concat!($op, " ", $r, "14, ", $r, "8, ", $r, "9"), concat!($op, " ", $r, "15, ", $r, "8, ", $r, "9"),
            "dec {n}",
            "jnz 2b",
            "vzeroupper",
            n = inout(reg) $iters => _,
            out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _, out("ymm4") _, out("ymm5") _,
            out("ymm6") _, out("ymm7") _, out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
            out("ymm12") _, out("ymm13") _, out("ymm14") _, out("ymm15") _,
            options(nostack, nomem),
        )
    };
}

/// 8 independent `vpmaddubsw → vpmaddwd → vpaddd` chains, `$iters` rounds, on registers `$r`
/// ("ymm" or "zmm"; declared by their ymm names, as in `chains_asm`), the 16-bit ones in
/// register 10 made by `$ones` and the byte operands in 8 and 9 by `$bytes` (a zmm needs
/// `vpternlogd` for them: an EVEX compare writes a mask).
macro_rules! int8_chains_asm {
    ($iters:expr, $r:literal, $ones:literal, $bytes:literal) => {
        std::arch::asm!(
            "vpxor ymm0, ymm0, ymm0", "vpxor ymm1, ymm1, ymm1", "vpxor ymm2, ymm2, ymm2",
            "vpxor ymm3, ymm3, ymm3", "vpxor ymm4, ymm4, ymm4", "vpxor ymm5, ymm5, ymm5",
            "vpxor ymm6, ymm6, ymm6", "vpxor ymm7, ymm7, ymm7",
            $ones, $bytes,
            "2:",
            concat!("vpmaddubsw ", $r, "11, ", $r, "8, ", $r, "9"), concat!("vpmaddwd ", $r, "11, ", $r, "11, ", $r, "10"), concat!("vpaddd ", $r, "0, ", $r, "0, ", $r, "11"),
            concat!("vpmaddubsw ", $r, "12, ", $r, "8, ", $r, "9"), concat!("vpmaddwd ", $r, "12, ", $r, "12, ", $r, "10"), concat!("vpaddd ", $r, "1, ", $r, "1, ", $r, "12"),
            concat!("vpmaddubsw ", $r, "13, ", $r, "8, ", $r, "9"), concat!("vpmaddwd ", $r, "13, ", $r, "13, ", $r, "10"), concat!("vpaddd ", $r, "2, ", $r, "2, ", $r, "13"),
            concat!("vpmaddubsw ", $r, "14, ", $r, "8, ", $r, "9"), concat!("vpmaddwd ", $r, "14, ", $r, "14, ", $r, "10"), concat!("vpaddd ", $r, "3, ", $r, "3, ", $r, "14"),
            concat!("vpmaddubsw ", $r, "11, ", $r, "8, ", $r, "9"), concat!("vpmaddwd ", $r, "11, ", $r, "11, ", $r, "10"), concat!("vpaddd ", $r, "4, ", $r, "4, ", $r, "11"),
            concat!("vpmaddubsw ", $r, "12, ", $r, "8, ", $r, "9"), concat!("vpmaddwd ", $r, "12, ", $r, "12, ", $r, "10"), concat!("vpaddd ", $r, "5, ", $r, "5, ", $r, "12"),
            concat!("vpmaddubsw ", $r, "13, ", $r, "8, ", $r, "9"), concat!("vpmaddwd ", $r, "13, ", $r, "13, ", $r, "10"), concat!("vpaddd ", $r, "6, ", $r, "6, ", $r, "13"),
            concat!("vpmaddubsw ", $r, "14, ", $r, "8, ", $r, "9"), concat!("vpmaddwd ", $r, "14, ", $r, "14, ", $r, "10"), concat!("vpaddd ", $r, "7, ", $r, "7, ", $r, "14"),
            "dec {n}",
            "jnz 2b",
            "vzeroupper",
            n = inout(reg) $iters => _,
            out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _, out("ymm4") _, out("ymm5") _,
            out("ymm6") _, out("ymm7") _, out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
            out("ymm12") _, out("ymm13") _, out("ymm14") _,
            options(nostack, nomem),
        )
    };
}

/// `iters` rounds of the 14 `vpdpbusd` chains in `form`.
///
/// # Safety
/// The CPU runs `form`.
#[inline(never)]
unsafe fn vnni(form: VnniForm, iters: u64) {
    // SAFETY: register-only arithmetic; every register used is declared clobbered (the zmm
    // ones by their ymm names, `chains_asm`'s note); the caller's contract.
    unsafe {
        match form {
            VnniForm::Vex => chains_asm!(iters, "{{vex}} vpdpbusd", "ymm"),
            VnniForm::Evex => chains_asm!(iters, "{{evex}} vpdpbusd", "ymm"),
            VnniForm::Zmm => chains_asm!(iters, "vpdpbusd", "zmm"),
        }
    }
}

/// `iters` rounds of a 512-bit loop.
///
/// # Safety
/// The CPU has AVX-512F/BW (and BF16 for [`Loop::Bf16Zmm`]).
#[inline(never)]
unsafe fn zmm(op: Loop, iters: u64) {
    // SAFETY: register-only arithmetic; every register used is declared clobbered by its ymm
    // name (`chains_asm`'s note); the caller's contract.
    unsafe {
        match op {
            // Zeros: no operand or product is subnormal (no microcode assists).
            Loop::Bf16Zmm => chains_asm!(iters, "vdpbf16ps", "zmm", "vpxor ymm8, ymm8, ymm8", "vpxor ymm9, ymm9, ymm9"),
            Loop::Int8Zmm => int8_chains_asm!(
                iters,
                "zmm",
                "vpternlogd zmm10, zmm10, zmm10, 0xff\nvpsrlw zmm10, zmm10, 15",
                "vpternlogd zmm8, zmm8, zmm8, 0xff\nvpabsb zmm8, zmm8\nvmovdqa64 zmm9, zmm8"
            ),
            _ => chains_asm!(iters, "vfmadd231ps", "zmm", "vpxor ymm8, ymm8, ymm8", "vpxor ymm9, ymm9, ymm9"),
        }
    }
}

/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_avx2(iters: u64) {
    // SAFETY: register-only arithmetic; every register used is declared clobbered.
    unsafe {
        std::arch::asm!(
            "vxorps ymm0, ymm0, ymm0", "vxorps ymm1, ymm1, ymm1", "vxorps ymm2, ymm2, ymm2",
            "vxorps ymm3, ymm3, ymm3", "vxorps ymm4, ymm4, ymm4", "vxorps ymm5, ymm5, ymm5",
            "vxorps ymm6, ymm6, ymm6", "vxorps ymm7, ymm7, ymm7", "vxorps ymm8, ymm8, ymm8",
            "vxorps ymm9, ymm9, ymm9", "vxorps ymm10, ymm10, ymm10", "vxorps ymm11, ymm11, ymm11",
            "vxorps ymm12, ymm12, ymm12", "vxorps ymm13, ymm13, ymm13",
            "2:",
            "vfmadd231ps ymm0, ymm12, ymm13", "vfmadd231ps ymm1, ymm12, ymm13",
            "vfmadd231ps ymm2, ymm12, ymm13", "vfmadd231ps ymm3, ymm12, ymm13",
            "vfmadd231ps ymm4, ymm12, ymm13", "vfmadd231ps ymm5, ymm12, ymm13",
            "vfmadd231ps ymm6, ymm12, ymm13", "vfmadd231ps ymm7, ymm12, ymm13",
            "vfmadd231ps ymm8, ymm12, ymm13", "vfmadd231ps ymm9, ymm12, ymm13",
            "vfmadd231ps ymm10, ymm12, ymm13", "vfmadd231ps ymm11, ymm12, ymm13",
            "dec {n}",
            "jnz 2b",
            "vzeroupper",
            n = inout(reg) iters => _,
            out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _, out("ymm4") _, out("ymm5") _,
            out("ymm6") _, out("ymm7") _, out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
            out("ymm12") _, out("ymm13") _,
            options(nostack, nomem),
        );
    }
}

/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
unsafe fn int8_avx2(iters: u64) {
    // SAFETY: register-only arithmetic; every register used is declared clobbered.
    unsafe {
        int8_chains_asm!(
            iters,
            "ymm",
            "vpcmpeqw ymm10, ymm10, ymm10\nvpsrlw ymm10, ymm10, 15", // 16-bit ones
            "vpcmpeqb ymm8, ymm8, ymm8\nvpabsb ymm8, ymm8\nvmovdqa ymm9, ymm8"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_loop_the_cpu_has_runs() {
        for l in [Loop::Fma, Loop::Int8, Loop::Vnni, Loop::Fma512, Loop::Int8Zmm, Loop::Bf16Zmm] {
            assert_eq!(l.run(1000), l.ops().is_some(), "{l:?}");
            if l.ops().is_none() {
                kt_core::skip_isa!(format!("{l:?}'s instructions"));
            }
        }
        // The ymm forms a CPU with AVX512-VNNI never picks.
        if is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl") {
            // SAFETY: the CPU runs the EVEX form (checked).
            unsafe { vnni(VnniForm::Evex, 1000) };
        }
        if is_x86_feature_detected!("avxvnni") {
            // SAFETY: the CPU runs the VEX form (checked).
            unsafe { vnni(VnniForm::Vex, 1000) };
        }
    }
}
