//! Generic ephemeral volumes in standalone mode: what the ephemeral-volume controller does —
//! the claim `<pod>-<volume>` made from the volume's template, controlled by the pod, and gone
//! with the pod.

use k8s_openapi::api::core::v1::PersistentVolumeClaim;

use crate::store::{Object, ObjectStore};

/// Makes the claims of `pod`'s generic ephemeral volumes that nothing defines, as the
/// ephemeral-volume controller makes them: `<pod>-<volume>` in the pod's namespace, from the
/// volume's `volumeClaimTemplate` (its labels, annotations and spec), controlled by the pod.
/// They go with the pod ([`remove_orphans`]), and their provisioned volumes by their reclaim
/// policy.
pub fn make_claims(store: &ObjectStore, pod: &k8s_openapi::api::core::v1::Pod) {
    let ns = pod
        .metadata
        .namespace
        .as_deref()
        .unwrap_or(crate::store::DEFAULT_NAMESPACE);
    let pod_name = pod.metadata.name.as_deref().unwrap_or_default();
    let uid = pod.metadata.uid.as_deref().unwrap_or_default();
    let mut made = Vec::new();
    for v in pod.spec.iter().flat_map(|s| s.volumes.iter().flatten()) {
        let Some(template) = v
            .ephemeral
            .as_ref()
            .and_then(|e| e.volume_claim_template.as_ref())
        else {
            continue;
        };
        let name = format!("{pod_name}-{}", v.name);
        if store.persistent_volume_claim(ns, &name).is_some()
            || store
                .not_loaded("PersistentVolumeClaim", ns, &name)
                .is_some()
        {
            continue;
        }
        let meta = template.metadata.clone().unwrap_or_default();
        made.push(PersistentVolumeClaim {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                uid: Some(crate::store::ephemeral_claim_uid(uid, &v.name)),
                name: Some(name),
                namespace: Some(ns.to_string()),
                labels: meta.labels,
                annotations: meta.annotations,
                owner_references: Some(vec![
                    k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
                        api_version: "v1".into(),
                        kind: "Pod".into(),
                        name: pod_name.to_string(),
                        uid: uid.to_string(),
                        controller: Some(true),
                        block_owner_deletion: Some(true),
                    },
                ]),
                ..Default::default()
            },
            spec: Some(template.spec.clone()),
            status: None,
        });
    }
    if !made.is_empty() {
        tracing::info!(pod = %format!("{ns}/{pod_name}"), claims = made.len(), "claims made for generic ephemeral volumes");
        store.add_provisioned(made.into_iter().map(Object::PersistentVolumeClaim));
    }
}

/// Removes the claims made for pods the store no longer has (not for those that merely ended:
/// as the garbage collector deletes them with the pod); their volumes then go by their reclaim
/// policy.
pub fn remove_orphans(store: &ObjectStore) {
    let owners: Vec<String> = store
        .persistent_volume_claims_where(|c| c.origin == crate::store::Origin::Provisioned)
        .into_iter()
        .flat_map(|c| {
            c.object
                .metadata
                .owner_references
                .iter()
                .flatten()
                .filter(|o| o.controller == Some(true) && o.kind == "Pod")
                .map(|o| o.uid.clone())
                .collect::<Vec<_>>()
        })
        .filter(|uid| !store.has_pod(&kubevol_core::PodUid::from(uid.as_str())))
        .collect();
    for uid in owners {
        store.remove_claims_made_for(&uid);
    }
}
