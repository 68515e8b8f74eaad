//! Backend selection by formats. The registry lists the backends with kernels in this build,
//! best first (the host orders it); a layer runs on the first backend this CPU can run that
//! serves all three of its matrices ([`Backend::serves`]). `KT_KERNEL_CPU_VARIANT` forces one
//! by name (KT's `avx512_*` variant strings are the names of the AVX-512 sub-variants); a forced
//! backend that does not run a layer's format is an error naming the format and the backends
//! that do.
//! Pure logic: the host reads the environment and passes the values in.
#![forbid(unsafe_code)]

use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use core::fmt::Write;

use crate::{Backend, Error, WeightFormat};

/// The chosen backend and, for `KT_KERNEL_DEBUG`, why.
#[derive(Debug)]
pub struct Selection {
    /// The backend.
    pub backend: &'static dyn Backend,
    /// One line per candidate considered.
    pub explanation: String,
}

/// The values `KT_KERNEL_CPU_VARIANT` accepts with this registry: every backend's name.
pub fn variants(registry: &[&'static dyn Backend]) -> Vec<&'static str> {
    registry.iter().map(|b| b.name()).collect()
}

/// The backend `forced` names (`KT_KERNEL_CPU_VARIANT`, case and spaces ignored), or `None`
/// when it is unset or empty. A name of no backend in `registry`, or one this CPU cannot run,
/// is an error.
pub fn forced_backend(
    registry: &[&'static dyn Backend],
    forced: Option<&str>,
) -> Result<Option<&'static dyn Backend>, Error> {
    let Some(v) = forced.map(str::trim).filter(|v| !v.is_empty()) else { return Ok(None) };
    let v = v.to_ascii_lowercase();
    let Some(&b) = registry.iter().find(|b| b.name() == v) else {
        return Err(Error::UnknownVariant { value: v.clone(), valid: variants(registry).join(", ") });
    };
    if let Err(missing) = b.cpu_support() {
        return Err(Error::VariantUnavailable { variant: v, reason: format!("this CPU lacks {missing}") });
    }
    Ok(Some(b))
}

/// The default backend: the forced one, else the first of `registry` this CPU runs.
pub fn select(registry: &[&'static dyn Backend], forced: Option<&str>) -> Result<Selection, Error> {
    if let Some(b) = forced_backend(registry, forced)? {
        let explanation = format!("{}: forced by KT_KERNEL_CPU_VARIANT\n", b.name());
        return Ok(Selection { backend: b, explanation });
    }
    let mut why = String::new();
    let mut best = None;
    for &b in registry {
        match b.cpu_support() {
            Ok(()) if best.is_none() => {
                let _ = writeln!(why, "{}: available, selected", b.name());
                best = Some(b);
            }
            Ok(()) => {
                let _ = writeln!(why, "{}: available", b.name());
            }
            Err(missing) => {
                let _ = writeln!(why, "{}: skipped, CPU lacks {missing}", b.name());
            }
        }
    }
    let backend = best.ok_or_else(|| Error::NoBackend { format: WeightFormat::Bf16, detail: why.clone() })?;
    Ok(Selection { backend, explanation: why })
}

/// Whether `b` runs on this CPU and serves every `(format, rows, cols)` of `shapes`.
pub fn serves_all(b: &dyn Backend, shapes: &[(WeightFormat, usize, usize)]) -> bool {
    b.cpu_support().is_ok() && shapes.iter().all(|&(f, r, c)| b.serves(f, r, c))
}

/// The names of the backends of `registry` that run `shapes` on this CPU, comma-separated.
pub fn serving(registry: &[&'static dyn Backend], shapes: &[(WeightFormat, usize, usize)]) -> String {
    let names: Vec<&str> = registry.iter().filter(|b| serves_all(**b, shapes)).map(|b| b.name()).collect();
    if names.is_empty() {
        "none".into()
    } else {
        names.join(", ")
    }
}

/// `Ok` if `b` (chosen as `chosen_by` says) runs `shapes`, else [`Error::FormatNotServed`]
/// naming the first format it declines and the backends of `registry` that run them all.
pub fn check_serves(
    b: &'static dyn Backend,
    chosen_by: &str,
    registry: &[&'static dyn Backend],
    shapes: &[(WeightFormat, usize, usize)],
) -> Result<(), Error> {
    match (shapes.iter().find(|&&(f, r, c)| !b.serves(f, r, c)), b.cpu_support()) {
        (None, Ok(())) => Ok(()),
        (None, Err(missing)) => {
            Err(Error::VariantUnavailable { variant: b.name().into(), reason: format!("this CPU lacks {missing}") })
        }
        (Some(&(format, ..)), _) => Err(Error::FormatNotServed {
            backend: b.name(),
            chosen_by: chosen_by.into(),
            format,
            serving: serving(registry, shapes),
        }),
    }
}

/// The backend for a layer whose matrices are `shapes`: the forced one if it serves them (an
/// error if not), else the first of `registry` that this CPU runs and that serves them.
pub fn for_layer(
    registry: &[&'static dyn Backend],
    forced: Option<&str>,
    shapes: &[(WeightFormat, usize, usize)],
) -> Result<Selection, Error> {
    if let Some(b) = forced_backend(registry, forced)? {
        let v = forced.unwrap_or_default().trim();
        check_serves(b, &format!("forced by KT_KERNEL_CPU_VARIANT={v}"), registry, shapes)?;
        return Ok(Selection { backend: b, explanation: format!("{}: forced, runs {shapes:?}\n", b.name()) });
    }
    let mut why = String::new();
    for &b in registry {
        if let Err(missing) = b.cpu_support() {
            let _ = writeln!(why, "{}: skipped, CPU lacks {missing}", b.name());
        } else if let Some((f, ..)) = shapes.iter().find(|&&(f, r, c)| !b.serves(f, r, c)) {
            let _ = writeln!(why, "{}: does not run {f}", b.name());
        } else {
            let _ = writeln!(why, "{}: runs it, selected", b.name());
            return Ok(Selection { backend: b, explanation: why });
        }
    }
    let format = shapes.first().map_or(WeightFormat::Bf16, |s| s.0);
    Err(Error::NoBackend { format, detail: why })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ggml::GgmlType;
    use crate::reference::REFERENCE;
    use crate::testing::OnlyFormat;

    static BF16_ONLY: OnlyFormat = OnlyFormat { name: "bf16-only", format: WeightFormat::Bf16, cpu: Ok(()) };
    static NO_CPU: OnlyFormat = OnlyFormat { name: "avx512", format: WeightFormat::Bf16, cpu: Err("avx512f") };
    const Q4K: WeightFormat = WeightFormat::Ggml(GgmlType::Q4_K);

    #[test]
    fn a_layer_runs_on_the_first_backend_that_serves_it() {
        let reg: [&'static dyn Backend; 3] = [&NO_CPU, &BF16_ONLY, &REFERENCE];
        let bf16 = [(WeightFormat::Bf16, 16, 256)];
        let s = for_layer(&reg, None, &bf16).unwrap();
        assert_eq!(s.backend.name(), "bf16-only");
        assert!(s.explanation.contains("avx512: skipped, CPU lacks avx512f"), "{}", s.explanation);
        let s = for_layer(&reg, None, &[(Q4K, 16, 256)]).unwrap();
        assert_eq!(s.backend.name(), "reference");
        assert!(s.explanation.contains("bf16-only: does not run q4_K"), "{}", s.explanation);
        assert_eq!(select(&reg, None).unwrap().backend.name(), "bf16-only");
    }

    #[test]
    fn a_forced_backend_that_declines_names_the_format_and_who_serves_it() {
        let reg: [&'static dyn Backend; 2] = [&BF16_ONLY, &REFERENCE];
        let e = for_layer(&reg, Some(" BF16-only "), &[(Q4K, 16, 256)]).unwrap_err();
        let msg = alloc::format!("{e}");
        assert!(matches!(e, Error::FormatNotServed { format: Q4K, .. }), "{e:?}");
        assert!(msg.contains("KT_KERNEL_CPU_VARIANT=BF16-only") && msg.contains("do on this CPU: reference"), "{msg}");
        assert_eq!(for_layer(&reg, Some("reference"), &[(Q4K, 16, 256)]).unwrap().backend.name(), "reference");
    }

    #[test]
    fn forced_values_are_names_of_this_build() {
        let reg: [&'static dyn Backend; 3] = [&NO_CPU, &BF16_ONLY, &REFERENCE];
        let e = select(&reg, Some("sse9")).unwrap_err();
        assert!(matches!(e, Error::UnknownVariant { .. }));
        let msg = alloc::format!("{e}");
        assert!(msg.contains("avx512, bf16-only, reference"), "{msg}");
        // A backend this CPU cannot run: the missing feature is named.
        let e = select(&reg, Some("AVX512")).unwrap_err();
        assert!(alloc::format!("{e}").contains("lacks avx512f"), "{e}");
        // Without the AVX-512 backends in the registry, KT's variant strings are not valid.
        let e = select(&[&REFERENCE], Some("avx512_bf16")).unwrap_err();
        assert!(alloc::format!("{e}").contains("valid values: reference"), "{e}");
        assert_eq!(select(&reg, Some("")).unwrap().backend.name(), "bf16-only");
    }
}
