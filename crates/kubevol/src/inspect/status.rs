//! The status report: every pod's volumes with state, path, last error and next retry, as the
//! HTTP API serves it and `kubevol status` prints it. These types are the API's wire format.

use std::collections::BTreeSet;

use kubevol_core::state::PodMountState;
use kubevol_core::PodUid;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::operations::executor::{Executor, LastError};
use crate::plugins::PluginRegistry;
use crate::reconstruct::Findings;
use crate::report::events::{Event, EventRecorder};
use crate::store::ObjectStore;
use crate::world::World;

/// Where a pod's volumes stand.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PodPhase {
    /// Every volume the pod's containers use is mounted.
    Ready,
    /// Volumes are being set up, or tried again after a failure that can pass (as a kubelet's
    /// pod stays `ContainerCreating`, its `FailedMount` events saying why).
    Pending,
    /// At least one volume failed for good (tried again only when the pod or an object it
    /// reads changes), or cannot be processed.
    Failed,
    /// The pod is invalid; nothing was created for it.
    Rejected,
    /// The pod is gone or terminated and its volumes are being torn down.
    Terminating,
    /// The pod's manifest cannot be read now (it has errors): its volumes are kept as last
    /// recorded, and nothing of it is torn down until the file is fixed or removed.
    Held,
}

impl std::fmt::Display for PodPhase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self, f)
    }
}

/// Where one volume of a pod stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum VolumePhase {
    /// Set up.
    Mounted,
    /// May or may not be set up; will be set up again or torn down.
    Uncertain,
    /// Not set up yet.
    Pending,
    /// The last attempt failed for a reason that can pass (an object or path that may
    /// appear, a driver that may recover): tried again after backoff.
    Retrying,
    /// Failed for good: tried again only when the pod or an object it reads changes.
    Failed,
    /// Of a type or a use kubevol does not mount.
    Unsupported,
    /// Being torn down.
    Unmounting,
}

impl std::fmt::Display for VolumePhase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self, f)
    }
}

/// One volume of a pod.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VolumeStatus {
    /// The volume's name in the pod's spec.
    pub name: String,
    /// The volume source (`emptyDir`, `hostPath`, ...).
    #[serde(rename = "type")]
    pub type_: String,
    /// The unique volume name, when the volume was processed.
    pub unique_name: Option<String>,
    /// Where it stands.
    pub state: VolumePhase,
    /// The path handed to the container runtime.
    pub path: Option<String>,
    /// Whether the runtime must mount it read-only.
    pub read_only: bool,
    /// The last error and the retry schedule.
    #[serde(flatten)]
    pub retry: RetryInfo,
    /// What is set up but not as the manifest asks (a field kubevol ignores).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
    /// What its CSI driver reports of its health, once it reported an adverse condition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<crate::report::health::VolumeHealth>,
}

/// The warnings of a volume's fields that kubevol ignores, in the API server's words.
fn unknown_field_warnings(ext: &kubevol_core::state::VolumeExtensions) -> Vec<String> {
    ext.unknown_fields
        .iter()
        .map(|f| format!("{f}: ignored"))
        .collect()
}

impl VolumeStatus {
    /// Whether the volume could not be processed (an unsupported type, a claim that is missing
    /// or unbound, a PersistentVolume of other nodes): nothing is retried, only a change to the
    /// pod or to the objects it reads can change it.
    pub fn not_processed(&self) -> bool {
        self.unique_name.is_none()
            && self.retry.last_error.is_some()
            && self.state != VolumePhase::Pending
    }
}

/// A volume's last failure and when it is tried again.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RetryInfo {
    /// The last error, naming what to change.
    pub last_error: Option<String>,
    /// Consecutive failures.
    pub failures: u32,
    /// Milliseconds until the next retry, while backing off.
    pub next_retry_ms: Option<u64>,
    /// The last error cannot clear without a change of the pod (or an object it reads) or of
    /// the node's configuration: it is not retried on a timer, only when those change.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub permanent: bool,
}

/// One pod.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PodStatus {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// UID.
    pub uid: String,
    /// Where the pod came from (manifest file and document, or the library API).
    pub source: String,
    /// Where its volumes stand.
    pub phase: PodPhase,
    /// Validation errors of a rejected pod, by field path.
    pub errors: Vec<String>,
    /// Its volumes.
    pub volumes: Vec<VolumeStatus>,
    /// Its recent events, oldest first.
    pub events: Vec<Event>,
    /// Fields it sets that kubevol's API types do not have (outside its volumes, whose own are
    /// their warnings; of a rejected pod, all): ignored.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

/// The whole report.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    /// The node's name.
    pub node_name: String,
    /// The root directory.
    pub root_dir: String,
    /// Whether the reconciler's states are synced (teardown allowed, first pass done).
    pub states_synced: bool,
    /// The pods.
    pub pods: Vec<PodStatus>,
    /// Manifest files with errors (file, document, line, column, message).
    pub manifest_errors: Vec<String>,
    /// Fields of manifest objects other than pods that kubevol's API types do not have
    /// (file, document, line, column, field and the field probably meant): ignored.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub manifest_warnings: Vec<String>,
    /// What else an operator should know about the sources: a source that cannot be read, the
    /// objects of kinds kubevol does not run, the pods assigned to other nodes.
    #[serde(default)]
    pub notes: Vec<String>,
    /// What reconstruction found at start.
    #[serde(default)]
    pub reconstruction: crate::reconstruct::Reconstruction,
    /// Orphaned pod directories that could not be removed, and why.
    #[serde(default)]
    pub leftovers: Vec<crate::reconstruct::Leftover>,
    /// The claims kubevol bound to PersistentVolumes (standalone mode), by claim.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bindings: Vec<BindingStatus>,
}

/// A claim kubevol bound, and to what.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BindingStatus {
    /// `namespace/name` of the claim.
    pub claim: String,
    /// The PersistentVolume.
    pub volume: String,
    /// `Bound`, or `Released` when the claim is gone (the volume keeps its data and stays
    /// the claim's: a claim of that name gets it back).
    pub phase: String,
}

impl std::fmt::Display for BindingStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} -> {}", self.claim, self.volume)?;
        if self.phase == "Released" {
            f.write_str(" (Released: the claim is gone; the volume keeps its data and is kept for a claim of that name)")?;
        }
        Ok(())
    }
}

/// What the status report is built from: read-only views of every part. Every lock it takes
/// is a short read; nothing is held across I/O.
pub(crate) struct Sources<'a> {
    /// Both states of world.
    pub(crate) world: &'a World,
    /// The last error and retry schedule of each key.
    pub(crate) executor: &'a Executor,
    /// Where each pod came from, and manifest errors.
    pub(crate) store: &'a ObjectStore,
    /// Plugin names to volume types.
    pub(crate) plugins: &'a PluginRegistry,
    /// Each pod's events.
    pub(crate) events: &'a EventRecorder,
    /// What CSI drivers report of their volumes' health.
    pub(crate) health: &'a crate::report::health::Health,
    /// What reconstruction and the orphan sweep found.
    pub(crate) findings: &'a Findings,
    /// The node's name.
    pub(crate) node_name: &'a str,
    /// The root directory.
    pub(crate) root_dir: &'a std::path::Path,
}

impl Sources<'_> {
    fn volume_type(&self, plugin: &str) -> String {
        self.plugins
            .by_name(plugin)
            .map(|p| p.source_field().to_string())
            .unwrap_or_else(|| plugin.to_string())
    }

    /// One pod's status, from both states of world and the executor's errors.
    pub(crate) fn pod(&self, uid: &PodUid, with_events: bool) -> Option<PodStatus> {
        let events = if with_events {
            self.events.for_pod(uid)
        } else {
            Vec::new()
        };
        let stored = self.store.pod(uid);
        let warnings = |volumes: bool| -> Vec<String> {
            let Some(p) = &stored else {
                return Vec::new();
            };
            let ext = &p.extensions;
            let of_volumes = ext
                .volumes
                .values()
                .flat_map(|v| &v.unknown_fields)
                .filter(|_| volumes);
            ext.unknown_fields
                .iter()
                .chain(of_volumes)
                .map(|f| format!("{f}: ignored"))
                .collect()
        };
        if let Some(r) = self.world.rejected().get(uid) {
            if self.world.dsw().pod(uid).is_none() {
                return Some(PodStatus {
                    warnings: warnings(true),
                    namespace: r.pod_ref.namespace.to_string(),
                    name: r.pod_ref.name.to_string(),
                    uid: uid.to_string(),
                    source: r.origin.to_string(),
                    phase: PodPhase::Rejected,
                    errors: r.errors.clone(),
                    volumes: Vec::new(),
                    events,
                });
            }
        }
        let now = Instant::now();
        let dsw = self.world.dsw();
        let asw = self.world.asw();
        let mut volumes = Vec::new();
        let mut errors = Vec::new();
        let (pod_ref, phase) = if let Some(dp) = dsw.pod(uid) {
            let mut all_mounted = true;
            let mut any_failed = dp.failed_to_process.values().any(|f| !f.waiting);
            for (outer, unique) in &dp.volumes {
                let desired = dsw.volume(unique);
                let plugin = desired.map(|v| v.traits.plugin.clone()).unwrap_or_default();
                let warnings = desired
                    .and_then(|v| v.pods.get(uid))
                    .map(|p| unknown_field_warnings(&p.spec.extensions))
                    .unwrap_or_default();
                let mounted = asw.pod_volume(unique, uid);
                let err = self.executor.last_error_for(unique, uid);
                let state = match (mounted.map(|m| m.state), &err) {
                    (Some(PodMountState::Mounted), _) => VolumePhase::Mounted,
                    (Some(PodMountState::Uncertain), _) => VolumePhase::Uncertain,
                    (None, Some(e)) if e.permanent => VolumePhase::Failed,
                    (None, Some(_)) => VolumePhase::Retrying,
                    (None, None) => VolumePhase::Pending,
                };
                all_mounted &= state == VolumePhase::Mounted;
                any_failed |= state == VolumePhase::Failed;
                volumes.push(VolumeStatus {
                    name: outer.to_string(),
                    type_: self.volume_type(&plugin),
                    unique_name: Some(unique.to_string()),
                    state,
                    path: mounted.map(handed_out),
                    read_only: mounted.is_some_and(|m| m.read_only),
                    retry: RetryInfo::from_error(err.as_ref(), now),
                    warnings,
                    health: self.health.volume(uid, outer),
                });
            }
            let stored = self.store.pod(uid);
            for (outer, failure) in &dp.failed_to_process {
                let type_ = stored
                    .as_ref()
                    .and_then(|p| p.pod.spec.as_ref())
                    .and_then(|s| s.volumes.as_ref())
                    .and_then(|vs| vs.iter().find(|v| &v.name == outer))
                    .and_then(|v| {
                        kubevol_core::validation::volume_source_names(v)
                            .first()
                            .copied()
                    })
                    .unwrap_or("unknown");
                volumes.push(VolumeStatus {
                    name: outer.clone(),
                    type_: type_.to_string(),
                    unique_name: None,
                    state: if failure.unsupported {
                        VolumePhase::Unsupported
                    } else if failure.waiting {
                        VolumePhase::Pending
                    } else {
                        VolumePhase::Failed
                    },
                    path: None,
                    read_only: false,
                    retry: RetryInfo {
                        last_error: Some(failure.message.clone()),
                        ..RetryInfo::default()
                    },
                    warnings: Vec::new(),
                    health: None,
                });
            }
            // A volume still waiting for an object the API server has not delivered keeps the
            // pod pending (it is neither mounted nor failed).
            let all_mounted = all_mounted && dp.failed_to_process.is_empty();
            let phase = if any_failed {
                PodPhase::Failed
            } else if all_mounted {
                PodPhase::Ready
            } else {
                PodPhase::Pending
            };
            (dp.pod_ref.clone(), phase)
        } else {
            let held = dsw.held(uid).map(str::to_string);
            let mut pod_ref = None;
            for (unique, m) in asw.pod_volumes(uid) {
                pod_ref = Some(m.pod_ref.clone());
                let err = self.executor.last_error_for(unique, uid);
                let state = match (&held, m.state) {
                    (None, _) => VolumePhase::Unmounting,
                    (Some(_), PodMountState::Mounted) => VolumePhase::Mounted,
                    (Some(_), _) => VolumePhase::Uncertain,
                };
                volumes.push(VolumeStatus {
                    name: m.outer_volume_name.to_string(),
                    type_: self.volume_type(
                        &asw.volume(unique)
                            .map(|v| v.traits.plugin.clone())
                            .unwrap_or_default(),
                    ),
                    unique_name: Some(unique.to_string()),
                    state,
                    path: Some(handed_out(m)),
                    read_only: m.read_only,
                    retry: RetryInfo::from_error(err.as_ref(), now),
                    warnings: Vec::new(),
                    health: self.health.volume(uid, &m.outer_volume_name),
                });
            }
            if let Some(why) = held {
                errors.push(why);
                (pod_ref?, PodPhase::Held)
            } else {
                (pod_ref?, PodPhase::Terminating)
            }
        };
        volumes.sort_by(|a, b| a.name.cmp(&b.name));
        Some(PodStatus {
            namespace: pod_ref.namespace.to_string(),
            name: pod_ref.name.to_string(),
            uid: uid.to_string(),
            source: match phase {
                PodPhase::Held => "the record (its manifest has errors)".to_string(),
                _ => self.store.pod_source(uid).to_string(),
            },
            phase,
            errors,
            volumes,
            events,
            warnings: warnings(false),
        })
    }

    /// The whole status report.
    pub(crate) fn report(&self, with_events: bool) -> StatusReport {
        // The flag first: once true, the desired state read below is complete. Read after the
        // pods, it could pair a listing from before the first sync with "synced".
        let states_synced = self.world.states_synced();
        let mut uids: BTreeSet<PodUid> = self
            .world
            .dsw()
            .pods()
            .map(|p| p.pod_ref.uid.clone())
            .collect();
        uids.extend(self.world.rejected().keys().cloned());
        uids.extend(self.world.asw().pods().cloned());
        let mut pods: Vec<PodStatus> = uids
            .iter()
            .filter_map(|u| self.pod(u, with_events))
            .collect();
        pods.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        StatusReport {
            node_name: self.node_name.to_string(),
            root_dir: self.root_dir.display().to_string(),
            states_synced,
            pods,
            manifest_errors: self
                .store
                .file_errors()
                .iter()
                .map(|e| e.to_string())
                .collect(),
            manifest_warnings: self
                .store
                .file_warnings()
                .iter()
                .map(|e| e.to_string())
                .collect(),
            notes: self.notes(),
            reconstruction: self.findings.reconstruction(),
            leftovers: self.findings.leftovers(),
            bindings: self
                .store
                .bindings()
                .all()
                .into_iter()
                .map(|b| BindingStatus {
                    phase: match self.store.persistent_volume_claim(&b.namespace, &b.claim) {
                        Some(c) if crate::store::claim_uid(&c.object) == b.uid => "Bound".into(),
                        _ => "Released".into(),
                    },
                    claim: format!("{}/{}", b.namespace, b.claim),
                    volume: b.volume,
                })
                .collect(),
        }
    }

    /// Sources that cannot be read, and what the sources hold that kubevol does not mount.
    fn notes(&self) -> Vec<String> {
        let mut notes = self.store.source_problems();
        let file = |p: &std::path::Path| {
            p.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        };
        let skipped: Vec<String> = self
            .store
            .skipped_objects()
            .iter()
            .map(|(path, o)| {
                let name = if o.namespace.is_empty() {
                    o.name.clone()
                } else {
                    format!("{}/{}", o.namespace, o.name)
                };
                format!("{} {name} ({})", o.kind, file(path))
            })
            .collect();
        if !skipped.is_empty() {
            notes.push(format!(
                "{} object{} of kinds kubevol does not run: {}",
                skipped.len(),
                if skipped.len() == 1 { "" } else { "s" },
                skipped.join(", ")
            ));
        }
        let elsewhere: Vec<String> = self
            .store
            .pods()
            .into_iter()
            .filter(|(_, p)| !crate::store::is_for_node(&p.pod, self.node_name))
            .map(|(_, p)| {
                let node = p
                    .pod
                    .spec
                    .as_ref()
                    .and_then(|s| s.node_name.clone())
                    .unwrap_or_default();
                format!(
                    "{}/{} (node {node}, {})",
                    p.pod.metadata.namespace.as_deref().unwrap_or_default(),
                    p.pod.metadata.name.as_deref().unwrap_or_default(),
                    p.origin()
                )
            })
            .collect();
        if !elsewhere.is_empty() {
            notes.push(format!(
                "{} pod{} assigned to other nodes skipped (this node is {}): {}",
                elsewhere.len(),
                if elsewhere.len() == 1 { "" } else { "s" },
                self.node_name,
                elsewhere.join(", ")
            ));
        }
        notes
    }
}

impl RetryInfo {
    fn from_error(err: Option<&LastError>, now: Instant) -> Self {
        RetryInfo {
            last_error: err.map(|e| e.message.clone()),
            failures: err.map(|e| e.failures).unwrap_or(0),
            next_retry_ms: err
                .filter(|e| e.retry_at > now && !e.permanent)
                .map(|e| (e.retry_at - now).as_millis() as u64),
            permanent: err.is_some_and(|e| e.permanent),
        }
    }
}

/// What the runtime is handed for a mounted volume: its path, or an image volume's reference
/// (nothing is made on the node for it).
fn handed_out(m: &kubevol_core::state::MountedPodVolume) -> String {
    match crate::plugins::image::source(&m.spec) {
        Some(image) => format!("image {}", image.reference.as_deref().unwrap_or_default()),
        None => m.path.display().to_string(),
    }
}
