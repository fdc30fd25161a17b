//! The library API as a pod source: an embedding node agent adds and removes pods, ConfigMaps,
//! Secrets and the other objects by calling it. It has no listing to wait for, so it is synced
//! as soon as it is started. What it gives wins over manifest files that define the same object.

use kubevol_core::state::PodExtensions;
use std::sync::{Arc, OnceLock};

use k8s_openapi::api::core::v1::Pod;
use kubevol_core::projection::ObjectKind;
use kubevol_core::PodUid;

use super::{BoxFuture, PodSource, Sink};
use crate::store::{normalize_pod, pod_uid, problem_of, Change, Object};

/// The library API's source. Cheap to clone; clones share one source.
#[derive(Clone, Default)]
pub struct Library {
    sink: Arc<OnceLock<Sink>>,
}

impl PodSource for Library {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    /// Keeps the sink and is synced at once; the returned future does nothing.
    fn start(self: Box<Self>, sink: Sink) -> BoxFuture<()> {
        sink.synced();
        let _ = self.sink.set(sink);
        Box::pin(async {})
    }
}

impl Library {
    /// The source's name in the store's sync gate.
    pub const NAME: &'static str = "api";

    fn apply(&self, changes: Vec<Change>) {
        match self.sink.get() {
            Some(sink) => sink.apply(changes),
            None => tracing::error!(
                "the library source is used before it was started; the change is lost"
            ),
        }
    }

    /// Adds or replaces many pods in one change (one wake-up of the populator). Returns their
    /// UIDs.
    pub fn add_pods(&self, pods: impl IntoIterator<Item = Pod>) -> Vec<PodUid> {
        let pods: Vec<Pod> = pods.into_iter().map(normalize_pod).collect();
        let uids = pods.iter().map(pod_uid).collect();
        self.apply(
            pods.into_iter()
                .map(|p| Change::Upsert(Box::new(Object::Pod(p, PodExtensions::default()))))
                .collect(),
        );
        uids
    }

    /// Removes many pods in one change: their volumes are torn down.
    pub fn remove_pods(&self, uids: &[PodUid]) {
        self.apply(uids.iter().cloned().map(Change::RemovePod).collect());
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
