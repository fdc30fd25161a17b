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

/// The name of the threads of the benchmark's own runtime, which makes and deletes the pods
/// and reads from the server (run [`run`] and [`super::nodes`] on it): their CPU is not
/// kubevol's.
pub(super) const BENCH_THREADS: &str = "bench-client";

/// The benchmark's runtime: its threads named [`BENCH_THREADS`].
pub(super) fn bench_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .thread_name(BENCH_THREADS)
        .enable_all()
        .build()
}

/// CPU seconds of kubevol so far: the process's, less the benchmark's own threads (the main
/// thread, which drives the run, and those of [`bench_runtime`]), to the nanosecond. A
/// benchmark thread that ended is counted as kubevol's: the figure errs high, never low.
pub(super) fn kubevol_cpu_seconds() -> f64 {
    let main = std::process::id().to_string();
    let bench: f64 = std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|t| {
            t.file_name() == main.as_str()
                || std::fs::read_to_string(t.path().join("comm"))
                    .is_ok_and(|c| c.trim_end() == BENCH_THREADS)
        })
        .filter_map(|t| {
            // The first figure is the time the thread ran, in nanoseconds.
            let stat = std::fs::read_to_string(t.path().join("schedstat")).ok()?;
            stat.split_whitespace().next()?.parse::<f64>().ok()
        })
        .sum::<f64>()
        * 1e-9;
    cpu_seconds() - bench
}

/// A node of the benchmark, joined to the cluster and synced: its Node, its pods' Secrets and
/// the ConfigMap they share exist, and its manager on `root` has listed (no pods yet). The
/// manager and its watches run on a runtime of their own, so that kubevol's CPU is told apart
/// from the benchmark's ([`kubevol_cpu_seconds`]).
pub(super) struct BenchNode {
    pub(super) cluster: Arc<TestCluster>,
    manager: VolumeManager,
    running: tokio::task::JoinHandle<()>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    kubevol: tokio::runtime::Runtime,
    n: usize,
}

/// What a node measured while its pods came.
pub(super) struct Arrival {
    /// Each pod's ready latency in seconds, sorted.
    pub(super) latencies: Vec<f64>,
    pub(super) all_ready: Duration,
    pub(super) pods: Vec<Pod>,
}

impl BenchNode {
    /// Node `cluster.node_name()` with `n` pods to come, its manager on `root`.
    pub(super) async fn start(
        cluster: Arc<TestCluster>,
        root: &Path,
        n: usize,
        args: &BenchArgs,
    ) -> anyhow::Result<BenchNode> {
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
        let kubevol = tokio::runtime::Builder::new_multi_thread()
            .thread_name("kubevol-rt")
            .enable_all()
            .build()?;
        let (manager, running, tasks) = {
            let _on = kubevol.enter();
            let (manager, running) = start_manager(root, args, |c| c.node_name = node.clone())?;
            let client = kubevol::source::cluster::client(cluster.node_config())?;
            let tasks = kubevol::source::cluster::join(&manager, client);
            (manager, running, tasks)
        };
        // Started and synced (an empty listing) before the pods come.
        let mut changes = manager.subscribe();
        while !manager.store().all_sources_synced() {
            changes.changed().await?;
        }
        Ok(BenchNode {
            cluster,
            manager,
            running,
            tasks,
            kubevol,
            n,
        })
    }

    /// Creates the node's pods at once (64 creations in flight) and waits for each to be
    /// ready, its latency counted from the server's answer to its creation.
    pub(super) async fn come(&self) -> anyhow::Result<Arrival> {
        let start = tokio::time::Instant::now();
        let mut waits = tokio::task::JoinSet::new();
        let gate = Arc::new(tokio::sync::Semaphore::new(64));
        let node = self.cluster.node_name().to_string();
        for i in 0..self.n {
            let (cluster, manager, gate, node) = (
                self.cluster.clone(),
                self.manager.clone(),
                gate.clone(),
                node.clone(),
            );
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
        Ok(Arrival {
            latencies,
            all_ready,
            pods,
        })
    }

    /// Deletes the pods, waits until they are torn down, stops the manager and its watches and
    /// cleans up what the run made in the cluster (the caller must hold no other reference to
    /// it). Returns how long the tear-down took.
    pub(super) async fn leave(self, pods: Vec<Pod>) -> anyhow::Result<Duration> {
        let t = tokio::time::Instant::now();
        // Deleted at once, 64 requests in flight as the pods were made: one after another,
        // the round trips to the server were the tear-down's time, not kubevol's.
        let mut deletions = tokio::task::JoinSet::new();
        let gate = Arc::new(tokio::sync::Semaphore::new(64));
        for p in &pods {
            let name = p.metadata.name.clone().unwrap_or_default();
            let (cluster, gate) = (self.cluster.clone(), gate.clone());
            deletions.spawn(async move {
                let _permit = gate.acquire_owned().await;
                cluster.delete("v1", "pods", &name, Some(0)).await;
            });
        }
        while let Some(deleted) = deletions.join_next().await {
            deleted?;
        }
        self.manager.wait_for_all_pods_unmount(&pods).await?;
        let torn_down = t.elapsed();
        self.manager.shutdown();
        let _ = self.running.await;
        // The watches and publishers stop now; the event poster once the manager is gone and
        // what it queued is posted. The server stops after them.
        let mut tasks = self.tasks;
        let poster = tasks.pop();
        for t in tasks {
            t.abort();
            let _ = t.await;
        }
        drop(self.manager);
        if let Some(poster) = poster {
            let _ = poster.await;
        }
        self.kubevol.shutdown_background();
        // What the run made goes; everything that shared the cluster has stopped.
        let cluster = Arc::try_unwrap(self.cluster).map_err(|c| {
            anyhow::anyhow!(
                "node {}: the cluster is still shared after the tear-down; what the run made is left",
                c.node_name()
            )
        })?;
        cluster.clean_up().await;
        Ok(torn_down)
    }
}

/// The requests counted in `after` and not in `before`.
fn difference(
    before: BTreeMap<String, u64>,
    after: BTreeMap<String, u64>,
) -> BTreeMap<String, u64> {
    after
        .into_iter()
        .filter_map(|(what, n)| {
            let more = n - before.get(&what).copied().unwrap_or(0);
            (more > 0).then_some((what, more))
        })
        .collect()
}

pub(super) fn run(args: &BenchArgs) -> anyhow::Result<ExitCode> {
    if args.node_process {
        return super::nodes::child(args);
    }
    if args.nodes > 1 {
        return super::nodes::run(args);
    }
    let n = args.pods();
    let (tmp, floor_dir) = BenchRoot::new(args)?;
    let (floor_a, _) = raw_floor(&floor_dir, n * VOLUMES).context("raw floor")?;
    let runtime = bench_runtime()?;
    let figures = runtime.block_on(async {
        let cluster = Arc::new(TestCluster::start("bench-node").await);
        let real = cluster.is_real();
        println!(
            "kubevol bench --cluster: {n} pods x (Memory emptyDir, secret, projected service account volume) created at once in {}",
            if real { "a real kube-apiserver" } else { "the in-process API server" }
        );
        let node = BenchNode::start(cluster.clone(), &tmp.path().join("root"), n, args).await?;
        let before = cluster.node_requests();
        // The in-process server runs on the benchmark's runtime: its CPU is counted with
        // kubevol's there, as the figure's name says.
        let kubevol_cpu = || if real { kubevol_cpu_seconds() } else { cpu_seconds() };
        let (cpu_start, all_start) = (kubevol_cpu(), cpu_seconds());
        let server_start = cluster.server_cpu_seconds();
        let arrival = node.come().await?;
        let cpu = kubevol_cpu() - cpu_start;
        let bench_cpu = cpu_seconds() - all_start - cpu;
        let server_cpu = server_start
            .zip(cluster.server_cpu_seconds())
            .map(|(a, b)| b - a);
        let requests = before
            .zip(cluster.node_requests())
            .map(|(b, a)| difference(b, a));
        drop(cluster);
        let Arrival {
            latencies,
            all_ready,
            pods,
        } = arrival;
        let torn_down = node.leave(pods).await?;
        let cpu = (cpu, bench_cpu);
        anyhow::Ok((latencies, all_ready, torn_down, cpu, real, server_cpu, requests))
    });
    let (lat, all_ready, torn_down, (cpu, bench_cpu), real, server_cpu, requests) = figures?;
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
    if real {
        println!("CPU seconds (kubevol alone): {cpu:.2} (the benchmark's own, making the pods and waiting: {bench_cpu:.2})");
    } else {
        println!("CPU seconds (kubevol and the in-process server together): {cpu:.2}");
    }
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
