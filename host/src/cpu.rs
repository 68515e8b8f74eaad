//! CPU identification: model name, the ISA flags that matter to MoE kernels, and KT's variant
//! string. Everything is detected at run time (CPUID/XCR0), so one binary runs on any x86-64.

/// What this CPU can run.
#[derive(Clone, Debug)]
pub struct CpuInfo {
    /// Brand string (CPUID 0x80000002..4), or /proc/cpuinfo's model name.
    pub model: String,
    /// `(flag, present)` for each flag that matters, in a fixed order.
    pub flags: Vec<(&'static str, bool)>,
}

impl CpuInfo {
    /// Detect the running CPU.
    pub fn detect() -> Self {
        CpuInfo { model: model_name(), flags: flags() }
    }

    /// Is `flag` present?
    pub fn has(&self, flag: &str) -> bool {
        self.flags.iter().any(|&(f, on)| f == flag && on)
    }

    /// KT's variant string for this CPU (`kt_kernel.__cpu_variant__`), by KT's progressive match.
    pub fn kt_variant(&self) -> &'static str {
        let all = |fs: &[&str]| fs.iter().all(|f| self.has(f));
        let base = ["avx512f", "avx512bw"];
        if all(&[
            "amx_tile",
            "amx_int8",
            "amx_bf16",
            "avx512f",
            "avx512bw",
            "avx512_vnni",
            "avx512_vbmi",
            "avx512_bf16",
        ]) {
            "amx"
        } else if all(&["avx512f", "avx512bw", "avx512_vnni", "avx512_vbmi", "avx512_bf16"]) {
            "avx512_bf16"
        } else if all(&["avx512f", "avx512bw", "avx512_vnni", "avx512_vbmi"]) {
            "avx512_vbmi"
        } else if all(&["avx512f", "avx512bw", "avx512_vnni"]) {
            "avx512_vnni"
        } else if all(&base) {
            "avx512_base"
        } else if self.has("avx2") {
            "avx2"
        } else {
            "generic"
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn flags() -> Vec<(&'static str, bool)> {
    let amx = amx_flags();
    vec![
        ("avx2", std::arch::is_x86_feature_detected!("avx2")),
        ("fma", std::arch::is_x86_feature_detected!("fma")),
        ("f16c", std::arch::is_x86_feature_detected!("f16c")),
        ("avx_vnni", std::arch::is_x86_feature_detected!("avxvnni")),
        ("avx512f", std::arch::is_x86_feature_detected!("avx512f")),
        ("avx512bw", std::arch::is_x86_feature_detected!("avx512bw")),
        ("avx512vl", std::arch::is_x86_feature_detected!("avx512vl")),
        ("avx512_vnni", std::arch::is_x86_feature_detected!("avx512vnni")),
        ("avx512_vbmi", std::arch::is_x86_feature_detected!("avx512vbmi")),
        ("avx512_bf16", std::arch::is_x86_feature_detected!("avx512bf16")),
        ("avx512_fp16", std::arch::is_x86_feature_detected!("avx512fp16")),
        ("amx_tile", amx[0]),
        ("amx_int8", amx[1]),
        ("amx_bf16", amx[2]),
    ]
}

#[cfg(not(target_arch = "x86_64"))]
fn flags() -> Vec<(&'static str, bool)> {
    Vec::new()
}

/// AMX tile/int8/bf16: CPUID.7.0:EDX bits 24/25/22 and the OS enabling tile state (XCR0 17+18).
/// `is_x86_feature_detected!` for AMX is unstable, hence by hand.
#[cfg(target_arch = "x86_64")]
fn amx_flags() -> [bool; 3] {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    let max_leaf = __cpuid(0).eax;
    if max_leaf < 7 {
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
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "xsave")]
unsafe fn xgetbv0() -> u64 {
    // SAFETY: guaranteed by the caller.
    unsafe { std::arch::x86_64::_xgetbv(0) }
}

fn model_name() -> String {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::__cpuid;
        if __cpuid(0x8000_0000).eax >= 0x8000_0004 {
            let mut bytes = Vec::with_capacity(48);
            for leaf in 0x8000_0002u32..=0x8000_0004 {
                let r = __cpuid(leaf);
                for reg in [r.eax, r.ebx, r.ecx, r.edx] {
                    bytes.extend_from_slice(&reg.to_le_bytes());
                }
            }
            let s = String::from_utf8_lossy(&bytes).trim_matches(char::from(0)).trim().to_string();
            if !s.is_empty() {
                return s;
            }
        }
    }
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variant_follows_flags() {
        let mut c = CpuInfo { model: "x".into(), flags: vec![("avx2", true)] };
        assert_eq!(c.kt_variant(), "avx2");
        c.flags.extend([("avx512f", true), ("avx512bw", true)]);
        assert_eq!(c.kt_variant(), "avx512_base");
        c.flags.extend([("avx512_vnni", true), ("avx512_vbmi", true), ("avx512_bf16", true)]);
        assert_eq!(c.kt_variant(), "avx512_bf16");
        c.flags.extend([("amx_tile", true), ("amx_int8", true), ("amx_bf16", true)]);
        assert_eq!(c.kt_variant(), "amx");
    }

    #[test]
    fn detects_this_machine() {
        let c = CpuInfo::detect();
        assert!(!c.model.is_empty());
        #[cfg(target_arch = "x86_64")]
        assert_eq!(c.has("avx2"), std::arch::is_x86_feature_detected!("avx2"));
    }
}
