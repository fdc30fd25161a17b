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
