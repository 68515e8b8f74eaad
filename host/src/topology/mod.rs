//! Machine topology: NUMA nodes, the physical cores of each (with their SMT siblings), the L3
//! size and free memory. Read from hwloc when it is compiled in (feature `hwloc`) and loads,
//! from Linux sysfs otherwise; both give the same [`Topology`], so placement never cares.

#[cfg(feature = "hwloc")]
mod hwloc;
mod sysfs;

pub use sysfs::parse_cpulist;

/// One NUMA node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    /// The OS's number for it (what `numactl` calls it).
    pub os_index: usize,
    /// Its physical cores, each as the OS CPU numbers of its hardware threads (SMT siblings),
    /// first thread first.
    pub cores: Vec<Vec<usize>>,
}

/// Where the topology came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// hwloc (honours `HWLOC_SYNTHETIC` and `HWLOC_XMLFILE`).
    Hwloc,
    /// Linux sysfs.
    Sysfs,
}

/// What the pool, the benchmark and `kt info` need to know about the machine.
#[derive(Clone, Debug)]
pub struct Topology {
    /// NUMA nodes in OS order (at least one).
    pub nodes: Vec<Node>,
    /// Logical CPUs this process may run on.
    pub logical_cpus: usize,
    /// Largest last-level cache, bytes (0 if unknown).
    pub l3_bytes: usize,
    /// MemAvailable, bytes (0 if unknown).
    pub mem_available: u64,
    /// MemTotal, bytes (0 if unknown).
    pub mem_total: u64,
    /// Who reported it.
    pub source: Source,
}

impl Topology {
    /// Read the running machine: hwloc if compiled in and it loads, sysfs otherwise.
    pub fn detect() -> Self {
        #[cfg(feature = "hwloc")]
        if let Some(t) = hwloc::detect() {
            return t;
        }
        Self::from_root(std::path::Path::new("/"))
    }

    /// Read a sysfs/procfs tree rooted at `root` (tests use a fake tree).
    pub fn from_root(root: &std::path::Path) -> Self {
        sysfs::read(root)
    }

    /// An hwloc synthetic topology such as `"numa:2 core:4 pu:2"` (tests and planning).
    #[cfg(feature = "hwloc")]
    pub fn synthetic(description: &str) -> Result<Self, String> {
        hwloc::synthetic(description)
    }

    /// Physical cores over all nodes.
    pub fn physical_cores(&self) -> usize {
        self.nodes.iter().map(|n| n.cores.len()).sum()
    }

    /// The node with OS number `os_index`.
    pub fn node(&self, os_index: usize) -> Option<&Node> {
        self.nodes.iter().find(|n| n.os_index == os_index)
    }
}
