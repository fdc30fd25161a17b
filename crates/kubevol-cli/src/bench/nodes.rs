//! `bench --cluster --nodes K`: K nodes against one real API server (the project's control
//! plane, `KUBEVOL_TEST_CLUSTER`), each its own process: `kubevol bench --cluster
//! --node-process`, which enters a mount namespace of its own as every benchmark does, gets a
//! node identity of its own (a client certificate of the control plane) and a namespace, and
//! runs one manager. The parent starts them all, lets their pods come at once when every node
//! has synced, and reads each node's requests from the server's audit log.
//!
//! A node process and its parent speak in lines: the node prints `ready NODE` once synced,
//! waits for `go`, creates its pods, prints `arrived` and its figures (JSON) once all are
//! ready, waits for `done`, tears down, cleans up and prints `left SECONDS`.

use std::collections::BTreeMap;
use std::process::Stdio;

use kubevol_testserver::cluster::{audit, CONTROL_PLANE_ENV};
use kubevol_testserver::TestCluster;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout};

use super::cluster::{Arrival, BenchNode};
use super::*;

/// How long the parent waits for a node's next line: a node's start includes minting its
/// certificate and waiting for its namespace's service account, K of them at once.
const PATIENCE: Duration = Duration::from_secs(900);

/// What a node reports once its pods are ready.
#[derive(Serialize, Deserialize)]
struct Arrived {
    /// Each pod's ready latency in seconds, from the server's answer to its creation, sorted.
    latencies: Vec<f64>,
    /// Seconds from `go` until every pod was ready.
    all_ready: f64,
    /// The node process's CPU seconds meanwhile.
    cpu: f64,
    /// The node process's peak resident memory so far.
    rss_mib: f64,
}

/// One node process, as the parent sees it.
struct NodeProcess {
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
    /// Its node's name, once it said it is ready.
    name: String,
}

impl NodeProcess {
    fn spawn(args: &BenchArgs) -> anyhow::Result<NodeProcess> {
        let exe = std::env::current_exe().context("the path of kubevol itself")?;
        let mut command = tokio::process::Command::new(exe);
        command
            .args(["bench", "--cluster", "--node-process", "--pods"])
            .arg(args.pods().to_string());
        if let Some(c) = args.concurrency {
            command.arg("--concurrency").arg(c.to_string());
        }
        if args.on_disk {
            command.arg("--on-disk");
        }
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .context("starting a node process")?;
        let stdin = child.stdin.take().context("the node's stdin")?;
        let stdout = child.stdout.take().context("the node's stdout")?;
        Ok(NodeProcess {
            child,
            stdin,
            lines: BufReader::new(stdout).lines(),
            name: String::new(),
        })
    }

    /// The rest of the node's next line after `word`.
    async fn expect(&mut self, word: &str) -> anyhow::Result<String> {
        let line = tokio::time::timeout(PATIENCE, self.lines.next_line())
            .await
            .with_context(|| format!("node {}: no `{word}` within {PATIENCE:?}", self.name))??;
        let Some(line) = line else {
            let status = self.child.wait().await?;
            anyhow::bail!(
                "node process {} ended ({status}) before saying `{word}`: its error is above",
                self.name
            );
        };
        line.strip_prefix(word)
            .map(|rest| rest.trim().to_string())
            .with_context(|| format!("node {}: `{line}` where `{word}` was due", self.name))
    }

    async fn say(&mut self, word: &str) -> anyhow::Result<()> {
        self.stdin.write_all(format!("{word}\n").as_bytes()).await?;
        self.stdin.flush().await?;
        Ok(())
    }
}

/// Each of `nodes` in turn through `step`, all at once.
async fn all<'a, T, F>(
    nodes: &'a mut [NodeProcess],
    step: impl Fn(&'a mut NodeProcess) -> F,
) -> anyhow::Result<Vec<T>>
where
    F: std::future::Future<Output = anyhow::Result<T>> + 'a,
{
    futures_util::future::join_all(nodes.iter_mut().map(step))
        .await
        .into_iter()
        .collect()
}

/// The parent: K node processes, their pods created at once, and the figures of each.
pub(super) fn run(args: &BenchArgs) -> anyhow::Result<ExitCode> {
    let (k, n) = (args.nodes, args.pods());
    let Some(dir) = std::env::var_os(CONTROL_PLANE_ENV).map(std::path::PathBuf::from) else {
        anyhow::bail!(
            "--nodes {k} needs one real API server for all its nodes: start one with tools/k8s/control-plane.sh up DIR and set {CONTROL_PLANE_ENV}=DIR"
        );
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        println!(
            "kubevol bench --cluster: {k} nodes x {n} pods x (Memory emptyDir, secret, projected service account volume) created at once in a real kube-apiserver; each node its own process and mount namespace"
        );
        let mut nodes = (0..k)
            .map(|_| NodeProcess::spawn(args))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let names = all(&mut nodes, |p| p.expect("ready")).await?;
        for (p, name) in nodes.iter_mut().zip(&names) {
            p.name = name.clone();
        }
        let server_start = audit::server_cpu_seconds(&dir);
        let from = k8s_openapi::jiff::Timestamp::now();
        all(&mut nodes, |p| p.say("go")).await?;
        let arrived = all(&mut nodes, |p| async {
            let json = p.expect("arrived").await?;
            serde_json::from_str::<Arrived>(&json)
                .with_context(|| format!("node {}: its figures `{json}`", p.name))
        })
        .await?;
        let to = k8s_openapi::jiff::Timestamp::now();
        let server_cpu = server_start
            .zip(audit::server_cpu_seconds(&dir))
            .map(|(a, b)| b - a);
        all(&mut nodes, |p| p.say("done")).await?;
        let torn_down = all(&mut nodes, |p| async {
            let secs = p.expect("left").await?;
            let status = p.child.wait().await?;
            anyhow::ensure!(status.success(), "node process {}: {status}", p.name);
            secs.parse::<f64>()
                .with_context(|| format!("node {}: its tear-down time `{secs}`", p.name))
        })
        .await?;
        // Every request each node made while the pods came, read once the nodes are gone
        // and the server has logged what they had in flight.
        let mut requests: BTreeMap<String, Vec<audit::NodeRequest>> = BTreeMap::new();
        for (node, r) in audit::node_requests(&dir, |node| names.iter().any(|n| n == node)) {
            if r.at.is_some_and(|at| at >= from && at <= to) {
                requests.entry(node).or_default().push(r);
            }
        }
        print(
            n,
            &names,
            &arrived,
            &torn_down,
            &requests,
            server_cpu,
            (to - from).total(k8s_openapi::jiff::Unit::Second)?,
        );
        anyhow::Ok(ExitCode::SUCCESS)
    })
}

fn print(
    n: usize,
    names: &[String],
    arrived: &[Arrived],
    torn_down: &[f64],
    requests: &BTreeMap<String, Vec<audit::NodeRequest>>,
    server_cpu: Option<f64>,
    window: f64,
) {
    let k = names.len();
    let ms = |d: f64| d * 1e3;
    let per_pod = |name: &str| requests.get(name).map_or(0, Vec::len) as f64 / n as f64;
    let watches = |name: &str| {
        requests
            .get(name)
            .map_or(0, |r| r.iter().filter(|r| r.verb == "watch").count())
    };
    println!();
    println!(
        "node                       ready p50    p99      all ready   torn down   CPU s  RSS MiB  watches  API requests per pod"
    );
    for ((name, a), down) in names.iter().zip(arrived).zip(torn_down) {
        println!(
            "{name:<26} {:>7.1} ms {:>7.1} ms {:>9.1} ms {:>8.1} ms {:>6.2} {:>8.1} {:>8}  {:.2}",
            ms(percentile(&a.latencies, 0.5)),
            ms(percentile(&a.latencies, 0.99)),
            ms(a.all_ready),
            ms(*down),
            a.cpu,
            a.rss_mib,
            watches(name),
            per_pod(name)
        );
    }
    let mut every: Vec<f64> = arrived.iter().flat_map(|a| a.latencies.clone()).collect();
    every.sort_by(|a, b| a.total_cmp(b));
    let slowest = arrived.iter().map(|a| a.all_ready).fold(0.0, f64::max);
    println!();
    println!(
        "all {} pods: ready p50 {:.1} ms, p99 {:.1} ms; every node's pods ready within {:.1} ms of its go",
        k * n,
        ms(percentile(&every, 0.5)),
        ms(percentile(&every, 0.99)),
        ms(slowest)
    );
    let spread = |mut v: Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        (v[0], percentile(&v, 0.5), v[v.len() - 1])
    };
    let (lo, mid, hi) = spread(names.iter().map(|m| per_pod(m)).collect());
    let over = names.iter().filter(|m| per_pod(m) > 3.0).count();
    println!(
        "API requests per pod of a node: min {lo:.2}, median {mid:.2}, max {hi:.2}; {over} of {k} nodes above 3.00"
    );
    let (lo, mid, hi) = spread(names.iter().map(|m| watches(m) as f64).collect());
    let total: usize = names.iter().map(|m| watches(m)).sum();
    println!(
        "watches opened by a node while its pods came: min {lo:.0}, median {mid:.0}, max {hi:.0} ({total} in all)"
    );
    let mut all = BTreeMap::<String, u64>::new();
    for r in requests.values() {
        for (what, count) in audit::count(r) {
            *all.entry(what).or_default() += count;
        }
    }
    println!("the {k} nodes' requests while the pods came, by kind:");
    for (what, count) in &all {
        println!(
            "  {what:<36} {count:7}  ({:.2} per pod)",
            *count as f64 / (k * n) as f64
        );
    }
    let cpu: f64 = arrived.iter().map(|a| a.cpu).sum();
    println!(
        "CPU seconds of the {k} node processes while their pods came: {cpu:.2} ({:.3} per node)",
        cpu / k as f64
    );
    if let Some(server) = server_cpu {
        println!(
            "CPU seconds of the kube-apiserver and etcd meanwhile ({window:.1} s): {server:.2} ({:.3} per node)",
            server / k as f64
        );
    }
}

/// One node process (`--node-process`), speaking to its parent on stdin and stdout.
pub(super) fn child(args: &BenchArgs) -> anyhow::Result<ExitCode> {
    let n = args.pods();
    let (tmp, _) = BenchRoot::new(args)?;
    let runtime = super::cluster::bench_runtime()?;
    runtime.block_on(async {
        // The parent's lines, read on a thread of their own (stdin blocks).
        let (lines, mut parent) = tokio::sync::mpsc::unbounded_channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::stdin().lock().lines() {
                if lines.send(line).is_err() {
                    break;
                }
            }
        });
        let mut wait_for = async |word: &str| -> anyhow::Result<()> {
            match parent.recv().await.transpose()? {
                Some(line) if line == word => Ok(()),
                other => anyhow::bail!("the parent said {other:?} where `{word}` was due"),
            }
        };
        let cluster = Arc::new(TestCluster::start("bench-node").await);
        anyhow::ensure!(
            cluster.is_real(),
            "a node process needs {CONTROL_PLANE_ENV}"
        );
        let node = BenchNode::start(cluster.clone(), &tmp.path().join("root"), n, args).await?;
        drop(cluster);
        say(&format!("ready {}", node.cluster.node_name()))?;
        wait_for("go").await?;
        let cpu_start = super::cluster::kubevol_cpu_seconds();
        let Arrival {
            latencies,
            all_ready,
            pods,
        } = node.come().await?;
        let arrived = Arrived {
            latencies,
            all_ready: all_ready.as_secs_f64(),
            cpu: super::cluster::kubevol_cpu_seconds() - cpu_start,
            rss_mib: peak_rss_mib(),
        };
        say(&format!("arrived {}", serde_json::to_string(&arrived)?))?;
        wait_for("done").await?;
        let torn_down = node.leave(pods).await?;
        say(&format!("left {}", torn_down.as_secs_f64()))
    })?;
    tmp.release()?;
    Ok(ExitCode::SUCCESS)
}

/// One line to the parent.
fn say(line: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")?;
    out.flush()?;
    Ok(())
}
