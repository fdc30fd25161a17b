//! Content volumes and subPaths, mounting for real, each test in its own private mount namespace.

#[macro_use]
mod common;

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use kubevol::source::ManifestSource;
use kubevol::status::PodPhase;
use kubevol_testserver::cluster::eventually;
use serde_json::json;

const OBJECTS: &str = r#"
apiVersion: v1
kind: ConfigMap
metadata: {name: app-config}
data:
  app.conf: "level=info"
  extra.conf: "x"
---
apiVersion: v1
kind: Secret
metadata: {name: app-secret}
stringData:
  password: "s3cret"
"#;

fn pod_yaml(tier: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Pod
metadata:
  name: web
  labels: {{app: web, tier: {tier}}}
spec:
  securityContext: {{fsGroup: 2000}}
  containers:
  - name: app
    env:
    - {{name: POD, valueFrom: {{fieldRef: {{fieldPath: metadata.name}}}}}}
    volumeMounts:
    - {{name: config, mountPath: /etc/app}}
    - {{name: config, mountPath: /etc/app.conf, subPath: app.conf}}
    - {{name: secret, mountPath: /run/secret}}
    - {{name: info, mountPath: /etc/info}}
    - {{name: all, mountPath: /etc/all}}
    - {{name: scratch, mountPath: /logs, subPathExpr: "logs/$(POD)"}}
  volumes:
  - {{name: config, configMap: {{name: app-config, items: [{{key: app.conf, path: app.conf, mode: 0600}}, {{key: extra.conf, path: conf.d/extra.conf}}]}}}}
  - {{name: secret, secret: {{secretName: app-secret, defaultMode: 0400}}}}
  - {{name: info, downwardAPI: {{items: [{{path: labels, fieldRef: {{fieldPath: metadata.labels}}}}, {{path: tier, fieldRef: {{fieldPath: "metadata.labels['tier']"}}}}]}}}}
  - {{name: all, projected: {{sources: [{{configMap: {{name: app-config, items: [{{key: app.conf, path: cfg}}]}}}}, {{secret: {{name: app-secret}}}}, {{downwardAPI: {{items: [{{path: name, fieldRef: {{fieldPath: metadata.name}}}}]}}}}]}}}}
  - {{name: scratch, emptyDir: {{}}}}
"#
    )
}

async fn wait_for_file(path: &Path, want: &str, what: &str) -> Duration {
    let start = Instant::now();
    loop {
        if fs::read_to_string(path).is_ok_and(|s| s == want) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "{what}: {} never became {want:?} (is {:?})",
            path.display(),
            fs::read_to_string(path)
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

mount_test! {
    fn content_volumes_from_manifests_with_live_updates_and_sub_paths() {
        let root = TestRoot::new();
        let manifests = root.manifests();
        write_manifest(&manifests, "objects.yaml", OBJECTS);
        write_manifest(&manifests, "pod.yaml", &pod_yaml("front"));
        runtime().block_on(async {
            // No safety-net resync within the test: every update must arrive by its own event.
            let m = manager(root.path(), |c| c.resync_period = Duration::from_secs(3600));
            let source = ManifestSource::new(&manifests);
            let _watch = source.listen(m.store().sink(ManifestSource::NAME)).await.expect("watch manifests");
            // The manifest pod, by the name its UID derives from.
            let p = common::pod(json!({"metadata": {"name": "web", "namespace": "default"}, "spec": {"containers": []}}));
            let uid = kubevol::pod_uid(&p);
            // The directory is read file by file while the manager runs: the pod may be seen
            // before its objects and fail once; their arrival retries it at once.
            let status = wait_for_status(&m, &p, 120, |s| s.phase == PodPhase::Ready).await;
            assert_eq!(status.phase, PodPhase::Ready, "{status:#?}");

            let pod_dir = m.config().root_dir.join(format!("pods/{uid}"));
            let vols = m.mounted_volumes_for_pod(&uid);
            for name in ["config", "secret", "info", "all"] {
                assert!(vols[name].read_only, "{name} is always read-only");
            }
            assert!(!vols["scratch"].read_only);
            let config = pod_dir.join("volumes/kubernetes.io~configmap/config");
            assert_eq!(vols["config"].path, config);
            assert_eq!(fs::read_to_string(config.join("app.conf")).unwrap(), "level=info");
            assert_eq!(fs::read_to_string(config.join("conf.d/extra.conf")).unwrap(), "x");
            assert_eq!(fs::read_link(config.join("conf.d")).unwrap(), PathBuf::from("..data/conf.d"));
            let f = fs::metadata(config.join("app.conf")).unwrap();
            assert_eq!((f.mode() & 0o7777, f.gid()), (0o640, 2000), "item mode 0600 plus fsGroup read");

            let secret = pod_dir.join("volumes/kubernetes.io~secret/secret");
            assert_eq!(fs::read_to_string(secret.join("password")).unwrap(), "s3cret");
            assert_eq!(fs::metadata(secret.join("password")).unwrap().mode() & 0o7777, 0o440);
            let mounts = mounts_under(&pod_dir);
            let fstype = |p: &Path| mounts.iter().find(|m| m.0 == p).map(|m| m.1.clone());
            assert_eq!(fstype(&secret).as_deref(), Some("tmpfs"), "secrets live on a tmpfs");
            assert_eq!(fstype(&pod_dir.join("volumes/kubernetes.io~projected/all")).as_deref(), Some("tmpfs"));
            assert_eq!(fstype(&config), None, "configMaps live on disk");

            let info = pod_dir.join("volumes/kubernetes.io~downward-api/info");
            assert_eq!(fstype(&info).as_deref(), Some("tmpfs"), "downwardAPI volumes live on a tmpfs, as the kubelet's");
            assert_eq!(fs::read_to_string(info.join("labels")).unwrap(), "app=\"web\"\ntier=\"front\"");
            let all = pod_dir.join("volumes/kubernetes.io~projected/all");
            assert_eq!(fs::read_to_string(all.join("cfg")).unwrap(), "level=info");
            assert_eq!(fs::read_to_string(all.join("password")).unwrap(), "s3cret");
            assert_eq!(fs::read_to_string(all.join("name")).unwrap(), "web");

            // subPath of a configMap key (a link into ..data, resolved inside the volume) and a
            // subPathExpr on an emptyDir, created because it is missing.
            let subs = &vols["config"].sub_paths;
            assert_eq!(subs.len(), 1, "{subs:?}");
            assert_eq!(subs[0].path, pod_dir.join("volume-subpaths/config/app/1"));
            assert_eq!(fs::read_to_string(&subs[0].path).unwrap(), "level=info");
            let scratch = &vols["scratch"].sub_paths[0];
            assert_eq!((scratch.sub_path.as_str(), scratch.index), ("logs/web", 5));
            fs::write(scratch.path.join("out.log"), "hello").unwrap();
            assert_eq!(fs::read_to_string(pod_dir.join("volumes/kubernetes.io~empty-dir/scratch/logs/web/out.log")).unwrap(), "hello");

            // Live update of the ConfigMap: the new content, atomically, event-driven.
            let data_before = fs::read_link(config.join("..data")).unwrap();
            let secret_before = fs::read_link(secret.join("..data")).unwrap();
            write_manifest(&manifests, "objects.yaml", &OBJECTS.replace("level=info", "level=debug"));
            let took = wait_for_file(&config.join("app.conf"), "level=debug", "configMap update").await;
            wait_for_file(&all.join("cfg"), "level=debug", "projected update").await;
            eprintln!("configMap update visible after {took:?}");
            assert_ne!(fs::read_link(config.join("..data")).unwrap(), data_before);
            assert_eq!(fs::read_link(secret.join("..data")).unwrap(), secret_before, "the unchanged secret was not rewritten");
            assert_eq!(fs::read_to_string(&subs[0].path).unwrap(), "level=info", "a subPath keeps the file it was made from, as in the kubelet");
            wait_for_one_payload(&m, &config, "the configMap's old payload").await;

            // Live update of the Secret, on its tmpfs and in the projected volume.
            write_manifest(&manifests, "objects.yaml", &OBJECTS.replace("level=info", "level=debug").replace("s3cret", "rotated"));
            wait_for_file(&secret.join("password"), "rotated", "secret update").await;
            wait_for_file(&all.join("password"), "rotated", "projected secret update").await;
            assert_eq!(fs::read_to_string(config.join("app.conf")).unwrap(), "level=debug");

            // Live update of the pod's labels.
            write_manifest(&manifests, "pod.yaml", &pod_yaml("back"));
            let took = wait_for_file(&info.join("tier"), "back", "label update").await;
            eprintln!("label update visible after {took:?}");

            // A burst of edits, each landing while the previous rewrite may still run: the last
            // one is written (an edit made during a rewrite is not left for a resync).
            for i in 0..30 {
                write_manifest(&manifests, "objects.yaml", &OBJECTS.replace("level=info", &format!("level={i}")));
                tokio::time::sleep(Duration::from_millis(i % 4)).await;
            }
            wait_for_file(&config.join("app.conf"), "level=29", "last of a burst of updates").await;
            wait_for_file(&all.join("cfg"), "level=29", "last of a burst of updates, projected").await;

            // The pod goes away: subPath mounts first, then the volumes.
            fs::remove_file(manifests.join("pod.yaml")).unwrap();
            let start = Instant::now();
            while pod_dir.exists() {
                assert!(start.elapsed() < Duration::from_secs(120), "pod directory left: {:?}", mounts_under(&pod_dir));
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert!(mounts_under(&m.config().root_dir).is_empty());
            m.shutdown();
        });
    }
}

fn payload_dirs(dir: &Path) -> usize {
    fs::read_dir(dir)
        .unwrap()
        .filter(|e| {
            kubevol_mount::atomic::is_payload_dir_name(
                e.as_ref().unwrap().file_name().as_encoded_bytes(),
            )
        })
        .count()
}

/// Waits until the content volume at `dir` holds one payload. The writer removes the old one
/// just after the swap that makes the new content visible, within the same operation, whose
/// end is announced to status watchers: each announcement is a moment to look again.
async fn wait_for_one_payload(m: &kubevol::VolumeManager, dir: &Path, what: &str) {
    let what = format!("{what} removed from {} (one payload left)", dir.display());
    until_announced(m, 120, &what, || payload_dirs(dir) == 1).await;
}

mount_test! {
    fn missing_objects_fail_clearly_and_mount_when_they_appear() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let m = manager(root.path(), |c| c.backoff.initial = Duration::from_secs(30));
            let p = pod_with_volumes("waiting", json!([
                {"name": "cfg", "configMap": {"name": "later"}},
                {"name": "opt", "secret": {"secretName": "never", "optional": true}},
                {"name": "tok", "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]}},
            ]));
            let uid = m.add_pod(p.clone());
            let s = wait_for_status(&m, &p, 120, |s| {
                s.volumes.iter().filter(|v| v.retry.last_error.is_some()).count() == 2
                    && s.volumes.iter().any(|v| v.name == "opt" && v.state == kubevol::status::VolumePhase::Mounted)
            })
            .await;
            let err = |n: &str| s.volumes.iter().find(|v| v.name == n).and_then(|v| v.retry.last_error.clone()).unwrap_or_default();
            assert!(err("cfg").contains("configMap default/later not found; create it, or set optional: true"), "{s:#?}");
            assert!(err("tok").contains("projected source serviceAccountToken (sources[0]) needs a Kubernetes API server"), "{s:#?}");
            assert!(err("opt").is_empty(), "an optional missing secret is an empty volume");
            let opt = &m.mounted_volumes_for_pod(&uid)["opt"].path;
            assert!(fs::read_link(opt.join("..data")).is_ok(), "an empty payload is still written");

            // The ConfigMap appears: retried at once, not after the 30 s backoff.
            let cm: k8s_openapi::api::core::v1::ConfigMap = serde_json::from_value(json!({"metadata": {"name": "later", "namespace": "default"}, "data": {"k": "v"}})).unwrap();
            let problems = m.library().upsert_objects([kubevol::store::Object::ConfigMap(cm)]);
            assert!(problems.is_empty());
            wait_for_status(&m, &p, 120, |s| s.volumes.iter().any(|v| v.name == "cfg" && v.state == kubevol::status::VolumePhase::Mounted)).await;
            assert_eq!(fs::read_to_string(m.mounted_volumes_for_pod(&uid)["cfg"].path.join("k")).unwrap(), "v");

            // An invalid Secret is reported, and a pod using it fails with the reason.
            let bad: k8s_openapi::api::core::v1::Secret = serde_json::from_value(json!({"metadata": {"name": "bad", "namespace": "default"}, "stringData": {"..x": "v"}})).unwrap();
            let problems = m.library().upsert_objects([kubevol::store::Object::Secret(bad)]);
            assert!(problems[0].contains("Secret default/bad is invalid") && problems[0].contains("data[..x]: Invalid value: \"..x\": must not start with '..'"), "{problems:?}");
            let p2 = pod_with_volumes("uses-bad", json!([{"name": "s", "secret": {"secretName": "bad"}}]));
            m.add_pod(p2.clone());
            let s = wait_for_status(&m, &p2, 120, |s| s.volumes.iter().any(|v| v.retry.last_error.is_some())).await;
            let e = s.volumes[0].retry.last_error.clone().unwrap();
            assert!(e.contains("secret default/bad is invalid: library API: data[..x]"), "{e}");
            m.remove_pod(&p);
            m.remove_pod(&p2);
            m.wait_for_unmount(&p).await.expect("unmounted");
            m.shutdown();
        });
    }
}

mount_test! {
    fn an_object_in_a_broken_file_fails_its_pods_with_the_files_error_until_fixed() {
        let root = TestRoot::new();
        let manifests = root.manifests();
        let secret = |value: &str| format!("apiVersion: v1\nkind: Secret\nmetadata: {{name: creds}}\ndata:\n  password: {value:?}\n");
        write_manifest(&manifests, "creds.yaml", &secret("not base64!"));
        write_manifest(&manifests, "pod.yaml", "apiVersion: v1\nkind: Pod\nmetadata: {name: app}\nspec:\n  containers: [{name: c, volumeMounts: [{name: creds, mountPath: /c}, {name: maybe, mountPath: /m}]}]\n  volumes:\n  - {name: creds, secret: {secretName: creds}}\n  - {name: maybe, secret: {secretName: creds, optional: true}}\n");
        runtime().block_on(async {
            let m = manager(root.path(), |c| c.backoff.initial = Duration::from_secs(30));
            let _watch = ManifestSource::new(&manifests).listen(m.store().sink(ManifestSource::NAME)).await.unwrap();
            let p = common::pod(json!({"metadata": {"name": "app", "namespace": "default"}, "spec": {"containers": []}}));
            let s = wait_for_status(&m, &p, 120, |s| s.volumes.iter().filter(|v| v.retry.last_error.is_some()).count() == 2).await;
            let file = manifests.canonicalize().unwrap().join("creds.yaml");
            for v in &s.volumes {
                // Not "not found": the Secret is there, in a file that does not load; an
                // optional volume is not mounted empty in its place.
                let e = v.retry.last_error.clone().unwrap();
                assert!(e.contains(&format!("volume {:?} of pod default/app", v.name)), "{e}");
                assert!(e.contains(&format!("secret default/creds is invalid: it is defined in {}: document 1, line 5, column 13: invalid Secret: data.password:", file.display())), "{e}");
                assert!(e.ends_with("that file is not applied while it has an error: fix it"), "{e}");
            }
            // Fixing the file mounts both at once, not after the 30 s backoff.
            write_manifest(&manifests, "creds.yaml", &secret("aHVudGVyMg=="));
            wait_for_status(&m, &p, 120, |s| s.phase == PodPhase::Ready).await;
            let uid = kubevol::pod_uid(&p);
            let vols = m.mounted_volumes_for_pod(&uid);
            for name in ["creds", "maybe"] {
                assert_eq!(fs::read_to_string(vols[name].path.join("password")).unwrap(), "hunter2");
            }
            m.shutdown();
        });
    }
}

mount_test! {
    fn a_planted_data_link_is_refused_and_the_outside_untouched() {
        let root = TestRoot::new();
        let outside = root.path().join("outside");
        fs::create_dir(&outside).unwrap();
        fs::write(outside.join("canary"), "keep").unwrap();
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            let cm = |v: &str| -> kubevol::store::Object {
                kubevol::store::Object::ConfigMap(serde_json::from_value(json!({"metadata": {"name": "c", "namespace": "default"}, "data": {"canary": v}})).unwrap())
            };
            m.library().upsert_objects([cm("one")]);
            let p = pod_with_volumes("victim", json!([{"name": "cfg", "configMap": {"name": "c"}}]));
            let uid = m.add_pod(p.clone());
            m.wait_for_attach_and_mount(&p).await.expect("mounted");
            let vol = m.mounted_volumes_for_pod(&uid)["cfg"].path.clone();
            let payload = vol.join(fs::read_link(vol.join("..data")).unwrap());
            fs::remove_file(vol.join("..data")).unwrap();
            std::os::unix::fs::symlink(&outside, vol.join("..data")).unwrap();
            m.library().upsert_objects([cm("two")]);
            let s = wait_for_status(&m, &p, 120, |s| s.volumes[0].retry.last_error.is_some()).await;
            let e = s.volumes[0].retry.last_error.clone().unwrap();
            assert!(e.contains("..data: points to") && e.contains("kubevol reads, writes and removes nothing through it: remove it"), "{e}");
            assert_eq!(fs::read_to_string(outside.join("canary")).unwrap(), "keep");
            assert_eq!(fs::read_dir(&outside).unwrap().count(), 1);
            assert!(payload.exists(), "the old payload is kept while ..data is not ours");
            // Removing the planted link lets the next write converge.
            fs::remove_file(vol.join("..data")).unwrap();
            m.library().upsert_objects([cm("three")]);
            wait_for_file(&vol.join("canary"), "three", "after the link is removed").await;
            assert_eq!(fs::read_to_string(outside.join("canary")).unwrap(), "keep");
            m.remove_pod(&p);
            m.wait_for_unmount(&p).await.expect("unmounted");
            assert!(outside.join("canary").exists());
            m.shutdown();
        });
    }
}

/// A host directory with a real subdirectory and links that lead out of it.
fn hostile_host_dir(root: &Path) -> (PathBuf, PathBuf) {
    let host = root.join("host");
    let outside = root.join("outside");
    fs::create_dir_all(host.join("real")).unwrap();
    fs::write(host.join("real/inside"), "inside").unwrap();
    fs::create_dir(&outside).unwrap();
    fs::write(outside.join("canary"), "keep").unwrap();
    std::os::unix::fs::symlink("/", host.join("to-root")).unwrap();
    std::os::unix::fs::symlink("../", host.join("to-parent")).unwrap();
    std::os::unix::fs::symlink(outside.join("canary"), host.join("to-file")).unwrap();
    std::os::unix::fs::symlink("real/../../outside", host.join("sneaky")).unwrap();
    (host, outside)
}

mount_test! {
    fn sub_paths_leading_out_of_the_volume_are_refused() {
        let root = TestRoot::new();
        let (host, outside) = hostile_host_dir(root.path());
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            let mounts: Vec<serde_json::Value> = ["to-root", "to-parent", "to-file", "sneaky", "to-root/etc"]
                .iter()
                .enumerate()
                .map(|(i, s)| json!({"name": "h", "mountPath": format!("/m{i}"), "subPath": s}))
                .collect();
            for (i, mount) in mounts.iter().enumerate() {
                let p = common::pod(json!({
                    "metadata": {"name": format!("hostile-{i}"), "namespace": "default"},
                    "spec": {"containers": [{"name": "c", "volumeMounts": [mount]}],
                             "volumes": [{"name": "h", "hostPath": {"path": host, "type": "Directory"}}]},
                }));
                m.add_pod(p.clone());
                let s = wait_for_status(&m, &p, 120, |s| s.volumes[0].retry.last_error.is_some()).await;
                let e = s.volumes[0].retry.last_error.clone().unwrap();
                assert!(e.contains("leads outside the volume"), "{mount}: {e}");
                assert!(e.contains("container \"c\", volumeMounts[0]: subPath"), "{e}");
                m.remove_pod(&p);
                m.wait_for_unmount(&p).await.expect("torn down");
            }
            assert_eq!(fs::read_to_string(outside.join("canary")).unwrap(), "keep");
            assert!(mounts_under(root.path()).is_empty(), "{:?}", mounts_under(root.path()));
            // A link that stays inside the volume is fine.
            std::os::unix::fs::symlink("real", host.join("alias")).unwrap();
            let p = common::pod(json!({
                "metadata": {"name": "fine", "namespace": "default"},
                "spec": {"containers": [{"name": "c", "volumeMounts": [{"name": "h", "mountPath": "/m", "subPath": "alias"}]}],
                         "volumes": [{"name": "h", "hostPath": {"path": host, "type": "Directory"}}]},
            }));
            let uid = m.add_pod(p.clone());
            m.wait_for_attach_and_mount(&p).await.expect("mounted");
            let sub = &m.mounted_volumes_for_pod(&uid)["h"].sub_paths[0];
            assert_eq!(fs::read_to_string(sub.path.join("inside")).unwrap(), "inside");
            m.remove_pod(&p);
            m.wait_for_unmount(&p).await.expect("unmounted");
            assert!(mounts_under(root.path()).is_empty());
            assert!(host.join("real/inside").exists(), "teardown of a hostPath never removes host data");
            m.shutdown();
        });
    }
}

mount_test! {
    /// The race made to happen: the subPath is opened, then swapped for a link to `/` before
    /// the mount, and the mount is still of the directory that was opened (the same inode),
    /// never of what the path leads to by then.
    fn a_sub_path_swapped_between_its_open_and_its_mount_mounts_what_was_opened() {
        use std::os::fd::AsFd;
        use std::os::unix::fs::MetadataExt;
        use kubevol_mount::{safe::Dir, subpath, LinuxMounter, Mounter};
        let root = TestRoot::new();
        let (host, _outside) = hostile_host_dir(root.path());
        fs::rename(host.join("real"), host.join("d")).unwrap();
        std::os::unix::fs::symlink("/", host.join("l")).unwrap();
        let volume = Dir::open(&host).unwrap();
        let pod_dir = Dir::open(root.path()).unwrap();
        let (source, is_dir) = subpath::open_sub_path(&volume, "d").unwrap();
        let opened = rustix::fs::fstat(&source).unwrap();
        // Between the open and the mount: `d` becomes the link to `/`.
        rustix::fs::renameat_with(volume.fd(), "d", volume.fd(), "l", rustix::fs::RenameFlags::EXCHANGE).unwrap();
        assert_eq!(fs::read_link(host.join("d")).unwrap(), Path::new("/"), "the swap happened");
        let target = subpath::SubPathTarget { pod_dir: &pod_dir, volume_name: "v", container: "c", index: 0 };
        let mounted = subpath::bind_opened(&LinuxMounter, source.as_fd(), is_dir, &host.join("d"), &target).unwrap();
        let at = fs::metadata(&mounted).unwrap();
        assert_eq!((at.dev(), at.ino()), (opened.st_dev, opened.st_ino), "the mount is of the directory opened");
        let names: Vec<String> = fs::read_dir(&mounted).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        assert_eq!(names, vec!["inside"]);
        LinuxMounter.unmount(&mounted).unwrap();
        assert!(mounts_under(root.path()).is_empty());
    }
}

mount_test! {
    fn a_sub_path_swapped_with_a_link_in_a_tight_loop_never_mounts_outside() {
        use kubevol_mount::{safe::Dir, subpath, LinuxMounter, Mounter};
        let root = TestRoot::new();
        let (host, _outside) = hostile_host_dir(root.path());
        // `d` and `l` trade places as fast as the kernel allows: `d` is the real directory one
        // moment and a link to / the next.
        fs::rename(host.join("real"), host.join("d")).unwrap();
        std::os::unix::fs::symlink("/", host.join("l")).unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let swapper = {
            let stop = stop.clone();
            let host = host.clone();
            std::thread::spawn(move || {
                let dir = Dir::open(&host).unwrap();
                let mut swaps = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    rustix::fs::renameat_with(dir.fd(), "d", dir.fd(), "l", rustix::fs::RenameFlags::EXCHANGE).unwrap();
                    swaps += 1;
                }
                swaps
            })
        };
        let volume = Dir::open(&host).unwrap();
        let pod_dir = Dir::open(root.path()).unwrap();
        let (mut mounted, mut refused) = (0, 0);
        // The safety property is asserted on every attempt. Both outcomes show that the race
        // was really run; a loaded machine may need many attempts for that, so they go on
        // (at least 300) until both are seen or a generous time has passed.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
        let mut i = 0;
        while i < 300 || ((mounted == 0 || refused == 0) && std::time::Instant::now() < deadline) {
            i += 1;
            match subpath::bind_sub_path(&LinuxMounter, &volume, "d", &pod_dir, "v", "c", i) {
                Ok(target) => {
                    let names: Vec<String> = fs::read_dir(&target).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
                    assert_eq!(names, vec!["inside"], "attempt {i} mounted something else: {names:?}");
                    LinuxMounter.unmount(&target).unwrap();
                    mounted += 1;
                }
                Err(e @ kubevol_mount::MountError::Unsafe { .. }) => {
                    assert!(e.to_string().contains("leads outside the volume"), "{e}");
                    refused += 1;
                }
                // The target kind flips with the source (file vs directory) only if a previous
                // attempt left a file; any other error is a failure.
                Err(e) => panic!("attempt {i}: {e}"),
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let swaps = swapper.join().unwrap();
        eprintln!("{swaps} swaps, {i} attempts: {mounted} mounts of the real directory, {refused} refusals");
        if mounted == 0 || refused == 0 {
            // Not a failure of kubevol: the scheduler never let the two threads interleave.
            eprintln!("note: only one outcome was seen in {i} attempts; the machine never interleaved the swap and the mount");
        }
        assert!(mounts_under(root.path()).is_empty());
    }
}

mount_test! {
    fn fs_group_on_an_empty_dir_honours_the_policy_never_follows_links_or_leaves_the_filesystem() {
        use kubevol_mount::safe::{Dir, FsGroupPolicy};
        use kubevol_mount::{LinuxMounter, MountOptions, Mounter};
        let root = TestRoot::new();
        let outside = root.path().join("outside");
        fs::create_dir(&outside).unwrap();
        fs::write(outside.join("canary"), "keep").unwrap();
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            let mut p = pod_with_volumes("grouped", json!([{"name": "data", "emptyDir": {}}]));
            p.spec.as_mut().unwrap().security_context = Some(serde_json::from_value(json!({"fsGroup": 3000})).unwrap());
            let uid = m.add_pod(p.clone());
            m.wait_for_attach_and_mount(&p).await.expect("mounted");
            let vol = m.mounted_volumes_for_pod(&uid)["data"].path.clone();
            let st = fs::metadata(&vol).unwrap();
            assert_eq!((st.gid(), st.mode() & 0o7777), (3000, 0o2777), "root: group, set-group-ID");

            // What a pod might leave there: a file, a directory, a link out, a nested mount.
            fs::create_dir(vol.join("dir")).unwrap();
            fs::write(vol.join("dir/f"), "x").unwrap();
            fs::set_permissions(vol.join("dir/f"), std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
            // Made by another group than the set-group-ID root would give them.
            std::os::unix::fs::chown(vol.join("dir"), None, Some(0)).unwrap();
            std::os::unix::fs::chown(vol.join("dir/f"), None, Some(0)).unwrap();
            fs::set_permissions(vol.join("dir"), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
            std::os::unix::fs::symlink(outside.join("canary"), vol.join("link")).unwrap();
            fs::create_dir(vol.join("nested")).unwrap();
            LinuxMounter.mount("tmpfs", &vol.join("nested"), "tmpfs", &MountOptions::default()).unwrap();
            fs::write(vol.join("nested/other-fs"), "y").unwrap();

            let dir = Dir::open(&vol).unwrap();
            assert!(!dir.apply_fs_group(3000, false, FsGroupPolicy::OnRootMismatch).unwrap(), "root matches: nothing walked");
            assert_eq!(fs::metadata(vol.join("dir/f")).unwrap().gid(), 0, "OnRootMismatch left the tree alone");
            assert!(dir.apply_fs_group(3000, false, FsGroupPolicy::Always).unwrap());
            let f = fs::metadata(vol.join("dir/f")).unwrap();
            assert_eq!((f.gid(), f.mode() & 0o7777), (3000, 0o660), "group read/write added");
            let d = fs::metadata(vol.join("dir")).unwrap();
            assert_eq!((d.gid(), d.mode() & 0o2000), (3000, 0o2000));
            let canary = fs::metadata(outside.join("canary")).unwrap();
            assert_eq!((canary.gid(), canary.mode() & 0o7777), (0, 0o644), "the link was not followed");
            assert_eq!(fs::metadata(vol.join("nested/other-fs")).unwrap().gid(), 0, "the nested filesystem was not entered");
            LinuxMounter.unmount(&vol.join("nested")).unwrap();
            m.remove_pod(&p);
            m.wait_for_unmount(&p).await.expect("unmounted");
            m.shutdown();
        });
    }
}

mount_test! {
    fn a_full_volume_keeps_its_previous_content() {
        // A secret volume lives on a tmpfs sized by the pod's memory limit: 64Ki here.
        let root = TestRoot::new();
        let manifests = root.manifests();
        let secret = |value: &str| {
            format!("apiVersion: v1\nkind: Secret\nmetadata: {{name: big}}\nstringData: {{value: \"{value}\"}}\n")
        };
        write_manifest(&manifests, "secret.yaml", &secret("small"));
        write_manifest(
            &manifests,
            "pod.yaml",
            "apiVersion: v1\nkind: Pod\nmetadata: {name: full}\nspec:\n  containers: [{name: c, resources: {limits: {memory: 64Ki}}, volumeMounts: [{name: s, mountPath: /s}]}]\n  volumes: [{name: s, secret: {secretName: big}}]\n",
        );
        runtime().block_on(async {
            // No retry of the failed write while the test looks at what it left (a change to
            // the Secret resets the backoff, so the last update is not delayed).
            let m = manager(root.path(), |c| {
                c.backoff.initial = Duration::from_secs(60);
                c.backoff.max = Duration::from_secs(60);
            });
            let source = ManifestSource::new(&manifests);
            let _watch = source.listen(m.store().sink(ManifestSource::NAME)).await.expect("watch manifests");
            let p = common::pod(json!({"metadata": {"name": "full", "namespace": "default"}, "spec": {"containers": []}}));
            wait_for_status(&m, &p, 120, |s| s.phase == PodPhase::Ready).await;
            let uid = kubevol::pod_uid(&p);
            let dir = m.config().root_dir.join(format!("pods/{uid}/volumes/kubernetes.io~secret/s"));
            assert_eq!(fs::read_to_string(dir.join("value")).unwrap(), "small");

            // 200 KiB does not fit: the write fails with ENOSPC and the old content stays.
            write_manifest(&manifests, "secret.yaml", &secret(&"x".repeat(200 * 1024)));
            let s = wait_for_status(&m, &p, 120, |s| {
                s.volumes[0].retry.last_error.as_deref().is_some_and(|e| e.contains("No space left on device"))
            })
            .await;
            assert!(s.volumes[0].retry.last_error.as_deref().unwrap().contains("full"), "{s:#?}");
            assert_eq!(fs::read_to_string(dir.join("value")).unwrap(), "small", "the previous content is intact");
            assert_eq!(payload_dirs(&dir), 1, "the half-written payload is removed");
            assert!(!dir.join("..data_tmp").exists());

            // Once it fits again, the update lands.
            write_manifest(&manifests, "secret.yaml", &secret("fits"));
            wait_for_file(&dir.join("value"), "fits", "secret update after a full disk").await;
            wait_for_one_payload(&m, &dir, "the payload before the update").await;
        });
    }
}

/// An issuer of tokens, making the manager a node of a cluster as far as projected sources go.
struct Issuer;

impl kubevol::tokens::TokenIssuer for Issuer {
    fn issue(
        &self,
        _: kubevol::tokens::TokenSpec,
    ) -> kubevol::BoxFuture<Result<kubevol::tokens::IssuedToken, kubevol::error::ApiError>> {
        Box::pin(async {
            Ok(kubevol::tokens::IssuedToken {
                token: "t".into(),
                valid_for: Duration::from_secs(3600),
            })
        })
    }
}

mount_test! {
    /// A podCertificate projected source: standalone mode has no API server for it; an agent
    /// that issues tokens but sets no place for PodCertificateRequests cannot ask either.
    /// Either way the pod fails for good with a message that says which (cluster mode asks the
    /// API server: `cluster.rs`).
    fn a_pod_certificate_source_without_a_place_to_ask_fails_for_good() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let volume = json!([{"name": "certs", "projected": {"sources": [{"podCertificate": {"signerName": "example.com/signer", "keyType": "ED25519", "credentialBundlePath": "bundle.pem"}}]}}]);
            let m = manager(root.path(), |_| {});
            let p = pod_with_volumes("standalone", volume.clone());
            m.add_pod(p.clone());
            let s = wait_for_status(&m, &p, 120, |s| s.volumes[0].retry.permanent).await;
            assert!(s.volumes[0].retry.last_error.as_deref().unwrap().contains("projected source podCertificate (sources[0]) needs a Kubernetes API server"), "{s:#?}");
            m.shutdown();
            let m = restart(m, root.path(), |_| {}).await;
            m.set_token_issuer(std::sync::Arc::new(Issuer));
            let p = pod_with_volumes("clustered", volume);
            m.add_pod(p.clone());
            let s = wait_for_status(&m, &p, 120, |s| s.volumes[0].retry.permanent).await;
            assert!(s.volumes[0].retry.last_error.as_deref().unwrap().contains("projected source podCertificate (sources[0]): this node agent makes no PodCertificateRequests"), "{s:#?}");
            m.shutdown();
        });
    }
}

/// The API server's side of PodCertificateRequests with a clock of the test's own: every
/// request is issued at once, its chain naming the request, and due for refresh a second
/// later. (A real server refuses a `beginRefreshAt` sooner than ten minutes after the
/// certificate's start, so only this can make a refresh happen within a test; the issuing
/// itself is tested against the real server in the cluster tests.)
#[derive(Default)]
struct QuickSigner {
    made: std::sync::Mutex<usize>,
}

impl QuickSigner {
    fn chain(request: &str) -> String {
        use base64::Engine as _;
        let body = base64::engine::general_purpose::STANDARD.encode(request);
        format!("-----BEGIN CERTIFICATE-----\n{body}\n-----END CERTIFICATE-----\n")
    }
}

impl kubevol::certificates::CertificateRequests for QuickSigner {
    fn create(
        &self,
        _: String,
        _: serde_json::Value,
    ) -> kubevol::BoxFuture<Result<String, kubevol::error::ApiError>> {
        let mut made = self.made.lock().unwrap();
        *made += 1;
        let name = format!("req-{made}");
        Box::pin(async move { Ok(name) })
    }

    fn get(
        &self,
        namespace: String,
        name: String,
    ) -> kubevol::BoxFuture<
        Result<Option<kubevol::certificates::PodCertificateRequest>, kubevol::error::ApiError>,
    > {
        let at = |secs: i64| {
            jiff::Timestamp::now()
                .checked_add(jiff::SignedDuration::from_secs(secs))
                .unwrap()
                .to_string()
        };
        let request = json!({
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"signerName": "kubevol.io/quick", "podName": "web", "podUID": "u", "serviceAccountName": "default",
                     "serviceAccountUID": "sa", "nodeName": "n", "nodeUID": "nu"},
            "status": {"conditions": [{"type": "Issued", "status": "True", "reason": "Issued", "message": "", "lastTransitionTime": at(0)}],
                       "certificateChain": Self::chain(&name), "notBefore": at(0), "beginRefreshAt": at(1), "notAfter": at(3600)}});
        Box::pin(async move { Ok(Some(serde_json::from_value(request).unwrap())) })
    }

    fn service_account_uid(
        &self,
        _: String,
        _: String,
    ) -> kubevol::BoxFuture<Result<String, kubevol::error::ApiError>> {
        Box::pin(async { Ok("sa-uid".to_string()) })
    }

    fn refresh_spread(&self) -> Duration {
        Duration::ZERO
    }
}

mount_test! {
    /// A pod certificate reaching its `beginRefreshAt` is refreshed in the volume itself, with
    /// nothing about the pod changing: a new key and the new request's chain replace the files
    /// (atomically, the key and the chain of one request together), again at each refresh.
    fn a_pod_certificate_due_for_refresh_is_rewritten_in_the_volume() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            m.set_certificate_requests(std::sync::Arc::new(QuickSigner::default()));
            // The Node, whose UID goes into each request.
            let node = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": m.config().node_name, "uid": "5f0c6a9e-0000-4000-8000-000000000001"}});
            m.library().upsert_objects(vec![kubevol::store::Object::Node(serde_json::from_value(node).unwrap())]);
            let pod = pod_with_volumes("web", json!([{"name": "certs", "projected": {"sources": [
                {"podCertificate": {"signerName": "kubevol.io/quick", "keyType": "ED25519", "keyPath": "tls.key", "certificateChainPath": "tls.crt"}}]}}]));
            m.add_pod(pod.clone());
            m.wait_for_attach_and_mount(&pod).await.expect("mounted with the first certificate");
            let dir = m.mounted_volumes_for_pod(&kubevol::pod_uid(&pod))["certs"].path.clone();
            let read = || (fs::read_to_string(dir.join("tls.key")).unwrap(), fs::read_to_string(dir.join("tls.crt")).unwrap());
            let first = read();
            assert_eq!(first.1, QuickSigner::chain("req-1"));
            let mut seen = vec![first.clone()];
            for (n, request) in ["req-2", "req-3"].into_iter().enumerate() {
                let deadline = Instant::now() + Duration::from_secs(120);
                loop {
                    let now = read();
                    if now.1 == QuickSigner::chain(request) {
                        assert!(seen.iter().all(|s| s.0 != now.0), "refresh {}: a new key with the new chain", n + 1);
                        seen.push(now);
                        break;
                    }
                    assert!(seen.iter().any(|s| s == &now), "the key and chain of one request, never mixed: {now:?}");
                    assert!(Instant::now() < deadline, "refresh {} never reached the volume", n + 1);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            m.shutdown();
        });
    }
}

mount_test! {
    /// A ConfigMap updated ten times a second for three seconds, read by twenty pods: each
    /// volume is written again at most once a second (the latest version wins), not ten
    /// times, and ends with the last version; an update after a quiet second reaches every
    /// volume at once (within a second, not after a turn).
    fn an_object_updated_often_is_written_at_most_once_a_second_per_volume() {
        const PODS: usize = 20;
        let root = TestRoot::new();
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            let cm = |v: usize| kubevol::store::Object::ConfigMap(serde_json::from_value(json!({"metadata": {"name": "hot", "namespace": "default"}, "data": {"v": v.to_string()}})).unwrap());
            m.library().upsert_objects([cm(0)]);
            let pods: Vec<_> = (0..PODS).map(|i| pod_with_volumes(&format!("reader-{i}"), json!([{"name": "cfg", "configMap": {"name": "hot"}}]))).collect();
            let mut dirs = Vec::new();
            for p in &pods {
                let uid = m.add_pod(p.clone());
                m.wait_for_attach_and_mount(p).await.expect("mounted");
                dirs.push(m.mounted_volumes_for_pod(&uid)["cfg"].path.clone());
            }
            let reads = |want: usize| dirs.iter().all(|d| fs::read_to_string(d.join("v")).is_ok_and(|v| v == want.to_string()));
            let before = volume_writes(&m, "kubernetes.io/configmap");
            let start = Instant::now();
            for v in 1..=30 {
                m.library().upsert_objects([cm(v)]);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            // Each second of updates is one turn, and the first and the last change each one
            // more: whatever the machine's speed, no more writes than that per volume. The bound
            // is the updates' window alone; reaching the last version is timed apart.
            let window = start.elapsed();
            eventually("the last version in every volume", 120, || async { reads(30) }).await;
            let turns = window.as_secs() + 2;
            let writes = volume_writes(&m, "kubernetes.io/configmap") - before;
            println!("{writes} writes of {PODS} volumes for 30 updates in {:.1?}", start.elapsed());
            assert!(writes <= PODS as u64 * turns, "{writes} writes for {PODS} volumes in {turns} turns");

            // Quiet for a turn: the next update is written at once, not held to a turn (the
            // populator's held-back count does not grow).
            tokio::time::sleep(Duration::from_millis(1100)).await;
            let held = m.content_rewrites_held();
            m.library().upsert_objects([cm(31)]);
            eventually("the update after a quiet turn in every volume", 120, || async { reads(31) }).await;
            assert_eq!(m.content_rewrites_held(), held, "an update after a quiet turn waits for no turn");
            m.shutdown();
        });
    }
}

mount_test! {
    /// A volume failing for an object that is missing is tried again when that object comes,
    /// not whenever another object of its pod does: ten ConfigMaps its sibling volumes read,
    /// created one by one, leave it to its own backoff.
    fn a_failing_volume_is_retried_for_what_it_reads_not_for_its_siblings_objects() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let m = manager(root.path(), |c| {
                c.backoff.initial = Duration::from_secs(2);
                c.backoff.max = Duration::from_secs(2);
            });
            let cm = |name: &str| kubevol::store::Object::ConfigMap(serde_json::from_value(json!({"metadata": {"name": name, "namespace": "default"}, "data": {"k": "v"}})).unwrap());
            let mut volumes = vec![json!({"name": "stuck", "configMap": {"name": "missing"}})];
            volumes.extend((0..10).map(|i| json!({"name": format!("v{i}"), "configMap": {"name": format!("cm-{i}")}})));
            let p = pod_with_volumes("app", serde_json::Value::Array(volumes));
            // Each attempt that fails is one more of the same event (folded, counted).
            let failures = |m: &kubevol::VolumeManager| -> u32 {
                m.events().iter().filter(|e| e.reason == "FailedMount" && e.message.contains("volume \"stuck\"")).map(|e| e.count).sum()
            };
            m.add_pod(p.clone());
            wait_for_status(&m, &p, 120, |s| s.volumes.iter().any(|v| v.name == "stuck" && v.retry.failures >= 1)).await;
            assert!(failures(&m) >= 1, "{:#?}", m.events());
            let start = Instant::now();
            for i in 0..10 {
                m.library().upsert_objects([cm(&format!("cm-{i}"))]);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            wait_for_status(&m, &p, 120, |s| s.volumes.iter().filter(|v| v.name != "stuck").all(|v| v.state == kubevol::status::VolumePhase::Mounted)).await;
            // Its own backoff (2 s) allows one failure every two seconds, and one more.
            let allowed = 2 + start.elapsed().as_secs() as u32 / 2;
            let seen = failures(&m);
            assert!(seen <= allowed, "{seen} failures of the volume whose object is missing, {allowed} allowed");
            // Its own object comes: at once, not after the backoff.
            m.library().upsert_objects([cm("missing")]);
            m.wait_for_attach_and_mount(&p).await.expect("mounted once its object exists");
            m.shutdown();
        });
    }
}

mount_test! {
    /// A Secret's tmpfs is as large as its payload needs (each file in whole pages, twice, and
    /// 1 MiB), not half the node's memory; it grows with the Secret, keeping the volume, and is
    /// no larger than the pod's memory limit.
    fn a_secrets_tmpfs_is_sized_by_its_payload_and_grows_with_it() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            let secret = |name: &str, kib: usize| kubevol::store::Object::Secret(serde_json::from_value(json!({"metadata": {"name": name, "namespace": "default"},
                "stringData": {"a": "x".repeat(kib << 10), "b": "y".repeat(kib << 10), "c": "z".repeat(kib << 10)}})).unwrap());
            m.library().upsert_objects([secret("big", 100), secret("limited", 100)]);
            let p = pod_with_volumes("app", json!([{"name": "s", "secret": {"secretName": "big"}}]));
            let mut q = pod_with_volumes("small", json!([{"name": "s", "secret": {"secretName": "limited"}}]));
            q.spec.as_mut().unwrap().containers[0].resources = Some(serde_json::from_value(json!({"limits": {"memory": "1Mi"}})).unwrap());
            for pod in [&p, &q] {
                m.add_pod(pod.clone());
                m.wait_for_attach_and_mount(pod).await.expect("mounted");
            }
            let size_of = |pod: &k8s_openapi::api::core::v1::Pod| -> u64 {
                let dir = m.mounted_volumes_for_pod(&kubevol::pod_uid(pod))["s"].path.clone();
                let st = rustix::fs::statfs(&dir).unwrap();
                st.f_blocks * st.f_bsize as u64
            };
            let pages = |kib: u64| 3 * (kib << 10);
            assert_eq!(size_of(&p), 2 * pages(100) + (1 << 20), "the payload's pages twice and 1 MiB");
            assert_eq!(size_of(&q), 1 << 20, "no more than the pod's memory limit");

            let dir = m.mounted_volumes_for_pod(&kubevol::pod_uid(&p))["s"].path.clone();
            // Grown to 900 KiB (a Secret holds at most 1 MiB).
            m.library().upsert_objects([secret("big", 300)]);
            eventually("the grown Secret written", 120, || async { fs::read_to_string(dir.join("a")).map_or(0, |a| a.len()) == 300 << 10 }).await;
            assert_eq!(size_of(&p), 2 * pages(300) + (1 << 20), "grown with the payload");
            assert_eq!(mounts_under(&dir).len(), 1, "the same mount, its options changed");
            m.shutdown();
        });
    }
}

mount_test! {
    /// A pod's content volumes count against its budget (its ephemeral-storage limit here,
    /// 1 MiB): each key is a file of at least a page, and the volume that would take the pod
    /// past its budget is refused, saying so, while its others are mounted; torn down, a
    /// volume gives its share back.
    fn content_volumes_past_the_pods_budget_are_refused_one_by_one() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            // 100 keys: 100 pages, 400 KiB, whatever their values.
            let data: serde_json::Map<String, serde_json::Value> = (0..100).map(|i| (format!("k{i}"), json!("v"))).collect();
            m.library().upsert_objects([kubevol::store::Object::ConfigMap(serde_json::from_value(json!({"metadata": {"name": "many", "namespace": "default"}, "data": data})).unwrap())]);
            let volumes: Vec<_> = (0..3).map(|i| json!({"name": format!("c{i}"), "configMap": {"name": "many"}})).collect();
            let mut p = pod_with_volumes("greedy", serde_json::Value::Array(volumes));
            p.spec.as_mut().unwrap().containers[0].resources = Some(serde_json::from_value(json!({"limits": {"ephemeral-storage": "1Mi"}})).unwrap());
            m.add_pod(p.clone());
            let s = wait_for_status(&m, &p, 120, |s| s.volumes.iter().filter(|v| v.state == kubevol::status::VolumePhase::Mounted).count() == 2
                && s.volumes.iter().any(|v| v.retry.last_error.is_some())).await;
            let refused = s.volumes.iter().find(|v| v.retry.last_error.is_some()).unwrap();
            let e = refused.retry.last_error.clone().unwrap();
            assert!(e.contains("its content takes 400 KiB and the pod's other content volumes 800 KiB: past the pod's budget of 1024 KiB") && e.contains("its ephemeral-storage limit"), "{e}");
            assert!(m.events().iter().any(|ev| ev.reason == "FailedMount" && ev.message.contains("past the pod's budget")), "told as an event");
            // Its share given back: a pod of the same two volumes after it fits.
            m.remove_pod(&p);
            m.wait_for_unmount(&p).await.expect("torn down");
            let volumes: Vec<_> = (0..2).map(|i| json!({"name": format!("c{i}"), "configMap": {"name": "many"}})).collect();
            let mut q = pod_with_volumes("greedy", serde_json::Value::Array(volumes));
            q.metadata.uid = p.metadata.uid.clone();
            q.spec.as_mut().unwrap().containers[0].resources = p.spec.as_ref().unwrap().containers[0].resources.clone();
            m.add_pod(q.clone());
            m.wait_for_attach_and_mount(&q).await.expect("the same pod's two volumes fit again");
            m.shutdown();
        });
    }
}

mount_test! {
    /// A pod that gives itself an ephemeral-storage limit of 100Ti does not get 100Ti: its
    /// content volumes are capped by what the node has, the Secrets (in memory) by the node's
    /// allocatable memory less the kubelet's eviction threshold, the ConfigMaps (on disk) by its
    /// allocatable ephemeral storage less 10 %, and the refusal says which cap applied.
    fn a_pods_own_limit_does_not_lift_its_content_budget_past_what_the_node_has() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let m = manager(root.path(), |c| {
                c.node_allocatable = Some(kubevol_core::projection::NodeAllocatable {
                    cpu_milli: 2000,
                    memory: (100 << 20) + (600 << 10),
                    ephemeral_storage: 800 << 10,
                });
            });
            // 100 keys: 100 pages, 400 KiB, whatever their values.
            let data: serde_json::Map<String, serde_json::Value> = (0..100).map(|i| (format!("k{i}"), json!("dg=="))).collect();
            m.library().upsert_objects([
                kubevol::store::Object::Secret(serde_json::from_value(json!({"metadata": {"name": "many", "namespace": "default"}, "data": data})).unwrap()),
                kubevol::store::Object::ConfigMap(serde_json::from_value(json!({"metadata": {"name": "many", "namespace": "default"}, "data": data})).unwrap()),
            ]);
            for (kind, source, cap) in [
                ("secret", json!({"secretName": "many"}), "the node's allocatable memory of 105472000 bytes less the kubelet's eviction threshold of 100 MiB"),
                ("configMap", json!({"name": "many"}), "the node's allocatable ephemeral storage of 819200 bytes less the kubelet's eviction threshold of 10 %"),
            ] {
                let volumes: Vec<_> = (0..3).map(|i| json!({"name": format!("c{i}"), kind: source})).collect();
                let mut p = pod_with_volumes(&format!("greedy-{}", kind.to_lowercase()), serde_json::Value::Array(volumes));
                p.spec.as_mut().unwrap().containers[0].resources = Some(serde_json::from_value(json!({"limits": {"ephemeral-storage": "100Ti"}})).unwrap());
                m.add_pod(p.clone());
                let s = wait_for_status(&m, &p, 120, |s| s.volumes.iter().filter(|v| v.state == kubevol::status::VolumePhase::Mounted).count() == 1
                    && s.volumes.iter().filter(|v| v.retry.last_error.is_some()).count() == 2).await;
                let e = s.volumes.iter().find_map(|v| v.retry.last_error.clone()).unwrap();
                assert!(e.contains("past the pod's budget") && e.contains(cap) && e.contains("which is below its ephemeral-storage limit of 109951162777600 bytes"), "{kind}: {e}");
                assert!(m.events().iter().any(|ev| ev.reason == "FailedMount" && ev.message.contains(cap)), "{kind}: told as an event");
                m.remove_pod(&p);
                m.wait_for_unmount(&p).await.expect("torn down");
            }
            m.shutdown();
        });
    }
}

mount_test! {
    /// A Secret volume whose write fails after its tmpfs was mounted (the pod's memory limit
    /// makes the tmpfs smaller than the Secret): the failure says why, and when the pod goes
    /// the tmpfs is unmounted and the directory removed, as for any volume that was set up
    /// (the record kept the intent: the volume was uncertain, not forgotten). Left mounted, it
    /// was taken for a foreign pod's after a restart.
    fn a_set_up_that_fails_after_its_tmpfs_was_mounted_is_torn_down_with_its_pod() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            use base64::Engine as _;
            let big = base64::engine::general_purpose::STANDARD.encode(vec![b'x'; 900 << 10]);
            m.library().upsert_objects([kubevol::store::Object::Secret(serde_json::from_value(json!({"metadata": {"name": "big", "namespace": "default"}, "data": {"k": big}})).unwrap())]);
            let mut p = pod_with_volumes("small", json!([{"name": "s", "secret": {"secretName": "big"}}]));
            p.spec.as_mut().unwrap().containers[0].resources = Some(serde_json::from_value(json!({"limits": {"memory": "512Ki"}})).unwrap());
            let uid = m.add_pod(p.clone());
            let s = wait_for_status(&m, &p, 120, |s| s.volumes[0].retry.last_error.as_ref().is_some_and(|e| e.contains("No space left") || e.contains("os error 28"))).await;
            assert_ne!(s.phase, kubevol::status::PodPhase::Ready);
            let pod_dir = m.config().root_dir.join("pods").join(uid.as_str());
            assert!(!mounts_under(&pod_dir).is_empty(), "the volume's tmpfs was mounted before the write failed");
            m.remove_pod(&p);
            m.wait_for_unmount(&p).await.expect("torn down");
            eventually("the pod's directory removed", 120, || async { !pod_dir.exists() }).await;
            assert!(mounts_under(&m.config().root_dir).is_empty(), "nothing left mounted");
            m.shutdown();
        });
    }
}
