//! Cluster mode against a real kube-apiserver: the project's control plane (the README's test
//! command starts it), or a cluster that `KUBEVOL_TEST_KUBECONFIG` and
//! `KUBEVOL_TEST_NODE_KUBECONFIG` name (see `kubevol_testserver::cluster`). The node's
//! identity, field selectors, per-object authorization with a lag, resource versions and `410
//! Gone`, graceful pod deletion, outages. The in-process server runs only the faults the real
//! one cannot make on demand ([`cluster_test_with_faults!`]), and answers a node's requests
//! exactly as the real one does (`rights`).

#[macro_use]
#[path = "../common/mod.rs"]
mod common;
mod certificates;
mod credentials;
mod reads;
mod rights;
mod tenants;

use std::time::Duration;

use common::*;
use kubevol::source::ClusterSource;
use kubevol::VolumeManager;
use kubevol_testserver::{Backend, TestCluster};
use serde_json::{json, Value};

/// The node's name against the in-process server (a real cluster's is its node kubeconfig's).
const NODE: &str = "test-node";

/// A manager fed by the cluster's pods of its node, with the node's identity.
fn cluster_manager(root: &std::path::Path, cluster: &TestCluster) -> VolumeManager {
    let m = manager(root, |c| c.node_name = cluster.node_name().into());
    m.add_source(ClusterSource::new(
        node_client(cluster),
        cluster.node_name(),
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
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
           "spec": {"nodeName": node, "automountServiceAccountToken": false, "containers": [{"name": "c", "image": "busybox", "volumeMounts": mounts}], "volumes": volumes}})
}

/// The typed pod of a stored one (its UID is the server's).
fn typed(v: &Value) -> k8s_openapi::api::core::v1::Pod {
    serde_json::from_value(v.clone()).unwrap()
}

/// The node's requests, after checking that claims and PersistentVolumes were only read with
/// GET (the only verb the Node authorizer allows a node on them).
fn storage_only_read_with_get(cluster: &TestCluster) -> std::collections::BTreeMap<String, u64> {
    let requests = cluster
        .node_requests()
        .expect("the server counts the node's requests");
    for (what, count) in &requests {
        let storage = what.contains("persistentvolume");
        assert!(
            !storage || what.starts_with("get "),
            "{what}: {count}; a node may only get claims and volumes: {requests:#?}"
        );
    }
    requests
}

/// A directory `data` under `root` with a file `kept` ("yes") in it, for a hostPath volume.
fn kept_data(root: &std::path::Path) -> std::path::PathBuf {
    let data = root.join("data");
    std::fs::create_dir(&data).unwrap();
    std::fs::write(data.join("kept"), "yes").unwrap();
    data
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

cluster_test! {
    fn pods_bound_to_the_node_come_and_go_and_their_config_maps_update(backend) {
        let root = TestRoot::new();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(backend, NODE).await;
            let node = cluster.node_name().to_string();
            cluster.create(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "app"}, "data": {"level": "info"}})).await;
            let m = cluster_manager(root.path(), &cluster);
            let web = cluster.create(bound_pod("web", &node, json!([{"name": "cfg", "configMap": {"name": "app"}}, {"name": "tmp", "emptyDir": {}}]))).await;
            let other = cluster.create(bound_pod("elsewhere", "kubevol-test-other-node", json!([{"name": "tmp", "emptyDir": {}}]))).await;
            let web_pod = typed(&web);
            m.wait_for_attach_and_mount(&web_pod).await.expect("the node's pod is mounted");
            let uid = kubevol::pod_uid(&web_pod);
            assert_eq!(uid.as_str(), web["metadata"]["uid"].as_str().unwrap(), "the server's UID is the pod's identity");
            let cfg = m.mounted_volumes_for_pod(&uid)["cfg"].path.clone();
            assert_eq!(std::fs::read_to_string(cfg.join("level")).unwrap(), "info");
            assert!(m.pod_status(&kubevol::pod_uid(&typed(&other))).is_none(), "another node's pod is not even seen");

            // A ConfigMap update reaches the volume.
            cluster.apply(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "app"}, "data": {"level": "debug"}})).await;
            until(&m, 120, "the ConfigMap update", || std::fs::read_to_string(cfg.join("level")).is_ok_and(|t| t == "debug")).await;

            // Deleted gracefully: the deletionTimestamp tears the volumes down; the node then
            // deletes the pod for good.
            cluster.delete("v1", "pods", "web", None).await;
            m.wait_for_unmount(&web_pod).await.expect("torn down once the pod is being deleted");
            assert!(cluster.get("v1", "pods", "web").await.is_some(), "the server keeps it until its node deletes it");
            cluster.delete("v1", "pods", "web", Some(0)).await;
            let pod_dir = m.config().root_dir.join(format!("pods/{uid}"));
            until(&m, 120, "the pod forgotten and its directory removed", || m.pod_status(&uid).is_none() && !pod_dir.exists()).await;
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

cluster_test_with_faults! {
    fn an_object_the_authorizer_does_not_yet_relate_to_the_node_is_waited_for_not_failed(backend) {
        let root = TestRoot::new();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(backend, NODE).await;
            let node_name = cluster.node_name().to_string();
            // The authorizer learns a new pod's references only when the test says so (a real
            // server's lag is its own): reads of its Secret are refused until then.
            if let Some(server) = cluster.server() {
                server.set_relation_delay(Duration::from_secs(3600));
            }
            cluster.create(json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "token"}, "stringData": {"t": "s3cret"}})).await;
            let node = node_client(&cluster);
            // The test's own reads as the node, refused on purpose.
            cluster.expect_refusal_of("get", "secrets", &format!("{}/token", cluster.namespace()));
            cluster.expect_refusal_of("list", "secrets", &format!("{}/", cluster.namespace()));
            let secrets: kube::Api<k8s_openapi::api::core::v1::Secret> = kube::Api::namespaced(node.clone(), cluster.namespace());
            let refused = secrets.get("token").await.unwrap_err();
            assert!(refused.to_string().contains(&format!("no relationship found between node '{node_name}' and this object")), "{refused}");
            let all = secrets.list(&Default::default()).await.unwrap_err();
            assert!(all.to_string().contains("Forbidden") || all.to_string().contains("forbidden"), "a node may not list all Secrets: {all}");

            let m = cluster_manager(root.path(), &cluster);
            let p = cluster.create(bound_pod("app", &node_name, json!([{"name": "token", "secret": {"secretName": "token"}}]))).await;
            let pod = typed(&p);
            // Until the Secret's watch has listed it, the volume waits: Pending, saying for
            // what, and no failure event.
            if let Some(server) = cluster.server() {
                let s = wait_for_status(&m, &pod, 120, |s| !s.volumes.is_empty()).await;
                let v = &s.volumes[0];
                assert_eq!(v.state, kubevol::status::VolumePhase::Pending, "{s:#?}");
                assert_eq!(s.phase, kubevol::status::PodPhase::Pending, "not ready while a volume waits: {s:#?}");
                let why = v.retry.last_error.clone().unwrap_or_default();
                assert!(why.contains(&format!("waiting for the API server to deliver Secret {}/token", cluster.namespace())), "{why}");
                server.learn_relations();
            }
            m.wait_for_attach_and_mount(&pod).await.expect("mounted once the server relates the Secret to the node");
            let failures: Vec<_> = m.events().into_iter().filter(|e| e.reason == "FailedMount").collect();
            assert!(failures.is_empty(), "a Secret still to be listed is no failure: {failures:#?}");
            let v = &m.mounted_volumes_for_pod(&kubevol::pod_uid(&pod))["token"];
            assert_eq!(std::fs::read_to_string(v.path.join("t")).unwrap(), "s3cret");
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

cluster_test_with_faults! {
    fn a_minute_long_outage_tears_nothing_down_and_the_re_list_removes_exactly_the_pod_deleted_meanwhile(backend) {
        let root = TestRoot::new();
        let outage = std::env::var("KUBEVOL_TEST_OUTAGE_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(60);
        runtime().block_on(async {
            let cluster = TestCluster::start_on(backend, NODE).await;
            let node = cluster.node_name().to_string();
            let m = cluster_manager(root.path(), &cluster);
            let keep = typed(&cluster.create(bound_pod("keep", &node, json!([{"name": "mem", "emptyDir": {"medium": "Memory"}}]))).await);
            let gone = typed(&cluster.create(bound_pod("gone", &node, json!([{"name": "mem", "emptyDir": {"medium": "Memory"}}]))).await);
            for p in [&keep, &gone] {
                m.wait_for_attach_and_mount(p).await.expect("mounted");
            }
            let keep_dir = m.mounted_volumes_for_pod(&kubevol::pod_uid(&keep))["mem"].path.clone();
            std::fs::write(keep_dir.join("canary"), "alive").unwrap();
            let gone_uid = kubevol::pod_uid(&gone);

            // The node loses the server; meanwhile a pod is deleted.
            cluster.cut().await;
            cluster.delete("v1", "pods", "gone", Some(0)).await;
            // The in-process server forgets its history too: the watch cannot resume and must
            // list again.
            if let Some(server) = cluster.server() {
                server.compact();
            }
            until(&m, 60, "the source reporting the outage", || m.status(false).notes.iter().any(|n| n.contains("cannot be watched"))).await;
            let not_ready = kubevol::http::readiness(&m).unwrap_err();
            assert!(not_ready.contains("cannot be watched"), "/readyz says why: {not_ready}");
            tokio::time::sleep(Duration::from_secs(outage)).await;
            assert!(m.mounted_volumes_for_pod(&gone_uid).contains_key("mem"), "nothing is torn down while the server is away");

            cluster.restore();
            m.wait_for_unmount(&gone).await.expect("the pod deleted during the outage goes after the re-list");
            until(&m, 60, "the outage note cleared", || !m.status(false).notes.iter().any(|n| n.contains("cannot be watched"))).await;
            assert_eq!(kubevol::http::readiness(&m), Ok(()));
            assert_eq!(std::fs::read_to_string(keep_dir.join("canary")).unwrap(), "alive", "the other pod's volume was never remounted");
            assert_eq!(mounts_under(&m.config().root_dir).len(), 1, "exactly the remaining pod's mount");
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

mount_test! {
    /// A watch that cannot resume because the server's history was compacted meanwhile (`410
    /// Gone` from the real kube-apiserver, which serves ConfigMaps from etcd on the project's
    /// control plane) lists again and gets what changed: the ConfigMap's last version reaches
    /// the volume, and the source counts one more listing.
    fn a_watch_whose_history_was_compacted_lists_again() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(Backend::Real, NODE).await;
            let node = cluster.node_name().to_string();
            cluster.create(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "app"}, "data": {"level": "info"}})).await;
            let m = manager(root.path(), |c| c.node_name = node.clone());
            let source = ClusterSource::new(node_client(&cluster), &node);
            let listings = source.listings();
            m.add_source(source);
            let pod = typed(&cluster.create(bound_pod("web", &node, json!([{"name": "cfg", "configMap": {"name": "app"}}]))).await);
            m.wait_for_attach_and_mount(&pod).await.expect("mounted");
            let cfg = m.mounted_volumes_for_pod(&kubevol::pod_uid(&pod))["cfg"].path.clone();
            assert_eq!(std::fs::read_to_string(cfg.join("level")).unwrap(), "info");
            let before = listings.objects();

            // Two versions while the node is away (the history then has a revision past the
            // one the watch resumes after), and the history compacted up to now.
            cluster.cut().await;
            for level in ["debug", "trace"] {
                cluster.apply(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "app"}, "data": {"level": level}})).await;
            }
            cluster.compact_history().await;
            cluster.restore();
            until(&m, 60, "the ConfigMap's last version after the re-list", || std::fs::read_to_string(cfg.join("level")).is_ok_and(|t| t == "trace")).await;
            assert!(listings.objects() > before, "the watch listed again ({} listings before, {} after)", before, listings.objects());
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

cluster_test! {
    /// Once the server answers again after connection failures, `/readyz` and the status say
    /// so at once, though no pod changed (a resumed watch is silent until one does: the
    /// readiness stayed "cannot be watched" for minutes).
    fn readiness_comes_back_with_the_server_though_no_pod_changes(backend) {
        let root = TestRoot::new();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(backend, NODE).await;
            let node = cluster.node_name().to_string();
            let m = cluster_manager(root.path(), &cluster);
            let p = typed(&cluster.create(bound_pod("keep", &node, json!([{"name": "tmp", "emptyDir": {}}]))).await);
            m.wait_for_attach_and_mount(&p).await.expect("mounted");
            assert_eq!(kubevol::http::readiness(&m), Ok(()));
            for _ in 0..3 {
                cluster.cut().await;
                until(&m, 60, "the source reporting the failure", || kubevol::http::readiness(&m).is_err_and(|e| e.contains("cannot be watched"))).await;
                cluster.restore();
                until(&m, 120, "ready again with no pod changed", || kubevol::http::readiness(&m).is_ok()).await;
            }
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

cluster_test_with_faults! {
    fn projected_service_account_tokens_are_bound_to_the_pod_and_renewed(backend) {
        let root = TestRoot::new();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(backend, NODE).await;
            let (node, ns) = (cluster.node_name().to_string(), cluster.namespace().to_string());
            // The in-process server grants 10 s whatever is asked: the token is renewed after
            // 8 s. A real server grants the 10 minutes asked: renewed after 8.
            if let Some(server) = cluster.server() {
                server.set_max_token_lifetime(Duration::from_secs(10));
            }
            let renewal = if cluster.is_real() { 600 } else { 30 };
            // A real cluster's ServiceAccount controller makes `default` by itself.
            if !cluster.is_real() {
                cluster.create(json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})).await;
            }
            cluster.create(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ca-bundle"}, "data": {"ca.crt": "CA"}})).await;
            // The volume every pod of a cluster gets.
            let access = json!([{"name": "kube-api-access", "projected": {"defaultMode": 420, "sources": [
                {"serviceAccountToken": {"expirationSeconds": 600, "path": "token"}},
                {"configMap": {"name": "ca-bundle", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}]}}]);
            // A pod whose service account is deleted after the pod was admitted (a server
            // refuses a pod that names one that does not exist).
            cluster.create(json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "missing"}})).await;
            let mut lost = bound_pod("lost", &node, access.clone());
            lost["spec"]["serviceAccountName"] = json!("missing");
            let lost = typed(&cluster.create(lost).await);
            cluster.delete("v1", "serviceaccounts", "missing", None).await;
            let m = manager(root.path(), |c| c.node_name = node.clone());
            m.set_token_issuer(std::sync::Arc::new(kubevol::source::cluster::ClusterTokens::new(node_client(&cluster))));
            m.add_source(ClusterSource::new(node_client(&cluster), &node));
            let p = cluster.create(bound_pod("app", &node, access)).await;
            let pod = typed(&p);
            m.wait_for_attach_and_mount(&pod).await.expect("mounted with a token");
            let uid = kubevol::pod_uid(&pod);
            let dir = m.mounted_volumes_for_pod(&uid)["kube-api-access"].path.clone();
            assert_eq!(std::fs::read_to_string(dir.join("ca.crt")).unwrap(), "CA");
            assert_eq!(std::fs::read_to_string(dir.join("namespace")).unwrap(), ns);
            let first = std::fs::read_to_string(dir.join("token")).unwrap();
            let c = jwt_claims(&first);
            assert_eq!(c["kubernetes.io"]["pod"]["uid"], json!(uid.as_str()), "bound to the pod: {c}");
            assert_eq!(c["sub"], json!(format!("system:serviceaccount:{ns}:default")));
            assert!(c["aud"].as_array().is_some_and(|a| !a.is_empty()), "the server's own audience when the source names none: {c}");
            if !cluster.is_real() {
                assert_eq!(c["aud"], json!(["https://kubernetes.default.svc"]));
            }

            // Renewed before it expires, without the pod doing anything. Only the in-process
            // server issues tokens this short: a real one's shortest lifetime is the 10
            // minutes asked, renewed after 8 (`KUBEVOL_TEST_TOKEN_RENEWAL=1` waits for it).
            if !cluster.is_real() || std::env::var_os("KUBEVOL_TEST_TOKEN_RENEWAL").is_some() {
                until(&m, renewal, "the token renewed", || std::fs::read_to_string(dir.join("token")).is_ok_and(|t| t != first)).await;
                let renewed = jwt_claims(&std::fs::read_to_string(dir.join("token")).unwrap());
                assert!(renewed["iat"].as_i64() > c["iat"].as_i64() || renewed["jti"] != c["jti"], "{renewed}");
            }

            // A service account that does not exist: the volume says so; no token anywhere.
            let named = |e: &String| e.contains("serviceaccounts \"missing\" not found") && e.contains(&format!("{ns}/missing"));
            wait_for_status(&m, &lost, 120, |s| s.volumes.iter().any(|v| v.retry.last_error.as_ref().is_some_and(&named))).await;
            let all = serde_json::to_string(&m.status(true)).unwrap();
            assert!(!all.contains(first.split('.').nth(1).unwrap()), "a token never appears in the status or events");
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

cluster_test! {
    fn events_reach_the_api_server_folded_and_rate_limited(backend) {
        let root = TestRoot::new();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(backend, NODE).await;
            let (node, ns) = (cluster.node_name().to_string(), cluster.namespace().to_string());
            let m = manager(root.path(), |c| c.node_name = node.clone());
            m.set_event_sink(kubevol::source::cluster::EventPoster::spawn(node_client(&cluster), &node).0);
            m.add_source(ClusterSource::new(node_client(&cluster), &node));
            let p = typed(&cluster.create(bound_pod("app", &node, json!([{"name": "tmp", "emptyDir": {}}, {"name": "cfg", "configMap": {"name": "missing"}}]))).await);
            let uid = kubevol::pod_uid(&p);
            let events: kube::Api<k8s_openapi::api::core::v1::Event> = kube::Api::namespaced(cluster.admin_client(), &ns);
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
            wait_for_status(&m, &p, 120, |s| s.events.iter().any(|e| e.reason == "SuccessfulMountVolume")).await;
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
                let _ = tokio::time::timeout(Duration::from_millis(100), m.subscribe().changed()).await;
            };
            assert_eq!(failed.len(), 1, "repeats fold into one Event: {failed:#?}");
            let e = &failed[0];
            assert!(e.count.unwrap_or(0) > 1, "{e:#?}");
            assert_eq!(e.type_.as_deref(), Some("Warning"));
            assert!(e.message.as_deref().unwrap_or_default().contains(&format!("{ns}/missing not found")), "{e:#?}");
            let source = e.source.clone().unwrap();
            assert_eq!((source.component.as_deref(), source.host.as_deref()), (Some("kubevol"), Some(node.as_str())));
            assert_eq!(e.involved_object.kind.as_deref(), Some("Pod"));
            // The other volume's success, recorded before the count above was reached, is not
            // posted (the kubelet has not posted it since 1.11), only kept in the status API.
            let posted: Vec<_> = of_pod().await.into_iter().filter_map(|e| e.reason).collect();
            assert!(posted.iter().all(|r| r == "FailedMount"), "{posted:?}");

            // Ten more failures later, nothing more was posted.
            let failures = |m: &VolumeManager| {
                m.pod_status(&uid).and_then(|s| s.volumes.iter().find(|v| v.name == "cfg").map(|v| v.retry.failures)).unwrap_or(0)
            };
            let now = failures(&m);
            until(&m, 60, "ten more failures", || failures(&m) >= now + 10).await;
            let posted: i32 = of_pod().await.iter().map(|e| e.count.unwrap_or(1)).sum();
            assert!(posted <= 26, "rate-limited to a burst of 25 (one more per 5 minutes): {posted}");
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

cluster_test! {
    /// A PersistentVolume's nodeAffinity is checked against the labels of the node's Node
    /// object: a pod waits (Failed, saying which label is missing) until the Node has it.
    fn a_volumes_node_affinity_follows_the_node_objects_labels(backend) {
        let root = TestRoot::new();
        let data = root.path().join("data");
        std::fs::create_dir(&data).unwrap();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(backend, NODE).await;
            let node = cluster.node_name().to_string();
            ensure_node(&cluster).await;
            let pv = format!("kubevol-test-{}", cluster.namespace());
            cluster.create(json!({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
                "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"], "hostPath": {"path": data, "type": "Directory"},
                         "claimRef": {"namespace": cluster.namespace(), "name": "data"},
                         "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [{"key": "kubevol.io/test-zone", "operator": "In", "values": ["a"]}]}]}}}})).await;
            cluster.create(json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "data"},
                "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}, "volumeName": pv, "storageClassName": ""}})).await;
            cluster.bind_claim("data", &pv).await;
            let m = cluster_manager(root.path(), &cluster);
            let p = typed(&cluster.create(bound_pod("app", &node, json!([{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]))).await);
            let s = wait_for_status(&m, &p, 120, |s| s.volumes.iter().any(|v| v.retry.last_error.as_deref().is_some_and(|e| e.contains("is on other nodes")))).await;
            let e = s.volumes[0].retry.last_error.clone().unwrap();
            assert!(e.contains("kubevol.io/test-zone in (a)") && e.contains(&format!("node {node}")), "{e}");

            let mut n = cluster.get("v1", "nodes", &node).await.unwrap();
            n["metadata"]["labels"]["kubevol.io/test-zone"] = json!("a");
            cluster.apply(n).await;
            m.wait_for_attach_and_mount(&p).await.expect("mounted once the Node has the label");
            m.shutdown();
            let mut n = cluster.get("v1", "nodes", &node).await.unwrap();
            n["metadata"]["labels"].as_object_mut().unwrap().remove("kubevol.io/test-zone");
            cluster.apply(n).await;
            cluster.clean_up().await;
        });
    }
}

mount_test! {
    /// Fields newer than kubevol's API types reach it from the API server as from a manifest:
    /// `emptyDir.mode` is honoured, any other unknown field of a volume is a warning. (Only
    /// the in-process server can serve a field no Kubernetes version has: a real server prunes
    /// what its own version does not know; the 1.37 fields from the real one are tested
    /// below.)
    fn volume_fields_newer_than_the_api_types_are_kept_from_the_api_server() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(Backend::InProcess, NODE).await;
            let node = cluster.node_name().to_string();
            let m = cluster_manager(root.path(), &cluster);
            let p = typed(&cluster.create(bound_pod("app", &node, json!([
                {"name": "scratch", "emptyDir": {"mode": 488}},
                {"name": "other", "emptyDir": {"futureField": true}}]))).await);
            m.wait_for_attach_and_mount(&p).await.expect("mounted");
            let uid = kubevol::pod_uid(&p);
            let dir = m.mounted_volumes_for_pod(&uid)["scratch"].path.clone();
            let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&dir).unwrap().permissions()) & 0o7777;
            assert_eq!(mode, 0o750, "emptyDir.mode applied");
            let s = m.pod_status(&uid).unwrap();
            let other = s.volumes.iter().find(|v| v.name == "other").unwrap();
            assert!(other.warnings.iter().any(|w| w.contains("futureField")), "{other:#?}");
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

cluster_test! {
    /// Kubernetes 1.37's alpha pod fields reach kubevol from the real API server (its control
    /// plane turns their gates on): `emptyDir.mode` gives the directory its mode, and a
    /// Secret volume's `defaultUser` and an item's `user` own its files. A 1.36 server does
    /// not know them and drops them: the defaults then hold (0777, kubevol's own user).
    fn the_alpha_pod_fields_of_1_37_arrive_from_the_real_api_server(backend) {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let root = TestRoot::new();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(backend, NODE).await;
            let node = cluster.node_name().to_string();
            let version = cluster.admin_client().apiserver_version().await.unwrap();
            let served = version.minor.trim_end_matches('+').parse::<u32>().unwrap() >= 37;
            cluster.create(json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "keys"}, "stringData": {"mine": "a", "theirs": "b"}})).await;
            let m = cluster_manager(root.path(), &cluster);
            let p = typed(&cluster.create(bound_pod("app", &node, json!([
                {"name": "scratch", "emptyDir": {"mode": 488}},
                {"name": "keys", "secret": {"secretName": "keys", "defaultUser": 1234,
                    "items": [{"key": "mine", "path": "mine"}, {"key": "theirs", "path": "theirs", "user": 2000}]}}]))).await);
            m.wait_for_attach_and_mount(&p).await.expect("mounted");
            let mounted = m.mounted_volumes_for_pod(&kubevol::pod_uid(&p));
            let mode = std::fs::metadata(&mounted["scratch"].path).unwrap().permissions().mode() & 0o7777;
            let owner = |f: &str| std::fs::metadata(mounted["keys"].path.join(f)).unwrap().uid();
            if served {
                assert_eq!(mode, 0o750, "emptyDir.mode from the server");
                assert_eq!((owner("mine"), owner("theirs")), (1234, 2000), "defaultUser and user from the server");
            } else {
                assert_eq!(mode, 0o777);
                assert_eq!((owner("mine"), owner("theirs")), (0, 0));
            }
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

mount_test! {
    /// A node multiplexes its requests over a few HTTP/2 connections, as client-go does: 100
    /// pods with four objects of their own each (400 watches by name, besides the pods', the
    /// Node's and the CSIDrivers') are all mounted — a connection is never given more streams
    /// than the server allows (kube-apiserver's 100: what goes beyond waits forever) — over
    /// the fewest connections that allows, one more at most. (kube's HTTP/1.1 client held one
    /// connection per watch; only the real server speaks HTTP/2.)
    fn a_node_multiplexes_its_watches_over_a_few_connections() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(Backend::Real, NODE).await;
            let node = cluster.node_name().to_string();
            let m = cluster_manager(root.path(), &cluster);
            let mut pods = Vec::new();
            for i in 0..100 {
                let mut volumes = Vec::new();
                for k in 0..2 {
                    cluster.create(json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": format!("s-{i}-{k}")}, "stringData": {"k": "v"}})).await;
                    cluster.create(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": format!("c-{i}-{k}")}, "data": {"k": "v"}})).await;
                    volumes.push(json!({"name": format!("s{k}"), "secret": {"secretName": format!("s-{i}-{k}")}}));
                    volumes.push(json!({"name": format!("c{k}"), "configMap": {"name": format!("c-{i}-{k}")}}));
                }
                pods.push(typed(&cluster.create(bound_pod(&format!("p{i}"), &node, Value::Array(volumes))).await));
            }
            for p in &pods {
                m.wait_for_attach_and_mount(p).await.expect("mounted");
            }
            let open = cluster.node_connections();
            let watches: usize = 400 + 3;
            let fewest = watches.div_ceil(kubevol::source::cluster::STREAMS_PER_CONNECTION);
            assert!(open <= fewest + 1, "{open} connections for {watches} watches");
            println!("{open} connections for {watches} watches");
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

mount_test! {
    /// A connection the network froze (no reset, no FIN: nothing arrives any more) is noticed
    /// within a minute by the HTTP/2 pings, `/readyz` says so, and once the network is back
    /// the watches resume: a pod created meanwhile is mounted. (The in-process server speaks
    /// HTTP/1.1, without pings.)
    fn a_connection_frozen_by_the_network_is_noticed_within_a_minute() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(Backend::Real, NODE).await;
            let node = cluster.node_name().to_string();
            let m = cluster_manager(root.path(), &cluster);
            let first = typed(&cluster.create(bound_pod("first", &node, json!([{"name": "tmp", "emptyDir": {}}]))).await);
            m.wait_for_attach_and_mount(&first).await.expect("mounted");

            cluster.freeze();
            let frozen = tokio::time::Instant::now();
            until(&m, 60, "the frozen connection noticed", || m.status(false).notes.iter().any(|n| n.contains("cannot be watched"))).await;
            assert!(frozen.elapsed() <= Duration::from_secs(60), "{:?}", frozen.elapsed());
            let not_ready = kubevol::http::readiness(&m).unwrap_err();
            assert!(not_ready.contains("cannot be watched"), "/readyz says why: {not_ready}");
            let later = typed(&cluster.create(bound_pod("later", &node, json!([{"name": "tmp", "emptyDir": {}}]))).await);

            cluster.restore();
            m.wait_for_attach_and_mount(&later).await.expect("the pod created while the network was frozen");
            until(&m, 60, "the note cleared", || !m.status(false).notes.iter().any(|n| n.contains("cannot be watched"))).await;
            assert_eq!(kubevol::http::readiness(&m), Ok(()));
            assert!(m.mounted_volumes_for_pod(&kubevol::pod_uid(&first)).contains_key("tmp"), "nothing was torn down");
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

cluster_test! {
    /// Claims and PersistentVolumes are read with GET, the only verb the Node authorizer
    /// allows on them: a claim that does not exist is a FailedMount that says so and is read
    /// again until it exists; one the controller has not bound yet waits for its binding (on
    /// the real control plane, its PV binder; in process, the test plays it); meanwhile the
    /// volume is Pending, not failed (the cluster's
    /// controllers make and bind claims); then the hostPath volume is mounted. Nothing was
    /// listed or watched, and nothing refused.
    fn a_claim_is_read_with_get_until_it_exists_and_is_bound(backend) {
        let root = TestRoot::new();
        let data = kept_data(root.path());
        runtime().block_on(async {
            let cluster = TestCluster::start_on(backend, NODE).await;
            let (node, ns) = (cluster.node_name().to_string(), cluster.namespace().to_string());
            let m = cluster_manager(root.path(), &cluster);
            let p = typed(&cluster.create(bound_pod("app", &node, json!([{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]))).await);
            let error = |s: &kubevol::status::PodStatus| s.volumes.first().and_then(|v| v.retry.last_error.clone()).unwrap_or_default();
            let s = wait_for_status(&m, &p, 120, |s| error(s).contains("does not exist in the API server")).await;
            assert!(error(&s).contains(&format!("PersistentVolumeClaim {ns}/data does not exist in the API server: create it")), "{s:#?}");
            // Waiting for the cluster (a claim is made and bound by others), not failed.
            assert_eq!(s.volumes[0].state, kubevol::status::VolumePhase::Pending, "{s:#?}");
            assert_eq!(s.phase, kubevol::status::PodPhase::Pending, "{s:#?}");
            assert!(m.events().iter().any(|e| e.reason == "FailedMount" && e.message.contains(&format!("{ns}/data does not exist"))), "a FailedMount event");

            // The claim first, of a volume that is not there yet (selected by a label of this
            // test's): no binder can bind it.
            let pv = cluster.scoped("data");
            cluster.create(json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "data"},
                "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}, "storageClassName": "",
                         "selector": {"matchLabels": {"kubevol.io/test-volume": pv}}}})).await;
            let s = wait_for_status(&m, &p, 120, |s| error(s).contains("is not bound yet")).await;
            assert!(error(&s).contains("waiting for the PersistentVolume controller to bind it"), "{s:#?}");
            assert_eq!(s.volumes[0].state, kubevol::status::VolumePhase::Pending, "{s:#?}");

            // Then its volume: the PV binder binds them (on the real control plane, its
            // controller; in process, the test plays it).
            cluster.create(json!({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv, "labels": {"kubevol.io/test-volume": pv}},
                "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"], "hostPath": {"path": data, "type": "Directory"},
                         "claimRef": {"namespace": ns, "name": "data"}}})).await;
            cluster.bind_claim("data", &pv).await;
            m.wait_for_attach_and_mount(&p).await.expect("mounted once bound");
            let dir = m.mounted_volumes_for_pod(&kubevol::pod_uid(&p))["data"].path.clone();
            assert_eq!(std::fs::read_to_string(dir.join("kept")).unwrap(), "yes");

            let requests = storage_only_read_with_get(&cluster);
            assert!(requests.contains_key("get persistentvolumeclaims") && requests.contains_key("get persistentvolumes"), "{requests:#?}");
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

cluster_test! {
    /// A generic ephemeral volume uses the claim `<pod>-<volume>` that the ephemeral-volume
    /// controller makes (on the real control plane, its controller; in process, the test plays
    /// it), read with GET as any claim, and only once the pod is its controlling owner: a claim
    /// that someone made with that name before the pod is never mounted ("was not created for
    /// pod"). Until the claim is bound, the volume waits for the cluster.
    fn a_generic_ephemeral_volume_uses_the_claim_made_for_its_pod(backend) {
        let root = TestRoot::new();
        let data = kept_data(root.path());
        runtime().block_on(async {
            let cluster = TestCluster::start_on(backend, NODE).await;
            let (node, ns) = (cluster.node_name().to_string(), cluster.namespace().to_string());
            let claim_spec = json!({"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}});
            // Someone else's claim, with the name the pod's volume `foreign` implies.
            cluster.create(json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "app-foreign"}, "spec": claim_spec})).await;
            let m = cluster_manager(root.path(), &cluster);
            let template = json!({"volumeClaimTemplate": {"metadata": {"labels": {"made-for": "app"}}, "spec": claim_spec}});
            let stored = cluster.create(bound_pod("app", &node, json!([{"name": "scratch", "ephemeral": template}, {"name": "foreign", "ephemeral": template}]))).await;
            let p = typed(&stored);
            let uid = kubevol::pod_uid(&p);
            if !cluster.is_real() {
                // The ephemeral-volume controller's part.
                cluster.create(json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                    "metadata": {"name": "app-scratch", "labels": {"made-for": "app"},
                                 "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "app", "uid": uid.as_str(), "controller": true, "blockOwnerDeletion": true}]},
                    "spec": claim_spec})).await;
            }
            let error = |s: &kubevol::status::PodStatus, name: &str| s.volumes.iter().find(|v| v.name == name).and_then(|v| v.retry.last_error.clone()).unwrap_or_default();
            let s = wait_for_status(&m, &p, 60, |s| error(s, "scratch").contains("is not bound yet") && error(s, "foreign").contains("was not created")).await;
            assert!(error(&s, "foreign").contains(&format!("PVC {ns}/app-foreign was not created for pod {ns}/app (pod is not owner)")), "{s:#?}");
            let scratch = s.volumes.iter().find(|v| v.name == "scratch").unwrap();
            assert_eq!(scratch.state, kubevol::status::VolumePhase::Pending, "waits for the binder: {s:#?}");
            let made = cluster.get("v1", "persistentvolumeclaims", "app-scratch").await.expect("the claim was made");
            assert_eq!(made["metadata"]["ownerReferences"][0]["uid"], json!(uid.as_str()), "{made:#}");

            // The PV binder's part.
            let pv = cluster.scoped("scratch");
            cluster.create(json!({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
                "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"], "hostPath": {"path": data, "type": "Directory"},
                         "claimRef": {"namespace": ns, "name": "app-scratch", "uid": made["metadata"]["uid"]}}})).await;
            cluster.bind_claim("app-scratch", &pv).await;
            wait_for_status(&m, &p, 60, |s| s.volumes.iter().any(|v| v.name == "scratch" && v.state == kubevol::status::VolumePhase::Mounted)).await;
            let dir = m.mounted_volumes_for_pod(&uid)["scratch"].path.clone();
            assert_eq!(std::fs::read_to_string(dir.join("kept")).unwrap(), "yes");
            let s = m.pod_status(&uid).unwrap();
            assert!(error(&s, "foreign").contains("was not created"), "still refused: {s:#?}");

            storage_only_read_with_get(&cluster);
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

cluster_test! {
    /// A node of a cluster refuses static pods (from its manifest directory) that reference
    /// objects of the API server, as the kubelet does since 1.34 (PreventStaticPodAPIReferences):
    /// one mounting a Secret, one with a ConfigMap in its environment; a static pod of emptyDir
    /// and downwardAPI volumes beside them is mounted.
    fn static_pods_that_reference_api_objects_are_refused_as_the_kubelet_refuses_them(backend) {
        let root = TestRoot::new();
        let manifests = root.manifests();
        write_manifest(&manifests, "static.yaml", r#"
apiVersion: v1
kind: Pod
metadata: {name: uses-secret, namespace: kube-system}
spec:
  containers: [{name: c, volumeMounts: [{name: creds, mountPath: /creds}]}]
  volumes: [{name: creds, secret: {secretName: creds}}]
---
apiVersion: v1
kind: Pod
metadata: {name: uses-config-map, namespace: kube-system}
spec:
  containers: [{name: c, envFrom: [{configMapRef: {name: settings}}], volumeMounts: [{name: scratch, mountPath: /s}]}]
  volumes: [{name: scratch, emptyDir: {}}]
---
apiVersion: v1
kind: Pod
metadata: {name: plain, namespace: kube-system}
spec:
  containers: [{name: c, volumeMounts: [{name: scratch, mountPath: /s}, {name: info, mountPath: /info}]}]
  volumes:
  - {name: scratch, emptyDir: {}}
  - {name: info, downwardAPI: {items: [{path: name, fieldRef: {fieldPath: metadata.name}}]}}
"#);
        runtime().block_on(async {
            let cluster = TestCluster::start_on(backend, NODE).await;
            ensure_node(&cluster).await;
            let m = cluster_manager(root.path(), &cluster);
            kubevol::source::ManifestSource::new(&manifests)
                .listen(m.store().sink(kubevol::source::ManifestSource::NAME))
                .await
                .unwrap();
            let static_pod = |name: &str| pod(json!({"metadata": {"name": name, "namespace": "kube-system"}, "spec": {"containers": []}}));
            let plain = static_pod("plain");
            m.wait_for_attach_and_mount(&plain).await.unwrap();
            for (name, what) in [("uses-secret", "secrets"), ("uses-config-map", "configmaps")] {
                let s = wait_for_status(&m, &static_pod(name), 120, |s| s.phase == kubevol::status::PodPhase::Rejected).await;
                let errors = s.errors.join("\n");
                assert!(errors.contains(&format!("static pods may not reference {what}:")), "{name}: {errors}");
            }
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

cluster_test! {
    /// A pod resized through the API server's `resize` subresource (a new memory limit): its
    /// memory-backed emptyDir without a sizeLimit, sized by that limit, is remounted with the
    /// new size, its files kept.
    fn a_pod_resize_resizes_its_memory_backed_empty_dir(backend) {
        let root = TestRoot::new();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(backend, NODE).await;
            let node = cluster.node_name().to_string();
            ensure_node(&cluster).await;
            let mut pod = bound_pod("sized", &node, json!([{"name": "m", "emptyDir": {"medium": "Memory"}}]));
            pod["spec"]["containers"][0]["resources"] = json!({"requests": {"memory": "32Mi", "cpu": "10m"}, "limits": {"memory": "32Mi", "cpu": "10m"}});
            let made = cluster.create(pod).await;
            let m = cluster_manager(root.path(), &cluster);
            let p = typed(&made);
            m.wait_for_attach_and_mount(&p).await.unwrap();
            let path = m.mounted_volumes_for_pod(&kubevol::pod_uid(&p))["m"].path.clone();
            let size = || { let st = rustix::fs::statfs(&path).unwrap(); st.f_blocks * st.f_bsize as u64 };
            assert_eq!(size(), 32 << 20);
            std::fs::write(path.join("kept"), "yes").unwrap();

            // The API server admits a resize only within the node's allocatable resources.
            let nodes: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(cluster.admin_client());
            let resources = json!({"cpu": "4", "memory": "8Gi", "pods": "110"});
            let status = json!({"status": {"capacity": resources, "allocatable": resources}});
            nodes.patch_status(&node, &kube::api::PatchParams::default(), &kube::api::Patch::Merge(&status)).await.expect("the node's resources");
            let pods: kube::Api<k8s_openapi::api::core::v1::Pod> = kube::Api::namespaced(cluster.admin_client(), cluster.namespace());
            let resize = json!({"spec": {"containers": [{"name": "c", "resources": {"requests": {"memory": "48Mi"}, "limits": {"memory": "48Mi"}}}]}});
            pods.patch_subresource("resize", "sized", &kube::api::PatchParams::default(), &kube::api::Patch::Strategic(&resize))
                .await
                .expect("the resize is accepted");
            until(&m, 120, "the tmpfs resized to 48Mi", || size() == 48 << 20).await;
            assert_eq!(std::fs::read_to_string(path.join("kept")).unwrap(), "yes");
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}
