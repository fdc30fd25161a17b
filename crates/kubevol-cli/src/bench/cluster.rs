//! The cluster-mode benchmark: N pods created at once in an API server, each with a
//! Memory emptyDir, a Secret of its own and the `kube-api-access` projected volume (a
//! service account token, a ConfigMap, the namespace). Ready latency is measured from the
//! moment the server answered each pod's creation; the in-process server counts the
//! requests the node made.

use std::collections::BTreeMap;

use super::*;
use kubevol_testserver::TestCluster;
use serde_json::json;

/// Volumes per pod, each its own tmpfs (emptyDir Memory, secret, projected).
const VOLUMES: usize = 3;

fn pod(i: usize, node: &str) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": format!("bench-{i}")},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox", "volumeMounts": [
                {"name": "cache", "mountPath": "/cache"},
                {"name": "creds", "mountPath": "/creds"},
                {"name": "kube-api-access", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}]}],
            "volumes": [
                {"name": "cache", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
                {"name": "creds", "secret": {"secretName": format!("bench-{i}")}},
                {"name": "kube-api-access", "projected": {"defaultMode": 420, "sources": [
                    {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                    {"configMap": {"name": "bench-ca", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                    {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}}]}}]}})
}

/// What one node measured.
struct NodeRun {
    node: String,
    /// Each pod's ready latency, sorted.
    latencies: Vec<f64>,
    all_ready: Duration,
    torn_down: Duration,
    /// The node's requests while its pods came, by verb and resource.
    requests: Option<BTreeMap<String, u64>>,
}

/// One node of `cluster`: its Node, its pods' Secrets and a manager on `root` joined to
/// the cluster; once every node is ready (`go`), its `n` pods are created at once and
/// waited for; once every node's are ready (`done`), they are deleted and torn down.
async fn node_run(
    cluster: Arc<TestCluster>,
    root: std::path::PathBuf,
    n: usize,
    args: &BenchArgs,
    go: &tokio::sync::Barrier,
    done: &tokio::sync::Barrier,
) -> anyhow::Result<NodeRun> {
    let node = cluster.node_name().to_string();
    if !cluster.is_real() {
        cluster.create(json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})).await;
    }
    if cluster.get("v1", "nodes", &node).await.is_none() {
        cluster
            .create(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}}))
            .await;
    }
    cluster.create(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "bench-ca"}, "data": {"ca.crt": "CA"}})).await;
    for i in 0..n {
        cluster.create(json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": format!("bench-{i}")}, "stringData": {"password": format!("secret {i}")}})).await;
    }
    let (manager, running) = start_manager(&root, args, |c| c.node_name = node.clone())?;
    let client = kubevol::source::cluster::client(cluster.node_config())?;
    let tasks = kubevol::source::cluster::join(&manager, client);
    // Started and synced (an empty listing) before the pods come.
    let mut changes = manager.subscribe();
    while !manager.store().all_sources_synced() {
        changes.changed().await?;
    }
    go.wait().await;
    let before = cluster.node_requests();
    let start = tokio::time::Instant::now();
    let mut waits = tokio::task::JoinSet::new();
    let gate = Arc::new(tokio::sync::Semaphore::new(64));
    for i in 0..n {
        let (cluster, manager, gate, node) =
            (cluster.clone(), manager.clone(), gate.clone(), node.clone());
        waits.spawn(async move {
            let permit = gate.acquire_owned().await;
            let made = cluster.create(pod(i, &node)).await;
            let created = tokio::time::Instant::now();
            drop(permit);
            let pod: Pod = serde_json::from_value(made)?;
            manager.wait_for_attach_and_mount(&pod).await?;
            anyhow::Ok((created.elapsed().as_secs_f64(), pod))
        });
    }
    let mut latencies = Vec::new();
    let mut pods = Vec::new();
    while let Some(r) = waits.join_next().await {
        let (l, p) = r??;
        latencies.push(l);
        pods.push(p);
    }
    let all_ready = start.elapsed();
    latencies.sort_by(|a, b| a.total_cmp(b));
    let after = cluster.node_requests();
    done.wait().await;

    let t = tokio::time::Instant::now();
    for p in &pods {
        cluster
            .delete(
                "v1",
                "pods",
                p.metadata.name.as_deref().unwrap_or_default(),
                Some(0),
            )
            .await;
    }
    manager.wait_for_all_pods_unmount(&pods).await?;
    let torn_down = t.elapsed();
    manager.shutdown();
    let _ = running.await;
    // The watches and publishers stop now; the event poster once the manager is gone and
    // what it queued is posted. The server stops after them.
    let mut tasks = tasks;
    let poster = tasks.pop();
    for t in tasks {
        t.abort();
        let _ = t.await;
    }
    drop(manager);
    if let Some(poster) = poster {
        let _ = poster.await;
    }
    let requests = before.zip(after).map(|(b, a)| {
        a.into_iter()
            .map(|(k, v)| {
                let was = b.get(&k).copied().unwrap_or(0);
                (k, v - was)
            })
            .filter(|(_, v)| *v > 0)
            .collect::<BTreeMap<String, u64>>()
    });
    Ok(NodeRun {
        node,
        latencies,
        all_ready,
        torn_down,
        requests,
    })
}

pub(super) fn run(args: &BenchArgs) -> anyhow::Result<ExitCode> {
    let n = args.pods();
    let k = args.nodes.max(1);
    let (tmp, floor_dir) = BenchRoot::new(args)?;
    let (floor_a, _) = raw_floor(&floor_dir, n * VOLUMES).context("raw floor")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let figures = runtime.block_on(async {
        let mut clusters = Vec::new();
        for _ in 0..k {
            clusters.push(Arc::new(TestCluster::start("bench-node").await));
        }
        let real = clusters[0].is_real();
        anyhow::ensure!(
            real || k == 1,
            "--nodes {k} needs one real API server for all its nodes: start one with tools/k8s/control-plane.sh up DIR and set KUBEVOL_TEST_CLUSTER=DIR"
        );
        println!(
            "kubevol bench --cluster: {}{n} pods x (Memory emptyDir, secret, projected service account volume) created at once in {}",
            if k > 1 { format!("{k} nodes x ") } else { String::new() },
            if real { "a real kube-apiserver" } else { "the in-process API server" }
        );
        let go = tokio::sync::Barrier::new(k + 1);
        let done = tokio::sync::Barrier::new(k + 1);
        let runs: Vec<_> = clusters.iter().enumerate().map(|(i, c)| {
            node_run(c.clone(), tmp.path().join(format!("root-{i}")), n, args, &go, &done)
        }).collect();
        let measure = async {
            go.wait().await;
            let cpu_start = cpu_seconds();
            let server_start = clusters[0].server_cpu_seconds();
            done.wait().await;
            let cpu = cpu_seconds() - cpu_start;
            let server_cpu = server_start.zip(clusters[0].server_cpu_seconds()).map(|(a, b)| b - a);
            (cpu, server_cpu)
        };
        let (runs, (cpu, server_cpu)) =
            tokio::join!(futures_util::future::join_all(runs), measure);
        // What the test made goes, once nothing else holds the cluster.
        for cluster in clusters {
            if let Ok(cluster) = Arc::try_unwrap(cluster) {
                cluster.clean_up().await;
            }
        }
        let runs = runs.into_iter().collect::<anyhow::Result<Vec<NodeRun>>>()?;
        anyhow::Ok((runs, cpu, real, server_cpu))
    });
    let (runs, cpu, real, server_cpu) = figures?;
    if k > 1 {
        let ms = |d: f64| d * 1e3;
        println!();
        println!(
            "node                       ready p50    p99      all ready   API requests per pod"
        );
        for r in &runs {
            let total: u64 = r.requests.iter().flat_map(|m| m.values()).sum();
            println!(
                "{:<26} {:>7.1} ms {:>7.1} ms {:>9.1} ms   {:.2}",
                r.node,
                ms(percentile(&r.latencies, 0.5)),
                ms(percentile(&r.latencies, 0.99)),
                ms(r.all_ready.as_secs_f64()),
                total as f64 / n as f64
            );
        }
        println!("CPU seconds (the {k} nodes): {cpu:.2}");
        if let Some(server) = server_cpu {
            println!("CPU seconds of the real kube-apiserver and etcd meanwhile: {server:.2}");
        }
        println!("peak RSS: {:.1} MiB", peak_rss_mib());
        tmp.release()?;
        return Ok(ExitCode::SUCCESS);
    }
    let NodeRun {
        latencies: lat,
        all_ready,
        torn_down,
        requests,
        ..
    } = runs.into_iter().next().context("one node")?;
    let (floor_b, _) = raw_floor(&floor_dir, n * VOLUMES).context("raw floor")?;
    let floor = (floor_a + floor_b) / 2;
    let ms = |d: f64| d * 1e3;
    println!();
    println!("pod volume-ready latency, from the server's answer to the pod's creation:");
    println!(
        "  p50 {:.1} ms   p99 {:.1} ms   max {:.1} ms",
        ms(percentile(&lat, 0.5)),
        ms(percentile(&lat, 0.99)),
        ms(lat.last().copied().unwrap_or(0.0))
    );
    println!(
        "all {n} pods ready {:.1} ms after the first creation; the raw floor of their {} tmpfs mounts (mkdir+mount+chmod): {:.1} ms, ratio {:.2}",
        ms(all_ready.as_secs_f64()),
        n * VOLUMES,
        ms(floor.as_secs_f64()),
        floor.as_secs_f64() / all_ready.as_secs_f64()
    );
    println!(
        "all torn down {:.1} ms after the deletions began",
        ms(torn_down.as_secs_f64())
    );
    println!(
        "CPU seconds ({}): {cpu:.2}",
        if real {
            "kubevol alone"
        } else {
            "kubevol and the in-process server together"
        }
    );
    if let Some(server) = server_cpu {
        println!("CPU seconds of the real kube-apiserver and etcd meanwhile: {server:.2}");
    }
    match requests {
        Some(r) => {
            let total: u64 = r.values().sum();
            println!(
                "API requests by the node while the pods came: {total} ({:.2} per pod)",
                total as f64 / n as f64
            );
            for (what, count) in &r {
                println!(
                    "  {what:<36} {count:6}  ({:.2} per pod)",
                    *count as f64 / n as f64
                );
            }
        }
        None => println!("API requests: counted by the in-process server and the project's control plane (its audit log) only"),
    }
    println!("peak RSS: {:.1} MiB", peak_rss_mib());
    tmp.release()?;
    Ok(ExitCode::SUCCESS)
}
