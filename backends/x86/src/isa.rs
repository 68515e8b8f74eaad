//! Run-time ISA detection: the instruction-set flags that matter to MoE kernels, read from
//! CPUID and XCR0 (AMX by hand: `is_x86_feature_detected!` for it is unstable), and the AMX
//! tile permission Linux requires before the first tile instruction.

use std::sync::OnceLock;

/// `(flag, present)` for each flag that matters, in a fixed order (Linux's `/proc/cpuinfo`
/// names).
pub fn flags() -> Vec<(&'static str, bool)> {
    let amx = amx_flags();
    vec![
        ("avx2", is_x86_feature_detected!("avx2")),
        ("fma", is_x86_feature_detected!("fma")),
        ("f16c", is_x86_feature_detected!("f16c")),
        ("avx_vnni", has_avx_vnni()),
        ("avx512f", is_x86_feature_detected!("avx512f")),
        ("avx512bw", is_x86_feature_detected!("avx512bw")),
        ("avx512vl", is_x86_feature_detected!("avx512vl")),
        ("avx512_vnni", is_x86_feature_detected!("avx512vnni")),
        ("avx512vbmi", is_x86_feature_detected!("avx512vbmi")), // Linux spells this one without "_"
        ("avx512_bf16", is_x86_feature_detected!("avx512bf16")),
        ("avx512_fp16", is_x86_feature_detected!("avx512fp16")),
        ("amx_tile", amx[0]),
        ("amx_int8", amx[1]),
        ("amx_bf16", amx[2]),
    ]
}

/// Whether the CPU has AVX2 and FMA, the floor of every x86 backend here.
pub fn avx2_fma() -> Result<(), &'static str> {
    if !is_x86_feature_detected!("avx2") {
        Err("AVX2")
    } else if !is_x86_feature_detected!("fma") {
        Err("FMA")
    } else {
        Ok(())
    }
}

/// AVX-VNNI: CPUID.(7,1):EAX bit 4 (and the AVX state enabled, which AVX2 already needs).
pub(crate) fn has_avx_vnni() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    __cpuid(0).eax >= 7 && __cpuid_count(7, 1).eax & (1 << 4) != 0 && is_x86_feature_detected!("avx2")
}

/// AMX tile/int8/bf16: CPUID.7.0:EDX bits 24/25/22 and the OS enabling tile state (XCR0 17+18).
fn amx_flags() -> [bool; 3] {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    if __cpuid(0).eax < 7 {
        return [false; 3];
    }
    let edx = __cpuid_count(7, 0).edx;
    let osxsave = __cpuid(1).ecx & (1 << 27) != 0;
    let tiles_enabled = osxsave && {
        // SAFETY: XGETBV is available when OSXSAVE is set (checked).
        let xcr0 = unsafe { xgetbv0() };
        xcr0 & (0b11 << 17) == (0b11 << 17)
    };
    let bit = |b: u32| edx & (1 << b) != 0 && tiles_enabled;
    [bit(24), bit(25), bit(22)]
}

/// # Safety
/// The CPU must support XGETBV (CPUID.1:ECX.OSXSAVE).
#[target_feature(enable = "xsave")]
unsafe fn xgetbv0() -> u64 {
    // SAFETY: guaranteed by the caller.
    unsafe { std::arch::x86_64::_xgetbv(0) }
}

/// The CPU's family as CPUID.1 gives it (base family, plus the extended family where the base
/// is 0xF) when its vendor string is AMD's, else `None`: 0x19 is Zen 3 and Zen 4, 0x1A Zen 5.
pub fn amd_family() -> Option<u32> {
    use std::arch::x86_64::__cpuid;
    let v = __cpuid(0);
    // (Compared in place: a forward's first decode asks this, and a forward allocates nothing.)
    if [v.ebx, v.edx, v.ecx].map(u32::to_le_bytes) != [*b"Auth", *b"enti", *b"cAMD"] {
        return None;
    }
    let eax = __cpuid(1).eax;
    let base = (eax >> 8) & 0xF;
    Some(if base == 0xF { base + ((eax >> 20) & 0xFF) } else { base })
}

/// Linux's `arch_prctl` codes for the extended-state permissions, and AMX's tile data state.
const ARCH_GET_XCOMP_PERM: libc::c_long = 0x1022;
const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
const XFEATURE_XTILEDATA: libc::c_long = 18;

/// Ask Linux once per process for the AMX tile state (`ARCH_REQ_XCOMP_PERM`): without it the
/// first tile instruction raises SIGILL. The permission covers every thread of the process, the
/// ones started earlier too. `Err` names what is missing: the CPU's AMX flags, or the kernel's
/// consent (a kernel before 5.16, or a seccomp filter, refuses it); a backend that gets `Err`
/// must not run tile instructions, and another backend serves.
pub fn request_amx() -> Result<(), &'static str> {
    static GRANTED: OnceLock<Result<(), &'static str>> = OnceLock::new();
    *GRANTED.get_or_init(|| {
        if !amx_flags().iter().all(|&f| f) {
            return Err("AMX (amx_tile, amx_int8, amx_bf16 with the OS's tile state)");
        }
        // SAFETY: arch_prctl with these codes only reads or sets the process's permissions.
        let asked = unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) };
        if asked != 0 || !amx_permitted() {
            return Err("the kernel's permission for AMX tile state (ARCH_REQ_XCOMP_PERM)");
        }
        Ok(())
    })
}

/// Whether the process holds the AMX tile permission now (`ARCH_GET_XCOMP_PERM`).
pub fn amx_permitted() -> bool {
    let mut mask: u64 = 0;
    // SAFETY: the kernel writes one u64 of feature bits to `mask`.
    let r = unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &mut mask as *mut u64) };
    r == 0 && mask & (1 << XFEATURE_XTILEDATA) != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amx_permission_follows_the_cpu() {
        let has = |f: &str| flags().iter().any(|&(n, on)| n == f && on);
        let amx = has("amx_tile") && has("amx_int8") && has("amx_bf16");
        match request_amx() {
            Ok(()) => {
                assert!(amx, "granted without the AMX flags");
                assert!(amx_permitted(), "granted, but ARCH_GET_XCOMP_PERM lacks the tile state");
            }
            Err(why) if !amx => {
                assert!(why.contains("AMX"), "{why}");
                kt_core::skip_isa!("AMX (the granted path)");
            }
            Err(why) => eprintln!("this kernel refused AMX tile state: {why}"),
        }
    }

    #[test]
    fn amd_family_reads_cpuinfo() {
        // /proc/cpuinfo's "vendor_id" and "cpu family" (decimal) come from the same CPUID leaves.
        let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else {
            eprintln!("skipped: no /proc/cpuinfo to compare with");
            return;
        };
        let field = |k: &str| {
            info.lines().find(|l| l.starts_with(k)).and_then(|l| l.split(':').nth(1)).map(|v| v.trim().to_string())
        };
        let expected = match field("vendor_id").as_deref() {
            Some("AuthenticAMD") => field("cpu family").and_then(|f| f.parse().ok()),
            _ => None,
        };
        assert_eq!(amd_family(), expected);
    }

    #[test]
    fn vnni_encoding_needs_its_flags() {
        let has = |f: &str| flags().iter().any(|&(n, on)| n == f && on);
        match crate::vnni::detect() {
            Some(crate::vnni::Vnni::Evex) => assert!(has("avx512_vnni") && has("avx512vl") && has("avx512bw")),
            Some(crate::vnni::Vnni::Vex) => assert!(has("avx_vnni")),
            None => assert!(!has("avx512_vnni") || !cfg!(vnni_intrinsics), "AVX512-VNNI present, not found"),
        }
    }
}
