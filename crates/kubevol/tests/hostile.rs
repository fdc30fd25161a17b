//! What a manifest author or a container can try against the node, each attack made for real
//! in a private mount namespace: names that climb out of the local-path directory, trees deep
//! enough to overflow any recursion, manifests that cost minutes to parse, mount options with
//! options smuggled in, a local-path directory two managers share, and a claim that takes
//! another pod's ephemeral data by its name.

#[macro_use]
mod common;

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Duration;

use common::*;
use kubevol::source::ManifestSource;
use kubevol::status::PodPhase;
use serde_json::json;

/// Mounts a tmpfs on `dir` (in the test's own mount namespace): trees of 100,000 levels are
/// made and removed ten times faster than on a disk.
fn in_memory(dir: &Path) {
    rustix::mount::mount(
        "tmpfs",
        dir,
        "tmpfs",
        rustix::mount::MountFlags::empty(),
        None,
    )
    .expect("mount a tmpfs");
}

/// Makes a chain of `depth` directories `d` below `top`, each with a file `f`, as a container
/// can (each level made relative to the one before: no path is ever that long).
fn deep_tree(top: &Path, depth: usize) {
    use rustix::fs::{Mode, OFlags};
    let dir = OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC;
    let mut cur = rustix::fs::open(top, dir, Mode::empty()).unwrap();
    for _ in 0..depth {
        rustix::fs::mkdirat(&cur, "d", Mode::from_raw_mode(0o755)).unwrap();
        let f = OFlags::CREATE | OFlags::WRONLY | OFlags::CLOEXEC;
        drop(rustix::fs::openat(&cur, "f", f, Mode::from_raw_mode(0o644)).unwrap());
        cur = rustix::fs::openat(&cur, "d", dir, Mode::empty()).unwrap();
    }
}

/// The group of the deepest directory of a [`deep_tree`].
fn deepest_group(top: &Path, depth: usize) -> u32 {
    use rustix::fs::{Mode, OFlags};
    let dir = OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC;
    let mut cur = rustix::fs::open(top, dir, Mode::empty()).unwrap();
    for _ in 0..depth {
        cur = rustix::fs::openat(&cur, "d", dir, Mode::empty()).unwrap();
    }
    rustix::fs::fstat(&cur).unwrap().st_gid
}

fn pod_named(name: &str) -> k8s_openapi::api::core::v1::Pod {
    common::pod(
        json!({"metadata": {"name": name, "namespace": "default"}, "spec": {"containers": []}}),
    )
}

fn claim(name: &str) -> String {
    format!("apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {{name: {name}}}\nspec:\n  accessModes: [ReadWriteOnce]\n  resources: {{requests: {{storage: 1Gi}}}}\n")
}

fn claim_pod(name: &str, claim: &str, security: &str) -> String {
    format!("apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}}}\nspec:\n{security}  containers: [{{name: c, volumeMounts: [{{name: data, mountPath: /data}}]}}]\n  volumes: [{{name: data, persistentVolumeClaim: {{claimName: {claim}}}}}]\n")
}

fn error_of(s: &kubevol::status::PodStatus) -> String {
    let mut all = s.errors.clone();
    all.extend(s.volumes.iter().filter_map(|v| v.retry.last_error.clone()));
    all.join("\n")
}

const DEPTH: usize = 100_000;

mount_test! {
    /// A container that makes a tree 100,000 levels deep in its emptyDir: the teardown removes
    /// it whole and the manager goes on (a recursive walk aborted the daemon, at every start).
    /// (Walking 100,000 levels takes seconds; the waits allow minutes on a loaded machine.)
    fn a_tree_100000_levels_deep_in_an_empty_dir_is_torn_down() {
        let root = TestRoot::new();
        in_memory(root.path());
        let manifests = root.manifests();
        let pod = |name: &str| format!("apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}}}\nspec:\n  containers: [{{name: c, volumeMounts: [{{name: cache, mountPath: /cache}}]}}]\n  volumes: [{{name: cache, emptyDir: {{}}}}]\n");
        runtime().block_on(async {
            let m = manager(root.path(), |c| c.wait_timeout = std::time::Duration::from_secs(300));
            write_manifest(&manifests, "deep.yaml", &pod("deep"));
            let _watch = ManifestSource::new(&manifests).listen(m.store().sink(ManifestSource::NAME)).await.unwrap();
            let deep = pod_named("deep");
            m.wait_for_attach_and_mount(&deep).await.expect("mounted");
            let volume = m.mounted_volumes_for_pod(&kubevol::pod_uid(&deep))["cache"].path.clone();
            let tree = volume.clone();
            tokio::task::spawn_blocking(move || deep_tree(&tree, DEPTH)).await.unwrap();
            std::fs::remove_file(manifests.join("deep.yaml")).unwrap();
            m.wait_for_unmount(&deep).await.expect("torn down, the tree removed");
            assert!(!volume.exists());
            // The manager lives on: a new pod is served.
            write_manifest(&manifests, "next.yaml", &pod("next"));
            m.wait_for_attach_and_mount(&pod_named("next")).await.expect("mounted");
            m.shutdown();
        });
    }
}

mount_test! {
    /// A claim's volume holding a tree 100,000 levels deep: a pod with `fsGroup` gets the
    /// group on every level, and when the claim is removed its volume (reclaim policy Delete)
    /// is deleted whole; the manager lives on throughout.
    fn a_tree_100000_levels_deep_gets_its_fs_group_and_is_reclaimed() {
        let root = TestRoot::new();
        in_memory(root.path());
        let manifests = root.manifests();
        runtime().block_on(async {
            let m = manager(root.path(), |c| c.wait_timeout = std::time::Duration::from_secs(300));
            write_manifest(&manifests, "claim.yaml", &claim("data"));
            write_manifest(&manifests, "writer.yaml", &claim_pod("writer", "data", ""));
            let _watch = ManifestSource::new(&manifests).listen(m.store().sink(ManifestSource::NAME)).await.unwrap();
            let writer = pod_named("writer");
            m.wait_for_attach_and_mount(&writer).await.expect("provisioned and mounted");
            let volume = m.mounted_volumes_for_pod(&kubevol::pod_uid(&writer))["data"].path.clone();
            let tree = volume.clone();
            tokio::task::spawn_blocking(move || deep_tree(&tree, DEPTH)).await.unwrap();
            std::fs::remove_file(manifests.join("writer.yaml")).unwrap();
            m.wait_for_unmount(&writer).await.expect("torn down");

            write_manifest(&manifests, "grouped.yaml", &claim_pod("grouped", "data", "  securityContext: {fsGroup: 2345}\n"));
            let grouped = pod_named("grouped");
            m.wait_for_attach_and_mount(&grouped).await.expect("mounted, the fsGroup walk done");
            let volume = m.mounted_volumes_for_pod(&kubevol::pod_uid(&grouped))["data"].path.clone();
            let tree = volume.clone();
            let gid = tokio::task::spawn_blocking(move || deepest_group(&tree, DEPTH)).await.unwrap();
            assert_eq!(gid, 2345, "the deepest level has the pod's group");

            let local = root.path().join("root/local-path");
            let dirs = || std::fs::read_dir(&local).unwrap().filter(|e| !e.as_ref().unwrap().file_name().to_string_lossy().starts_with('.')).count();
            assert_eq!(dirs(), 1);
            std::fs::remove_file(manifests.join("grouped.yaml")).unwrap();
            std::fs::remove_file(manifests.join("claim.yaml")).unwrap();
            m.wait_for_unmount(&grouped).await.expect("torn down");
            until_announced(&m, 300, "the reclaimed volume deleted", || dirs() == 0).await;
            write_manifest(&manifests, "next.yaml", &claim("next"));
            write_manifest(&manifests, "next-pod.yaml", &claim_pod("next", "next", ""));
            m.wait_for_attach_and_mount(&pod_named("next")).await.expect("the manager lives on");
            m.shutdown();
        });
    }
}

mount_test! {
    /// Claims whose UID, name or namespace would make a path outside the local-path directory
    /// are refused as the API server refuses them: the pod says which field of which file to
    /// fix, nothing is made or changed outside the local-path directory, and a pod beside them
    /// is served.
    fn a_claim_whose_names_climb_out_makes_nothing_outside_the_local_path_directory() {
        let root = TestRoot::new();
        let manifests = root.manifests();
        let outside = root.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::set_permissions(&outside, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
        let escapes = [
            ("uid", "metadata: {name: c, uid: \"u1_default_c/../../../outside\"}", "metadata.uid"),
            ("nul", "metadata: {name: c, uid: \"0b3f4c2e-9a1d-4c55-8f0e-2d3c4b5a6f7\\0\"}", "metadata.uid"),
            ("long", &format!("metadata: {{name: c, uid: \"{}\"}}", "a".repeat(300)), "metadata.uid"),
        ];
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            let _watch = ManifestSource::new(&manifests).listen(m.store().sink(ManifestSource::NAME)).await.unwrap();
            for (row, meta, field) in escapes {
                let text = claim("c").replace("metadata: {name: c}", meta) + "---\n" + &claim_pod(row, "c", "");
                write_manifest(&manifests, &format!("{row}.yaml"), &text);
                let s = wait_for_status(&m, &pod_named(row), 120, |s| !error_of(s).is_empty()).await;
                let e = error_of(&s);
                assert!(e.contains("PersistentVolumeClaim default/c is invalid") && e.contains(field) && e.contains(&format!("{row}.yaml")), "{row}: {e}");
                std::fs::remove_file(manifests.join(format!("{row}.yaml"))).unwrap();
            }
            // A name with a separator is no name a claim can have: the pod's reference to it is
            // refused, and the claim's own file says why.
            write_manifest(&manifests, "slash.yaml", &claim("c").replace("name: c", "name: \"../../outside\""));
            until_announced(&m, 120, "the claim's file refused", || m.status(false).manifest_errors.iter().any(|e| e.contains("slash.yaml") && e.contains("metadata.name"))).await;
            write_manifest(&manifests, "fine.yaml", &(claim("fine") + "---\n" + &claim_pod("fine", "fine", "")));
            m.wait_for_attach_and_mount(&pod_named("fine")).await.expect("a pod beside them is served");
            let local = root.path().join("root/local-path");
            let made: Vec<String> = std::fs::read_dir(&local).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).filter(|n| !n.starts_with('.')).collect();
            assert_eq!(made.len(), 1, "{made:?}");
            assert!(made[0].ends_with("_default_fine"), "{made:?}");
            assert_eq!(std::fs::metadata(&outside).unwrap().mode() & 0o7777, 0o700, "the directory outside keeps its mode");
            assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
            m.shutdown();
        });
    }
}

mount_test! {
    /// A manifest of flow YAML nested 200,000 levels deep (400 KB) is refused at once, naming
    /// the file, line and column; a pod written beside it is served.
    fn a_deeply_nested_manifest_is_refused_and_the_pod_beside_it_served() {
        let root = TestRoot::new();
        let manifests = root.manifests();
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            let _watch = ManifestSource::new(&manifests).listen(m.store().sink(ManifestSource::NAME)).await.unwrap();
            for i in 0..8 {
                write_manifest(&manifests, &format!("bomb{i}.yaml"), &format!("x: {}", "[".repeat(200_000)));
            }
            write_manifest(&manifests, "web.yaml", "apiVersion: v1\nkind: Pod\nmetadata: {name: web}\nspec:\n  containers: [{name: c, volumeMounts: [{name: m, mountPath: /m}]}]\n  volumes: [{name: m, emptyDir: {medium: Memory}}]\n");
            m.wait_for_attach_and_mount(&pod_named("web")).await.expect("served beside the bombs");
            until_announced(&m, 120, "every bomb refused", || m.status(false).manifest_errors.iter().filter(|e| e.contains("nests more than 128 levels")).count() == 8).await;
            let errors = m.status(false).manifest_errors;
            let e = errors.iter().find(|e| e.contains("bomb0.yaml")).unwrap();
            assert!(e.contains("line 1") && e.contains("column"), "{e}");
            m.shutdown();
        });
    }
}

mount_test! {
    /// SELinux options that would smuggle mount options into `-o context="…"` are refused with
    /// the field that holds them; the pod's volume is never mounted.
    fn selinux_options_that_would_end_the_context_option_are_refused() {
        let root = TestRoot::new();
        let manifests = root.manifests();
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            let _watch = ManifestSource::new(&manifests).listen(m.store().sink(ManifestSource::NAME)).await.unwrap();
            let rows = [
                ("level", "  securityContext: {seLinuxOptions: {level: \"s0:c1,c2\\\",dev,suid,exec,nodev=\\\"x\\nfoo\"}}\n", "spec.securityContext.seLinuxOptions.level"),
                ("type", "  securityContext: {seLinuxOptions: {type: \"spc_t\\\",dev\"}}\n", "spec.securityContext.seLinuxOptions.type"),
            ];
            for (name, security, field) in rows {
                write_manifest(&manifests, &format!("{name}.yaml"), &format!("apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}}}\nspec:\n{security}  containers: [{{name: c, volumeMounts: [{{name: m, mountPath: /m}}]}}]\n  volumes: [{{name: m, emptyDir: {{}}}}]\n"));
                let s = wait_for_status(&m, &pod_named(name), 120, |s| s.phase == PodPhase::Rejected).await;
                assert!(error_of(&s).contains(field) && error_of(&s).contains("SELinux"), "{name}: {s:#?}");
                assert!(m.mounted_volumes_for_pod(&kubevol::pod_uid(&pod_named(name))).is_empty());
            }
            m.shutdown();
        });
    }
}

mount_test! {
    /// Two managers with different roots and one local-path directory: the second is refused
    /// at its start, naming the first's root, before it reads or changes anything.
    fn a_local_path_directory_serves_one_manager() {
        let root = TestRoot::new();
        let shared = root.path().join("shared-local-path");
        runtime().block_on(async {
            let first = manager(root.path(), |c| c.local_path_dir = Some(shared.clone()));
            let mut config = kubevol::Config::new(root.path().join("other-root"), "test-node");
            config.local_path_dir = Some(shared.clone());
            let e = kubevol::VolumeManager::new(config, std::sync::Arc::new(kubevol_mount::LinuxMounter)).err().expect("refused");
            assert_eq!(e.kind(), std::io::ErrorKind::ResourceBusy);
            let first_root = std::fs::canonicalize(root.path().join("root")).unwrap();
            assert!(e.to_string().contains(&format!("the kubevol of root {}", first_root.display())), "{e}");
            assert!(!root.path().join("other-root/volume-record").exists(), "the second read or wrote nothing");
            first.shutdown();
        });
    }
}

mount_test! {
    /// A claim of the manifests named as another pod's generic ephemeral claim was
    /// (`<pod>-<volume>`), written as that pod goes: it is another claim (another UID), gets a
    /// volume of its own, empty, and the ephemeral volume is deleted as its class says.
    fn a_claim_named_as_a_gone_pods_ephemeral_claim_does_not_inherit_its_data() {
        let root = TestRoot::new();
        let manifests = root.manifests();
        let ephemeral = "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  containers: [{name: c, volumeMounts: [{name: v, mountPath: /v}]}]\n  volumes:\n  - name: v\n    ephemeral:\n      volumeClaimTemplate:\n        spec: {accessModes: [ReadWriteOnce], resources: {requests: {storage: 1Gi}}}\n";
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            write_manifest(&manifests, "p.yaml", ephemeral);
            let _watch = ManifestSource::new(&manifests).listen(m.store().sink(ManifestSource::NAME)).await.unwrap();
            let p = pod_named("p");
            m.wait_for_attach_and_mount(&p).await.expect("provisioned and mounted");
            let old = m.mounted_volumes_for_pod(&kubevol::pod_uid(&p))["v"].path.clone();
            std::fs::write(old.join("secret"), "the pod's data").unwrap();
            let old_volume = m.status(false).bindings.iter().find(|b| b.claim == "default/p-v").unwrap().volume.clone();
            // In one change: the pod goes, a claim of its ephemeral claim's name and a pod
            // that uses it come.
            write_manifest(&manifests, "p.yaml", &(claim("p-v") + "---\n" + &claim_pod("heir", "p-v", "")));
            let heir = pod_named("heir");
            m.wait_for_attach_and_mount(&heir).await.expect("mounted");
            let new = m.mounted_volumes_for_pod(&kubevol::pod_uid(&heir))["data"].path.clone();
            assert!(!new.join("secret").exists(), "the heir sees none of the gone pod's data: old {old:?}, new {new:?}, bindings {:#?}", m.status(false).bindings);
            let bindings = m.status(false).bindings;
            let new_volume = &bindings.iter().find(|b| b.claim == "default/p-v" && b.phase == "Bound").unwrap().volume;
            assert_ne!(new_volume, &old_volume);
            until_announced(&m, 120, "the ephemeral volume deleted", || m.store().persistent_volume(&old_volume).is_none()).await;
            let local = root.path().join("root/local-path");
            let left: Vec<String> = std::fs::read_dir(&local).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).filter(|n| !n.starts_with('.')).collect();
            assert!(left.len() == 1 && left[0].starts_with(new_volume.as_str()), "{left:?}");
            m.shutdown();
        });
    }
}

mount_test! {
    /// A container that mounts something inside its claim's local-path directory stops the
    /// volume's deletion once the claim is gone (a removal never crosses a mount). The deletion
    /// is tried again by itself after a backoff, with nothing else changing, so the volume goes
    /// once the mount does.
    fn a_reclaim_stopped_by_a_mount_inside_is_tried_again_by_itself() {
        let log = LogCapture::install();
        let root = TestRoot::new();
        let manifests = root.manifests();
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            write_manifest(&manifests, "c.yaml", &(claim("c") + "---\n" + &claim_pod("p", "c", "")));
            let _watch = ManifestSource::new(&manifests).listen(m.store().sink(ManifestSource::NAME)).await.unwrap();
            m.wait_for_attach_and_mount(&pod_named("p")).await.expect("provisioned and mounted");
            let volume = m.status(false).bindings.iter().find(|b| b.claim == "default/c").unwrap().volume.clone();
            let local = root.path().join("root/local-path");
            let dir = std::fs::read_dir(&local).unwrap().map(|e| e.unwrap().path()).find(|p| p.file_name().unwrap().to_string_lossy().starts_with(volume.as_str())).unwrap();
            let inner = dir.join("inner");
            std::fs::create_dir(&inner).unwrap();
            kubevol_mount::Mounter::mount(&kubevol_mount::LinuxMounter, "tmpfs", &inner, "tmpfs", &kubevol_mount::MountOptions::default()).unwrap();
            std::fs::remove_file(manifests.join("c.yaml")).unwrap();
            kubevol_testserver::cluster::eventually("the first deletion refused", 60, || {
                let refused = log.contains("the provisioned volume of a removed claim cannot be deleted");
                async move { refused }
            })
            .await;
            assert!(dir.exists() && m.store().persistent_volume(&volume).is_some(), "nothing removed across the mount");
            kubevol_mount::Mounter::unmount(&kubevol_mount::LinuxMounter, &inner).unwrap();
            kubevol_testserver::cluster::eventually("the volume deleted once the mount is gone", 60, || {
                let gone = m.store().persistent_volume(&volume).is_none() && !dir.exists();
                async move { gone }
            })
            .await;
            m.shutdown();
        });
    }
}

mount_test! {
    /// A hostPath inside `--host-path-allow` swapped for a link after its check (`mv swap
    /// swap.old; ln -s <secret> swap`) changes nothing a runtime is given: the path handed out
    /// is a bind of the directory checked, made from its descriptor, so it still shows that
    /// directory, not the link's target; a pod set up after the swap is refused (the path now
    /// resolves outside); the teardown unmounts the bind and leaves the host's data alone. The
    /// bind is recursive: a filesystem mounted below the host path shows through it.
    fn a_host_path_swapped_for_a_link_after_its_check_hands_out_what_was_checked() {
        let root = TestRoot::new();
        let allowed = root.path().join("hostok");
        let secret = root.path().join("secret");
        std::fs::create_dir_all(allowed.join("swap/below")).unwrap();
        std::fs::create_dir_all(&secret).unwrap();
        std::fs::write(allowed.join("swap/canary"), "checked").unwrap();
        std::fs::write(secret.join("shadow"), "root:x").unwrap();
        in_memory(&allowed.join("swap/below"));
        std::fs::write(allowed.join("swap/below/on-tmpfs"), "mounted below").unwrap();
        runtime().block_on(async {
            let allow = allowed.clone();
            let m = manager(root.path(), move |c| c.host_path_allow = vec![allow]);
            let volume = |path: &Path| json!([{"name": "host", "hostPath": {"path": path, "type": "Directory"}}]);
            let p = pod_with_volumes("app", volume(&allowed.join("swap")));
            m.add_pod(p.clone());
            m.wait_for_attach_and_mount(&p).await.expect("mounted");
            let handed = m.mounted_volumes_for_pod(&kubevol::pod_uid(&p))["host"].path.clone();
            assert!(handed.starts_with(m.config().root_dir.join("pods")), "a pinned path under the pod's directory: {}", handed.display());
            assert_eq!(std::fs::read_to_string(handed.join("canary")).unwrap(), "checked");
            assert_eq!(std::fs::read_to_string(handed.join("below/on-tmpfs")).unwrap(), "mounted below", "the bind is recursive");

            // The swap.
            std::fs::rename(allowed.join("swap"), allowed.join("swap.old")).unwrap();
            std::os::unix::fs::symlink(&secret, allowed.join("swap")).unwrap();
            assert!(!handed.join("shadow").exists(), "the link's target is not what was handed out");
            assert_eq!(std::fs::read_to_string(handed.join("canary")).unwrap(), "checked");
            let ino = |p: &Path| std::fs::metadata(p).unwrap().ino();
            assert_eq!(ino(&handed), ino(&allowed.join("swap.old")), "the directory checked");

            // A pod set up after the swap: the path now resolves outside.
            let q = pod_with_volumes("late", volume(&allowed.join("swap")));
            m.add_pod(q.clone());
            let s = wait_for_status(&m, &q, 120, |s| s.volumes.iter().any(|v| v.retry.last_error.is_some())).await;
            let e = s.volumes[0].retry.last_error.clone().unwrap();
            assert!(e.contains("outside the allowed host paths"), "{e}");

            m.remove_pod(&p);
            m.wait_for_unmount(&p).await.expect("torn down");
            assert!(!handed.exists(), "the mount point removed");
            assert_eq!(std::fs::read_to_string(allowed.join("swap.old/canary")).unwrap(), "checked", "the host's data stays");
            assert_eq!(std::fs::read_to_string(allowed.join("swap.old/below/on-tmpfs")).unwrap(), "mounted below");
            assert_eq!(std::fs::read_to_string(secret.join("shadow")).unwrap(), "root:x");
            m.shutdown();
        });
    }
}

/// Fills the filesystem of `dir` to its last byte with the file `dir/filler`.
fn fill(dir: &Path) {
    use std::io::Write;
    let mut f = std::fs::File::create(dir.join("filler")).unwrap();
    for chunk in [1 << 16, 1 << 10, 1] {
        let bytes = vec![0u8; chunk];
        while f.write_all(&bytes).is_ok() {}
    }
}

/// Mounts a new ext4 filesystem of `mib` MiB on `dir` (a loop device the kernel frees when
/// the test's mount namespace ends): a disk, whose directories take blocks, unlike a tmpfs's.
fn small_disk(dir: &Path, mib: u64) {
    let image = dir.with_extension("img");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(mib << 20)
        .unwrap();
    let run = |cmd: &mut std::process::Command| {
        let out = cmd.output().expect("run mkfs.ext4 and mount");
        assert!(
            out.status.success(),
            "{cmd:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run(std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F"])
        .arg(&image));
    run(std::process::Command::new("mount")
        .args(["-o", "loop"])
        .arg(&image)
        .arg(dir));
}

mount_test! {
    /// The root's disk full to its last byte (what a pod's disk-backed emptyDir can do): the
    /// set-ups whose intent cannot be recorded fail, saying so, and leave nothing; the record
    /// stays whole (a restart on the full disk reads it without a corrupt line or a problem);
    /// pods removed meanwhile are torn down all the same; once space returns, every pod is mounted without a restart, the earlier ones with
    /// their data.
    fn a_full_disk_never_loses_the_record_and_kubevol_recovers_when_space_returns() {
        let root = TestRoot::new();
        let node_root = root.path().join("root");
        std::fs::create_dir_all(&node_root).unwrap();
        small_disk(&node_root, 32);
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            let before: Vec<_> = (0..5).map(|i| pod_with_volumes(&format!("before-{i}"), json!([{"name": "d", "emptyDir": {}}]))).collect();
            for p in &before {
                m.add_pod(p.clone());
                m.wait_for_attach_and_mount(p).await.expect("mounted");
                let dir = m.mounted_volumes_for_pod(&kubevol::pod_uid(p))["d"].path.clone();
                std::fs::write(dir.join("canary"), "kept").unwrap();
            }
            let gone: Vec<_> = (0..10).map(|i| pod_with_volumes(&format!("gone-{i}"), json!([{"name": "d", "emptyDir": {}}]))).collect();
            for p in &gone {
                m.add_pod(p.clone());
                m.wait_for_attach_and_mount(p).await.expect("mounted");
            }
            fill(&node_root);
            let after: Vec<_> = (0..40).map(|i| pod_with_volumes(&format!("after-{i}"), json!([{"name": "d", "emptyDir": {}}]))).collect();
            for p in &after {
                m.add_pod(p.clone());
            }
            // Some set-up cannot record its intent (the journal's last page has room for a
            // few): it fails, saying why.
            let full = async {
                loop {
                    let said = after.iter().find_map(|p| {
                        let s = m.pod_status(&kubevol::pod_uid(p))?;
                        s.volumes.iter().find_map(|v| v.retry.last_error.clone())
                    });
                    if let Some(e) = said {
                        return e;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            };
            let e = tokio::time::timeout(Duration::from_secs(120), full).await.expect("a set-up refused on the full disk");
            assert!(e.contains("No space left on device") || e.contains("os error 28"), "{e}");

            // Teardowns go on while the disk is full (their lines go into the record's
            // reserve: without it the journal's last page holds a few lines at most).
            m.remove_pods(&gone);
            for p in &gone {
                tokio::time::timeout(Duration::from_secs(120), m.wait_for_unmount(p)).await.expect("torn down on the full disk").unwrap();
            }
            assert!(node_root.join("filler").exists());

            // A restart on the full disk: the record reads whole (nothing corrupt, nothing
            // set aside), and what it holds waits for space to be confirmed (an intent first).
            let m = restart(m, root.path(), |_| {}).await;
            for p in before.iter().chain(&after) {
                m.add_pod(p.clone());
            }
            let record = node_root.join("volume-record");
            assert!(!record.join("journal.corrupt").exists(), "the journal reads whole");
            let deadline = std::time::Instant::now() + Duration::from_secs(120);
            let found = loop {
                let found = m.status(false).reconstruction;
                if found.pod_volumes >= before.len() || std::time::Instant::now() > deadline {
                    break found;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            };
            assert_eq!(found.problems, Vec::<String>::new());
            assert!(found.pod_volumes >= before.len(), "every volume mounted before is in the record: {found:?}");
            let recorded: Vec<String> = kubevol::record::Record::read(&node_root).unwrap().pods.iter().map(|r| r.pod.name.to_string()).collect();
            assert!(before.iter().all(|p| recorded.contains(p.metadata.name.as_ref().unwrap())), "{recorded:?}");
            assert!(!recorded.iter().any(|p| p.starts_with("gone-")), "a pod torn down is out of the record: {recorded:?}");

            // Space returns: every pod is mounted without a restart, the earlier ones with
            // their data.
            std::fs::remove_file(node_root.join("filler")).unwrap();
            for p in before.iter().chain(&after) {
                m.wait_for_attach_and_mount(p).await.expect("mounted once space returned");
            }
            for p in &before {
                let dir = m.mounted_volumes_for_pod(&kubevol::pod_uid(p))["d"].path.clone();
                assert_eq!(std::fs::read_to_string(dir.join("canary")).unwrap(), "kept");
            }
            m.shutdown();
        });
    }
}

/// A pod volume's record in `state`, as a set-up of an emptyDir writes it.
fn record_of(
    pod: &str,
    state: kubevol::record::PodVolumeState,
) -> kubevol::record::PodVolumeRecord {
    use kubevol::record::{PodVolumeRecord, SpecRecord, TraitsRecord, VERSION};
    PodVolumeRecord {
        version: VERSION,
        state,
        pod: kubevol_core::PodRef {
            namespace: "default".into(),
            name: pod.into(),
            uid: kubevol_core::PodUid(format!("uid-{pod}").into()),
        },
        source: "/m/pods.yaml, document 1".into(),
        volume: "d".into(),
        unique_name: kubevol_core::UniqueVolumeName::from(format!(
            "kubernetes.io/empty-dir/uid-{pod}-d"
        )),
        traits: TraitsRecord {
            plugin: "kubernetes.io/empty-dir".into(),
            attachable: false,
            device_mountable: false,
        },
        path: format!("/r/pods/uid-{pod}/volumes/kubernetes.io~empty-dir/d").into(),
        read_only: false,
        sub_paths: Vec::new(),
        spec: SpecRecord {
            volume: k8s_openapi::api::core::v1::Volume {
                name: "d".into(),
                ..Default::default()
            }
            .into(),
            persistent_volume: None,
            block: false,
            selinux: None,
        },
    }
}

mount_test! {
    /// On a full disk the record keeps space of its own for what finishes or undoes work: the
    /// intent to set a volume up is refused, saying so, once half of the reserve is used,
    /// while every volume written so far can still be torn down (intent and removal); once
    /// space is freed, set-ups are recorded again, and the journal reads whole.
    fn the_record_keeps_its_reserve_for_teardowns_on_a_full_disk() {
        use kubevol::record::{Change, PodVolumeState as S, Record};
        let root = TestRoot::new();
        let node_root = root.path().join("root");
        std::fs::create_dir_all(&node_root).unwrap();
        rustix::mount::mount("tmpfs", &node_root, "tmpfs", rustix::mount::MountFlags::empty(), Some(c"size=8m")).expect("a small tmpfs");
        runtime().block_on(async {
            let record = std::sync::Arc::new(Record::open(&node_root).unwrap());
            fill(&node_root);
            let mut written = 0;
            let refused = loop {
                let pod = format!("p{written}");
                match record.commit(Change::PodVolume(record_of(&pod, S::SettingUp)), true).await {
                    Ok(()) => record.commit(Change::PodVolume(record_of(&pod, S::SetUp)), false).await.unwrap(),
                    Err(e) => break e,
                }
                written += 1;
                assert!(written < 10_000, "no set-up refused on a full disk");
            };
            assert!(refused.to_string().contains("reserve is kept for teardowns"), "{refused}");
            assert!(written > 100, "the reserve took {written} set-ups");
            for i in 0..written {
                let r = record_of(&format!("p{i}"), S::TearingDown);
                let (pod, unique) = (r.pod.uid.clone(), r.unique_name.clone());
                record.commit(Change::PodVolume(r), true).await.expect("a teardown's intent is recorded on the full disk");
                record.commit(Change::RemovePodVolume { pod, volume: "d".into(), unique }, false).await.unwrap();
            }
            assert!(record.commit(Change::PodVolume(record_of("after", S::SettingUp)), true).await.is_err());
            std::fs::remove_file(node_root.join("filler")).unwrap();
            record.commit(Change::PodVolume(record_of("after", S::SettingUp)), true).await.expect("set-ups recorded once space returns");
            drop(record);
            let loaded = Record::read(&node_root).unwrap();
            assert!(loaded.corrupt.is_empty());
            assert_eq!(loaded.pods.iter().map(|r| r.pod.name.to_string()).collect::<Vec<_>>(), ["after"]);
        });
    }
}

/// A pod manifest of `namespace/name` with `uid` (none if empty) and one emptyDir `volume`.
fn pod_with_uid(namespace: &str, name: &str, uid: &str, volume: &str) -> String {
    let uid = if uid.is_empty() {
        String::new()
    } else {
        format!(", uid: {uid}")
    };
    format!("apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: {namespace}{uid}}}\nspec:\n  containers: [{{name: c, image: i, volumeMounts: [{{name: {volume}, mountPath: /d}}]}}]\n  volumes: [{{name: {volume}, emptyDir: {{}}}}]\n")
}

mount_test! {
    /// A manifest writer gives a pod of its namespace the UID of another namespace's running
    /// pod, in a file that sorts first: the newcomer is refused (its file's error and an event
    /// on the running pod name both), the running pod keeps its volume and its data, whether
    /// the newcomer's volume has the same name or another, live and across a restart (where
    /// both files are listed at once).
    fn a_pod_that_takes_another_pods_uid_is_refused_and_the_first_keeps_it() {
        let root = TestRoot::new();
        let manifests = root.manifests();
        let web = pod_named("web");
        let web = {
            let mut p = web;
            p.metadata.namespace = Some("team-a".into());
            p
        };
        let uid = kubevol::pod_uid(&web);
        write_manifest(&manifests, "web.yaml", &pod_with_uid("team-a", "web", "", "data"));
        runtime().block_on(async {
            let m = manager(root.path(), |_| {});
            let _watch = ManifestSource::new(&manifests).listen(m.store().sink(ManifestSource::NAME)).await.unwrap();
            m.wait_for_attach_and_mount(&web).await.expect("web mounted");
            let data = m.mounted_volumes_for_pod(&uid)["data"].path.clone();
            std::fs::write(data.join("victim"), "VICTIM-DATA").unwrap();

            for volume in ["data", "other"] {
                write_manifest(&manifests, "000-evil.yaml", &pod_with_uid("team-b", "evil", uid.as_str(), volume));
                let refused = format!("pod team-b/evil is refused: its metadata.uid {uid} is already the UID of pod team-a/web");
                let deadline = std::time::Instant::now() + Duration::from_secs(120);
                loop {
                    let (errors, events) = (m.store().file_errors(), m.events());
                    let in_file = errors.iter().any(|e| e.message.contains(&refused) && e.path.ends_with("000-evil.yaml"));
                    let event = events.iter().any(|e| e.reason == "UIDConflict" && e.message.contains("team-b/evil") && e.message.contains("team-a/web"));
                    if in_file && event {
                        break;
                    }
                    assert!(std::time::Instant::now() < deadline, "{volume}: the newcomer refused: {errors:#?} {events:#?}");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                // The populator has looked at the UID since the newcomer came (the event above);
                // a probe pod mounted after that proves the reconciler planned since.
                let probe = pod_with_volumes(&format!("probe-{volume}"), json!([{"name": "p", "emptyDir": {}}]));
                m.add_pod(probe.clone());
                m.wait_for_attach_and_mount(&probe).await.expect("the probe pod mounted");
                let status = m.pod_status(&uid).expect("web's status");
                assert_eq!((status.namespace.as_str(), status.name.as_str(), status.phase), ("team-a", "web", PodPhase::Ready));
                assert_eq!(std::fs::read_to_string(data.join("victim")).unwrap(), "VICTIM-DATA", "{volume}: web keeps its data");
                assert!(!m.mounted_volumes_for_pod(&uid).contains_key("other"), "nothing of evil's is mounted");
            }

            // After a restart both files are listed at once; the record says whose the UID is.
            let m = restart(m, root.path(), |_| {}).await;
            let _watch = ManifestSource::new(&manifests).listen(m.store().sink(ManifestSource::NAME)).await.unwrap();
            m.wait_for_attach_and_mount(&web).await.expect("web mounted again");
            let status = m.pod_status(&uid).expect("web's status");
            assert_eq!((status.namespace.as_str(), status.name.as_str()), ("team-a", "web"));
            assert_eq!(std::fs::read_to_string(data.join("victim")).unwrap(), "VICTIM-DATA");
            assert!(m.store().file_errors().iter().any(|e| e.path.ends_with("000-evil.yaml") && e.message.contains("is refused")));
            m.shutdown();
        });
    }
}
