//! emptyDir: a directory on the node's disk, a tmpfs (medium Memory) or a hugetlbfs (medium
//! HugePages), at `pods/<uid>/volumes/kubernetes.io~empty-dir/<name>`, mode 0777 or the
//! volume's `emptyDir.mode`.
//!
//! Teardown of a disk volume removes its contents with a one-filesystem walk that stops before a
//! mount nested inside the volume, so that mount's data is never touched.

use std::path::Path;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kubevol_core::quantity::Quantity;
use kubevol_core::state::VolumeSpec;

use super::{
    blocking, fs_group, BoxFuture, Filesystem, PluginHost, QuickPlugin, QuickStep, SetUpRequest,
    SetUpResult, TearDownRequest, VolumeDir, VolumePlugin,
};
use crate::error::VolumeError;

/// The kubelet's name of the plugin.
pub const PLUGIN_NAME: &str = "kubernetes.io/empty-dir";

/// The emptyDir plugin.
pub struct EmptyDirPlugin;

/// What backs an emptyDir.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Medium {
    Disk,
    Memory,
    HugePages(Option<String>),
}

/// Whether the emptyDir lives on the node's disk (not a tmpfs or hugetlbfs of its own).
pub(crate) fn on_disk(spec: &VolumeSpec) -> bool {
    medium(spec) == Medium::Disk
}

fn medium(spec: &VolumeSpec) -> Medium {
    let m = spec
        .volume
        .empty_dir
        .as_ref()
        .and_then(|e| e.medium.as_deref())
        .unwrap_or("");
    match m {
        "Memory" => Medium::Memory,
        "HugePages" => Medium::HugePages(None),
        m => match m.strip_prefix("HugePages-") {
            Some(size) => Medium::HugePages(Some(size.to_string())),
            None => Medium::Disk,
        },
    }
}

/// The permission bits of the volume's directory: `emptyDir.mode` (Kubernetes 1.37), else 0777.
fn mode(spec: &VolumeSpec) -> u32 {
    spec.extensions.empty_dir_mode.unwrap_or(0o777)
}

/// The pod's memory limit as the kubelet computes it: the sum of the app containers' limits, or
/// the largest init container's limit if that is larger. `None` when no container sets one.
pub fn pod_memory_limit(pod: &Pod) -> Option<i64> {
    pod_limit(pod, "memory")
}

/// The pod's limit of `resource` (`memory`, `ephemeral-storage`), computed as
/// [`pod_memory_limit`] computes the memory's.
pub fn pod_limit(pod: &Pod, resource: &str) -> Option<i64> {
    let spec = pod.spec.as_ref()?;
    let limit = |c: &k8s_openapi::api::core::v1::Container| -> Option<i64> {
        let q = c.resources.as_ref()?.limits.as_ref()?.get(resource)?;
        Quantity::parse(&q.0).ok().map(|q| q.value())
    };
    let app: Vec<i64> = spec.containers.iter().filter_map(limit).collect();
    let init = spec
        .init_containers
        .iter()
        .flatten()
        .filter_map(limit)
        .max();
    // Saturating: two 7Ei limits must not wrap to a negative sum, which would read as "no
    // limit" and give an unlimited tmpfs.
    let sum = (!app.is_empty()).then(|| app.iter().fold(0i64, |a, b| a.saturating_add(*b)));
    match (sum, init) {
        (None, None) => None,
        (a, b) => Some(a.unwrap_or(0).max(b.unwrap_or(0))),
    }
}

/// The tmpfs size, as the kubelet sizes a memory-backed emptyDir: the pod's memory limit, or
/// without one the node's allocatable memory (`node_memory`), and the sizeLimit if it is
/// smaller. Never unlimited: a tmpfs without a size may take half the node's memory, and one of
/// `size=0` all of it. `None` only where the node's memory is not known (0) and nothing limits it.
pub fn tmpfs_size(pod: &Pod, spec: &VolumeSpec, node_memory: i64) -> Option<i64> {
    let size_limit = spec
        .volume
        .empty_dir
        .as_ref()
        .and_then(|e| e.size_limit.as_ref())
        .and_then(|q| Quantity::parse(&q.0).ok())
        .map(|q| q.value())
        .filter(|v| *v > 0);
    let base = pod_memory_limit(pod)
        .filter(|v| *v > 0)
        .or((node_memory > 0).then_some(node_memory));
    match (size_limit, base) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Makes a memory-backed emptyDir's tmpfs (mounted at `path`, its root open as `root`) the size the pod
/// asks for now, keeping its files: a pod resized, or edited, since it was mounted. A size
/// below what the volume holds is refused, with a warning event on the pod, and the volume
/// keeps its size (as the kubelet refuses it).
fn resize_tmpfs(
    host: &PluginHost,
    req: &SetUpRequest,
    path: &Path,
    root: &kubevol_mount::safe::Dir,
) -> Result<(), VolumeError> {
    let Some(usage) = PluginHost::tmpfs_usage(root) else {
        return Ok(());
    };
    let (now, used) = (usage.size, usage.used);
    // tmpfs counts whole pages.
    let want = tmpfs_size(&req.pod, &req.spec, host.node_allocatable.memory)
        .map(|s| (s.max(0) as u64).div_ceil(usage.block) * usage.block);
    match want {
        Some(w) if w == now => return Ok(()),
        Some(w) if w < used => {
            let message = format!(
                "emptyDir {:?} cannot shrink to {w} bytes: it holds {used}; it keeps its size of {now} bytes (free some of it, or ask for more)",
                req.outer_volume_name
            );
            tracing::warn!(pod = %req.pod_ref, "{message}");
            host.events.record(
                &req.pod_ref,
                true,
                crate::events::reason::VOLUME_RESIZE_FAILED,
                message,
            );
            return Ok(());
        }
        // Nothing known to size it by: it keeps the size it has.
        None => return Ok(()),
        Some(_) => {}
    }
    let size = want.unwrap_or_default();
    tracing::info!(pod = %req.pod_ref, volume = %req.outer_volume_name, from = now, to = size, "resizing a memory-backed emptyDir's tmpfs");
    host.resize_tmpfs(path, size)
}

/// The huge page size in bytes for a HugePages medium, from the medium itself or from the pod's
/// `hugepages-<size>` resources.
fn huge_page_size(
    pod: &Pod,
    explicit: Option<&str>,
    medium_name: &str,
) -> Result<i64, VolumeError> {
    let err = |detail: String| VolumeError::HugePages {
        medium: medium_name.to_string(),
        detail,
    };
    let parse = |s: &str| {
        Quantity::parse(s)
            .map(|q| q.value())
            .map_err(|e| err(format!("page size {s:?}: {e}")))
    };
    if let Some(size) = explicit {
        return parse(size);
    }
    let mut sizes = std::collections::BTreeSet::new();
    for c in pod.spec.iter().flat_map(|s| {
        s.containers
            .iter()
            .chain(s.init_containers.iter().flatten())
    }) {
        let Some(r) = &c.resources else { continue };
        for map in [&r.limits, &r.requests].into_iter().flatten() {
            for key in map.keys() {
                if let Some(size) = key.strip_prefix("hugepages-") {
                    sizes.insert(parse(size)?);
                }
            }
        }
    }
    match sizes.len() {
        1 => Ok(*sizes.iter().next().unwrap_or(&0)),
        0 => Err(err("the pod's containers request no hugepages-<size> resource; request one or use medium HugePages-<size>".into())),
        _ => Err(err("the pod's containers request more than one huge page size; use medium HugePages-<size> to pick one".into())),
    }
}

/// Checks that the node has huge pages of `size` bytes reserved.
fn check_node_huge_pages(dir: &Path, size: i64, medium_name: &str) -> Result<(), VolumeError> {
    let kb = size / 1024;
    let nr_path = dir.join(format!("hugepages-{kb}kB")).join("nr_hugepages");
    let err = |detail: String| VolumeError::HugePages {
        medium: medium_name.to_string(),
        detail,
    };
    match std::fs::read_to_string(&nr_path) {
        Err(_) => Err(err(format!(
            "the node has no huge pages of {kb}kB ({} does not exist); use a page size the node supports, or medium \"\" or Memory",
            nr_path.display()
        ))),
        Ok(n) if n.trim() == "0" => Err(err(format!(
            "the node has no {kb}kB huge pages reserved ({} is 0); reserve some (vm.nr_hugepages) or use medium \"\" or Memory",
            nr_path.display()
        ))),
        Ok(_) => Ok(()),
    }
}

impl VolumePlugin for EmptyDirPlugin {
    fn name(&self) -> &'static str {
        PLUGIN_NAME
    }

    fn source_field(&self) -> &'static str {
        "emptyDir"
    }

    fn can_support(&self, spec: &VolumeSpec) -> bool {
        spec.volume.empty_dir.is_some()
    }

    fn reconstruct(
        &self,
        _host: &PluginHost,
        _pod: &kubevol_core::PodRef,
        name: &str,
        dir: &Path,
        mounted: bool,
    ) -> Option<(VolumeSpec, std::path::PathBuf)> {
        // A mount of its own means a memory-backed medium: teardown unmounts it.
        let volume = k8s_openapi::api::core::v1::Volume {
            name: name.to_string(),
            empty_dir: Some(k8s_openapi::api::core::v1::EmptyDirVolumeSource {
                medium: mounted.then(|| "Memory".to_string()),
                size_limit: None,
            }),
            ..Default::default()
        };
        super::reconstructed(volume, dir)
    }

    fn quick(&self) -> Option<&dyn QuickPlugin> {
        Some(self)
    }

    /// A memory-backed emptyDir whose size changed (its `sizeLimit`, or the pod's memory
    /// limit, by a pod resize or an edit of the pod): its tmpfs is resized in place
    /// (Kubernetes 1.37, `InPlacePodVerticalScalingMemoryBackedVolumes`).
    fn set_up_again(&self, old_pod: &Pod, old: &VolumeSpec, pod: &Pod, spec: &VolumeSpec) -> bool {
        // (The node's memory is the same for both: 0 stands for it.)
        medium(spec) == Medium::Memory && tmpfs_size(old_pod, old, 0) != tmpfs_size(pod, spec, 0)
    }

    fn set_up(
        &self,
        host: Arc<PluginHost>,
        req: SetUpRequest,
    ) -> BoxFuture<Result<SetUpResult, VolumeError>> {
        blocking(move || EmptyDirPlugin.set_up_now(&host, req))
    }

    fn tear_down(
        &self,
        host: Arc<PluginHost>,
        req: TearDownRequest,
    ) -> BoxFuture<Result<(), VolumeError>> {
        blocking(move || EmptyDirPlugin.tear_down_now(&host, req))
    }
}

impl QuickPlugin for EmptyDirPlugin {
    /// A set-up is a mkdir, perhaps a mount, a chmod, unless the pod has an fsGroup: then the
    /// volume's content is walked, and a volume set up again after a restart may hold millions
    /// of files. The teardown of a tmpfs or hugetlbfs is an unmount and an rmdir; that of a
    /// volume on the node's disk removes what the pod wrote. The slow ones run as their own
    /// tasks.
    fn is_quick(&self, spec: &VolumeSpec, step: QuickStep<'_>) -> bool {
        match step {
            QuickStep::SetUp(pod) => fs_group(pod).is_none(),
            QuickStep::TearDown => medium(spec) != Medium::Disk,
        }
    }

    /// The pod's plugin directory, which every one of its emptyDir volumes is made in.
    fn set_up_ahead(&self, host: &PluginHost, pod: &kubevol_core::PodRef) {
        if let Err(e) = host.make_plugin_dir(pod, PLUGIN_NAME) {
            tracing::debug!(pod = %pod, "cannot make the pod's emptyDir directory ahead: {e}");
        }
    }

    fn set_up_now(
        &self,
        host: &Arc<PluginHost>,
        req: SetUpRequest,
    ) -> Result<SetUpResult, VolumeError> {
        // Check what can fail for the user's reasons before creating anything.
        let fs = match medium(&req.spec) {
            Medium::Disk => None,
            Medium::Memory => {
                let data = tmpfs_size(&req.pod, &req.spec, host.node_allocatable.memory)
                    .map(|s| vec![format!("size={s}")])
                    .unwrap_or_default();
                Some(Filesystem {
                    source: "tmpfs",
                    fstype: "tmpfs",
                    data,
                })
            }
            Medium::HugePages(size) => {
                let medium_name = req
                    .spec
                    .volume
                    .empty_dir
                    .as_ref()
                    .and_then(|e| e.medium.as_deref())
                    .unwrap_or_default();
                let size = huge_page_size(&req.pod, size.as_deref(), medium_name)?;
                check_node_huge_pages(&host.hugepages_dir, size, medium_name)?;
                Some(Filesystem {
                    source: "nodev",
                    fstype: "hugetlbfs",
                    data: vec![format!("pagesize={size}")],
                })
            }
        };
        let memory = fs.as_ref().is_some_and(|f| f.fstype == "tmpfs");
        let (path, dir) = host.set_up_volume_dir(
            &req.pod_ref,
            PLUGIN_NAME,
            &req.outer_volume_name,
            mode(&req.spec),
            fs,
        )?;
        // A disk-backed volume made just now, empty: a project of its own, where projects are
        // accounted, makes its usage one call.
        if let VolumeDir::Open(made, true) = &dir {
            host.projects.give(made);
        }
        let fs_group = fs_group(&req.pod);
        // A tmpfs mounted just now has the size asked for now: nothing to resize.
        let resize = memory && !dir.mounted_now();
        if resize || fs_group.is_some() {
            // What fails from here leaves the volume made: uncertain, torn down if the pod goes.
            let made = VolumeError::after_something_made;
            let root = dir.open().map_err(|e| made(e.into()))?;
            if resize {
                resize_tmpfs(host, &req, &path, &root).map_err(made)?;
            }
            if let Some((gid, policy)) = fs_group {
                let volume = &req.outer_volume_name;
                host.apply_fs_group(&req.pod_ref, volume, &root, gid, policy)
                    .map_err(|e| made(e.into()))?;
            }
        }
        Ok(SetUpResult {
            path,
            read_only: false,
        })
    }

    fn tear_down_now(
        &self,
        host: &Arc<PluginHost>,
        req: TearDownRequest,
    ) -> Result<(), VolumeError> {
        host.tear_down_volume_dir(
            &req.pod_ref,
            PLUGIN_NAME,
            &req.outer_volume_name,
            &req.path,
            medium(&req.spec) != Medium::Disk,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(containers: serde_json::Value) -> Pod {
        serde_json::from_value(
            json!({"metadata": {"name": "p"}, "spec": {"containers": containers}}),
        )
        .unwrap()
    }

    fn spec(ed: serde_json::Value) -> VolumeSpec {
        VolumeSpec {
            volume: serde_json::from_value::<k8s_openapi::api::core::v1::Volume>(
                json!({"name": "v", "emptyDir": ed}),
            )
            .unwrap()
            .into(),
            persistent_volume: None,
            block: false,
            extensions: Default::default(),
            selinux_label: None,
            selinux_mount: false,
        }
    }

    #[test]
    fn tmpfs_size_is_the_pods_limit_or_the_nodes_memory_and_the_size_limit_if_smaller() {
        let limited = pod(
            json!([{"name": "a", "resources": {"limits": {"memory": "32Mi"}}}, {"name": "b", "resources": {"limits": {"memory": "16Mi"}}}]),
        );
        let unlimited = pod(json!([{"name": "a"}]));
        let huge = pod(
            json!([{"name": "a", "resources": {"limits": {"memory": "7Ei"}}}, {"name": "b", "resources": {"limits": {"memory": "7Ei"}}}]),
        );
        let rows = [
            (
                "limit smaller than pod",
                &limited,
                json!({"medium": "Memory", "sizeLimit": "8Mi"}),
                Some(8 << 20),
            ),
            (
                "pod smaller than limit",
                &limited,
                json!({"medium": "Memory", "sizeLimit": "1Gi"}),
                Some(48 << 20),
            ),
            (
                "pod limit only",
                &limited,
                json!({"medium": "Memory"}),
                Some(48 << 20),
            ),
            (
                "size limit only",
                &unlimited,
                json!({"medium": "Memory", "sizeLimit": "64Mi"}),
                Some(64 << 20),
            ),
            (
                "neither: the node's allocatable memory",
                &unlimited,
                json!({"medium": "Memory"}),
                Some(1 << 30),
            ),
            (
                "a size limit above the node's memory",
                &unlimited,
                json!({"medium": "Memory", "sizeLimit": "2Gi"}),
                Some(1 << 30),
            ),
            (
                "a zero sizeLimit is no limit",
                &limited,
                json!({"medium": "Memory", "sizeLimit": "0"}),
                Some(48 << 20),
            ),
            (
                "limits whose sum overflows are the largest size, not none",
                &huge,
                json!({"medium": "Memory"}),
                Some(i64::MAX),
            ),
        ];
        for (name, p, ed, want) in rows {
            assert_eq!(tmpfs_size(p, &spec(ed), 1 << 30), want, "row {name}");
        }
    }

    #[test]
    fn huge_page_size_from_medium_or_resources() {
        let p = pod(json!([{"name": "a", "resources": {"limits": {"hugepages-2Mi": "10Mi"}}}]));
        assert_eq!(huge_page_size(&p, None, "HugePages").unwrap(), 2 << 20);
        assert_eq!(
            huge_page_size(&p, Some("1Gi"), "HugePages-1Gi").unwrap(),
            1 << 30
        );
        let none = pod(json!([{"name": "a"}]));
        assert!(huge_page_size(&none, None, "HugePages")
            .unwrap_err()
            .to_string()
            .contains("request no hugepages"));
    }

    #[test]
    fn node_without_huge_pages_is_a_clear_error() {
        let t = tempfile::tempdir().unwrap();
        let e = check_node_huge_pages(t.path(), 2 << 20, "HugePages-2Mi").unwrap_err();
        assert!(
            e.to_string()
                .contains("the node has no huge pages of 2048kB"),
            "{e}"
        );
        std::fs::create_dir_all(t.path().join("hugepages-2048kB")).unwrap();
        std::fs::write(t.path().join("hugepages-2048kB/nr_hugepages"), "0\n").unwrap();
        let e = check_node_huge_pages(t.path(), 2 << 20, "HugePages-2Mi").unwrap_err();
        assert!(
            e.to_string().contains("no 2048kB huge pages reserved"),
            "{e}"
        );
        std::fs::write(t.path().join("hugepages-2048kB/nr_hugepages"), "4\n").unwrap();
        check_node_huge_pages(t.path(), 2 << 20, "HugePages-2Mi").unwrap();
    }
}
