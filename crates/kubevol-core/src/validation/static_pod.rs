//! Static pods may not reference API objects (the kubelet's `PreventStaticPodAPIReferences`,
//! on by default since Kubernetes 1.34 and enforced in 1.37): a pod read from a manifest file by
//! a node of a cluster that names a service account, a Secret, a ConfigMap, a resource claim, a
//! claim or a volume that needs an object of the API server is refused, as the kubelet refuses
//! it, with the kind of object it names.

use k8s_openapi::api::core::v1::{Container, Pod, Volume};

/// The API objects `pod` references, in the kubelet's words (`secrets`, `configmaps (via
/// projected volumes)`), or `None` when it references none.
pub fn static_pod_api_reference(pod: &Pod) -> Option<&'static str> {
    let spec = pod.spec.as_ref()?;
    if spec
        .service_account_name
        .as_deref()
        .is_some_and(|s| !s.is_empty())
    {
        return Some("serviceaccounts");
    }
    let containers: Vec<ContainerRefs<'_>> = spec
        .init_containers
        .iter()
        .flatten()
        .chain(&spec.containers)
        .map(ContainerRefs::of)
        .chain(
            spec.ephemeral_containers
                .iter()
                .flatten()
                .map(|c| ContainerRefs {
                    env: c.env.as_deref().unwrap_or_default(),
                    env_from: c.env_from.as_deref().unwrap_or_default(),
                }),
        )
        .collect();
    let volumes = spec.volumes.as_deref().unwrap_or_default();
    let secrets = spec
        .image_pull_secrets
        .as_ref()
        .is_some_and(|s| !s.is_empty())
        || containers.iter().any(ContainerRefs::secret)
        || volumes.iter().any(names_secret);
    if secrets {
        return Some("secrets");
    }
    let config_maps = containers.iter().any(ContainerRefs::config_map)
        || volumes.iter().any(|v| {
            v.config_map.is_some()
                || v.projected
                    .iter()
                    .flat_map(|p| p.sources.iter().flatten())
                    .any(|s| s.config_map.is_some())
        });
    if config_maps {
        return Some("configmaps");
    }
    if spec.resource_claims.as_ref().is_some_and(|c| !c.is_empty()) {
        return Some("resourceclaims");
    }
    volumes.iter().find_map(volume_reference)
}

/// What a container's environment names.
struct ContainerRefs<'a> {
    env: &'a [k8s_openapi::api::core::v1::EnvVar],
    env_from: &'a [k8s_openapi::api::core::v1::EnvFromSource],
}

impl<'a> ContainerRefs<'a> {
    fn of(c: &'a Container) -> Self {
        ContainerRefs {
            env: c.env.as_deref().unwrap_or_default(),
            env_from: c.env_from.as_deref().unwrap_or_default(),
        }
    }

    fn secret(&self) -> bool {
        self.env.iter().any(|e| {
            e.value_from
                .as_ref()
                .is_some_and(|f| f.secret_key_ref.is_some())
        }) || self.env_from.iter().any(|e| e.secret_ref.is_some())
    }

    fn config_map(&self) -> bool {
        self.env.iter().any(|e| {
            e.value_from
                .as_ref()
                .is_some_and(|f| f.config_map_key_ref.is_some())
        }) || self.env_from.iter().any(|e| e.config_map_ref.is_some())
    }
}

/// Whether a volume names a Secret (its source, or a secret reference of its plugin).
fn names_secret(v: &Volume) -> bool {
    v.secret.is_some()
        || v.azure_file.is_some()
        || v.cephfs.as_ref().is_some_and(|s| s.secret_ref.is_some())
        || v.cinder.as_ref().is_some_and(|s| s.secret_ref.is_some())
        || v.flex_volume
            .as_ref()
            .is_some_and(|s| s.secret_ref.is_some())
        || v.iscsi.as_ref().is_some_and(|s| s.secret_ref.is_some())
        || v.rbd.as_ref().is_some_and(|s| s.secret_ref.is_some())
        || v.scale_io.is_some()
        || v.storageos.as_ref().is_some_and(|s| s.secret_ref.is_some())
        || v.csi
            .as_ref()
            .is_some_and(|s| s.node_publish_secret_ref.is_some())
        || v.projected
            .iter()
            .flat_map(|p| p.sources.iter().flatten())
            .any(|s| s.secret.is_some())
}

/// What a volume needs of the API server beyond Secrets and ConfigMaps, in the kubelet's words.
fn volume_reference(v: &Volume) -> Option<&'static str> {
    if v.csi.is_some() {
        return Some("csidrivers (via CSI volumes)");
    }
    if v.glusterfs.is_some() {
        return Some("endpoints (via glusterFS volumes)");
    }
    if v.persistent_volume_claim.is_some() {
        return Some("persistentvolumeclaims");
    }
    if v.ephemeral.is_some() {
        return Some("persistentvolumeclaims (via ephemeral volumes)");
    }
    for s in v.projected.iter().flat_map(|p| p.sources.iter().flatten()) {
        if s.service_account_token.is_some() {
            return Some("serviceaccounts (via projected volumes)");
        }
        if s.cluster_trust_bundle.is_some() {
            return Some("clustertrustbundles");
        }
        if s.pod_certificate.is_some() {
            return Some("podcertificates");
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(spec: serde_json::Value) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": "p"}, "spec": spec})).unwrap()
    }

    #[test]
    fn each_api_reference_is_named_as_the_kubelet_names_it() {
        let c = |extra: serde_json::Value| {
            let mut c = json!({"name": "c"});
            c.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            c
        };
        let rows = [
            (
                json!({"containers": [c(json!({}))], "volumes": [{"name": "v", "emptyDir": {}}, {"name": "h", "hostPath": {"path": "/x"}},
                    {"name": "d", "downwardAPI": {"items": []}}, {"name": "i", "image": {"reference": "r"}},
                    {"name": "pd", "projected": {"sources": [{"downwardAPI": {"items": []}}]}}]}),
                None,
            ),
            (
                json!({"serviceAccountName": "sa", "containers": [c(json!({}))]}),
                Some("serviceaccounts"),
            ),
            (
                json!({"imagePullSecrets": [{"name": "s"}], "containers": [c(json!({}))]}),
                Some("secrets"),
            ),
            (
                json!({"containers": [c(json!({"env": [{"name": "E", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}))]}),
                Some("secrets"),
            ),
            (
                json!({"initContainers": [c(json!({"envFrom": [{"secretRef": {"name": "s"}}]}))], "containers": [c(json!({}))]}),
                Some("secrets"),
            ),
            (
                json!({"containers": [c(json!({}))], "volumes": [{"name": "v", "secret": {"secretName": "s"}}]}),
                Some("secrets"),
            ),
            (
                json!({"containers": [c(json!({}))], "volumes": [{"name": "v", "projected": {"sources": [{"secret": {"name": "s"}}]}}]}),
                Some("secrets"),
            ),
            (
                json!({"containers": [c(json!({"envFrom": [{"configMapRef": {"name": "m"}}]}))]}),
                Some("configmaps"),
            ),
            (
                json!({"containers": [c(json!({}))], "volumes": [{"name": "v", "configMap": {"name": "m"}}]}),
                Some("configmaps"),
            ),
            (
                json!({"containers": [c(json!({}))], "resourceClaims": [{"name": "r", "resourceClaimName": "x"}]}),
                Some("resourceclaims"),
            ),
            (
                json!({"containers": [c(json!({}))], "volumes": [{"name": "v", "csi": {"driver": "d"}}]}),
                Some("csidrivers (via CSI volumes)"),
            ),
            (
                json!({"containers": [c(json!({}))], "volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": "c"}}]}),
                Some("persistentvolumeclaims"),
            ),
            (
                json!({"containers": [c(json!({}))], "volumes": [{"name": "v", "ephemeral": {"volumeClaimTemplate": {"spec": {}}}}]}),
                Some("persistentvolumeclaims (via ephemeral volumes)"),
            ),
            (
                json!({"containers": [c(json!({}))], "volumes": [{"name": "v", "projected": {"sources": [{"serviceAccountToken": {"path": "t"}}]}}]}),
                Some("serviceaccounts (via projected volumes)"),
            ),
            (
                json!({"containers": [c(json!({}))], "volumes": [{"name": "v", "projected": {"sources": [{"clusterTrustBundle": {"path": "b", "name": "n"}}]}}]}),
                Some("clustertrustbundles"),
            ),
        ];
        for (spec, want) in rows {
            assert_eq!(static_pod_api_reference(&pod(spec.clone())), want, "{spec}");
        }
    }
}
