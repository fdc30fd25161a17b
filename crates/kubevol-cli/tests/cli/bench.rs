//! `kubevol bench` prints its figures, against the raw floor, in each of its modes, and leaves
//! nothing behind.

use super::*;

/// `kubevol bench ARGS --idle-seconds 0` in a private namespace, its temporary roots under
/// `tmp`: what it printed.
fn bench(tmp: &Path, args: &[&str]) -> String {
    let mut all = vec!["bench"];
    all.extend(args);
    all.extend(["--idle-seconds", "0"]);
    succeeds(in_namespace(&all).env("TMPDIR", tmp)).0
}

mount_test! {
    /// The benchmark runs end to end on a small node: each size prints its figures against the
    /// floor measured in the same run (p99 against the floor's time for all set-ups, CPU as a
    /// ratio), then the cost curve and each larger size's CPU per volume against the first; its
    /// root goes with it.
    fn bench_prints_its_figures_against_the_floor_and_leaves_nothing() {
        require_root();
        let tmp = tempfile::tempdir().unwrap();
        let stdout = bench(tmp.path(), &["--scale", "4,8", "--volumes", "2"]);
        for want in [
            "4 pods x 2 Memory emptyDir volumes = 8 tmpfs mounts",
            "times the floor's time for all 8 set-ups",
            "8 pods x 2 Memory emptyDir volumes = 16 tmpfs mounts",
            "times the floor's time for all 16 set-ups",
            "the cost curve",
            "MiB of the program's file pages)",
        ] {
            assert!(stdout.contains(want), "{want:?} missing:\n{stdout}");
        }
        let ratios: Vec<f64> = stdout
            .lines()
            .filter_map(|l| l.split_once("(kubevol/floor ")?.1.strip_suffix(')'))
            .map(|r| r.parse().unwrap())
            .collect();
        assert_eq!(ratios.len(), 2, "{stdout}");
        assert!(
            ratios.iter().all(|r| r.is_finite() && *r > 0.0),
            "{ratios:?}"
        );
        let curve = stdout
            .lines()
            .find_map(|l| l.strip_prefix("CPU per volume at 8 pods: "))
            .unwrap_or_else(|| panic!("no CPU per volume against the first size:\n{stdout}"));
        let (ratio, base) = curve.split_once(" times that at ").unwrap();
        assert!(ratio.parse::<f64>().unwrap() > 0.0, "{curve}");
        assert_eq!(base, "4 pods");
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
    }
}

mount_test! {
    /// The benchmark's other figures run end to end on a small node too: a restart finds every
    /// volume it left mounted in the record and reconstructs it without a problem, content volumes
    /// are ready and updated against their floor, and a root on the disk is named as such; none
    /// leaves its root behind.
    fn bench_restart_content_and_on_disk_print_their_figures_and_leave_nothing() {
        require_root();
        let tmp = tempfile::tempdir().unwrap();
        let bench = |mode: &str| bench(tmp.path(), &["--pods", "8", "--volumes", "2", mode]);
        // "(raw floor X ms, ratio R)": the ratios a content run prints.
        let floor_ratios = |out: &str| -> Vec<f64> {
            out.lines()
                .filter_map(|l| l.split_once(", ratio ")?.1.strip_suffix(')')?.parse().ok())
                .collect()
        };

        let restart = bench("--restart");
        assert!(
            restart.contains("start to first reconcile: ")
                && restart.contains("16 pod volumes, 0 problems")
                && restart.contains("start to every pod ready again: "),
            "{restart}"
        );

        let content = bench("--content");
        assert!(
            content.contains(
                "8 pods x (configMap 10 keys, secret 3 keys, projected 14 files) = 24 volumes"
            ) && content.contains("ConfigMap update, 16 volumes rewritten"),
            "{content}"
        );
        let ratios = floor_ratios(&content);
        assert_eq!(
            ratios.len(),
            2,
            "ready and update against the floor: {content}"
        );
        assert!(ratios.iter().all(|r| *r > 0.0), "{content}");

        let on_disk = bench("--on-disk");
        assert!(
            on_disk.contains(" on the disk (") && on_disk.contains("(kubevol/floor "),
            "{on_disk}"
        );
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
    }
}

mount_test! {
    /// The benchmark's CSI mode (the loop driver as a child, a PersistentVolume per pod) and its
    /// cluster mode (the in-process API server) end to end on a small node: each prints its
    /// figures, and nothing is left behind — no temporary root, and no loop device still bound to
    /// a file of the run's.
    fn bench_csi_and_cluster_print_their_figures_and_leave_nothing() {
        require_root();
        let tmp = tempfile::tempdir().unwrap();
        let bench = |mode: &str| bench(tmp.path(), &["--pods", "8", mode]);

        let csi = bench("--csi");
        assert!(
            csi.contains(
                "8 pods, one after another, each with its own PersistentVolume of loop.csi.kubevol.io"
            ) && csi.contains("(ratio floor/kubevol ")
                && csi.contains("tear-down of all 8 pods at once"),
            "{csi}"
        );
        common::no_loop_devices_left(tmp.path(), "bench --csi");

        let cluster = bench("--cluster");
        assert!(
            cluster.contains(
                "8 pods x (Memory emptyDir, secret, projected service account volume) created at once"
            ) && cluster.contains("all 8 pods ready ")
                && cluster.contains("all torn down ")
                && cluster.contains("API requests by the node while the pods came: "),
            "{cluster}"
        );
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
    }
}

mount_test! {
    /// `bench --cluster --nodes 2` against the real control plane (the README's test command starts
    /// one; without it the benchmark says how to get one, and this fails): two nodes of their own,
    /// each its own process, against one server, a row each with its latency, the watches it
    /// opened and its API requests per pod (from the server's audit log), and the server's CPU.
    fn bench_cluster_with_several_nodes_prints_a_row_per_node() {
        require_root();
        let tmp = tempfile::tempdir().unwrap();
        let out = bench(tmp.path(), &["--cluster", "--nodes", "2", "--pods", "4"]);
        assert!(
            out.contains("2 nodes x 4 pods x (Memory emptyDir, secret, projected service account volume) created at once in a real kube-apiserver"),
            "{out}"
        );
        let rows: Vec<&str> = out
            .lines()
            .filter(|l| l.starts_with("bench-node-"))
            .collect();
        assert_eq!(rows.len(), 2, "{out}");
        let mut nodes = std::collections::BTreeSet::new();
        for row in rows {
            let fields: Vec<&str> = row.split_whitespace().collect();
            nodes.insert(fields[0]);
            let per_pod: f64 = fields[fields.len() - 1].parse().unwrap();
            let watches: u64 = fields[fields.len() - 2].parse().unwrap();
            assert!(per_pod > 0.0, "the node's requests are counted: {row}");
            assert!(watches > 0, "its four Secrets are watched: {row}");
        }
        assert_eq!(nodes.len(), 2, "two nodes of their own: {out}");
        for line in [
            "all 8 pods: ready p50 ",
            "API requests per pod of a node: min ",
            "watches opened by a node while its pods came: ",
            "CPU seconds of the 2 node processes while their pods came: ",
            "CPU seconds of the kube-apiserver and etcd meanwhile ",
        ] {
            assert!(out.contains(line), "{line}: {out}");
        }
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
    }
}

/// The kubelet harness (tools/k8s/build-harness.sh): the one `./test.sh` built, or built here.
fn kubelet_harness() -> std::path::PathBuf {
    if let Some(h) = std::env::var_os("KUBEVOL_KUBELET_HARNESS") {
        return h.into();
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/k8s/build-harness.sh");
    let out = std::process::Command::new(&script)
        .output()
        .expect("run tools/k8s/build-harness.sh (Go builds the kubelet harness)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dir = String::from_utf8_lossy(&out.stdout);
    Path::new(dir.lines().last().unwrap().trim()).join("kubelet-harness")
}

mount_test! {
    /// Side by side with the kubelet's own code, built from k8s.io/kubernetes: the
    /// VolumeManager on the same pods (both sets of figures, the ratios, and no mount left by
    /// either), and fsGroup on the same tree (kubevol's, the kubelet's SetVolumeOwnership and
    /// the raw walk, first time and again, and OnRootMismatch not walking), and volume stats on
    /// one tree (the kubelet's MetricsDu, kubevol's walk, the raw stat; every entry counted).
    fn bench_measures_kubevol_beside_the_kubelets_own_code() {
        require_root();
        let tmp = tempfile::tempdir().unwrap();
        let harness = kubelet_harness();
        let run = |args: &[&str]| {
            let mut all = vec!["bench"];
            all.extend(args);
            all.extend(["--idle-seconds", "0"]);
            succeeds(
                in_namespace(&all)
                    .env("TMPDIR", tmp.path())
                    .env("KUBEVOL_KUBELET_HARNESS", &harness),
            )
            .0
        };
        let versus = run(&["--versus-kubelet", "--pods", "8", "--volumes", "2"]);
        let ratio = |out: &str, row: &str| -> f64 {
            let line = out.lines().find(|l| l.trim_start().starts_with(row)).unwrap_or_else(|| panic!("no {row:?}:\n{out}"));
            line.split_whitespace().last().unwrap().trim_end_matches('x').parse().unwrap()
        };
        assert!(versus.contains("the kubelet's own VolumeManager"), "{versus}");
        for row in ["ready p50", "ready p99", "all torn down"] {
            let r = ratio(&versus, row);
            assert!(r.is_finite() && r > 0.0, "{row}: {r}\n{versus}");
        }

        let fs_group = run(&["--fs-group", "3000"]);
        for want in ["raw single-threaded walk (floor)", "kubelet SetVolumeOwnership", "kubevol is faster than the kubelet", "OnRootMismatch with the root already right: kubevol"] {
            assert!(fs_group.contains(want), "{want:?} missing:\n{fs_group}");
        }

        // The walks agree (the benchmark fails otherwise) and their figures are printed.
        let stats = run(&["--volume-stats", "3000"]);
        for want in ["raw single-threaded stat of every entry", "kubelet MetricsDu", "kubevol walk is faster than the kubelet's"] {
            assert!(stats.contains(want), "{want:?} missing:\n{stats}");
        }
        let walk = stats.lines().find(|l| l.starts_with("kubevol walk ")).unwrap_or_default();
        assert_eq!(walk.split_whitespace().last(), Some("3001"), "every entry and the root: {stats}");
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0, "nothing left behind");
    }
}
