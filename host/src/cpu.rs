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
        if all(&["amx_tile", "amx_int8", "amx_bf16", "avx512f", "avx512bw", "avx512_vnni", "avx512vbmi", "avx512_bf16"])
        {
            "amx"
        } else if all(&["avx512f", "avx512bw", "avx512_vnni", "avx512vbmi", "avx512_bf16"]) {
            "avx512_bf16"
        } else if all(&["avx512f", "avx512bw", "avx512_vnni", "avx512vbmi"]) {
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
    kt_x86::isa::flags()
}

#[cfg(not(target_arch = "x86_64"))]
fn flags() -> Vec<(&'static str, bool)> {
    Vec::new()
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
        c.flags.extend([("avx512_vnni", true), ("avx512vbmi", true), ("avx512_bf16", true)]);
        assert_eq!(c.kt_variant(), "avx512_bf16");
        c.flags.extend([("amx_tile", true), ("amx_int8", true), ("amx_bf16", true)]);
        assert_eq!(c.kt_variant(), "amx");
    }

    /// The brand string is what the kernel reports as the model name.
    #[test]
    fn model_matches_proc_cpuinfo() {
        let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else {
            eprintln!("skipped: no /proc/cpuinfo");
            return;
        };
        let Some(name) = info.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split(':').nth(1)) else {
            eprintln!("skipped: /proc/cpuinfo has no model name");
            return;
        };
        assert_eq!(CpuInfo::detect().model, name.trim());
    }

    /// Each detected flag agrees with the kernel's own list (`/proc/cpuinfo` flags) where the
    /// kernel reports it; the OS may hide a flag the CPU has, never the other way round.
    #[test]
    fn flags_agree_with_proc_cpuinfo() {
        let Some(listed) = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|t| t.lines().find(|l| l.starts_with("flags")).map(|l| l.to_string()))
        else {
            eprintln!("skipped: no flags line in /proc/cpuinfo");
            return;
        };
        let listed: Vec<&str> = listed.split(':').nth(1).unwrap_or("").split_whitespace().collect();
        for (flag, on) in CpuInfo::detect().flags {
            if on {
                assert!(listed.contains(&flag), "{flag} detected but not in /proc/cpuinfo");
            } else if flag != "avx_vnni" {
                // The kernel lists every other flag we read whenever the CPU has it.
                assert!(!listed.contains(&flag), "{flag} in /proc/cpuinfo but not detected");
            }
        }
    }
}
