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
            eventually("the ready pod's condition", 120, status_is("ready", "True")).await;
            assert_eq!(condition(&cluster, "ready").await.unwrap()["reason"], json!("VolumesMounted"));
            eventually("the blocked pod's condition", 120, status_is("blocked", "False")).await;
            let c = condition(&cluster, "blocked").await.unwrap();
            assert_eq!(c["reason"], json!("VolumesNotReady"));
            assert!(c["message"].as_str().unwrap().contains("later"), "{c}");

            // The missing ConfigMap appears: the agent's next wait succeeds.
            cluster.create(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "later"}, "data": {"k": "v"}})).await;
            eventually("the blocked pod ready", 120, status_is("blocked", "True")).await;

            // Deleted: torn down, then deleted for good by the agent.
            let uid = cluster.get("v1", "pods", "ready").await.unwrap()["metadata"]["uid"].as_str().unwrap().to_string();
            cluster.delete("v1", "pods", "ready", None).await;
            eventually("the pod deleted for good", 120, || async { cluster.get("v1", "pods", "ready").await.is_none() }).await;
            let dir = root.path().join("root/pods").join(&uid);
            assert!(!dir.join("volumes").exists() || mounts_under(&dir).is_empty(), "torn down before it was deleted");
            running.abort();
            cluster.clean_up().await;
        });
    }
}

/// The pod's phase, if set.
async fn phase(cluster: &TestCluster, pod: &str) -> Option<(String, String)> {
    let p = cluster.get("v1", "pods", pod).await?;
    let phase = p["status"]["phase"].as_str()?.to_string();
    Some((
        phase,
        p["status"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
    ))
}

cluster_test! {
    /// With `--run-containers`, the agent runs a batch pod's containers with crun once its
    /// volumes are ready: the container, as uid 1000 with fsGroup 2000, reads its Secret and
    /// writes what it read to a hostPath, and the pod ends `Succeeded`; a pod whose container
    /// exits with 3 ends `Failed`, saying which container.
    fn the_example_node_agent_runs_a_batch_pods_containers(backend) {
        let root = TestRoot::new();
        let rt = common::runtime::Runtime::new(&root.path().join("runtime"));
        let out = root.path().join("out");
        std::fs::create_dir(&out).unwrap();
        std::fs::set_permissions(&out, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
        runtime().block_on(async {
            let cluster = TestCluster::start_on(backend, NODE).await;
            let node = cluster.node_name().to_string();
            ensure_node(&cluster).await;
            cluster.create(json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "creds"}, "stringData": {"token": "t0k3n"}})).await;
            let pod = |name: &str, script: &str| {
                json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                       "spec": {"nodeName": node, "restartPolicy": "Never",
                                "securityContext": {"runAsUser": 1000, "fsGroup": 2000},
                                "containers": [{"name": "c", "image": "busybox", "command": ["sh", "-c", script],
                                                "volumeMounts": [{"name": "creds", "mountPath": "/creds"}, {"name": "out", "mountPath": "/out"}]}],
                                "volumes": [{"name": "creds", "secret": {"secretName": "creds"}},
                                            {"name": "out", "hostPath": {"path": out.to_str().unwrap(), "type": "Directory"}}]}})
            };
            cluster.create(pod("batch", "cat /creds/token > /out/token && id -G > /out/groups")).await;
            cluster.create(pod("fails", "exit 3")).await;
            let mut config = kubevol::Config::new(root.path().join("root"), node.as_str());
            config.backoff.initial = Duration::from_millis(20);
            config.backoff.max = Duration::from_millis(200);
            let runner = std::sync::Arc::new(agent::ContainerRunner {
                runtime: "crun".into(),
                rootfs: rt.rootfs.clone(),
                state: root.path().join("containers"),
            });
            let running = tokio::spawn(agent::run_with(node_client(&cluster), config, Some(runner)));
            let ended = |pod: &'static str| {
                let cluster = &cluster;
                move || async move { phase(cluster, pod).await.is_some_and(|(p, _)| p == "Succeeded" || p == "Failed") }
            };
            eventually("the batch pod's end", 60, ended("batch")).await;
            let (p, message) = phase(&cluster, "batch").await.unwrap();
            assert_eq!(p, "Succeeded", "{message}");
            assert_eq!(std::fs::read_to_string(out.join("token")).unwrap(), "t0k3n");
            let groups = std::fs::read_to_string(out.join("groups")).unwrap();
            assert!(groups.split_whitespace().any(|g| g == "2000"), "{groups}");
            eventually("the failing pod's end", 60, ended("fails")).await;
            let (p, message) = phase(&cluster, "fails").await.unwrap();
            assert_eq!(p, "Failed");
            assert!(message.starts_with("container c failed"), "{message}");
            running.abort();
            cluster.clean_up().await;
        });
    }
}
