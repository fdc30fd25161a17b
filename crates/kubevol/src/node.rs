//! Facts about the node kubevol runs on.

use std::path::Path;

use kubevol_core::projection::NodeAllocatable;

/// The node's capacity as the downward API's default for unset limits: its online CPUs, its
/// memory (`MemTotal`) and the size of the filesystem holding `root`.
pub fn allocatable(root: &Path) -> NodeAllocatable {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as i64;
    let memory = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<i64>().ok())
        })
        .map_or(0, |kb| kb * 1024);
    let ephemeral_storage = rustix::fs::statvfs(root)
        .map(|s| (s.f_blocks as i64).saturating_mul(s.f_frsize as i64))
        .unwrap_or(0);
    NodeAllocatable {
        cpu_milli: cpus * 1000,
        memory,
        ephemeral_storage,
    }
}
