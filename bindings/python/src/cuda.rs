//! CUDA host functions without CUDA at build time: libcudart is opened on first use (the path in
//! `KT_KERNEL_CUDART`, else the usual sonames, which torch has already loaded) and only
//! `cudaLaunchHostFunc` is called. A host function runs after all earlier work on its stream, so
//! a task queued from one sees the staging copies done, and a sync in one holds later work back.
//!
//! Callback blocks are cached by what they do ([`Key`]) and never freed: a captured CUDA graph
//! replays the same data pointer, so it must stay valid, and the cache bounds their number by
//! the distinct (layer, buffer, token count) combinations instead of growing per call.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::{Mutex, OnceLock};

type HostFn = unsafe extern "C" fn(*mut c_void);
type LaunchHostFunc = unsafe extern "C" fn(*mut c_void, HostFn, *mut c_void) -> c_int;
type Callback = Box<dyn Fn() + Send + Sync>;

/// What a cached callback does; equal keys must mean identical behaviour.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(crate) enum Key {
    /// Block until the queue has at most `allow` tasks.
    Sync {
        /// The queue (address of a queue that lives as long as its engine; engines are
        /// process-wide and never dropped while a stream can run their callbacks).
        queue: usize,
        /// Tasks allowed to remain.
        allow: usize,
    },
    /// Queue a forward of layer `moe` (a unique id) over staging buffers at these addresses
    /// (bsz, input, ids, weights, output, addend) with these dtype codes.
    Forward {
        /// `Moe::id`.
        moe: u64,
        /// Every address the task reads or writes.
        addrs: [usize; 6],
        /// Input and output dtype codes.
        dtypes: [u8; 2],
    },
}

struct Cudart {
    _lib: libloading::Library,
    launch: LaunchHostFunc,
}

fn cudart() -> Result<&'static Cudart, String> {
    static CELL: OnceLock<Result<Cudart, String>> = OnceLock::new();
    CELL.get_or_init(|| {
        let names: Vec<String> = match std::env::var("KT_KERNEL_CUDART") {
            Ok(p) => vec![p],
            Err(_) => {
                ["libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"].map(String::from).into()
            }
        };
        let mut errors = Vec::new();
        for name in &names {
            // SAFETY: loading libcudart runs its initialisers, which is what linking it would do.
            match unsafe { libloading::Library::new(name) } {
                Ok(lib) => {
                    // SAFETY: the symbol has this C signature in every CUDA runtime since 10.0.
                    let launch = unsafe { lib.get::<LaunchHostFunc>(b"cudaLaunchHostFunc\0") }
                        .map(|s| *s)
                        .map_err(|e| format!("{name}: {e}"))?;
                    return Ok(Cudart { _lib: lib, launch });
                }
                Err(e) => errors.push(format!("{name}: {e}")),
            }
        }
        Err(format!(
            "a CUDA stream was given but no CUDA runtime could be loaded ({}); pass cuda_stream=0 for the CPU path \
             or set KT_KERNEL_CUDART to libcudart's path",
            errors.join("; ")
        ))
    })
    .as_ref()
    .map_err(Clone::clone)
}

fn blocks() -> &'static Mutex<HashMap<Key, usize>> {
    static BLOCKS: OnceLock<Mutex<HashMap<Key, usize>>> = OnceLock::new();
    BLOCKS.get_or_init(Default::default)
}

/// Callback blocks made so far (tests check that replays reuse them).
pub(crate) fn cached_blocks() -> usize {
    blocks().lock().unwrap_or_else(|e| e.into_inner()).len()
}

unsafe extern "C" fn trampoline(data: *mut c_void) {
    // SAFETY: `data` is a leaked `Callback` from `launch`, never freed.
    let f = unsafe { &*(data as *const Callback) };
    // A panic must not unwind into CUDA's thread; tasks report their own errors.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
}

/// Enqueue `f` as a host function on `stream` (a `cudaStream_t` as an integer). The block for
/// `key` is made once, from the first `f` given for it.
pub(crate) fn launch(stream: usize, key: Key, f: impl Fn() + Send + Sync + 'static) -> Result<(), String> {
    let rt = cudart()?;
    let data = *blocks()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(key)
        .or_insert_with(|| Box::into_raw(Box::new(Box::new(f) as Callback)) as usize);
    // SAFETY: the stream handle comes from the caller's CUDA runtime; `data` lives forever.
    let rc = unsafe { (rt.launch)(stream as *mut c_void, trampoline, data as *mut c_void) };
    if rc != 0 {
        return Err(format!("cudaLaunchHostFunc failed with CUDA error {rc}"));
    }
    Ok(())
}
