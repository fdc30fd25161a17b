//! Storage classes in standalone mode: the default class (what the DefaultStorageClass
//! admission plugin gives a claim that names none), the built-in `local-path` class, and when a
//! class binds its claims.

use std::sync::Arc;

use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::api::storage::v1::StorageClass;

use crate::store::ObjectStore;

/// The built-in provisioner: directories on this node.
pub const LOCAL_PATH_PROVISIONER: &str = "kubevol.io/local-path";

/// The built-in class, the default where the manifests mark none.
pub const LOCAL_PATH_CLASS: &str = "local-path";

/// The annotation that makes a StorageClass the default.
pub const DEFAULT_CLASS_ANNOTATION: &str = "storageclass.kubernetes.io/is-default-class";

/// The annotation a provisioned volume names its provisioner by.
pub const PROVISIONED_BY: &str = "pv.kubernetes.io/provisioned-by";

/// The default class: the newest StorageClass marked default (then the first by name), else
/// the built-in `local-path`.
pub fn default_class(store: &ObjectStore) -> String {
    let mut marked: Vec<Arc<StorageClass>> = store
        .storage_classes()
        .into_iter()
        .filter(|c| c.invalid.is_none())
        .map(|c| c.object)
        .filter(|c| {
            c.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(DEFAULT_CLASS_ANNOTATION))
                .is_some_and(|v| v == "true")
        })
        .collect();
    marked.sort_by(|a, b| {
        let created = |c: &StorageClass| c.metadata.creation_timestamp.as_ref().map(|t| t.0);
        created(b)
            .cmp(&created(a))
            .then_with(|| a.metadata.name.cmp(&b.metadata.name))
    });
    marked
        .first()
        .and_then(|c| c.metadata.name.clone())
        .unwrap_or_else(|| LOCAL_PATH_CLASS.to_string())
}

/// The class a claim's volume must have: the one it names, else the default.
pub fn class_of(store: &ObjectStore, claim: &PersistentVolumeClaim) -> String {
    match kubevol_core::binding::named_class(claim) {
        Some(c) => c.to_string(),
        None => default_class(store),
    }
}

/// A StorageClass by name: the manifests', else the built-in one for `local-path`.
pub fn storage_class(store: &ObjectStore, name: &str) -> Option<Arc<StorageClass>> {
    let defined = store
        .storage_classes()
        .into_iter()
        .find(|c| c.object.metadata.name.as_deref() == Some(name))
        .map(|c| c.object);
    defined.or_else(|| {
        (name == LOCAL_PATH_CLASS).then(|| {
            Arc::new(StorageClass {
                metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                    name: Some(LOCAL_PATH_CLASS.into()),
                    ..Default::default()
                },
                provisioner: LOCAL_PATH_PROVISIONER.into(),
                reclaim_policy: Some("Delete".into()),
                volume_binding_mode: Some("WaitForFirstConsumer".into()),
                ..Default::default()
            })
        })
    })
}

/// Why the StorageClass `name` of the manifests or the library is invalid, if it is: nothing is
/// provisioned of it (its `mountOptions` would reach the volume's mounts).
pub fn invalid_class(store: &ObjectStore, name: &str) -> Option<Arc<str>> {
    store
        .storage_classes()
        .into_iter()
        .find(|c| c.object.metadata.name.as_deref() == Some(name))
        .and_then(|c| c.invalid)
}

/// Whether claims of class `class` are bound (or get a volume) at once rather than when a pod
/// first uses them: `volumeBindingMode: Immediate`, the API's default, and the behaviour of the
/// PersistentVolume controller for a class that no StorageClass defines.
pub fn binds_at_once(store: &ObjectStore, class: &str) -> bool {
    storage_class(store, class)
        .is_none_or(|c| c.volume_binding_mode.as_deref() != Some("WaitForFirstConsumer"))
}
