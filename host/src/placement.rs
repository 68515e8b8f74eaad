//! Which CPUs the workers of each sub-pool get: KT's `WorkerPoolConfig` (sub-pool count, the
//! NUMA node of each, threads per sub-pool), checked against a [`Topology`] and turned into a
//! [`Placement`]. Pure logic, so it is tested on synthetic and fake topologies.

use std::fmt;

use crate::topology::Topology;

/// One sub-pool: its NUMA node (OS number) and thread count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SubPoolConfig {
    /// NUMA node (OS number) whose cores it runs on and whose memory it fills.
    pub node: usize,
    /// Threads, the caller's included for sub-pool 0.
    pub threads: usize,
}

/// The pool to build; one sub-pool per NUMA part of the weights.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Sub-pools in part order.
    pub subpools: Vec<SubPoolConfig>,
    /// Put workers on SMT siblings once a node's physical cores are used (off by default: two
    /// workers on one core halve each other's FMA throughput).
    pub smt: bool,
}

/// A configuration that cannot be built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PoolError {
    /// No sub-pools, or a sub-pool of zero threads.
    ZeroThreads {
        /// The sub-pool (`None`: there are none).
        subpool: Option<usize>,
    },
    /// A sub-pool names a node the machine does not have.
    NoSuchNode {
        /// The sub-pool.
        subpool: usize,
        /// The node asked for.
        node: usize,
        /// The nodes there are.
        nodes: Vec<usize>,
    },
    /// Fewer threads than parts: every part needs a thread.
    FewerThreadsThanParts {
        /// Threads asked for.
        threads: usize,
        /// Parts asked for.
        parts: usize,
    },
}

impl fmt::Display for PoolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PoolError::ZeroThreads { subpool: None } => write!(f, "a pool needs at least one sub-pool"),
            PoolError::ZeroThreads { subpool: Some(i) } => {
                write!(f, "sub-pool {i} has 0 threads; every sub-pool needs at least 1")
            }
            PoolError::NoSuchNode { subpool, node, nodes } => {
                write!(f, "sub-pool {subpool} asks for NUMA node {node}, but this machine has nodes {nodes:?}")
            }
            PoolError::FewerThreadsThanParts { threads, parts } => {
                write!(f, "{threads} thread(s) cannot serve {parts} NUMA parts: give each part at least one thread")
            }
        }
    }
}

impl std::error::Error for PoolError {}

/// The CPUs of one sub-pool's threads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubPoolPlacement {
    /// NUMA node (OS number).
    pub node: usize,
    /// OS CPU of each thread; for sub-pool 0, `cpus[0]` is the caller's slot.
    pub cpus: Vec<usize>,
}

/// Where every thread goes, and what was given up to get there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// In part order.
    pub subpools: Vec<SubPoolPlacement>,
    /// Oversubscription and SMT use, one line each (printed by `kt info`/`kt bench`).
    pub warnings: Vec<String>,
}

impl PoolConfig {
    /// KT's default: one sub-pool per NUMA node with all its physical cores.
    pub fn per_node(topo: &Topology) -> Self {
        let subpools = topo.nodes.iter().map(|n| SubPoolConfig { node: n.os_index, threads: n.cores.len() }).collect();
        PoolConfig { subpools, smt: false }
    }

    /// `threads` threads in `parts` sub-pools, as even as possible (the first get the extra
    /// ones), sub-pool `p` on the machine's node `p % nodes`, as KT does for `threadpool_count`.
    pub fn split(topo: &Topology, threads: usize, parts: usize) -> Result<Self, PoolError> {
        if threads == 0 || parts == 0 {
            return Err(PoolError::ZeroThreads { subpool: (parts > 0).then_some(0) });
        }
        if threads < parts {
            return Err(PoolError::FewerThreadsThanParts { threads, parts });
        }
        let subpools = (0..parts)
            .map(|p| SubPoolConfig {
                node: topo.nodes[p % topo.nodes.len()].os_index,
                threads: threads / parts + usize::from(p < threads % parts),
            })
            .collect();
        Ok(PoolConfig { subpools, smt: false })
    }

    /// Total threads.
    pub fn threads(&self) -> usize {
        self.subpools.iter().map(|s| s.threads).sum()
    }

    /// Give each thread a CPU: a node's physical cores in order (first hardware thread), split
    /// among the sub-pools on that node; then, with `smt`, the cores' other hardware threads;
    /// then, with a warning, the node's cores again (oversubscribed).
    pub fn place(&self, topo: &Topology) -> Result<Placement, PoolError> {
        if self.subpools.is_empty() {
            return Err(PoolError::ZeroThreads { subpool: None });
        }
        let mut used: Vec<usize> = vec![0; topo.nodes.len()]; // slots handed out per node
        let mut warnings = Vec::new();
        let mut subpools = Vec::with_capacity(self.subpools.len());
        for (i, sp) in self.subpools.iter().enumerate() {
            if sp.threads == 0 {
                return Err(PoolError::ZeroThreads { subpool: Some(i) });
            }
            let Some(ni) = topo.nodes.iter().position(|n| n.os_index == sp.node) else {
                return Err(PoolError::NoSuchNode {
                    subpool: i,
                    node: sp.node,
                    nodes: topo.nodes.iter().map(|n| n.os_index).collect(),
                });
            };
            let node = &topo.nodes[ni];
            // Slot order on this node: first threads of every core, then (smt) the siblings.
            let mut slots: Vec<usize> = node.cores.iter().filter_map(|c| c.first().copied()).collect();
            let physical = slots.len();
            if self.smt {
                let depth = node.cores.iter().map(Vec::len).max().unwrap_or(1);
                slots.extend((1..depth).flat_map(|d| node.cores.iter().filter_map(move |c| c.get(d).copied())));
            }
            let start = used[ni];
            used[ni] += sp.threads;
            let cpus: Vec<usize> = (start..start + sp.threads).map(|s| slots[s % slots.len()]).collect();
            if used[ni] > slots.len() {
                warnings.push(format!(
                    "sub-pool {i}: node {} has {} {}, and its sub-pools ask for {} threads: workers share cores{}",
                    sp.node,
                    slots.len(),
                    if self.smt { "hardware threads" } else { "physical cores" },
                    used[ni],
                    if self.smt { "" } else { " (SMT siblings are not used unless asked)" },
                ));
            } else if used[ni] > physical {
                warnings.push(format!("sub-pool {i}: uses SMT siblings on node {} (asked for)", sp.node));
            }
            subpools.push(SubPoolPlacement { node: sp.node, cpus });
        }
        Ok(Placement { subpools, warnings })
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, s) in self.subpools.iter().enumerate() {
            writeln!(f, "  sub-pool {i}: node {}, {} thread(s) on CPUs {}", s.node, s.cpus.len(), cpulist(&s.cpus))?;
        }
        for w in &self.warnings {
            writeln!(f, "  warning: {w}")?;
        }
        Ok(())
    }
}

/// `0-3,8` style, as the kernel writes CPU lists (input order kept, runs folded).
pub fn cpulist(cpus: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        out.push(if j > i { format!("{}-{}", cpus[i], cpus[j]) } else { cpus[i].to_string() });
        i = j + 1;
    }
    out.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::{Node, Source};

    /// `nodes` nodes of `cores` cores with `smt` threads each, numbered as Linux does on
    /// Intel (sibling of core c is c + all cores).
    fn machine(nodes: usize, cores: usize, smt: usize) -> Topology {
        let total = nodes * cores;
        Topology {
            nodes: (0..nodes)
                .map(|n| Node {
                    os_index: n,
                    cores: (0..cores).map(|c| (0..smt).map(|t| t * total + n * cores + c).collect()).collect(),
                })
                .collect(),
            logical_cpus: total * smt,
            l3_bytes: 0,
            mem_available: 0,
            mem_total: 0,
            source: Source::Sysfs,
        }
    }

    #[test]
    fn per_node_default_takes_every_physical_core_once() {
        let t = machine(2, 4, 2);
        let p = PoolConfig::per_node(&t).place(&t).unwrap();
        assert_eq!(p.subpools[0], SubPoolPlacement { node: 0, cpus: vec![0, 1, 2, 3] });
        assert_eq!(p.subpools[1], SubPoolPlacement { node: 1, cpus: vec![4, 5, 6, 7] });
        assert!(p.warnings.is_empty());
    }

    #[test]
    fn split_spreads_parts_over_nodes_and_threads_over_parts() {
        let t = machine(2, 4, 1);
        let c = PoolConfig::split(&t, 7, 4).unwrap();
        let shape: Vec<_> = c.subpools.iter().map(|s| (s.node, s.threads)).collect();
        assert_eq!(shape, vec![(0, 2), (1, 2), (0, 2), (1, 1)]);
        let p = c.place(&t).unwrap();
        let cpus: Vec<_> = p.subpools.iter().map(|s| s.cpus.clone()).collect();
        assert_eq!(cpus, vec![vec![0, 1], vec![4, 5], vec![2, 3], vec![6]], "two parts share a node's cores");
        assert!(p.warnings.is_empty());
    }

    #[test]
    fn more_threads_than_cores_warns_and_uses_siblings_only_when_asked() {
        let t = machine(1, 2, 2);
        let mut c = PoolConfig { subpools: vec![SubPoolConfig { node: 0, threads: 3 }], smt: false };
        let p = c.place(&t).unwrap();
        assert_eq!(p.subpools[0].cpus, vec![0, 1, 0]);
        assert!(p.warnings[0].contains("share cores"), "{:?}", p.warnings);
        c.smt = true;
        let p = c.place(&t).unwrap();
        assert_eq!(p.subpools[0].cpus, vec![0, 1, 2]);
        assert!(p.warnings[0].contains("SMT"), "{:?}", p.warnings);
    }

    #[test]
    fn impossible_configs_are_errors_naming_the_problem() {
        let t = machine(2, 2, 1);
        let bad = PoolConfig { subpools: vec![SubPoolConfig { node: 5, threads: 1 }], smt: false };
        let e = bad.place(&t).unwrap_err().to_string();
        assert!(e.contains("node 5") && e.contains("[0, 1]"), "{e}");
        let zero = PoolConfig { subpools: vec![SubPoolConfig { node: 0, threads: 0 }], smt: false };
        assert!(zero.place(&t).unwrap_err().to_string().contains("0 threads"));
        assert_eq!(PoolConfig::split(&t, 1, 2).unwrap_err(), PoolError::FewerThreadsThanParts { threads: 1, parts: 2 });
        assert!(PoolConfig { subpools: vec![], smt: false }.place(&t).is_err());
    }

    #[cfg(feature = "hwloc")]
    #[test]
    fn hwloc_synthetic_machines() {
        // 2 nodes × 4 cores × 2 SMT threads: hwloc numbers PUs depth-first, siblings adjacent.
        let t = Topology::synthetic("numa:2 core:4 pu:2").unwrap();
        assert_eq!(t.nodes.len(), 2);
        assert_eq!(t.nodes[1].cores[0], vec![8, 9]);
        let p = PoolConfig::per_node(&t).place(&t).unwrap();
        assert_eq!(p.subpools[0].cpus, vec![0, 2, 4, 6], "one worker per physical core, no siblings");
        assert_eq!(p.subpools[1].cpus, vec![8, 10, 12, 14]);
        let smt = PoolConfig { smt: true, ..PoolConfig::split(&t, 12, 2).unwrap() }.place(&t).unwrap();
        assert_eq!(smt.subpools[0].cpus, vec![0, 2, 4, 6, 1, 3]);
        assert_eq!(smt.subpools[1].node, 1);

        // 4 nodes × 8 cores: 4 parts get a node each; 8 parts put two sub-pools on every node.
        let t = Topology::synthetic("numa:4 core:8 pu:1").unwrap();
        let p = PoolConfig::per_node(&t).place(&t).unwrap();
        assert_eq!(
            p.subpools.iter().map(|s| (s.node, s.cpus.len())).collect::<Vec<_>>(),
            [(0, 8), (1, 8), (2, 8), (3, 8)]
        );
        assert_eq!(p.subpools[3].cpus, (24..32).collect::<Vec<_>>());
        let p = PoolConfig::split(&t, 16, 8).unwrap().place(&t).unwrap();
        assert_eq!(p.subpools[1].cpus, vec![8, 9]);
        assert_eq!(p.subpools[5].cpus, vec![10, 11], "the second sub-pool on node 1 takes its next cores");
        assert!(p.warnings.is_empty());
        assert!(Topology::synthetic("numa:x").is_err());
    }

    #[test]
    fn fake_sysfs_machine_places_like_hwloc() {
        let dir = std::env::temp_dir().join(format!("kt-place-{}", std::process::id()));
        let sys = dir.join("sys/devices/system");
        for (n, list) in [(0, "0-3,8-11"), (1, "4-7,12-15")] {
            std::fs::create_dir_all(sys.join(format!("node/node{n}"))).unwrap();
            std::fs::write(sys.join(format!("node/node{n}/cpulist")), list).unwrap();
        }
        std::fs::create_dir_all(sys.join("cpu")).unwrap();
        std::fs::write(sys.join("cpu/online"), "0-15").unwrap();
        for c in 0..16 {
            let t = sys.join(format!("cpu/cpu{c}/topology"));
            std::fs::create_dir_all(&t).unwrap();
            std::fs::write(t.join("physical_package_id"), format!("{}", (c % 8) / 4)).unwrap();
            std::fs::write(t.join("core_id"), format!("{}", c % 4)).unwrap(); // sibling of c is c + 8
        }
        let t = Topology::from_root(&dir);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(t.nodes[0].cores[1], vec![1, 9]);
        let p = PoolConfig::per_node(&t).place(&t).unwrap();
        assert_eq!(p.subpools[0].cpus, vec![0, 1, 2, 3]);
        assert_eq!(p.subpools[1].cpus, vec![4, 5, 6, 7]);
    }

    #[test]
    fn cpulists_fold_runs() {
        assert_eq!(cpulist(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(cpulist(&[4]), "4");
    }
}
