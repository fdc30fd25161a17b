//! What an operator's worst day brings, mounting for real in private mount namespaces: manifest
//! files renamed, duplicated and churned while their pods run, and operations that panic.

#[macro_use]
mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::*;
use kubevol::source::ManifestSource;
use kubevol::status::PodPhase;
use kubevol_mount::Mounter;
use serde_json::json;

/// A pod manifest with one Memory emptyDir.
fn memory_pod(name: &str) -> String {
    format!("apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}}}\nspec:\n  containers: [{{name: c, volumeMounts: [{{name: mem, mountPath: /m}}]}}]\n  volumes: [{{name: mem, emptyDir: {{medium: Memory}}}}]\n")
}

/// Mount point → mount ID of every mount under `dir`. A volume unmounted and mounted again gets
/// a new ID.
fn mount_ids(dir: &Path) -> BTreeMap<PathBuf, u32> {
    kubevol_mount::LinuxMounter
        .mount_table()
        .expect("mount table")
        .into_iter()
        .filter(|m| m.mount_point.starts_with(dir))
        .map(|m| (m.mount_point, m.id))
        .collect()
}

fn pod_ref(name: &str) -> k8s_openapi::api::core::v1::Pod {
    common::pod(json!({"metadata": {"name": name, "namespace": "default"}}))
}

/// Writes a marker pod and waits until it is ready: every manifest event before it was handled
/// and every operation it caused has finished.
async fn settle_manifests(m: &kubevol::VolumeManager, dir: &Path, round: usize) {
    let name = format!("marker-{round}");
    std::fs::write(dir.join("marker.yaml"), memory_pod(&name)).unwrap();
    m.wait_for_attach_and_mount(&pod_ref(&name))
        .await
        .expect("the marker pod mounts");
}

mount_test! {
    fn renaming_or_duplicating_a_manifest_never_unmounts_its_pod() {
        let root = TestRoot::new();
        let manifests = root.manifests();
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            std::fs::write(manifests.join("web.yaml"), memory_pod("web")).unwrap();
            let _watch = ManifestSource::new(&manifests).listen(m.store().sink(ManifestSource::NAME)).await.unwrap();
            let web = pod_ref("web");
            m.wait_for_attach_and_mount(&web).await.expect("mounted");
            let uid = kubevol::pod_uid(&web);
            let volume = m.mounted_volumes_for_pod(&uid)["mem"].path.clone();
            std::fs::write(volume.join("canary"), b"data of a running pod").unwrap();
            let ids = mount_ids(&volume);
            assert_eq!(ids.len(), 1);
            // (row, what is done to the manifest directory, the file that defines the pod after)
            type Step = Box<dyn Fn(&Path)>;
            let rows: Vec<(&str, Step, &str)> = vec![
                ("renamed to a name that sorts first", Box::new(|d: &Path| std::fs::rename(d.join("web.yaml"), d.join("00-web.yaml")).unwrap()), "00-web.yaml"),
                ("renamed to a name that sorts last", Box::new(|d: &Path| std::fs::rename(d.join("00-web.yaml"), d.join("zz-web.yaml")).unwrap()), "zz-web.yaml"),
                ("copied to a file that sorts first (a duplicate that wins)", Box::new(|d: &Path| { std::fs::copy(d.join("zz-web.yaml"), d.join("aa-web.yaml")).unwrap(); }), "aa-web.yaml"),
                ("the winner of the duplicate removed", Box::new(|d: &Path| std::fs::remove_file(d.join("aa-web.yaml")).unwrap()), "zz-web.yaml"),
                ("renamed over another manifest", Box::new(|d: &Path| { std::fs::write(d.join("other.yaml"), memory_pod("other")).unwrap(); std::fs::rename(d.join("zz-web.yaml"), d.join("other.yaml")).unwrap(); }), "other.yaml"),
            ];
            for (round, (row, step, file)) in rows.iter().enumerate() {
                step(&manifests);
                settle_manifests(&m, &manifests, round).await;
                let s = m.pod_status(&uid).expect("the pod is known");
                assert_eq!(s.phase, PodPhase::Ready, "row {row}: {s:#?}");
                assert!(s.source.starts_with(&manifests.join(file).display().to_string()), "row {row}: {}", s.source);
                assert_eq!(mount_ids(&volume), ids, "row {row}: never unmounted or mounted again");
                assert_eq!(std::fs::read(volume.join("canary")).unwrap(), b"data of a running pod", "row {row}");
                let errors = m.status(false).manifest_errors;
                if row.starts_with("copied") {
                    assert!(errors.len() == 1 && errors[0].contains("zz-web.yaml: document 1: pod default/web") && errors[0].contains("is also defined by"), "row {row}: {errors:?}");
                } else {
                    assert!(errors.is_empty(), "row {row}: {errors:?}");
                }
            }
            m.shutdown();
        });
    }
}

mount_test! {
    fn manifest_churn_ends_with_exactly_the_mounts_the_directory_asks_for() {
        let root = TestRoot::new();
        let manifests = root.manifests();
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            let _watch = ManifestSource::new(&manifests).listen(m.store().sink(ManifestSource::NAME)).await.unwrap();
            // Creates, renames, copies and removals of 16 files defining 10 pods.
            churn_manifests(&manifests, 16, 10, 1000, 0x9e37_79b9_7f4a_7c15, memory_pod);
            settle_manifests(&m, &manifests, 0).await;
            let wanted = defined_pods(&manifests);
            for name in &wanted {
                m.wait_for_attach_and_mount(&pod_ref(name)).await.expect("every defined pod mounts");
            }
            for i in 0..10 {
                let name = format!("p{i}");
                if !wanted.contains(&name) {
                    m.wait_for_unmount(&pod_ref(&name)).await.expect("every pod no file defines is torn down");
                }
            }
            let want: std::collections::BTreeSet<PathBuf> = wanted
                .iter()
                .map(|n| m.config().root_dir.join(format!("pods/{}/volumes/kubernetes.io~empty-dir/mem", kubevol::pod_uid(&pod_ref(n)))))
                .collect();
            let have: std::collections::BTreeSet<PathBuf> = mount_ids(&m.config().root_dir).into_keys().collect();
            assert_eq!(have, want, "the mount table holds exactly the defined pods' volumes");
            m.shutdown();
        });
    }
}

mount_test! {
    fn an_operation_that_panics_is_recorded_as_uncertain_and_retried() {
        // The set-up panics after it mounted, the teardown after it unmounted: each time the
        // outcome is unknown to kubevol, which must neither lose the mount nor stop.
        // SAFETY of the environment: this test runs alone in its own process.
        std::env::set_var(kubevol::record::FAIL_POINT_ENV, "set_up:after:panic,tear_down:after:panic");
        let root = TestRoot::new();
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            let p = pod_with_volumes("p", json!([{"name": "mem", "emptyDir": {"medium": "Memory"}}]));
            let uid = m.add_pod(p.clone());
            m.wait_for_attach_and_mount(&p).await.expect("mounted on the retry");
            let s = m.pod_status(&uid).unwrap();
            let failed = s.events.iter().find(|e| e.reason == "FailedMount").expect("the panic is shown");
            assert!(failed.message.contains("kubevol panicked (fail point set_up:after reached)"), "{failed:?}");
            let volume = m.mounted_volumes_for_pod(&uid)["mem"].path.clone();
            assert_eq!(mount_ids(&volume).len(), 1, "mounted once, not stacked by the retry");
            m.remove_pod(&p);
            m.wait_for_unmount(&p).await.expect("unmounted on the retry");
            assert!(mount_ids(&m.config().root_dir).is_empty());
            // The outcome's line is queued, not waited for: it is written soon after.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
            loop {
                let records = kubevol::record::Record::read(&m.config().root_dir).unwrap().pods;
                if records.is_empty() {
                    break;
                }
                assert!(std::time::Instant::now() < deadline, "no record left: {records:?}");
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
            m.shutdown();
        });
    }
}

mount_test! {
    fn a_small_pod_is_not_kept_waiting_by_a_pod_with_thousands_of_volumes() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let m = manager(root.path(), |c| c.wait_timeout = std::time::Duration::from_secs(120));
            let volumes: Vec<serde_json::Value> = (0..2000)
                .map(|i| json!({"name": format!("v{i}"), "emptyDir": {"medium": "Memory"}}))
                .collect();
            let big = pod_with_volumes("big", json!(volumes));
            let big_uid = m.add_pod(big.clone());
            // Once the big pod's set-up is under way, the small pod arrives.
            let mut changes = m.subscribe();
            while m.mounted_volumes_for_pod(&big_uid).len() < 100 {
                changes.changed().await.unwrap();
            }
            let small = pod_with_volumes("small", json!([{"name": "mem", "emptyDir": {"medium": "Memory"}}]));
            m.add_pod(small.clone());
            m.wait_for_attach_and_mount(&small).await.expect("the small pod mounts");
            let big_done = m.mounted_volumes_for_pod(&big_uid).len();
            assert!(
                big_done < 1000,
                "the small pod took turns with the big one instead of waiting for it: {big_done} of the big pod's 2000 volumes were mounted first"
            );
            m.wait_for_attach_and_mount(&big).await.expect("the big pod mounts too");
            m.remove_pods(&[big.clone(), small.clone()]);
            m.wait_for_all_pods_unmount(&[big, small]).await.expect("torn down");
            assert!(mount_ids(&m.config().root_dir).is_empty());
            m.shutdown();
        });
    }
}

mount_test! {
    fn a_set_up_that_hangs_stalls_only_its_own_pod() {
        // Quick set-ups run one after another on one thread: one that hangs (its directory is
        // a filesystem that never answers) must not hold up the others behind it.
        let root = TestRoot::new();
        runtime().block_on(async {
            let m = manager(root.path(), |c| c.operation_timeout = std::time::Duration::from_secs(1));
            // The hung mount is planted once the manager has looked at the root: found at its
            // start, it would be an orphan of an earlier run, unmounted before the pod came.
            until_announced(&m, 60, "the manager's first full pass", || m.reconciler_states_synced()).await;
            let stuck = pod_with_volumes("stuck", json!([{"name": "data", "emptyDir": {"medium": "Memory"}}]));
            let uid = kubevol::pod_uid(&stuck);
            let dir = m
                .config()
                .root_dir
                .join("pods")
                .join(uid.as_str())
                .join("volumes/kubernetes.io~empty-dir/data");
            std::fs::create_dir_all(&dir).unwrap();
            let fuse = hung_fuse_mount(&dir);
            m.add_pod(stuck.clone());
            wait_for_status(&m, &stuck, 60, |s| {
                s.volumes[0]
                    .retry
                    .last_error
                    .as_deref()
                    .is_some_and(|e| e.contains("has not finished after"))
            })
            .await;
            // Behind it, in the same lane: pods with several volumes each.
            let others: Vec<_> = (0..3)
                .map(|i| {
                    pod_with_volumes(
                        &format!("other-{i}"),
                        json!([{"name": "a", "emptyDir": {"medium": "Memory"}}, {"name": "b", "emptyDir": {}}]),
                    )
                })
                .collect();
            m.add_pods(others.clone());
            for p in &others {
                m.wait_for_attach_and_mount(p).await.expect("mounted while the other set-up hangs");
            }
            assert_ne!(m.pod_status(&uid).unwrap().phase, PodPhase::Ready);
            // The filesystem dies: the call returns, the dead mount is removed, the volume set up.
            drop(fuse);
            m.wait_for_attach_and_mount(&stuck).await.expect("set up once the hung call returned");
            let mut all = others.clone();
            all.push(stuck.clone());
            m.remove_pods(&all);
            m.wait_for_all_pods_unmount(&all).await.expect("torn down");
            assert!(mount_ids(&m.config().root_dir).is_empty());
            m.shutdown();
        });
    }
}
