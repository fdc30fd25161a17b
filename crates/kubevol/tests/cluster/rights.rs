//! The node's rights: its identity may do what the Node authorizer allows and no more, and the
//! in-process server answers each request as the real one does.

use crate::common::*;
use crate::{bound_pod, NODE};
use kubevol_testserver::{Backend, TestCluster};
use serde_json::{json, Value};

#[tokio::test]
async fn the_node_identity_has_the_node_authorizers_rights_and_no_more() {
    let cluster = TestCluster::start_on(Backend::Real, NODE).await;
    cluster.expect_refusals();
    let node_name = cluster.node_name().to_string();
    cluster
        .create(bound_pod("mine", &node_name, json!([])))
        .await;
    cluster
        .create(bound_pod("theirs", "kubevol-test-other-node", json!([])))
        .await;
    let node = node_client(&cluster);
    let pods: kube::Api<k8s_openapi::api::core::v1::Pod> = kube::Api::all(node.clone());
    let err = pods.list(&Default::default()).await.unwrap_err();
    assert!(
        err.to_string()
            .contains("can only list/watch pods with spec.nodeName field selector"),
        "{err}"
    );
    let mine = pods
        .list(&kube::api::ListParams::default().fields(&format!("spec.nodeName={node_name}")))
        .await
        .unwrap();
    assert!(mine
        .items
        .iter()
        .any(|p| p.metadata.name.as_deref() == Some("mine")));
    assert!(mine
        .items
        .iter()
        .all(|p| p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node_name.as_str())));
    let theirs: kube::Api<k8s_openapi::api::core::v1::Pod> =
        kube::Api::namespaced(node, cluster.namespace());
    assert!(theirs.get("theirs").await.is_err(), "another node's pod");
    assert_eq!(
        cluster.list("v1", "pods").await.len(),
        2,
        "the administrator sees every pod"
    );
    cluster.clean_up().await;
}

/// The status code the server answers `method path` (with `body`) with, as the node.
async fn answer(node: &kube::Client, method: &str, path: &str, body: Option<Value>) -> u16 {
    let req = axum::http::Request::builder()
        .method(method)
        .uri(path)
        .header(
            "content-type",
            if method == "PATCH" {
                "application/merge-patch+json"
            } else {
                "application/json"
            },
        )
        .body(kube::client::Body::from(
            body.map(|b| serde_json::to_vec(&b).unwrap())
                .unwrap_or_default(),
        ))
        .unwrap();
    match node.send(req).await {
        Ok(r) => r.status().as_u16(),
        Err(kube::Error::Api(s)) => s.code,
        Err(e) => panic!("{method} {path}: {e}"),
    }
}

/// What a node is allowed, request by request: objects a pod of the node uses and objects
/// nothing of the node uses, read by name and listed; claims, PersistentVolumes and
/// VolumeAttachments only by GET; its own Node and no other.
async fn node_rights(backend: Backend) -> Vec<(String, u16, u16)> {
    let cluster = TestCluster::start_on(backend, NODE).await;
    cluster.expect_refusals();
    let (node, ns) = (
        cluster.node_name().to_string(),
        cluster.namespace().to_string(),
    );
    let other = cluster.scoped("kubevol-test-other-node");
    // A real cluster's ServiceAccount controller makes `default` by itself.
    if !cluster.is_real() {
        cluster
            .create(json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}}))
            .await;
    }
    cluster
        .create(
            json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "unused"}}),
        )
        .await;
    let (pv_used, pv_unused) = (cluster.scoped("pv-used"), cluster.scoped("pv-unused"));
    for n in [&node, &other] {
        cluster
            .create(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": n}}))
            .await;
    }
    for name in ["cm-used", "cm-unused"] {
        cluster.create(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {"k": "v"}})).await;
    }
    for name in ["s-used", "s-csi", "s-unused"] {
        cluster.create(json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "stringData": {"k": "v"}})).await;
    }
    for (pv, claim) in [(&pv_used, "c-used"), (&pv_unused, "c-unused")] {
        cluster.create(json!({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
            "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"], "claimRef": {"namespace": ns, "name": claim},
                     "csi": {"driver": "example.csi.kubevol.io", "volumeHandle": pv, "nodePublishSecretRef": {"namespace": ns, "name": "s-csi"}}}})).await;
        cluster.create(json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim},
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}, "volumeName": pv, "storageClassName": ""}})).await;
    }
    let (va_mine, va_other) = (cluster.scoped("va-mine"), cluster.scoped("va-other"));
    for (va, n) in [(&va_mine, &node), (&va_other, &other)] {
        cluster.create(json!({"apiVersion": "storage.k8s.io/v1", "kind": "VolumeAttachment", "metadata": {"name": va},
            "spec": {"attacher": "example.csi.kubevol.io", "nodeName": n, "source": {"persistentVolumeName": pv_used}}})).await;
    }
    let mine = cluster
        .create(bound_pod(
            "mine",
            &node,
            json!([
        {"name": "cm", "configMap": {"name": "cm-used"}},
        {"name": "s", "secret": {"secretName": "s-used"}},
        {"name": "data", "persistentVolumeClaim": {"claimName": "c-used"}},
        {"name": "token", "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]}}]),
        ))
        .await;
    let theirs = cluster
        .create(bound_pod(
            "theirs",
            &other,
            json!([{"name": "tmp", "emptyDir": {}}]),
        ))
        .await;
    let uid = |pod: &Value| pod["metadata"]["uid"].as_str().unwrap().to_string();
    let (mine_uid, theirs_uid) = (uid(&mine), uid(&theirs));
    // A token for `pod`, of the server's own audience or of `audience`.
    let token_request = |uid: &str, pod: &str, audience: Option<&str>| {
        json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
               "spec": {"audiences": audience.into_iter().collect::<Vec<_>>(), "expirationSeconds": 600,
                        "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": uid}}})
    };
    let client = node_client(&cluster);
    let core = format!("/api/v1/namespaces/{ns}");
    // The real authorizer learns the pod's references a moment after its creation.
    let learnt = [
        format!("{core}/configmaps/cm-used"),
        format!("/api/v1/persistentvolumes/{pv_used}"),
        format!("{core}/secrets/s-csi"),
        format!("{core}/serviceaccounts/default"),
    ];
    kubevol_testserver::cluster::eventually(
        "the authorizer relating the pod's objects to the node",
        120,
        || {
            let (client, learnt) = (client.clone(), learnt.clone());
            async move {
                for p in &learnt {
                    if answer(&client, "GET", p, None).await != 200 {
                        return false;
                    }
                }
                true
            }
        },
    )
    .await;
    let by_name =
        |plural: &str, name: &str| format!("{core}/{plural}?fieldSelector=metadata.name%3D{name}");
    let event = json!({"apiVersion": "v1", "kind": "Event", "metadata": {"name": "mine.1", "namespace": ns},
        "involvedObject": {"kind": "Pod", "name": "mine", "namespace": ns}, "reason": "Test", "message": "m", "type": "Normal"});
    let cases: Vec<(&str, String, Option<Value>, u16)> = vec![
        ("GET", format!("{core}/configmaps/cm-used"), None, 200),
        ("GET", format!("{core}/configmaps/cm-unused"), None, 403),
        ("GET", by_name("configmaps", "cm-used"), None, 200),
        ("GET", by_name("configmaps", "cm-unused"), None, 403),
        ("GET", format!("{core}/configmaps"), None, 403),
        ("GET", format!("{core}/secrets/s-used"), None, 200),
        ("GET", format!("{core}/secrets/s-csi"), None, 200),
        ("GET", format!("{core}/secrets/s-unused"), None, 403),
        ("GET", by_name("secrets", "s-used"), None, 200),
        ("GET", format!("{core}/secrets"), None, 403),
        ("GET", format!("{core}/serviceaccounts/default"), None, 200),
        ("GET", format!("{core}/serviceaccounts/unused"), None, 403),
        ("GET", format!("{core}/serviceaccounts"), None, 403),
        (
            "GET",
            format!("{core}/persistentvolumeclaims/c-used"),
            None,
            200,
        ),
        (
            "GET",
            format!("{core}/persistentvolumeclaims/c-unused"),
            None,
            403,
        ),
        (
            "GET",
            by_name("persistentvolumeclaims", "c-used"),
            None,
            403,
        ),
        ("GET", format!("{core}/persistentvolumeclaims"), None, 403),
        (
            "PATCH",
            format!("{core}/persistentvolumeclaims/c-used/status"),
            Some(json!({})),
            200,
        ),
        (
            "PATCH",
            format!("{core}/persistentvolumeclaims/c-unused/status"),
            Some(json!({})),
            403,
        ),
        (
            "GET",
            format!("/api/v1/persistentvolumes/{pv_used}"),
            None,
            200,
        ),
        (
            "GET",
            format!("/api/v1/persistentvolumes/{pv_unused}"),
            None,
            403,
        ),
        (
            "GET",
            format!("/api/v1/persistentvolumes?fieldSelector=metadata.name%3D{pv_used}"),
            None,
            403,
        ),
        (
            "GET",
            format!("/apis/storage.k8s.io/v1/volumeattachments/{va_mine}"),
            None,
            200,
        ),
        (
            "GET",
            format!("/apis/storage.k8s.io/v1/volumeattachments/{va_other}"),
            None,
            403,
        ),
        (
            "GET",
            format!(
                "/apis/storage.k8s.io/v1/volumeattachments/{}",
                cluster.scoped("va-missing")
            ),
            None,
            403,
        ),
        (
            "GET",
            "/apis/storage.k8s.io/v1/volumeattachments".to_string(),
            None,
            403,
        ),
        ("GET", "/api/v1/pods".to_string(), None, 403),
        (
            "GET",
            format!("/api/v1/pods?fieldSelector=spec.nodeName%3D{node}"),
            None,
            200,
        ),
        ("GET", format!("{core}/pods/mine"), None, 200),
        ("GET", format!("{core}/pods/theirs"), None, 403),
        ("GET", format!("/api/v1/nodes/{node}"), None, 200),
        ("GET", format!("/api/v1/nodes/{other}"), None, 403),
        (
            "GET",
            format!("/api/v1/nodes?fieldSelector=metadata.name%3D{node}"),
            None,
            200,
        ),
        ("GET", "/api/v1/nodes".to_string(), None, 403),
        (
            "PATCH",
            format!("/api/v1/nodes/{node}/status"),
            Some(json!({"status": {"volumesInUse": []}})),
            200,
        ),
        (
            "GET",
            "/apis/storage.k8s.io/v1/csidrivers".to_string(),
            None,
            200,
        ),
        ("POST", format!("{core}/events"), Some(event), 201),
        (
            "POST",
            format!("{core}/secrets"),
            Some(json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "new"}})),
            403,
        ),
        (
            "POST",
            format!("{core}/serviceaccounts/default/token"),
            Some(token_request(&mine_uid, "mine", None)),
            201,
        ),
        (
            "POST",
            format!("{core}/serviceaccounts/default/token"),
            Some(token_request(&mine_uid, "mine", Some("vault"))),
            403,
        ),
        (
            "POST",
            format!("{core}/serviceaccounts/default/token"),
            Some(token_request(&theirs_uid, "theirs", None)),
            403,
        ),
    ];
    let mut answers = Vec::new();
    for (method, path, body, want) in cases {
        let got = answer(&client, method, &path, body).await;
        // The names of this test's own objects are the same in both servers' answers.
        let path = path
            .replace(&ns, "NS")
            .replace(&node, "NODE")
            .replace(&other, "OTHER");
        let path = path.replace(&format!("-{}", "NS"), "");
        answers.push((format!("{method} {path}"), got, want));
    }
    cluster.clean_up().await;
    answers
}

/// The in-process server is exactly as strict as the real one: the same requests of a node
/// (reads, lists, status patches, an event, its pods' service accounts, TokenRequests for its
/// own pod and another's), the same status codes, one by one (and each as the Node authorizer's rules say).
#[tokio::test]
async fn the_in_process_server_answers_a_node_as_the_real_one_does() {
    let fake = node_rights(Backend::InProcess).await;
    let real = node_rights(Backend::Real).await;
    let mut differ = Vec::new();
    for ((what, fake_code, want), (_, real_code, _)) in fake.iter().zip(&real) {
        println!("{what:<90} in-process {fake_code}  real {real_code}  rule {want}");
        if fake_code != real_code || real_code != want {
            differ.push(format!(
                "{what}: in-process {fake_code}, real {real_code}, the rule {want}"
            ));
        }
    }
    assert!(
        differ.is_empty(),
        "the answers differ:\n{}",
        differ.join("\n")
    );
}
