//! The storage checks of a volume before it is desired: a claim resolves to its
//! PersistentVolume, of a type kubevol mounts, whose nodeAffinity this node matches; an inline CSI
//! volume's driver allows ephemeral volumes; an in-tree type is served through CSI migration.

use std::sync::Arc;

use kubevol_core::PodRef;

use super::claims;
use crate::plugins::PluginHost;
use crate::store::ObjectStore;

/// The volume source a PersistentVolume's spec sets (`hostPath`, `nfs`, `local`, ...), as the
/// API names it.
pub(crate) fn persistent_volume_type(
    pv: &k8s_openapi::api::core::v1::PersistentVolume,
) -> &'static str {
    const SOURCES: [&str; 22] = [
        "awsElasticBlockStore",
        "azureDisk",
        "azureFile",
        "cephfs",
        "cinder",
        "csi",
        "fc",
        "flexVolume",
        "flocker",
        "gcePersistentDisk",
        "glusterfs",
        "hostPath",
        "iscsi",
        "local",
        "nfs",
        "photonPersistentDisk",
        "portworxVolume",
        "quobyte",
        "rbd",
        "scaleIO",
        "storageos",
        "vsphereVolume",
    ];
    let spec = pv
        .spec
        .as_ref()
        .and_then(|s| serde_json::to_value(s).ok())
        .unwrap_or_default();
    SOURCES
        .into_iter()
        .find(|s| spec.get(*s).is_some_and(|v| !v.is_null()))
        .unwrap_or("unknown")
}

/// Why a volume cannot be processed.
pub(super) struct Refusal {
    pub(super) why: String,
    /// A use kubevol does not support, as opposed to a reference that cannot be resolved yet.
    pub(super) unsupported: bool,
}

impl From<String> for Refusal {
    fn from(why: String) -> Self {
        Refusal {
            why,
            unsupported: false,
        }
    }
}

/// The storage checks of one volume: a claim resolves to its PersistentVolume, whose
/// nodeAffinity this node matches; an inline CSI volume's driver allows ephemeral volumes.
/// Returns the PersistentVolume of a claim.
pub(super) fn storage_check(
    store: &ObjectStore,
    host: &Arc<PluginHost>,
    pod: &PodRef,
    v: &k8s_openapi::api::core::v1::Volume,
    usage: claims::Usage,
) -> Result<Option<Arc<k8s_openapi::api::core::v1::PersistentVolume>>, Refusal> {
    let unsupported = |why: String| Refusal {
        why,
        unsupported: true,
    };
    if let Some(csi) = &v.csi {
        if usage.device {
            return Err(unsupported("an inline CSI volume cannot be used in volumeDevices: use a claim with volumeMode Block".into()));
        }
        claims::lifecycle_allows(store, &csi.driver, "Ephemeral")?;
    }
    if let Some(translated) = kubevol_core::migration::translate_inline(v, &pod.namespace) {
        return migrated_inline(v, translated, usage).map(Some);
    }
    if v.persistent_volume_claim.is_none() && v.ephemeral.is_none() {
        return Ok(None);
    }
    // (A claim nothing binds is bound by the storage controllers, which run beside.)
    let pv = claims::resolve(store, pod, v, usage)?;
    let name = pv.metadata.name.as_deref().unwrap_or_default();
    let spec = pv.spec.as_ref();
    if usage.device && spec.is_some_and(|s| s.host_path.is_some()) {
        return Err(unsupported(format!(
            "PersistentVolume {name} is a hostPath volume, which cannot be used as a raw block device: use the claim in volumeMounts"
        )));
    }
    claims::check_persistent_volume(&pv)?;
    if let Some(required) = spec
        .and_then(|s| s.node_affinity.as_ref())
        .and_then(|a| a.required.as_ref())
    {
        claims::check_node_affinity(name, required, &host.node_facts())?;
    }
    // An in-tree type is served by its CSI driver, as the PersistentVolume the translation
    // gives (its node affinity was checked as written).
    match kubevol_core::migration::translate_pv(&pv) {
        Some(Ok(translated)) => Ok(Some(Arc::new(translated))),
        Some(Err(e)) => {
            let t = kubevol_core::migration::in_tree_of_pv(&pv).map_or("", |t| t.driver);
            Err(format!(
                "PersistentVolume {name} cannot be served by CSI driver {t}, as Kubernetes serves in-tree volumes: {e}; fix the PersistentVolume"
            )
            .into())
        }
        None => Ok(Some(pv)),
    }
}

/// An inline volume of an in-tree type, as the PersistentVolume its CSI driver serves. Its
/// name (the translation's, unique per disk) names the volume's directories: one that is not a
/// single path component has each `/` written as `~`.
fn migrated_inline(
    v: &k8s_openapi::api::core::v1::Volume,
    translated: Result<k8s_openapi::api::core::v1::PersistentVolume, String>,
    usage: claims::Usage,
) -> Result<Arc<k8s_openapi::api::core::v1::PersistentVolume>, Refusal> {
    let t = kubevol_core::migration::in_tree_of_volume(v).map_or("", |t| t.driver);
    let mut pv = translated.map_err(|e| {
        format!("the volume cannot be served by CSI driver {t}, as Kubernetes serves in-tree volumes: {e}; fix the volume")
    })?;
    if usage.device {
        return Err(Refusal {
            why: "an inline volume cannot be used in volumeDevices: use a claim with volumeMode Block".into(),
            unsupported: true,
        });
    }
    if let Some(n) = pv.metadata.name.as_mut() {
        *n = n.replace('/', "~");
        if n.is_empty() || n == "." || n == ".." {
            return Err(format!(
                "the volume's disk name {n:?} cannot name a directory; fix the volume"
            )
            .into());
        }
    }
    Ok(Arc::new(pv))
}
