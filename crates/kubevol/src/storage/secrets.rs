//! A StorageClass's secret parameters, as the external-provisioner reads them:
//! `csi.storage.k8s.io/<operation>-secret-{name,namespace}` for the provisioner (CreateVolume
//! and DeleteVolume), and for controller-publish, node-stage, node-publish, controller-expand
//! and node-expand, which become the provisioned PersistentVolume's secret references (and so
//! reach ControllerPublishVolume, NodeStageVolume, NodePublishVolume and the expansions).
//!
//! Their values may be templates: `${pv.name}` and `${pvc.namespace}` everywhere, `${pvc.name}`
//! in a name, and `${pvc.annotations['<key>']}` in the name of any but the provisioner's secret
//! (the claim's annotations are the user's, and the provisioner's secret is the
//! administrator's). A template resolved to what cannot name a Secret is refused.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{PersistentVolumeClaim, SecretReference};
use kubevol_core::validation::{dns1123_label_error, dns1123_subdomain_error};

/// The operations whose secrets a StorageClass names, by their parameters' prefix.
pub(crate) const OPERATIONS: [&str; 6] = [
    "provisioner",
    "controller-publish",
    "node-stage",
    "node-publish",
    "controller-expand",
    "node-expand",
];

/// The PV annotations that keep the provisioner's secret for DeleteVolume, as the
/// external-provisioner keeps them (the class may be gone by then).
pub(crate) const DELETION_SECRET_NAME: &str =
    "volume.kubernetes.io/provisioner-deletion-secret-name";
/// See [`DELETION_SECRET_NAME`].
pub(crate) const DELETION_SECRET_NAMESPACE: &str =
    "volume.kubernetes.io/provisioner-deletion-secret-namespace";

/// The provisioner's secret a provisioned volume keeps for DeleteVolume, if any.
pub(crate) fn deletion_secret(
    pv: &k8s_openapi::api::core::v1::PersistentVolume,
) -> Option<SecretReference> {
    let a = pv.metadata.annotations.as_ref()?;
    Some(SecretReference {
        name: Some(a.get(DELETION_SECRET_NAME)?.clone()),
        namespace: Some(a.get(DELETION_SECRET_NAMESPACE)?.clone()),
    })
}

/// The secrets a class names for one claim, by operation.
pub(crate) type ClassSecrets = BTreeMap<&'static str, SecretReference>;

/// The secret references of `parameters` (a StorageClass's) for the volume `pv_name` of
/// `claim`, templates resolved; an error names the parameter and what to fix.
pub(crate) fn class_secrets(
    parameters: &BTreeMap<String, String>,
    pv_name: &str,
    claim: &PersistentVolumeClaim,
) -> Result<ClassSecrets, String> {
    let mut out = ClassSecrets::new();
    for op in OPERATIONS {
        let name_key = format!("csi.storage.k8s.io/{op}-secret-name");
        let namespace_key = format!("csi.storage.k8s.io/{op}-secret-namespace");
        let (name, namespace) = match (parameters.get(&name_key), parameters.get(&namespace_key)) {
            (None, None) => continue,
            (Some(n), Some(ns)) => (n, ns),
            (Some(_), None) | (None, Some(_)) => {
                return Err(format!(
                    "StorageClass parameters {name_key} and {namespace_key} go together: set both, or neither"
                ))
            }
        };
        let annotations = op != "provisioner";
        let namespace = resolve(namespace, pv_name, claim, false, false).map_err(|why| {
            format!("StorageClass parameter {namespace_key}={namespace:?}: {why}")
        })?;
        if let Some(why) = dns1123_label_error(&namespace) {
            return Err(format!("StorageClass parameter {namespace_key} resolves to {namespace:?}, which is not a namespace: {why}"));
        }
        let name = resolve(name, pv_name, claim, true, annotations)
            .map_err(|why| format!("StorageClass parameter {name_key}={name:?}: {why}"))?;
        if let Some(why) = dns1123_subdomain_error(&name) {
            return Err(format!("StorageClass parameter {name_key} resolves to {name:?}, which is not a Secret's name: {why}"));
        }
        out.insert(
            op,
            SecretReference {
                name: Some(name),
                namespace: Some(namespace),
            },
        );
    }
    Ok(out)
}

/// Resolves the `${...}` of one template; `claim_name` allows `${pvc.name}`, `annotations`
/// `${pvc.annotations['<key>']}`.
fn resolve(
    template: &str,
    pv_name: &str,
    claim: &PersistentVolumeClaim,
    claim_name: bool,
    annotations: bool,
) -> Result<String, String> {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let Some(end) = after.find('}') else {
            return Err("a ${ without its }".into());
        };
        let key = &after[..end];
        let value = match key {
            "pv.name" => pv_name.to_string(),
            "pvc.namespace" => claim.metadata.namespace.clone().unwrap_or_default(),
            "pvc.name" if claim_name => claim.metadata.name.clone().unwrap_or_default(),
            k if annotations && k.starts_with("pvc.annotations['") && k.ends_with("']") => {
                let annotation = &k["pvc.annotations['".len()..k.len() - 2];
                claim
                    .metadata
                    .annotations
                    .as_ref()
                    .and_then(|a| a.get(annotation))
                    .cloned()
                    .ok_or_else(|| format!("the claim has no annotation {annotation:?}"))?
            }
            k => return Err(format!("${{{k}}} cannot be used here")),
        };
        out.push_str(&value);
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn claim() -> PersistentVolumeClaim {
        serde_json::from_value(json!({"metadata": {"name": "data", "namespace": "shop",
            "annotations": {"team/key": "shop-key"}}, "spec": {}}))
        .unwrap()
    }

    #[test]
    fn templates_resolve_as_the_external_provisioner_resolves_them() {
        let p: BTreeMap<String, String> = [
            (
                "csi.storage.k8s.io/provisioner-secret-name",
                "prov-${pvc.namespace}",
            ),
            ("csi.storage.k8s.io/provisioner-secret-namespace", "storage"),
            (
                "csi.storage.k8s.io/node-publish-secret-name",
                "${pvc.annotations['team/key']}",
            ),
            (
                "csi.storage.k8s.io/node-publish-secret-namespace",
                "${pvc.namespace}",
            ),
            (
                "csi.storage.k8s.io/node-stage-secret-name",
                "${pv.name}-${pvc.name}",
            ),
            ("csi.storage.k8s.io/node-stage-secret-namespace", "shop"),
            ("type", "fast"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let s = class_secrets(&p, "pvc-1", &claim()).unwrap();
        let named = |op: &str| {
            let r = &s[op];
            format!(
                "{}/{}",
                r.namespace.as_deref().unwrap(),
                r.name.as_deref().unwrap()
            )
        };
        assert_eq!(named("provisioner"), "storage/prov-shop");
        assert_eq!(named("node-publish"), "shop/shop-key");
        assert_eq!(named("node-stage"), "shop/pvc-1-data");
        assert_eq!(s.len(), 3);
    }

    #[test]
    fn what_the_provisioner_refuses_is_refused_with_the_parameter_named() {
        let one = |k: &str, v: &str, ns: &str| -> Result<ClassSecrets, String> {
            let p: BTreeMap<String, String> = [
                (format!("csi.storage.k8s.io/{k}-secret-name"), v.to_string()),
                (
                    format!("csi.storage.k8s.io/{k}-secret-namespace"),
                    ns.to_string(),
                ),
            ]
            .into();
            class_secrets(&p, "pvc-1", &claim())
        };
        let e = one("provisioner", "${pvc.annotations['team/key']}", "s").unwrap_err();
        assert!(
            e.contains("provisioner-secret-name") && e.contains("cannot be used here"),
            "{e}"
        );
        let e = one("node-stage", "x", "${pvc.name}").unwrap_err();
        assert!(e.contains("${pvc.name} cannot be used here"), "{e}");
        let e = one("node-stage", "${pvc.annotations['absent']}", "s").unwrap_err();
        assert!(e.contains("no annotation \"absent\""), "{e}");
        let e = one("node-stage", "Bad_Name", "s").unwrap_err();
        assert!(e.contains("not a Secret's name"), "{e}");
        let half: BTreeMap<String, String> = [(
            "csi.storage.k8s.io/node-stage-secret-name".to_string(),
            "x".to_string(),
        )]
        .into();
        assert!(class_secrets(&half, "pvc-1", &claim())
            .unwrap_err()
            .contains("go together"));
    }
}
