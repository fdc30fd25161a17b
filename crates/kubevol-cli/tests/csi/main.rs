//! CSI volumes against the real kubevol-csi-loop driver over a unix socket, each test in its
//! own private mount namespace. The driver is a separate process; its call log (one JSON line
//! per RPC) is what the tests read to see which calls kubevol made.

#[macro_use]
#[path = "../../../kubevol/tests/common/mod.rs"]
mod common;
mod attach;
mod cluster;
mod containers;
mod health;
#[path = "../loop_driver/mod.rs"]
mod loop_driver;
mod migration;
mod secrets;
mod selinux;
mod sources;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use k8s_openapi::api::core::v1::Pod;
use kubevol::source::parse_manifest;
use kubevol::store::Object;
use kubevol::VolumeManager;
use kubevol_testserver::cluster::eventually;
use loop_driver::{Driver, DRIVER};
use serde_json::json;

/// Objects from JSON, read as the manifest directory reads them.
fn objects(items: serde_json::Value) -> Vec<Object> {
    let list = json!({"apiVersion": "v1", "kind": "List", "items": items});
    let (objects, errors) = parse_manifest(Path::new("objects.json"), &list.to_string());
    assert!(errors.is_empty(), "{errors:?}");
    objects.into_iter().map(|(_, o)| o).collect()
}

fn csi_driver(attach: bool) -> serde_json::Value {
    json!({"apiVersion": "storage.k8s.io/v1", "kind": "CSIDriver", "metadata": {"name": DRIVER}, "spec": {
        "attachRequired": attach, "podInfoOnMount": true, "fsGroupPolicy": "File",
        "volumeLifecycleModes": ["Persistent", "Ephemeral"]}})
}

fn pv(name: &str, size: &str, mode: &str) -> serde_json::Value {
    pv_fs(name, size, mode, "ext4")
}

fn pv_fs(name: &str, size: &str, mode: &str, fs: &str) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name}, "spec": {
        "capacity": {"storage": size}, "accessModes": ["ReadWriteOnce"], "volumeMode": mode,
        "claimRef": {"namespace": "default", "name": name},
        "csi": {"driver": DRIVER, "volumeHandle": name, "fsType": fs,
                "volumeAttributes": {"size": size}}}})
}

fn pvc(name: &str, mode: &str) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": "default"},
        "spec": {"accessModes": ["ReadWriteOnce"], "volumeMode": mode, "volumeName": name,
                 "resources": {"requests": {"storage": "1Mi"}}}})
}

/// A claim of `size` of StorageClass `class`, in the manifests' JSON.
fn class_claim(name: &str, class: &str, size: &str) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": "default"},
        "spec": {"storageClassName": class, "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}}})
}

/// Pod `name` with claim `claim` mounted at /data, in the manifests' JSON.
fn claim_pod_json(name: &str, claim: &str) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
        "spec": {"containers": [{"name": "c", "image": "busybox", "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
                 "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": claim}}]}})
}

/// `items` as a List.
fn list(items: Vec<serde_json::Value>) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "List", "items": items})
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
    /// Standalone provisioning by a CSI driver: a claim of a StorageClass whose provisioner is
    /// a driver given with --csi-controller gets a volume from CreateVolume (named
    /// `pvc-<claim UID>`, the claim's request, the class's parameters but the reserved ones,
    /// the node's topology), recorded as a PersistentVolume of the driver with the filesystem
    /// the class names and the topology the driver answered; it is attached, staged and
    /// published as any. The claim asks for more: the volume grows (ControllerExpandVolume,
    /// NodeExpandVolume, the filesystem too). Removed from the manifests, the claim's volume
    /// is unpublished, unstaged and detached, then deleted (DeleteVolume), and forgotten.
    fn a_claim_of_a_csi_class_gets_a_volume_from_create_volume_and_loses_it_with_delete_volume() {
        let t = TestRoot::new();
        let driver = Driver::start(&t.path().join("driver"), Some(&registry(t.path())), &[]);
        let manifests = t.manifests();
        let class = json!({"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": "loop"},
            "provisioner": DRIVER, "reclaimPolicy": "Delete", "volumeBindingMode": "WaitForFirstConsumer", "allowVolumeExpansion": true,
            "parameters": {"csi.storage.k8s.io/fstype": "xfs", "flavour": "plain"}});
        write_manifest(&manifests, "objects.json", &json!({"apiVersion": "v1", "kind": "List", "items": [csi_driver(true), class]}).to_string());
        let claim = list(vec![class_claim("data", "loop", "300Mi"), claim_pod_json("app", "data")]);
        write_manifest(&manifests, "claim.json", &claim.to_string());
        runtime().block_on(async {
            let m = csi_manager(t.path(), &t.path().join("driver"), Duration::from_secs(60));
            let _watch = kubevol::source::ManifestSource::new(&manifests).listen(m.store().sink(kubevol::source::ManifestSource::NAME)).await.unwrap();
            let app = claim_pod("app", "data");
            m.wait_for_attach_and_mount(&app).await.expect("created, attached, staged, published");
            assert_eq!(driver.count("CreateVolume", "Ok"), 1);
            let volume = m.status(false).bindings[0].volume.clone();
            assert!(volume.starts_with("pvc-"), "{volume}");
            let pv = m.store().persistent_volume(&volume).unwrap().object;
            let spec = pv.spec.clone().unwrap();
            let csi = spec.csi.clone().unwrap();
            assert_eq!((csi.driver.as_str(), csi.volume_handle.as_str(), csi.fs_type.as_deref()), (DRIVER, volume.as_str(), Some("xfs")));
            assert_eq!(spec.capacity.unwrap()["storage"].0, "314572800");
            let affinity = serde_json::to_value(&spec.node_affinity).unwrap();
            assert_eq!(affinity["required"]["nodeSelectorTerms"][0]["matchExpressions"][0]["key"], "topology.loop.csi.kubevol.io/node", "{affinity}");
            let created = driver.requests("CreateVolume");
            assert_eq!(created[0]["context"], json!({"flavour": "plain"}), "the class's parameters but the reserved ones: {created:?}");
            assert_eq!(created[0]["access_mode"], 1, "SINGLE_NODE_WRITER");
            std::fs::write(mount_path(&m, &app, "data").join("canary"), "yes").unwrap();

            // The claim asks for more.
            let size = |p: &Path| rustix::fs::statvfs(p).map(|s| s.f_blocks * s.f_frsize).unwrap();
            let before = size(&mount_path(&m, &app, "data"));
            write_manifest(&manifests, "claim.json", &claim.to_string().replace("300Mi", "600Mi"));
            wait_until("expanded on the node", 120, || driver.count("NodeExpandVolume", "Ok") == 1).await;
            assert_eq!(driver.count("ControllerExpandVolume", "Ok"), 1);
            assert_eq!(m.store().persistent_volume(&volume).unwrap().object.spec.clone().unwrap().capacity.unwrap()["storage"].0, "600Mi");
            let after = size(&mount_path(&m, &app, "data"));
            assert!(after > before + 200 * 1024 * 1024, "{before} -> {after}");
            assert_eq!(std::fs::read_to_string(mount_path(&m, &app, "data").join("canary")).unwrap(), "yes");

            std::fs::remove_file(manifests.join("claim.json")).unwrap();
            m.wait_for_unmount(&app).await.expect("torn down");
            wait_until("DeleteVolume", 120, || driver.count("DeleteVolume", "Ok") == 1).await;
            assert_eq!(driver.count("ControllerUnpublishVolume", "Ok"), 1, "detached first");
            wait_until("forgotten", 120, || m.store().persistent_volume(&volume).is_none() && m.status(false).bindings.is_empty()).await;
            m.shutdown();
        });
        drop(driver);
    }
}

mount_test! {
    /// A claim's volume: attached, staged once for two pods, published per pod; unstaged and
    /// detached after the last pod; its data survives the pods.
    fn persistent_volume_staged_once_published_per_pod_and_data_survives() {
        let t = TestRoot::new();
        let driver = Driver::start(&t.path().join("driver"), Some(&registry(t.path())), &[]);
        runtime().block_on(async {
            let m = csi_manager(t.path(), &t.path().join("driver"), Duration::from_secs(60));
            m.library().upsert_objects(objects(json!([csi_driver(true), pv("data", "32Mi", "Filesystem"), pvc("data", "Filesystem")])));
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
            wait_until("unstage and detach", 120, || driver.count("ControllerUnpublishVolume", "Ok") == 1).await;
            assert_eq!(driver.count("NodeUnstageVolume", "Ok"), 1);
            assert!(mounts_under(t.path()).is_empty(), "{:?}", mounts_under(t.path()));

            // The data outlives the pods: a new pod reads the canary back.
            let c = claim_pod("c", "data");
            m.add_pod(c.clone());
            m.wait_for_attach_and_mount(&c).await.unwrap();
            assert_eq!(std::fs::read(mount_path(&m, &c, "data").join("canary")).unwrap(), b"still here");
            let metrics = m.metrics_text();
            assert!(metrics.contains(r#"csi_operations_seconds_count{driver_name="loop.csi.kubevol.io",method_name="/csi.v1.Node/NodeStageVolume",grpc_status_code="OK",migrated="false"} 2"#), "{metrics}");
            wait_until("volume stats", 120, || m.metrics_text().contains(r#"kubelet_volume_stats_capacity_bytes{namespace="default",persistentvolumeclaim="data"}"#)).await;
            let drivers = m.csi_drivers();
            assert_eq!(drivers.len(), 1);
            assert_eq!(drivers[0].node_id, "test-node");
            assert!(drivers[0].capabilities.stage_unstage_volume && drivers[0].capabilities.expand_volume);
            m.remove_pod(&c);
            m.wait_for_unmount(&c).await.unwrap();
            wait_until("second detach", 120, || driver.count("ControllerUnpublishVolume", "Ok") == 2).await;
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
            m.library().upsert_objects(objects(json!([
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
            let handle = kubevol::plugins::csi::ephemeral_handle(&kubevol::pod_uid(&eph), "scratch");
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
            m.library().upsert_objects(objects(json!([pv_fs("grow", "600Mi", "Filesystem", "xfs")])));
            let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
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
            wait_until("detach", 120, || driver.count("ControllerUnpublishVolume", "Ok") == 2).await;
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
            m.library().upsert_objects(objects(json!([csi_driver(false), pv("slow", "16Mi", "Filesystem"), pvc("slow", "Filesystem")])));
            let p = claim_pod("p", "slow");
            m.add_pod(p.clone());
            // First the final stage error: reported, and nothing to unstage.
            wait_for_status(&m, &p, 120, |s| s.volumes[0].retry.last_error.as_deref().is_some_and(|e| e.contains("InvalidArgument"))).await;
            // Then the stage succeeds and the publish times out: uncertain.
            let s = wait_for_status(&m, &p, 120, |s| s.volumes[0].state == kubevol::status::VolumePhase::Uncertain).await;
            let e = s.volumes[0].retry.last_error.clone().unwrap();
            assert!(e.contains("DeadlineExceeded") && e.contains("NodePublishVolume"), "the publish is the call that timed out: {e}");
            assert_eq!(driver.count("NodeStageVolume", "Ok"), 1, "the stage had answered");
            assert_eq!(driver.count("NodeStageVolume", "InvalidArgument"), 1);
            assert_eq!(driver.count("NodeUnstageVolume", "Ok"), 0, "a final stage error is not unstaged");
            m.remove_pod(&p);
            m.wait_for_unmount(&p).await.unwrap();
            wait_until("unstage of the deleted pod's volume", 120, || driver.count("NodeUnstageVolume", "Ok") == 1).await;
            assert!(driver.count("NodeUnpublishVolume", "Ok") >= 1);
            assert_eq!(driver.count("ControllerPublishVolume", "Ok"), 0, "attachRequired: false");
            assert!(mounts_under(t.path()).is_empty(), "{:?}", mounts_under(t.path()));
            m.shutdown();
        });
    }
}

mount_test! {
    /// A driver killed (SIGKILL) in the middle of staging — the stage has begun and mounted, and
    /// not answered yet — and started again: kubevol retries, the pod gets its volume with one
    /// staging mount (the retry stacks none), and none is left after the teardown.
    fn driver_killed_mid_operation_and_restarted() {
        let t = TestRoot::new();
        let dir = t.path().join("driver");
        let mut driver = Driver::start(&dir, None, &["--delay", "NodeStageVolume:3000"]);
        runtime().block_on(async {
            let m = manager(t.path(), |c| {
                c.csi_drivers = vec![(DRIVER.into(), dir.join("csi.sock"))];
                c.csi_controllers = vec![(DRIVER.into(), dir.join("csi.sock"))];
            });
            m.library().upsert_objects(objects(json!([csi_driver(true), pv("k", "16Mi", "Filesystem"), pvc("k", "Filesystem")])));
            let p = claim_pod("p", "k");
            m.add_pod(p.clone());
            let staged = || mounts_under(t.path()).into_iter().filter(|(path, _, _)| path.ends_with("globalmount")).count();
            wait_until("the stage begun and mounted, not answered", 120, || driver.requests("NodeStageVolume").len() == 1 && staged() == 1).await;
            assert_eq!(driver.count("NodeStageVolume", "Ok"), 0, "killed before it answered");
            driver.kill();
            let s = wait_for_status(&m, &p, 120, |s| s.volumes[0].retry.last_error.is_some()).await;
            assert!(s.volumes[0].retry.last_error.as_deref().unwrap().contains("Unavailable") || s.volumes[0].retry.last_error.as_deref().unwrap().contains("Unknown"), "{s:#?}");
            driver.args.retain(|a| a != "--delay" && a != "NodeStageVolume:3000");
            driver.restart();
            m.wait_for_attach_and_mount(&p).await.unwrap();
            assert_eq!(staged(), 1, "one staging mount after the retry");
            m.remove_pod(&p);
            m.wait_for_unmount(&p).await.unwrap();
            wait_until("detach", 120, || driver.count("ControllerUnpublishVolume", "Ok") == 1).await;
            assert_eq!(staged(), 0, "no staging mount after the teardown");
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
            let old = Driver::start(&t.path().join("old"), Some(&reg), &["--driver-name", "old.csi.example.com", "--registration-versions", "0.3.0"]);
            wait_until("refusal notified", 120, || old.count("NotifyRegistrationStatus", "FailedPrecondition") == 1).await;
            let refusal = old.calls().into_iter().find(|c| c.0 == "NotifyRegistrationStatus").unwrap().2;
            assert!(refusal.contains("0.3.0") && refusal.contains("is supported"), "{refusal}");
            assert!(m.csi_drivers().is_empty());

            let mut good = Driver::start(&t.path().join("good"), Some(&reg), &[]);
            wait_until("registration", 120, || m.csi_drivers().len() == 1).await;
            // The plugin is told after kubevol has taken the driver: wait for that too.
            wait_until("the plugin told", 120, || good.count("NotifyRegistrationStatus", "Ok") == 1).await;
            assert_eq!(m.csi_drivers()[0].name, DRIVER);
            // The same name at another endpoint: refused at the same CSI version, as the
            // kubelet does, and taken at a higher one; both shown to the operator.
            let same = Driver::start(&t.path().join("same"), Some(&reg), &["--registration-socket", "same-reg.sock"]);
            wait_until("the same version refused", 120, || same.count("NotifyRegistrationStatus", "FailedPrecondition") == 1).await;
            let refusal = same.calls().into_iter().find(|c| c.0 == "NotifyRegistrationStatus").unwrap().2;
            assert!(refusal.contains("already registered at") && refusal.contains("higher or equal supported version: \"1.0.0\""), "{refusal}");
            let d = &m.csi_drivers()[0];
            assert!(d.endpoint.contains("/good/"), "the registered driver is kept: {d:?}");
            assert!(d.warnings.iter().any(|w| w.contains("/same/") && w.contains("was refused")), "{d:?}");
            let mut newer = Driver::start(&t.path().join("newer"), Some(&reg), &["--registration-socket", "newer-reg.sock", "--registration-versions", "1.0.0,1.1.0"]);
            wait_until("a higher version replaces it", 120, || m.csi_drivers().first().is_some_and(|d| d.endpoint.contains("/newer/"))).await;
            let d = &m.csi_drivers()[0];
            assert!(d.warnings.iter().any(|w| w.contains("/good/") && w.contains("/newer/") && w.contains("was replaced")), "{d:?}");
            newer.stop();
            wait_until("deregistration of the newer", 120, || m.csi_drivers().is_empty()).await;
            drop(same);
            good.stop();
            wait_until("deregistration", 120, || m.csi_drivers().is_empty()).await;
            good.restart();
            wait_until("registration again", 120, || m.csi_drivers().len() == 1).await;
            m.shutdown();
        });
    }
}

const SECRET_VALUE: &str = "TOPSECRET-VALUE";

mount_test! {
    /// What NodeStageVolume and NodePublishVolume carry: pod information (podInfoOnMount),
    /// secrets from Secret objects (never shown by kubevol), mount options, read-only; fsGroup
    /// applied under fsGroupPolicy File; vol_data.json beside the staging and publish paths, gone
    /// after teardown.
    fn requests_carry_pod_info_secrets_options_read_only_and_fs_group() {
        let t = TestRoot::new();
        let driver = Driver::start(
            &t.path().join("driver"),
            Some(&registry(t.path())),
            &["--inject", "NodePublishVolume:INTERNAL:1"],
        );
        runtime().block_on(async {
            let m = csi_manager(t.path(), &t.path().join("driver"), Duration::from_secs(60));
            let mut volume = pv("sec", "16Mi", "Filesystem");
            volume["spec"]["mountOptions"] = json!(["noatime"]);
            volume["spec"]["csi"]["nodePublishSecretRef"] = json!({"name": "creds", "namespace": "default"});
            volume["spec"]["csi"]["nodeStageSecretRef"] = json!({"name": "creds", "namespace": "default"});
            m.library().upsert_objects(objects(json!([csi_driver(true), volume, pvc("sec", "Filesystem")])));
            let mut p = claim_pod("writer", "sec");
            p.spec.as_mut().unwrap().security_context = Some(serde_json::from_value(json!({"fsGroup": 4321})).unwrap());
            m.add_pod(p.clone());
            // The Secret is missing: the error names it and says what to do (before the driver
            // registers, the error says that instead).
            let s = wait_for_status(&m, &p, 120, |s| s.volumes[0].retry.last_error.as_deref().is_some_and(|e| e.contains("Secret default/creds"))).await;
            let e = s.volumes[0].retry.last_error.clone().unwrap();
            assert!(e.contains("Secret default/creds") && e.contains("add it to the manifests") && e.contains("PersistentVolume sec"), "{e}");
            m.library().upsert_objects(objects(json!([{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "creds", "namespace": "default"}, "data": {"password": "VE9QU0VDUkVULVZBTFVF"}}])));
            // The first publish fails (injected), the next one succeeds.
            m.wait_for_attach_and_mount(&p).await.unwrap();
            assert_eq!(driver.count("NodePublishVolume", "Internal"), 1);

            let stage = &driver.requests("NodeStageVolume")[0];
            assert_eq!(stage["secret_keys"], json!(["password"]), "{stage}");
            assert_eq!(stage["mount_flags"], json!(["noatime"]), "{stage}");
            let publish = driver.requests("NodePublishVolume").pop().unwrap();
            let uid = kubevol::pod_uid(&p);
            let ctx = &publish["context"];
            assert_eq!(ctx["csi.storage.k8s.io/pod.name"], "writer", "{publish}");
            assert_eq!(ctx["csi.storage.k8s.io/pod.namespace"], "default");
            assert_eq!(ctx["csi.storage.k8s.io/pod.uid"], uid.to_string());
            assert_eq!(ctx["csi.storage.k8s.io/serviceAccount.name"], "default");
            assert_eq!(ctx["csi.storage.k8s.io/ephemeral"], "false");
            assert_eq!(ctx["size"], "16Mi", "volume attributes pass through");
            assert_eq!(publish["secret_keys"], json!(["password"]));
            assert_eq!(publish["readonly"], false);

            let path = mount_path(&m, &p, "data");
            use std::os::unix::fs::MetadataExt;
            assert_eq!(std::fs::metadata(&path).unwrap().gid(), 4321, "fsGroupPolicy File");
            let staged = t.path().join("root/plugins/kubernetes.io/csi").join(DRIVER);
            let stage_dir = std::fs::read_dir(&staged).unwrap().next().unwrap().unwrap().path();
            let data: serde_json::Value = serde_json::from_slice(&std::fs::read(stage_dir.join("vol_data.json")).unwrap()).unwrap();
            assert_eq!(data["volumeHandle"], "sec");

            // A second pod reads the claim read-only: published read-only, and it is.
            let mut reader = pod_with_volumes("reader", json!([{"name": "data", "persistentVolumeClaim": {"claimName": "sec", "readOnly": true}}]));
            reader.spec.as_mut().unwrap().containers[0].volume_mounts.as_mut().unwrap()[0].read_only = Some(true);
            m.add_pod(reader.clone());
            m.wait_for_attach_and_mount(&reader).await.unwrap();
            assert_eq!(driver.requests("NodePublishVolume").pop().unwrap()["readonly"], true);
            let rv = &m.mounted_volumes_for_pod(&kubevol::pod_uid(&reader))["data"];
            assert!(rv.read_only);
            let err = std::fs::write(rv.path.join("x"), b"x").unwrap_err();
            assert_eq!(err.raw_os_error(), Some(30), "EROFS: {err}");

            // kubevol never shows a secret's value: not in status, events, errors or metrics.
            let shown = format!("{}{}{}", serde_json::to_string(&m.status(true)).unwrap(), serde_json::to_string(&m.events()).unwrap(), m.metrics_text());
            assert!(shown.contains("injected fault"), "the failed publish is reported");
            assert!(!shown.contains(SECRET_VALUE));

            // A temporary vol_data.json left by a kill in the middle of its write goes with the
            // volume's directory.
            let data_dir = mount_path(&m, &p, "data");
            std::fs::write(data_dir.parent().unwrap().join(".vol_data.json.tmp"), "{").unwrap();
            for q in [&p, &reader] {
                m.remove_pod(q);
                m.wait_for_unmount(q).await.unwrap();
                let dir = t.path().join("root/pods").join(kubevol::pod_uid(q).as_str());
                wait_until("pod directory removal (vol_data.json gone)", 120, || !dir.exists()).await;
            }
            wait_until("detach", 120, || driver.count("ControllerUnpublishVolume", "Ok") == 1).await;
            assert!(!stage_dir.exists(), "the staging vol_data.json and its directory go after unstage");
            m.shutdown();
        });
    }
}

mount_test! {
    /// A volume that needs attaching without a controller endpoint waits with a message saying
    /// what to configure; the pod's other volume and other pods are not held up.
    fn attach_without_a_controller_waits_and_holds_nothing_else_up() {
        let t = TestRoot::new();
        let _driver = Driver::start(&t.path().join("driver"), Some(&registry(t.path())), &[]);
        runtime().block_on(async {
            let m = manager(t.path(), |_| {});
            m.library().upsert_objects(objects(json!([csi_driver(true), pv("att", "16Mi", "Filesystem"), pvc("att", "Filesystem")])));
            let p = pod_with_volumes("p", json!([
                {"name": "data", "persistentVolumeClaim": {"claimName": "att"}},
                {"name": "tmp", "emptyDir": {}},
            ]));
            m.add_pod(p.clone());
            let other = pod_with_volumes("other", json!([{"name": "tmp", "emptyDir": {}}]));
            m.add_pod(other.clone());
            m.wait_for_attach_and_mount(&other).await.unwrap();
            // Until the driver registers, the error says so; then it names what to configure.
            let s = wait_for_status(&m, &p, 120, |s| {
                s.volumes.iter().any(|v| v.retry.last_error.as_deref().is_some_and(|e| e.contains("--csi-controller")))
                    && s.volumes.iter().any(|v| v.state == kubevol::status::VolumePhase::Mounted)
            })
            .await;
            let data = s.volumes.iter().find(|v| v.name == "data").unwrap();
            let e = data.retry.last_error.as_deref().unwrap();
            assert!(e.contains("--csi-controller loop.csi.kubevol.io=unix://") && e.contains("pod default/p") && e.contains("attachRequired: false"), "{e}");
            assert!(e.contains("or there is no CSIDriver object loop.csi.kubevol.io)"), "the driver, not the volume handle: {e}");
            m.shutdown();
        });
    }
}

mount_test! {
/// The loop driver's controller service, called directly: idempotent, with the CSI spec's
/// codes.
fn loop_driver_controller_is_idempotent_with_spec_codes() {
    use kubevol_csi::v1::controller_client::ControllerClient;
    use kubevol_csi::v1::*;
    let t = TestRoot::new();
    let driver = Driver::start(&t.path().join("driver"), None, &[]);
    runtime().block_on(async {
        let mut c = ControllerClient::new(kubevol_csi::connect(&driver.socket()));
        let cap = VolumeCapability {
            access_type: Some(volume_capability::AccessType::Mount(volume_capability::MountVolume::default())),
            access_mode: Some(volume_capability::AccessMode { mode: volume_capability::access_mode::Mode::SingleNodeWriter as i32 }),
        };
        let create = |name: &str, bytes: i64| CreateVolumeRequest {
            name: name.into(),
            capacity_range: Some(CapacityRange { required_bytes: bytes, limit_bytes: 0 }),
            volume_capabilities: vec![cap.clone()],
            ..Default::default()
        };
        let a = c.create_volume(create("vol-a", 8 << 20)).await.unwrap().into_inner().volume.unwrap();
        let again = c.create_volume(create("vol-a", 8 << 20)).await.unwrap().into_inner().volume.unwrap();
        assert_eq!((a.volume_id.as_str(), a.capacity_bytes), ("vol-a", 8 << 20));
        assert_eq!((again.volume_id, again.capacity_bytes), (a.volume_id.clone(), a.capacity_bytes));
        assert!(driver.image("vol-a").exists());
        let bigger = c.create_volume(create("vol-a", 16 << 20)).await.unwrap_err();
        assert_eq!(bigger.code(), tonic::Code::AlreadyExists, "{bigger:?}");
        assert_eq!(c.create_volume(create("", 1)).await.unwrap_err().code(), tonic::Code::InvalidArgument);
        let validate = |id: &str, mode: volume_capability::access_mode::Mode| ValidateVolumeCapabilitiesRequest {
            volume_id: id.into(),
            volume_capabilities: vec![VolumeCapability { access_mode: Some(volume_capability::AccessMode { mode: mode as i32 }), ..cap.clone() }],
            ..Default::default()
        };
        use volume_capability::access_mode::Mode;
        assert!(c.validate_volume_capabilities(validate("vol-a", Mode::SingleNodeWriter)).await.unwrap().into_inner().confirmed.is_some());
        assert!(c.validate_volume_capabilities(validate("vol-a", Mode::MultiNodeMultiWriter)).await.unwrap().into_inner().confirmed.is_none());
        assert_eq!(c.validate_volume_capabilities(validate("nope", Mode::SingleNodeWriter)).await.unwrap_err().code(), tonic::Code::NotFound);

        let publish = |node: &str| ControllerPublishVolumeRequest {
            volume_id: "vol-a".into(),
            node_id: node.into(),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        };
        assert_eq!(c.controller_publish_volume(publish("elsewhere")).await.unwrap_err().code(), tonic::Code::NotFound);
        let first = c.controller_publish_volume(publish("test-node")).await.unwrap().into_inner().publish_context;
        let second = c.controller_publish_volume(publish("test-node")).await.unwrap().into_inner().publish_context;
        assert!(first["devicePath"].starts_with("/dev/loop"));
        assert_eq!(first, second, "publishing twice attaches once");
        let in_use = c.delete_volume(DeleteVolumeRequest { volume_id: "vol-a".into(), ..Default::default() }).await.unwrap_err();
        assert_eq!(in_use.code(), tonic::Code::FailedPrecondition, "{in_use:?}");
        let unpublish = ControllerUnpublishVolumeRequest { volume_id: "vol-a".into(), node_id: "test-node".into(), ..Default::default() };
        c.controller_unpublish_volume(unpublish.clone()).await.unwrap();
        c.controller_unpublish_volume(unpublish).await.unwrap();
        let delete = DeleteVolumeRequest { volume_id: "vol-a".into(), ..Default::default() };
        c.delete_volume(delete.clone()).await.unwrap();
        c.delete_volume(delete).await.unwrap();
        assert!(!driver.image("vol-a").exists());
        let bad_id = c.controller_publish_volume(ControllerPublishVolumeRequest { volume_id: "../x".into(), ..publish("test-node") }).await.unwrap_err();
        assert_eq!(bad_id.code(), tonic::Code::NotFound);
    });
}
}

mount_test! {
    /// Each non-final code (DeadlineExceeded, Unavailable, Canceled, ResourceExhausted,
    /// Aborted) from NodePublishVolume leaves the volume uncertain; the pod deleted meanwhile
    /// still gets NodeUnpublishVolume, NodeUnstageVolume and the detach.
    fn every_non_final_code_leaves_the_volume_uncertain_and_still_torn_down() {
        let t = TestRoot::new();
        runtime().block_on(async {
            for (code, shown) in [
                ("DEADLINE_EXCEEDED", "DeadlineExceeded"),
                ("UNAVAILABLE", "Unavailable"),
                ("CANCELLED", "Canceled"),
                ("RESOURCE_EXHAUSTED", "ResourceExhausted"),
                ("ABORTED", "Aborted"),
            ] {
                let base = t.path().join(code);
                let inject = format!("NodePublishVolume:{code}");
                let driver = Driver::start(&base.join("driver"), Some(&registry(&base)), &["--inject", &inject]);
                let m = csi_manager(&base, &base.join("driver"), Duration::from_secs(60));
                m.library().upsert_objects(objects(json!([csi_driver(true), pv("v", "16Mi", "Filesystem"), pvc("v", "Filesystem")])));
                let p = claim_pod("p", "v");
                m.add_pod(p.clone());
                let s = wait_for_status(&m, &p, 120, |s| s.volumes[0].state == kubevol::status::VolumePhase::Uncertain).await;
                let e = s.volumes[0].retry.last_error.clone().unwrap_or_default();
                assert!(e.contains(shown), "{code}: {e}");
                m.remove_pod(&p);
                m.wait_for_unmount(&p).await.unwrap();
                wait_until("detach after the uncertain publish", 120, || driver.count("ControllerUnpublishVolume", "Ok") == 1).await;
                assert!(driver.count("NodeUnpublishVolume", "Ok") >= 1, "{code}");
                assert_eq!(driver.count("NodeUnstageVolume", "Ok"), 1, "{code}");
                assert!(mounts_under(&base).is_empty(), "{code}: {:?}", mounts_under(&base));
                m.shutdown();
            }
        });
    }
}

mount_test! {
    /// An attach that timed out may have attached the volume: when its pod goes away,
    /// ControllerUnpublishVolume is still called.
    fn an_uncertain_attach_is_detached_when_the_pod_goes() {
        let t = TestRoot::new();
        let driver = Driver::start(
            &t.path().join("driver"),
            Some(&registry(t.path())),
            &["--inject", "ControllerPublishVolume:DEADLINE_EXCEEDED"],
        );
        runtime().block_on(async {
            let m = csi_manager(t.path(), &t.path().join("driver"), Duration::from_secs(60));
            m.library().upsert_objects(objects(json!([csi_driver(true), pv("u", "16Mi", "Filesystem"), pvc("u", "Filesystem")])));
            let p = claim_pod("p", "u");
            m.add_pod(p.clone());
            let s = wait_for_status(&m, &p, 120, |s| s.volumes[0].retry.last_error.as_deref().is_some_and(|e| e.contains("DeadlineExceeded"))).await;
            let e = s.volumes[0].retry.last_error.clone().unwrap();
            assert!(e.contains("DeadlineExceeded") && e.contains("pod default/p"), "{e}");
            m.remove_pod(&p);
            m.wait_for_unmount(&p).await.unwrap();
            wait_until("detach of the uncertain attach", 120, || driver.count("ControllerUnpublishVolume", "Ok") == 1).await;
            assert_eq!(driver.count("NodeStageVolume", "Ok"), 0);
            m.shutdown();
        });
    }
}

mount_test! {
    /// A driver that answers NodeUnpublishVolume with OK but leaves its mount: kubevol says
    /// exactly that, never removes the mounted directory, and tries again.
    fn a_driver_that_claims_an_unpublish_but_leaves_its_mount_is_named() {
        let t = TestRoot::new();
        let driver = Driver::start(
            &t.path().join("driver"),
            Some(&registry(t.path())),
            &["--inject", "NodeUnpublishVolume:OK:1"],
        );
        runtime().block_on(async {
            let socket = t.path().join("driver/csi.sock");
            let m = manager(t.path(), |c| c.csi_controllers = vec![(DRIVER.into(), socket)]);
            // The failure is read from the warnings as they are sent (the status holds it only
            // until the retry, which a loaded machine may run before the test looks).
            let (warnings, mut warned) = tokio::sync::mpsc::channel(64);
            m.set_event_sink(warnings);
            m.library().upsert_objects(objects(json!([csi_driver(false), pv("left", "16Mi", "Filesystem"), pvc("left", "Filesystem")])));
            let p = claim_pod("p", "left");
            m.add_pod(p.clone());
            m.wait_for_attach_and_mount(&p).await.expect("mounted");
            m.remove_pod(&p);
            let e = loop {
                let w = tokio::time::timeout(Duration::from_secs(120), warned.recv()).await.expect("a warning within 120 s").expect("the sink is open");
                if w.reason == "FailedUnMount" {
                    break w.message;
                }
            };
            assert!(
                e.contains("answered NodeUnpublishVolume with OK but") && e.contains("is still mounted: the driver claims success but left its mount"),
                "{e}"
            );
            m.wait_for_unmount(&p).await.expect("the retry unpublishes");
            assert_eq!(driver.count("NodeUnpublishVolume", "Ok"), 2, "the claimed one and the real one");
            wait_until("unstage", 120, || driver.count("NodeUnstageVolume", "Ok") == 1).await;
            assert!(mounts_under(t.path()).is_empty(), "{:?}", mounts_under(t.path()));
            m.shutdown();
        });
    }
}

mount_test! {
    /// What the kubelet sends for a PersistentVolume: the first access mode (ReadWriteOnce before
    /// ReadWriteMany is SINGLE_NODE_WRITER for a driver without SINGLE_NODE_MULTI_WRITER), the
    /// volume's `spec.csi.readOnly` to ControllerPublishVolume only, and the claim volume's
    /// `readOnly` to NodePublishVolume.
    fn the_access_mode_and_read_only_flags_are_sent_as_the_kubelet_sends_them() {
        let t = TestRoot::new();
        let driver = Driver::start(&t.path().join("driver"), Some(&registry(t.path())), &[]);
        runtime().block_on(async {
            let m = csi_manager(t.path(), &t.path().join("driver"), Duration::from_secs(60));
            let mut volume = pv("shared", "16Mi", "Filesystem");
            volume["spec"]["accessModes"] = json!(["ReadWriteOnce", "ReadWriteMany"]);
            volume["spec"]["csi"]["readOnly"] = json!(true);
            m.library().upsert_objects(objects(json!([csi_driver(true), volume, pvc("shared", "Filesystem")])));
            let p = claim_pod("p", "shared");
            m.add_pod(p.clone());
            m.wait_for_attach_and_mount(&p).await.unwrap();
            let attach = driver.requests("ControllerPublishVolume").pop().unwrap();
            let publish = driver.requests("NodePublishVolume").pop().unwrap();
            assert_eq!(attach["readonly"], true, "{attach}");
            assert_eq!(publish["readonly"], false, "{publish}");
            let single_node_writer = kubevol_csi::v1::volume_capability::access_mode::Mode::SingleNodeWriter as i32;
            assert_eq!(publish["access_mode"], json!(single_node_writer), "{publish}");
            assert_eq!(attach["access_mode"], json!(single_node_writer), "{attach}");
            m.remove_pod(&p);
            m.wait_for_unmount(&p).await.unwrap();
            m.shutdown();
        });
    }
}

/// The CSIDriver of the loop driver for inline volumes, asking for a service account token of
/// `audience` and to be republished; the tokens in the secrets when `in_secrets`.
fn token_driver(audience: &str, in_secrets: bool) -> serde_json::Value {
    json!({"apiVersion": "storage.k8s.io/v1", "kind": "CSIDriver", "metadata": {"name": DRIVER}, "spec": {
        "attachRequired": false, "podInfoOnMount": true, "volumeLifecycleModes": ["Ephemeral"],
        "tokenRequests": [{"audience": audience, "expirationSeconds": 600}],
        "requiresRepublish": true, "serviceAccountTokenInSecrets": in_secrets}})
}

/// A pod with one inline volume of the loop driver.
fn inline_pod(name: &str) -> Pod {
    pod_with_volumes(
        name,
        json!([{"name": "data", "csi": {"driver": DRIVER, "volumeAttributes": {"size": "16Mi"}}}]),
    )
}

mount_test! {
    /// Standalone mode has no API server to issue the tokens a CSIDriver's tokenRequests ask
    /// for: the volume fails for good with a message that says so, and nothing is published.
    fn csi_tokens_without_an_api_server_are_refused_for_good() {
        let t = TestRoot::new();
        let driver = Driver::start(&t.path().join("driver"), Some(&registry(t.path())), &[]);
        runtime().block_on(async {
            let m = csi_manager(t.path(), &t.path().join("driver"), Duration::from_secs(60));
            m.library().upsert_objects(objects(json!([token_driver("vault", false)])));
            let p = inline_pod("app");
            m.add_pod(p.clone());
            let s = wait_for_status(&m, &p, 120, |s| s.volumes[0].retry.permanent).await;
            let e = s.volumes[0].retry.last_error.clone().unwrap();
            assert!(e.contains(&format!("CSIDriver {DRIVER} asks for service account tokens (spec.tokenRequests), which only a Kubernetes API server issues")), "{e}");
            assert!(driver.requests("NodePublishVolume").is_empty(), "nothing published");
            m.shutdown();
        });
    }
}

mount_test! {
    /// `describe` of a CSI volume whose stage keeps failing: attached, stuck at the stage with
    /// the driver's error, and the set-up never tried.
    fn describe_names_the_stage_a_csi_volume_is_stuck_at() {
        let t = TestRoot::new();
        let _driver = Driver::start(&t.path().join("driver"), Some(&registry(t.path())), &["--inject", "NodeStageVolume:INTERNAL"]);
        runtime().block_on(async {
            let m = csi_manager(t.path(), &t.path().join("driver"), Duration::from_secs(60));
            m.library().upsert_objects(objects(json!([csi_driver(true), pv("stuck", "16Mi", "Filesystem"), pvc("stuck", "Filesystem")])));
            let p = claim_pod("p", "stuck");
            m.add_pod(p.clone());
            wait_for_status(&m, &p, 120, |s| s.volumes.first().is_some_and(|v| v.retry.last_error.as_deref().is_some_and(|e| e.contains("NodeStageVolume")))).await;
            let d = m.describe_pod(&kubevol::pod_uid(&p)).unwrap();
            use kubevol::describe::StepState::{Done, Failed, Waiting};
            let states: Vec<(String, kubevol::describe::StepState)> = d.chains[0].steps.iter().map(|s| (s.step.clone(), s.state)).collect();
            assert!(states.contains(&("attach".into(), Done)) && states.contains(&("stage".into(), Failed)), "{states:?}");
            assert!(states.contains(&("set up".into(), Waiting)), "{states:?}");
            let why = d.chains[0].waiting_for.clone().unwrap();
            assert!(why.starts_with("stage: ") && why.contains("NodeStageVolume"), "{why}");
            m.shutdown();
        });
    }
}
