//! `kubevol bench`: N pods with M Memory emptyDir volumes (tmpfs mounts) arrive at once. It
//! prints pod volume-ready latency, volume throughput, CPU, peak RSS and the CPU used while idle
//! with every pod mounted, and, measured in the same run, the raw floor: the same mkdir, mount,
//! chmod, umount and rmdir syscalls made directly in a loop (before and after kubevol,
//! averaged), with kubevol's ratio to it.
//!
//! It runs in a private mount namespace (entered before any thread starts) on a temporary root
//! that is itself a fresh tmpfs, so nothing it mounts is visible outside or outlives it, and the
//! disk's state does not skew the comparison.

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use k8s_openapi::api::core::v1::Pod;
use kubevol::{Config, PodIdentity, VolumeManager};
use kubevol_core::PodRef;
use kubevol_mount::{LinuxMounter, MountOptions, Mounter};

mod churn;
mod deep;
mod manifests;

/// Benchmark options.
#[derive(clap::Args)]
pub struct BenchArgs {
    /// Pods (default: 1000; 50 with --csi, where each pod's volume is a loop device).
    #[arg(long)]
    pods: Option<usize>,
    /// Memory emptyDir volumes per pod.
    #[arg(long, default_value_t = 4)]
    volumes: usize,
    /// Seconds to measure idle CPU and wake-ups with everything mounted.
    #[arg(long, default_value_t = 10)]
    idle_seconds: u64,
    /// At most this many seconds between the last pod's readiness and the idle window: the
    /// tail work of the set-up (the durable record's write, the orphan sweep after the
    /// changes, the operation threads' exit when they have had nothing to do for 10 s) is
    /// measured apart from idle, until those threads are gone and a whole second passes in
    /// which no thread of kubevol woke or ended.
    #[arg(long, default_value_t = 30)]
    settle_seconds: u64,
    /// Operations kubevol runs at once (default: the manager's default).
    #[arg(long)]
    concurrency: Option<usize>,
    /// Benchmark content volumes instead: each pod gets a configMap (10 keys), a secret (3 keys)
    /// and a projected volume (both plus the pod's name); reports ready and update latency.
    #[arg(long)]
    content: bool,
    /// Benchmark CSI volumes instead: each pod gets its own PersistentVolume of the
    /// kubevol-csi-loop driver (attach, stage: format and mount, publish); reports each pod's
    /// ready latency split into the driver's own work and kubevol's overhead.
    #[arg(long, conflicts_with = "content")]
    csi: bool,
    /// Benchmark cluster mode instead: N pods, each with a Memory emptyDir, its own Secret and
    /// the service account volume every pod of a cluster gets (a token from TokenRequest, a
    /// ConfigMap, the namespace), are created at once in an API server (the in-process test
    /// server, or the real one of KUBEVOL_TEST_CLUSTER, a control plane of
    /// tools/k8s/control-plane.sh); reports ready latency from each pod's creation and the
    /// API requests the node made.
    #[arg(long, conflicts_with_all = ["content", "csi"])]
    cluster: bool,
    /// With --cluster: K nodes (each its own identity, root and manager, N pods each) against
    /// one real API server (KUBEVOL_TEST_CLUSTER), to show that a node's API cost does not
    /// grow as nodes are added.
    #[arg(long, default_value_t = 1, requires = "cluster")]
    nodes: usize,
    /// With --cluster: run as one node of `--nodes K`, started by the benchmark itself, which
    /// speaks to it on stdin and stdout.
    #[arg(long, hide = true, requires = "cluster")]
    node_process: bool,
    /// Benchmark a restart instead: N pods x M Memory emptyDir volumes are mounted, the
    /// manager stops with everything mounted, and a new one starts on the same root; reports
    /// the time to read the record and reconstruct (start to first reconcile) and until every
    /// pod is ready again.
    #[arg(long, conflicts_with_all = ["content", "csi", "cluster"])]
    restart: bool,
    /// Run the default benchmark once per number of pods given (e.g. 100,1000,10000) and
    /// print the cost curve as a table.
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["pods", "content", "csi", "cluster", "restart"])]
    scale: Vec<usize>,
    /// Benchmark memory after churn instead: waves of N pods are added and removed for this
    /// many seconds, then every pod is gone; reports the resident memory before, at its peak
    /// and after. With --content each pod has four content volumes (configMap, secret,
    /// projected, downwardAPI) instead of Memory emptyDirs.
    #[arg(long, value_name = "SECONDS", conflicts_with_all = ["csi", "cluster", "restart", "scale"])]
    churn: Option<u64>,
    /// Benchmark fsGroup instead: a volume of this many files and directories is given a
    /// pod's fsGroup by kubevol, by the kubelet's own SetVolumeOwnership (built from
    /// k8s.io/kubernetes) and by a raw single-threaded walk, first with every entry to change,
    /// then again with every entry right, and with OnRootMismatch.
    #[arg(long, value_name = "FILES", conflicts_with_all = ["content", "csi", "cluster", "restart", "scale", "churn"])]
    fs_group: Option<usize>,
    /// Benchmark volume stats instead: one emptyDir of this many files and directories is
    /// measured by the kubelet's own MetricsDu, by kubevol's walk, by its project quota where
    /// the filesystem accounts them, and by a raw stat of every entry.
    #[arg(long, value_name = "FILES", conflicts_with_all = ["content", "csi", "cluster", "restart", "scale", "churn", "fs_group"])]
    volume_stats: Option<usize>,
    /// Run the default benchmark, then the same workload through the kubelet's own
    /// VolumeManager (built from k8s.io/kubernetes by tools/k8s/build-harness.sh), and print
    /// the ratios.
    #[arg(long, conflicts_with_all = ["content", "csi", "cluster", "restart", "scale", "churn", "fs_group"])]
    versus_kubelet: bool,
    /// Benchmark the walks over a tree a pod made instead: a chain of this many directories is
    /// walked by kubevol's usage, fsGroup and teardown walks, beside `rm -rf` of it.
    #[arg(long, value_name = "LEVELS", conflicts_with_all = ["content", "csi", "cluster", "restart", "scale", "churn", "fs_group", "volume_stats", "versus_kubelet"])]
    deep_tree: Option<usize>,
    /// Benchmark manifest reading instead: files of this many MB (valid pods, pods with octal
    /// and quoted modes, ConfigMaps of unknown fields, documents with a type error) are parsed
    /// as the manifest watch parses them; prints CPU seconds per MB beside the YAML parser's.
    #[arg(long, value_name = "MB", conflicts_with_all = ["content", "csi", "cluster", "restart", "scale", "churn", "fs_group", "volume_stats", "versus_kubelet"])]
    manifests: Option<f64>,
    /// Put the benchmark's root (kubevol's and the floor's) in a temporary directory on the
    /// disk instead of a fresh tmpfs, so that the durable record's fsyncs are real.
    #[arg(long)]
    on_disk: bool,
}

impl BenchArgs {
    fn pods(&self) -> usize {
        self.pods.unwrap_or(if self.csi { 50 } else { 1000 })
    }
}

/// CPU seconds (user + system) of this process so far, to the nanosecond (the clock ticks of
/// /proc/self/stat are 10 ms, a twentieth of what a run of the floor takes). With
/// `KUBEVOL_BENCH_CPU=ticks` they are read from /proc/self/stat instead: under valgrind, whose
/// vDSO the clock cannot be read through, for a count of instructions (callgrind) of the run.
fn cpu_seconds() -> f64 {
    static TICKS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *TICKS.get_or_init(|| std::env::var("KUBEVOL_BENCH_CPU").is_ok_and(|v| v == "ticks")) {
        let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
        let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
        let f: Vec<&str> = after.split_whitespace().collect();
        // Fields 14 and 15 of the file are the 12th and 13th after the command name, in
        // USER_HZ (100) ticks.
        let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        return (ticks(11) + ticks(12)) / 100.0;
    }
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// A memory figure of this process in MiB (`VmHWM:` the peak resident set, `VmRSS:` the
/// resident set now, `RssFile:` the part of it that is pages of files), from
/// /proc/self/status.
fn status_mib(field: &str) -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|kb| kb.parse::<f64>().ok())
        .map(|kb| kb / 1024.0)
        .unwrap_or(0.0)
}

fn peak_rss_mib() -> f64 {
    status_mib("VmHWM:")
}

/// Wake-ups of this process's living threads so far (each thread's voluntary context
/// switches: it slept and woke on a timer, an event or a lock), by thread name, and the
/// threads' ids, from /proc/self/task. A thread that ends takes its count with it: the ids tell
/// how many ended (each woke at least once to do so).
struct Wakeups {
    by_name: std::collections::BTreeMap<String, u64>,
    tids: std::collections::BTreeSet<String>,
}

fn wakeups() -> Wakeups {
    let mut by_name = std::collections::BTreeMap::new();
    let mut tids = std::collections::BTreeSet::new();
    for task in std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .flatten()
    {
        let Ok(status) = std::fs::read_to_string(task.path().join("status")) else {
            continue;
        };
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(|v| v.trim().to_string())
        };
        let switches = field("voluntary_ctxt_switches:")
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        *by_name
            .entry(field("Name:").unwrap_or_default())
            .or_insert(0) += switches;
        tids.insert(task.file_name().to_string_lossy().into_owned());
    }
    Wakeups { by_name, tids }
}

/// The name of the runtime's threads, workers and blocking threads alike (tokio's default).
const RUNTIME_THREAD: &str = "tokio-rt-worker";

/// Waits until the runtime's blocking threads have ended (they end after 10 s with nothing to
/// do, each waking to do so: tail work, not idle) and then a whole second passes in which no
/// thread but the caller's woke and none ended; at most `max`. Returns how long it took. The
/// caller sleeps outside the runtime (as the idle window does), so that its own timer wakes
/// none of kubevol's threads; it must not be one of the runtime's `workers`.
fn settle(max: Duration, workers: usize) -> Duration {
    let me = std::fs::read_to_string("/proc/thread-self/comm").unwrap_or_default();
    let start = Instant::now();
    while start.elapsed() < max {
        let before = wakeups();
        std::thread::sleep(Duration::from_secs(1));
        let after = wakeups();
        let (_, woke) = wakeups_between(&before, &after, 1.0);
        // The runtime names its workers and its blocking threads alike.
        let runtime_threads = std::fs::read_dir("/proc/self/task")
            .into_iter()
            .flatten()
            .flatten()
            .filter(|t| {
                std::fs::read_to_string(t.path().join("comm"))
                    .is_ok_and(|name| name.trim() == RUNTIME_THREAD)
            })
            .count();
        let only_blocking_gone = runtime_threads <= workers;
        if only_blocking_gone && woke.iter().all(|(name, n)| name == me.trim() && *n <= 1) {
            break;
        }
    }
    start.elapsed()
}

/// What woke the process between two [`wakeups`] counts: the total per second and the threads
/// (by name) that woke, most first; threads that ended count once each, as "ended".
fn wakeups_between(before: &Wakeups, after: &Wakeups, seconds: f64) -> (f64, Vec<(String, u64)>) {
    let mut woke: Vec<(String, u64)> = after
        .by_name
        .iter()
        .map(|(name, n)| {
            let was = before.by_name.get(name).copied().unwrap_or(0);
            (name.clone(), n.saturating_sub(was))
        })
        .filter(|(_, n)| *n > 0)
        .collect();
    let ended = before.tids.difference(&after.tids).count() as u64;
    if ended > 0 {
        woke.push(("(threads that ended)".into(), ended));
    }
    woke.sort_by_key(|w| std::cmp::Reverse(w.1));
    let total: u64 = woke.iter().map(|(_, n)| n).sum();
    (total as f64 / seconds.max(1e-9), woke)
}

fn pod(i: usize, volumes: usize) -> Pod {
    let vols: Vec<serde_json::Value> = (0..volumes)
        .map(|v| serde_json::json!({"name": format!("v{v}"), "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}))
        .collect();
    let mounts: Vec<serde_json::Value> = (0..volumes)
        .map(|v| serde_json::json!({"name": format!("v{v}"), "mountPath": format!("/v{v}")}))
        .collect();
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("bench-{i}"), "namespace": "bench"},
        "spec": {"containers": [{"name": "c", "image": "busybox", "volumeMounts": mounts}], "volumes": vols},
    }))
    .expect("benchmark pod is valid")
}

/// The raw floor: the same syscalls kubevol needs per volume, made directly.
fn raw_floor(dir: &Path, count: usize) -> anyhow::Result<(Duration, Duration)> {
    let m = LinuxMounter;
    let opts = MountOptions {
        data: vec![format!("size={}", 1 << 20)],
        ..Default::default()
    };
    let t0 = Instant::now();
    for i in 0..count {
        let p = dir.join(i.to_string());
        std::fs::create_dir(&p)?;
        m.mount("tmpfs", &p, "tmpfs", &opts)?;
        std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o777))?;
    }
    let mounted = t0.elapsed();
    let t1 = Instant::now();
    for i in 0..count {
        let p = dir.join(i.to_string());
        m.unmount(&p)?;
        std::fs::remove_dir(&p)?;
    }
    Ok((mounted, t1.elapsed()))
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// The root of both kubevol's and the floor's runs: a temporary directory with a fresh tmpfs
/// on it, so that the measurement is kubevol's overhead over the same syscalls, not the state
/// of the disk filesystem (ext4 slows down after many removals); or, with `--on-disk`, a
/// temporary directory on the disk, where every fsync of the durable record is real.
struct BenchRoot {
    /// None once released.
    dir: Option<tempfile::TempDir>,
    on_disk: bool,
}

impl Drop for BenchRoot {
    /// A run that ends early (an error) unmounts its tmpfs, so that the directory under it,
    /// now empty, is removed too.
    fn drop(&mut self) {
        if let (Some(dir), false) = (&self.dir, self.on_disk) {
            let _ = LinuxMounter.unmount(dir.path());
        }
    }
}

impl BenchRoot {
    fn new(args: &BenchArgs) -> anyhow::Result<(Self, std::path::PathBuf)> {
        let dir = tempfile::Builder::new().prefix("kubevol-bench").tempdir()?;
        if !args.on_disk {
            LinuxMounter
                .mount("tmpfs", dir.path(), "tmpfs", &MountOptions::default())
                .context("mount the benchmark's tmpfs root")?;
        }
        // Owned by the root from here: an error below unmounts it.
        let root = BenchRoot {
            dir: Some(dir),
            on_disk: args.on_disk,
        };
        let floor_dir = root.path().join("floor");
        std::fs::create_dir(&floor_dir)?;
        Ok((root, floor_dir))
    }

    fn path(&self) -> &Path {
        self.dir.as_ref().expect("not released yet").path()
    }

    /// What the root is, for the report.
    fn describe(&self) -> String {
        if !self.on_disk {
            return "a fresh tmpfs (fsync costs nothing)".into();
        }
        let fs = LinuxMounter
            .mount_table()
            .ok()
            .and_then(|t| {
                t.into_iter()
                    .filter(|m| self.path().starts_with(&m.mount_point))
                    .max_by_key(|m| m.mount_point.as_os_str().len())
            })
            .map(|m| m.fs_type)
            .unwrap_or_else(|| "unknown".into());
        format!(
            "{} on the disk ({fs}, every fsync is real)",
            self.path().display()
        )
    }

    /// Removes the root: unmounts its tmpfs, or on disk removes the directory, which is only
    /// done when nothing is mounted under it any more (a removal never crosses a mount).
    fn release(mut self) -> anyhow::Result<()> {
        let Some(dir) = self.dir.take() else {
            return Ok(());
        };
        if !self.on_disk {
            LinuxMounter.unmount(dir.path())?;
            return Ok(());
        }
        let left = LinuxMounter
            .mount_table()?
            .into_iter()
            .filter(|m| m.mount_point.starts_with(dir.path()))
            .count();
        if left > 0 {
            let kept = dir.keep();
            anyhow::bail!(
                "{left} mounts are left under {}; the directory is kept",
                kept.display()
            );
        }
        Ok(())
    }
}

/// A running manager on `root` with the benchmark's settings. Call inside the runtime.
fn start_manager(
    root: &Path,
    args: &BenchArgs,
    tweak: impl FnOnce(&mut Config),
) -> anyhow::Result<(VolumeManager, tokio::task::JoinHandle<()>)> {
    let mut config = Config::new(root, "bench-node");
    config.wait_timeout = Duration::from_secs(600);
    if let Some(c) = args.concurrency {
        config.max_concurrent_operations = c;
    }
    tweak(&mut config);
    let manager = VolumeManager::new(config, Arc::new(LinuxMounter))?;
    let running = tokio::spawn({
        let m = manager.clone();
        async move { m.run().await }
    });
    Ok((manager, running))
}

/// What the benchmark keeps of the pods it gives to kubevol: who each is (a `PodRef`), all
/// that the waits and the removal need. The pods themselves move into kubevol, as a daemon's
/// parsed manifests do, so no second copy of their specs is measured as kubevol's (an empty
/// `Pod` kept instead would still weigh 2.4 KB: its fields are inline).
fn handles(pods: &[Pod]) -> Arc<Vec<PodRef>> {
    Arc::new(pods.iter().map(PodIdentity::pod_ref).collect())
}

/// Gives all `pods` to the manager at once and waits for each to be ready, through its
/// handle (see [`handles`]). Returns their UIDs and their ready latencies in seconds, sorted.
async fn add_and_wait(
    manager: &VolumeManager,
    pods: Vec<Pod>,
    handles: &Arc<Vec<PodRef>>,
) -> anyhow::Result<(Vec<kubevol_core::PodUid>, Vec<f64>)> {
    let start = tokio::time::Instant::now();
    let uids = manager.add_pods(pods);
    // The waiters share the benchmark's one copy of the handles.
    let pods = handles;
    let mut waits = Vec::new();
    for i in 0..pods.len() {
        let (m, pods) = (manager.clone(), pods.clone());
        waits.push(tokio::spawn(async move {
            m.wait_for_attach_and_mount(&pods[i])
                .await
                .map(|_| start.elapsed().as_secs_f64())
        }));
    }
    let mut latencies = Vec::new();
    for w in waits {
        latencies.push(w.await??);
    }
    latencies.sort_by(|a, b| a.total_cmp(b));
    Ok((uids, latencies))
}

/// Runs the benchmark and prints its figures.
pub fn run(args: &BenchArgs) -> anyhow::Result<ExitCode> {
    if let Some(mb) = args.manifests {
        return manifests::run(mb);
    }
    if let Some(levels) = args.deep_tree {
        return deep::run(args, levels);
    }
    if let Some(seconds) = args.churn {
        return churn::run(args, seconds);
    }
    if args.content {
        return content::run(args);
    }
    if args.csi {
        return csi::run(args);
    }
    if args.cluster {
        return cluster::run(args);
    }
    if args.restart {
        return restart(args);
    }
    if let Some(files) = args.fs_group {
        return fsgroup::run(args, files);
    }
    if let Some(files) = args.volume_stats {
        return stats::run(args, files);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    if args.versus_kubelet {
        return versus::run(args, &runtime);
    }
    if args.scale.is_empty() {
        let f = measure(args, args.pods(), &runtime)?;
        f.print(args);
        return Ok(ExitCode::SUCCESS);
    }
    let mut all = Vec::new();
    for &n in &args.scale {
        let f = measure(args, n, &runtime)?;
        f.print(args);
        println!();
        all.push(f);
    }
    println!("the cost curve (ratios to the floor measured in the same run):");
    println!(
        "{:>7} {:>8} {:>9} {:>9} {:>15} {:>15} {:>13} {:>9} {:>9} {:>12}",
        "pods",
        "mounts",
        "p50 ms",
        "p99 ms",
        "set-up/s",
        "tear-down/s",
        "CPU s (floor)",
        "µs CPU/vol",
        "idle CPU",
        "KiB/volume"
    );
    for f in &all {
        println!(
            "{:>7} {:>8} {:>9.1} {:>9.1} {:>8.0} ({:.2}) {:>8.0} ({:.2}) {:>6.2} ({:.2}) {:>9.0} {:>9} {:>12.1}",
            f.pods,
            f.total,
            percentile(&f.latencies, 0.5) * 1e3,
            percentile(&f.latencies, 0.99) * 1e3,
            f.kv_mount,
            f.kv_mount / f.fl_mount,
            f.kv_unmount,
            f.kv_unmount / f.fl_unmount,
            f.mount_cpu + f.unmount_cpu,
            f.floor_cpu,
            (f.mount_cpu + f.unmount_cpu) / f.total as f64 * 1e6,
            f.idle_percent()
                .map_or_else(|| "-".to_string(), |p| format!("{p:.3}%")),
            f.rss_per_volume_kib()
        );
    }
    // How the CPU per volume grows with the node's mounts, against the row of 1,000 pods (the
    // issue's reference size) or the first.
    let per_volume = |f: &Figures| (f.mount_cpu + f.unmount_cpu) / f.total as f64;
    if let Some(base) = all.iter().find(|f| f.pods == 1000).or(all.first()) {
        for f in all.iter().filter(|f| f.pods > base.pods) {
            println!(
                "CPU per volume at {} pods: {:.2} times that at {} pods",
                f.pods,
                per_volume(f) / per_volume(base),
                base.pods
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The figures of one run of the default benchmark.
struct Figures {
    pods: usize,
    total: usize,
    root: String,
    /// Pod ready latencies in seconds, sorted.
    latencies: Vec<f64>,
    kv_mount: f64,
    kv_unmount: f64,
    fl_mount: f64,
    fl_unmount: f64,
    mount_cpu: f64,
    unmount_cpu: f64,
    floor_cpu: f64,
    idle_cpu: f64,
    idle_seconds: u64,
    /// Wake-ups per second while idle, and the threads that woke.
    idle_wakeups: f64,
    idle_woke: Vec<(String, u64)>,
    /// How long the tail work after the last pod was ready lasted, and its CPU seconds
    /// (the [`settle`]'s own reads included).
    settled: Duration,
    settle_cpu: f64,
    /// Resident memory before the manager started, and the peak after, in MiB.
    rss_before: f64,
    rss_peak: f64,
    /// The pages of the program's files (its binary and libraries) resident when set-up
    /// ended, in MiB: part of the peak, and not kubevol's data. They depend on how the page
    /// cache holds the binary (a binary written by `cp` into large folios maps several MiB
    /// more of itself than the linker's output does).
    rss_file: f64,
}

impl Figures {
    fn idle_percent(&self) -> Option<f64> {
        (self.idle_seconds > 0).then(|| self.idle_cpu / self.idle_seconds as f64 * 100.0)
    }

    fn rss_per_volume_kib(&self) -> f64 {
        (self.rss_peak - self.rss_before).max(0.0) * 1024.0 / self.total.max(1) as f64
    }

    fn print(&self, args: &BenchArgs) {
        let lat = &self.latencies;
        let total = self.total;
        println!(
            "kubevol bench: {} pods x {} Memory emptyDir volumes = {total} tmpfs mounts",
            self.pods, args.volumes
        );
        println!("root: {}", self.root);
        println!();
        println!("pod volume-ready latency (all pods added at once):");
        let p99 = percentile(lat, 0.99);
        println!(
            "  first {:.1} ms   p50 {:.1} ms   p99 {:.1} ms   max {:.1} ms",
            lat.first().copied().unwrap_or(0.0) * 1e3,
            percentile(lat, 0.5) * 1e3,
            p99 * 1e3,
            lat.last().copied().unwrap_or(0.0) * 1e3
        );
        let floor_all = total as f64 / self.fl_mount;
        println!(
            "  p99 is {:.2} times the floor's time for all {total} set-ups ({:.1} ms)",
            p99 / floor_all,
            floor_all * 1e3
        );
        println!("throughput (volumes/s)        kubevol    raw floor   ratio");
        println!(
            "  set up (mkdir+mount+chmod) {:9.0}  {:10.0}   {:.2}",
            self.kv_mount,
            self.fl_mount,
            self.kv_mount / self.fl_mount
        );
        println!(
            "  tear down (umount+rmdir)   {:9.0}  {:10.0}   {:.2}",
            self.kv_unmount,
            self.fl_unmount,
            self.kv_unmount / self.fl_unmount
        );
        println!(
            "CPU seconds: kubevol set-up {:.3}, tear-down {:.3}; raw floor set-up and tear-down {:.3} (kubevol/floor {:.2})",
            self.mount_cpu,
            self.unmount_cpu,
            self.floor_cpu,
            (self.mount_cpu + self.unmount_cpu) / self.floor_cpu
        );
        println!(
            "tail work after the last pod was ready: {:.1} ms CPU, quiet after {:.0} s{}",
            self.settle_cpu * 1e3,
            self.settled.as_secs_f64(),
            if self.settled.as_secs() >= args.settle_seconds {
                " (not quiet by --settle-seconds)"
            } else {
                ""
            }
        );
        match self.idle_percent() {
            Some(p) => {
                println!(
                    "idle CPU with {total} volumes mounted: {p:.3}% of one core over {} s; {:.1} wake-ups/s",
                    self.idle_seconds, self.idle_wakeups
                );
                let woke: Vec<String> = self
                    .idle_woke
                    .iter()
                    .take(6)
                    .map(|(name, n)| format!("{name} {n}"))
                    .collect();
                if !woke.is_empty() {
                    println!("  threads that woke while idle: {}", woke.join(", "));
                }
            }
            None => println!("idle CPU: not measured (--idle-seconds 0)"),
        }
        println!(
            "peak RSS: {:.1} MiB ({:.1} MiB idle with the pods built: {:.1} KiB per volume above it; {:.1} MiB of the program's file pages)",
            self.rss_peak,
            self.rss_before,
            self.rss_per_volume_kib(),
            self.rss_file
        );
    }
}

/// One run of the default benchmark with `n` pods.
fn measure(
    args: &BenchArgs,
    n: usize,
    runtime: &tokio::runtime::Runtime,
) -> anyhow::Result<Figures> {
    let total = n * args.volumes;
    let (tmp, floor_dir) = BenchRoot::new(args)?;

    // The floor runs before and after kubevol and the two are averaged: the filesystem gets
    // slower at creating directories after many removals, which would favour whichever ran first.
    let cpu0 = cpu_seconds();
    let (floor_mount_a, floor_unmount_a) = raw_floor(&floor_dir, total).context("raw floor")?;
    let floor_cpu_a = cpu_seconds() - cpu0;

    let root = tmp.path().join("root");
    let mut rss_before = 0.0;
    let mut rss_file = 0.0;
    let result = runtime.block_on(async {
        let (manager, running) = start_manager(&root, args, |_| {})?;
        let input: Vec<Pod> = (0..n).map(|i| pod(i, args.volumes)).collect();
        let pods = handles(&input);
        // The baseline is the idle manager beside its parsed input, which then moves into it (a
        // daemon parses its pods and keeps no other copy); the peak is this run's (the kernel
        // resets its high-water mark on this write).
        let _ = std::fs::write("/proc/self/clear_refs", "5");
        rss_before = status_mib("VmRSS:");
        let cpu_start = cpu_seconds();
        let start = tokio::time::Instant::now();
        let (_, latencies) = add_and_wait(&manager, input, &pods).await?;
        let mount_elapsed = start.elapsed();
        let mount_cpu = cpu_seconds() - cpu_start;
        rss_file = status_mib("RssFile:");

        let settle_start = cpu_seconds();
        // The benchmark's thread (block_on's, not a worker) sleeps outside the runtime from
        // here to the end of the idle window: its timer is not kubevol's wake-up.
        let workers = tokio::runtime::Handle::current().metrics().num_workers();
        // Nothing to settle for without an idle window.
        let max = if args.idle_seconds == 0 {
            0
        } else {
            args.settle_seconds
        };
        let settled = settle(Duration::from_secs(max), workers);
        let settle_cpu = cpu_seconds() - settle_start;

        // Counted before the clock starts: reading every thread's status is not kubevol's.
        let woken_before = wakeups();
        let idle_start = cpu_seconds();
        std::thread::sleep(Duration::from_secs(args.idle_seconds));
        let idle_cpu = cpu_seconds() - idle_start;
        let idle = wakeups_between(&woken_before, &wakeups(), args.idle_seconds as f64);

        let cpu_unmount_start = cpu_seconds();
        let t = tokio::time::Instant::now();
        manager.remove_pods(&pods);
        manager.wait_for_all_pods_unmount(&pods).await?;
        let unmount_elapsed = t.elapsed();
        let unmount_cpu = cpu_seconds() - cpu_unmount_start;
        manager.shutdown();
        let _ = running.await;
        anyhow::Ok((
            latencies,
            mount_elapsed,
            mount_cpu,
            ((settled, settle_cpu), idle_cpu, idle),
            unmount_elapsed,
            unmount_cpu,
        ))
    });
    let (latencies, mount_elapsed, mount_cpu, quiet, unmount_elapsed, unmount_cpu) = result?;
    let ((settled, settle_cpu), idle_cpu, (idle_wakeups, idle_woke)) = quiet;
    let rss_peak = peak_rss_mib();
    let cpu1 = cpu_seconds();
    let (floor_mount_b, floor_unmount_b) = raw_floor(&floor_dir, total).context("raw floor")?;
    let floor_cpu = (floor_cpu_a + cpu_seconds() - cpu1) / 2.0;
    let floor_mount = (floor_mount_a + floor_mount_b) / 2;
    let floor_unmount = (floor_unmount_a + floor_unmount_b) / 2;
    let rate = |n: usize, d: Duration| n as f64 / d.as_secs_f64().max(1e-9);
    let figures = Figures {
        pods: n,
        total,
        root: tmp.describe(),
        latencies,
        kv_mount: rate(total, mount_elapsed),
        kv_unmount: rate(total, unmount_elapsed),
        fl_mount: rate(total, floor_mount),
        fl_unmount: rate(total, floor_unmount),
        mount_cpu,
        unmount_cpu,
        floor_cpu,
        idle_cpu,
        idle_seconds: args.idle_seconds,
        idle_wakeups,
        idle_woke,
        settled,
        settle_cpu,
        rss_before,
        rss_peak,
        rss_file,
    };
    tmp.release()?;
    Ok(figures)
}

/// The restart benchmark (see [`BenchArgs::restart`]).
fn restart(args: &BenchArgs) -> anyhow::Result<ExitCode> {
    let total = args.pods() * args.volumes;
    let (tmp, _) = BenchRoot::new(args)?;
    println!(
        "kubevol bench --restart: {} pods x {} Memory emptyDir volumes = {total} tmpfs mounts, then a restart",
        args.pods(),
        args.volumes
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let root = tmp.path().join("root");
    let input: Vec<Pod> = (0..args.pods()).map(|i| pod(i, args.volumes)).collect();
    let pods = handles(&input);
    let figures = runtime.block_on(async {
        let (manager, running) = start_manager(&root, args, |_| {})?;
        add_and_wait(&manager, input.clone(), &pods).await?;
        // Stopped with everything mounted, as a killed daemon leaves the node.
        manager.shutdown();
        let _ = running.await;
        drop(manager);

        let start = tokio::time::Instant::now();
        let (manager, running) = start_manager(&root, args, |_| {})?;
        let opened = start.elapsed();
        let (_, latencies) = add_and_wait(&manager, input, &pods).await?;
        let ready = start.elapsed();
        let found = manager.reconstruction();
        manager.remove_pods(&pods);
        manager.wait_for_all_pods_unmount(&pods).await?;
        manager.shutdown();
        let _ = running.await;
        anyhow::Ok((opened, found, ready, latencies))
    });
    let (opened, found, ready, lat) = figures?;
    let reconstruct = Duration::from_millis(found.took_ms);
    println!();
    println!(
        "start to first reconcile: {:.1} ms (record read {:.1} ms, reconstruction {} ms: {} pod volumes, {} problems)",
        (opened + reconstruct).as_secs_f64() * 1e3,
        opened.as_secs_f64() * 1e3,
        found.took_ms,
        found.pod_volumes,
        found.problems.len()
    );
    println!(
        "start to every pod ready again: {:.1} ms (pod p50 {:.1} ms, p99 {:.1} ms)",
        ready.as_secs_f64() * 1e3,
        percentile(&lat, 0.5) * 1e3,
        percentile(&lat, 0.99) * 1e3
    );
    println!("peak RSS: {:.1} MiB", peak_rss_mib());
    tmp.release()?;
    Ok(ExitCode::SUCCESS)
}

mod content;

mod csi;

mod cluster;
mod nodes;

mod fsgroup;
mod stats;

mod versus;
