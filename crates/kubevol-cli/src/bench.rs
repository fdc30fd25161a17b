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
use kubevol::{Config, VolumeManager};
use kubevol_mount::{LinuxMounter, MountOptions, Mounter};

mod churn;

/// Benchmark options.
#[derive(clap::Args)]
pub struct BenchArgs {
    /// Pods (default: 1000; 50 with --csi, where each pod's volume is a loop device).
    #[arg(long)]
    pods: Option<usize>,
    /// Memory emptyDir volumes per pod.
    #[arg(long, default_value_t = 4)]
    volumes: usize,
    /// Seconds to measure idle CPU with everything mounted.
    #[arg(long, default_value_t = 10)]
    idle_seconds: u64,
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
    /// and after.
    #[arg(long, value_name = "SECONDS", conflicts_with_all = ["content", "csi", "cluster", "restart", "scale"])]
    churn: Option<u64>,
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
/// resident set now), from /proc/self/status.
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

/// What the benchmark keeps of a pod it gave to kubevol: its name and namespace, all that the
/// waits and the removal need. The pods themselves move into kubevol, as a daemon's parsed
/// manifests do, so no second copy of their specs is measured as kubevol's.
fn handle(pod: &Pod) -> Pod {
    Pod {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: pod.metadata.name.clone(),
            namespace: pod.metadata.namespace.clone(),
            uid: pod.metadata.uid.clone(),
            ..Default::default()
        },
        ..Default::default()
    }
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

/// Adds all pods at once and waits for each to be ready. Returns their UIDs and their ready
/// latencies in seconds, sorted.
/// Gives `pods` to the manager and waits for each, through its handle (see [`handle`]).
async fn add_and_wait(
    manager: &VolumeManager,
    pods: Vec<Pod>,
    handles: &Arc<Vec<Pod>>,
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
    if let Some(seconds) = args.churn {
        return churn::run(args, seconds);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
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
    /// Resident memory before the manager started, and the peak after, in MiB.
    rss_before: f64,
    rss_peak: f64,
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
            "  p50 {:.1} ms   p99 {:.1} ms   max {:.1} ms",
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
        match self.idle_percent() {
            Some(p) => println!(
                "idle CPU with {total} volumes mounted: {p:.3}% of one core over {} s",
                self.idle_seconds
            ),
            None => println!("idle CPU: not measured (--idle-seconds 0)"),
        }
        println!(
            "peak RSS: {:.1} MiB ({:.1} MiB idle with the pods built: {:.1} KiB per volume above it)",
            self.rss_peak,
            self.rss_before,
            self.rss_per_volume_kib()
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
    let result = runtime.block_on(async {
        let (manager, running) = start_manager(&root, args, |_| {})?;
        let input: Vec<Pod> = (0..n).map(|i| pod(i, args.volumes)).collect();
        let pods: Arc<Vec<Pod>> = Arc::new(input.iter().map(handle).collect());
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

        let idle_start = cpu_seconds();
        tokio::time::sleep(Duration::from_secs(args.idle_seconds)).await;
        let idle_cpu = cpu_seconds() - idle_start;

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
            idle_cpu,
            unmount_elapsed,
            unmount_cpu,
        ))
    });
    let (latencies, mount_elapsed, mount_cpu, idle_cpu, unmount_elapsed, unmount_cpu) = result?;
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
        rss_before,
        rss_peak,
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
    let pods: Arc<Vec<Pod>> = Arc::new(input.iter().map(handle).collect());
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

mod content {
    //! The content-volume benchmark: configMap, secret and projected volumes for N pods, then
    //! one ConfigMap update that every pod's volumes must show.

    use super::*;
    use kubevol::store::Object;

    const CONFIG_KEYS: usize = 10;
    const SECRET_KEYS: usize = 3;
    const VOLUMES: usize = 3;

    fn value(version: u32, key: usize) -> String {
        format!("value {version} of key {key}: {}", "x".repeat(64))
    }

    fn objects(version: u32) -> Vec<Object> {
        let data: serde_json::Map<String, serde_json::Value> = (0..CONFIG_KEYS)
            .map(|k| (format!("k{k}"), value(version, k).into()))
            .collect();
        let secret: serde_json::Map<String, serde_json::Value> = (0..SECRET_KEYS)
            .map(|k| (format!("s{k}"), format!("secret {k}").into()))
            .collect();
        vec![
            Object::ConfigMap(
                serde_json::from_value(serde_json::json!({"metadata": {"name": "config", "namespace": "bench"}, "data": data}))
                    .expect("valid ConfigMap"),
            ),
            Object::Secret(
                serde_json::from_value(serde_json::json!({"metadata": {"name": "secret", "namespace": "bench"}, "stringData": secret}))
                    .expect("valid Secret"),
            ),
        ]
    }

    fn pod(i: usize) -> Pod {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": format!("bench-{i}"), "namespace": "bench"},
            "spec": {
                "containers": [{"name": "c", "volumeMounts": [
                    {"name": "config", "mountPath": "/config"},
                    {"name": "secret", "mountPath": "/secret"},
                    {"name": "all", "mountPath": "/all"}]}],
                "volumes": [
                    {"name": "config", "configMap": {"name": "config"}},
                    {"name": "secret", "secret": {"secretName": "secret"}},
                    {"name": "all", "projected": {"sources": [
                        {"configMap": {"name": "config"}},
                        {"secret": {"name": "secret"}},
                        {"downwardAPI": {"items": [{"path": "name", "fieldRef": {"fieldPath": "metadata.name"}}]}}]}}],
            },
        }))
        .expect("benchmark pod is valid")
    }

    /// Writes one volume the way the atomic writer lays it out, with plain syscalls.
    fn raw_write(dir: &Path, version: u32, keys: &[(String, String)]) -> std::io::Result<()> {
        let ts = dir.join(format!("..v{version}"));
        std::fs::create_dir(&ts)?;
        for (k, v) in keys {
            std::fs::write(ts.join(k), v)?;
        }
        std::os::unix::fs::symlink(format!("..v{version}"), dir.join("..data_tmp"))?;
        std::fs::rename(dir.join("..data_tmp"), dir.join("..data"))?;
        if version == 1 {
            for (k, _) in keys {
                std::os::unix::fs::symlink(format!("..data/{k}"), dir.join(k))?;
            }
        } else {
            std::fs::remove_dir_all(dir.join(format!("..v{}", version - 1)))?;
        }
        Ok(())
    }

    fn keys(version: u32, name: &str) -> [Vec<(String, String)>; 3] {
        let config: Vec<(String, String)> = (0..CONFIG_KEYS)
            .map(|k| (format!("k{k}"), value(version, k)))
            .collect();
        let secret: Vec<(String, String)> = (0..SECRET_KEYS)
            .map(|k| (format!("s{k}"), format!("secret {k}")))
            .collect();
        let mut all = config.clone();
        all.extend(secret.clone());
        all.push(("name".into(), name.into()));
        [config, secret, all]
    }

    /// The floor: the same directories, tmpfs mounts, files and links, made directly; then the
    /// update of the configMap and projected volumes; then the tear-down.
    fn raw_floor(dir: &Path, pods: usize) -> anyhow::Result<(Duration, Duration)> {
        let m = LinuxMounter;
        let t0 = Instant::now();
        for i in 0..pods {
            let sets = keys(1, &format!("bench-{i}"));
            for (v, set) in sets.iter().enumerate() {
                let p = dir.join(format!("{i}-{v}"));
                std::fs::create_dir(&p)?;
                if v > 0 {
                    m.mount("tmpfs", &p, "tmpfs", &MountOptions::default())?;
                }
                raw_write(&p, 1, set)?;
            }
        }
        let set_up = t0.elapsed();
        let t1 = Instant::now();
        for i in 0..pods {
            let sets = keys(2, &format!("bench-{i}"));
            for v in [0, 2] {
                raw_write(&dir.join(format!("{i}-{v}")), 2, &sets[v])?;
            }
        }
        let update = t1.elapsed();
        for i in 0..pods {
            for v in 0..VOLUMES {
                let p = dir.join(format!("{i}-{v}"));
                if v > 0 {
                    m.unmount(&p)?;
                }
                std::fs::remove_dir_all(&p)?;
            }
        }
        Ok((set_up, update))
    }

    /// Waits until every watched volume directory shows the wanted value in its `k0`: an
    /// inotify watch per directory reports each rename onto `..data` (the atomic writer's
    /// publish), and only that directory is read then.
    struct UpdateWatch {
        inotify: std::os::fd::OwnedFd,
        dirs: std::collections::HashMap<i32, std::path::PathBuf>,
        want: String,
    }

    impl UpdateWatch {
        fn new(dirs: Vec<std::path::PathBuf>, want: String) -> anyhow::Result<Self> {
            use rustix::fs::inotify;
            let fd = inotify::init(inotify::CreateFlags::CLOEXEC).context("inotify_init1")?;
            let mut watched = std::collections::HashMap::with_capacity(dirs.len());
            for dir in dirs {
                let wd = inotify::add_watch(
                    &fd,
                    &dir,
                    inotify::WatchFlags::MOVED_TO | inotify::WatchFlags::ONLYDIR,
                )
                .with_context(|| format!("watching {}", dir.display()))?;
                watched.insert(wd, dir);
            }
            Ok(Self {
                inotify: fd,
                dirs: watched,
                want,
            })
        }

        /// The seconds from `start` at which each directory showed the value, sorted.
        fn wait(self, start: Instant) -> anyhow::Result<Vec<f64>> {
            use rustix::fs::inotify;
            let Self {
                inotify,
                mut dirs,
                want,
            } = self;
            let shows =
                |dir: &Path| std::fs::read_to_string(dir.join("k0")).is_ok_and(|s| s == want);
            let mut seen = Vec::with_capacity(dirs.len());
            let take_all = |dirs: &mut std::collections::HashMap<i32, std::path::PathBuf>,
                            seen: &mut Vec<f64>| {
                dirs.retain(|_, dir| {
                    let done = shows(dir);
                    if done {
                        seen.push(start.elapsed().as_secs_f64());
                    }
                    !done
                })
            };
            // A directory already written before its watch saw a rename shows it now.
            take_all(&mut dirs, &mut seen);
            let mut buf = vec![std::mem::MaybeUninit::<u8>::uninit(); 64 * 1024];
            let mut events = inotify::Reader::new(&inotify, &mut buf);
            while !dirs.is_empty() {
                let event = events.next().context("reading inotify events")?;
                if event.events().contains(inotify::ReadFlags::QUEUE_OVERFLOW) {
                    // Events were lost: look at every directory still waited for.
                    take_all(&mut dirs, &mut seen);
                } else if event.file_name().is_some_and(|n| n.to_bytes() == b"..data") {
                    let wd = event.wd();
                    if dirs.get(&wd).is_some_and(|dir| shows(dir)) {
                        dirs.remove(&wd);
                        seen.push(start.elapsed().as_secs_f64());
                    }
                }
            }
            seen.sort_by(|a, b| a.total_cmp(b));
            Ok(seen)
        }
    }

    pub(super) fn run(args: &BenchArgs) -> anyhow::Result<ExitCode> {
        let (tmp, floor_dir) = BenchRoot::new(args)?;
        let total = args.pods() * VOLUMES;
        println!(
            "kubevol bench --content: {} pods x (configMap {CONFIG_KEYS} keys, secret {SECRET_KEYS} keys, projected {} files) = {total} volumes",
            args.pods(),
            CONFIG_KEYS + SECRET_KEYS + 1
        );
        let (floor_setup_a, floor_update_a) =
            raw_floor(&floor_dir, args.pods()).context("raw floor")?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?;
        let root = tmp.path().join("root");
        let (lat, ready_elapsed, update_elapsed, update_lat) = runtime.block_on(async {
            let (manager, running) = start_manager(&root, args, |_| {})?;
            manager.library().upsert_objects(objects(1));
            let input: Vec<Pod> = (0..args.pods()).map(pod).collect();
            let pods: Arc<Vec<Pod>> = Arc::new(input.iter().map(handle).collect());
            let start = tokio::time::Instant::now();
            let (uids, latencies) = add_and_wait(&manager, input, &pods).await?;
            let ready_elapsed = start.elapsed();

            // One ConfigMap update; every pod's configMap and projected volume must show it.
            // Each volume's directory is watched for the rename that publishes a new `..data`,
            // so seeing the update costs nothing while kubevol writes (a polling loop would
            // take one of the machine's two cores from it).
            let dirs: Vec<std::path::PathBuf> = uids
                .iter()
                .flat_map(|u| {
                    let vols = manager.mounted_volumes_for_pod(u);
                    [vols["config"].path.clone(), vols["all"].path.clone()]
                })
                .collect();
            let updated = UpdateWatch::new(dirs, value(2, 0))?;
            let t = tokio::time::Instant::now();
            manager.library().upsert_objects(objects(2));
            let watching = tokio::task::spawn_blocking(move || updated.wait(t.into_std()));
            let update_lat = tokio::time::timeout(Duration::from_secs(600), watching)
                .await
                .context("update not seen in 600 s")???;
            let update_elapsed = Duration::from_secs_f64(update_lat.last().copied().unwrap_or(0.0));
            manager.remove_pods(&pods);
            manager.wait_for_all_pods_unmount(&pods).await?;
            manager.shutdown();
            let _ = running.await;
            anyhow::Ok((latencies, ready_elapsed, update_elapsed, update_lat))
        })?;
        let (floor_setup_b, floor_update_b) =
            raw_floor(&floor_dir, args.pods()).context("raw floor")?;
        let floor_setup = (floor_setup_a + floor_setup_b) / 2;
        let floor_update = (floor_update_a + floor_update_b) / 2;
        let ms = |d: f64| d * 1e3;
        println!();
        println!("pod ready latency (all pods added at once, 3 content volumes each):");
        println!(
            "  p50 {:.1} ms   p99 {:.1} ms   all ready after {:.1} ms (raw floor {:.1} ms, ratio {:.2})",
            ms(percentile(&lat, 0.5)),
            ms(percentile(&lat, 0.99)),
            ms(ready_elapsed.as_secs_f64()),
            ms(floor_setup.as_secs_f64()),
            floor_setup.as_secs_f64() / ready_elapsed.as_secs_f64()
        );
        println!("ConfigMap update, {} volumes rewritten:", args.pods() * 2);
        println!(
            "  p50 {:.1} ms   p99 {:.1} ms   all after {:.1} ms (raw floor {:.1} ms, ratio {:.2})",
            ms(percentile(&update_lat, 0.5)),
            ms(percentile(&update_lat, 0.99)),
            ms(update_elapsed.as_secs_f64()),
            ms(floor_update.as_secs_f64()),
            floor_update.as_secs_f64() / update_elapsed.as_secs_f64()
        );
        println!("(ratio = raw floor time / kubevol time; 1.0 is the floor)");
        println!("peak RSS: {:.1} MiB", peak_rss_mib());
        tmp.release()?;
        Ok(ExitCode::SUCCESS)
    }
}

mod csi {
    //! The CSI benchmark: pods added one after another, each with its own PersistentVolume of
    //! the kubevol-csi-loop driver. The driver logs the time it spent on each call, so each
    //! pod's ready latency splits into the driver's own work (the floor: attaching a loop
    //! device, formatting and mounting it, binding it) and kubevol's overhead (gRPC, bookkeeping,
    //! directories, vol_data.json, fsync).

    use std::collections::HashMap;
    use std::process::{Child, Command};

    use super::*;
    use kubevol::store::Object;

    const DRIVER: &str = "loop.csi.kubevol.io";

    /// The driver process; dropping it stops it and detaches its volumes' loop devices.
    struct Driver {
        child: Child,
        binary: std::path::PathBuf,
        data: std::path::PathBuf,
    }

    impl Drop for Driver {
        fn drop(&mut self) {
            let _ = Command::new("kill")
                .args(["-TERM", &self.child.id().to_string()])
                .status();
            let _ = self.child.wait();
            let _ = Command::new(&self.binary)
                .arg("--detach-all")
                .arg("--data-dir")
                .arg(&self.data)
                .status();
        }
    }

    fn objects(n: usize) -> Vec<Object> {
        let mut out = vec![Object::CSIDriver(
            serde_json::from_value(
                serde_json::json!({"metadata": {"name": DRIVER}, "spec": {"attachRequired": true}}),
            )
            .expect("valid CSIDriver"),
        )];
        for i in 0..n {
            let name = format!("bench-{i}");
            out.push(Object::PersistentVolume(
                serde_json::from_value(serde_json::json!({"metadata": {"name": name}, "spec": {
                    "capacity": {"storage": "16Mi"}, "accessModes": ["ReadWriteOnce"],
                    "claimRef": {"namespace": "bench", "name": name},
                    "csi": {"driver": DRIVER, "volumeHandle": name, "fsType": "ext4", "volumeAttributes": {"size": "16Mi"}}}}))
                .expect("valid PersistentVolume"),
            ));
            out.push(Object::PersistentVolumeClaim(
                serde_json::from_value(
                    serde_json::json!({"metadata": {"name": name, "namespace": "bench"},
                    "spec": {"accessModes": ["ReadWriteOnce"], "volumeName": name,
                             "resources": {"requests": {"storage": "16Mi"}}}}),
                )
                .expect("valid PersistentVolumeClaim"),
            ));
        }
        out
    }

    fn pod(i: usize) -> Pod {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": format!("bench-{i}"), "namespace": "bench"},
            "spec": {
                "containers": [{"name": "c", "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
                "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": format!("bench-{i}")}}],
            },
        }))
        .expect("benchmark pod is valid")
    }

    /// The driver's own time per (volume, method), from its call log, in seconds.
    fn driver_work(log: &Path) -> HashMap<(String, String), f64> {
        let mut out = HashMap::new();
        for line in std::fs::read_to_string(log).unwrap_or_default().lines() {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            if let (Some(m), Some(id), Some(ms)) = (
                v["method"].as_str(),
                v["volume_id"].as_str(),
                v["work_ms"].as_f64(),
            ) {
                *out.entry((id.to_string(), m.to_string())).or_insert(0.0) += ms / 1e3;
            }
        }
        out
    }

    pub(super) fn run(args: &BenchArgs) -> anyhow::Result<ExitCode> {
        let n = args.pods();
        let binary = std::env::current_exe()?.with_file_name("kubevol-csi-loop");
        anyhow::ensure!(
            binary.exists(),
            "{} is missing: build it with cargo build --release --bin kubevol-csi-loop",
            binary.display()
        );
        let (tmp, _) = BenchRoot::new(args)?;
        let base = tmp.path();
        let root = base.join("root");
        let socket = base.join("csi/csi.sock");
        let log = base.join("csi/calls.json");
        std::fs::create_dir_all(base.join("csi"))?;
        let child = Command::new(&binary)
            .arg("--endpoint")
            .arg(format!("unix://{}", socket.display()))
            .arg("--data-dir")
            .arg(base.join("csi-data"))
            .args(["--node-id", "bench-node"])
            .arg("--registration-dir")
            .arg(root.join("plugins_registry"))
            .arg("--call-log")
            .arg(&log)
            .stderr(std::process::Stdio::null())
            .spawn()
            .with_context(|| format!("start {}", binary.display()))?;
        let driver = Driver {
            child,
            binary: binary.clone(),
            data: base.join("csi-data"),
        };
        let registration = root
            .join("plugins_registry")
            .join(format!("{DRIVER}-reg.sock"));
        let t = Instant::now();
        while !registration.exists() {
            anyhow::ensure!(
                t.elapsed() < Duration::from_secs(10),
                "the driver did not start"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        println!("kubevol bench --csi: {n} pods, one after another, each with its own PersistentVolume of {DRIVER} (16Mi ext4 on a loop device)");
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?;
        let (latencies, teardown) = runtime.block_on(async {
            let (manager, running) = start_manager(&root, args, |c| {
                c.csi_controllers = vec![(DRIVER.into(), socket.clone())];
            })?;
            manager.library().upsert_objects(objects(n));
            let pods: Vec<Pod> = (0..n).map(pod).collect();
            let mut latencies = Vec::new();
            for p in &pods {
                let t = tokio::time::Instant::now();
                manager.add_pod(p.clone());
                manager.wait_for_attach_and_mount(p).await?;
                latencies.push(t.elapsed().as_secs_f64());
            }
            let t = tokio::time::Instant::now();
            manager.remove_pods(&pods);
            manager.wait_for_all_pods_unmount(&pods).await?;
            // Teardown ends with the detach of the last volume.
            while driver_work(&log)
                .keys()
                .filter(|(_, m)| m == "ControllerUnpublishVolume")
                .count()
                < n
            {
                anyhow::ensure!(
                    t.elapsed() < Duration::from_secs(600),
                    "volumes not detached"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let teardown = t.elapsed();
            manager.shutdown();
            let _ = running.await;
            anyhow::Ok((latencies, teardown))
        })?;
        let work = driver_work(&log);
        let sum = |id: &str, methods: &[&str]| -> f64 {
            methods
                .iter()
                .map(|m| {
                    work.get(&(id.to_string(), m.to_string()))
                        .copied()
                        .unwrap_or(0.0)
                })
                .sum()
        };
        let set_up = [
            "ControllerPublishVolume",
            "NodeStageVolume",
            "NodePublishVolume",
        ];
        let tear_down = [
            "NodeUnpublishVolume",
            "NodeUnstageVolume",
            "ControllerUnpublishVolume",
        ];
        let mut driver_s: Vec<f64> = (0..n)
            .map(|i| sum(&format!("bench-{i}"), &set_up))
            .collect();
        let mut overhead: Vec<f64> = latencies
            .iter()
            .zip(&driver_s)
            .map(|(l, d)| l - d)
            .collect();
        let total_latency: f64 = latencies.iter().sum();
        let total_driver: f64 = driver_s.iter().sum();
        let teardown_driver: f64 = (0..n).map(|i| sum(&format!("bench-{i}"), &tear_down)).sum();
        let mut lat = latencies.clone();
        for v in [&mut lat, &mut driver_s, &mut overhead] {
            v.sort_by(|a, b| a.total_cmp(b));
        }
        let ms = |v: &[f64], p: f64| percentile(v, p) * 1e3;
        println!();
        println!("pod ready latency (attach + stage + publish), per pod:");
        println!("                        p50        p99");
        println!(
            "  total            {:7.1} ms {:7.1} ms",
            ms(&lat, 0.5),
            ms(&lat, 0.99)
        );
        println!(
            "  driver's own     {:7.1} ms {:7.1} ms   (the floor: loop device, mkfs, mounts)",
            ms(&driver_s, 0.5),
            ms(&driver_s, 0.99)
        );
        println!(
            "  kubevol overhead {:7.1} ms {:7.1} ms   (gRPC, paths, vol_data.json, bookkeeping)",
            ms(&overhead, 0.5),
            ms(&overhead, 0.99)
        );
        println!(
            "set-up: driver {:.0} ms of {:.0} ms in all (ratio floor/kubevol {:.2})",
            total_driver * 1e3,
            total_latency * 1e3,
            total_driver / total_latency.max(1e-9)
        );
        println!(
            "tear-down of all {n} pods at once (unpublish, unstage, detach): {:.0} ms wall; driver's own work {:.0} ms summed over its calls, which run in parallel",
            teardown.as_secs_f64() * 1e3,
            teardown_driver * 1e3
        );
        println!("peak RSS: {:.1} MiB", peak_rss_mib());
        drop(driver);
        tmp.release()?;
        Ok(ExitCode::SUCCESS)
    }
}

mod cluster {
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
}
