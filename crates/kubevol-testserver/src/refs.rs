//! The objects a pod references by name, as the Node authorizer's graph has them: volumes,
//! projected sources, environment variables and image pull secrets.

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
    out.sort();
    out.dedup();
    out
}

/// The claims of the pod's volumes.
pub(crate) fn claims(pod: &Value) -> Vec<String> {
    refs(pod, &["persistentVolumeClaim/claimName"])
}

/// The names at `paths` (relative to each of the pod's volumes, `/`-separated).
fn refs(pod: &Value, paths: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    for v in pod
        .pointer("/spec/volumes")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        for path in paths {
            if let Some(n) = v.pointer(&format!("/{path}")).and_then(Value::as_str) {
                out.push(n.to_string());
            }
        }
    }
    out
}

/// The names under every container's `env[].valueFrom.<kind>KeyRef.name` and `envFrom[].<kind>Ref.name`.
fn env_refs(pod: &Value, key_ref: &str, from_ref: &str) -> Vec<String> {
    let mut out = Vec::new();
    for list in ["containers", "initContainers", "ephemeralContainers"] {
        for c in pod
            .pointer(&format!("/spec/{list}"))
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            for e in c.get("env").and_then(Value::as_array).into_iter().flatten() {
                out.extend(
                    e.pointer(&format!("/valueFrom/{key_ref}/name"))
                        .and_then(Value::as_str)
                        .map(String::from),
                );
            }
            for e in c
                .get("envFrom")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                out.extend(
                    e.pointer(&format!("/{from_ref}/name"))
                        .and_then(Value::as_str)
                        .map(String::from),
                );
            }
        }
    }
    out
}

fn projected(pod: &Value, kind: &str) -> Vec<String> {
    let mut out = Vec::new();
    for v in pod
        .pointer("/spec/volumes")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        for s in v
            .pointer("/projected/sources")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            out.extend(
                s.pointer(&format!("/{kind}/name"))
                    .and_then(Value::as_str)
                    .map(String::from),
            );
        }
    }
    out
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
    for s in pod
        .pointer("/spec/imagePullSecrets")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        out.extend(s.get("name").and_then(Value::as_str).map(String::from));
    }
    out
}
