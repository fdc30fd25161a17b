use super::*;
use serde_json::json;

fn pod_with(volume: serde_json::Value) -> Pod {
    let name = volume["name"].as_str().unwrap_or("v").to_string();
    serde_json::from_value(json!({
        "metadata": {"name": "p", "namespace": "default"},
        "spec": {
            "containers": [{"name": "c", "volumeMounts": [{"name": name, "mountPath": "/m"}]}],
            "volumes": [volume],
        },
    }))
    .expect("test pod parses")
}

fn errors(pod: &Pod) -> String {
    super::super::validate_pod(pod)
        .iter()
        .map(|e| e.to_string())
        .collect::<Vec<_>>()
        .join("\n")
}

/// (row, volume, expected substring; "" = valid)
#[test]
fn content_volume_table() {
    let long = "a".repeat(256);
    let deep = vec!["d"; 2100].join("/");
    let rows: Vec<(&str, serde_json::Value, String)> = vec![
        ("configMap valid", json!({"name": "v", "configMap": {"name": "cm", "items": [{"key": "k", "path": "a/b", "mode": 0o600}], "defaultMode": 0o644}}), String::new()),
        ("configMap name required", json!({"name": "v", "configMap": {"name": ""}}), "spec.volumes[0].configMap.name: Required value".into()),
        ("secret name required", json!({"name": "v", "secret": {}}), "spec.volumes[0].secret.secretName: Required value".into()),
        ("defaultMode too big", json!({"name": "v", "secret": {"secretName": "s", "defaultMode": 512}}), "spec.volumes[0].secret.defaultMode: Invalid value: \"512\": must be a number between 0 and 0777 (octal), both inclusive".into()),
        ("negative item mode", json!({"name": "v", "configMap": {"name": "cm", "items": [{"key": "k", "path": "p", "mode": -1}]}}), "configMap.items[0].mode: Invalid value: \"-1\"".into()),
        ("item key required", json!({"name": "v", "configMap": {"name": "cm", "items": [{"key": "", "path": "p"}]}}), "configMap.items[0].key: Required value".into()),
        ("item path required", json!({"name": "v", "configMap": {"name": "cm", "items": [{"key": "k", "path": ""}]}}), "configMap.items[0].path: Required value".into()),
        ("absolute item path", json!({"name": "v", "configMap": {"name": "cm", "items": [{"key": "k", "path": "/etc/x"}]}}), "items[0].path: Invalid value: \"/etc/x\": must be a relative path".into()),
        ("item path backsteps", json!({"name": "v", "configMap": {"name": "cm", "items": [{"key": "k", "path": "a/../../x"}]}}), "must not contain '..'".into()),
        ("item path reserved", json!({"name": "v", "configMap": {"name": "cm", "items": [{"key": "k", "path": "..data"}]}}), "items[0].path: Invalid value: \"..data\": must not start with '..'".into()),
        ("item path element too long", json!({"name": "v", "configMap": {"name": "cm", "items": [{"key": "k", "path": long}]}}), "each path element must be no more than 255 bytes".into()),
        ("item path too long", json!({"name": "v", "configMap": {"name": "cm", "items": [{"key": "k", "path": deep}]}}), "must be no more than 4096 bytes".into()),
        ("duplicate item paths", json!({"name": "v", "configMap": {"name": "cm", "items": [{"key": "a", "path": "p"}, {"key": "b", "path": "p"}]}}), "items[1].path: Invalid value: \"p\": conflicting duplicate paths".into()),
        ("duplicate after cleaning", json!({"name": "v", "configMap": {"name": "cm", "items": [{"key": "a", "path": "p"}, {"key": "b", "path": "./p"}]}}), "items[1].path: Invalid value: \"./p\": conflicting duplicate paths: \"./p\" and \"p\" name the same file".into()),
        ("file and directory", json!({"name": "v", "configMap": {"name": "cm", "items": [{"key": "a", "path": "p"}, {"key": "b", "path": "p/q"}]}}), "items[1].path: Invalid value: \"p/q\": conflicts with path \"p\"".into()),
        ("directory then file", json!({"name": "v", "configMap": {"name": "cm", "items": [{"key": "a", "path": "p/q"}, {"key": "b", "path": "p"}]}}), "items[1].path: Invalid value: \"p\": conflicts with path \"p/q\"".into()),
        ("path of only dots", json!({"name": "v", "configMap": {"name": "cm", "items": [{"key": "a", "path": "./"}]}}), "must name a file below the volume".into()),
        ("downward valid", json!({"name": "v", "downwardAPI": {"items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}, {"path": "tier", "fieldRef": {"fieldPath": "metadata.labels['app.kubernetes.io/tier']"}}, {"path": "mem", "resourceFieldRef": {"containerName": "c", "resource": "limits.memory", "divisor": "1Mi"}}]}}), String::new()),
        ("downward both refs", json!({"name": "v", "downwardAPI": {"items": [{"path": "x", "fieldRef": {"fieldPath": "metadata.name"}, "resourceFieldRef": {"containerName": "c", "resource": "limits.cpu"}}]}}), "fieldRef and resourceFieldRef can not be specified simultaneously".into()),
        ("downward no ref", json!({"name": "v", "downwardAPI": {"items": [{"path": "x"}]}}), "one of fieldRef and resourceFieldRef is required".into()),
        ("downward bad field", json!({"name": "v", "downwardAPI": {"items": [{"path": "x", "fieldRef": {"fieldPath": "spec.nodeName"}}]}}), "fieldRef.fieldPath: Unsupported value: \"spec.nodeName\"".into()),
        ("downward bad subscript", json!({"name": "v", "downwardAPI": {"items": [{"path": "x", "fieldRef": {"fieldPath": "metadata.labels['-bad-']"}}]}}), "invalid key in metadata.labels".into()),
        ("downward bad apiVersion", json!({"name": "v", "downwardAPI": {"items": [{"path": "x", "fieldRef": {"apiVersion": "v2", "fieldPath": "metadata.name"}}]}}), "fieldRef.apiVersion: Unsupported value: \"v2\"".into()),
        ("downward container required", json!({"name": "v", "downwardAPI": {"items": [{"path": "x", "resourceFieldRef": {"resource": "limits.cpu"}}]}}), "resourceFieldRef.containerName: Required value".into()),
        ("downward container missing", json!({"name": "v", "downwardAPI": {"items": [{"path": "x", "resourceFieldRef": {"containerName": "nope", "resource": "limits.cpu"}}]}}), "resourceFieldRef.containerName: Not found: \"nope\"".into()),
        ("downward bad resource", json!({"name": "v", "downwardAPI": {"items": [{"path": "x", "resourceFieldRef": {"containerName": "c", "resource": "limits.gpu"}}]}}), "resourceFieldRef.resource: Unsupported value: \"limits.gpu\"".into()),
        ("downward bad cpu divisor", json!({"name": "v", "downwardAPI": {"items": [{"path": "x", "resourceFieldRef": {"containerName": "c", "resource": "limits.cpu", "divisor": "1Mi"}}]}}), "only divisor's values 1m, 1 are supported with the cpu resource".into()),
        ("downward bad memory divisor", json!({"name": "v", "downwardAPI": {"items": [{"path": "x", "resourceFieldRef": {"containerName": "c", "resource": "requests.memory", "divisor": "3"}}]}}), "are supported with the memory resource".into()),
        ("downward hugepages", json!({"name": "v", "downwardAPI": {"items": [{"path": "x", "resourceFieldRef": {"containerName": "c", "resource": "limits.hugepages-2Mi"}}]}}), String::new()),
        ("downward reserved path", json!({"name": "v", "downwardAPI": {"items": [{"path": "..x", "fieldRef": {"fieldPath": "metadata.name"}}]}}), "must not start with '..'".into()),
        ("downward defaultMode", json!({"name": "v", "downwardAPI": {"defaultMode": 1000, "items": []}}), "downwardAPI.defaultMode: Invalid value: \"1000\"".into()),
        ("projected valid", json!({"name": "v", "projected": {"sources": [{"configMap": {"name": "cm", "items": [{"key": "a", "path": "a"}]}}, {"secret": {"name": "s", "items": [{"key": "b", "path": "b"}]}}, {"downwardAPI": {"items": [{"path": "n", "fieldRef": {"fieldPath": "metadata.name"}}]}}, {"serviceAccountToken": {"path": "token"}}]}}), String::new()),
        ("projected empty source", json!({"name": "v", "projected": {"sources": [{}]}}), "projected.sources[0]: Required value: must specify exactly one projection type".into()),
        ("projected two kinds", json!({"name": "v", "projected": {"sources": [{"configMap": {"name": "a"}, "secret": {"name": "b"}}]}}), "may not specify more than 1 projection type (found configMap, secret)".into()),
        ("projected duplicate across sources", json!({"name": "v", "projected": {"sources": [{"configMap": {"name": "cm", "items": [{"key": "a", "path": "x"}]}}, {"secret": {"name": "s", "items": [{"key": "b", "path": "x"}]}}]}}), "sources[1].secret.items[0].path: Invalid value: \"x\": conflicting duplicate paths".into()),
        ("projected prefix across sources", json!({"name": "v", "projected": {"sources": [{"configMap": {"name": "cm", "items": [{"key": "a", "path": "x"}]}}, {"downwardAPI": {"items": [{"path": "x/y", "fieldRef": {"fieldPath": "metadata.name"}}]}}]}}), "conflicts with path \"x\"".into()),
        ("projected token too short", json!({"name": "v", "projected": {"sources": [{"serviceAccountToken": {"path": "t", "expirationSeconds": 599}}]}}), "may not specify a duration less than 10 minutes".into()),
        ("projected token too long", json!({"name": "v", "projected": {"sources": [{"serviceAccountToken": {"path": "t", "expirationSeconds": 4294967297i64}}]}}), "may not specify a duration larger than 2^32 seconds".into()),
        ("projected token path", json!({"name": "v", "projected": {"sources": [{"serviceAccountToken": {"path": ""}}]}}), "serviceAccountToken.path: Required value".into()),
        ("projected bundle both", json!({"name": "v", "projected": {"sources": [{"clusterTrustBundle": {"path": "b", "name": "x", "signerName": "y"}}]}}), "only one of name and signerName may be used".into()),
        ("projected bundle neither", json!({"name": "v", "projected": {"sources": [{"clusterTrustBundle": {"path": "b"}}]}}), "either name or signerName must be specified".into()),
        ("pod certificate valid", json!({"name": "v", "projected": {"sources": [{"podCertificate": {"signerName": "example.com/signer", "keyType": "ED25519", "credentialBundlePath": "creds.pem", "keyPath": "tls.key", "certificateChainPath": "tls.crt", "maxExpirationSeconds": 7862400, "userAnnotations": {"example.com/team": "a"}}}]}}), String::new()),
        ("pod certificate no path", json!({"name": "v", "projected": {"sources": [{"podCertificate": {"signerName": "example.com/signer", "keyType": "ED25519"}}]}}), "spec.volumes[0].projected.sources[0].podCertificate: Required value: specify at least one of credentialBundlePath, keyPath, and certificateChainPath".into()),
        ("pod certificate key type", json!({"name": "v", "projected": {"sources": [{"podCertificate": {"signerName": "example.com/signer", "keyType": "RSA2048", "keyPath": "k"}}]}}), "spec.volumes[0].projected.sources[0].podCertificate.keyType: Unsupported value: \"RSA2048\": supported values: \"RSA3072\", \"RSA4096\", \"ECDSAP256\", \"ECDSAP384\", \"ECDSAP521\", \"ED25519\"".into()),
        ("pod certificate signer without path", json!({"name": "v", "projected": {"sources": [{"podCertificate": {"signerName": "example.com", "keyType": "ED25519", "keyPath": "k"}}]}}), "must be a fully qualified domain and path of the form 'example.com/signer-name'".into()),
        ("pod certificate signer one label", json!({"name": "v", "projected": {"sources": [{"podCertificate": {"signerName": "example/signer", "keyType": "ED25519", "keyPath": "k"}}]}}), "should be a domain with at least two segments separated by dots".into()),
        ("pod certificate signer required", json!({"name": "v", "projected": {"sources": [{"podCertificate": {"signerName": "", "keyType": "ED25519", "keyPath": "k"}}]}}), "spec.volumes[0].projected.sources[0].podCertificate.signerName: Required value".into()),
        ("pod certificate short life", json!({"name": "v", "projected": {"sources": [{"podCertificate": {"signerName": "example.com/s", "keyType": "ED25519", "keyPath": "k", "maxExpirationSeconds": 600}}]}}), "if provided, maxExpirationSeconds must be >= 3600".into()),
        ("pod certificate kubernetes signer long life", json!({"name": "v", "projected": {"sources": [{"podCertificate": {"signerName": "kubernetes.io/kube-apiserver-client-pod", "keyType": "ED25519", "keyPath": "k", "maxExpirationSeconds": 86401}}]}}), "if provided, maxExpirationSeconds must be <= 86400".into()),
        ("pod certificate annotation not prefixed", json!({"name": "v", "projected": {"sources": [{"podCertificate": {"signerName": "example.com/s", "keyType": "ED25519", "keyPath": "k", "userAnnotations": {"team": "a"}}}]}}), "must be a domain-prefixed key".into()),
        ("pod certificate paths collide", json!({"name": "v", "projected": {"sources": [{"podCertificate": {"signerName": "example.com/s", "keyType": "ED25519", "keyPath": "k"}}, {"serviceAccountToken": {"path": "k"}}]}}), "conflicting duplicate paths".into()),
        ("pod certificate path escapes", json!({"name": "v", "projected": {"sources": [{"podCertificate": {"signerName": "example.com/s", "keyType": "ED25519", "keyPath": "../k"}}]}}), "podCertificate.keyPath: Invalid value".into()),
        ("projected bundle selector with name", json!({"name": "v", "projected": {"sources": [{"clusterTrustBundle": {"path": "b", "name": "x", "labelSelector": {}}}]}}), "labelSelector can only be used with signerName".into()),
        ("projected secret name", json!({"name": "v", "projected": {"sources": [{"secret": {"name": ""}}]}}), "projected.sources[0].secret.name: Required value".into()),
    ];
    check_rows(rows, |v| errors(&pod_with(v.clone())));
}

/// Checks table rows (name, input, expected substring of the errors; "" means valid).
fn check_rows<T, W: AsRef<str>>(rows: Vec<(&str, T, W)>, errors: impl Fn(&T) -> String) {
    for (name, input, want) in rows {
        let (got, want) = (errors(&input), want.as_ref());
        if want.is_empty() {
            assert!(got.is_empty(), "row {name:?}: expected valid, got:\n{got}");
        } else {
            assert!(
                got.contains(want),
                "row {name:?}: expected {want:?} in:\n{got}"
            );
        }
    }
}

fn joined(errs: Vec<FieldError>) -> String {
    errs.iter()
        .map(|e| e.to_string())
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn config_map_objects() {
    let cm = |v: serde_json::Value| -> ConfigMap { serde_json::from_value(v).expect("parses") };
    let rows: Vec<(&str, ConfigMap, &str)> = vec![
        ("valid", cm(json!({"metadata": {"name": "cm"}, "data": {"a.b_C-1": "x"}, "binaryData": {"bin": "AAE="}})), ""),
        ("no name", cm(json!({"metadata": {}})), "metadata.name: Required value"),
        ("bad name", cm(json!({"metadata": {"name": "CM"}})), "metadata.name: Invalid value: \"CM\""),
        ("bad namespace", cm(json!({"metadata": {"name": "cm", "namespace": "a.b"}})), "metadata.namespace: Invalid value: \"a.b\""),
        ("bad key chars", cm(json!({"metadata": {"name": "cm"}, "data": {"a/b": "x"}})), "data[a/b]: Invalid value: \"a/b\": a valid config key must consist of alphanumeric characters"),
        ("key dot", cm(json!({"metadata": {"name": "cm"}, "data": {".": "x"}})), "must not be '.'"),
        ("key dotdot", cm(json!({"metadata": {"name": "cm"}, "data": {"..": "x"}})), "must not be '..'"),
        ("key starts with dotdot", cm(json!({"metadata": {"name": "cm"}, "binaryData": {"..data": "AA=="}})), "binaryData[..data]: Invalid value: \"..data\": must not start with '..'"),
        ("key too long", cm(json!({"metadata": {"name": "cm"}, "data": {"k".repeat(254): "x"}})), "must be no more than 253 characters"),
        ("key in both", cm(json!({"metadata": {"name": "cm"}, "data": {"k": "x"}, "binaryData": {"k": "AA=="}})), "data[k]: Invalid value: \"k\": duplicate of key present in binaryData"),
        ("too big", cm(json!({"metadata": {"name": "cm"}, "data": {"a": "x".repeat(MAX_OBJECT_SIZE), "b": "y"}})), "data: Too long: may not be more than 1048576 bytes"),
    ];
    check_rows(rows, |o| joined(validate_config_map(o)));
    let exact = cm(json!({"metadata": {"name": "cm"}, "data": {"a": "x".repeat(MAX_OBJECT_SIZE)}}));
    assert!(
        validate_config_map(&exact).is_empty(),
        "exactly 1 MiB is allowed"
    );
}

#[test]
fn secret_objects() {
    let secret = |v: serde_json::Value| -> Secret {
        let mut s: Secret = serde_json::from_value(v).expect("parses");
        merge_string_data(&mut s);
        s
    };
    let rows: Vec<(&str, Secret, &str)> = vec![
        (
            "valid",
            secret(
                json!({"metadata": {"name": "s"}, "data": {"k": "dmFsdWU="}, "stringData": {"t": "text"}}),
            ),
            "",
        ),
        (
            "bad key",
            secret(json!({"metadata": {"name": "s"}, "stringData": {"a b": "x"}})),
            "data[a b]: Invalid value",
        ),
        (
            "too big after merge",
            secret(
                json!({"metadata": {"name": "s"}, "stringData": {"a": "x".repeat(MAX_OBJECT_SIZE + 1)}}),
            ),
            "data: Too long",
        ),
        (
            "tls needs key",
            secret(
                json!({"metadata": {"name": "s"}, "type": "kubernetes.io/tls", "stringData": {"tls.crt": "c"}}),
            ),
            "data[tls.key]: Required value",
        ),
        (
            "ssh needs key",
            secret(json!({"metadata": {"name": "s"}, "type": "kubernetes.io/ssh-auth"})),
            "data[ssh-privatekey]: Required value",
        ),
        (
            "basic auth needs one",
            secret(json!({"metadata": {"name": "s"}, "type": "kubernetes.io/basic-auth"})),
            "one of username or password must be provided",
        ),
        (
            "basic auth ok",
            secret(
                json!({"metadata": {"name": "s"}, "type": "kubernetes.io/basic-auth", "stringData": {"password": "p"}}),
            ),
            "",
        ),
        (
            "dockerconfigjson json",
            secret(
                json!({"metadata": {"name": "s"}, "type": "kubernetes.io/dockerconfigjson", "stringData": {".dockerconfigjson": "{nope"}}),
            ),
            "data[.dockerconfigjson]: Invalid value: \"<secret contents redacted>\"",
        ),
        (
            "dockercfg required",
            secret(json!({"metadata": {"name": "s"}, "type": "kubernetes.io/dockercfg"})),
            "data[.dockercfg]: Required value",
        ),
        (
            "sa token annotation",
            secret(
                json!({"metadata": {"name": "s"}, "type": "kubernetes.io/service-account-token"}),
            ),
            "metadata.annotations[kubernetes.io/service-account.name]: Required value",
        ),
    ];
    check_rows(rows, |o| joined(validate_secret(o)));
    let merged = secret(
        json!({"metadata": {"name": "s"}, "data": {"k": "b2xk"}, "stringData": {"k": "new"}}),
    );
    assert_eq!(merged.data.unwrap()["k"].0, b"new", "stringData wins");
}

#[test]
fn cleaning() {
    assert_eq!(clean_item_path("./a//b/"), "a/b");
    assert_eq!(clean_item_path("./"), "");
    assert_eq!(
        split_subscript("metadata.labels['a/b']"),
        Some(("metadata.labels", "a/b"))
    );
    assert_eq!(split_subscript("metadata.labels"), None);
}
