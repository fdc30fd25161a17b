//! A whole OCI runtime-spec `config.json` for one container of a pod, around the mounts and
//! devices kubevol resolved: what a minimal node agent hands `runc` or `crun` to run a batch
//! pod's container on a root filesystem it already has (kubevol pulls no image).
//!
//! What it carries of the pod: the container's `command` and `args` (without `$(VAR)`
//! expansion), its literal `env` values (not `valueFrom`), `workingDir`, the user
//! (`runAsUser`/`runAsGroup` of the container or the pod, 0 by default), the supplemental
//! groups (`supplementalGroups`, `fsGroup` and the groups kubevol's volumes ask for), and
//! `readOnlyRootFilesystem`. The container shares the host's network and has no capabilities;
//! resources, probes, seccomp and AppArmor are a full runtime's.

use std::path::Path;

use k8s_openapi::api::core::v1::Pod;
use serde_json::{json, Value};

use super::ContainerMounts;

/// The `config.json` for `mounts`' container of `pod` (the same pod: the container is looked
/// up in it), whose root filesystem is `rootfs`; `extra_groups` are the supplemental groups
/// its volumes ask for ([`crate::VolumeManager::extra_supplemental_groups_for_pod`]).
pub fn oci_config(
    pod: &Pod,
    mounts: &ContainerMounts,
    extra_groups: &[i64],
    rootfs: &Path,
) -> Result<Value, String> {
    let spec = pod.spec.as_ref().ok_or("the pod has no spec")?;
    let c = spec
        .init_containers
        .iter()
        .flatten()
        .chain(&spec.containers)
        .find(|c| c.name == mounts.container)
        .ok_or_else(|| {
            format!(
                "pod {}/{} has no container {:?}",
                mounts.namespace, mounts.pod, mounts.container
            )
        })?;
    let pod_sc = spec.security_context.as_ref();
    let sc = c.security_context.as_ref();
    let id = |v: Option<i64>, what: &str| -> Result<u32, String> {
        u32::try_from(v.unwrap_or(0))
            .map_err(|_| format!("{what} {} is not a user or group ID", v.unwrap_or(0)))
    };
    let uid = id(
        sc.and_then(|s| s.run_as_user)
            .or(pod_sc.and_then(|s| s.run_as_user)),
        "runAsUser",
    )?;
    let gid = id(
        sc.and_then(|s| s.run_as_group)
            .or(pod_sc.and_then(|s| s.run_as_group)),
        "runAsGroup",
    )?;
    let mut groups: Vec<u32> = Vec::new();
    let supplemental = pod_sc
        .and_then(|s| s.supplemental_groups.clone())
        .unwrap_or_default();
    let fs_group = pod_sc.and_then(|s| s.fs_group);
    for g in supplemental
        .into_iter()
        .chain(fs_group)
        .chain(extra_groups.iter().copied())
    {
        let g = id(Some(g), "supplemental group")?;
        if !groups.contains(&g) {
            groups.push(g);
        }
    }
    let args: Vec<String> = c
        .command
        .iter()
        .flatten()
        .chain(c.args.iter().flatten())
        .cloned()
        .collect();
    if args.is_empty() {
        return Err(format!(
            "container {:?} has no command: without an image's entrypoint one is needed",
            c.name
        ));
    }
    let mut env =
        vec!["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_string()];
    for e in c.env.iter().flatten() {
        if let Some(v) = &e.value {
            env.push(format!("{}={v}", e.name));
        }
    }
    let fragment = mounts.to_oci()?;
    let mut all_mounts = vec![
        json!({"destination": "/proc", "type": "proc", "source": "proc"}),
        json!({"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}),
        json!({"destination": "/dev/pts", "type": "devpts", "source": "devpts", "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]}),
        json!({"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]}),
        json!({"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]}),
    ];
    all_mounts.extend(fragment["mounts"].as_array().cloned().unwrap_or_default());
    let read_only_root = sc
        .and_then(|s| s.read_only_root_filesystem)
        .unwrap_or(false);
    Ok(json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": uid, "gid": gid, "additionalGids": groups},
            "args": args,
            "env": env,
            "cwd": c.working_dir.clone().unwrap_or_else(|| "/".into()),
            "noNewPrivileges": true,
        },
        "root": {"path": rootfs, "readonly": read_only_root},
        "hostname": mounts.pod,
        "mounts": all_mounts,
        "linux": {
            "namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}],
            "devices": fragment["linux"]["devices"],
            "resources": fragment["linux"]["resources"],
            "rootfsPropagation": fragment["linux"].get("rootfsPropagation").cloned().unwrap_or(json!("rprivate")),
            "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/sys/firmware"],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
        },
    }))
}
