//! `describe`: for each volume of a pod, the chain of what it depends on and where each step
//! stands, with the step it is stuck on and what to do about it; and the node's summary. Built
//! from the same read views as the status report, and the status report's pod underneath.

use kubevol_core::affinity;
use kubevol_core::state::{DeviceMountState, PodMountState};
use kubevol_core::{PodRef, PodUid};
use serde::{Deserialize, Serialize};

use super::status::{PodPhase, PodStatus, StatusReport, VolumePhase};

/// Where one step of a volume's chain stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StepState {
    /// Done.
    Done,
    /// Not done yet, and nothing failed: it waits for something (or its turn).
    Waiting,
    /// It failed; the volume is stuck here.
    Failed,
}

/// One step of a volume's chain: a source object, the driver, attach, stage, set-up.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Step {
    /// What the step is (`ConfigMap default/app`, `claim`, `driver`, `attach`, ...).
    pub step: String,
    /// Where it stands.
    pub state: StepState,
    /// What it is, or found (`bound to PersistentVolume pv-1`, a path).
    pub detail: String,
    /// Its last error, if it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One volume's chain.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeChain {
    /// The volume's name in the pod's spec.
    pub volume: String,
    /// Whether it is ready.
    pub ready: bool,
    /// When it is not: the step it is stuck on or waits at, and what to do.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting_for: Option<String>,
    /// Its steps, in the order they are taken.
    pub steps: Vec<Step>,
}

/// A pod, described.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PodDescription {
    /// The pod's status (source, phase, volumes with their retries, events, warnings).
    pub status: PodStatus,
    /// Each volume's chain.
    pub chains: Vec<VolumeChain>,
}

/// The node, described.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeDescription {
    /// The node's name.
    pub node_name: String,
    /// The root directory.
    pub root_dir: String,
    /// Whether every source has listed its pods and the first full reconcile is done.
    pub states_synced: bool,
    /// The pod sources, and whether each has delivered its first listing.
    pub sources: Vec<(String, bool)>,
    /// What the sources cannot deliver now, and other notes.
    pub notes: Vec<String>,
    /// The CSI drivers (as `/api/v1/drivers` shows them).
    pub drivers: Vec<serde_json::Value>,
    /// How many pods are in each phase.
    pub pods_by_phase: Vec<(String, usize)>,
    /// How many volumes are in each state.
    pub volumes_by_state: Vec<(String, usize)>,
    /// The volumes that are not ready, each with its one-line reason (`ns/pod volume: why`).
    pub not_ready: Vec<String>,
    /// Manifest errors.
    pub manifest_errors: Vec<String>,
    /// The volumes this node reports in use (its Node's `status.volumesInUse`, in cluster mode).
    pub volumes_in_use: Vec<String>,
    /// The volumes attached to this node.
    pub volumes_attached: Vec<String>,
    /// What reconstruction found at start.
    pub reconstruction: crate::reconstruct::Reconstruction,
    /// Orphaned pod directories kept.
    pub leftovers: Vec<crate::reconstruct::Leftover>,
}

fn step(step: impl Into<String>, state: StepState, detail: impl Into<String>) -> Step {
    Step {
        step: step.into(),
        state,
        detail: detail.into(),
        error: None,
    }
}

impl super::status::Sources<'_> {
    /// The pod `uid`, described; `None` if no state of world knows it.
    pub(crate) fn describe_pod(
        &self,
        uid: &PodUid,
        host: &crate::plugins::PluginHost,
    ) -> Option<PodDescription> {
        let status = self.pod(uid, true)?;
        let stored = self.store.pod(uid);
        let namespace = status.namespace.clone();
        let pref = PodRef {
            namespace: namespace.as_str().into(),
            name: status.name.as_str().into(),
            uid: uid.clone(),
        };
        let mut chains = Vec::new();
        for v in &status.volumes {
            let mut steps = Vec::new();
            let spec_volume = stored.as_ref().and_then(|s| {
                s.pod
                    .spec
                    .as_ref()?
                    .volumes
                    .as_ref()?
                    .iter()
                    .find(|x| x.name == v.name)
                    .cloned()
            });
            if let Some(sv) = &spec_volume {
                let pod = stored.as_ref().map(|s| &*s.pod);
                self.source_steps(sv, pod, &pref, host, &mut steps);
            }
            let unique = v
                .unique_name
                .clone()
                .map(kubevol_core::UniqueVolumeName::from);
            let (asw_volume, desired) = match &unique {
                Some(u) => (
                    self.world.asw().volume(u).cloned(),
                    self.world.dsw().volume(u).cloned(),
                ),
                None => (None, None),
            };
            let traits = asw_volume
                .as_ref()
                .map(|a| a.traits.clone())
                .or_else(|| desired.as_ref().map(|d| d.traits.clone()));
            let device_error = unique.as_ref().and_then(|u| {
                self.executor
                    .last_error(&kubevol_core::reconcile::OperationKey {
                        volume: u.clone(),
                        pod: None,
                    })
                    .map(|e| e.message)
            });
            if let Some(t) = &traits {
                if t.plugin.as_str() == crate::plugins::csi::PLUGIN_NAME {
                    let driver = spec_volume
                        .as_ref()
                        .and_then(|sv| csi_driver(sv, desired.as_ref()))
                        .unwrap_or_default();
                    let registered = host.csi.status().into_iter().find(|d| d.name == driver);
                    steps.push(match registered {
                        Some(d) => {
                            let how = match &d.source {
                                crate::csi::DriverSource::Registration { socket, version } => {
                                    format!("through {} (CSI {version})", socket.display())
                                }
                                crate::csi::DriverSource::CommandLine => "by --csi-driver".into(),
                            };
                            let c = &d.capabilities;
                            let caps: Vec<&str> = [
                                (c.stage_unstage_volume, "STAGE_UNSTAGE_VOLUME"),
                                (c.get_volume_stats, "GET_VOLUME_STATS"),
                                (c.expand_volume, "EXPAND_VOLUME"),
                                (c.volume_mount_group, "VOLUME_MOUNT_GROUP"),
                                (c.single_node_multi_writer, "SINGLE_NODE_MULTI_WRITER"),
                                (c.get_volume_health, "GET_VOLUME_HEALTH"),
                                (c.get_storage_health, "GET_STORAGE_HEALTH"),
                            ]
                            .into_iter()
                            .filter_map(|(on, name)| on.then_some(name))
                            .collect();
                            step(
                                format!("driver {driver}"),
                                StepState::Done,
                                format!(
                                    "registered {how}, endpoint {}, node ID {}, capabilities [{}], {}",
                                    d.endpoint,
                                    d.node_id,
                                    caps.join(", "),
                                    d.health
                                ),
                            )
                        }
                        None => step(
                            format!("driver {driver}"),
                            StepState::Waiting,
                            "not registered: start the driver's node plugin (its registration socket in <root>/plugins_registry) or pass --csi-driver",
                        ),
                    });
                }
                if self.world.reported_in_use_required() && t.node_wide() {
                    let reported = desired.as_ref().is_some_and(|d| d.reported_in_use);
                    steps.push(if reported {
                        step("reported in use", StepState::Done, "listed in this node's status.volumesInUse")
                    } else {
                        step(
                            "reported in use",
                            StepState::Waiting,
                            "waiting for this node's status.volumesInUse to list it: the attach/detach controller attaches it only then",
                        )
                    });
                }
                let attached = asw_volume.as_ref().is_some_and(|a| a.attached);
                let staged = asw_volume
                    .as_ref()
                    .is_some_and(|a| a.device_state == DeviceMountState::Mounted);
                if t.attachable {
                    let mut s = step(
                        "attach",
                        if attached {
                            StepState::Done
                        } else {
                            StepState::Waiting
                        },
                        if attached {
                            "attached".to_string()
                        } else {
                            "not attached yet".to_string()
                        },
                    );
                    if !attached {
                        if let Some(e) = &device_error {
                            s.state = StepState::Failed;
                            s.error = Some(e.clone());
                        }
                    }
                    steps.push(s);
                }
                if t.device_mountable {
                    let path = asw_volume
                        .as_ref()
                        .and_then(|a| a.device_mount_path.clone())
                        .map(|p| p.display().to_string())
                        .unwrap_or_default();
                    let mut s = step(
                        "stage",
                        if staged {
                            StepState::Done
                        } else {
                            StepState::Waiting
                        },
                        if staged {
                            format!("mounted at {path}")
                        } else {
                            "not staged yet".into()
                        },
                    );
                    if !staged && (attached || !t.attachable) {
                        if let Some(e) = &device_error {
                            s.state = StepState::Failed;
                            s.error = Some(e.clone());
                        }
                    }
                    steps.push(s);
                }
            }
            // The SELinux label: of the mount as it is (kept across restarts by the record),
            // else as wanted.
            let uid = PodUid::from(status.uid.as_str());
            let selinux_spec = asw_volume
                .as_ref()
                .and_then(|a| a.pods.get(&uid).map(|m| m.spec.clone()))
                .or_else(|| {
                    desired
                        .as_ref()
                        .and_then(|d| d.pods.get(&uid).map(|p| p.spec.clone()))
                });
            if let Some(label) = selinux_spec.as_ref().and_then(|s| s.selinux_label.clone()) {
                let mounted = selinux_spec.as_ref().is_some_and(|s| s.selinux_mount);
                steps.push(step(
                    "SELinux",
                    StepState::Done,
                    if mounted {
                        format!("mounted with -o context=\"{label}\"")
                    } else {
                        format!("label {label}, not used for the mount (only ReadWriteOncePod volumes are mounted with their label unless --selinux-mount): the container runtime relabels the files")
                    },
                ));
            }
            let mounted = asw_volume
                .as_ref()
                .and_then(|a| a.pods.get(&uid))
                .map(|m| (m.state, m.path.clone(), m.sub_paths.clone()));
            let tearing_down = v.state == VolumePhase::Unmounting;
            let mut set_up = match (&mounted, tearing_down) {
                (Some((_, path, _)), true) => step(
                    "tear down",
                    StepState::Waiting,
                    format!("still mounted at {}", path.display()),
                ),
                (Some((PodMountState::Mounted, path, _)), false) => {
                    step("set up", StepState::Done, path.display().to_string())
                }
                (Some((_, path, _)), false) => step(
                    "set up",
                    StepState::Waiting,
                    format!(
                        "uncertain at {} (set up again or torn down)",
                        path.display()
                    ),
                ),
                (None, _) => step("set up", StepState::Waiting, "not set up yet"),
            };
            let last_ok = unique.as_ref().and_then(|u| {
                self.executor
                    .last_success(&kubevol_core::reconcile::OperationKey {
                        volume: u.clone(),
                        pod: Some(PodUid::from(status.uid.as_str())),
                    })
            });
            if let (StepState::Done, Some(at)) = (set_up.state, last_ok) {
                let ago = at.elapsed().unwrap_or_default().as_secs();
                set_up
                    .detail
                    .push_str(&format!(" (set up or written {ago}s ago)"));
            }
            if v.state != VolumePhase::Mounted {
                // The node-wide step's error is its own, not the set-up's.
                let own = v
                    .retry
                    .last_error
                    .as_ref()
                    .filter(|e| Some(*e) != device_error.as_ref());
                if let Some(e) = own {
                    set_up.state = StepState::Failed;
                    set_up.error = Some(e.clone());
                }
            }
            let set_up_done = set_up.state == StepState::Done;
            steps.push(set_up);
            if let (Some(t), Some(pod)) = (&traits, stored.as_ref().map(|s| &s.pod)) {
                if let Some(mut detail) =
                    fs_group_step(t.plugin.as_str(), pod, desired.as_ref(), host)
                {
                    let uid = PodUid::from(status.uid.as_str());
                    if let Some(p) = host.ownership.progress(&uid, &v.name) {
                        detail = format!(
                            "fsGroup {}: being applied by kubevol: {} files and directories so far, for {} s",
                            p.gid,
                            p.entries,
                            p.started.elapsed().as_secs()
                        );
                    }
                    let state = if set_up_done {
                        StepState::Done
                    } else {
                        StepState::Waiting
                    };
                    steps.push(step("fsGroup", state, detail));
                }
            }
            if let Some(u) = host.usages.get(&PodUid::from(status.uid.as_str()), &v.name) {
                let ago = u.at.and_then(|t| t.elapsed().ok()).unwrap_or_default();
                let detail = format!(
                    "{} bytes in {} inodes, measured by {} {} s ago (of {} bytes, {} free)",
                    u.used_bytes,
                    u.inodes_used,
                    u.by.as_str(),
                    ago.as_secs(),
                    u.capacity_bytes,
                    u.available_bytes,
                );
                steps.push(step("usage", StepState::Done, detail));
            }
            if let Some((_, _, subs)) = &mounted {
                for sp in subs {
                    steps.push(step(
                        format!(
                            "subPath of container {:?}, volumeMounts[{}]",
                            sp.container, sp.index
                        ),
                        StepState::Done,
                        sp.path.display().to_string(),
                    ));
                }
            }
            if let Some(h) = &v.health {
                let since = crate::report::health::rfc3339(h.since);
                let mut s = step(
                    "health",
                    StepState::Done,
                    format!("no adverse condition reported since {since} (it had some before)"),
                );
                if !h.conditions.is_empty() {
                    let conditions: Vec<String> =
                        h.conditions.iter().map(|c| c.to_string()).collect();
                    s.state = StepState::Failed;
                    s.detail =
                        format!("as its driver reports it (NodeGetVolumeHealth) since {since}");
                    s.error = Some(conditions.join("; "));
                }
                steps.push(s);
            }
            let ready = v.state == VolumePhase::Mounted;
            let waiting_for = (!ready).then(|| {
                // The first step not done is where the volume stands; a later step's error says
                // what the last attempt met.
                let first = steps.iter().position(|s| s.state != StepState::Done);
                match first.map(|i| (&steps[i], &steps[i + 1..])) {
                    Some((s, _)) if s.error.is_some() => {
                        format!("{}: {}", s.step, s.error.as_deref().unwrap_or_default())
                    }
                    Some((s, later)) => match later.iter().find_map(|l| l.error.as_ref()) {
                        Some(e) => format!("{}: {}; last error: {e}", s.step, s.detail),
                        None => format!("{}: {}", s.step, s.detail),
                    },
                    None => v
                        .retry
                        .last_error
                        .clone()
                        .unwrap_or_else(|| format!("{:?}", v.state)),
                }
            });
            chains.push(VolumeChain {
                volume: v.name.clone(),
                ready,
                waiting_for,
                steps,
            });
        }
        Some(PodDescription { status, chains })
    }

    /// The steps of what a volume reads: its ConfigMaps and Secrets, or its claim and
    /// PersistentVolume.
    fn source_steps(
        &self,
        v: &k8s_openapi::api::core::v1::Volume,
        pod: Option<&k8s_openapi::api::core::v1::Pod>,
        pref: &PodRef,
        host: &crate::plugins::PluginHost,
        steps: &mut Vec<Step>,
    ) {
        let namespace = &*pref.namespace;
        let object = |kind: &str, name: &str, optional: bool, present: Option<String>| {
            let what = format!("{kind} {namespace}/{name}");
            match (present, optional) {
                (Some(found), _) => step(what, StepState::Done, found),
                (None, true) => step(
                    what,
                    StepState::Done,
                    "missing, optional: mounted without it",
                ),
                (None, false) => step(
                    what,
                    StepState::Waiting,
                    self.store.absence(kind, namespace, name),
                ),
            }
        };
        // Where the object in effect came from, and its version when the API server gave one.
        let found = |origin: &crate::store::Origin, version: Option<&String>| match version {
            Some(v) => format!("present (from the {origin}, resourceVersion {v})"),
            None => format!("present (from {origin})"),
        };
        let cm = |name: &str, optional: Option<bool>| {
            let present = self
                .store
                .config_map(namespace, name)
                .map(|s| found(&s.origin, s.object.metadata.resource_version.as_ref()));
            object("ConfigMap", name, optional.unwrap_or(false), present)
        };
        let secret = |name: &str, optional: Option<bool>| {
            let present = self
                .store
                .secret(namespace, name)
                .map(|s| found(&s.origin, s.object.metadata.resource_version.as_ref()));
            object("Secret", name, optional.unwrap_or(false), present)
        };
        if let Some(c) = &v.config_map {
            steps.push(cm(&c.name, c.optional));
        }
        if let Some(s) = &v.secret {
            steps.push(secret(
                s.secret_name.as_deref().unwrap_or_default(),
                s.optional,
            ));
        }
        if let Some(p) = &v.projected {
            for src in p.sources.iter().flatten() {
                if let Some(c) = &src.config_map {
                    steps.push(cm(&c.name, c.optional));
                }
                if let Some(s) = &src.secret {
                    steps.push(secret(&s.name, s.optional));
                }
            }
        }
        let Some(name) = kubevol_core::names::claim_name(&pref.name, v) else {
            return;
        };
        let name = &*name;
        let what = format!("claim {namespace}/{name}");
        // Resolved as the populator resolves it (a claim of the manifests may name its volume
        // by the volume's claimRef; one of the API server must be bound).
        let usage = pod
            .map(|p| crate::populator::claims::usage(p, &v.name))
            .unwrap_or_default();
        let pv = match crate::populator::claims::resolve(self.store, pref, v, usage) {
            Ok(pv) => pv,
            Err(why) => {
                let waits = crate::populator::claims::waits_for_others(self.store, pref, v)
                    || self
                        .store
                        .persistent_volume_claim(namespace, name)
                        .is_none();
                let state = if waits {
                    StepState::Waiting
                } else {
                    StepState::Failed
                };
                steps.push(step(what, state, why));
                return;
            }
        };
        let pv_name = pv.metadata.name.clone().unwrap_or_default();
        steps.push(step(
            what,
            StepState::Done,
            format!("bound to PersistentVolume {pv_name}"),
        ));
        let spec = pv.spec.clone().unwrap_or_default();
        let source = crate::populator::persistent_volume_type(&pv);
        let modes = spec.access_modes.clone().unwrap_or_default().join(",");
        let capacity = spec
            .capacity
            .as_ref()
            .and_then(|c| c.get("storage"))
            .map(|q| q.0.clone())
            .unwrap_or_default();
        let mut detail = format!("{source}, access modes {modes}, capacity {capacity}");
        let mut state = StepState::Done;
        if let Some(required) = spec
            .node_affinity
            .as_ref()
            .and_then(|a| a.required.as_ref())
        {
            let node = host.node_facts();
            let matches = affinity::matches(required, &node);
            detail.push_str(&format!(
                ", nodeAffinity {} ({})",
                affinity::describe(required),
                if matches {
                    "this node matches"
                } else {
                    "this node does not match"
                }
            ));
            if !matches {
                state = StepState::Failed;
            }
        }
        steps.push(step(format!("PersistentVolume {pv_name}"), state, detail));
    }

    /// The node, described.
    pub(crate) fn describe_node(
        &self,
        report: StatusReport,
        drivers: Vec<crate::csi::DriverStatus>,
    ) -> NodeDescription {
        let mut phases = std::collections::BTreeMap::<String, usize>::new();
        let mut states = std::collections::BTreeMap::<String, usize>::new();
        let mut not_ready = Vec::new();
        for p in &report.pods {
            *phases.entry(p.phase.to_string()).or_default() += 1;
            if p.phase == PodPhase::Rejected || p.phase == PodPhase::Held {
                not_ready.push(format!(
                    "{}/{}: {} ({})",
                    p.namespace,
                    p.name,
                    p.phase,
                    p.errors.join("; ")
                ));
            }
            for v in &p.volumes {
                *states.entry(format!("{:?}", v.state)).or_default() += 1;
                if v.state != VolumePhase::Mounted {
                    let why = v
                        .retry
                        .last_error
                        .clone()
                        .unwrap_or_else(|| format!("{:?}", v.state));
                    not_ready.push(format!(
                        "{}/{} volume {}: {why}",
                        p.namespace, p.name, v.name
                    ));
                }
            }
        }
        let asw = self.world.asw();
        let volumes_attached = asw
            .volumes()
            .filter(|v| v.traits.attachable && v.attached)
            .map(|v| v.name.to_string())
            .collect();
        drop(asw);
        NodeDescription {
            node_name: report.node_name.clone(),
            root_dir: report.root_dir.clone(),
            states_synced: report.states_synced,
            sources: self.store.sources(),
            notes: report.notes.clone(),
            drivers: drivers
                .iter()
                .filter_map(|d| serde_json::to_value(d).ok())
                .collect(),
            pods_by_phase: phases.into_iter().collect(),
            volumes_by_state: states.into_iter().collect(),
            not_ready,
            manifest_errors: report.manifest_errors.clone(),
            volumes_in_use: self
                .world
                .volumes_in_use()
                .iter()
                .map(|v| v.to_string())
                .collect(),
            volumes_attached,
            reconstruction: report.reconstruction.clone(),
            leftovers: report.leftovers.clone(),
        }
    }
}

/// Who applies the pod's fsGroup to a volume of `plugin`, as its set-up decides; `None` when
/// the pod sets none.
fn fs_group_step(
    plugin: &str,
    pod: &k8s_openapi::api::core::v1::Pod,
    desired: Option<&kubevol_core::state::DesiredVolume>,
    host: &crate::plugins::PluginHost,
) -> Option<String> {
    use crate::plugins::{csi, empty_dir, local, ContentKind};
    let (gid, _) = crate::plugins::fs_group(pod)?;
    if plugin == csi::PLUGIN_NAME {
        let spec = desired?.pods.values().next()?.spec.clone();
        return csi::fs_group_decision(host, &spec, pod);
    }
    let content = ContentKind::ALL.iter().any(|k| k.plugin_name() == plugin);
    Some(
        if plugin == empty_dir::PLUGIN_NAME || plugin == local::PLUGIN_NAME {
            format!("fsGroup {gid}: applied by kubevol at set-up")
        } else if content {
            format!("fsGroup {gid}: the files are written with group {gid}")
        } else {
            format!("fsGroup {gid}: not applied to this type (a host path keeps its owner)")
        },
    )
}

/// The CSI driver a volume uses: its inline `csi.driver`, or its PersistentVolume's.
fn csi_driver(
    v: &k8s_openapi::api::core::v1::Volume,
    desired: Option<&kubevol_core::state::DesiredVolume>,
) -> Option<String> {
    if let Some(c) = &v.csi {
        return Some(c.driver.clone());
    }
    let spec = desired?.pods.values().next()?.spec.clone();
    let pv = spec.persistent_volume.as_ref()?;
    Some(pv.spec.as_ref()?.csi.as_ref()?.driver.clone())
}
