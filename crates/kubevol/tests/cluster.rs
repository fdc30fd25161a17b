//! Cluster mode against an API server that keeps the real server's rules (the project's
//! in-process test server): the node's identity, field selectors, per-object authorization
//! with a lag, resource versions and `410 Gone`, graceful pod deletion, outages.

#[macro_use]
mod common;

use std::time::Duration;

use common::*;
use kubevol::source::ClusterSource;
use kubevol::VolumeManager;
use kubevol_testserver::{TestServer, ADMIN_TOKEN};
use serde_json::{json, Value};

const NODE: &str = "test-node";

/// A manager fed by `server`'s pods of this node, with the node's identity.
async fn cluster_manager(root: &std::path::Path, server: &TestServer) -> VolumeManager {
    let m = manager(root, |_| {});
    m.add_source(ClusterSource::new(
        server.client(&TestServer::node_token(NODE)).await,
        NODE,
    ));
    m
}

/// A pod bound to `node` whose one container mounts every volume.
fn bound_pod(name: &str, node: &str, volumes: Value) -> Value {
    let mounts: Vec<Value> = volumes
        .as_array()
        .unwrap()
        .iter()
        .map(|v| json!({"name": v["name"], "mountPath": format!("/mnt/{}", v["name"].as_str().unwrap())}))
        .collect();
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
           "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox", "volumeMounts": mounts}], "volumes": volumes}})
}

/// The typed pod of a stored one (its UID is the server's).
fn typed(v: &Value) -> k8s_openapi::api::core::v1::Pod {
    serde_json::from_value(v.clone()).unwrap()
}

/// Waits, woken by the manager's changes, until `cond` holds.
async fn until(m: &VolumeManager, secs: u64, what: &str, mut cond: impl FnMut() -> bool) {
    let mut rx = m.subscribe();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while !cond() {
        // Woken by a change, or every 100 ms for what the manager is not told of.
        let wake = tokio::time::Instant::now() + Duration::from_millis(100);
        let _ = tokio::time::timeout_at(wake.min(deadline), rx.changed()).await;
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within {secs}s; status: {:#?}",
            m.status(true)
        );
    }
}

mount_test! {
    fn pods_bound_to_the_node_come_and_go_and_their_config_maps_update() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let server = TestServer::start().await.unwrap();
            server.create(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "app", "namespace": "default"}, "data": {"level": "info"}})).unwrap();
            let m = cluster_manager(root.path(), &server).await;
            let web = server.create(bound_pod("web", NODE, json!([{"name": "cfg", "configMap": {"name": "app"}}, {"name": "tmp", "emptyDir": {}}]))).unwrap();
            let other = server.create(bound_pod("elsewhere", "node-b", json!([{"name": "tmp", "emptyDir": {}}]))).unwrap();
            let web_pod = typed(&web);
            m.wait_for_attach_and_mount(&web_pod).await.expect("the node's pod is mounted");
            let uid = kubevol::pod_uid(&web_pod);
            assert_eq!(uid.as_str(), web["metadata"]["uid"].as_str().unwrap(), "the server's UID is the pod's identity");
            let cfg = m.mounted_volumes_for_pod(&uid)["cfg"].path.clone();
            assert_eq!(std::fs::read_to_string(cfg.join("level")).unwrap(), "info");
            assert!(m.pod_status(&kubevol::pod_uid(&typed(&other))).is_none(), "another node's pod is not even seen");

            // A ConfigMap update reaches the volume.
            server.apply(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "app", "namespace": "default"}, "data": {"level": "debug"}})).unwrap();
            until(&m, 10, "the ConfigMap update", || std::fs::read_to_string(cfg.join("level")).is_ok_and(|t| t == "debug")).await;

            // Deleted gracefully: the deletionTimestamp tears the volumes down; the node then
            // deletes the pod for good.
            server.delete("v1", "pods", "default", "web", None).unwrap();
            m.wait_for_unmount(&web_pod).await.expect("torn down once the pod is being deleted");
            assert!(server.get("v1", "pods", "default", "web").is_some(), "the server keeps it until its node deletes it");
            server.delete("v1", "pods", "default", "web", Some(0)).unwrap();
            let pod_dir = m.config().root_dir.join(format!("pods/{uid}"));
            until(&m, 10, "the pod forgotten and its directory removed", || m.pod_status(&uid).is_none() && !pod_dir.exists()).await;
            m.shutdown();
        });
    }
}

mount_test! {
    fn an_object_the_authorizer_does_not_yet_relate_to_the_node_is_waited_for_not_failed() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let server = TestServer::start().await.unwrap();
            // The authorizer learns a new pod's references 2 s after it appears: reads of its
            // Secret are refused until then.
            server.set_relation_delay(Duration::from_secs(2));
            server.create(json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "token", "namespace": "default"}, "stringData": {"t": "s3cret"}})).unwrap();
            let node = server.client(&TestServer::node_token(NODE)).await;
            let secrets: kube::Api<k8s_openapi::api::core::v1::Secret> = kube::Api::namespaced(node.clone(), "default");
            let refused = secrets.get("token").await.unwrap_err();
            assert!(refused.to_string().contains("no relationship found between node 'test-node' and this object"), "{refused}");
            let all = secrets.list(&Default::default()).await.unwrap_err();
            assert!(all.to_string().contains("Forbidden"), "a node may not list all Secrets: {all}");

            let m = manager(root.path(), |_| {});
            m.add_source(ClusterSource::new(node, NODE));
            let p = server.create(bound_pod("app", NODE, json!([{"name": "token", "secret": {"secretName": "token"}}]))).unwrap();
            let pod = typed(&p);
            m.wait_for_attach_and_mount(&pod).await.expect("mounted once the server relates the Secret to the node");
            let v = &m.mounted_volumes_for_pod(&kubevol::pod_uid(&pod))["token"];
            assert_eq!(std::fs::read_to_string(v.path.join("t")).unwrap(), "s3cret");
            m.shutdown();
        });
    }
}

mount_test! {
    fn an_outage_tears_nothing_down_and_the_re_list_removes_exactly_the_pod_deleted_meanwhile() {
        let root = TestRoot::new();
        let outage = std::env::var("KUBEVOL_TEST_OUTAGE_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(60);
        runtime().block_on(async {
            let mut server = TestServer::start().await.unwrap();
            let m = cluster_manager(root.path(), &server).await;
            let keep = typed(&server.create(bound_pod("keep", NODE, json!([{"name": "mem", "emptyDir": {"medium": "Memory"}}]))).unwrap());
            let gone = typed(&server.create(bound_pod("gone", NODE, json!([{"name": "mem", "emptyDir": {"medium": "Memory"}}]))).unwrap());
            for p in [&keep, &gone] {
                m.wait_for_attach_and_mount(p).await.expect("mounted");
            }
            let keep_dir = m.mounted_volumes_for_pod(&kubevol::pod_uid(&keep))["mem"].path.clone();
            std::fs::write(keep_dir.join("canary"), "alive").unwrap();
            let gone_uid = kubevol::pod_uid(&gone);

            server.stop().await;
            server.delete("v1", "pods", "default", "gone", Some(0)).unwrap();
            // The server forgets its history: the watch cannot resume and must list again.
            server.compact();
            until(&m, 60, "the source reporting the outage", || m.status(false).notes.iter().any(|n| n.contains("cannot be watched"))).await;
            let not_ready = kubevol::http::readiness(&m).unwrap_err();
            assert!(not_ready.contains("cannot be watched"), "/readyz says why: {not_ready}");
            tokio::time::sleep(Duration::from_secs(outage)).await;
            assert!(m.mounted_volumes_for_pod(&gone_uid).contains_key("mem"), "nothing is torn down while the server is away");

            server.restart().await.unwrap();
            m.wait_for_unmount(&gone).await.expect("the pod deleted during the outage goes after the re-list");
            until(&m, 60, "the outage note cleared", || !m.status(false).notes.iter().any(|n| n.contains("cannot be watched"))).await;
            assert_eq!(kubevol::http::readiness(&m), Ok(()));
            assert_eq!(std::fs::read_to_string(keep_dir.join("canary")).unwrap(), "alive", "the other pod's volume was never remounted");
            assert_eq!(mounts_under(&m.config().root_dir).len(), 1, "exactly the remaining pod's mount");
            m.shutdown();
        });
    }
}

#[tokio::test]
async fn the_node_identity_has_the_node_authorizers_rights_and_no_more() {
    let server = TestServer::start().await.unwrap();
    server.create(bound_pod("mine", NODE, json!([]))).unwrap();
    server
        .create(bound_pod("theirs", "node-b", json!([])))
        .unwrap();
    let node = server.client(&TestServer::node_token(NODE)).await;
    let admin = server.client(ADMIN_TOKEN).await;
    let pods: kube::Api<k8s_openapi::api::core::v1::Pod> = kube::Api::all(node.clone());
    let err = pods.list(&Default::default()).await.unwrap_err();
    assert!(
        err.to_string()
            .contains("can only list/watch pods with spec.nodeName field selector"),
        "{err}"
    );
    let mine = pods
        .list(&kube::api::ListParams::default().fields(&format!("spec.nodeName={NODE}")))
        .await
        .unwrap();
    assert_eq!(mine.items.len(), 1);
    let theirs: kube::Api<k8s_openapi::api::core::v1::Pod> = kube::Api::namespaced(node, "default");
    assert!(theirs.get("theirs").await.is_err(), "another node's pod");
    let all: kube::Api<k8s_openapi::api::core::v1::Pod> = kube::Api::all(admin);
    assert_eq!(
        all.list(&Default::default()).await.unwrap().items.len(),
        2,
        "the administrator sees every pod"
    );
}

/// The claims of a JWT (its second part, base64url without padding).
fn claims(token: &str) -> Value {
    let part = token.split('.').nth(1).expect("a JWT has three parts");
    let mut bits = 0u32;
    let mut n = 0;
    let mut out = Vec::new();
    for c in part.bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'-' => 62,
            b'_' => 63,
            _ => panic!("not base64url: {c}"),
        };
        bits = (bits << 6) | u32::from(v);
        n += 6;
        if n >= 8 {
            n -= 8;
            out.push((bits >> n) as u8);
        }
    }
    serde_json::from_slice(&out).expect("JSON claims")
}

mount_test! {
    fn projected_service_account_tokens_are_bound_to_the_pod_and_renewed() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let server = TestServer::start().await.unwrap();
            // The server grants 10 s whatever is asked: the token is renewed after 8 s.
            server.set_max_token_lifetime(Duration::from_secs(10));
            server.create(json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": "default"}})).unwrap();
            server.create(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "kube-root-ca.crt", "namespace": "default"}, "data": {"ca.crt": "CA"}})).unwrap();
            let node = server.client(&TestServer::node_token(NODE)).await;
            let m = manager(root.path(), |_| {});
            m.set_token_issuer(std::sync::Arc::new(kubevol::source::cluster::ClusterTokens::new(node.clone())));
            m.add_source(ClusterSource::new(node, NODE));
            // The volume every pod of a cluster gets.
            let access = json!([{"name": "kube-api-access", "projected": {"defaultMode": 420, "sources": [
                {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}]}}]);
            let p = server.create(bound_pod("app", NODE, access.clone())).unwrap();
            let mut lost = bound_pod("lost", NODE, access);
            lost["spec"]["serviceAccountName"] = json!("missing");
            let lost = typed(&server.create(lost).unwrap());
            let pod = typed(&p);
            m.wait_for_attach_and_mount(&pod).await.expect("mounted with a token");
            let uid = kubevol::pod_uid(&pod);
            let dir = m.mounted_volumes_for_pod(&uid)["kube-api-access"].path.clone();
            assert_eq!(std::fs::read_to_string(dir.join("ca.crt")).unwrap(), "CA");
            assert_eq!(std::fs::read_to_string(dir.join("namespace")).unwrap(), "default");
            let first = std::fs::read_to_string(dir.join("token")).unwrap();
            let c = claims(&first);
            assert_eq!(c["kubernetes.io"]["pod"]["uid"], json!(uid.as_str()), "bound to the pod: {c}");
            assert_eq!(c["sub"], json!("system:serviceaccount:default:default"));
            assert_eq!(c["aud"], json!(["https://kubernetes.default.svc"]), "the server's own audience when the source names none");

            // Renewed before it expires, without the pod doing anything.
            until(&m, 30, "the token renewed", || std::fs::read_to_string(dir.join("token")).is_ok_and(|t| t != first)).await;
            let renewed = claims(&std::fs::read_to_string(dir.join("token")).unwrap());
            assert!(renewed["iat"].as_i64() > c["iat"].as_i64() || renewed["jti"] != c["jti"], "{renewed}");

            // A service account that does not exist: the volume says so; no token anywhere.
            let s = wait_for_status(&m, &lost, 20, |s| s.volumes.iter().any(|v| v.retry.last_error.is_some())).await;
            let e = s.volumes[0].retry.last_error.clone().unwrap();
            assert!(e.contains("serviceaccounts \"missing\" not found") && e.contains("default/missing"), "{e}");
            let all = serde_json::to_string(&m.status(true)).unwrap();
            assert!(!all.contains(first.split('.').nth(1).unwrap()), "a token never appears in the status or events");
            m.shutdown();
        });
    }
}

mount_test! {
    fn events_reach_the_api_server_folded_and_rate_limited() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let server = TestServer::start().await.unwrap();
            let node = server.client(&TestServer::node_token(NODE)).await;
            let m = manager(root.path(), |_| {});
            m.set_event_sink(kubevol::source::cluster::EventPoster::spawn(node.clone(), NODE));
            m.add_source(ClusterSource::new(node, NODE));
            let p = typed(&server.create(bound_pod("app", NODE, json!([{"name": "tmp", "emptyDir": {}}, {"name": "cfg", "configMap": {"name": "missing"}}]))).unwrap());
            let uid = kubevol::pod_uid(&p);
            let admin = server.client(ADMIN_TOKEN).await;
            let events: kube::Api<k8s_openapi::api::core::v1::Event> = kube::Api::namespaced(admin, "default");
            let of_pod = || async {
                events
                    .list(&Default::default())
                    .await
                    .unwrap()
                    .items
                    .into_iter()
                    .filter(|e| e.involved_object.uid.as_deref() == Some(uid.as_str()))
                    .collect::<Vec<_>>()
            };
            // The failing volume is retried every 200 ms at most: its FailedMount event is one
            // Event whose count grows, until the pod's budget (a burst of 25) is spent.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
            let failed = loop {
                let list = of_pod().await;
                let failed: Vec<_> = list.iter().filter(|e| e.reason.as_deref() == Some("FailedMount")).cloned().collect();
                let posted: i32 = list.iter().map(|e| e.count.unwrap_or(1)).sum();
                if posted >= 25 {
                    break failed;
                }
                assert!(tokio::time::Instant::now() < deadline, "25 events not posted: {list:#?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            assert_eq!(failed.len(), 1, "repeats fold into one Event: {failed:#?}");
            let e = &failed[0];
            assert!(e.count.unwrap_or(0) > 1, "{e:#?}");
            assert_eq!(e.type_.as_deref(), Some("Warning"));
            assert!(e.message.as_deref().unwrap_or_default().contains("default/missing not found"), "{e:#?}");
            let source = e.source.clone().unwrap();
            assert_eq!((source.component.as_deref(), source.host.as_deref()), (Some("kubevol"), Some(NODE)));
            assert_eq!(e.involved_object.kind.as_deref(), Some("Pod"));
            let mounted = of_pod().await.into_iter().any(|e| e.reason.as_deref() == Some("SuccessfulMountVolume"));
            assert!(mounted, "the other volume's success is posted too");

            // Ten more failures later, nothing more was posted.
            let failures = |m: &VolumeManager| {
                m.pod_status(&uid).and_then(|s| s.volumes.iter().find(|v| v.name == "cfg").map(|v| v.retry.failures)).unwrap_or(0)
            };
            let now = failures(&m);
            until(&m, 60, "ten more failures", || failures(&m) >= now + 10).await;
            let posted: i32 = of_pod().await.iter().map(|e| e.count.unwrap_or(1)).sum();
            assert!(posted <= 26, "rate-limited to a burst of 25 (one more per 5 minutes): {posted}");
            m.shutdown();
        });
    }
}

/// A PEM certificate block of `body`.
fn cert(body: &str) -> String {
    format!("-----BEGIN CERTIFICATE-----\n{body}\n-----END CERTIFICATE-----")
}

mount_test! {
    fn cluster_trust_bundles_are_projected_by_name_or_signer_and_their_absence_is_explained() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let server = TestServer::start().await.unwrap();
            let bundle = |name: &str, signer: Option<&str>, pem: String| {
                let mut b = json!({"apiVersion": "certificates.k8s.io/v1beta1", "kind": "ClusterTrustBundle",
                                   "metadata": {"name": name, "labels": {"trust": "yes"}}, "spec": {"trustBundle": pem}});
                if let Some(s) = signer {
                    b["spec"]["signerName"] = json!(s);
                }
                server.create(b).unwrap();
            };
            bundle("example.com:signer:a", Some("example.com/signer"), format!("{}\n{}\n", cert("AAA"), cert("BBB")));
            bundle("example.com:signer:b", Some("example.com/signer"), format!("{}\n{}\n", cert("BBB"), cert("CCC")));
            bundle("plain", None, cert("DDD"));
            let node = server.client(&TestServer::node_token(NODE)).await;
            let m = manager(root.path(), |_| {});
            m.set_trust_bundles(std::sync::Arc::new(kubevol::source::cluster::ClusterTrustBundles::new(node.clone())));
            m.add_source(ClusterSource::new(node, NODE));
            let sources = json!([{"name": "ca", "projected": {"sources": [
                {"clusterTrustBundle": {"name": "plain", "path": "plain.pem"}},
                {"clusterTrustBundle": {"signerName": "example.com/signer", "labelSelector": {"matchLabels": {"trust": "yes"}}, "path": "signer.pem"}},
                {"clusterTrustBundle": {"name": "absent", "path": "absent.pem", "optional": true}}]}}]);
            let p = typed(&server.create(bound_pod("app", NODE, sources.clone())).unwrap());
            m.wait_for_attach_and_mount(&p).await.expect("mounted with the bundles");
            let dir = m.mounted_volumes_for_pod(&kubevol::pod_uid(&p))["ca"].path.clone();
            assert_eq!(std::fs::read_to_string(dir.join("plain.pem")).unwrap(), format!("{}\n", cert("DDD")));
            let signer = std::fs::read_to_string(dir.join("signer.pem")).unwrap();
            assert_eq!(signer, format!("{}\n{}\n{}\n", cert("AAA"), cert("BBB"), cert("CCC")), "every bundle of the signer, each certificate once");
            assert!(!dir.join("absent.pem").exists(), "an optional source that matches nothing is skipped");

            // A server without the API: the volume says so.
            server.disable("clustertrustbundles");
            let q = typed(&server.create(bound_pod("later", NODE, sources)).unwrap());
            let s = wait_for_status(&m, &q, 20, |s| s.volumes.iter().any(|v| v.retry.last_error.is_some())).await;
            let e = s.volumes[0].retry.last_error.clone().unwrap();
            assert!(e.contains("the API server does not serve ClusterTrustBundles (certificates.k8s.io/v1beta1)"), "{e}");
            m.shutdown();
        });
    }
}
