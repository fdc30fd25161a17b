//! The example node agent (`examples/node-agent.rs`), run for real against the test API
//! server: pods bound to the node get their volumes, the agent records the outcome on the pod,
//! and a pod being deleted is torn down and then deleted for good.

#[macro_use]
mod common;

#[path = "../../../examples/node-agent.rs"]
mod agent;

use std::time::Duration;

use common::*;
use kubevol_testserver::TestServer;
use serde_json::{json, Value};

const NODE: &str = "test-node";

/// The agent's condition on a pod, if set.
fn condition(server: &TestServer, pod: &str) -> Option<Value> {
    let p = server.get("v1", "pods", "default", pod)?;
    p["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == json!(agent::CONDITION))
        .cloned()
}

/// Polls `cond` (the server is not watched here) until it holds, for at most `secs`.
async fn eventually(what: &str, secs: u64, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within {secs}s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

mount_test! {
    fn the_example_node_agent_gates_pods_on_their_volumes() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let server = TestServer::start().await.unwrap();
            server.create(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})).unwrap();
            let pod = |name: &str, volumes: Value| {
                json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
                       "spec": {"nodeName": NODE, "containers": [{"name": "c", "volumeMounts": [{"name": "v", "mountPath": "/v"}]}], "volumes": volumes}})
            };
            server.create(pod("ready", json!([{"name": "v", "emptyDir": {}}]))).unwrap();
            server.create(pod("blocked", json!([{"name": "v", "configMap": {"name": "later"}}]))).unwrap();
            let client = server.client(&TestServer::node_token(NODE)).await;
            let mut config = kubevol::Config::new(root.path().join("root"), NODE);
            config.backoff.initial = Duration::from_millis(20);
            config.backoff.max = Duration::from_millis(200);
            config.wait_timeout = Duration::from_secs(2);
            let running = tokio::spawn(agent::run(client, config));

            eventually("the ready pod's condition", 30, || condition(&server, "ready").is_some_and(|c| c["status"] == json!("True"))).await;
            assert_eq!(condition(&server, "ready").unwrap()["reason"], json!("VolumesMounted"));
            eventually("the blocked pod's condition", 30, || condition(&server, "blocked").is_some_and(|c| c["status"] == json!("False"))).await;
            let c = condition(&server, "blocked").unwrap();
            assert_eq!(c["reason"], json!("VolumesNotReady"));
            assert!(c["message"].as_str().unwrap().contains("later"), "{c}");

            // The missing ConfigMap appears: the agent's next wait succeeds.
            server.create(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "later", "namespace": "default"}, "data": {"k": "v"}})).unwrap();
            eventually("the blocked pod ready", 30, || condition(&server, "blocked").is_some_and(|c| c["status"] == json!("True"))).await;

            // Deleted: torn down, then deleted for good by the agent.
            let uid = server.get("v1", "pods", "default", "ready").unwrap()["metadata"]["uid"].as_str().unwrap().to_string();
            server.delete("v1", "pods", "default", "ready", None).unwrap();
            eventually("the pod deleted for good", 30, || server.get("v1", "pods", "default", "ready").is_none()).await;
            let dir = root.path().join("root/pods").join(&uid);
            assert!(!dir.join("volumes").exists() || mounts_under(&dir).is_empty(), "torn down before it was deleted");
            running.abort();
        });
    }
}
