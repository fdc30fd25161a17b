//! Claims and PersistentVolumes in standalone mode, mounted for real: hostPath and local
//! volumes, block volumes, generic ephemeral volumes, kubevol's binder and its local-path
//! provisioner, and the documentation's claim examples.

use crate::common::{self, *};
use kubevol::source::ManifestSource;
use kubevol::status::VolumePhase;
use serde_json::json;

mount_test! {
    fn a_claim_bound_to_a_host_path_persistent_volume_is_the_host_path_with_its_type_checks() {
        let root = TestRoot::new();
        let data = root.path().join("host/pv-data");
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            let objects: Vec<kubevol::store::Object> = vec![
                kubevol::store::Object::PersistentVolume(serde_json::from_value(json!({
                    "metadata": {"name": "task-pv-volume"},
                    "spec": {"storageClassName": "manual", "capacity": {"storage": "10Gi"}, "accessModes": ["ReadWriteOnce"],
                             "hostPath": {"path": data, "type": "DirectoryOrCreate"},
                             "claimRef": {"namespace": "default", "name": "task-pv-claim"}}
                })).unwrap()),
                kubevol::store::Object::PersistentVolumeClaim(serde_json::from_value(json!({
                    "metadata": {"name": "task-pv-claim", "namespace": "default"},
                    "spec": {"storageClassName": "manual", "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "3Gi"}}, "volumeName": "task-pv-volume"},
                    "status": {"phase": "Bound"}
                })).unwrap()),
                kubevol::store::Object::PersistentVolume(serde_json::from_value(json!({
                    "metadata": {"name": "block-pv"},
                    "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"], "volumeMode": "Block",
                             "hostPath": {"path": "/dev/null"}, "claimRef": {"namespace": "default", "name": "block-claim"}}
                })).unwrap()),
                kubevol::store::Object::PersistentVolumeClaim(serde_json::from_value(json!({
                    "metadata": {"name": "block-claim", "namespace": "default"},
                    "spec": {"accessModes": ["ReadWriteOnce"], "volumeMode": "Block", "volumeName": "block-pv", "resources": {"requests": {"storage": "1Gi"}}},
                    "status": {"phase": "Bound"}
                })).unwrap()),
            ];
            assert!(m.library().upsert_objects(objects).is_empty());
            let p = pod_with_volumes("task-pv-pod", json!([{"name": "task-pv-storage", "persistentVolumeClaim": {"claimName": "task-pv-claim"}}]));
            let uid = m.add_pod(p.clone());
            m.wait_for_attach_and_mount(&p).await.expect("mounted through the claim");
            let v = &m.mounted_volumes_for_pod(&uid)["task-pv-storage"];
            assert_eq!(v.path, data, "the host path itself");
            assert!(data.is_dir(), "DirectoryOrCreate made it");
            std::fs::write(data.join("index.html"), "hello").unwrap();
            let s = m.pod_status(&uid).unwrap();
            assert_eq!(s.volumes[0].type_, "hostPath");

            // A block use of it is refused with a reason.
            let mut block = pod_with_volumes("block", json!([{"name": "raw", "persistentVolumeClaim": {"claimName": "block-claim"}}]));
            let c = &mut block.spec.as_mut().unwrap().containers[0];
            c.volume_mounts = None;
            c.volume_devices = Some(vec![serde_json::from_value(json!({"name": "raw", "devicePath": "/dev/raw"})).unwrap()]);
            let buid = m.add_pod(block.clone());
            let s = wait_for_status(&m, &block, 120, |s| s.volumes.iter().any(|v| v.retry.last_error.is_some())).await;
            let e = s.volumes[0].retry.last_error.clone().unwrap();
            assert!(e.contains("PersistentVolume block-pv is a hostPath volume, which cannot be used as a raw block device"), "{e}");
            assert!(m.mounted_volumes_for_pod(&buid).is_empty());

            m.remove_pods(&[p.clone(), block.clone()]);
            m.wait_for_all_pods_unmount(&[p, block]).await.expect("torn down");
            assert_eq!(std::fs::read_to_string(data.join("index.html")).unwrap(), "hello", "host data kept");
            m.shutdown();
        });
    }
}

mount_test! {
    /// fsGroup on a local volume of 10,000 files (a setuid one among them): every entry gets
    /// the group and the bits, the setuid bit is kept, and a walk longer than the warning's
    /// threshold (0 here, 30 s by default) posts the kubelet's VolumePermissionChangeInProgress
    /// naming OnRootMismatch. A second pod with `Always` finds everything right and changes
    /// nothing (no entry's ctime moves); one with `OnRootMismatch` does not walk at all.
    fn a_long_fs_group_walk_warns_its_pod_and_a_second_one_changes_nothing() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let root = TestRoot::new();
        let disk = root.path().join("host/disk");
        for d in 0..10 {
            std::fs::create_dir_all(disk.join(format!("d{d}"))).unwrap();
            for f in 0..999 {
                std::fs::write(disk.join(format!("d{d}/f{f}")), "").unwrap();
            }
        }
        let setuid = disk.join("d3/f7");
        std::fs::set_permissions(&setuid, std::fs::Permissions::from_mode(0o4755)).unwrap();
        let host = root.path().join("host");
        runtime().block_on(async {
            let m = manager(root.path(), |c| {
                c.host_path_allow = vec![host.clone()];
                c.fs_group_warning_after = std::time::Duration::ZERO;
            });
            let here = affinity(json!([{"key": "kubernetes.io/hostname", "operator": "In", "values": ["test-node"]}]));
            let mut objects = Vec::new();
            for n in ["one", "two", "three"] {
                objects.extend(bound_pair(&format!("{n}-pv"), &format!("{n}-claim"), "Filesystem", json!({"local": {"path": disk}, "nodeAffinity": here})));
            }
            assert!(m.library().upsert_objects(objects).is_empty());
            let pod = |name: &str, claim: &str, policy: &str| {
                let mut p = pod_with_volumes(name, json!([{"name": "data", "persistentVolumeClaim": {"claimName": claim}}]));
                p.spec.as_mut().unwrap().security_context = Some(serde_json::from_value(json!({"fsGroup": 2000, "fsGroupChangePolicy": policy})).unwrap());
                p
            };
            let warned = |m: &kubevol::VolumeManager, uid: &kubevol_core::PodUid| {
                m.events().into_iter().filter(|e| &e.uid == uid && e.reason == "VolumePermissionChangeInProgress").map(|e| e.message.to_string()).collect::<Vec<_>>()
            };

            let first = pod("first", "one-claim", "Always");
            let uid = m.add_pod(first.clone());
            m.wait_for_attach_and_mount(&first).await.expect("mounted");
            let events = warned(&m, &uid);
            assert!(events.len() == 1 && events[0].contains("is taking longer than expected, consider using OnRootMismatch") && events[0].contains(&format!("{uid}/volumes/kubernetes.io~local-volume/one-pv")), "{events:?}");
            for d in 0..10 {
                let dir = std::fs::metadata(disk.join(format!("d{d}"))).unwrap();
                assert_eq!((dir.gid(), dir.mode() & 0o2770), (2000, 0o2770), "d{d}");
                for f in [0, 500, 998] {
                    let file = std::fs::metadata(disk.join(format!("d{d}/f{f}"))).unwrap();
                    assert_eq!((file.gid(), file.mode() & 0o660), (2000, 0o660), "d{d}/f{f}");
                }
            }
            assert_eq!(std::fs::metadata(&setuid).unwrap().mode() & 0o7777, 0o4775, "set-user-ID given back after the chown");
            let ctimes = |dir: &std::path::Path| -> Vec<(i64, i64)> {
                (0..10).flat_map(|d| (0..999).map(move |f| (d, f))).map(|(d, f)| {
                    let m = std::fs::metadata(dir.join(format!("d{d}/f{f}"))).unwrap();
                    (m.ctime(), m.ctime_nsec())
                }).collect()
            };
            let before = ctimes(&disk);

            let second = pod("second", "two-claim", "Always");
            let uid2 = m.add_pod(second.clone());
            m.wait_for_attach_and_mount(&second).await.expect("mounted");
            assert_eq!(ctimes(&disk), before, "everything was right: nothing changed");
            assert_eq!(warned(&m, &uid2).len(), 1, "walked (Always), and told");

            let third = pod("third", "three-claim", "OnRootMismatch");
            let uid3 = m.add_pod(third.clone());
            m.wait_for_attach_and_mount(&third).await.expect("mounted");
            assert!(warned(&m, &uid3).is_empty(), "the root matches: no walk");
            m.remove_pods(&[first.clone(), second.clone(), third.clone()]);
            m.wait_for_all_pods_unmount(&[first, second, third]).await.expect("torn down");
            m.shutdown();
        });
    }
}

mount_test! {
    /// A generic ephemeral volume uses the claim `<pod>-<volume>` only if the pod controls it
    /// (the kubelet's "was not created for pod" check): a claim that merely has the name is
    /// never mounted, and a claim of the manifests may name its owner pod by kind and name
    /// when the pod has no UID of its own. Where nothing defines the claim, kubevol makes it
    /// from the template, as the ephemeral-volume controller would, and it gets a volume of
    /// the default class; both go with the pod.
    fn a_generic_ephemeral_volume_uses_only_the_claim_made_for_its_pod() {
        let root = TestRoot::new();
        let (mine, theirs) = (root.path().join("host/mine"), root.path().join("host/theirs"));
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            let template = json!({"volumeClaimTemplate": {"spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}});
            let p = pod_with_volumes("app", json!([
                {"name": "scratch", "ephemeral": template},
                {"name": "other", "ephemeral": template},
                {"name": "later", "ephemeral": template}]));
            let uid = kubevol::pod_uid(&p);
            let claim = |name: &str, pv: &str, owner: serde_json::Value| kubevol::store::Object::PersistentVolumeClaim(serde_json::from_value(json!({
                "metadata": {"name": name, "namespace": "default", "ownerReferences": owner},
                "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}, "volumeName": pv},
                "status": {"phase": "Bound"}})).unwrap());
            let volume = |name: &str, path: &std::path::Path, claim: &str| kubevol::store::Object::PersistentVolume(serde_json::from_value(json!({
                "metadata": {"name": name},
                "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"], "hostPath": {"path": path, "type": "DirectoryOrCreate"},
                         "claimRef": {"namespace": "default", "name": claim}}})).unwrap());
            let objects = vec![
                volume("pv-mine", &mine, "app-scratch"),
                claim("app-scratch", "pv-mine", json!([{"apiVersion": "v1", "kind": "Pod", "name": "app", "uid": uid.as_str(), "controller": true}])),
                volume("pv-theirs", &theirs, "app-other"),
                // The name alone, or an owner that does not control it, is not enough.
                claim("app-other", "pv-theirs", json!([{"apiVersion": "v1", "kind": "Pod", "name": "app", "uid": uid.as_str()}])),
            ];
            assert!(m.library().upsert_objects(objects).is_empty());
            m.add_pod(p.clone());
            let error = |s: &kubevol::status::PodStatus, name: &str| s.volumes.iter().find(|v| v.name == name).and_then(|v| v.retry.last_error.clone()).unwrap_or_default();
            let mounted = |s: &kubevol::status::PodStatus, name: &str| s.volumes.iter().any(|v| v.name == name && v.state == VolumePhase::Mounted);
            let s = wait_for_status(&m, &p, 120, |s| !error(s, "other").is_empty() && mounted(s, "later") && mounted(s, "scratch")).await;
            assert!(error(&s, "other").contains("PVC default/app-other was not created for pod default/app (pod is not owner)"), "{s:#?}");
            let made = m.store().persistent_volume_claim("default", "app-later").expect("the claim made from the template");
            assert_eq!(made.origin, kubevol::store::Origin::Provisioned);
            let owner = &made.object.metadata.owner_references.as_ref().unwrap()[0];
            assert_eq!((owner.kind.as_str(), owner.uid.as_str(), owner.controller), ("Pod", uid.as_str(), Some(true)));
            let later = m.status(false).bindings.iter().find(|b| b.claim == "default/app-later").map(|b| b.volume.clone()).expect("bound");
            let later_dir = root.path().join("root/local-path").join(format!("{later}_default_app-later"));
            assert!(later_dir.is_dir(), "provisioned: {}", later_dir.display());
            assert_eq!(m.mounted_volumes_for_pod(&uid)["scratch"].path, mine);
            assert!(!theirs.exists(), "nothing was made for the claim that is not the pod's");
            assert!(m.events().iter().any(|e| e.reason == "FailedMount" && e.message.contains("app-other was not created for pod")), "a FailedMount event");

            // The pod's own claim, naming its owner by kind and name (a pod of the manifests
            // has no UID the author knows): mounted.
            assert!(m.library().upsert_objects(vec![claim("app-other", "pv-theirs", json!([{"apiVersion": "v1", "kind": "Pod", "name": "app", "controller": true}]))]).is_empty());
            wait_for_status(&m, &p, 120, |s| s.volumes.iter().any(|v| v.name == "other" && v.state == VolumePhase::Mounted)).await;
            assert_eq!(m.mounted_volumes_for_pod(&uid)["other"].path, theirs);

            m.remove_pods(std::slice::from_ref(&p));
            m.wait_for_all_pods_unmount(&[p]).await.expect("torn down");
            // The claim made for it goes with it, and its volume by the class's policy; the
            // claims of the library stay.
            until_announced(&m, 120, "the made claim and its volume gone", || m.store().persistent_volume_claim("default", "app-later").is_none() && !later_dir.exists()).await;
            assert!(m.store().persistent_volume_claim("default", "app-scratch").is_some());
            assert!(mine.exists());
            m.shutdown();
        });
    }
}

/// A PersistentVolume and a claim bound to it, both in `default`.
fn bound_pair(
    pv: &str,
    claim: &str,
    mode: &str,
    pv_spec: serde_json::Value,
) -> Vec<kubevol::store::Object> {
    let mut spec = json!({"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"], "volumeMode": mode,
                          "claimRef": {"namespace": "default", "name": claim}});
    spec.as_object_mut()
        .unwrap()
        .extend(pv_spec.as_object().unwrap().clone());
    vec![
        kubevol::store::Object::PersistentVolume(
            serde_json::from_value(json!({"metadata": {"name": pv}, "spec": spec})).unwrap(),
        ),
        kubevol::store::Object::PersistentVolumeClaim(
            serde_json::from_value(json!({
                "metadata": {"name": claim, "namespace": "default"},
                "spec": {"accessModes": ["ReadWriteOnce"], "volumeMode": mode, "volumeName": pv, "resources": {"requests": {"storage": "1Gi"}}},
            }))
            .unwrap(),
        ),
    ]
}

/// `nodeAffinity.required` with one term of the given match expressions.
fn affinity(expressions: serde_json::Value) -> serde_json::Value {
    json!({"required": {"nodeSelectorTerms": [{"matchExpressions": expressions}]}})
}

mount_test! {
    fn a_local_persistent_volume_is_bind_mounted_where_its_node_affinity_matches() {
        let root = TestRoot::new();
        let disk = root.path().join("host/local-disk");
        std::fs::create_dir_all(&disk).unwrap();
        std::fs::write(disk.join("canary"), "keep").unwrap();
        let outside = root.path().join("elsewhere/disk");
        std::fs::create_dir_all(&outside).unwrap();
        let host = root.path().join("host");
        runtime().block_on(async {
            let m = manager(root.path(), |c| {
                c.node_labels.insert("disk".into(), "ssd".into());
                c.host_path_allow = vec![host.clone()];
            });
            let here = affinity(json!([
                {"key": "kubernetes.io/hostname", "operator": "In", "values": ["test-node"]},
                {"key": "disk", "operator": "In", "values": ["ssd"]}]));
            let mut objects = bound_pair("local-pv", "local-claim", "Filesystem", json!({"local": {"path": disk}, "nodeAffinity": here}));
            objects.extend(bound_pair("ro-pv", "ro-claim", "Filesystem", json!({"local": {"path": disk}, "nodeAffinity": here})));
            objects.extend(bound_pair("far-pv", "far-claim", "Filesystem", json!({"local": {"path": disk},
                "nodeAffinity": affinity(json!([{"key": "kubernetes.io/hostname", "operator": "In", "values": ["node-b"]}]))})));
            objects.extend(bound_pair("loose-pv", "loose-claim", "Filesystem", json!({"local": {"path": disk}})));
            objects.extend(bound_pair("gone-pv", "gone-claim", "Filesystem", json!({"local": {"path": host.join("not-yet")}, "nodeAffinity": here})));
            objects.extend(bound_pair("out-pv", "out-claim", "Filesystem", json!({"local": {"path": outside}, "nodeAffinity": here})));
            // The volume without node affinity is kept, and refused as the API server refuses it.
            let problems = m.library().upsert_objects(objects);
            assert!(problems.len() == 1 && problems[0].contains("PersistentVolume loose-pv is invalid") && problems[0].contains("Local volume requires node affinity"), "{problems:?}");

            let mut p = pod_with_volumes("app", json!([{"name": "data", "persistentVolumeClaim": {"claimName": "local-claim"}}]));
            p.spec.as_mut().unwrap().security_context = Some(serde_json::from_value(json!({"fsGroup": 2000})).unwrap());
            let uid = m.add_pod(p.clone());
            m.wait_for_attach_and_mount(&p).await.expect("mounted");
            let v = &m.mounted_volumes_for_pod(&uid)["data"];
            let want = m.config().root_dir.join(format!("pods/{uid}/volumes/kubernetes.io~local-volume/local-pv"));
            assert_eq!(v.path, want, "the kubelet's path, named after the PersistentVolume");
            assert!(!v.read_only);
            assert_eq!(mounts_under(&want).len(), 1, "one bind mount");
            assert_eq!(std::fs::read_to_string(want.join("canary")).unwrap(), "keep", "the disk's content");
            std::fs::write(want.join("written"), "by the pod").unwrap();
            assert_eq!(std::fs::read_to_string(disk.join("written")).unwrap(), "by the pod", "the same directory");
            use std::os::unix::fs::MetadataExt;
            assert_eq!(std::fs::metadata(&want).unwrap().gid(), 2000, "fsGroup applied");
            assert_eq!(m.pod_status(&uid).unwrap().volumes[0].type_, "local");

            let mut ro = pod_with_volumes("reader", json!([{"name": "data", "persistentVolumeClaim": {"claimName": "ro-claim", "readOnly": true}}]));
            ro.spec.as_mut().unwrap().containers[0].volume_mounts.as_mut().unwrap()[0].read_only = Some(true);
            let ro_uid = m.add_pod(ro.clone());
            m.wait_for_attach_and_mount(&ro).await.expect("mounted read-only");
            let rv = &m.mounted_volumes_for_pod(&ro_uid)["data"];
            assert!(rv.read_only);
            let err = std::fs::write(rv.path.join("nope"), "x").unwrap_err();
            assert_eq!(err.raw_os_error(), Some(30), "EROFS expected, got {err}");
            std::fs::write(want.join("still"), "writable").expect("the other pod's mount stays writable");

            let rows = [
                ("far", "far-claim", "PersistentVolume far-pv is on other nodes: its spec.nodeAffinity requires (kubernetes.io/hostname in (node-b)), and node test-node (labels: disk=ssd, kubernetes.io/arch="),
                ("loose", "loose-claim", "spec.nodeAffinity: Required value: Local volume requires node affinity"),
                ("gone", "gone-claim", "does not exist on this node"),
                ("out", "out-claim", "which is outside the allowed host paths"),
            ];
            let mut bad = Vec::new();
            for (name, claim, _) in rows {
                bad.push(pod_with_volumes(name, json!([{"name": "data", "persistentVolumeClaim": {"claimName": claim}}])));
                m.add_pod(bad.last().unwrap().clone());
            }
            for ((name, _, want), p) in rows.iter().zip(&bad) {
                let s = wait_for_status(&m, p, 120, |s| s.volumes.iter().any(|v| v.retry.last_error.is_some())).await;
                let e = s.volumes[0].retry.last_error.clone().unwrap();
                assert!(e.contains(want), "row {name}: {e}");
                assert!(matches!(s.volumes[0].state, VolumePhase::Failed | VolumePhase::Retrying), "row {name}: an error of the volume, not an unsupported type: {:?}", s.volumes[0].state);
                assert!(m.mounted_volumes_for_pod(&kubevol::pod_uid(p)).is_empty(), "row {name}");
            }
            assert_eq!(mounts_under(&m.config().root_dir).len(), 2, "only the two good pods' mounts");

            // The missing path appears: the volume is retried and mounted.
            std::fs::create_dir(host.join("not-yet")).unwrap();
            m.wait_for_attach_and_mount(&bad[2]).await.expect("mounted once the path exists");

            let all: Vec<_> = [p.clone(), ro.clone()].into_iter().chain(bad).collect();
            m.remove_pods(&all);
            m.wait_for_all_pods_unmount(&all).await.expect("torn down");
            assert!(mounts_under(&m.config().root_dir).is_empty(), "nothing left mounted");
            assert!(!want.exists(), "mount point removed");
            for (f, text) in [("canary", "keep"), ("written", "by the pod"), ("still", "writable")] {
                assert_eq!(std::fs::read_to_string(disk.join(f)).unwrap(), text, "the volume's data is kept");
            }
            m.shutdown();
        });
    }
}

/// A loop device over a file of `root`, detached when dropped.
struct LoopDevice(std::path::PathBuf);

impl LoopDevice {
    fn new(root: &std::path::Path) -> Self {
        let file = root.join("disk.img");
        std::fs::File::create(&file)
            .unwrap()
            .set_len(4 << 20)
            .unwrap();
        let out = std::process::Command::new("losetup")
            .args(["--find", "--show"])
            .arg(&file)
            .output()
            .expect("losetup");
        assert!(
            out.status.success(),
            "losetup: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        LoopDevice(String::from_utf8(out.stdout).unwrap().trim().into())
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = std::process::Command::new("losetup")
            .arg("-d")
            .arg(&self.0)
            .status();
    }
}

mount_test! {
    fn a_local_block_persistent_volume_is_mapped_as_the_kubelet_maps_it() {
        let root = TestRoot::new();
        let dev = LoopDevice::new(root.path());
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            let here = affinity(json!([{"key": "kubernetes.io/hostname", "operator": "In", "values": ["test-node"]}]));
            let mut objects = bound_pair("raw-pv", "raw-claim", "Block", json!({"local": {"path": dev.0}, "nodeAffinity": here}));
            objects.extend(bound_pair("dir-pv", "dir-claim", "Block", json!({"local": {"path": root.path()}, "nodeAffinity": here})));
            assert!(m.library().upsert_objects(objects).is_empty());
            let device_pod = |name: &str, claim: &str| {
                let mut p = pod_with_volumes(name, json!([{"name": "raw", "persistentVolumeClaim": {"claimName": claim}}]));
                let c = &mut p.spec.as_mut().unwrap().containers[0];
                c.volume_mounts = None;
                c.volume_devices = Some(vec![serde_json::from_value(json!({"name": "raw", "devicePath": "/dev/xvda"})).unwrap()]);
                p
            };
            let p = device_pod("db", "raw-claim");
            let uid = m.add_pod(p.clone());
            m.wait_for_attach_and_mount(&p).await.expect("mapped");
            let rootd = m.config().root_dir.clone();
            let file = rootd.join(format!("plugins/kubernetes.io/local-volume/volumeDevices/raw-pv/{uid}"));
            let link = rootd.join(format!("pods/{uid}/volumeDevices/kubernetes.io~local-volume/raw-pv"));
            assert_eq!(m.mounted_volumes_for_pod(&uid)["raw"].path, file, "the runtime gets the pod's device file");
            use std::os::unix::fs::{FileTypeExt, MetadataExt};
            let (got, want) = (std::fs::metadata(&file).unwrap(), std::fs::metadata(&dev.0).unwrap());
            assert!(got.file_type().is_block_device() && got.rdev() == want.rdev(), "the device bound on the file");
            assert_eq!(std::fs::read_link(&link).unwrap(), dev.0, "the pod's link names the device");

            let dir = device_pod("wrong", "dir-claim");
            m.add_pod(dir.clone());
            let s = wait_for_status(&m, &dir, 120, |s| s.volumes.iter().any(|v| v.retry.last_error.is_some())).await;
            let e = s.volumes[0].retry.last_error.clone().unwrap();
            assert!(e.contains("is a directory, not a block device (volumeMode Block needs one)"), "{e}");

            m.remove_pods(&[p.clone(), dir.clone()]);
            m.wait_for_all_pods_unmount(&[p, dir]).await.expect("unmapped");
            assert!(mounts_under(&rootd).is_empty(), "nothing left mounted");
            assert!(!file.exists() && std::fs::symlink_metadata(&link).is_err(), "device file and link removed");
            assert!(!rootd.join("plugins/kubernetes.io/local-volume/volumeDevices/raw-pv").exists());
            m.shutdown();
        });
        drop(dev);
    }
}

/// A hostPath PersistentVolume of `size` at `host/<name>`, as YAML, with `extra` spec fields.
fn host_volume(host: &std::path::Path, name: &str, size: &str, extra: &str) -> String {
    format!(
        "apiVersion: v1\nkind: PersistentVolume\nmetadata: {{name: {name}}}\nspec:\n  storageClassName: manual\n  capacity: {{storage: {size}}}\n  accessModes: [ReadWriteOnce]\n  hostPath: {{path: {}, type: DirectoryOrCreate}}\n{extra}---\n",
        host.join(name).display()
    )
}

/// A claim of `size` and a pod of the same name that mounts it, as YAML.
fn claim_and_pod(name: &str, size: &str) -> String {
    format!(
        "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {{name: {name}}}\nspec:\n  storageClassName: manual\n  accessModes: [ReadWriteOnce]\n  resources: {{requests: {{storage: {size}}}}}\n---\napiVersion: v1\nkind: Pod\nmetadata: {{name: {name}}}\nspec:\n  containers: [{{name: c, image: busybox, volumeMounts: [{{name: data, mountPath: /data}}]}}]\n  volumes: [{{name: data, persistentVolumeClaim: {{claimName: {name}}}}}]\n"
    )
}

/// The claims kubevol bound, as `claim -> volume` lines of the status.
fn bindings(m: &kubevol::VolumeManager) -> Vec<String> {
    m.status(false)
        .bindings
        .iter()
        .map(|b| b.to_string())
        .collect()
}

mount_test! {
    /// Standalone mode binds a claim nothing binds, as the PersistentVolume controller would:
    /// once, when a pod first uses it, to the smallest volume that fits (one whose node
    /// affinity excludes the node does not), kept on disk. A better fit added later, a
    /// restart, another claim: nothing moves, and a volume is never given to two claims. A
    /// claim that nothing fits says why for the closest volumes. A claim removed with its pod
    /// leaves its volume Released, with its data, kept for it: another claim does not get it,
    /// and the claim, written again, gets its data back.
    fn unbound_claims_are_bound_once_to_the_volume_that_fits_best_and_stay() {
        let root = TestRoot::new();
        let manifests = root.manifests();
        let host = root.path().join("host");
        let zoned = "  nodeAffinity: {required: {nodeSelectorTerms: [{matchExpressions: [{key: zone, operator: In, values: [b]}]}]}}\n";
        let volumes = host_volume(&host, "big", "10Gi", "") + &host_volume(&host, "small", "2Gi", "") + &host_volume(&host, "zoned", "1Gi", zoned);
        write_manifest(&manifests, "volumes.yaml", &volumes);
        write_manifest(&manifests, "data.yaml", &claim_and_pod("data", "1Gi"));
        let pod_named = |name: &str| common::pod(json!({"metadata": {"name": name, "namespace": "default"}, "spec": {"containers": []}}));
        let error_of = |s: &kubevol::status::PodStatus| s.volumes.first().and_then(|v| v.retry.last_error.clone()).unwrap_or_default();
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            let _watch = ManifestSource::new(&manifests).listen(m.store().sink(ManifestSource::NAME)).await.unwrap();
            let data = pod_named("data");
            m.wait_for_attach_and_mount(&data).await.expect("the claim bound and mounted");
            let dir = m.mounted_volumes_for_pod(&kubevol::pod_uid(&data))["data"].path.clone();
            std::fs::write(dir.join("kept"), "yes").unwrap();
            assert!(host.join("small/kept").exists(), "the smallest volume that fits: small, not zoned (another zone) or big");
            assert_eq!(bindings(&m), ["default/data -> small"]);
            let file = root.path().join("root").join(kubevol::record::RECORD_DIR).join(kubevol::store::BINDINGS_FILE);
            assert!(std::fs::read_to_string(&file).unwrap().contains("\"volume\": \"small\""));

            // A better fit, then a restart: the claim stays where its data is.
            write_manifest(&manifests, "volumes.yaml", &(volumes.clone() + &host_volume(&host, "tiny", "1Gi", "")));
            let (m, sink) = restart_with(m, root.path(), |_| {}, |m| m.store().sink(ManifestSource::NAME)).await;
            let _watch = ManifestSource::new(&manifests).listen(sink).await.unwrap();
            m.wait_for_attach_and_mount(&data).await.expect("mounted again");
            assert_eq!(bindings(&m), ["default/data -> small"]);
            let dir = m.mounted_volumes_for_pod(&kubevol::pod_uid(&data))["data"].path.clone();
            assert_eq!(std::fs::read_to_string(dir.join("kept")).unwrap(), "yes");

            // Another claim gets the new volume; one that nothing fits says why.
            write_manifest(&manifests, "other.yaml", &claim_and_pod("other", "1Gi"));
            m.wait_for_attach_and_mount(&pod_named("other")).await.expect("bound and mounted");
            assert_eq!(bindings(&m), ["default/data -> small", "default/other -> tiny"]);
            write_manifest(&manifests, "huge.yaml", &claim_and_pod("huge", "50Gi"));
            let s = wait_for_status(&m, &pod_named("huge"), 120, |s| error_of(s).contains("no PersistentVolume fits")).await;
            let e = error_of(&s);
            assert!(e.contains("huge.yaml (document 2): volume \"data\" of pod default/huge: PersistentVolumeClaim default/huge is not bound: no PersistentVolume fits it (big: its capacity 10Gi is less than the claim's request 50Gi; small: it is bound to claim default/data, its capacity 2Gi is less"), "{e}");
            assert!(e.ends_with("; 1 more), and no StorageClass manual is defined, so none is provisioned for it: add a PersistentVolume that fits, or a StorageClass manual of provisioner kubevol.io/local-path"), "{e}");
            std::fs::remove_file(manifests.join("huge.yaml")).unwrap();

            // The claim and its pod go: its volume stays its own, with the data.
            std::fs::remove_file(manifests.join("data.yaml")).unwrap();
            m.wait_for_unmount(&data).await.expect("torn down");
            let released = "default/data -> small (Released: the claim is gone; the volume keeps its data and is kept for a claim of that name)".to_string();
            until_announced(&m, 120, "the volume released", || bindings(&m).contains(&released)).await;
            write_manifest(&manifests, "intruder.yaml", &claim_and_pod("intruder", "1Gi"));
            m.wait_for_attach_and_mount(&pod_named("intruder")).await.expect("bound to what is free");
            assert!(bindings(&m).contains(&"default/intruder -> big".to_string()), "{:?}", bindings(&m));
            assert_eq!(std::fs::read_to_string(host.join("small/kept")).unwrap(), "yes");
            // Not even a claim that names it gets it.
            let named = claim_and_pod("named", "1Gi").replace("resources:", "volumeName: small\n  resources:");
            write_manifest(&manifests, "named.yaml", &named);
            let s = wait_for_status(&m, &pod_named("named"), 120, |s| error_of(s).contains("never given to two claims")).await;
            assert!(error_of(&s).contains("PersistentVolume small was bound by kubevol to claim default/data"), "{s:#?}");
            std::fs::remove_file(manifests.join("named.yaml")).unwrap();
            write_manifest(&manifests, "data.yaml", &claim_and_pod("data", "1Gi"));
            m.wait_for_attach_and_mount(&data).await.expect("the claim back");
            let dir = m.mounted_volumes_for_pod(&kubevol::pod_uid(&data))["data"].path.clone();
            assert_eq!(std::fs::read_to_string(dir.join("kept")).unwrap(), "yes", "its own volume, with its data");
            m.shutdown();
        });
    }
}

mount_test! {
    /// Standalone provisioning: a claim that no volume fits gets one of its class, as a
    /// cluster's provisioner would make it. A claim that names no class gets the default one:
    /// kubevol's `local-path` (a directory of its own under `<root>/local-path`, served as a
    /// `local` volume of this node, named `pvc-<claim UID>`), or the StorageClass the manifests
    /// mark default, whose reclaim policy the volume takes. The volume is recorded with its
    /// binding and is there again after a restart, with its data. A claim of no class, of a
    /// provisioner kubevol does not run, or of volumeMode Block says why it gets none.
    fn a_claim_that_no_volume_fits_gets_a_local_path_volume_of_its_class() {
        let root = TestRoot::new();
        let manifests = root.manifests();
        let claim = |name: &str, spec: &str| format!(
            "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {{name: {name}}}\nspec:\n  accessModes: [ReadWriteOnce]\n  resources: {{requests: {{storage: 1Gi}}}}\n{spec}---\napiVersion: v1\nkind: Pod\nmetadata: {{name: {name}}}\nspec:\n  containers: [{{name: c, image: busybox, volumeMounts: [{{name: data, mountPath: /data}}]}}]\n  volumes: [{{name: data, persistentVolumeClaim: {{claimName: {name}}}}}]\n");
        write_manifest(&manifests, "web.yaml", &claim("web", ""));
        let pod_named = |name: &str| common::pod(json!({"metadata": {"name": name, "namespace": "default"}, "spec": {"containers": []}}));
        let error_of = |s: &kubevol::status::PodStatus| s.volumes.first().and_then(|v| v.retry.last_error.clone()).unwrap_or_default();
        let volume_of = |m: &kubevol::VolumeManager, claim: &str| {
            m.status(false).bindings.iter().find(|b| b.claim == format!("default/{claim}")).map(|b| b.volume.clone()).unwrap()
        };
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            let _watch = ManifestSource::new(&manifests).listen(m.store().sink(ManifestSource::NAME)).await.unwrap();
            let web = pod_named("web");
            m.wait_for_attach_and_mount(&web).await.expect("provisioned and mounted");
            let volume = volume_of(&m, "web");
            assert!(volume.starts_with("pvc-") && volume.len() == 40, "{volume}");
            let dir = root.path().join("root/local-path").join(format!("{volume}_default_web"));
            assert!(dir.is_dir(), "{}", dir.display());
            let mounted = m.mounted_volumes_for_pod(&kubevol::pod_uid(&web))["data"].path.clone();
            std::fs::write(mounted.join("kept"), "yes").unwrap();
            assert_eq!(std::fs::read_to_string(dir.join("kept")).unwrap(), "yes", "the pod's volume is the directory");
            let pv = m.store().persistent_volume(&volume).unwrap().object;
            let spec = pv.spec.clone().unwrap();
            assert_eq!(spec.storage_class_name.as_deref(), Some("local-path"));
            assert_eq!(spec.persistent_volume_reclaim_policy.as_deref(), Some("Delete"));
            assert_eq!(spec.capacity.unwrap()["storage"].0, "1Gi");
            assert_eq!(spec.claim_ref.unwrap().name.as_deref(), Some("web"));

            // A restart: the same volume, with its data.
            let (m, sink) = restart_with(m, root.path(), |_| {}, |m| m.store().sink(ManifestSource::NAME)).await;
            let _watch = ManifestSource::new(&manifests).listen(sink).await.unwrap();
            m.wait_for_attach_and_mount(&web).await.expect("mounted again");
            assert_eq!(volume_of(&m, "web"), volume);
            let mounted = m.mounted_volumes_for_pod(&kubevol::pod_uid(&web))["data"].path.clone();
            assert_eq!(std::fs::read_to_string(mounted.join("kept")).unwrap(), "yes");

            // The manifests' default class.
            write_manifest(&manifests, "classes.yaml", "apiVersion: storage.k8s.io/v1\nkind: StorageClass\nmetadata:\n  name: kept\n  annotations: {storageclass.kubernetes.io/is-default-class: \"true\"}\nprovisioner: kubevol.io/local-path\nreclaimPolicy: Retain\n---\napiVersion: storage.k8s.io/v1\nkind: StorageClass\nmetadata: {name: cloud}\nprovisioner: ebs.csi.aws.com\n");
            write_manifest(&manifests, "db.yaml", &claim("db", ""));
            m.wait_for_attach_and_mount(&pod_named("db")).await.expect("provisioned");
            let pv = m.store().persistent_volume(&volume_of(&m, "db")).unwrap().object;
            let spec = pv.spec.clone().unwrap();
            assert_eq!((spec.storage_class_name.as_deref(), spec.persistent_volume_reclaim_policy.as_deref()), (Some("kept"), Some("Retain")));

            // A claim that asks for more than its class lets it have: the volume stays as it
            // is, mounted, and the pod is told.
            write_manifest(&manifests, "db.yaml", &claim("db", "").replace("storage: 1Gi", "storage: 2Gi"));
            until_announced(&m, 120, "the resize refused", || m.events().iter().any(|e| e.reason == "VolumeResizeFailed" && e.message.contains("StorageClass kept does not allow volume expansion"))).await;
            assert!(m.mounted_volumes_for_pod(&kubevol::pod_uid(&pod_named("db"))).contains_key("data"));
            assert_eq!(m.store().persistent_volume(&volume_of(&m, "db")).unwrap().object.spec.clone().unwrap().capacity.unwrap()["storage"].0, "1Gi");

            // Claims that get none, and why.
            for (name, spec, why) in [
                ("none", "  storageClassName: \"\"\n", "pvc-d8318174-a975-5363-90cd-d5870a66eecc: its claimRef names claim default/web, its storageClassName is \"local-path\", the claim's \"\""),
                ("none", "  storageClassName: \"\"\n", "and it names no StorageClass (storageClassName \"\"), so none is provisioned for it: add a PersistentVolume that fits"),
                ("cloud", "  storageClassName: cloud\n", "StorageClass cloud is provisioned by ebs.csi.aws.com, which kubevol does not run: kubevol runs kubevol.io/local-path, and the CSI drivers whose controller service it is given (--csi-controller ebs.csi.aws.com=unix:///…)"),
                ("block", "  volumeMode: Block\n", "makes directories, not block devices: use volumeMode Filesystem"),
            ] {
                write_manifest(&manifests, &format!("{name}.yaml"), &claim(name, spec));
                // The binder's word on the claim, once it has looked at it.
                wait_for_status(&m, &pod_named(name), 120, |s| error_of(s).contains(why)).await;
            }

            // A manifest that no longer parses deletes nothing.
            let dir = root.path().join("root/local-path").join(format!("{volume}_default_web"));
            write_manifest(&manifests, "web.yaml", "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {name: web\n");
            until_announced(&m, 120, "the manifest error", || !m.status(false).manifest_errors.is_empty()).await;
            assert!(m.mounted_volumes_for_pod(&kubevol::pod_uid(&web)).contains_key("data"));
            assert_eq!(std::fs::read_to_string(dir.join("kept")).unwrap(), "yes");
            // The claim removed while its pod still names it: nothing is deleted while the pod
            // is there.
            write_manifest(&manifests, "web.yaml", claim("web", "").split("---\n").nth(1).unwrap());
            until_announced(&m, 120, "the claim gone", || m.store().persistent_volume_claim("default", "web").is_none()).await;
            // The storage controllers have looked at the claim's removal: what they did not do,
            // they decided not to do.
            storage_decided(&m).await;
            assert_eq!(std::fs::read_to_string(dir.join("kept")).unwrap(), "yes", "kept while its pod names the claim");
            assert!(m.store().persistent_volume(&volume).is_some());
            // Removed with its pod: reclaim policy Delete deletes the volume once it is
            // unmounted; Retain keeps it, Released.
            std::fs::remove_file(manifests.join("web.yaml")).unwrap();
            m.wait_for_unmount(&web).await.expect("torn down");
            until_announced(&m, 120, "the volume deleted", || !dir.exists() && m.store().persistent_volume(&volume).is_none()).await;
            assert!(!m.status(false).bindings.iter().any(|b| b.claim == "default/web"));
            let db_volume = volume_of(&m, "db");
            let db_dir = root.path().join("root/local-path").join(format!("{db_volume}_default_db"));
            std::fs::write(db_dir.join("kept"), "yes").unwrap();
            std::fs::remove_file(manifests.join("db.yaml")).unwrap();
            m.wait_for_unmount(&pod_named("db")).await.expect("torn down");
            until_announced(&m, 120, "the volume released", || m.status(false).bindings.iter().any(|b| b.claim == "default/db" && b.phase == "Released")).await;
            assert_eq!(std::fs::read_to_string(db_dir.join("kept")).unwrap(), "yes", "Retain keeps the data");
            // The claim written again: Delete made a new volume; Retain gives the old one back.
            write_manifest(&manifests, "web.yaml", &claim("web", ""));
            write_manifest(&manifests, "db.yaml", &claim("db", ""));
            m.wait_for_attach_and_mount(&web).await.expect("a new volume");
            m.wait_for_attach_and_mount(&pod_named("db")).await.expect("its old volume");
            assert!(!m.mounted_volumes_for_pod(&kubevol::pod_uid(&web))["data"].path.join("kept").exists(), "a new, empty volume");
            assert!(m.mounted_volumes_for_pod(&kubevol::pod_uid(&pod_named("db")))["data"].path.join("kept").exists(), "the data kept");
            m.shutdown();
        });
    }
}

/// The claim examples of the Kubernetes documentation, as a user copies them: the task
/// "Configure a Pod to Use a PersistentVolume for Storage" (a hostPath volume at /mnt/data of
/// class `manual`, a claim of 3Gi of that class, a pod mounting it) and the claims a
/// StatefulSet's `volumeClaimTemplates` make (`www-web-0`, `www-web-1`: no class).
const DOCS_EXAMPLES: &str = r#"
apiVersion: v1
kind: PersistentVolume
metadata:
  name: task-pv-volume
  labels:
    type: local
spec:
  storageClassName: manual
  capacity:
    storage: 10Gi
  accessModes:
    - ReadWriteOnce
  hostPath:
    path: "/mnt/data"
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: task-pv-claim
spec:
  storageClassName: manual
  accessModes:
    - ReadWriteOnce
  resources:
    requests:
      storage: 3Gi
---
apiVersion: v1
kind: Pod
metadata:
  name: task-pv-pod
spec:
  volumes:
    - name: task-pv-storage
      persistentVolumeClaim:
        claimName: task-pv-claim
  containers:
    - name: task-pv-container
      image: nginx
      ports:
        - containerPort: 80
          name: "http-server"
      volumeMounts:
        - mountPath: "/usr/share/nginx/html"
          name: task-pv-storage
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: www-web-0
  labels:
    app: nginx
spec:
  accessModes: [ "ReadWriteOnce" ]
  resources:
    requests:
      storage: 1Gi
---
apiVersion: v1
kind: Pod
metadata:
  name: web-0
  labels:
    app: nginx
spec:
  containers:
  - name: nginx
    image: registry.k8s.io/nginx-slim:0.24
    ports:
    - containerPort: 80
      name: web
    volumeMounts:
    - name: www
      mountPath: /usr/share/nginx/html
  volumes:
  - name: www
    persistentVolumeClaim:
      claimName: www-web-0
"#;

mount_test! {
    /// The documentation's claim examples run unchanged in standalone mode: the task's claim
    /// is bound to the task's volume (its class, and the only one that fits), the
    /// StatefulSet-style claim gets a volume of the default class.
    fn the_documentations_claim_examples_run_unchanged() {
        let root = TestRoot::new();
        // The task's volume is the host's /mnt/data: here a tmpfs of this test's own mount
        // namespace, gone with it.
        std::fs::create_dir_all("/mnt").unwrap();
        rustix::mount::mount("tmpfs", "/mnt", "tmpfs", rustix::mount::MountFlags::empty(), None).unwrap();
        std::fs::create_dir("/mnt/data").unwrap();
        std::fs::write("/mnt/data/index.html", "Hello from Kubernetes storage").unwrap();
        let manifests = root.manifests();
        write_manifest(&manifests, "examples.yaml", DOCS_EXAMPLES);
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            let _watch = ManifestSource::new(&manifests).listen(m.store().sink(ManifestSource::NAME)).await.unwrap();
            let pod = |name: &str| common::pod(json!({"metadata": {"name": name, "namespace": "default"}, "spec": {"containers": []}}));
            for name in ["task-pv-pod", "web-0"] {
                m.wait_for_attach_and_mount(&pod(name)).await.unwrap_or_else(|e| panic!("{name}: {e}"));
            }
            let html = m.mounted_volumes_for_pod(&kubevol::pod_uid(&pod("task-pv-pod")))["task-pv-storage"].path.join("index.html");
            assert_eq!(std::fs::read_to_string(html).unwrap(), "Hello from Kubernetes storage");
            let bindings: Vec<String> = m.status(false).bindings.iter().map(|b| b.to_string()).collect();
            assert_eq!(bindings.len(), 2, "{bindings:?}");
            assert!(bindings.contains(&"default/task-pv-claim -> task-pv-volume".to_string()), "{bindings:?}");
            assert!(bindings.iter().any(|b| b.starts_with("default/www-web-0 -> pvc-")), "{bindings:?}");
            m.shutdown();
        });
    }
}

mount_test! {
    /// A claim of a class that binds at once (`volumeBindingMode: Immediate`, the default, or
    /// a class no StorageClass defines) is bound, or gets its volume, without any pod; one of
    /// a `WaitForFirstConsumer` class (the built-in `local-path`) waits for its first pod.
    fn claims_of_immediate_classes_are_bound_without_a_pod() {
        let root = TestRoot::new();
        let manifests = root.manifests();
        let host = root.path().join("host");
        let claim = |name: &str, class: &str| format!(
            "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {{name: {name}}}\nspec: {{storageClassName: {class}, accessModes: [ReadWriteOnce], resources: {{requests: {{storage: 1Gi}}}}}}\n---\n");
        let objects = host_volume(&host, "static", "1Gi", "")
            + "apiVersion: storage.k8s.io/v1\nkind: StorageClass\nmetadata: {name: now}\nprovisioner: kubevol.io/local-path\nvolumeBindingMode: Immediate\n---\n"
            + &claim("bound", "manual") + &claim("made", "now") + &claim("waits", "local-path");
        write_manifest(&manifests, "objects.yaml", &objects);
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            let _watch = ManifestSource::new(&manifests).listen(m.store().sink(ManifestSource::NAME)).await.unwrap();
            until_announced(&m, 120, "both bound", || m.status(false).bindings.len() == 2).await;
            storage_decided(&m).await;
            let bindings = bindings(&m);
            assert_eq!(bindings[0], "default/bound -> static");
            assert!(bindings[1].starts_with("default/made -> pvc-"), "{bindings:?}");
            assert!(m.store().persistent_volume_claim("default", "waits").is_some());
            assert!(!m.status(false).bindings.iter().any(|b| b.claim == "default/waits"), "a WaitForFirstConsumer claim waits for its pod");
            m.shutdown();
        });
    }
}
