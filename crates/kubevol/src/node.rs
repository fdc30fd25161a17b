//! Facts about the node kubevol runs on.

use std::collections::BTreeMap;
use std::path::Path;

use kubevol_core::affinity::NodeFacts;
use kubevol_core::projection::NodeAllocatable;

/// The node as PersistentVolumes' nodeAffinity sees it: its name and `labels`, with the labels
/// the kubelet gives every Node added unless given (`kubernetes.io/hostname` is the node name;
/// `kubernetes.io/os` and `kubernetes.io/arch` in Go's spelling).
pub fn facts(name: &str, labels: &BTreeMap<String, String>) -> NodeFacts {
    let mut all = labels.clone();
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        other => other,
    };
    for (k, v) in [
        ("kubernetes.io/hostname", name),
        ("kubernetes.io/os", std::env::consts::OS),
        ("kubernetes.io/arch", arch),
    ] {
        all.entry(k.to_string()).or_insert_with(|| v.to_string());
    }
    NodeFacts {
        name: name.to_string(),
        labels: all,
    }
}

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

/// The node's default SELinux file context for containers, or `None` when the node has no
/// SELinux (no selinuxfs at `/sys/fs/selinux`): the `file` entry of the policy's
/// `contexts/lxc_contexts` (`SELINUXTYPE` of `/etc/selinux/config`), else
/// `system_u:object_r:container_file_t:s0`.
pub fn selinux_file_context() -> Option<String> {
    if !std::path::Path::new("/sys/fs/selinux/enforce").exists() {
        return None;
    }
    let policy = std::fs::read_to_string("/etc/selinux/config")
        .ok()
        .and_then(|c| {
            c.lines().find_map(|l| {
                l.trim()
                    .strip_prefix("SELINUXTYPE=")
                    .map(|v| v.trim().to_string())
            })
        })
        .unwrap_or_else(|| "targeted".into());
    let contexts = std::fs::read_to_string(format!("/etc/selinux/{policy}/contexts/lxc_contexts"));
    let file = contexts.ok().and_then(|c| {
        c.lines().find_map(|l| {
            let (k, v) = l.split_once('=')?;
            (k.trim() == "file").then(|| v.trim().trim_matches('"').to_string())
        })
    });
    Some(file.unwrap_or_else(|| kubevol_core::selinux::DEFAULT_FILE_CONTEXT.to_string()))
}
