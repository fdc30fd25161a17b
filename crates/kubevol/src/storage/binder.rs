//! The binder: what the PersistentVolume controller does for a claim of the manifests or the
//! library that nothing binds — the volume that fits it best, else one provisioned for it.

use std::sync::Arc;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};

use super::StorageError;
use crate::store::{claim_uid, claim_volume};

/// How many volumes that do not fit an unbound claim its message names.
const CLOSEST: usize = 3;

/// Binds claim `ns/cname` to the PersistentVolume that fits it best, as the PersistentVolume
/// controller would (see [`kubevol_core::binding`]), when it is a claim of the manifests or
/// the library that nothing binds yet; where none fits, provisions one of the claim's class
/// (see [`super::provision`]). The binding is on disk before it is used. Returns the volume
/// bound now, if any; fails, saying why for the closest volumes, when none fits and none can be
/// made. A claim of the API server, one that names its volume, one a volume's claimRef names,
/// one bound already is left alone.
pub fn bind_claim(
    host: &Arc<crate::plugins::PluginHost>,
    ns: &str,
    cname: &str,
    claim: &PersistentVolumeClaim,
) -> Result<Option<String>, StorageError> {
    let store = &*host.store;
    crate::populator::claims::invalid_claim(store, ns, cname)
        .map_err(StorageError::InvalidClaim)?;
    if crate::populator::claims::from_cluster(store, ns, cname)
        || claim_volume(claim).is_some()
        || claim.metadata.deletion_timestamp.is_some()
        || store
            .bindings()
            .volume_of(ns, cname, &claim_uid(claim))
            .is_some()
        || crate::populator::claims::bound_volume(store, ns, claim).is_some()
    {
        return Ok(None);
    }
    let all = store.persistent_volumes();
    let kept_out = crate::populator::claims::handles_named_first_elsewhere(store, &all);
    let volumes: Vec<Arc<PersistentVolume>> = all
        .into_iter()
        .filter(|s| s.invalid.is_none())
        .filter(|s| {
            !s.object
                .metadata
                .name
                .as_ref()
                .is_some_and(|n| kept_out.contains(n))
        })
        .map(|s| s.object)
        .collect();
    let refs: Vec<&PersistentVolume> = volumes.iter().map(Arc::as_ref).collect();
    let taken = |name: &str| store.bindings().claim_of(name);
    let class = super::classes::class_of(store, claim);
    let unfit =
        match kubevol_core::binding::find(ns, claim, &class, &refs, &taken, &host.node_facts()) {
            kubevol_core::binding::Found::Volume(pv) => {
                let name = pv.metadata.name.clone().unwrap_or_default();
                store
                    .bindings()
                    .bind(ns, cname, &claim_uid(claim), &name)
                    .map_err(StorageError::recording(ns, cname, &name))?;
                tracing::info!(claim = %format!("{ns}/{cname}"), volume = %name, "claim bound");
                return Ok(Some(name));
            }
            kubevol_core::binding::Found::Nothing(unfit) => unfit,
        };
    // None fits: one of its class is made, where the class has a provisioner kubevol runs.
    let why_not = match super::classes::storage_class(store, &class) {
        Some(_) if super::classes::invalid_class(store, &class).is_some() => {
            StorageError::Refused(format!(
                "StorageClass {class} is invalid (the API server refuses it too), so nothing is provisioned of it: {}; fix the StorageClass",
                super::classes::invalid_class(store, &class).unwrap_or_default()
            ))
        }
        Some(c) => match super::provision::provision(host, ns, cname, claim, &c) {
            Ok(name) => return Ok(Some(name)),
            Err(e) => e,
        },
        None if class.is_empty() => StorageError::Refused("it names no StorageClass (storageClassName \"\"), so none is provisioned for it: add a PersistentVolume that fits".to_string()),
        None => StorageError::Refused(format!("no StorageClass {class} is defined, so none is provisioned for it: add a PersistentVolume that fits, or a StorageClass {class} of provisioner {}", super::classes::LOCAL_PATH_PROVISIONER)),
    };
    let closest: Vec<String> = unfit
        .iter()
        .take(CLOSEST)
        .map(|(name, why)| format!("{name}: {}", why.join(", ")))
        .collect();
    let more = unfit.len().saturating_sub(CLOSEST);
    let volumes = match closest.len() {
        0 => "there is no PersistentVolume".to_string(),
        _ => format!(
            "no PersistentVolume fits it ({}{})",
            closest.join("; "),
            if more > 0 {
                format!("; {more} more")
            } else {
                String::new()
            }
        ),
    };
    Err(StorageError::Unbound {
        claim: format!("{ns}/{cname}"),
        volumes,
        why_not: Box::new(why_not),
    })
}
