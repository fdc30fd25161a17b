//! CSI volumes against the real kubevol-csi-loop driver over a unix socket, each test in its
//! own private mount namespace. The driver is a separate process; its call log (one JSON line
//! per RPC) is what the tests read to see which calls kubevol made.

#[macro_use]
#[path = "../../kubevol/tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use common::*;
use k8s_openapi::api::core::v1::Pod;
use kubevol::store::Object;
use kubevol::VolumeManager;
use serde_json::json;

const DRIVER: &str = "loop.csi.kubevol.io";

fn driver_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_kubevol-csi-loop"))
}

/// A running kubevol-csi-loop. Dropping it kills it and detaches its volumes' loop devices.
struct Driver {
    child: Option<Child>,
    dir: PathBuf,
    args: Vec<String>,
}

impl Driver {
    /// Starts the driver with its socket and data under `dir`, registering through
    /// `registry` when given.
    fn start(dir: &Path, registry: Option<&Path>, extra: &[&str]) -> Driver {
        std::fs::create_dir_all(dir).unwrap();
        let mut args = vec![
            "--endpoint".to_string(),
            format!("unix://{}", dir.join("csi.sock").display()),
            "--data-dir".into(),
            dir.join("data").display().to_string(),
            "--node-id".into(),
            "test-node".into(),
            "--call-log".into(),
            dir.join("calls.json").display().to_string(),
        ];
        if let Some(r) = registry {
            args.push("--registration-dir".into());
            args.push(r.display().to_string());
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut d = Driver {
            child: None,
            dir: dir.to_path_buf(),
            args,
        };
        d.restart();
        d
    }

    fn restart(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("driver.log"))
            .unwrap();
        let _ = std::fs::remove_file(self.socket());
        self.child = Some(
            Command::new(driver_binary())
                .args(&self.args)
                .stderr(log)
                .spawn()
                .expect("start kubevol-csi-loop"),
        );
        for _ in 0..200 {
            if self.socket().exists() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("the driver did not listen on {}", self.socket().display());
    }

    fn socket(&self) -> PathBuf {
        self.dir.join("csi.sock")
    }

    /// SIGKILL: nothing is cleaned up, as when a driver crashes.
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM: the driver removes its sockets and exits.
    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &c.id().to_string()])
                .status();
            let _ = c.wait();
        }
    }

    /// The calls the driver has answered: (method, volume, path, code).
    fn calls(&self) -> Vec<(String, String, String, String)> {
        std::fs::read_to_string(self.dir.join("calls.json"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .map(|v| {
                let s = |k: &str| v[k].as_str().unwrap_or_default().to_string();
                (s("method"), s("volume_id"), s("path"), s("code"))
            })
            .collect()
    }

    fn count(&self, method: &str, code: &str) -> usize {
        self.calls()
            .iter()
            .filter(|c| c.0 == method && c.3 == code)
            .count()
    }

    fn image(&self, id: &str) -> PathBuf {
        self.dir.join("data/volumes").join(format!("{id}.img"))
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        self.kill();
        for img in std::fs::read_dir(self.dir.join("data/volumes"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let out = Command::new("losetup")
                .arg("--associated")
                .arg(img.path())
                .output();
            for line in out
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default()
                .lines()
            {
                if let Some(dev) = line.split(':').next() {
                    let _ = Command::new("losetup").args(["--detach", dev]).status();
                }
            }
        }
    }
}

fn objects(v: serde_json::Value) -> Vec<Object> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|o| match o["kind"].as_str().unwrap() {
            "PersistentVolume" => {
                Object::PersistentVolume(serde_json::from_value(o.clone()).unwrap())
            }
            "PersistentVolumeClaim" => {
                Object::PersistentVolumeClaim(serde_json::from_value(o.clone()).unwrap())
            }
            "CSIDriver" => Object::CSIDriver(serde_json::from_value(o.clone()).unwrap()),
            k => panic!("kind {k}"),
        })
        .collect()
}

fn csi_driver(attach: bool) -> serde_json::Value {
    json!({"kind": "CSIDriver", "metadata": {"name": DRIVER}, "spec": {
        "attachRequired": attach, "podInfoOnMount": true, "fsGroupPolicy": "File",
        "volumeLifecycleModes": ["Persistent", "Ephemeral"]}})
}

fn pv(name: &str, size: &str, mode: &str) -> serde_json::Value {
    pv_fs(name, size, mode, "ext4")
}

fn pv_fs(name: &str, size: &str, mode: &str, fs: &str) -> serde_json::Value {
    json!({"kind": "PersistentVolume", "metadata": {"name": name}, "spec": {
        "capacity": {"storage": size}, "accessModes": ["ReadWriteOnce"], "volumeMode": mode,
        "claimRef": {"namespace": "default", "name": name},
        "csi": {"driver": DRIVER, "volumeHandle": name, "fsType": fs,
                "volumeAttributes": {"size": size}}}})
}

fn pvc(name: &str, mode: &str) -> serde_json::Value {
    json!({"kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": "default"},
        "spec": {"accessModes": ["ReadWriteOnce"], "volumeMode": mode, "volumeName": name,
                 "resources": {"requests": {"storage": "1Mi"}}}})
}

fn claim_pod(name: &str, claim: &str) -> Pod {
    pod_with_volumes(
        name,
        json!([{"name": "data", "persistentVolumeClaim": {"claimName": claim}}]),
    )
}

/// A manager whose root holds the registry the driver registers through, with the driver as
/// its controller too.
fn csi_manager(root: &Path, driver_dir: &Path, timeout: Duration) -> VolumeManager {
    let socket = driver_dir.join("csi.sock");
    manager(root, |c| {
        c.csi_controllers = vec![(DRIVER.into(), socket)];
        c.csi_timeout = timeout;
        c.volume_stats_period = Duration::from_millis(200);
    })
}

fn registry(root: &Path) -> PathBuf {
    root.join("root/plugins_registry")
}

async fn wait_until(what: &str, secs: u64, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn mount_path(m: &VolumeManager, pod: &Pod, volume: &str) -> PathBuf {
    m.mounted_volumes_for_pod(&kubevol::pod_uid(pod))[volume]
        .path
        .clone()
}

mount_test! {
    /// A claim's volume: attached, staged once for two pods, published per pod; unstaged and
    /// detached after the last pod; its data survives the pods.
    fn persistent_volume_staged_once_published_per_pod_and_data_survives() {
        let t = TestRoot::new();
        let driver = Driver::start(&t.path().join("driver"), Some(&registry(t.path())), &[]);
        runtime().block_on(async {
            let m = csi_manager(t.path(), &t.path().join("driver"), Duration::from_secs(60));
            m.store().upsert_objects(objects(json!([csi_driver(true), pv("data", "32Mi", "Filesystem"), pvc("data", "Filesystem")])));
            let a = claim_pod("a", "data");
            m.add_pod(a.clone());
            m.wait_for_attach_and_mount(&a).await.unwrap();
            let path = mount_path(&m, &a, "data");
            assert!(path.ends_with("volumes/kubernetes.io~csi/data/mount"), "{}", path.display());
            let vol_data: serde_json::Value = serde_json::from_slice(&std::fs::read(path.parent().unwrap().join("vol_data.json")).unwrap()).unwrap();
            assert_eq!(vol_data["driverName"], DRIVER);
            assert_eq!(vol_data["volumeHandle"], "data");
            assert_eq!(vol_data["volumeLifecycleMode"], "Persistent");
            std::fs::write(path.join("canary"), b"still here").unwrap();

            let b = claim_pod("b", "data");
            m.add_pod(b.clone());
            m.wait_for_attach_and_mount(&b).await.unwrap();
            assert_eq!(std::fs::read(mount_path(&m, &b, "data").join("canary")).unwrap(), b"still here");
            assert_eq!(driver.count("ControllerPublishVolume", "Ok"), 1);
            assert_eq!(driver.count("NodeStageVolume", "Ok"), 1);
            assert_eq!(driver.count("NodePublishVolume", "Ok"), 2);

            m.remove_pod(&a);
            m.wait_for_unmount(&a).await.unwrap();
            assert_eq!(driver.count("NodeUnpublishVolume", "Ok"), 1);
            assert_eq!(driver.count("NodeUnstageVolume", "Ok"), 0, "b still uses the volume");
            m.remove_pod(&b);
            m.wait_for_unmount(&b).await.unwrap();
            wait_until("unstage and detach", 20, || driver.count("ControllerUnpublishVolume", "Ok") == 1).await;
            assert_eq!(driver.count("NodeUnstageVolume", "Ok"), 1);
            assert!(mounts_under(t.path()).is_empty(), "{:?}", mounts_under(t.path()));

            // The data outlives the pods: a new pod reads the canary back.
            let c = claim_pod("c", "data");
            m.add_pod(c.clone());
            m.wait_for_attach_and_mount(&c).await.unwrap();
            assert_eq!(std::fs::read(mount_path(&m, &c, "data").join("canary")).unwrap(), b"still here");
            let metrics = m.metrics_text();
            assert!(metrics.contains(r#"csi_operations_seconds_count{driver_name="loop.csi.kubevol.io",method_name="/csi.v1.Node/NodeStageVolume",grpc_status_code="OK",migrated="false"} 2"#), "{metrics}");
            wait_until("volume stats", 20, || m.metrics_text().contains(r#"kubelet_volume_stats_capacity_bytes{namespace="default",persistentvolumeclaim="data"}"#)).await;
            let drivers = m.csi_drivers();
            assert_eq!(drivers.len(), 1);
            assert_eq!(drivers[0].node_id, "test-node");
            assert!(drivers[0].capabilities.stage_unstage_volume && drivers[0].capabilities.expand_volume);
            m.remove_pod(&c);
            m.wait_for_unmount(&c).await.unwrap();
            wait_until("second detach", 20, || driver.count("ControllerUnpublishVolume", "Ok") == 2).await;
            m.shutdown();
        });
    }
}

mount_test! {
    /// Inline ephemeral volumes are made on publish and deleted on unpublish; a Block claim is
    /// handed to the runtime as a device; a grown capacity reaches NodeExpandVolume.
    fn ephemeral_block_and_expansion() {
        let t = TestRoot::new();
        let driver = Driver::start(&t.path().join("driver"), Some(&registry(t.path())), &[]);
        runtime().block_on(async {
            let m = csi_manager(t.path(), &t.path().join("driver"), Duration::from_secs(60));
            m.store().upsert_objects(objects(json!([
                csi_driver(true),
                pv("raw", "16Mi", "Block"), pvc("raw", "Block"),
                // XFS: growing it online needs CAP_SYS_ADMIN only (ext4 also needs
                // CAP_SYS_RESOURCE, which containers often drop); 300Mi is its minimum.
                pv_fs("grow", "300Mi", "Filesystem", "xfs"), pvc("grow", "Filesystem"),
            ])));
            let eph = pod_with_volumes("eph", json!([{"name": "scratch", "csi": {"driver": DRIVER, "volumeAttributes": {"size": "20Mi"}}}]));
            m.add_pod(eph.clone());
            m.wait_for_attach_and_mount(&eph).await.unwrap();
            let path = mount_path(&m, &eph, "scratch");
            std::fs::write(path.join("f"), b"x").unwrap();
            let handle = kubevol::csi::ephemeral_handle(&kubevol::pod_uid(&eph), "scratch");
            assert!(driver.image(&handle).exists());
            m.remove_pod(&eph);
            m.wait_for_unmount(&eph).await.unwrap();
            assert!(!driver.image(&handle).exists(), "an ephemeral volume goes with its pod");

            let block = pod(json!({"metadata": {"name": "blk", "namespace": "default"}, "spec": {
                "containers": [{"name": "c", "image": "busybox", "volumeDevices": [{"name": "raw", "devicePath": "/dev/xvda"}]}],
                "volumes": [{"name": "raw", "persistentVolumeClaim": {"claimName": "raw"}}]}}));
            m.add_pod(block.clone());
            m.wait_for_attach_and_mount(&block).await.unwrap();
            let dev = mount_path(&m, &block, "raw");
            use std::os::unix::fs::FileTypeExt;
            assert!(std::fs::metadata(&dev).unwrap().file_type().is_block_device(), "{}", dev.display());
            assert!(dev.starts_with(t.path().join("root/plugins/kubernetes.io/csi/volumeDevices/publish/raw")));
            m.remove_pod(&block);
            m.wait_for_unmount(&block).await.unwrap();

            let g = claim_pod("g", "grow");
            m.add_pod(g.clone());
            m.wait_for_attach_and_mount(&g).await.unwrap();
            let gp = mount_path(&m, &g, "data");
            let size = |p: &Path| { let s = rustix::fs::statvfs(p).unwrap(); s.f_blocks * s.f_frsize };
            let before = size(&gp);
            m.store().upsert_objects(objects(json!([pv_fs("grow", "600Mi", "Filesystem", "xfs")])));
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            while driver.count("NodeExpandVolume", "Ok") != 1 {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "no NodeExpandVolume; calls {:?}; status {:#?}",
                    driver.calls(),
                    m.pod_status(&kubevol::pod_uid(&g))
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert!(size(&gp) > before + (200 << 20), "{} -> {}", before, size(&gp));
            m.remove_pod(&g);
            m.wait_for_unmount(&g).await.unwrap();
            wait_until("detach", 20, || driver.count("ControllerUnpublishVolume", "Ok") == 2).await;
            assert!(mounts_under(t.path()).is_empty(), "{:?}", mounts_under(t.path()));
            m.shutdown();
        });
    }
}

mount_test! {
    /// A publish that outlives kubevol's timeout (DeadlineExceeded, non-final) leaves the volume
    /// uncertain, and the pod deleted meanwhile still gets NodeUnpublishVolume and
    /// NodeUnstageVolume. A final error on stage is not followed by an unstage.
    fn non_final_errors_leave_the_volume_uncertain_and_final_ones_do_not() {
        let t = TestRoot::new();
        let driver = Driver::start(
            &t.path().join("driver"),
            Some(&registry(t.path())),
            &["--delay", "NodePublishVolume:1500", "--inject", "NodeStageVolume:INVALID_ARGUMENT:1"],
        );
        runtime().block_on(async {
            let m = csi_manager(t.path(), &t.path().join("driver"), Duration::from_millis(500));
            m.store().upsert_objects(objects(json!([csi_driver(false), pv("slow", "16Mi", "Filesystem"), pvc("slow", "Filesystem")])));
            let p = claim_pod("p", "slow");
            m.add_pod(p.clone());
            // First the final stage error: reported, and nothing to unstage.
            wait_for_status(&m, &p, 20, |s| s.volumes[0].retry.last_error.as_deref().is_some_and(|e| e.contains("InvalidArgument"))).await;
            // Then the stage succeeds and the publish times out: uncertain.
            let s = wait_for_status(&m, &p, 20, |s| s.volumes[0].state == kubevol::status::VolumePhase::Uncertain).await;
            assert!(s.volumes[0].retry.last_error.as_deref().unwrap().contains("DeadlineExceeded"), "{s:#?}");
            assert_eq!(driver.count("NodeStageVolume", "InvalidArgument"), 1);
            assert_eq!(driver.count("NodeUnstageVolume", "Ok"), 0, "a final stage error is not unstaged");
            m.remove_pod(&p);
            m.wait_for_unmount(&p).await.unwrap();
            wait_until("unstage of the deleted pod's volume", 20, || driver.count("NodeUnstageVolume", "Ok") == 1).await;
            assert!(driver.count("NodeUnpublishVolume", "Ok") >= 1);
            assert_eq!(driver.count("ControllerPublishVolume", "Ok"), 0, "attachRequired: false");
            assert!(mounts_under(t.path()).is_empty(), "{:?}", mounts_under(t.path()));
            m.shutdown();
        });
    }
}

mount_test! {
    /// A driver killed (SIGKILL) in the middle of staging and started again: kubevol retries
    /// and the pod gets its volume.
    fn driver_killed_mid_operation_and_restarted() {
        let t = TestRoot::new();
        let dir = t.path().join("driver");
        let mut driver = Driver::start(&dir, None, &["--delay", "NodeStageVolume:3000"]);
        runtime().block_on(async {
            let m = manager(t.path(), |c| {
                c.csi_drivers = vec![(DRIVER.into(), dir.join("csi.sock"))];
                c.csi_controllers = vec![(DRIVER.into(), dir.join("csi.sock"))];
            });
            m.store().upsert_objects(objects(json!([csi_driver(true), pv("k", "16Mi", "Filesystem"), pvc("k", "Filesystem")])));
            let p = claim_pod("p", "k");
            m.add_pod(p.clone());
            wait_until("stage in progress", 20, || driver.count("ControllerPublishVolume", "Ok") == 1).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
            driver.kill();
            let s = wait_for_status(&m, &p, 20, |s| s.volumes[0].retry.last_error.is_some()).await;
            assert!(s.volumes[0].retry.last_error.as_deref().unwrap().contains("Unavailable") || s.volumes[0].retry.last_error.as_deref().unwrap().contains("Unknown"), "{s:#?}");
            driver.args.retain(|a| a != "--delay" && a != "NodeStageVolume:3000");
            driver.restart();
            m.wait_for_attach_and_mount(&p).await.unwrap();
            m.remove_pod(&p);
            m.wait_for_unmount(&p).await.unwrap();
            wait_until("detach", 20, || driver.count("ControllerUnpublishVolume", "Ok") == 1).await;
            m.shutdown();
        });
    }
}

mount_test! {
    /// Registration through plugins_registry: a plugin offering no CSI version kubevol speaks
    /// is refused (and told why); a good one is registered, deregistered when its socket goes
    /// away, and registered again when it comes back.
    fn registration_refused_accepted_and_withdrawn() {
        let t = TestRoot::new();
        let reg = registry(t.path());
        std::fs::create_dir_all(&reg).unwrap();
        runtime().block_on(async {
            let m = manager(t.path(), |_| {});
            tokio::time::sleep(Duration::from_millis(100)).await;
            let old = Driver::start(&t.path().join("old"), Some(&reg), &["--driver-name", "old.csi.example.com", "--registration-versions", "0.3.0"]);
            wait_until("refusal notified", 20, || old.count("NotifyRegistrationStatus", "FailedPrecondition") == 1).await;
            let refusal = old.calls().into_iter().find(|c| c.0 == "NotifyRegistrationStatus").unwrap().2;
            assert!(refusal.contains("0.3.0") && refusal.contains("is supported"), "{refusal}");
            assert!(m.csi_drivers().is_empty());

            let mut good = Driver::start(&t.path().join("good"), Some(&reg), &[]);
            wait_until("registration", 20, || m.csi_drivers().len() == 1).await;
            assert_eq!(good.count("NotifyRegistrationStatus", "Ok"), 1);
            assert_eq!(m.csi_drivers()[0].name, DRIVER);
            good.stop();
            wait_until("deregistration", 20, || m.csi_drivers().is_empty()).await;
            good.restart();
            wait_until("registration again", 20, || m.csi_drivers().len() == 1).await;
            m.shutdown();
        });
    }
}
