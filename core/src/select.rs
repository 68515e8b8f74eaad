//! Backend selection: the best compiled-in backend this CPU supports, unless
//! `KT_KERNEL_CPU_VARIANT` forces one; per format, fall back to the next best that serves it.
//! Pure logic: the host reads the environment and passes the values in.
#![forbid(unsafe_code)]

use alloc::format;
use alloc::string::String;
use core::fmt::Write;

use crate::{Backend, Error, LayerFormat, WeightFormat};

/// Values `KT_KERNEL_CPU_VARIANT` accepts: KT's six variant strings, plus `avx512` and ours.
pub const VARIANTS: &[&str] =
    &["amx", "avx512_bf16", "avx512_vbmi", "avx512_vnni", "avx512_base", "avx512", "avx2", "reference"];

/// The backend name a variant string selects.
pub fn backend_for_variant(v: &str) -> Option<&'static str> {
    Some(match v {
        "amx" => "amx",
        "avx512_bf16" | "avx512_vbmi" | "avx512_vnni" | "avx512_base" | "avx512" => "avx512",
        "avx2" => "avx2",
        "reference" => "reference",
        _ => return None,
    })
}

/// The chosen backend and, for `KT_KERNEL_DEBUG`, why.
#[derive(Debug)]
pub struct Selection {
    /// The backend.
    pub backend: &'static dyn Backend,
    /// One line per candidate considered.
    pub explanation: String,
}

/// Choose among `registry` (the backends with kernels in this build). `forced` is
/// `KT_KERNEL_CPU_VARIANT` if set; `compiled` names the backend crates compiled in, so a forced
/// variant whose crate is compiled but registers no backend yet gets a precise message.
pub fn select(registry: &[&'static dyn Backend], forced: Option<&str>, compiled: &[&str]) -> Result<Selection, Error> {
    let mut why = String::new();
    if let Some(v) = forced.map(str::trim).filter(|v| !v.is_empty()) {
        let v = v.to_ascii_lowercase();
        let name =
            backend_for_variant(&v).ok_or_else(|| Error::UnknownVariant { value: v.clone(), valid: VARIANTS })?;
        let Some(b) = registry.iter().copied().find(|b| b.name() == name) else {
            let reason = if compiled.contains(&name) {
                format!("backend {name} has no kernels registered in this build yet")
            } else {
                format!("this build does not include it (Cargo feature \"{name}\")")
            };
            return Err(Error::VariantUnavailable { variant: v, reason });
        };
        if let Err(missing) = b.cpu_support() {
            return Err(Error::VariantUnavailable { variant: v, reason: format!("this CPU lacks {missing}") });
        }
        let _ = writeln!(why, "{name}: forced by KT_KERNEL_CPU_VARIANT={v}");
        return Ok(Selection { backend: b, explanation: why });
    }
    let mut best: Option<&'static dyn Backend> = None;
    for &b in registry {
        match b.cpu_support() {
            Ok(()) => {
                let _ = writeln!(why, "{}: available (priority {})", b.name(), b.priority());
                if best.is_none_or(|cur| b.priority() > cur.priority()) {
                    best = Some(b);
                }
            }
            Err(missing) => {
                let _ = writeln!(why, "{}: skipped, CPU lacks {missing}", b.name());
            }
        }
    }
    for &c in compiled {
        if !registry.iter().any(|b| b.name() == c) {
            let _ = writeln!(why, "{c}: compiled in, no kernels registered yet");
        }
    }
    let backend = best.ok_or_else(|| Error::NoBackend { format: WeightFormat::Bf16, detail: why.clone() })?;
    let _ = writeln!(why, "selected {}", backend.name());
    Ok(Selection { backend, explanation: why })
}

/// The backend that runs `format`, matrices of the given `(format, rows, cols)`: `preferred`
/// if it can, else the highest-priority available backend of `registry` that can.
pub fn for_format(
    registry: &[&'static dyn Backend],
    preferred: &'static dyn Backend,
    format: LayerFormat,
    shapes: &[(WeightFormat, usize, usize)],
) -> Result<Selection, Error> {
    let serves = |b: &dyn Backend| b.cpu_support().is_ok() && shapes.iter().all(|&(f, r, c)| b.supports(f, r, c));
    if serves(preferred) {
        return Ok(Selection { backend: preferred, explanation: format!("{} runs {format}\n", preferred.name()) });
    }
    let mut explanation = format!("{} declines {format} on shapes {shapes:?}\n", preferred.name());
    let mut best: Option<&'static dyn Backend> = None;
    for &b in registry {
        if serves(b) && best.is_none_or(|cur| b.priority() > cur.priority()) {
            best = Some(b);
        }
    }
    match best {
        Some(b) => {
            let _ = writeln!(explanation, "falling back to {} for {format}", b.name());
            Ok(Selection { backend: b, explanation })
        }
        None => Err(Error::NoBackend { format: format.gate, detail: explanation }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::REFERENCE;

    #[test]
    fn default_picks_best_available() {
        let s = select(&[&REFERENCE], None, &["avx2"]).unwrap();
        assert_eq!(s.backend.name(), "reference");
        assert!(s.explanation.contains("avx2: compiled in, no kernels registered yet"));
    }

    #[test]
    fn forced_values() {
        assert_eq!(select(&[&REFERENCE], Some("reference"), &[]).unwrap().backend.name(), "reference");
        let e = select(&[&REFERENCE], Some("sse9"), &[]).unwrap_err();
        assert!(matches!(e, Error::UnknownVariant { .. }));
        assert!(alloc::format!("{e}").contains("avx2"), "lists valid values: {e}");
        let e = select(&[&REFERENCE], Some("avx2"), &["avx2"]).unwrap_err();
        assert!(alloc::format!("{e}").contains("no kernels registered"), "{e}");
        let e = select(&[&REFERENCE], Some("AMX"), &[]).unwrap_err();
        assert!(alloc::format!("{e}").contains("Cargo feature \"amx\""), "{e}");
    }
}
