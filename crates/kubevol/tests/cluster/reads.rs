//! How the node reads what its pods reference: one streaming list per ConfigMap or Secret
//! (or a list and a watch where the server has no WatchList), an immutable one read once and
//! never watched, and the moments after a pod's creation when the server's authorizer or
//! admission does not know it yet, which are waited for in the pods' order.

use std::time::Duration;

use crate::common::*;
use crate::{bound_pod, cluster_manager, storage_only_read_with_get, typed, until, NODE};
use kubevol_testserver::TestCluster;
use serde_json::{json, Value};

/// `pods` pods, pod `i` with the volumes `volumes(i)`, made at once (while a server told to
/// lag has not learnt them) for a manager of the cluster's node that gets tokens from it: each
/// is mounted once the server knows it, with no FailedMount meanwhile (the lag is waited
/// for, not failed). Returns the node's requests.
async fn made_in_the_lag(
    cluster: &TestCluster,
    root: &std::path::Path,
    pods: u64,
    volumes: impl Fn(u64) -> Value,
) -> std::collections::BTreeMap<String, u64> {
    let node = cluster.node_name().to_string();
    let m = cluster_manager(root, cluster);
    m.set_token_issuer(std::sync::Arc::new(
        kubevol::source::cluster::ClusterTokens::new(node_client(cluster)),
    ));
    let mut made = Vec::new();
    for i in 0..pods {
        let pod = bound_pod(&format!("p{i}"), &node, volumes(i));
        made.push(typed(&cluster.create(pod).await));
    }
    for p in &made {
        m.wait_for_attach_and_mount(p)
            .await
            .expect("mounted once the server knows the pod");
        let status = m.pod_status(&kubevol::pod_uid(p)).expect("a status");
        let failed: Vec<_> = status
            .events
            .iter()
            .filter(|e| e.reason == "FailedMount")
            .collect();
        assert!(
            failed.is_empty(),
            "the lag is waited for, not failed: {failed:#?}"
        );
    }
    m.shutdown();
    storage_only_read_with_get(cluster)
}

cluster_test_with_faults! {
    /// An immutable Secret is read once and never watched (as the kubelet stops watching one):
    /// the node reads it with one streaming list (a watch it closes once the listing has ended)
    /// and no other request, while the pod's mutable ConfigMap is watched and its update
    /// reaches the volume.
    fn an_immutable_secret_is_read_once_and_never_watched(backend) {
        let root = TestRoot::new();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(backend, NODE).await;
            let node = cluster.node_name().to_string();
            cluster.create(json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "frozen"}, "immutable": true, "stringData": {"key": "v1"}})).await;
            cluster.create(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "live"}, "data": {"level": "info"}})).await;
            let m = cluster_manager(root.path(), &cluster);
            let pod = typed(&cluster.create(bound_pod("app", &node, json!([{"name": "s", "secret": {"secretName": "frozen"}}, {"name": "c", "configMap": {"name": "live"}}]))).await);
            m.wait_for_attach_and_mount(&pod).await.expect("mounted");
            let volumes = m.mounted_volumes_for_pod(&kubevol::pod_uid(&pod));
            assert_eq!(std::fs::read_to_string(volumes["s"].path.join("key")).unwrap(), "v1");
            cluster.apply(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "live"}, "data": {"level": "debug"}})).await;
            let cfg = volumes["c"].path.clone();
            until(&m, 120, "the ConfigMap update", || std::fs::read_to_string(cfg.join("level")).is_ok_and(|t| t == "debug")).await;
            let requests = storage_only_read_with_get(&cluster);
            assert!(!requests.contains_key("list secrets"), "read with a streaming list: {requests:#?}");
            // One, or a few more when the Node authorizer had not related the pod's Secret to
            // the node yet (on a real server, for a moment after the pod's creation).
            let reads = requests.get("watch secrets").copied().unwrap_or(0);
            assert!(reads >= 1, "{requests:#?}");
            if let Some(server) = cluster.server() {
                assert_eq!(reads, 1, "read once: {requests:#?}");
                kubevol_testserver::cluster::eventually("the immutable Secret's watch closed once read", 120, || {
                    let open = server.open_watches("secrets");
                    async move { open == 0 }
                })
                .await;
            }
            // The real server's own record: one watch of the Secret it answered (the others
            // refused in the authorizer's lag), ended once the listing was read, and never a
            // watch again.
            if cluster.audited().is_some() {
                let answered = || -> Vec<kubevol_testserver::cluster::audit::NodeRequest> {
                    cluster.audited().unwrap().into_iter()
                        .filter(|r| r.verb == "watch" && r.resource == "secrets" && r.selected.as_deref() == Some("frozen") && r.code == 200)
                        .collect()
                };
                assert_eq!(answered().len(), 1, "one watch of the immutable Secret answered: {:#?}", answered());
                kubevol_testserver::cluster::eventually("the immutable Secret's one watch ended, by the server's audit log", 120, || {
                    let ended = answered().iter().all(|r| r.ended);
                    async move { ended }
                })
                .await;
                assert_eq!(answered().len(), 1, "never watched again: {:#?}", answered());
            }
            assert!(requests.get("watch configmaps").is_some_and(|n| *n >= 1), "the mutable ConfigMap is watched: {requests:#?}");
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

cluster_test_with_faults! {
    /// Twenty pods, each with a Secret of its own, made at once while the authorizer has not
    /// learnt them (two seconds on the in-process server; the real one's own moment): one read
    /// at a time asks for the pods it may not know, and the others wait for its answer, so a
    /// few reads are refused in all, not one or more per Secret.
    fn reads_refused_in_the_authorizers_lag_wait_for_the_oldest_one(backend) {
        const PODS: u64 = 20;
        let root = TestRoot::new();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(backend, NODE).await;
            if let Some(server) = cluster.server() {
                server.set_relation_delay(Duration::from_secs(2));
            }
            for i in 0..PODS {
                cluster.create(json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": format!("s{i}")}, "stringData": {"k": format!("v{i}")}})).await;
            }
            let requests = made_in_the_lag(&cluster, root.path(), PODS, |i| {
                json!([{"name": "s", "secret": {"secretName": format!("s{i}")}}])
            })
            .await;
            // Each Secret is read with one streaming list (a watch) once allowed.
            let reads = requests.get("watch secrets").copied().unwrap_or(0);
            // One read at a time asks for the pods the authorizer may not know: the newest,
            // refused, a binary search below it (about five refused reads), the refused one
            // again on its backoff (0.25, 0.5, 1 s) until the two seconds pass, then all at
            // once: 24–25 reads on the in-process server (39–40 when only a refusal held the
            // others).
            assert!((PODS..=PODS + 12).contains(&reads), "{reads} reads of {PODS} Secrets: {requests:#?}");
            cluster.clean_up().await;
        });
    }
}

cluster_test_with_faults! {
    /// A Secret is read with one streaming list (a watch whose first events are the listing,
    /// the WatchList feature), not a list and then a watch, and its update reaches the volume
    /// through that same watch. A server without WatchList (turned off, which only the
    /// in-process server can be on demand) refuses the streaming list as invalid: kubevol then
    /// lists and watches, and the Secret and its update reach the volume all the same.
    fn a_secret_is_read_with_one_streaming_list_or_a_list_and_a_watch_without_it(backend) {
        let root = TestRoot::new();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(backend, NODE).await;
            let node = cluster.node_name().to_string();
            if let Some(server) = cluster.server() {
                server.disable_watch_list();
            }
            let streams = cluster.is_real();
            cluster.create(json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}, "stringData": {"k": "v1"}})).await;
            let m = cluster_manager(root.path(), &cluster);
            let pod = typed(&cluster.create(bound_pod("app", &node, json!([{"name": "s", "secret": {"secretName": "s"}}]))).await);
            m.wait_for_attach_and_mount(&pod).await.expect("mounted");
            let dir = m.mounted_volumes_for_pod(&kubevol::pod_uid(&pod))["s"].path.clone();
            assert_eq!(std::fs::read_to_string(dir.join("k")).unwrap(), "v1");
            cluster.apply(json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}, "stringData": {"k": "v2"}})).await;
            until(&m, 120, "the Secret's update", || std::fs::read_to_string(dir.join("k")).is_ok_and(|t| t == "v2")).await;
            let requests = storage_only_read_with_get(&cluster);
            let lists = requests.get("list secrets").copied().unwrap_or(0);
            let watches = requests.get("watch secrets").copied().unwrap_or(0);
            if streams {
                assert_eq!(lists, 0, "no list beside the streaming one: {requests:#?}");
                assert!(watches >= 1, "{requests:#?}");
            } else {
                // (The first streaming list refused, of the Node's, turns them off for all.)
                assert!(lists >= 1 && watches >= 1, "listed, then watched: {requests:#?}");
            }
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}

cluster_test_with_faults! {
    /// Ten pods with a service account token made at once while the server's admission has not
    /// learnt them (its informer of pods lags, two seconds on the in-process server, the real
    /// one's own moment): its `404 pod not found` is waited for as the authorizer's lag is —
    /// the oldest pod's TokenRequest is asked again on a short backoff and the newer ones wait
    /// for it — so no volume fails or says FailedMount, and each pod's token is asked for about
    /// twice at most, not once per backoff step of a failed set-up.
    fn token_requests_refused_in_the_admissions_lag_are_waited_for(backend) {
        const PODS: u64 = 10;
        let root = TestRoot::new();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(backend, NODE).await;
            if let Some(server) = cluster.server() {
                server.set_relation_delay(Duration::from_secs(2));
                cluster.create(json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})).await;
            }
            let token = json!([{"name": "token", "projected": {"sources": [
                {"serviceAccountToken": {"expirationSeconds": 3600, "path": "token"}}]}}]);
            let requests = made_in_the_lag(&cluster, root.path(), PODS, |_| token.clone()).await;
            let asked = requests.get("create serviceaccounts/token").copied().unwrap_or(0);
            assert!((PODS..=2 * PODS + 5).contains(&asked), "{asked} TokenRequests for {PODS} pods: {requests:#?}");
            cluster.clean_up().await;
        });
    }
}

cluster_test_with_faults! {
    /// A streaming list comes from the server's watch cache, which may not have caught up with
    /// an object made just before (only the in-process server can be made to lag on demand):
    /// an object missing from its first events is read with GET before it is called absent,
    /// so the volume is set up with it rather than failing "not found".
    fn an_object_missing_from_a_streaming_lists_first_events_is_read_with_get(backend) {
        let root = TestRoot::new();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(backend, NODE).await;
            let node = cluster.node_name().to_string();
            if let Some(server) = cluster.server() {
                server.lag_watch_cache();
            }
            cluster.create(json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "fresh"}, "stringData": {"k": "v1"}})).await;
            let m = cluster_manager(root.path(), &cluster);
            let pod = typed(&cluster.create(bound_pod("app", &node, json!([{"name": "s", "secret": {"secretName": "fresh"}}]))).await);
            m.wait_for_attach_and_mount(&pod).await.expect("mounted with the Secret the cache did not have");
            let dir = m.mounted_volumes_for_pod(&kubevol::pod_uid(&pod))["s"].path.clone();
            assert_eq!(std::fs::read_to_string(dir.join("k")).unwrap(), "v1");
            let status = m.pod_status(&kubevol::pod_uid(&pod)).expect("a status");
            let failed: Vec<_> = status.events.iter().filter(|e| e.reason == "FailedMount").collect();
            assert!(failed.is_empty(), "never said not found: {failed:#?}");
            if cluster.server().is_some() {
                let requests = storage_only_read_with_get(&cluster);
                assert!(requests.get("get secrets").is_some_and(|n| *n >= 1), "{requests:#?}");
            }
            m.shutdown();
            cluster.clean_up().await;
        });
    }
}
