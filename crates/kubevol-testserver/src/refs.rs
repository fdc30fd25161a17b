//! The objects a pod references by name, as the Node authorizer's graph has them: volumes,
//! projected sources, environment variables, image pull secrets and its service account.

use serde_json::Value;

/// The objects `pod` references in its namespace: (resource plural, name).
pub(crate) fn of_pod(pod: &Value) -> Vec<(&'static str, String)> {
    let mut out: Vec<(&'static str, String)> = Vec::new();
    out.extend(config_maps(pod).into_iter().map(|n| ("configmaps", n)));
    out.extend(secrets(pod).into_iter().map(|n| ("secrets", n)));
    out.extend(
        claims(pod)
            .into_iter()
            .map(|n| ("persistentvolumeclaims", n)),
    );
    // The API server sets `default` where a pod names none.
    let account = pod
        .pointer("/spec/serviceAccountName")
        .and_then(Value::as_str)
        .filter(|a| !a.is_empty())
        .unwrap_or("default");
    out.push(("serviceaccounts", account.to_string()));
    out.sort();
    out.dedup();
    out
}

/// The claims of the pod's volumes: those named, and those of generic ephemeral volumes
/// (`<pod name>-<volume name>`, which the Node authorizer's graph relates to the pod too).
pub(crate) fn claims(pod: &Value) -> Vec<String> {
    let mut out = refs(pod, &["persistentVolumeClaim/claimName"]);
    let pod_name = pod
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or_default();
    out.extend(
        each(pod, "/spec/volumes")
            .filter(|v| v.get("ephemeral").is_some())
            .filter_map(|v| v.get("name").and_then(Value::as_str))
            .map(|v| format!("{pod_name}-{v}")),
    );
    out
}

/// The elements of the array at `pointer` in `v` (none if there is none).
fn each<'a>(v: &'a Value, pointer: &str) -> impl Iterator<Item = &'a Value> {
    v.pointer(pointer)
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
}

/// The string at `pointer` in each of `items`.
fn names<'a>(items: impl Iterator<Item = &'a Value>, pointer: &str) -> Vec<String> {
    items
        .filter_map(|i| i.pointer(pointer).and_then(Value::as_str).map(String::from))
        .collect()
}

/// The names at `paths` (relative to each of the pod's volumes, `/`-separated).
fn refs(pod: &Value, paths: &[&str]) -> Vec<String> {
    paths
        .iter()
        .flat_map(|path| names(each(pod, "/spec/volumes"), &format!("/{path}")))
        .collect()
}

/// The names under every container's `env[].valueFrom.<kind>KeyRef.name` and `envFrom[].<kind>Ref.name`.
fn env_refs(pod: &Value, key_ref: &str, from_ref: &str) -> Vec<String> {
    let mut out = Vec::new();
    for list in ["containers", "initContainers", "ephemeralContainers"] {
        for c in each(pod, &format!("/spec/{list}")) {
            out.extend(names(
                each(c, "/env"),
                &format!("/valueFrom/{key_ref}/name"),
            ));
            out.extend(names(each(c, "/envFrom"), &format!("/{from_ref}/name")));
        }
    }
    out
}

/// The names of the projected volumes' sources of `kind` (`configMap`, `secret`).
fn projected(pod: &Value, kind: &str) -> Vec<String> {
    each(pod, "/spec/volumes")
        .flat_map(|v| names(each(v, "/projected/sources"), &format!("/{kind}/name")))
        .collect()
}

fn config_maps(pod: &Value) -> Vec<String> {
    let mut out = refs(pod, &["configMap/name"]);
    out.extend(projected(pod, "configMap"));
    out.extend(env_refs(pod, "configMapKeyRef", "configMapRef"));
    out
}

fn secrets(pod: &Value) -> Vec<String> {
    let mut out = refs(
        pod,
        &[
            "secret/secretName",
            "csi/nodePublishSecretRef/name",
            "cephfs/secretRef/name",
            "rbd/secretRef/name",
            "azureFile/secretName",
        ],
    );
    out.extend(projected(pod, "secret"));
    out.extend(env_refs(pod, "secretKeyRef", "secretRef"));
    out.extend(names(each(pod, "/spec/imagePullSecrets"), "/name"));
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn every_way_a_pod_names_an_object() {
        let pod = json!({"metadata": {"name": "p"}, "spec": {
            "volumes": [
                {"name": "a", "configMap": {"name": "cm-vol"}},
                {"name": "b", "secret": {"secretName": "s-vol"}},
                {"name": "c", "persistentVolumeClaim": {"claimName": "claim"}},
                {"name": "d", "projected": {"sources": [{"secret": {"name": "s-proj"}}, {"configMap": {"name": "cm-proj"}}]}},
                {"name": "e", "csi": {"driver": "x", "nodePublishSecretRef": {"name": "s-csi"}}},
                {"name": "f", "ephemeral": {"volumeClaimTemplate": {"spec": {}}}}],
            "containers": [{"name": "c",
                "env": [{"name": "E", "valueFrom": {"secretKeyRef": {"name": "s-env", "key": "k"}}}],
                "envFrom": [{"configMapRef": {"name": "cm-env"}}]}],
            "initContainers": [{"name": "i", "envFrom": [{"secretRef": {"name": "s-init"}}]}],
            "imagePullSecrets": [{"name": "s-pull"}]}});
        let got = super::of_pod(&pod);
        let mut named = pod.clone();
        named["spec"]["serviceAccountName"] = json!("app");
        assert!(super::of_pod(&named).contains(&("serviceaccounts", "app".to_string())));
        let want: Vec<(&str, String)> = [
            ("configmaps", "cm-env"),
            ("configmaps", "cm-proj"),
            ("configmaps", "cm-vol"),
            ("persistentvolumeclaims", "claim"),
            ("persistentvolumeclaims", "p-f"),
            ("secrets", "s-csi"),
            ("secrets", "s-env"),
            ("secrets", "s-init"),
            ("secrets", "s-proj"),
            ("secrets", "s-pull"),
            ("secrets", "s-vol"),
            ("serviceaccounts", "default"),
        ]
        .into_iter()
        .map(|(p, n)| (p, n.to_string()))
        .collect();
        assert_eq!(got, want);
    }
}
