//! The topology from Linux sysfs: the fallback when hwloc is compiled out or fails to load.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use super::{Node, Source, Topology};

/// Read a sysfs/procfs tree rooted at `root`.
pub(super) fn read(root: &Path) -> Topology {
    let sys = root.join("sys/devices/system");
    let online = fs::read_to_string(sys.join("cpu/online")).ok().and_then(|s| parse_cpulist(&s)).unwrap_or_default();
    let logical = std::thread::available_parallelism().map_or(online.len().max(1), |n| n.get());
    let mut node_cpus: BTreeMap<usize, Vec<usize>> = fs::read_dir(sys.join("node"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let id: usize = name.strip_prefix("node")?.parse().ok()?;
            let cpus = parse_cpulist(&fs::read_to_string(e.path().join("cpulist")).ok()?)?;
            Some((id, cpus))
        })
        .filter(|(_, cpus)| !cpus.is_empty())
        .collect();
    if node_cpus.is_empty() {
        node_cpus.insert(0, if online.is_empty() { (0..logical).collect() } else { online });
    }
    // A core is a (package, core_id) pair; CPUs without topology files are cores of their own.
    let core_of = |c: usize| {
        let t = sys.join(format!("cpu/cpu{c}/topology"));
        (read_trim(&t.join("physical_package_id")), read_trim(&t.join("core_id")).unwrap_or_else(|| format!("cpu{c}")))
    };
    let nodes = node_cpus
        .into_iter()
        .map(|(os_index, cpus)| {
            let mut cores: Vec<(_, Vec<usize>)> = Vec::new();
            for c in cpus {
                let key = core_of(c);
                match cores.iter_mut().find(|(k, _)| *k == key) {
                    Some((_, pus)) => pus.push(c),
                    None => cores.push((key, vec![c])),
                }
            }
            Node { os_index, cores: cores.into_iter().map(|(_, pus)| pus).collect() }
        })
        .collect();
    let l3_bytes = (0..8)
        .filter_map(|i| {
            let d = sys.join(format!("cpu/cpu0/cache/index{i}"));
            let level: u32 = read_trim(&d.join("level"))?.parse().ok()?;
            (level == 3).then(|| parse_size(&read_trim(&d.join("size"))?))?
        })
        .max()
        .unwrap_or(0);
    let (mem_available, mem_total) = meminfo(root);
    Topology { nodes, logical_cpus: logical, l3_bytes, mem_available, mem_total, source: Source::Sysfs }
}

/// (MemAvailable, MemTotal) in bytes from `root/proc/meminfo`, 0 where unknown.
pub(super) fn meminfo(root: &Path) -> (u64, u64) {
    let meminfo = fs::read_to_string(root.join("proc/meminfo")).unwrap_or_default();
    let mem = |key: &str| -> u64 {
        meminfo
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    (mem("MemAvailable:"), mem("MemTotal:"))
}

fn read_trim(p: &Path) -> Option<String> {
    fs::read_to_string(p).ok().map(|s| s.trim().to_string())
}

/// Parse a kernel cpulist such as `0-3,8,10-11`.
pub fn parse_cpulist(s: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => out.extend(a.parse::<usize>().ok()?..=b.parse::<usize>().ok()?),
            None => out.push(part.parse().ok()?),
        }
    }
    Some(out)
}

/// Parse a sysfs cache size such as `32768K` or `1M`.
fn parse_size(s: &str) -> Option<usize> {
    let (num, mult) = match s.chars().last()? {
        'K' => (&s[..s.len() - 1], 1024),
        'M' => (&s[..s.len() - 1], 1024 * 1024),
        'G' => (&s[..s.len() - 1], 1024 * 1024 * 1024),
        _ => (s, 1),
    };
    Some(num.parse::<usize>().ok()? * mult)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpulists() {
        assert_eq!(parse_cpulist("0-3,8,10-11\n"), Some(vec![0, 1, 2, 3, 8, 10, 11]));
        assert_eq!(parse_cpulist("x"), None);
        assert_eq!(parse_size("32768K"), Some(32 << 20));
    }

    #[test]
    fn fake_sysfs_tree() {
        let dir = std::env::temp_dir().join(format!("kt-topo-{}", std::process::id()));
        let sys = dir.join("sys/devices/system");
        for (n, list) in [(0, "0-3"), (1, "4-7")] {
            fs::create_dir_all(sys.join(format!("node/node{n}"))).unwrap();
            fs::write(sys.join(format!("node/node{n}/cpulist")), list).unwrap();
        }
        fs::create_dir_all(sys.join("cpu")).unwrap();
        fs::write(sys.join("cpu/online"), "0-7").unwrap();
        for c in 0..8 {
            let t = sys.join(format!("cpu/cpu{c}/topology"));
            fs::create_dir_all(&t).unwrap();
            fs::write(t.join("physical_package_id"), format!("{}", c / 4)).unwrap();
            fs::write(t.join("core_id"), format!("{}", (c % 4) / 2)).unwrap(); // 2 SMT threads per core
        }
        let cache = sys.join("cpu/cpu0/cache/index3");
        fs::create_dir_all(&cache).unwrap();
        fs::write(cache.join("level"), "3").unwrap();
        fs::write(cache.join("size"), "16384K").unwrap();
        fs::create_dir_all(dir.join("proc")).unwrap();
        fs::write(dir.join("proc/meminfo"), "MemTotal: 1000 kB\nMemAvailable: 500 kB\n").unwrap();
        let t = read(&dir);
        fs::remove_dir_all(&dir).unwrap();
        let cores: Vec<_> = t.nodes.iter().map(|n| (n.os_index, n.cores.clone())).collect();
        assert_eq!(cores, vec![(0, vec![vec![0, 1], vec![2, 3]]), (1, vec![vec![4, 5], vec![6, 7]])]);
        assert_eq!(t.physical_cores(), 4);
        assert_eq!(t.l3_bytes, 16 << 20);
        assert_eq!(t.mem_available, 500 * 1024);
    }
}
