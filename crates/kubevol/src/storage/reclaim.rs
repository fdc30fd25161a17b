//! Reclaim: what the PersistentVolume controller does with a provisioned volume whose claim is
//! gone — deleted once nothing uses it (reclaim policy `Delete`), or kept Released (`Retain`).

use std::sync::Arc;

use k8s_openapi::api::core::v1::PersistentVolume;

use crate::plugins::PluginHost;
use crate::store::{claim_uid, ObjectStore};

/// A provisioned volume to delete, and its claim (`namespace/name`), which is gone.
pub struct Reclaim {
    /// The volume, as recorded.
    pub volume: PersistentVolume,
    /// Its claim.
    pub claim: String,
    /// Another claim of the same name (another UID) is there now: the pods that name the
    /// claim name that one.
    replaced: bool,
}

/// The provisioned volumes to delete now: of reclaim policy `Delete`, whose claim is gone for
/// good (every source synced and readable, and no broken manifest file that defined the claim
/// holds it back), that no pod names, wants or has mounted, and that are not being deleted
/// already.
/// Each is marked as being deleted (nothing may mount it meanwhile) before it is returned.
pub fn to_reclaim(store: &ObjectStore, world: &crate::world::World) -> Vec<Reclaim> {
    let bindings = store.bindings();
    // Looked at on every change of either state of world: nothing to copy when nothing was
    // provisioned.
    if !bindings.has_provisioned() {
        return Vec::new();
    }
    let gone: Vec<Reclaim> = bindings
        .provisioned()
        .into_iter()
        .filter_map(|volume| {
            let spec = volume.spec.as_ref()?;
            let claim = spec.claim_ref.as_ref()?;
            let (ns, claim) = (claim.namespace.as_deref()?, claim.name.as_deref()?);
            let name = volume.metadata.name.as_deref()?;
            // Gone, or another claim of the same name now (another UID): the volume's claim is
            // not coming back.
            let bound = bindings.binding_of(name);
            let (gone, replaced) = match store.persistent_volume_claim(ns, claim) {
                Some(c) => {
                    let other = bound.is_some_and(|b| b.uid != claim_uid(&c.object));
                    (other, other)
                }
                None => {
                    let absent = store
                        .not_loaded("PersistentVolumeClaim", ns, claim)
                        .is_none();
                    (absent, false)
                }
            };
            let delete = spec.persistent_volume_reclaim_policy.as_deref() == Some("Delete");
            (delete && gone && !bindings.is_releasing(name)).then(|| Reclaim {
                claim: format!("{ns}/{claim}"),
                volume: volume.clone(),
                replaced,
            })
        })
        .collect();
    if gone.is_empty()
        || !world.states_synced()
        || !store.all_sources_synced()
        || !store.source_problems().is_empty()
    {
        return Vec::new();
    }
    // A claim a pod still names is in use though it is gone from the manifests (what
    // PersistentVolumeClaim protection keeps on a cluster): its volume waits for the pod.
    let named: std::collections::BTreeSet<String> = store
        .pods()
        .iter()
        .flat_map(|(_, p)| {
            let pod = &p.pod;
            let ns = pod
                .metadata
                .namespace
                .clone()
                .unwrap_or_else(|| crate::store::DEFAULT_NAMESPACE.into());
            let pod_name = pod.metadata.name.clone().unwrap_or_default();
            pod.spec
                .iter()
                .flat_map(|s| s.volumes.iter().flatten())
                .filter_map(|v| {
                    kubevol_core::names::claim_name(&pod_name, v).map(|c| format!("{ns}/{c}"))
                })
                .collect::<Vec<_>>()
        })
        .collect();
    let in_use: std::collections::BTreeSet<String> = {
        let name = |spec: &kubevol_core::state::VolumeSpec| {
            spec.persistent_volume
                .as_ref()
                .and_then(|pv| pv.metadata.name.clone())
        };
        let dsw = world.dsw();
        let asw = world.asw();
        let wanted = dsw
            .volumes()
            .flat_map(|v| v.pods.values().filter_map(|p| name(&p.spec)));
        let mounted = asw
            .volumes()
            .filter_map(|v| v.spec.as_deref().and_then(name));
        wanted.chain(mounted).collect()
    };
    gone.into_iter()
        .filter(|r| {
            let name = r.volume.metadata.name.as_deref().unwrap_or_default();
            !in_use.contains(name)
                && (r.replaced || !named.contains(&r.claim))
                && bindings.start_release(name)
        })
        .collect()
}

/// How a failed deletion is tried again: after 0.5 s, doubling to the kubelet's 2 min 2 s, or
/// at the next change of anything, whichever comes first.
pub const RETRY: kubevol_core::backoff::BackoffPolicy =
    kubevol_core::backoff::BackoffPolicy::KUBELET;

/// Deletes a provisioned volume that [`to_reclaim`] chose (its claim is gone, and it is
/// neither mounted, staged nor attached any more): a CSI driver's with DeleteVolume, a
/// `local-path` one by removing its directory, on its own filesystem only (a mount inside it
/// stops the removal, and a directory outside the local-path directory is left alone); then
/// its record and binding, then the store's object. Returns whether it is gone; a failure is
/// logged, and tried again ([`RETRY`]).
pub async fn reclaim(host: Arc<PluginHost>, r: Reclaim) -> bool {
    let name = r.volume.metadata.name.clone().unwrap_or_default();
    let spec = r.volume.spec.clone().unwrap_or_default();
    crate::record::fail_point("reclaim", "before");
    // The provisioner's secret, as the provisioned volume's annotations keep it.
    let deletion_secrets = match super::secrets::deletion_secret(&r.volume) {
        Some(secret) => match crate::plugins::csi::secret_data(&host, &secret, "") {
            Ok(data) => data,
            Err(e) => {
                tracing::warn!(volume = %name, "cannot read the provisioner's secret for DeleteVolume (tried again): {e}");
                return false;
            }
        },
        None => Default::default(),
    };
    let deleted = match (spec.csi, spec.local) {
        (Some(csi), _) => match host.csi.controller_client(&csi.driver) {
            Some(mut client) => host
                .csi
                .call(
                    &csi.driver,
                    "Controller",
                    "DeleteVolume",
                    client.delete_volume(kubevol_csi::v1::DeleteVolumeRequest {
                        volume_id: csi.volume_handle.clone(),
                        secrets: deletion_secrets.clone(),
                    }),
                )
                .await
                .map(drop)
                .map_err(|e| e.to_string()),
            None => Err(format!(
                "no controller service of CSI driver {} is given (--csi-controller)",
                csi.driver
            )),
        },
        (None, Some(local)) => {
            let dir = std::path::PathBuf::from(&local.path);
            let root = host.local_path_dir.clone();
            match (dir.parent() == Some(root.as_path()), dir.file_name()) {
                (true, Some(leaf)) => {
                    let leaf = leaf.to_string_lossy().into_owned();
                    let removed = tokio::task::spawn_blocking(move || {
                        kubevol_mount::safe::Dir::open(&root)
                            .and_then(|d| d.remove_dir_all_one_fs(&leaf))
                    })
                    .await;
                    match removed {
                        Ok(r) => r.map_err(|e| e.to_string()),
                        Err(e) => Err(format!("the removal did not finish: {e}")),
                    }
                }
                _ => Err(format!(
                    "its directory {} is not in the local-path directory {}: left alone",
                    dir.display(),
                    root.display()
                )),
            }
        }
        (None, None) => Ok(()),
    };
    let store = &host.store;
    if let Err(e) = deleted {
        tracing::warn!(volume = %name, claim = %r.claim, "the provisioned volume of a removed claim cannot be deleted: {e}; tried again after a backoff");
        let _ = store.bindings().finish_release(&name, false);
        return false;
    }
    crate::record::fail_point("reclaim", "after");
    if let Err(e) = store.bindings().finish_release(&name, true) {
        tracing::warn!(volume = %name, "the deleted volume cannot be forgotten: {e}; tried again after a backoff");
        return false;
    }
    store.remove_provisioned(&name);
    tracing::info!(volume = %name, claim = %r.claim, "provisioned volume deleted: its claim is gone (reclaim policy Delete)");
    true
}
