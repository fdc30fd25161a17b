//! The desired-state populator: turns the pods in the store into the desired state of world.
//!
//! It is woken by every store change (never polls), processes only pods whose object changed,
//! and holds the only [`DswWriter`]. An invalid pod is rejected whole before anything touches
//! disk; if an earlier valid version of it is already desired, that version stays (a bad edit
//! never takes volumes away). Volumes no container uses are skipped, as the kubelet does.

pub mod claims;
mod pace;
pub use pace::CONTENT_EVERY;
mod selinux;
mod storage;
mod versions;

use std::collections::{BTreeMap, BTreeSet};

use kubevol_core::collections::{HashMap, HashSet};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kubevol_core::state::{
    DesiredPodVolume, PodVolumeRef, PodVolumeWish, ProcessFailure, VolumeSpec,
};
use kubevol_core::validation::{all_containers, validate_pod, volume_source_names};
use kubevol_core::PodUid;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::debug;

use crate::events::{reason, EventRecorder};
use crate::operations::executor::Executor;
use crate::plugins::{PluginHost, PluginRegistry};
pub use crate::store::{is_for_node, is_terminated, pod_ref};
use crate::store::{ObjectKey, ObjectStore, StoredPod};
use crate::world::{DswWriter, Rejected};
pub(crate) use storage::persistent_volume_type;
use storage::{storage_check, Refusal};
pub(crate) use versions::Seen;
use versions::{object_versions, ANY_PERSISTENT_VOLUME};

/// The volumes a pod's containers mount or map: only these are set up.
pub fn used_volume_names(pod: &Pod) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (_, c) in all_containers(pod) {
        out.extend(c.volume_mounts.iter().flatten().map(|m| m.name.clone()));
        out.extend(c.volume_devices.iter().flatten().map(|d| d.name.clone()));
    }
    out
}

/// The populator: what it reads, the DSW it writes, and what it remembers between passes.
pub struct Populator {
    store: Arc<ObjectStore>,
    dsw: DswWriter,
    plugins: PluginRegistry,
    host: Arc<PluginHost>,
    events: Arc<EventRecorder>,
    /// Backoff of a pod's operations is reset when an object it reads changes.
    executor: Arc<Executor>,
    node_name: String,
    /// The last content generation handed out (see `DesiredPodVolume::content_generation`).
    content_generation: u64,
    /// Pods to process again though nothing of theirs changed (their tokens are due).
    refreshes: tokio::sync::mpsc::UnboundedReceiver<PodUid>,
    seen: HashMap<PodUid, Seen>,
    /// The pods that read each object (by the keys of `seen`): a change of the object touches
    /// only them.
    readers: HashMap<ObjectKey, HashSet<PodUid>>,
    /// Pods to process in the next pass whatever changed (refreshes).
    due: BTreeSet<PodUid>,
    /// The pace of content rewrites: changes of a ConfigMap or Secret held back to its turn.
    pace: pace::Pace,
    /// The pace of each content volume's rewrites, whatever asks for them.
    volume_pace: pace::VolumePace,
    /// The content volumes held back whose turn has come: written again when their pod is
    /// processed in this pass.
    rewrite_now: HashMap<PodUid, HashSet<String>>,
    /// Pods whose fetched content (tokens, trust bundles, certificates) is due: their volumes
    /// that read such content are written again.
    fetch_due: HashSet<PodUid>,
    /// The next pass looks at every pod (the first one, and the one after a panic).
    full_pass_due: bool,
    /// Pods recorded at start from a manifest file that have not come back yet: while their
    /// file has errors they are held (their volumes kept as recorded).
    recorded: crate::reconstruct::RecordedFiles,
}

impl Populator {
    /// A populator of `dsw` from `store`.
    pub fn new(
        store: Arc<ObjectStore>,
        dsw: DswWriter,
        plugins: PluginRegistry,
        host: Arc<PluginHost>,
        events: Arc<EventRecorder>,
        executor: Arc<Executor>,
        refreshes: tokio::sync::mpsc::UnboundedReceiver<PodUid>,
    ) -> Self {
        Populator {
            store,
            node_name: host.node_name.clone(),
            dsw,
            plugins,
            host,
            events,
            executor,
            content_generation: 0,
            refreshes,
            seen: HashMap::default(),
            readers: HashMap::default(),
            due: BTreeSet::new(),
            pace: pace::Pace::default(),
            volume_pace: pace::VolumePace::default(),
            rewrite_now: HashMap::default(),
            fetch_due: HashSet::default(),
            full_pass_due: true,
            recorded: Default::default(),
        }
    }

    /// Rewrites the volumes of one ConfigMap or Secret at most once per `every`.
    pub(crate) fn pacing(mut self, every: std::time::Duration) -> Self {
        self.pace = pace::Pace::every(every);
        self.volume_pace = pace::VolumePace::every(every);
        self
    }

    /// Holds the volumes of pods recorded from a manifest file while that file has errors and
    /// the pod has not come back (`files`: what reconstruction found in the record).
    pub(crate) fn holding(mut self, files: crate::reconstruct::RecordedFiles) -> Self {
        self.recorded = files;
        self
    }

    /// Brings the held pods up to date: a recorded pod that came back, or whose file reads
    /// without errors (and so no longer defines it), is no longer held, for good.
    fn update_held(&mut self) {
        if self.recorded.is_empty() {
            return;
        }
        let broken: BTreeSet<std::path::PathBuf> = self
            .store
            .file_errors()
            .into_iter()
            .map(|e| e.path)
            .collect();
        let store = &self.store;
        self.recorded
            .retain(|uid, (_, file)| store.pod(uid).is_none() && broken.contains(file));
        let held = self
            .recorded
            .iter()
            .map(|(uid, (pod, file))| {
                let why = format!(
                    "pod {}/{} is kept as last recorded: its manifest {} has errors; its volumes stay until the file is fixed (or removed)",
                    pod.namespace,
                    pod.name,
                    file.display()
                );
                (uid.clone(), why)
            })
            .collect();
        self.dsw.set_held(held);
    }

    /// Runs until `stop` says so: a pass on every store change. A pass that panics (a bug hit
    /// by one input) is reported and the next change gets a new one.
    pub async fn run(mut self, mut stop: watch::Receiver<bool>) {
        let mut store_rx = self.store.subscribe();
        loop {
            store_rx.borrow_and_update();
            if *stop.borrow_and_update() {
                return;
            }
            let pass = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.sync()));
            match pass {
                Ok(true) => self.dsw.world().wake_reconciler(),
                Ok(false) => {}
                Err(_) => {
                    tracing::error!(
                        "the populator panicked in a pass; the next store change starts a new one"
                    );
                    self.seen.clear();
                    self.readers.clear();
                    self.full_pass_due = true;
                }
            }
            // The status report shows manifest errors too: status watchers hear of every
            // store change.
            self.dsw.world().announce();
            let held_back = [self.pace.next(), self.volume_pace.next()]
                .into_iter()
                .flatten()
                .min();
            tokio::select! {
                r = store_rx.changed() => if r.is_err() { return },
                // A change held back to its object's turn.
                () = tokio::time::sleep_until(held_back.unwrap_or_else(Instant::now)), if held_back.is_some() => {}
                Some(uid) = self.refreshes.recv() => {
                    self.refresh(uid);
                    while let Ok(uid) = self.refreshes.try_recv() {
                        self.refresh(uid);
                    }
                }
                _ = stop.changed() => return,
            }
        }
    }
}

/// How many pods a pass changes before it wakes the reconciler, which then starts their
/// operations while the pass goes on (a manifest of a thousand pods is not processed whole
/// before the first mount).
const WAKE_EVERY: usize = 64;

/// The pods a pass changed since it last woke the reconciler.
#[derive(Default)]
struct Wake(usize);

impl Wake {
    /// Counts one pod's sync; says whether the reconciler is due a wake-up now.
    fn count(&mut self, changed: bool) -> bool {
        self.0 += usize::from(changed);
        if self.0 < WAKE_EVERY {
            return false;
        }
        self.0 = 0;
        true
    }

    /// `sync` (one pod's sync) and, every [`WAKE_EVERY`] changed pods, a wake-up.
    fn after(&mut self, p: &mut Populator, sync: impl FnOnce(&mut Populator) -> bool) -> bool {
        let changed = sync(p);
        if self.count(changed) {
            p.dsw.world().wake_reconciler();
        }
        changed
    }
}

impl Populator {
    /// One pass: the pods the store's changes touch (their own changes, and changes of the
    /// objects they read), or every pod when anything may have changed. Returns whether the
    /// DSW changed (the reconciler must look).
    fn sync(&mut self) -> bool {
        // Read the sync flag before the pods: if it is true, this listing is complete.
        let sources_synced = self.store.all_sources_synced();
        let (keys, everything) = self.store.take_changes();
        let mut changed = false;
        // Content volumes held back whose turn has come: their pods are processed now.
        for (uid, volume) in self.volume_pace.due(Instant::now()) {
            self.due.insert(uid.clone());
            self.rewrite_now.entry(uid).or_default().insert(volume);
        }
        if everything || std::mem::take(&mut self.full_pass_due) {
            let pods = self.store.pods();
            let listed: HashSet<&PodUid> = pods.iter().map(|(uid, _)| uid).collect();
            let gone: Vec<PodUid> = self
                .seen
                .keys()
                .filter(|u| !listed.contains(u))
                .cloned()
                .collect();
            let mut wake = Wake::default();
            for (uid, stored) in &pods {
                changed |= wake.after(self, |p| p.sync_pod(uid, Some(stored)));
            }
            for uid in gone {
                changed |= wake.after(self, |p| p.sync_pod(&uid, None));
            }
            self.due.clear();
        } else {
            let mut touched: BTreeSet<PodUid> = std::mem::take(&mut self.due);
            let now = Instant::now();
            for key in keys {
                match key {
                    ObjectKey::Pod(uid) => {
                        touched.insert(uid);
                    }
                    other
                        if !self
                            .pace
                            .admit(&other, now, self.store.holds_content(&other)) =>
                    {
                        self.dsw.world().count_rewrite_held();
                    }
                    other => {
                        if matches!(other, ObjectKey::PersistentVolume(_)) {
                            touched.extend(self.readers_of(&ANY_PERSISTENT_VOLUME));
                        }
                        touched.extend(self.readers_of(&other));
                    }
                }
            }
            // Changes held back whose object's turn has come: its readers see the store's
            // version now, the latest.
            for key in self.pace.due(now) {
                touched.extend(self.readers_of(&key));
            }
            let mut wake = Wake::default();
            for uid in touched {
                let stored = self.store.pod(&uid);
                changed |= wake.after(self, |p| p.sync_pod(&uid, stored.as_ref()));
            }
        }
        if sources_synced {
            self.update_held();
            if self.dsw.mark_synced() {
                changed = true;
            }
        }
        changed
    }

    /// Brings one pod's wishes up to date with the store's pod (`None`: it is gone). Returns
    /// whether the DSW changed.
    fn sync_pod(&mut self, uid: &PodUid, stored: Option<&StoredPod>) -> bool {
        let wanted = stored.filter(|s| {
            let pod = &s.pod;
            if !is_for_node(pod, &self.node_name) {
                debug!(pod = ?pod.metadata.name, node = ?pod.spec.as_ref().and_then(|s| s.node_name.as_ref()), "pod is assigned to another node; ignored");
                return false;
            }
            !is_terminated(pod)
        });
        let Some(stored) = wanted else {
            let Some(old) = self.seen.remove(uid) else {
                return false;
            };
            // Its volumes are torn down now: a set-up that failed for good shares their keys.
            self.executor
                .retry_permanent_now(|k| k.pod.as_ref() == Some(uid), Instant::now());
            self.forget_readers(uid, &old);
            // Its certificates' keys go with it (a set-up that never succeeded has no
            // teardown to drop them).
            self.host.certificates.forget_pod(uid.as_str());
            self.volume_pace.forget_pod(uid);
            self.rewrite_now.remove(uid);
            self.fetch_due.remove(uid);
            self.dsw.remove_pod(uid);
            self.dsw.world().notify_pod(uid);
            return true;
        };
        let pod = &stored.pod;
        // (Looked at whenever the UID is touched: a refused newcomer changes nothing of the pod
        // in effect. The same event again is folded.)
        let pref = pod_ref(pod, uid);
        for (origin, (namespace, name)) in self.store.pod_uid_conflicts(uid) {
            self.events.record(
                &pref,
                true,
                reason::UID_CONFLICT,
                format!(
                    "pod {namespace}/{name} of {origin} gives itself this pod's UID {uid}: it is refused, and the UID, its directory and its volumes stay with pod {pref} ({})",
                    stored.origin()
                ),
            );
        }
        let versions = object_versions(&self.store, &self.node_name, pod, uid);
        let (objects, pending) = (versions.objects, versions.pending);
        let (same_pod, same_objects) = self.seen.get(uid).map_or((false, false), |s| {
            (Arc::ptr_eq(&s.pod, pod), s.objects == objects)
        });
        let rewrites_due = self.rewrite_now.contains_key(uid) || self.fetch_due.contains(uid);
        if same_pod && same_objects && !rewrites_due {
            return false;
        }
        // The volumes whose objects changed since the pod was last processed (all of them the
        // first time): only those are written again for it.
        let objects_changed: Option<HashSet<String>> = self.seen.get(uid).map(|_| {
            Seen::changed_volumes(self.seen.get(uid), &objects, &versions.spans)
                .into_iter()
                .map(String::from)
                .collect()
        });
        if !same_objects {
            // An object appeared or changed: retry now, not after backoff, the volumes that
            // read it, and only those (a change another volume reads is no news to them).
            let changed = Seen::changed_volumes(self.seen.get(uid), &objects, &versions.spans);
            let keys: HashSet<kubevol_core::UniqueVolumeName> = self
                .dsw
                .world()
                .dsw()
                .pod(uid)
                .map(|p| {
                    changed
                        .iter()
                        .filter_map(|name| p.volumes.get(*name).cloned())
                        .collect()
                })
                .unwrap_or_default();
            self.executor.retry_now(
                |k| k.pod.as_ref() == Some(uid) && keys.contains(&k.volume),
                Instant::now(),
            );
        } else if !same_pod {
            // The pod changed: what failed for good because of its spec may work now.
            self.executor
                .retry_permanent_now(|k| k.pod.as_ref() == Some(uid), Instant::now());
        }
        if let Some(old) = self.seen.remove(uid) {
            self.forget_readers(uid, &old);
        }
        for (key, _) in &objects {
            self.readers
                .entry(key.clone())
                .or_default()
                .insert(uid.clone());
        }
        self.seen.insert(
            uid.clone(),
            Seen {
                pod: pod.clone(),
                objects,
                spans: versions.spans,
            },
        );
        self.process_pod(uid, stored, &pending, objects_changed.as_ref());
        self.rewrite_now.remove(uid);
        self.fetch_due.remove(uid);
        // Its waiters are woken only when they have something to decide: a pod whose volumes
        // are still to be set up has nothing, and a thousand pods coming at once would wake a
        // thousand waiters for nothing, ahead of the operations that make them ready.
        let world = self.dsw.world();
        let decided = world.mounts_decided(uid, |k| self.executor.tearing_down(k));
        if !matches!(decided, Ok(false)) {
            world.notify_pod(uid);
        }
        true
    }

    /// Processes `uid` again in the next pass whatever changed: its volumes that read fetched
    /// content (tokens, trust bundles, certificates) are due to be written again, and only those.
    fn refresh(&mut self, uid: PodUid) {
        self.fetch_due.insert(uid.clone());
        self.due.insert(uid);
    }

    /// The content generation of volume `volume` (unique name `name`) of pod `uid`: a new one,
    /// which writes the volume again, when it is new, when an object it reads changed
    /// (`objects_changed`: the volumes whose objects did, `None` for all), when its fetched
    /// content is due, or when what it projects of the pod changed (its definition, the pod's
    /// identity, account and fsGroup, a downward API item's value); else the one it has. An
    /// annotation no item reads writes nothing (a pod patched ten times a second wrote all its
    /// content volumes ten times a second). A rewrite of a volume written less than a turn ago
    /// waits for its turn ([`pace::VolumePace`]).
    fn content_generation_of(
        &mut self,
        uid: &PodUid,
        pod: &Arc<Pod>,
        volume: &str,
        name: &kubevol_core::UniqueVolumeName,
        spec: &VolumeSpec,
        objects_changed: Option<&HashSet<String>>,
    ) -> u64 {
        let before = {
            let world = self.dsw.world();
            let dsw = world.dsw();
            dsw.volume(name)
                .and_then(|v| v.pods.get(uid))
                .map(|b| (b.content_generation, b.pod.clone(), b.spec.clone()))
        };
        let key = (uid.clone(), volume.to_string());
        let now = Instant::now();
        let Some((generation, old_pod, old_spec)) = before else {
            self.volume_pace.wrote(&key, now);
            self.content_generation += 1;
            return self.content_generation;
        };
        let turn_came = self
            .rewrite_now
            .get(uid)
            .is_some_and(|s| s.contains(volume));
        let wanted = turn_came
            || objects_changed.is_none_or(|c| c.contains(volume))
            || (self.fetch_due.contains(uid) && kubevol_core::projection::fetches(&spec.volume))
            || old_spec.extensions != spec.extensions
            || !kubevol_core::projection::same_pod_inputs(
                (&old_pod, &old_spec.volume),
                (pod, &spec.volume),
                &self.host.node_allocatable,
            );
        if wanted && (turn_came || self.volume_pace.admit(&key, now)) {
            self.content_generation += 1;
            self.content_generation
        } else {
            if wanted {
                self.dsw.world().count_rewrite_held();
            }
            generation
        }
    }

    fn readers_of(&self, key: &ObjectKey) -> Vec<PodUid> {
        self.readers
            .get(key)
            .map(|r| r.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Drops `uid` from the readers of what it read.
    fn forget_readers(&mut self, uid: &PodUid, seen: &Seen) {
        for (key, _) in &seen.objects {
            if let Some(readers) = self.readers.get_mut(key) {
                readers.remove(uid);
                if readers.is_empty() {
                    self.readers.remove(key);
                }
            }
        }
    }

    /// Turns the pod into wishes; `pending` names, for each volume that reads one, an object
    /// the API server is still to list (the volume waits for it).
    fn process_pod(
        &mut self,
        uid: &PodUid,
        stored: &StoredPod,
        pending: &BTreeMap<String, ObjectKey>,
        objects_changed: Option<&HashSet<String>>,
    ) {
        let pod = &stored.pod;
        let pref = pod_ref(pod, uid);
        // Before validation: a misspelt field is often why a pod is invalid
        // (`mountpath` leaves `mountPath` unset).
        let ext = &stored.extensions;
        let unknown = ext
            .unknown_fields
            .iter()
            .chain(ext.volumes.values().flat_map(|v| &v.unknown_fields));
        for field in unknown {
            self.events.record(
                &pref,
                true,
                reason::UNKNOWN_FIELD,
                format!(
                    "{}: pod {pref}: {field}: kubevol's API types do not have it, so it is ignored",
                    stored.origin()
                ),
            );
        }
        let mut errors: Vec<String> = validate_pod(pod).iter().map(|e| e.to_string()).collect();
        if matches!(stored.origin(), crate::store::Origin::File { .. })
            && self.store.serves_a_cluster()
        {
            if let Some(what) = kubevol_core::validation::static_pod_api_reference(pod) {
                errors.push(format!(
                    "static pods may not reference {what}: a pod from a manifest file on a node of a cluster gets no object of the API server; remove the reference, or create the pod through the API server"
                ));
            }
        }
        if !errors.is_empty() {
            let message = format!(
                "{}: pod {pref} rejected, nothing was created for it; fix these fields: {}",
                stored.origin(),
                errors.join("; ")
            );
            self.events
                .record(&pref, true, reason::FAILED_VALIDATION, message);
            self.dsw.reject(
                uid.clone(),
                Rejected {
                    pod_ref: pref,
                    origin: stored.origin().clone(),
                    errors,
                },
            );
            return;
        }
        let used = used_volume_names(pod);
        let mut wishes = Vec::new();
        let mut failed = BTreeMap::new();
        for (index, v) in pod
            .spec
            .iter()
            .flat_map(|s| s.volumes.iter().flatten())
            .enumerate()
        {
            if !used.contains(&v.name) {
                debug!(pod = %pref, volume = %v.name, "volume is not used by any container; skipped");
                continue;
            }
            let usage = claims::usage(pod, &v.name);
            if let Some(key) = pending.get(&v.name) {
                // Not a failure: no event, and the pod is not failed for good.
                failed.insert(
                    v.name.clone(),
                    ProcessFailure {
                        message: match self.store.refusal() {
                            None => format!(
                                "{}: volume {:?} of pod {pref}: waiting for the API server to deliver {key} (it has not been read yet)",
                                stored.origin(), v.name
                            ),
                            Some(why) => format!(
                                "{}: volume {:?} of pod {pref}: waiting for the API server to deliver {key}, which refuses the node's reads: {why}",
                                stored.origin(), v.name
                            ),
                        },
                        unsupported: false,
                        waiting: true,
                    },
                );
                continue;
            }
            let mut fail = |why: String, unsupported: bool, waiting: bool| {
                let message = format!(
                    "{}: volume {:?} of pod {pref}: {why}",
                    stored.origin(),
                    v.name
                );
                self.events
                    .record(&pref, true, reason::FAILED_MOUNT, message.clone());
                failed.insert(
                    v.name.clone(),
                    ProcessFailure {
                        message,
                        unsupported,
                        waiting,
                    },
                );
            };
            let persistent_volume = match storage_check(&self.store, &self.host, &pref, v, usage) {
                Ok(pv) => pv,
                Err(Refusal { why, unsupported }) => {
                    let waiting = claims::waits_for_others(&self.store, &pref, v);
                    fail(why, unsupported, waiting);
                    continue;
                }
            };
            let extensions = stored
                .extensions
                .volumes
                .get(&v.name)
                .cloned()
                .unwrap_or_default();
            // Read in place in the stored pod: no copy of the volume per wish.
            let volume =
                PodVolumeRef::in_pod(stored.pod.clone(), index).unwrap_or_else(|| v.clone().into());
            let spec = Arc::new(VolumeSpec {
                volume,
                block: usage.device,
                extensions,
                persistent_volume,
                selinux_label: None,
                selinux_mount: false,
            });
            let Some(plugin) = self.plugins.find(&spec) else {
                let why = match spec.persistent_volume.as_deref() {
                    Some(pv) => format!(
                        "PersistentVolume {} is a {} volume, a type kubevol does not mount yet (supported for persistent volumes: {}); use a CSI volume",
                        pv.metadata.name.as_deref().unwrap_or_default(),
                        persistent_volume_type(pv),
                        self.plugins.persistent_sources().join(", ")
                    ),
                    None => format!(
                        "volume type {} is not supported by kubevol yet (supported: {}); change the volume's type or remove it",
                        volume_source_names(v).first().copied().unwrap_or("unknown"),
                        self.plugins.supported_sources().join(", ")
                    ),
                };
                fail(why, true, false);
                continue;
            };
            let name = plugin.volume_name(&pref, &spec);
            let spec = match self.selinux(pod, &pref, &v.name, spec, &*plugin, &name) {
                Ok(spec) => spec,
                Err(why) => {
                    fail(why, false, false);
                    continue;
                }
            };
            let content_generation = if plugin.requires_remount() {
                self.content_generation_of(uid, pod, v.name.as_str(), &name, &spec, objects_changed)
            } else {
                // A volume set up again when the pod's change asks for it (a memory-backed
                // emptyDir whose size changed); else what was asked before stands.
                let world = self.dsw.world();
                let dsw = world.dsw();
                let before = dsw.volume(&name).and_then(|v| v.pods.get(uid));
                match before {
                    Some(b) if plugin.set_up_again(&b.pod, &b.spec, pod, &spec) => {
                        self.content_generation += 1;
                        self.content_generation
                    }
                    Some(b) => b.content_generation,
                    None => 0,
                }
            };
            wishes.push(PodVolumeWish {
                name,
                traits: plugin.traits(&self.host, &spec),
                pod_volume: DesiredPodVolume {
                    pod_ref: pref.clone(),
                    pod: pod.clone(),
                    outer_volume_name: v.name.as_str().into(),
                    spec,
                    content_generation,
                },
            });
        }
        self.dsw.set_pod(pref, wishes, failed);
    }
}

#[cfg(test)]
mod tests;
