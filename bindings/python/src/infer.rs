//! `CpuInfer`: KT's process-wide CPU engine. One NUMA pool (sub-pools, their NUMA nodes and
//! threads, as KT's `WorkerPoolConfig`) and one FIFO queue whose thread runs every task; the
//! queue thread is worker 0 of sub-pool 0 and is pinned there.

use std::sync::{Arc, Mutex};

use kt_host::numa_pool::NumaPool;
use kt_host::placement::{PoolConfig, SubPoolConfig};
use kt_host::queue::{Task, TaskQueue};
use kt_host::topology::Topology;
use kt_host::LayerOptions;
use pyo3::prelude::*;

use crate::cuda;
use crate::errors::KTRuntimeError;
use crate::value_error;

/// The engine: pool + queue (+ the first error of a stream-ordered sync, kept for the next
/// Python-side sync).
#[pyclass(frozen, module = "kt_kernel.kt_kernel_ext")]
pub struct CpuInfer {
    pub(crate) pool: Arc<NumaPool>,
    pub(crate) queue: Arc<TaskQueue>,
    stream_error: Arc<Mutex<Option<String>>>,
    /// How its layers are built: on its pool, all with one scratch (the queue runs them one
    /// at a time).
    layers: LayerOptions,
}

#[pymethods]
impl CpuInfer {
    /// `subpool_thread_count[i]` threads on NUMA node `subpool_numa_map[i]` for sub-pool `i`
    /// (`None`: the machine's nodes in turn, so KT's default `[0, 1]` works on one node too).
    #[new]
    #[pyo3(signature = (subpool_thread_count, subpool_numa_map = None))]
    fn new(subpool_thread_count: Vec<usize>, subpool_numa_map: Option<Vec<usize>>) -> PyResult<Self> {
        let topo = Topology::detect();
        let subpool_numa_map = subpool_numa_map.unwrap_or_else(|| {
            (0..subpool_thread_count.len()).map(|i| topo.nodes[i % topo.nodes.len()].os_index).collect()
        });
        if subpool_thread_count.len() != subpool_numa_map.len() {
            return Err(value_error(format!(
                "numa_nodes has {} entries but threadpool_count is {}",
                subpool_numa_map.len(),
                subpool_thread_count.len()
            )));
        }
        let subpools = subpool_thread_count
            .iter()
            .zip(&subpool_numa_map)
            .map(|(&threads, &node)| SubPoolConfig { node, threads })
            .collect();
        let config = PoolConfig { subpools, smt: false };
        let placement = config.place(&topo).map_err(value_error)?;
        if std::env::var("KT_KERNEL_DEBUG").is_ok_and(|v| v == "1") {
            eprint!("[kt-kernel] pool:\n{placement}");
        }
        for w in &placement.warnings {
            eprintln!("[kt-kernel] warning: {w}");
        }
        let pool = Arc::new(NumaPool::new(&config, &topo).map_err(value_error)?);
        let queue = Arc::new(TaskQueue::new());
        let p = pool.clone();
        queue.submit(Box::new(move || {
            p.pin_caller();
            Ok(())
        }));
        let layers = LayerOptions::executor(pool.clone());
        Ok(CpuInfer { pool, queue, stream_error: Arc::default(), layers })
    }

    /// Threads over all sub-pools.
    #[getter]
    fn threads(&self) -> usize {
        kt_core::Executor::workers(&*self.pool)
    }

    /// Where the threads run, one line per sub-pool.
    #[getter]
    fn placement(&self) -> String {
        self.pool.placement().to_string()
    }

    /// Wait until at most `allow_n_pending` tasks remain; the first task error since the last
    /// sync (or one recorded by a stream-ordered sync) is raised here. The GIL is released.
    #[pyo3(signature = (allow_n_pending = 0))]
    fn sync(&self, py: Python<'_>, allow_n_pending: usize) -> PyResult<()> {
        let r = py.detach(|| self.queue.sync(allow_n_pending));
        self.take_stream_error()?;
        r.map_err(|e| KTRuntimeError::new_err(e.to_string()))
    }

    /// Wait until the task with this ticket (from `submit_forward`) and all before it ran: what
    /// a Python thread waits for when other threads share the queue. Errors as `sync`.
    fn sync_until(&self, py: Python<'_>, ticket: u64) -> PyResult<()> {
        let r = py.detach(|| self.queue.sync_until(ticket));
        self.take_stream_error()?;
        r.map_err(|e| KTRuntimeError::new_err(e.to_string()))
    }

    /// Stream-ordered sync: enqueue on `stream` a host function that blocks the stream until at
    /// most `allow_n_pending` tasks remain. Errors are kept and raised by the next `sync` or
    /// `sync_with_cuda_stream`.
    #[pyo3(signature = (stream, allow_n_pending = 0))]
    fn sync_with_cuda_stream(&self, stream: usize, allow_n_pending: usize) -> PyResult<()> {
        self.take_stream_error()?;
        let (queue, slot) = (self.queue.clone(), self.stream_error.clone());
        let key = cuda::Key::Sync { queue: Arc::as_ptr(&queue) as usize, allow: allow_n_pending };
        cuda::launch(stream, key, move || {
            if let Err(e) = queue.sync(allow_n_pending) {
                slot.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(e.to_string());
            }
        })
        .map_err(KTRuntimeError::new_err)
    }

    /// Bytes of scratch the engine's layers hold between calls: one for all of them, sized
    /// by the largest call so far.
    #[getter]
    fn scratch_bytes(&self) -> usize {
        kt_host::scratch::lock(&self.layers.scratch).bytes()
    }

    /// Tasks queued or running.
    #[getter]
    fn pending(&self) -> usize {
        self.queue.pending()
    }
}

impl CpuInfer {
    /// How a layer on this engine is built: on its pool, with the engine's one scratch.
    pub(crate) fn layer_options(&self) -> LayerOptions {
        self.layers.clone()
    }

    fn take_stream_error(&self) -> PyResult<()> {
        match self.stream_error.lock().unwrap_or_else(|e| e.into_inner()).take() {
            Some(e) => Err(KTRuntimeError::new_err(e)),
            None => Ok(()),
        }
    }

    /// Queue a task now (stream 0: its ticket) or from a host function on `stream`, keyed for
    /// caching (no ticket: the task is queued when the stream gets there).
    pub(crate) fn submit(
        &self,
        stream: usize,
        key: cuda::Key,
        task: impl Fn() -> Task + Send + Sync + 'static,
    ) -> PyResult<Option<u64>> {
        if stream == 0 {
            return Ok(Some(self.queue.submit(task())));
        }
        let queue = self.queue.clone();
        cuda::launch(stream, key, move || {
            queue.submit(task());
        })
        .map_err(KTRuntimeError::new_err)?;
        Ok(None)
    }
}
