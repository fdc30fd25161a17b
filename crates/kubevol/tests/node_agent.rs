//! The example node agent (`examples/node-agent.rs`), run for real against the test API
//! server: pods bound to the node get their volumes, the agent records the outcome on the pod,
//! and a pod being deleted is torn down and then deleted for good.

#[macro_use]
mod common;

#[path = "../../../examples/node-agent.rs"]
mod agent;

use std::time::Duration;

use common::*;
use kubevol_testserver::cluster::eventually;
use kubevol_testserver::TestCluster;
use serde_json::{json, Value};

/// The node's name against the in-process server (a real cluster's is its node kubeconfig's).
const NODE: &str = "test-node";

/// The agent's condition on a pod, if set.
async fn condition(cluster: &TestCluster, pod: &str) -> Option<Value> {
    let p = cluster.get("v1", "pods", pod).await?;
    p["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == json!(agent::CONDITION))
        .cloned()
}

cluster_test! {
    fn the_example_node_agent_gates_pods_on_their_volumes(backend) {
        let root = TestRoot::new();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(backend, NODE).await;
            let node = cluster.node_name().to_string();
            ensure_node(&cluster).await;
            let pod = |name: &str, volumes: Value| {
                json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                       "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox", "volumeMounts": [{"name": "v", "mountPath": "/v"}]}], "volumes": volumes}})
            };
            cluster.create(pod("ready", json!([{"name": "v", "emptyDir": {}}]))).await;
            cluster.create(pod("blocked", json!([{"name": "v", "configMap": {"name": "later"}}]))).await;
            let mut config = kubevol::Config::new(root.path().join("root"), node.as_str());
            config.backoff.initial = Duration::from_millis(20);
            config.backoff.max = Duration::from_millis(200);
            config.wait_timeout = Duration::from_secs(2);
            let running = tokio::spawn(agent::run(node_client(&cluster), config));

            let status_is = |pod: &'static str, want: &'static str| {
                let cluster = &cluster;
                move || async move { condition(cluster, pod).await.is_some_and(|c| c["status"] == json!(want)) }
            };
            eventually("the ready pod's condition", 30, status_is("ready", "True")).await;
            assert_eq!(condition(&cluster, "ready").await.unwrap()["reason"], json!("VolumesMounted"));
            eventually("the blocked pod's condition", 30, status_is("blocked", "False")).await;
            let c = condition(&cluster, "blocked").await.unwrap();
            assert_eq!(c["reason"], json!("VolumesNotReady"));
            assert!(c["message"].as_str().unwrap().contains("later"), "{c}");

            // The missing ConfigMap appears: the agent's next wait succeeds.
            cluster.create(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "later"}, "data": {"k": "v"}})).await;
            eventually("the blocked pod ready", 30, status_is("blocked", "True")).await;

            // Deleted: torn down, then deleted for good by the agent.
            let uid = cluster.get("v1", "pods", "ready").await.unwrap()["metadata"]["uid"].as_str().unwrap().to_string();
            cluster.delete("v1", "pods", "ready", None).await;
            eventually("the pod deleted for good", 30, || async { cluster.get("v1", "pods", "ready").await.is_none() }).await;
            let dir = root.path().join("root/pods").join(&uid);
            assert!(!dir.join("volumes").exists() || mounts_under(&dir).is_empty(), "torn down before it was deleted");
            running.abort();
            cluster.clean_up().await;
        });
    }
}
