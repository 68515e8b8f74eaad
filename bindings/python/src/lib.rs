//! `kt_kernel.kt_kernel_ext`: the native half of the `kt_kernel` package. It exposes what KT's
//! C++ extension exposes to its Python wrapper: a process-wide `CpuInfer` (the NUMA pool and a
//! FIFO task queue, with CUDA-stream host-function submission) and `Moe` layers whose forward
//! tasks read pinned staging buffers by address when they run, so CUDA graphs can replay them.
//! The Python package (`python/kt_kernel`) holds KT's wrapper logic on top.
//!
//! **Must not** compute or convert data itself: it translates arguments and calls the host
//! crate (layers, loaders, core's dequantization).

mod cuda;
mod infer;
mod moe;
mod sft;

use pyo3::prelude::*;

/// The exceptions of `kt_kernel.errors` (pure Python: each derives from `KTKernelError` and
/// from the built-in its kind always was), raised from here too, so that one `except` catches
/// the package's errors and the extension's alike.
mod errors {
    pyo3::import_exception!(kt_kernel.errors, KTValueError);
    pyo3::import_exception!(kt_kernel.errors, KTRuntimeError);
    pyo3::import_exception!(kt_kernel.errors, KTNotImplementedError);
}

/// Map a `kt_core::Error` (or any refusal of an argument) to the Python exception a user
/// expects: a `ValueError`, as `kt_kernel.errors.KTValueError`.
fn value_error(e: impl std::fmt::Display) -> PyErr {
    errors::KTValueError::new_err(e.to_string())
}

#[pymodule]
mod kt_kernel_ext {
    #[pymodule_export]
    use super::infer::CpuInfer;
    #[pymodule_export]
    use super::moe::Moe;
    #[pymodule_export]
    use super::sft::SftMoe;

    use pyo3::prelude::*;

    /// CUDA host-function argument blocks made so far; equal calls (as in CUDA-graph replays)
    /// reuse theirs.
    #[pyfunction]
    fn cuda_host_blocks() -> usize {
        super::cuda::cached_blocks()
    }

    /// The machine as the pool sees it: where the topology came from (`"hwloc"`, or `"sysfs"`
    /// when hwloc did not load), NUMA nodes, physical cores and logical CPUs.
    #[pyfunction]
    fn topology() -> (&'static str, usize, usize, usize) {
        let t = kt_host::topology::Topology::detect();
        let source = match t.source {
            kt_host::topology::Source::Hwloc => "hwloc",
            kt_host::topology::Source::Sysfs => "sysfs",
        };
        (source, t.nodes.len(), t.physical_cores(), t.logical_cpus)
    }

    /// Convert a Hugging Face checkpoint to KT's INT8/INT4 format or one of ours (as
    /// `kt convert`, with the backward's transposes when `backward`, scales chosen by
    /// `scales`: "absmax" or "mse"); returns (layers written, layers already complete). The
    /// GIL is released.
    #[pyfunction]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (input, output, method = "AMXINT8", parts = 2, threads = 0, backward = false, scales = "absmax"))]
    fn convert(
        py: Python<'_>,
        input: std::path::PathBuf,
        output: std::path::PathBuf,
        method: &str,
        parts: usize,
        threads: usize,
        backward: bool,
        scales: &str,
    ) -> PyResult<(usize, usize)> {
        use kt_host::convert::{convert, ConvertSpec};
        let format = kt_core::WeightFormat::parse(method).ok_or_else(|| {
            super::value_error(format!("unknown method {method:?}; valid: {}", kt_core::WeightFormat::NAMES))
        })?;
        let threads = if threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { threads };
        let checkpoint_group = kt_core::WeightFormat::takes_checkpoint_group(method);
        let scales = kt_core::Scales::parse(scales).ok_or_else(|| {
            super::value_error(format!("unknown scales {scales:?}; valid: {}", kt_core::Scales::NAMES))
        })?;
        let spec = ConvertSpec {
            input,
            output,
            format,
            scales,
            parts,
            layers: None,
            checkpoint_group,
            backward,
            threads,
            progress: false,
        };
        let r = py.detach(|| convert(&spec)).map_err(super::value_error)?;
        Ok((r.written.len(), r.skipped.len()))
    }

    /// Tensor `name` of the GGUF model at `path`, dequantized to f32 little-endian bytes (ggml's
    /// definition of its type), and its shape outermost first.
    #[pyfunction]
    fn gguf_dequantize(
        py: Python<'_>,
        path: std::path::PathBuf,
        name: &str,
    ) -> PyResult<(Vec<usize>, Py<pyo3::types::PyBytes>)> {
        let (shape, out) = py
            .detach(|| -> Result<_, kt_host::weights::WeightError> {
                let f = kt_host::gguf::GgufFile::open(&path)?;
                let t = f.tensor(name)?;
                let out = kt_core::ggml::dequantize(t.t, t.bytes, t.dims.first().map_or(0, |&d| d as usize));
                Ok((t.dims.iter().rev().map(|&d| d as usize).collect(), out))
            })
            .map_err(super::value_error)?;
        Ok((shape, pyo3::types::PyBytes::new(py, bytemuck::cast_slice(&out)).unbind()))
    }

    #[pymodule_init]
    fn init(m: &Bound<'_, PyModule>) -> PyResult<()> {
        // KT_KERNEL_CPU_VARIANT / KT_KERNEL_DEBUG are read here; a bad value fails the import
        // with the list of valid ones rather than silently running something else.
        let selected = kt_host::registry::select_default().map_err(|e| {
            pyo3::exceptions::PyImportError::new_err(format!("kt_kernel: cannot choose a CPU backend: {e}"))
        })?;
        let name = selected.backend.name();
        m.add("__version__", env!("CARGO_PKG_VERSION"))?;
        m.add("__backend__", name)?;
        m.add("__cpu_variant__", selected.backend.variant())?;
        m.add("__cpu_features__", kt_host::cpu::CpuInfo::detect().kt_variant())?;
        // The instructions the default backend's int8 kernels run on (KT reports its own build's).
        let int8 = match selected.backend.instructions(kt_core::WeightFormat::Int8Row) {
            kt_core::backend::Instructions::AmxInt8 => "amx-int8".to_string(),
            kt_core::backend::Instructions::Int8Vnni => format!("{name}-vnni"),
            kt_core::backend::Instructions::Int8Pairs | kt_core::backend::Instructions::Int8PairsZmm => {
                format!("{name}-maddubs")
            }
            _ => name.to_string(),
        };
        m.add("__int8_kernel__", int8)?;
        Ok(())
    }
}
