//! The library API as a pod source: an embedding node agent adds and removes pods, ConfigMaps,
//! Secrets and the other objects by calling it. What it gives wins over manifest files that
//! define the same object.
//!
//! It has no listing to wait for. On a fresh root it is synced once the manager runs; after a
//! restart, once every pod the record says it gave has been given again or removed (or the
//! embedder says [`Library::synced`]): until then nothing is torn down, so that an embedder
//! that gives its pods again after `run()` does not see their volumes — an emptyDir's data —
//! torn down in between.

use kubevol_core::state::PodExtensions;
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, OnceLock};

use k8s_openapi::api::core::v1::Pod;
use kubevol_core::projection::ObjectKind;
use kubevol_core::PodUid;

use super::{BoxFuture, PodSource, Sink};
use crate::store::{normalize_pod, pod_uid, problem_of, Change, Object};

/// How many pods [`Library::add_pods`] stores in one change.
const ADD_SLICE: usize = 64;

/// The library API's source. Cheap to clone; clones share one source.
#[derive(Clone, Default)]
pub struct Library {
    sink: Arc<OnceLock<Sink>>,
    sync: Arc<Mutex<Sync>>,
}

/// Where the source's sync stands.
enum Sync {
    /// The record is not read yet: the pods given or removed so far.
    Unread(Vec<PodUid>),
    /// Recorded pods not given again yet (the source is synced when none is left).
    Awaiting(BTreeSet<PodUid>),
    /// Synced.
    Done,
}

impl Default for Sync {
    fn default() -> Self {
        Sync::Unread(Vec::new())
    }
}

impl PodSource for Library {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    /// Keeps the sink; the returned future does nothing.
    fn start(self: Box<Self>, sink: Sink) -> BoxFuture<()> {
        let _ = self.sink.set(sink);
        Box::pin(async {})
    }
}

impl Library {
    /// The source's name in the store's sync gate.
    pub const NAME: &'static str = "api";

    /// The pods of the library the record holds (the manager, once it has read the record):
    /// the source is synced once each is given again or removed.
    pub(crate) fn awaiting(&self, recorded: BTreeSet<PodUid>) {
        let mut sync = crate::sync::lock(&self.sync);
        *sync = match std::mem::take(&mut *sync) {
            Sync::Unread(given) => Sync::Awaiting(&recorded - &given.into_iter().collect()),
            Sync::Awaiting(_) => Sync::Awaiting(recorded),
            Sync::Done => Sync::Done,
        };
        self.settle(&mut sync);
    }

    /// Says that the pods given so far are all the embedder has: the source is synced, and a
    /// recorded pod not given again is torn down (what an embedder that knows its pods calls
    /// once it has given them again after a restart).
    pub fn synced(&self) {
        let mut sync = crate::sync::lock(&self.sync);
        *sync = Sync::Awaiting(BTreeSet::new());
        self.settle(&mut sync);
    }

    /// Notes the pods `uids` given or removed.
    fn given(&self, uids: &[PodUid]) {
        let mut sync = crate::sync::lock(&self.sync);
        match &mut *sync {
            Sync::Unread(given) => given.extend_from_slice(uids),
            Sync::Awaiting(awaited) => {
                for uid in uids {
                    awaited.remove(uid);
                }
                self.settle(&mut sync);
            }
            Sync::Done => {}
        }
    }

    /// Synced once no recorded pod is awaited; else says which are.
    fn settle(&self, sync: &mut Sync) {
        let (Some(sink), Sync::Awaiting(awaited)) = (self.sink.get(), &*sync) else {
            return;
        };
        if awaited.is_empty() {
            *sync = Sync::Done;
            sink.problem(None);
            sink.synced();
            return;
        }
        let some: Vec<&str> = awaited.iter().take(3).map(|u| u.as_str()).collect();
        sink.problem(Some(format!(
            "{} of the pods the library API gave before the restart (UIDs {}{}) have not been given again: nothing is torn down until each is added again or removed, or Library::synced() says the pods given are all",
            awaited.len(),
            some.join(", "),
            if awaited.len() > some.len() { ", …" } else { "" },
        )));
    }

    fn apply(&self, changes: Vec<Change>) {
        match self.sink.get() {
            Some(sink) => sink.apply(changes),
            None => tracing::error!(
                "the library source is used before it was started; the change is lost"
            ),
        }
    }

    /// Adds or replaces many pods, [`ADD_SLICE`] to a change: the populator starts on the
    /// first while the rest are stored, so a thousand pods given at once do not wait for
    /// the last to be stored before the first is set up. Returns their UIDs.
    pub fn add_pods(&self, pods: impl IntoIterator<Item = Pod>) -> Vec<PodUid> {
        let mut uids = Vec::new();
        let mut slice = Vec::with_capacity(ADD_SLICE);
        for pod in pods {
            let pod = normalize_pod(pod);
            uids.push(pod_uid(&pod));
            slice.push(Change::Upsert(Box::new(Object::Pod(
                pod,
                PodExtensions::default(),
            ))));
            if slice.len() == ADD_SLICE {
                self.apply(std::mem::replace(&mut slice, Vec::with_capacity(ADD_SLICE)));
            }
        }
        if !slice.is_empty() {
            self.apply(slice);
        }
        self.given(&uids);
        uids
    }

    /// Removes many pods in one change: their volumes are torn down.
    pub fn remove_pods(&self, uids: &[PodUid]) {
        self.apply(uids.iter().cloned().map(Change::RemovePod).collect());
        self.given(uids);
    }

    /// Adds or replaces objects (ConfigMaps, Secrets, ...) in one change. Returns the problems
    /// found: an invalid object is kept, and the pods that use it fail with its reason.
    pub fn upsert_objects(&self, objects: impl IntoIterator<Item = Object>) -> Vec<String> {
        let objects: Vec<Object> = objects.into_iter().collect();
        let problems = objects.iter().filter_map(problem_of).collect();
        self.apply(
            objects
                .into_iter()
                .map(|o| Change::Upsert(Box::new(o)))
                .collect(),
        );
        problems
    }

    /// Removes a ConfigMap or Secret.
    pub fn remove_object(&self, kind: ObjectKind, namespace: &str, name: &str) {
        self.apply(vec![Change::RemoveObject {
            kind,
            namespace: namespace.to_string(),
            name: name.to_string(),
        }]);
    }
}
