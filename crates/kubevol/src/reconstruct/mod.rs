//! Reconstruction at start, and the sweep of orphaned pod directories.
//!
//! Before the first reconcile the actual state is rebuilt from four witnesses: the durable
//! record (exact specs and paths), the pods directory (`pods/<uid>/volumes/<plugin>/<name>`),
//! the CSI plugin directory (`vol_data.json` beside each staging path) and the mount table.
//! Everything found enters the actual state as *uncertain*: a pod that is still wanted gets
//! its volumes set up again (idempotently: no second mount on a target), and one that is gone
//! gets them torn down the right way, CSI volumes unpublished and unstaged, once every pod
//! source has listed its pods. Nothing here stats a volume, so a dead or hung filesystem cannot
//! stall the start.
//!
//! The sweep removes the directory of a pod that is gone and has nothing left on the node, with
//! rmdir only and never crossing a mount point: whatever is left is reported, not deleted.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use kubevol_core::state::{MountedPodVolume, PodMountState, ReconstructedDevice, VolumeTraits};
use kubevol_core::{PodRef, PodUid};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::metrics::Metrics;
use crate::plugins::{subdirs as dirs, PluginHost, PluginRegistry};
use crate::world::AswWriter;

mod sweep;

pub(crate) use sweep::{sweep_loop, Sweep};

/// What reconstruction and the orphan sweep found, for the status report.
#[derive(Default)]
pub struct Findings {
    reconstruction: Mutex<Reconstruction>,
    leftovers: Mutex<BTreeMap<PodUid, Leftover>>,
}

impl Findings {
    /// What reconstruction found at start.
    pub fn reconstruction(&self) -> Reconstruction {
        crate::sync::lock(&self.reconstruction).clone()
    }

    /// Orphaned pod directories the last sweep could not remove.
    pub fn leftovers(&self) -> Vec<Leftover> {
        crate::sync::lock(&self.leftovers)
            .values()
            .cloned()
            .collect()
    }
}

/// What reconstruction found.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reconstruction {
    /// Pod volumes found (all uncertain until set up again or torn down).
    pub pod_volumes: usize,
    /// Of those, found only in the pods directory (no record).
    pub from_layout: usize,
    /// Volumes found attached or globally mounted.
    pub devices: usize,
    /// Records that could not be read, and directories no plugin could account for.
    pub problems: Vec<String>,
    /// Pod directories with volumes that kubevol never recorded (a kubelet's, another tool's,
    /// or from a record that was lost): left alone, neither set up nor torn down nor swept,
    /// unless the manager was told to adopt them ([`Config::adopt_foreign_pods`](crate::Config)).
    #[serde(default)]
    pub foreign_pods: Vec<ForeignPod>,
    /// How long it took, in milliseconds (the record itself is read when the manager is
    /// made).
    #[serde(default)]
    pub took_ms: u64,
}

/// A pod directory under the root that kubevol never recorded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForeignPod {
    /// The pod's UID (the directory's name).
    pub uid: String,
    /// Its directory.
    pub path: String,
    /// Its volume directories (`<plugin>/<name>`).
    pub volumes: Vec<String>,
}

/// What the status and the log say of foreign pod directories.
pub const FOREIGN_HINT: &str = "pod directories kubevol never recorded are left alone (another kubelet or tool may be using this root directory); run with --adopt-foreign-pods to set them up or tear them down as kubevol's own";

/// A pod directory that could not be removed, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Leftover {
    /// The pod's UID.
    pub uid: String,
    /// Its directory.
    pub path: String,
    /// What is left in it.
    pub reason: String,
}

/// The pod a directory or record belongs to when nothing names it.
fn unknown_pod(uid: &PodUid) -> PodRef {
    PodRef {
        namespace: "(unknown)".into(),
        name: uid.as_str().into(),
        uid: uid.clone(),
    }
}

fn name_of(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The manifest file each recorded pod came from: while that file cannot be read, the pod's
/// volumes are kept as recorded.
pub(crate) type RecordedFiles = BTreeMap<PodUid, (PodRef, PathBuf)>;

/// The sources of the pods in the record that a source must give again before anything of
/// theirs is torn down.
#[derive(Default)]
pub(crate) struct Recorded {
    /// Pods from manifest files, and their files.
    pub(crate) files: RecordedFiles,
    /// Pods given through the library API.
    pub(crate) library: BTreeSet<PodUid>,
}

/// Rebuilds the actual state. Runs once, before the reconciler starts; blocking.
pub(crate) fn reconstruct(
    asw: &AswWriter,
    host: &PluginHost,
    plugins: &PluginRegistry,
    adopt_foreign: bool,
) -> (Reconstruction, Recorded) {
    let mut report = Reconstruction::default();
    let mounts: BTreeSet<PathBuf> = match host.mounter.mount_table() {
        Ok(t) => t.into_iter().map(|m| m.mount_point).collect(),
        Err(e) => {
            report.problems.push(format!(
                "cannot read the mount table ({e}): every volume found is treated as mounted"
            ));
            BTreeSet::new()
        }
    };
    let table_known = report.problems.is_empty();
    let loaded = host.record.load();
    let files: RecordedFiles = loaded
        .pods
        .iter()
        .filter_map(|r| {
            let file = crate::store::Origin::file_of(&r.source)?;
            Some((r.pod.uid.clone(), (r.pod.clone(), file)))
        })
        .collect();
    let api = crate::store::Origin::Api.to_string();
    let library = loaded
        .pods
        .iter()
        .filter(|r| *r.source == *api)
        .map(|r| r.pod.uid.clone())
        .collect();
    let files = Recorded { files, library };
    let mut asw = asw.write();

    // 1. The record: exact specs, paths and traits.
    for r in &loaded.pods {
        let spec = Arc::new(r.spec.spec());
        asw.mark_pod_volume(
            &r.unique_name,
            &r.traits.traits(),
            r.pod.uid.clone(),
            MountedPodVolume {
                pod_ref: r.pod.clone(),
                outer_volume_name: r.volume.clone(),
                spec,
                state: PodMountState::Uncertain,
                path: r.path.clone(),
                read_only: r.read_only,
                content_generation: 0,
                sub_paths: r.sub_paths.clone(),
            },
        );
        report.pod_volumes += 1;
    }
    for d in &loaded.devices {
        asw.mark_reconstructed_device(
            &d.unique_name,
            &d.traits.traits(),
            ReconstructedDevice {
                attach: d.attach.is_some(),
                attach_done: d.attach == Some(crate::record::DeviceStepState::Done),
                device: d.device_mount.is_some(),
                device_mount_path: d.device_mount_path.clone(),
                publish_context: d.publish_context.clone(),
                spec: Some(Arc::new(d.spec.spec())),
            },
        );
        report.devices += 1;
    }
    for c in &loaded.corrupt {
        warn!("{c}");
        report.problems.push(c.to_string());
    }

    // 2. The pods directory: volumes without a (readable) record. A pod the record never
    // named, not even in a line it cannot read, is not kubevol's.
    let recorded: BTreeSet<&PodUid> = loaded
        .pods
        .iter()
        .map(|r| &r.pod.uid)
        .chain(loaded.corrupt.iter().filter_map(|c| c.pod.as_ref()))
        .collect();
    for pod_dir in dirs(&host.root.join("pods")) {
        let uid = PodUid::from(name_of(&pod_dir));
        if !adopt_foreign && !recorded.contains(&uid) {
            let volumes: Vec<String> = dirs(&pod_dir.join("volumes"))
                .iter()
                .flat_map(|p| {
                    let plugin = name_of(p).replace('~', "/");
                    dirs(p)
                        .iter()
                        .map(move |v| format!("{plugin}/{}", name_of(v)))
                        .collect::<Vec<_>>()
                })
                .collect();
            // A directory without volumes has nothing to tear down: the sweep, rmdir only and
            // never through a mount, removes it if it is empty (as kubevol's own is, when a
            // crash came between a pod's last record and its directory's removal) and reports
            // it otherwise.
            if !volumes.is_empty() {
                report.foreign_pods.push(ForeignPod {
                    uid: uid.to_string(),
                    path: pod_dir.display().to_string(),
                    volumes,
                });
                continue;
            }
        }
        let pod_ref = loaded
            .pods
            .iter()
            .find(|r| r.pod.uid == uid)
            .map(|r| r.pod.clone())
            .unwrap_or_else(|| unknown_pod(&uid));
        for plugin_dir in dirs(&pod_dir.join("volumes")) {
            let escaped = name_of(&plugin_dir);
            let plugin_name = escaped.replace('~', "/");
            for vol_dir in dirs(&plugin_dir) {
                let name = name_of(&vol_dir);
                if asw
                    .pod_volumes(&uid)
                    .any(|(_, m)| m.path.starts_with(&vol_dir))
                {
                    // Recorded: the record's spec and name are exact.
                    continue;
                }
                let Some(plugin) = plugins.by_name(&plugin_name) else {
                    report.problems.push(format!(
                        "{}: no plugin {plugin_name} is registered; left in place",
                        vol_dir.display()
                    ));
                    continue;
                };
                let mounted = !table_known
                    || mounts.contains(&vol_dir)
                    || mounts.contains(&vol_dir.join("mount"));
                let Some((spec, path)) =
                    plugin.reconstruct(host, &pod_ref, &name, &vol_dir, mounted)
                else {
                    report.problems.push(format!(
                        "{}: plugin {plugin_name} cannot tell what this volume was; left in place",
                        vol_dir.display()
                    ));
                    continue;
                };
                let traits = layout_traits(plugin.traits(host, &spec));
                let unique = plugin.volume_name(&pod_ref, &spec);
                if asw.pod_volume(&unique, &uid).is_some() {
                    // Recorded under another path (an intent written before its set-up
                    // chose the path).
                    continue;
                }
                info!(pod = %uid, volume = %name, plugin = %plugin_name, "volume found in the pods directory without a record");
                asw.mark_pod_volume(
                    &unique,
                    &traits,
                    uid.clone(),
                    MountedPodVolume {
                        pod_ref: pod_ref.clone(),
                        outer_volume_name: name.as_str().into(),
                        spec: Arc::new(spec),
                        state: PodMountState::Uncertain,
                        path,
                        read_only: false,
                        content_generation: 0,
                        sub_paths: Vec::new(),
                    },
                );
                report.pod_volumes += 1;
                report.from_layout += 1;
            }
        }
    }

    // 3. The CSI plugin directory: staged volumes whose record is lost.
    for (unique, spec, path) in crate::plugins::csi::staged_volumes(host) {
        let known = asw
            .volume(&unique)
            .is_some_and(|v| v.device_state != kubevol_core::state::DeviceMountState::NotMounted);
        if known {
            continue;
        }
        let traits = VolumeTraits {
            plugin: kubevol_core::names::SharedStr::interned(crate::plugins::csi::PLUGIN_NAME),
            attachable: false,
            device_mountable: true,
        };
        info!(volume = %unique, "staged volume found in the plugin directory without a record");
        asw.mark_reconstructed_device(
            &unique,
            &traits,
            ReconstructedDevice {
                attach: false,
                attach_done: false,
                device: true,
                device_mount_path: Some(path),
                publish_context: BTreeMap::new(),
                spec: Some(Arc::new(spec)),
            },
        );
        report.devices += 1;
    }
    drop(asw);
    (report, files)
}

/// Traits of a volume known only from the layout: never attachable (nothing says an attach
/// was made, and a detach kubevol cannot make would block the volume forever).
fn layout_traits(t: VolumeTraits) -> VolumeTraits {
    VolumeTraits {
        attachable: false,
        ..t
    }
}

/// Reconstructs, once, before the first reconcile, and keeps what was found for the status.
pub(crate) async fn at_start(
    asw: AswWriter,
    host: Arc<PluginHost>,
    plugins: PluginRegistry,
    metrics: &Metrics,
    findings: &Findings,
    adopt_foreign: bool,
) -> Recorded {
    let world = asw.clone();
    let started = std::time::Instant::now();
    let (mut report, files) =
        tokio::task::spawn_blocking(move || reconstruct(&asw, &host, &plugins, adopt_foreign))
            .await
            .unwrap_or_else(|e| {
                let report = Reconstruction {
                    problems: vec![format!("reconstruction failed: {e}")],
                    ..Default::default()
                };
                (report, Recorded::default())
            });
    report.took_ms = started.elapsed().as_millis() as u64;
    info!(
        pod_volumes = report.pod_volumes,
        from_layout = report.from_layout,
        devices = report.devices,
        problems = report.problems.len(),
        took_ms = report.took_ms,
        "actual state reconstructed"
    );
    if !report.foreign_pods.is_empty() {
        let uids: Vec<&str> = report.foreign_pods.iter().map(|f| f.uid.as_str()).collect();
        warn!(
            count = uids.len(),
            pods = %uids.join(", "),
            "{FOREIGN_HINT}"
        );
    }
    metrics.set_reconstruction_problems(report.problems.len());
    *crate::sync::lock(&findings.reconstruction) = report;
    world.world().announce();
    world.world().touch_all();
    world.world().wake_reconciler();
    files
}
