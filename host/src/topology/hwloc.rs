//! The topology as hwloc sees it. hwloc reads `HWLOC_SYNTHETIC`/`HWLOC_XMLFILE` from the
//! environment, so a planned machine can be inspected with the real binary.

use std::collections::BTreeMap;

use hwlocality::object::attributes::ObjectAttributes;
use hwlocality::object::types::ObjectType;
use hwlocality::object::TopologyObject;

use super::{sysfs, Node, Source, Topology};

/// The running machine (or the one `HWLOC_SYNTHETIC` describes); `None` if hwloc fails.
pub(super) fn detect() -> Option<Topology> {
    from_hwloc(&hwlocality::Topology::new().ok()?)
}

pub(super) fn synthetic(description: &str) -> Result<Topology, String> {
    let topo = hwlocality::Topology::builder()
        .from_synthetic(description)
        .map_err(|e| format!("bad synthetic topology {description:?}: {e}"))?
        .build()
        .map_err(|e| format!("hwloc could not build {description:?}: {e}"))?;
    from_hwloc(&topo).ok_or_else(|| format!("synthetic topology {description:?} has no cores"))
}

fn cpus(o: &TopologyObject) -> Vec<usize> {
    o.cpuset().map(|s| s.iter_set().map(usize::from).collect()).unwrap_or_default()
}

fn from_hwloc(topo: &hwlocality::Topology) -> Option<Topology> {
    // Each core goes to the node whose cpuset holds its first thread (the first node if none
    // does, as on machines without NUMA objects).
    let mut nodes: BTreeMap<usize, (Vec<usize>, Vec<Vec<usize>>)> = topo
        .objects_with_type(ObjectType::NUMANode)
        .enumerate()
        .map(|(i, n)| (n.os_index().unwrap_or(i), (cpus(n), Vec::new())))
        .collect();
    for core in topo.objects_with_type(ObjectType::Core) {
        let pus = cpus(core);
        let Some(&first) = pus.first() else { continue };
        if nodes.is_empty() {
            nodes.insert(0, (Vec::new(), Vec::new()));
        }
        let home = nodes.values().position(|(set, _)| set.contains(&first)).unwrap_or(0);
        nodes.values_mut().nth(home)?.1.push(pus);
    }
    let nodes: Vec<Node> = nodes
        .into_iter()
        .filter(|(_, (_, cores))| !cores.is_empty())
        .map(|(os_index, (_, cores))| Node { os_index, cores })
        .collect();
    if nodes.is_empty() {
        return None;
    }
    let l3_bytes = topo
        .objects_with_type(ObjectType::L3Cache)
        .filter_map(|c| match c.attributes() {
            Some(ObjectAttributes::Cache(a)) => a.size().map(|s| s.get() as usize),
            _ => None,
        })
        .max()
        .unwrap_or(0);
    let logical = nodes.iter().flat_map(|n| &n.cores).map(Vec::len).sum();
    let (mem_available, mem_total) = sysfs::meminfo(std::path::Path::new("/"));
    Some(Topology { nodes, logical_cpus: logical, l3_bytes, mem_available, mem_total, source: Source::Hwloc })
}
