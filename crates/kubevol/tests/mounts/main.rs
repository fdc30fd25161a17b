//! Integration tests that mount for real, each in its own private mount namespace.

#[macro_use]
#[path = "../common/mod.rs"]
mod common;
mod claims;
mod resize;
mod usage;

use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::time::Duration;

use common::*;
use kubevol::source::ManifestSource;
use kubevol::status::{PodPhase, VolumePhase};
use kubevol::WaitError;
use serde_json::json;

mount_test! {
    fn memory_empty_dir_is_tmpfs_of_size_limit_and_full_at_it() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            let p = pod_with_volumes("mem", json!([{"name": "cache", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}}]));
            let uid = m.add_pod(p.clone());
            m.wait_for_attach_and_mount(&p).await.expect("mounted");
            let vols = m.mounted_volumes_for_pod(&uid);
            let cache = &vols["cache"];
            let want = m.config().root_dir.join(format!("pods/{uid}/volumes/kubernetes.io~empty-dir/cache"));
            assert_eq!(cache.path, want, "the kubelet's path");
            assert!(!cache.read_only);
            let mounts = mounts_under(&want);
            assert_eq!(mounts.len(), 1, "{mounts:?}");
            assert_eq!(mounts[0].1, "tmpfs");
            assert!(mounts[0].2.contains("size=65536k"), "tmpfs size: {}", mounts[0].2);
            let mode = std::fs::metadata(&want).unwrap().permissions().mode() & 0o7777;
            assert_eq!(mode, 0o777);

            let mut f = std::fs::File::create(want.join("fill")).unwrap();
            let chunk = vec![7u8; 1 << 20];
            let mut err = None;
            for _ in 0..65 {
                if let Err(e) = f.write_all(&chunk) {
                    err = Some(e);
                    break;
                }
            }
            let err = err.expect("writing past 64Mi must fail");
            assert_eq!(err.raw_os_error(), Some(28), "ENOSPC expected, got {err}");
            drop(f);

            m.remove_pod(&p);
            m.wait_for_unmount(&p).await.expect("unmounted");
            assert!(mounts_under(&want).is_empty(), "tmpfs unmounted");
            assert!(!m.config().root_dir.join(format!("pods/{uid}")).exists(), "pod directory removed");
            m.shutdown();
        });
    }
}

mount_test! {
    fn deleting_the_manifest_unmounts_and_removes_the_pod_directory() {
        let root = TestRoot::new();
        let manifests = root.manifests();
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            let watch = ManifestSource::new(&manifests).listen(m.store().sink(ManifestSource::NAME)).await.unwrap();
            let file = manifests.join("app.yaml");
            std::fs::write(&file, "apiVersion: v1\nkind: Pod\nmetadata: {name: app}\nspec:\n  containers: [{name: c, volumeMounts: [{name: tmp, mountPath: /tmp}, {name: data, mountPath: /data}]}]\n  volumes:\n  - {name: tmp, emptyDir: {medium: Memory}}\n  - {name: data, emptyDir: {}}\n").unwrap();
            let p = common::pod(json!({"metadata": {"name": "app", "namespace": "default"}}));
            m.wait_for_attach_and_mount(&p).await.expect("mounted after the file appeared");
            let uid = kubevol::pod_uid(&p);
            let pod_dir = m.config().root_dir.join(format!("pods/{uid}"));
            assert_eq!(mounts_under(&pod_dir).len(), 1);
            std::fs::write(pod_dir.join("volumes/kubernetes.io~empty-dir/data/file"), b"x").unwrap();
            assert!(m.reconciler_states_synced());

            std::fs::remove_file(&file).unwrap();
            m.wait_for_unmount(&p).await.expect("torn down after the file was removed");
            assert!(mounts_under(&pod_dir).is_empty());
            assert!(!m.has_possibly_mounted_volumes(&uid));
            // The pod directory goes right after the last unmount.
            let mut rx = m.subscribe();
            while pod_dir.exists() {
                tokio::time::timeout(Duration::from_secs(120), rx.changed()).await.expect("pod dir removed").unwrap();
            }
            watch.abort();
            m.shutdown();
        });
    }
}

mount_test! {
    fn a_mount_left_in_a_gone_pods_directory_keeps_it_and_is_never_entered() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            let p = pod_with_volumes("kept", json!([{"name": "cache", "emptyDir": {"medium": "Memory"}}]));
            let uid = m.add_pod(p.clone());
            m.wait_for_attach_and_mount(&p).await.expect("mounted");
            let pod_dir = m.config().root_dir.join(format!("pods/{uid}"));
            let foreign = pod_dir.join("plugins/example.com~driver/mnt");
            std::fs::create_dir_all(&foreign).unwrap();
            let st = std::process::Command::new("mount").args(["-t", "tmpfs", "tmpfs"]).arg(&foreign).status().unwrap();
            assert!(st.success());
            std::fs::create_dir(foreign.join("empty")).unwrap();
            std::fs::write(foreign.join("canary"), b"precious").unwrap();

            m.remove_pod(&p);
            m.wait_for_unmount(&p).await.expect("unmounted");
            let mut rx = m.subscribe();
            while pod_dir.join("volumes").exists() {
                tokio::time::timeout(Duration::from_secs(120), rx.changed()).await.expect("the empty directories beside the mount go").unwrap();
            }
            assert_eq!(std::fs::read(foreign.join("canary")).unwrap(), b"precious", "the mount is untouched");
            assert!(foreign.join("empty").is_dir(), "nothing inside the mount is removed");
            assert_eq!(mounts_under(&pod_dir).len(), 1, "the pod directory is kept with the mount in it");
            let st = std::process::Command::new("umount").arg(&foreign).status().unwrap();
            assert!(st.success());
            m.shutdown();
        });
    }
}

mount_test! {
    fn every_host_path_type_and_each_way_it_fails() {
        host_path_types(false);
    }
}

mount_test! {
    /// With `--host-path-allow`, each type as without, each path pinned: a bind of the object
    /// checked, under the pod's directory, gone after the teardown with the host's data kept.
    fn every_host_path_type_pinned_and_each_way_it_fails() {
        host_path_types(true);
    }
}

/// Every hostPath type, set up and refused; `pinned`: with the host directory as the allow-list.
fn host_path_types(pinned: bool) {
    let root = TestRoot::new();
    let host = root.path().join("host");
    std::fs::create_dir(&host).unwrap();
    std::fs::create_dir(host.join("dir")).unwrap();
    std::fs::write(host.join("file"), b"host data").unwrap();
    let _sock = std::os::unix::net::UnixListener::bind(host.join("sock")).unwrap();
    let st = std::process::Command::new("mknod")
        .arg(host.join("null"))
        .args(["c", "1", "3"])
        .status()
        .unwrap();
    assert!(st.success(), "mknod");
    let blk = host.join("blk");
    let st = std::process::Command::new("mknod")
        .arg(&blk)
        .args(["b", "7", "200"])
        .status()
        .unwrap();
    assert!(st.success(), "mknod");
    let h = |p: &str| host.join(p).display().to_string();
    // (row, path, type, expected error substring or "" for success)
    let rows: Vec<(&str, String, &str, &str)> = vec![
        ("untyped missing", h("nothing"), "", ""),
        (
            "DirectoryOrCreate creates",
            h("new/deep/dir"),
            "DirectoryOrCreate",
            "",
        ),
        (
            "DirectoryOrCreate existing",
            h("dir"),
            "DirectoryOrCreate",
            "",
        ),
        (
            "DirectoryOrCreate on a file",
            h("file"),
            "DirectoryOrCreate",
            "is a regular file, not a directory",
        ),
        ("Directory", h("dir"), "Directory", ""),
        (
            "Directory missing",
            h("missing"),
            "Directory",
            "does not exist (type Directory requires a directory)",
        ),
        (
            "Directory on a file",
            h("file"),
            "Directory",
            "is a regular file, not a directory",
        ),
        (
            "FileOrCreate creates",
            h("dir/new-file"),
            "FileOrCreate",
            "",
        ),
        ("FileOrCreate existing", h("file"), "FileOrCreate", ""),
        (
            "FileOrCreate without parent",
            h("no-parent/f"),
            "FileOrCreate",
            "FileOrCreate does not create parents",
        ),
        (
            "FileOrCreate on a dir",
            h("dir"),
            "FileOrCreate",
            "is a directory, not a regular file",
        ),
        ("File", h("file"), "File", ""),
        ("File missing", h("missing"), "File", "does not exist"),
        (
            "File on a socket",
            h("sock"),
            "File",
            "is a socket, not a regular file",
        ),
        ("Socket", h("sock"), "Socket", ""),
        (
            "Socket on a file",
            h("file"),
            "Socket",
            "is a regular file, not a socket",
        ),
        ("CharDevice", h("null"), "CharDevice", ""),
        (
            "CharDevice on a dir",
            h("dir"),
            "CharDevice",
            "is a directory, not a character device",
        ),
        ("BlockDevice", h("blk"), "BlockDevice", ""),
        (
            "BlockDevice on a char device",
            h("null"),
            "BlockDevice",
            "is a character device, not a block device",
        ),
    ];
    runtime().block_on(async {
        let allow = pinned.then(|| host.clone());
        let m = manager(root.path(), |c| {
            c.host_path_allow = allow.into_iter().collect()
        });
        let pods: Vec<_> = rows
            .iter()
            .enumerate()
            .map(|(i, (_, path, t, _))| {
                let p = pod_with_volumes(
                    &format!("hp-{i}"),
                    json!([{"name": "h", "hostPath": {"path": path, "type": t}}]),
                );
                m.add_pod(p.clone());
                p
            })
            .collect();
        for ((name, path, _, want), p) in rows.iter().zip(&pods) {
            let s = wait_for_status(&m, p, 120, settled).await;
            let v = &s.volumes[0];
            if want.is_empty() {
                assert_eq!(s.phase, PodPhase::Ready, "row {name}: {v:?}");
                let reported = v.path.clone().unwrap_or_default();
                if pinned {
                    let handed = std::path::Path::new(&reported);
                    assert!(
                        handed.starts_with(root.path().join("root/pods")),
                        "row {name}: pinned under the pod: {reported}"
                    );
                    let ino = |p: &std::path::Path| {
                        let m = std::fs::metadata(p).unwrap();
                        (m.dev(), m.ino())
                    };
                    assert_eq!(
                        ino(handed),
                        ino(std::path::Path::new(path)),
                        "row {name}: the object checked"
                    );
                } else {
                    assert_eq!(
                        reported,
                        path.as_str(),
                        "row {name}: the host path is reported"
                    );
                }
            } else {
                // A type check may pass later (the path may appear): retried, not failed.
                assert_eq!(
                    (s.phase, v.state),
                    (PodPhase::Pending, VolumePhase::Retrying),
                    "row {name}"
                );
                let e = v.retry.last_error.as_deref().unwrap_or("");
                assert!(
                    e.contains(want),
                    "row {name}: {e:?} should contain {want:?}"
                );
                assert!(
                    e.contains("hp-") && e.contains("\"h\"") && e.contains(path.as_str()),
                    "row {name}: error names pod, volume and path: {e}"
                );
            }
        }
        let mode = |p: &str| {
            std::fs::metadata(host.join(p))
                .unwrap()
                .permissions()
                .mode()
                & 0o7777
        };
        assert_eq!(mode("new/deep/dir"), 0o755, "DirectoryOrCreate makes 0755");
        assert_eq!(mode("dir/new-file"), 0o644, "FileOrCreate makes 0644");
        assert!(
            !host.join("no-parent").exists(),
            "FileOrCreate does not create the parent"
        );

        for p in &pods {
            m.remove_pod(p);
        }
        m.wait_for_all_pods_unmount(&pods)
            .await
            .expect("all torn down");
        assert_eq!(
            std::fs::read(host.join("file")).unwrap(),
            b"host data",
            "teardown never touches host data"
        );
        assert!(
            host.join("new/deep/dir").is_dir()
                && host.join("dir/new-file").is_file()
                && host.join("sock").exists()
        );
        assert!(
            mounts_under(&root.path().join("root")).is_empty(),
            "every pin unmounted"
        );
        m.shutdown();
    });
}

mount_test! {
    fn a_failing_volume_backs_off_alone_while_other_pods_mount() {
        let root = TestRoot::new();
        let missing = root.path().join("appears-later");
        runtime().block_on(async {
            let m = manager(root.path(), |c| {
                c.backoff.initial = Duration::from_millis(50);
                c.backoff.max = Duration::from_millis(400);
            });
            let bad = pod_with_volumes("bad", json!([{"name": "data", "hostPath": {"path": missing, "type": "Directory"}}]));
            let good: Vec<_> = (0..5)
                .map(|i| pod_with_volumes(&format!("good-{i}"), json!([{"name": "a", "emptyDir": {"medium": "Memory"}}, {"name": "b", "emptyDir": {}}])))
                .collect();
            m.add_pod(bad.clone());
            for g in &good {
                m.add_pod(g.clone());
            }
            for g in &good {
                m.wait_for_attach_and_mount(g).await.expect("other pods mount while one fails");
            }
            let s = wait_for_status(&m, &bad, 120, |s| s.volumes[0].retry.failures >= 3).await;
            let v = &s.volumes[0];
            // Retried, not failed: the path may appear.
            assert_eq!(s.phase, PodPhase::Pending);
            assert_eq!(v.state, VolumePhase::Retrying);
            assert!(v.retry.last_error.as_deref().unwrap().contains("does not exist"), "{v:?}");
            let events = m.pod_status(&kubevol::pod_uid(&bad)).unwrap().events;
            let failed = events.iter().find(|e| e.reason == "FailedMount").expect("FailedMount event");
            assert!(failed.count >= 3, "repeats fold into one event: {failed:?}");

            std::fs::create_dir(&missing).unwrap();
            m.wait_for_attach_and_mount(&bad).await.expect("mounts once the directory exists");
            assert!(m.pod_status(&kubevol::pod_uid(&bad)).unwrap().volumes[0].retry.last_error.is_none());
            m.shutdown();
        });
    }
}

mount_test! {
    fn an_invalid_manifest_gets_a_clear_error_and_other_pods_mount() {
        let root = TestRoot::new();
        let manifests = root.manifests();
        std::fs::write(manifests.join("broken.yaml"), "apiVersion: v1\nkind: Pod\nmetadata:\n  name: broken\n spec: [\n").unwrap();
        std::fs::write(
            manifests.join("invalid.yaml"),
            "apiVersion: v1\nkind: Pod\nmetadata: {name: invalid}\nspec:\n  containers: [{name: c, volumeMounts: [{name: Data, mountPath: /d}, {name: logs, mountPath: /d}]}]\n  volumes:\n  - {name: Data, emptyDir: {}}\n  - {name: logs, hostPath: {path: var/log}}\n  - {name: both, emptyDir: {}, hostPath: {path: /x}}\n",
        )
        .unwrap();
        std::fs::write(
            manifests.join("good.yaml"),
            "apiVersion: v1\nkind: Pod\nmetadata: {name: good}\nspec:\n  containers: [{name: c, volumeMounts: [{name: v, mountPath: /v}]}]\n  volumes: [{name: v, emptyDir: {medium: Memory}}]\n",
        )
        .unwrap();
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            let watch = ManifestSource::new(&manifests).listen(m.store().sink(ManifestSource::NAME)).await.unwrap();
            let good = common::pod(json!({"metadata": {"name": "good", "namespace": "default"}}));
            m.wait_for_attach_and_mount(&good).await.expect("the good pod mounts");

            let invalid = common::pod(json!({"metadata": {"name": "invalid", "namespace": "default"}}));
            let err = m.wait_for_attach_and_mount(&invalid).await.unwrap_err();
            let WaitError::Rejected { errors, origin, .. } = &err else { panic!("rejected expected: {err}") };
            assert!(origin.contains("invalid.yaml (document 1)"), "{origin}");
            let all = errors.join("\n");
            for want in [
                "spec.volumes[0].name: Invalid value: \"Data\"",
                "spec.volumes[1].hostPath.path: Invalid value: \"var/log\": must be an absolute path",
                "spec.volumes[2]: Forbidden: may not specify more than 1 volume type",
                "spec.containers[0].volumeMounts[1].mountPath: Invalid value: \"/d\": must be unique",
            ] {
                assert!(all.contains(want), "missing {want:?} in:\n{all}");
            }
            let uid = kubevol::pod_uid(&invalid);
            assert!(!m.config().root_dir.join(format!("pods/{uid}")).exists(), "nothing created for a rejected pod");

            let report = m.status(false);
            let broken = report.manifest_errors.iter().find(|e| e.contains("broken.yaml")).expect("broken file reported");
            assert!(broken.contains("document 1, line 5, column"), "{broken}");
            assert!(report.pods.iter().any(|p| p.name == "invalid" && p.phase == PodPhase::Rejected));

            // Fixing the broken file brings its pod in, within one inotify event.
            std::fs::write(manifests.join("broken.yaml"), "apiVersion: v1\nkind: Pod\nmetadata: {name: broken}\nspec: {containers: [{name: c, volumeMounts: [{name: v, mountPath: /v}]}], volumes: [{name: v, emptyDir: {}}]}\n").unwrap();
            let fixed = common::pod(json!({"metadata": {"name": "broken", "namespace": "default"}}));
            m.wait_for_attach_and_mount(&fixed).await.expect("fixed file is applied");
            assert!(m.status(false).manifest_errors.is_empty());

            // Breaking it again keeps the pod's volumes: a half-written file loses nothing.
            std::fs::write(manifests.join("broken.yaml"), "apiVersion: v1\nkind: Pod\nmetadata: {name: [\n").unwrap();
            let mut rx = m.subscribe();
            while m.status(false).manifest_errors.is_empty() {
                tokio::time::timeout(Duration::from_secs(120), rx.changed()).await.expect("error reported").unwrap();
            }
            assert!(m.has_possibly_mounted_volumes(&kubevol::pod_uid(&fixed)), "{:#?}", m.status(true));
            watch.abort();
            m.shutdown();
        });
    }
}

mount_test! {
    fn a_mount_nested_in_a_disk_empty_dir_survives_teardown_untouched() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            let p = pod_with_volumes("nest", json!([{"name": "data", "emptyDir": {}}]));
            let uid = m.add_pod(p.clone());
            m.wait_for_attach_and_mount(&p).await.unwrap();
            let vol = m.mounted_volumes_for_pod(&uid)["data"].path.clone();
            let mode = std::fs::metadata(&vol).unwrap().permissions().mode() & 0o7777;
            assert_eq!(mode, 0o777, "a disk emptyDir is 0777, as the kubelet makes it");
            std::fs::write(vol.join("scratch"), b"goes away").unwrap();
            let nested = vol.join("sub/nested");
            std::fs::create_dir_all(&nested).unwrap();
            let st = std::process::Command::new("mount").args(["-t", "tmpfs", "tmpfs"]).arg(&nested).status().unwrap();
            assert!(st.success());
            std::fs::write(nested.join("canary"), b"precious").unwrap();

            m.remove_pod(&p);
            let s = wait_for_status(&m, &p, 120, |s| s.volumes.first().is_some_and(|v| v.retry.failures >= 2)).await;
            assert_eq!(s.phase, PodPhase::Terminating);
            let e = s.volumes[0].retry.last_error.clone().unwrap();
            assert!(e.contains("UnmountVolume.TearDown failed for volume \"data\""), "{e}");
            assert!(e.contains("sub/nested is a mount point"), "{e}");
            assert_eq!(std::fs::read(nested.join("canary")).unwrap(), b"precious", "nested mount untouched");
            assert!(vol.join("scratch").exists(), "nothing is removed before the whole tree is checked");

            let st = std::process::Command::new("umount").arg(&nested).status().unwrap();
            assert!(st.success());
            m.wait_for_unmount(&p).await.expect("teardown retries and succeeds");
            assert!(!vol.exists());
            m.shutdown();
        });
    }
}

mount_test! {
    fn the_wait_timeout_error_names_every_missing_volume() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let m = manager(root.path(), |c| c.wait_timeout = Duration::from_millis(700));
            let p = pod_with_volumes(
                "waits",
                json!([
                    {"name": "ok", "emptyDir": {}},
                    {"name": "data", "hostPath": {"path": "/nonexistent/kubevol", "type": "Directory"}},
                    {"name": "cfg", "configMap": {"name": "settings"}},
                    {"name": "share", "nfs": {"server": "nfs.example", "path": "/export"}}
                ]),
            );
            m.add_pod(p.clone());
            // Every volume tried first (as long as a loaded machine takes): what the wait's
            // error says is then known, whenever it runs out.
            wait_for_status(&m, &p, 120, |s| {
                let tried = |n: &str| s.volumes.iter().any(|v| v.name == n && (v.retry.last_error.is_some() || v.not_processed()));
                tried("data") && tried("cfg") && tried("share")
            })
            .await;
            let err = m.wait_for_attach_and_mount(&p).await.unwrap_err().to_string();
            assert!(err.starts_with("timed out after 700ms waiting for volumes of pod default/waits"), "{err}");
            assert!(err.contains("unmounted volumes=[cfg (") && err.contains("data (MountVolume.SetUp failed for volume \"data\""), "{err}");
            assert!(err.contains("/nonexistent/kubevol does not exist"), "{err}");
            assert!(err.contains("cfg (MountVolume.SetUp failed for volume \"cfg\" of pod default/waits (library API): configMap default/settings not found; create it, or set optional: true"), "{err}");
            assert!(err.contains("failed to process volumes=[share (library API: volume \"share\" of pod default/waits: volume type nfs is not supported by kubevol yet"), "{err}");
            assert!(!err.contains("[ok") && !err.contains(", ok"), "mounted volumes are not listed: {err}");
            m.shutdown();
        });
    }
}

mount_test! {
    fn pods_for_other_nodes_are_ignored_and_terminated_pods_are_torn_down() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            let mut elsewhere = pod_with_volumes("elsewhere", json!([{"name": "v", "emptyDir": {"medium": "Memory"}}]));
            elsewhere.spec.as_mut().unwrap().node_name = Some("other-node".into());
            let mut here = pod_with_volumes("here", json!([{"name": "v", "emptyDir": {"medium": "Memory"}}]));
            here.spec.as_mut().unwrap().node_name = Some("test-node".into());
            m.add_pod(elsewhere.clone());
            let uid = m.add_pod(here.clone());
            m.wait_for_attach_and_mount(&here).await.unwrap();
            assert!(m.pod_status(&kubevol::pod_uid(&elsewhere)).is_none(), "other node's pod is ignored");
            assert_eq!(mounts_under(&m.config().root_dir).len(), 1);

            here.status = Some(k8s_openapi::api::core::v1::PodStatus { phase: Some("Succeeded".into()), ..Default::default() });
            m.add_pod(here.clone());
            m.wait_for_unmount(&here).await.expect("a finished pod's volumes are torn down");
            assert!(m.mounted_volumes_for_pod(&uid).is_empty());
            assert!(mounts_under(&m.config().root_dir).is_empty());
            m.shutdown();
        });
    }
}

mount_test! {
    fn huge_pages_without_reserved_pages_is_a_clear_error() {
        let root = TestRoot::new();
        let fake_sys = root.path().join("hugepages");
        std::fs::create_dir_all(fake_sys.join("hugepages-2048kB")).unwrap();
        std::fs::write(fake_sys.join("hugepages-2048kB/nr_hugepages"), "0\n").unwrap();
        runtime().block_on(async {
            let m = manager(root.path(), |c| c.hugepages_dir = fake_sys.clone());
            let p = pod_with_volumes("huge", json!([{"name": "hp", "emptyDir": {"medium": "HugePages-2Mi"}}]));
            m.add_pod(p.clone());
            let s = wait_for_status(&m, &p, 120, settled).await;
            let e = s.volumes[0].retry.last_error.clone().unwrap();
            assert!(e.contains("emptyDir medium HugePages-2Mi: the node has no 2048kB huge pages reserved"), "{e}");
            assert!(mounts_under(&m.config().root_dir).is_empty(), "nothing mounted");
            m.shutdown();
        });
    }
}

mount_test! {
    fn empty_dir_mode_sets_the_volume_directory_and_unknown_fields_are_warned_about() {
        let root = TestRoot::new();
        let manifests = root.manifests();
        std::fs::write(
            manifests.join("app.yaml"),
            "apiVersion: v1\nkind: Pod\nmetadata: {name: app}\nspec:\n  containers: [{name: c, volumeMounts: [{name: a, mountPath: /a}, {name: b, mountPath: /b}, {name: c, mountPath: /c}, {name: d, mountPath: /d}]}]\n  volumes:\n  - {name: a, emptyDir: {mode: 0750}}\n  - {name: b, emptyDir: {medium: Memory, mode: 01777}}\n  - {name: c, emptyDir: {sizeLimit: 1Mi, futureField: x}}\n  - {name: d, emptyDir: {}}\n",
        )
        .unwrap();
        std::fs::write(
            manifests.join("bad.yaml"),
            "apiVersion: v1\nkind: Pod\nmetadata: {name: bad}\nspec:\n  containers: [{name: c, volumeMounts: [{name: a, mountPath: /a}]}]\n  volumes:\n  - name: a\n    emptyDir: {mode: 4096}\n",
        )
        .unwrap();
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            let watch = ManifestSource::new(&manifests).listen(m.store().sink(ManifestSource::NAME)).await.unwrap();
            let p = common::pod(json!({"metadata": {"name": "app", "namespace": "default"}}));
            m.wait_for_attach_and_mount(&p).await.expect("mounted");
            let uid = kubevol::pod_uid(&p);
            let dir = |v: &str| m.config().root_dir.join(format!("pods/{uid}/volumes/kubernetes.io~empty-dir/{v}"));
            let mode = |v: &str| std::fs::metadata(dir(v)).unwrap().permissions().mode() & 0o7777;
            assert_eq!(mode("a"), 0o750, "emptyDir.mode on a disk volume");
            assert_eq!(mode("b"), 0o1777, "emptyDir.mode on the tmpfs's root");
            assert_eq!(mounts_under(&dir("b")).len(), 1);
            assert_eq!(mode("c"), 0o777);
            assert_eq!(mode("d"), 0o777, "the default");

            let s = m.pod_status(&uid).unwrap();
            let c = s.volumes.iter().find(|v| v.name == "c").unwrap();
            assert_eq!(c.warnings, vec!["unknown field \"spec.volumes[2].emptyDir.futureField\" at line 9, column 55: ignored".to_string()]);
            assert!(s.volumes.iter().filter(|v| v.name != "c").all(|v| v.warnings.is_empty()), "{s:?}");
            let events = m.status(true).pods.into_iter().find(|p| p.name == "app").unwrap().events;
            assert!(
                events.iter().any(|e| e.reason == "UnknownField" && e.message.contains("unknown field \"spec.volumes[2].emptyDir.futureField\"")),
                "{events:?}"
            );

            let errors = m.status(false).manifest_errors;
            let bad = errors.iter().find(|e| e.contains("bad.yaml")).expect("the bad mode is an error of its file");
            assert!(
                bad.contains("document 1, line 8, column 22: invalid Pod: spec.volumes[0].emptyDir.mode: Invalid value: 4096: must be a number between 0 and 01777 (octal), both inclusive"),
                "{bad}"
            );
            std::fs::remove_file(manifests.join("app.yaml")).unwrap();
            m.wait_for_unmount(&p).await.expect("torn down");
            watch.abort();
            m.shutdown();
        });
    }
}

mount_test! {
    /// A pod waiting for objects is processed again when what it reads appears: a claim, then
    /// a PersistentVolume naming the claim in its claimRef (any PersistentVolume may be an
    /// unbound claim's), and a ConfigMap (an unrelated one changes nothing).
    fn a_waiting_pod_is_processed_again_when_what_it_reads_appears() {
        let root = TestRoot::new();
        let data = root.path().join("host/later");
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            let p = pod_with_volumes("waits", json!([
                {"name": "data", "persistentVolumeClaim": {"claimName": "later"}},
                {"name": "cfg", "configMap": {"name": "cfg"}}]));
            let uid = m.add_pod(p.clone());
            let error_of = |s: &kubevol::status::PodStatus, name: &str| {
                s.volumes.iter().find(|v| v.name == name).and_then(|v| v.retry.last_error.clone()).unwrap_or_default()
            };
            wait_for_status(&m, &p, 120, |s| error_of(s, "data").contains("later") && error_of(s, "cfg").contains("cfg")).await;

            // The claim appears, unbound: the volume still waits, now for the binding.
            m.library().upsert_objects(vec![kubevol::store::Object::PersistentVolumeClaim(serde_json::from_value(json!({
                "metadata": {"name": "later", "namespace": "default"},
                "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "", "resources": {"requests": {"storage": "1Gi"}}}})).unwrap())]);
            wait_for_status(&m, &p, 120, |s| error_of(s, "data").contains("PersistentVolumeClaim default/later is not bound")).await;

            // A PersistentVolume whose claimRef names the claim binds it.
            m.library().upsert_objects(vec![kubevol::store::Object::PersistentVolume(serde_json::from_value(json!({
                "metadata": {"name": "later-pv"},
                "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                         "hostPath": {"path": data, "type": "DirectoryOrCreate"},
                         "claimRef": {"namespace": "default", "name": "later"}}})).unwrap())]);
            wait_for_status(&m, &p, 120, |s| s.volumes.iter().any(|v| v.name == "data" && v.state == kubevol::status::VolumePhase::Mounted)).await;

            // An unrelated ConfigMap leaves the waiting volume as it is; its own one mounts it.
            m.library().upsert_objects(vec![kubevol::store::Object::ConfigMap(serde_json::from_value(json!({
                "metadata": {"name": "other", "namespace": "default"}, "data": {"k": "v"}})).unwrap())]);
            assert!(error_of(&m.pod_status(&uid).unwrap(), "cfg").contains("cfg"));
            m.library().upsert_objects(vec![kubevol::store::Object::ConfigMap(serde_json::from_value(json!({
                "metadata": {"name": "cfg", "namespace": "default"}, "data": {"k": "v"}})).unwrap())]);
            m.wait_for_attach_and_mount(&p).await.expect("mounted once everything it reads exists");
            m.remove_pods(std::slice::from_ref(&p));
            m.wait_for_all_pods_unmount(&[p]).await.expect("torn down");
            m.shutdown();
        });
    }
}

mount_test! {
    /// A restart of an embedder that gives its pods again after `run()`: the volumes the
    /// record holds for pods of the library wait for them (the source says which it awaits,
    /// and nothing is torn down meanwhile), so a disk-backed emptyDir keeps its data; a pod the
    /// embedder does not give again goes once it says `Library::synced()`.
    fn pods_of_the_library_are_awaited_after_a_restart_and_their_data_kept() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            let keep = pod_with_volumes("keep", json!([{"name": "d", "emptyDir": {}}]));
            let drop = pod_with_volumes("drop", json!([{"name": "d", "emptyDir": {}}]));
            for p in [&keep, &drop] {
                m.add_pod(p.clone());
                m.wait_for_attach_and_mount(p).await.expect("mounted");
            }
            let dir = |m: &kubevol::VolumeManager, p| m.mounted_volumes_for_pod(&kubevol::pod_uid(p))["d"].path.clone();
            let (kept, dropped) = (dir(&m, &keep), dir(&m, &drop));
            std::fs::write(kept.join("canary"), "kept").unwrap();

            let m = restart(m, root.path(), |_| {}).await;
            // The manager runs, has read the record, and waits for the two pods.
            let mut rx = m.subscribe();
            let awaited = |m: &kubevol::VolumeManager| m.status(false).notes.iter().any(|n| n.contains("2 of the pods the library API gave before the restart"));
            tokio::time::timeout(Duration::from_secs(120), async {
                while !awaited(&m) || m.reconciler_passes() == 0 {
                    let _ = rx.changed().await;
                }
            })
            .await
            .expect("the library's recorded pods awaited");
            assert!(!m.reconciler_states_synced(), "nothing may be torn down yet");
            assert!(kubevol::http::readiness(&m).unwrap_err().contains("have not been given again"));
            assert_eq!(std::fs::read_to_string(kept.join("canary")).unwrap(), "kept");

            m.add_pod(keep.clone());
            m.wait_for_attach_and_mount(&keep).await.expect("mounted again");
            assert!(!awaited(&m) && m.status(false).notes.iter().any(|n| n.contains("1 of the pods the library API")), "{:?}", m.status(false).notes);
            m.library().synced();
            until_gone(&dropped).await;
            assert_eq!(std::fs::read_to_string(kept.join("canary")).unwrap(), "kept", "the pod given again keeps its data");
            assert_eq!(kubevol::http::readiness(&m), Ok(()));
            m.shutdown();
        });
    }
}

/// Waits until nothing is at `path` (a volume torn down).
async fn until_gone(path: &std::path::Path) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while path.exists() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} still there",
            path.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

mount_test! {
    /// A storm of volumes is not a storm of log lines: each volume's set-up and teardown is
    /// logged at debug, and at info one line says when all of a pod's volumes are mounted and
    /// one when all are torn down.
    fn a_pods_volumes_are_logged_at_info_once_when_mounted_and_once_when_torn_down() {
        let log = LogCapture::install();
        let root = TestRoot::new();
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            let volumes: Vec<_> = (0..4).map(|i| json!({"name": format!("v{i}"), "emptyDir": {"medium": "Memory"}})).collect();
            let pods: Vec<_> = (0..3).map(|i| pod_with_volumes(&format!("p{i}"), json!(volumes))).collect();
            m.add_pods(pods.clone());
            for p in &pods {
                m.wait_for_attach_and_mount(p).await.expect("mounted");
            }
            m.remove_pods(&pods);
            m.wait_for_all_pods_unmount(&pods).await.expect("torn down");
            m.shutdown();
        });
        let text = log.text();
        for i in 0..3 {
            let lines = |what: &str| text.lines().filter(|l| l.contains(&format!("default/p{i}")) && l.contains(what)).count();
            assert_eq!(lines("every volume of the pod is mounted"), 1, "{text}");
            assert_eq!(lines("every volume of the pod is torn down"), 1, "{text}");
        }
        assert!(!text.contains("SetUp succeeded") && !text.contains("TearDown succeeded"), "no line per volume at info: {text}");
    }
}
