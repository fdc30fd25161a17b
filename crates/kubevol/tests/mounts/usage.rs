//! emptyDir usage (`/stats/summary`, `describe`): from the filesystem's project quota on
//! loop-mounted XFS and ext4, by a walk elsewhere, from its own tmpfs for a memory medium; each
//! checked against `du` on the same tree.

use std::path::Path;
use std::time::Duration;

use crate::common::*;
use serde_json::{json, Value};

/// Mounts a new filesystem `fs` (`xfs` or `ext4`) of a sparse file at `<root>/root`, the
/// manager's root, with project quotas where the kernel has them (XFS needs
/// `CONFIG_XFS_QUOTA`, ext4 `CONFIG_QFMT_V2`), else without: says which. A loop device the
/// kernel detaches at the unmount.
fn loop_root(root: &Path, fs: &str) -> bool {
    let image = root.join(format!("{fs}.img"));
    let target = root.join("root");
    std::fs::create_dir(&target).unwrap();
    let try_with = |quotas: bool| {
        std::fs::File::create(&image)
            .unwrap()
            .set_len(512 << 20)
            .unwrap();
        let mkfs = match (fs, quotas) {
            ("xfs", _) => std::process::Command::new("mkfs.xfs")
                .args(["-q", "-f"])
                .arg(&image)
                .status(),
            (_, true) => std::process::Command::new("mkfs.ext4")
                .args(["-q", "-F", "-O", "quota,project"])
                .arg(&image)
                .status(),
            (_, false) => std::process::Command::new("mkfs.ext4")
                .args(["-q", "-F"])
                .arg(&image)
                .status(),
        };
        assert!(mkfs.unwrap().success(), "mkfs.{fs}");
        let options = if quotas { "loop,prjquota" } else { "loop" };
        let out = std::process::Command::new("mount")
            .args(["-o", options])
            .arg(&image)
            .arg(&target)
            .output()
            .unwrap();
        out.status.success()
    };
    if try_with(true) {
        return true;
    }
    skipped(
        &format!("emptyDir usage by project quota on {fs}"),
        &format!("this kernel cannot mount {fs} with prjquota (no CONFIG_XFS_QUOTA, or no QFMT_V2 for ext4): its test takes the walk"),
    );
    assert!(try_with(false), "mount {fs}");
    false
}

/// `du`'s bytes (blocks) and inodes of the tree at `path`, one filesystem.
fn du(path: &Path) -> (u64, u64) {
    let run = |args: &[&str]| {
        let out = std::process::Command::new("du")
            .args(args)
            .arg(path)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "du: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout)
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .parse::<u64>()
            .unwrap()
    };
    (run(&["-s", "-x", "-B1"]), run(&["-s", "-x", "--inodes"]))
}

/// Writes `files` files of 10,000 bytes, a subdirectory each 100, and a second link to one.
fn fill(dir: &Path, files: usize, tag: &str) {
    for i in 0..files {
        let sub = dir.join(format!("{tag}-{}", i / 100));
        std::fs::create_dir_all(&sub).unwrap();
        std::fs::write(sub.join(format!("f{i}")), vec![b'x'; 10_000]).unwrap();
    }
    std::fs::hard_link(
        dir.join(format!("{tag}-0/f0")),
        dir.join(format!("{tag}-link")),
    )
    .unwrap();
    rustix::fs::sync();
}

/// The volume `name` of `pod` in the summary, once measured after `after` bytes were in it.
async fn measured(m: &kubevol::VolumeManager, pod: &str, name: &str, at_least: u64) -> Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let summary = m.stats_summary().await;
        let found = summary["pods"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|p| p["podRef"]["name"] == pod)
            .flat_map(|p| p["volume"].as_array().cloned().unwrap_or_default())
            .find(|v| v["name"] == name && v["usedBytes"].as_u64().unwrap_or(0) >= at_least);
        if let Some(v) = found {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{pod}/{name} not measured with {at_least} bytes: {summary:#}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A pod with a disk-backed and a memory-backed emptyDir on a root of `fs` (`None`: the test's
/// own filesystem): the disk-backed one is measured by its project where the filesystem
/// accounts projects, else walked; both agree with du; a restart keeps the project, and what
/// the pod adds is seen at the next measure.
fn usage_on(fs: Option<&str>) {
    let root = TestRoot::new();
    let quotas = fs.is_some_and(|fs| loop_root(root.path(), fs));
    let by = if quotas { "project-quota" } else { "walk" };
    runtime().block_on(async {
        let fast = |c: &mut kubevol::Config| c.volume_stats_period = Duration::from_millis(100);
        let m = manager(root.path(), fast);
        let p = pod_with_volumes("app", json!([{"name": "scratch", "emptyDir": {}}, {"name": "mem", "emptyDir": {"medium": "Memory"}}]));
        let uid = m.add_pod(p.clone());
        m.wait_for_attach_and_mount(&p).await.expect("mounted");
        let scratch = m.mounted_volumes_for_pod(&uid)["scratch"].path.clone();
        let mem = m.mounted_volumes_for_pod(&uid)["mem"].path.clone();
        fill(&scratch, 1_000, "a");
        std::fs::write(mem.join("m"), vec![1u8; 1 << 20]).unwrap();

        let (bytes, inodes) = du(&scratch);
        let v = measured(&m, "app", "scratch", bytes).await;
        assert_eq!(v["measuredBy"], by, "{v}");
        assert_eq!(v["usedBytes"], bytes, "du's bytes: {v}");
        assert_eq!(v["inodesUsed"], inodes, "du's inodes: {v}");
        assert!(v["capacityBytes"].as_u64().unwrap() > 0 && v["time"].is_string(), "{v}");
        let v = measured(&m, "app", "mem", 1 << 20).await;
        assert_eq!(v["measuredBy"], "own-filesystem", "{v}");
        assert_eq!(v["usedBytes"], du(&mem).0, "{v}");
        let described = m.describe_pod(&uid).unwrap();
        let text = serde_json::to_string(&described).unwrap();
        assert!(text.contains(&format!("{bytes} bytes in {inodes} inodes, measured by {by}")), "{text}");

        // After a restart the volume keeps its project; what the pod adds is measured.
        let m = restart(m, root.path(), fast).await;
        m.add_pod(p.clone());
        m.wait_for_attach_and_mount(&p).await.expect("mounted again");
        fill(&scratch, 500, "b");
        let (bytes, inodes) = du(&scratch);
        let v = measured(&m, "app", "scratch", bytes).await;
        assert_eq!((v["measuredBy"].clone(), v["usedBytes"].clone(), v["inodesUsed"].clone()), (json!(by), json!(bytes), json!(inodes)), "{v}");

        m.remove_pod(&p);
        m.wait_for_unmount(&p).await.expect("torn down");
        assert!(!scratch.exists(), "the volume is removed");
        m.shutdown();
    });
}

mount_test! {
    fn an_empty_dir_on_xfs_is_measured_by_its_project_where_quotas_are_on() {
        usage_on(Some("xfs"));
    }
}

mount_test! {
    fn an_empty_dir_on_ext4_is_measured_by_its_project_where_quotas_are_on() {
        usage_on(Some("ext4"));
    }
}

mount_test! {
    fn an_empty_dir_on_the_roots_own_filesystem_is_walked() {
        usage_on(None);
    }
}

mount_test! {
    /// The project kubevol gives a directory is the one xfs_io reads, inherited.
    fn a_project_given_on_xfs_is_read_back_by_xfs_io() {
        let root = TestRoot::new();
        loop_root(root.path(), "xfs");
        let d = root.path().join("root/volume");
        std::fs::create_dir(&d).unwrap();
        let dir = kubevol_mount::safe::Dir::open(&d).unwrap();
        assert_eq!(kubevol_mount::usage::project(&dir).unwrap(), None, "no project yet");
        kubevol_mount::usage::set_project(&dir, 1_048_600).unwrap();
        assert_eq!(kubevol_mount::usage::project(&dir).unwrap(), Some(1_048_600));
        let out = std::process::Command::new("xfs_io").args(["-c", "lsproj", "-c", "lsattr"]).arg(&d).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("projid = 1048600"), "{text}");
        assert!(text.lines().nth(1).is_some_and(|l| l.split_whitespace().next().unwrap_or("").contains('P')), "inherited: {text}");
        std::fs::create_dir(d.join("child")).unwrap();
        let child = kubevol_mount::safe::Dir::open(&d.join("child")).unwrap();
        assert_eq!(kubevol_mount::usage::project(&child).unwrap(), Some(1_048_600), "a new entry takes it");
    }
}

mount_test! {
    /// A volume whose measurement hangs (a FUSE mount inside it that never answers) is measured
    /// by one thread, however many `/stats/summary` requests come: each request answers within
    /// its wait, without that volume's usage, and a new pod (a configMap and an fsGroup
    /// emptyDir, set-ups that take blocking threads) is set up meanwhile. When the filesystem
    /// dies the measurement ends and its thread with it.
    fn a_hung_measurement_is_made_once_and_stalls_neither_requests_nor_set_ups() {
        let root = TestRoot::new();
        runtime().block_on(async {
            let fast = |c: &mut kubevol::Config| c.volume_stats_period = Duration::from_millis(100);
            let m = manager(root.path(), fast);
            let p = pod_with_volumes("hung", json!([{"name": "scratch", "emptyDir": {}}]));
            let uid = m.add_pod(p.clone());
            m.wait_for_attach_and_mount(&p).await.expect("mounted");
            let scratch = m.mounted_volumes_for_pod(&uid)["scratch"].path.clone();
            std::fs::create_dir(scratch.join("stuck")).unwrap();
            let fuse = hung_fuse_mount(&scratch.join("stuck"));

            let ask = |n: usize| {
                let m = m.clone();
                async move {
                    let requests: Vec<_> = (0..n).map(|_| tokio::spawn({
                        let m = m.clone();
                        async move { m.stats_summary().await }
                    })).collect();
                    let mut answers = Vec::new();
                    for r in requests {
                        let answer = tokio::time::timeout(Duration::from_secs(120), r).await;
                        answers.push(answer.expect("a request answers within its wait").unwrap());
                    }
                    answers
                }
            };
            for summary in ask(20).await {
                assert!(!summary.to_string().contains("\"scratch\""), "the hung volume has no measure yet: {summary}");
            }
            assert_eq!(m.usage_measurements(), (1, 1), "one measurement of the hung volume, on one thread");

            m.library().upsert_objects(vec![kubevol::store::Object::ConfigMap(serde_json::from_value(json!({
                "metadata": {"name": "cfg", "namespace": "default"}, "data": {"k": "v"}})).unwrap())]);
            let mut fresh = pod_with_volumes("fresh", json!([{"name": "cfg", "configMap": {"name": "cfg"}}, {"name": "data", "emptyDir": {}}]));
            fresh.spec.as_mut().unwrap().security_context = Some(serde_json::from_value(json!({"fsGroup": 2000})).unwrap());
            m.add_pod(fresh.clone());
            m.wait_for_attach_and_mount(&fresh).await.expect("a new pod is set up while the measurement hangs");
            let summaries = ask(20).await;
            assert_eq!(m.usage_measurements(), (1, 1), "still the one measurement");
            assert!(summaries.iter().any(|s| s.to_string().contains("\"fresh\"")), "the new pod's emptyDir is measured: {:?}", summaries.last());

            // The filesystem dies: the walk fails, its thread ends, and the next request
            // measures the volume again (the dead mount is passed by).
            drop(fuse);
            let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
            while m.usage_measurements() != (0, 0) {
                assert!(tokio::time::Instant::now() < deadline, "the measurement ended: {:?}", m.usage_measurements());
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            {
                use kubevol_mount::Mounter;
                kubevol_mount::LinuxMounter.unmount(&scratch.join("stuck")).unwrap();
            }
            measured(&m, "hung", "scratch", 1).await;

            m.remove_pods(&[p.clone(), fresh.clone()]);
            m.wait_for_all_pods_unmount(&[p, fresh]).await.expect("torn down");
            m.shutdown();
        });
    }
}
