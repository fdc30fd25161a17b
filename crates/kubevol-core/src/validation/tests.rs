use super::*;
use serde_json::json;

/// Every name that becomes part of a path, tried with a separator, a backstep, a NUL and
/// 300 characters: each is refused, by the field that holds it.
#[test]
fn every_name_that_becomes_a_path_refuses_what_would_climb_out() {
    use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};
    use k8s_openapi::api::storage::v1::StorageClass;
    let long = "a".repeat(300);
    let hostile = ["a/b", "..", "../x", "a\0b", long.as_str()];
    // (what, field, the object with `{}` where the name goes, its validation)
    type Check = fn(&serde_json::Value) -> Vec<FieldError>;
    let check_pod: Check = |v| validate_pod(&serde_json::from_value(v.clone()).unwrap());
    let check_claim: Check =
        |v| validate_claim(&serde_json::from_value::<PersistentVolumeClaim>(v.clone()).unwrap());
    let check_pv: Check = |v| {
        validate_persistent_volume(&serde_json::from_value::<PersistentVolume>(v.clone()).unwrap())
    };
    let check_class: Check =
        |v| validate_storage_class(&serde_json::from_value::<StorageClass>(v.clone()).unwrap());
    let pod_with = |uid: &str, volume: &str, container: &str, driver: &str| {
        json!({"metadata": {"name": "p", "namespace": "default", "uid": uid}, "spec": {
            "containers": [{"name": container, "volumeMounts": [{"name": volume, "mountPath": "/v"}]}],
            "volumes": [{"name": volume, "csi": {"driver": driver}}]}})
    };
    let uid = "0b3f4c2e-9a1d-4c55-8f0e-2d3c4b5a6f70";
    let claim_with = |name: &str, ns: &str, uid: &str| {
        json!({"metadata": {"name": name, "namespace": ns, "uid": uid}, "spec": {
            "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}})
    };
    let pv_with = |name: &str, driver: &str| {
        json!({"metadata": {"name": name}, "spec": {"capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteOnce"], "csi": {"driver": driver, "volumeHandle": "h"}}})
    };
    for bad in hostile {
        let rows: Vec<(&str, &str, serde_json::Value, Check)> = vec![
            (
                "pod UID",
                "metadata.uid",
                pod_with(bad, "v", "c", "d.example"),
                check_pod,
            ),
            (
                "volume name",
                "spec.volumes[0].name",
                pod_with(uid, bad, "c", "d.example"),
                check_pod,
            ),
            (
                "container name",
                "spec.containers[0].name",
                pod_with(uid, "v", bad, "d.example"),
                check_pod,
            ),
            (
                "inline CSI driver",
                "spec.volumes[0].csi.driver",
                pod_with(uid, "v", "c", bad),
                check_pod,
            ),
            (
                "claim name",
                "metadata.name",
                claim_with(bad, "default", uid),
                check_claim,
            ),
            (
                "claim namespace",
                "metadata.namespace",
                claim_with("c", bad, uid),
                check_claim,
            ),
            (
                "claim UID",
                "metadata.uid",
                claim_with("c", "default", bad),
                check_claim,
            ),
            (
                "PersistentVolume name",
                "metadata.name",
                pv_with(bad, "d.example"),
                check_pv,
            ),
            (
                "PersistentVolume CSI driver",
                "spec.csi.driver",
                pv_with("pv", bad),
                check_pv,
            ),
            (
                "StorageClass name",
                "metadata.name",
                json!({"metadata": {"name": bad}, "provisioner": "p.example"}),
                check_class,
            ),
        ];
        for (what, field, object, check) in rows {
            let errors = check(&object);
            assert!(
                errors.iter().any(|e| e.field == field),
                "{what} {bad:?}: {}",
                errors
                    .iter()
                    .map(|e| e.to_string())
                    .collect::<Vec<_>>()
                    .join("; ")
            );
        }
    }
}

fn pod(spec: serde_json::Value) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "p", "namespace": "default"},
        "spec": spec,
    }))
    .expect("test pod parses")
}

fn with_volume(volume: serde_json::Value) -> Pod {
    let name = volume["name"].as_str().unwrap_or("").to_string();
    pod(json!({
        "containers": [{"name": "c", "image": "i", "volumeMounts": [{"name": name, "mountPath": "/m"}]}],
        "volumes": [volume],
    }))
}

/// (row name, pod, expected substring of the joined errors; "" means valid)
fn rows() -> Vec<(&'static str, Pod, &'static str)> {
    vec![
        ("valid emptyDir", with_volume(json!({"name": "a", "emptyDir": {}})), ""),
        ("valid memory with limit", with_volume(json!({"name": "a", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}})), ""),
        ("valid hugepages size", with_volume(json!({"name": "a", "emptyDir": {"medium": "HugePages-2Mi"}})), ""),
        ("valid hostPath", with_volume(json!({"name": "a", "hostPath": {"path": "/var/log", "type": "Directory"}})), ""),
        ("upper-case name", with_volume(json!({"name": "Data", "emptyDir": {}})), "spec.volumes[0].name: Invalid value: \"Data\": a lowercase RFC 1123 label"),
        ("name too long", with_volume(json!({"name": "a".repeat(64), "emptyDir": {}})), "must be no more than 63 characters"),
        ("empty name", pod(json!({"containers": [{"name": "c"}], "volumes": [{"name": "", "emptyDir": {}}]})), "spec.volumes[0].name: Required value"),
        ("name ends with dash", with_volume(json!({"name": "a-", "emptyDir": {}})), "spec.volumes[0].name: Invalid value"),
        ("no source", with_volume(json!({"name": "a"})), "spec.volumes[0]: Required value: must specify a volume type"),
        ("two sources", with_volume(json!({"name": "a", "emptyDir": {}, "hostPath": {"path": "/x"}})), "may not specify more than 1 volume type (found emptyDir, hostPath)"),
        ("relative hostPath", with_volume(json!({"name": "a", "hostPath": {"path": "var/log"}})), "spec.volumes[0].hostPath.path: Invalid value: \"var/log\": must be an absolute path"),
        ("hostPath with ..", with_volume(json!({"name": "a", "hostPath": {"path": "/var/../etc"}})), "must not contain '..'"),
        ("hostPath with ..\\", with_volume(json!({"name": "a", "hostPath": {"path": "/var/..\\etc"}})), "must not contain '..'"),
        ("hostPath dots in a name are fine", with_volume(json!({"name": "a", "hostPath": {"path": "/var/..data"}})), ""),
        ("empty hostPath", with_volume(json!({"name": "a", "hostPath": {"path": ""}})), "spec.volumes[0].hostPath.path: Required value"),
        ("bad hostPath type", with_volume(json!({"name": "a", "hostPath": {"path": "/x", "type": "Dir"}})), "spec.volumes[0].hostPath.type: Unsupported value: \"Dir\""),
        ("bad medium", with_volume(json!({"name": "a", "emptyDir": {"medium": "SSD"}})), "spec.volumes[0].emptyDir.medium: Unsupported value: \"SSD\""),
        ("bad hugepage size", with_volume(json!({"name": "a", "emptyDir": {"medium": "HugePages-big"}})), "emptyDir.medium: Unsupported value"),
        ("negative sizeLimit", with_volume(json!({"name": "a", "emptyDir": {"sizeLimit": "-1Gi"}})), "emptyDir.sizeLimit: Invalid value: \"-1Gi\": SizeLimit field must be a valid resource quantity"),
        ("garbage sizeLimit", with_volume(json!({"name": "a", "emptyDir": {"sizeLimit": "lots"}})), "emptyDir.sizeLimit: Invalid value: \"lots\": quantities must match"),
        // The API server takes it; the kubelet sizes such a tmpfs as if no limit were set.
        ("zero sizeLimit is no limit", with_volume(json!({"name": "a", "emptyDir": {"sizeLimit": "0"}})), ""),
        ("duplicate volume names", pod(json!({"containers": [{"name": "c"}], "volumes": [{"name": "a", "emptyDir": {}}, {"name": "a", "emptyDir": {}}]})), "spec.volumes[1].name: Duplicate value: \"a\""),
        ("mount of missing volume", pod(json!({"containers": [{"name": "c", "volumeMounts": [{"name": "nope", "mountPath": "/m"}]}]})), "spec.containers[0].volumeMounts[0].name: Not found: \"nope\""),
        ("duplicate mountPath", pod(json!({"containers": [{"name": "c", "volumeMounts": [{"name": "a", "mountPath": "/m"}, {"name": "b", "mountPath": "/m"}]}], "volumes": [{"name": "a", "emptyDir": {}}, {"name": "b", "emptyDir": {}}]})), "spec.containers[0].volumeMounts[1].mountPath: Invalid value: \"/m\": must be unique"),
        ("same mountPath in two containers is fine", pod(json!({"containers": [{"name": "c", "volumeMounts": [{"name": "a", "mountPath": "/m"}]}, {"name": "d", "volumeMounts": [{"name": "a", "mountPath": "/m"}]}], "volumes": [{"name": "a", "emptyDir": {}}]})), ""),
        ("absolute subPath", pod(json!({"containers": [{"name": "c", "volumeMounts": [{"name": "a", "mountPath": "/m", "subPath": "/etc"}]}], "volumes": [{"name": "a", "emptyDir": {}}]})), "subPath: Invalid value: \"/etc\": must be a relative path"),
        ("subPath backsteps", pod(json!({"containers": [{"name": "c", "volumeMounts": [{"name": "a", "mountPath": "/m", "subPath": "x/../../y"}]}], "volumes": [{"name": "a", "emptyDir": {}}]})), "subPath: Invalid value: \"x/../../y\": must not contain '..'"),
        ("subPath and subPathExpr", pod(json!({"containers": [{"name": "c", "volumeMounts": [{"name": "a", "mountPath": "/m", "subPath": "x", "subPathExpr": "$(A)"}]}], "volumes": [{"name": "a", "emptyDir": {}}]})), "mutually exclusive"),
        ("bidirectional unprivileged", pod(json!({"containers": [{"name": "c", "volumeMounts": [{"name": "a", "mountPath": "/m", "mountPropagation": "Bidirectional"}]}], "volumes": [{"name": "a", "emptyDir": {}}]})), "available only to privileged containers"),
        ("bad propagation", pod(json!({"containers": [{"name": "c", "volumeMounts": [{"name": "a", "mountPath": "/m", "mountPropagation": "Shared"}]}], "volumes": [{"name": "a", "emptyDir": {}}]})), "mountPropagation: Unsupported value: \"Shared\""),
        ("recursiveReadOnly needs readOnly", pod(json!({"containers": [{"name": "c", "volumeMounts": [{"name": "a", "mountPath": "/m", "recursiveReadOnly": "Enabled"}]}], "volumes": [{"name": "a", "emptyDir": {}}]})), "may only be specified when readOnly is true"),
        ("device on emptyDir", pod(json!({"containers": [{"name": "c", "volumeDevices": [{"name": "a", "devicePath": "/dev/x"}]}], "volumes": [{"name": "a", "emptyDir": {}}]})), "can only use volume source type of PersistentVolumeClaim"),
        ("duplicate container names", pod(json!({"initContainers": [{"name": "c"}], "containers": [{"name": "c"}]})), "spec.containers[0].name: Duplicate value: \"c\""),
        ("bad container name", pod(json!({"containers": [{"name": "C_1"}]})), "spec.containers[0].name: Invalid value: \"C_1\""),
        ("no containers", pod(json!({"containers": []})), "spec.containers: Required value"),
        ("valid generic ephemeral volume", with_volume(json!({"name": "a", "ephemeral": {"volumeClaimTemplate": {"metadata": {"labels": {"app": "x"}}, "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}, "storageClassName": "fast"}}}})), ""),
        ("ephemeral without a template", with_volume(json!({"name": "a", "ephemeral": {}})), "spec.volumes[0].ephemeral.volumeClaimTemplate: Required value"),
        ("ephemeral template with a name", with_volume(json!({"name": "a", "ephemeral": {"volumeClaimTemplate": {"metadata": {"name": "x"}, "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}}})), "spec.volumes[0].ephemeral.volumeClaimTemplate.metadata: Forbidden: cannot be set"),
        ("ephemeral template without access modes", with_volume(json!({"name": "a", "ephemeral": {"volumeClaimTemplate": {"spec": {"resources": {"requests": {"storage": "1Gi"}}}}}})), "spec.volumes[0].ephemeral.volumeClaimTemplate.spec.accessModes: Required value"),
        ("ephemeral template without storage", with_volume(json!({"name": "a", "ephemeral": {"volumeClaimTemplate": {"spec": {"accessModes": ["ReadWriteOnce"]}}}})), "volumeClaimTemplate.spec.resources.requests[storage]: Required value"),
        ("ephemeral template with zero storage", with_volume(json!({"name": "a", "ephemeral": {"volumeClaimTemplate": {"spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "0"}}}}}})), "must be greater than zero"),
        ("ephemeral template with a bad mode", with_volume(json!({"name": "a", "ephemeral": {"volumeClaimTemplate": {"spec": {"accessModes": ["ReadWriteOncePod", "ReadWriteOnce"], "resources": {"requests": {"storage": "1"}}, "volumeMode": "Raw"}}}})), "may not use ReadWriteOncePod with other access modes"),
        ("ephemeral claim name too long", {
            let mut p = with_volume(json!({"name": "a".repeat(63), "ephemeral": {"volumeClaimTemplate": {"spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}}}));
            p.metadata.name = Some("p".repeat(200));
            p
        }, "spec.volumes[0].name: Invalid value: \"aaaa"),
        ("claim of an ephemeral volume named", pod(json!({"containers": [{"name": "c", "volumeMounts": [{"name": "a", "mountPath": "/a"}, {"name": "b", "mountPath": "/b"}]}],
            "volumes": [{"name": "a", "ephemeral": {"volumeClaimTemplate": {"spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}}},
                        {"name": "b", "persistentVolumeClaim": {"claimName": "p-a"}}]})),
            "spec.volumes[1].persistentVolumeClaim.claimName: Invalid value: \"p-a\": must not reference a PVC that gets created for an ephemeral volume"),
        ("bad uid", {
            let mut p = with_volume(json!({"name": "a", "emptyDir": {}}));
            p.metadata.uid = Some("../../etc".into());
            p
        }, "metadata.uid: Invalid value: \"../../etc\": must be a lower-case UUID"),
        ("bad namespace", {
            let mut p = with_volume(json!({"name": "a", "emptyDir": {}}));
            p.metadata.namespace = Some("Prod".into());
            p
        }, "metadata.namespace: Invalid value: \"Prod\""),
    ]
}

#[test]
fn validation_table() {
    for (name, pod, want) in rows() {
        let got: Vec<String> = validate_pod(&pod).iter().map(|e| e.to_string()).collect();
        let joined = got.join("\n");
        if want.is_empty() {
            assert!(
                got.is_empty(),
                "row {name:?}: expected valid, got:\n{joined}"
            );
        } else {
            assert!(
                joined.contains(want),
                "row {name:?}: expected {want:?} in:\n{joined}"
            );
        }
    }
}

#[test]
fn every_violation_is_listed() {
    let p = pod(json!({
        "containers": [{"name": "c", "volumeMounts": [{"name": "x", "mountPath": "/m"}]}],
        "volumes": [{"name": "A", "emptyDir": {"medium": "Disk"}}, {"name": "b", "hostPath": {"path": "rel", "type": "Nope"}}],
    }));
    let fields: Vec<String> = validate_pod(&p).into_iter().map(|e| e.field).collect();
    assert_eq!(
        fields,
        vec![
            "spec.volumes[0].name",
            "spec.volumes[0].emptyDir.medium",
            "spec.volumes[1].hostPath.path",
            "spec.volumes[1].hostPath.type",
            "spec.containers[0].volumeMounts[0].name",
        ]
    );
}

#[test]
fn uuid_shape() {
    assert!(is_canonical_uuid("0b3f4c2e-9a1d-4c55-8f0e-2d3c4b5a6f70"));
    assert!(!is_canonical_uuid("0B3F4C2E-9A1D-4C55-8F0E-2D3C4B5A6F70"));
    assert!(!is_canonical_uuid("0b3f4c2e9a1d4c558f0e2d3c4b5a6f70"));
    assert!(!is_canonical_uuid("0b3f4c2e-9a1d-4c55-8f0e-2d3c4b5a6f7/"));
}

#[test]
fn subdomain_rules() {
    assert!(dns1123_subdomain_error("web.example-1").is_none());
    assert!(dns1123_subdomain_error("web..x").is_some());
    assert!(dns1123_subdomain_error(&"a".repeat(254)).is_some());
}

/// An image volume's reference is read in the registries' grammar and its pull policy is one
/// of the three: a newline (an option after it), a 10,000-character reference, no reference,
/// an unknown policy are each refused by their field; a plain reference passes.
#[test]
fn an_image_volume_is_refused_unless_its_reference_and_pull_policy_are_real() {
    let pod = |image: serde_json::Value| {
        let p = json!({"metadata": {"name": "p", "namespace": "default"}, "spec": {
            "containers": [{"name": "c", "volumeMounts": [{"name": "v", "mountPath": "/v"}]}],
            "volumes": [{"name": "v", "image": image}]}});
        validate_pod(&serde_json::from_value(p).unwrap())
    };
    assert!(pod(json!({"reference": "quay.io/x/y:1", "pullPolicy": "IfNotPresent"})).is_empty());
    let long = format!("quay.io/{}", "a".repeat(10_000));
    for (image, field) in [
        (
            json!({"reference": "quay.io/x/y:1\n--privileged"}),
            "spec.volumes[0].image.reference",
        ),
        (
            json!({"reference": long}),
            "spec.volumes[0].image.reference",
        ),
        (json!({}), "spec.volumes[0].image.reference"),
        (
            json!({"reference": "busybox", "pullPolicy": "Sometimes"}),
            "spec.volumes[0].image.pullPolicy",
        ),
    ] {
        let errs = pod(image.clone());
        assert!(errs.iter().any(|e| e.field == field), "{image}: {errs:?}");
    }
}
