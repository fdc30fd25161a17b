//! The `kubevol` command end to end. Each run happens under `unshare --mount --propagation
//! private`, so its mounts vanish with it, on a temporary root removed afterwards.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod bench;
mod mounts;
#[macro_use]
#[path = "../../../kubevol/tests/common/mod.rs"]
mod common;
#[path = "../loop_driver/mod.rs"]
mod loop_driver;
mod process;
use loop_driver::free_port;

const BIN: &str = env!("CARGO_BIN_EXE_kubevol");

/// A valid pod with one emptyDir.
const OK_POD: &str = "apiVersion: v1\nkind: Pod\nmetadata: {name: ok}\nspec: {containers: [{name: c, volumeMounts: [{name: v, mountPath: /v}]}], volumes: [{name: v, emptyDir: {}}]}\n";

fn examples() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/manifests")
}

/// The example manifests without the CSI example (for runs without the loop driver).
fn examples_without_csi() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(examples()).unwrap() {
        let e = e.unwrap();
        if e.file_name() != "database.yaml" {
            std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
        }
    }
    dir
}

/// `kubevol ARGS` in a private mount namespace with the loop CSI driver beside it
/// (examples/with-loop-driver.sh), its controller passed to kubevol.
fn with_loop_driver(root: &str, args: &[&str]) -> Command {
    let bin_dir = Path::new(BIN).parent().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/with-loop-driver.sh");
    let mut c = Command::new("unshare");
    c.args(["--mount", "--propagation", "private"])
        .arg(script)
        .arg(bin_dir)
        .arg(root)
        .args([
            "sh",
            "-c",
            "exec \"$0\" \"$@\" --csi-controller \"$KUBEVOL_CSI_CONTROLLER\"",
            BIN,
        ])
        .args(args);
    c
}

fn in_namespace(args: &[&str]) -> Command {
    let mut c = Command::new("unshare");
    c.args(["--mount", "--propagation", "private", BIN])
        .args(args);
    c
}

/// `kubevol [global...] run --once` on a manifest directory and root, in a private namespace.
fn run_once(
    global: &[&str],
    manifests: &std::path::Path,
    root: &std::path::Path,
) -> std::process::Output {
    let mut args = global.to_vec();
    args.extend([
        "run",
        "--once",
        "--manifests",
        manifests.to_str().unwrap(),
        "--root-dir",
        root.to_str().unwrap(),
    ]);
    in_namespace(&args).output().unwrap()
}

/// `kubevol run` as a daemon on a manifest directory and root, serving on `listen`, in a
/// private namespace.
fn daemon(manifests: &Path, root: &Path, listen: &str) -> Command {
    in_namespace(&[
        "run",
        "--manifests",
        manifests.to_str().unwrap(),
        "--root-dir",
        root.to_str().unwrap(),
        "--listen",
        listen,
    ])
}

/// A daemon on `manifests` and `root` serving HTTP on a free port, its log in `<dir>/log`
/// (at `level` when given, as `RUST_LOG`): the child, the port and the log's path.
fn logged_daemon(
    dir: &Path,
    manifests: &Path,
    root: &Path,
    level: Option<&str>,
) -> (Running, u16, std::path::PathBuf) {
    let port = free_port();
    let log = dir.join("log");
    let mut command = daemon(manifests, root, &format!("127.0.0.1:{port}"));
    if let Some(level) = level {
        command.env("RUST_LOG", level);
    }
    let child = command
        .stderr(std::fs::File::create(&log).unwrap())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    (Running(child), port, log)
}

/// A daemon child stopped with SIGTERM when dropped, also when its test fails (the loop
/// driver's script forwards it, and detaches its devices).
struct Running(std::process::Child);

impl std::ops::Deref for Running {
    type Target = std::process::Child;
    fn deref(&self) -> &std::process::Child {
        &self.0
    }
}

impl std::ops::DerefMut for Running {
    fn deref_mut(&mut self) -> &mut std::process::Child {
        &mut self.0
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = Command::new("kill")
                .args(["-TERM", &self.0.id().to_string()])
                .status();
            let _ = self.0.wait();
        }
    }
}

/// Sends SIGTERM to `child` and waits for it: its exit status.
fn sigterm(child: &mut std::process::Child) -> std::process::ExitStatus {
    let st = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    child.wait().unwrap()
}

/// `kubevol run --once` on a manifest directory and root with `extra` flags, in a private
/// namespace: whether it succeeded, and what it printed.
fn once(manifests: &Path, root: &Path, extra: &[&str]) -> (bool, String) {
    let mut args = vec![
        "run",
        "--once",
        "--manifests",
        manifests.to_str().unwrap(),
        "--root-dir",
        root.to_str().unwrap(),
    ];
    args.extend(extra);
    let out = in_namespace(&args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// A temporary directory with an empty manifest directory `m` and a root `root` (not made yet)
/// in it.
fn scratch() -> (tempfile::TempDir, std::path::PathBuf, std::path::PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let (manifests, root) = (tmp.path().join("m"), tmp.path().join("root"));
    std::fs::create_dir_all(&manifests).unwrap();
    (tmp, manifests, root)
}

fn require_root() {
    let out = Command::new("id").arg("-u").output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "0",
        "these tests mount for real: run them as root"
    );
}

/// Runs `c`, which must succeed (else its exit, output and errors are shown); its output and
/// its errors.
fn succeeds(c: &mut Command) -> (String, String) {
    let out = c.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "exit {:?}\n{stdout}\n{stderr}",
        out.status
    );
    (stdout, stderr)
}

mount_test! {
    fn run_once_prints_what_was_mounted_where() {
        require_root();
        let root = tempfile::tempdir().unwrap();
        let root_s = root.path().to_str().unwrap();
        let (stdout, stderr) = succeeds(&mut with_loop_driver(
            root_s,
            &[
                "run",
                "--once",
                "--manifests",
                examples().to_str().unwrap(),
                "--root-dir",
                root_s,
                "--node-name",
                "demo",
            ],
        ));
        let lines: Vec<&str> = stdout.lines().collect();
        assert!(
            lines[0].starts_with("NAMESPACE/POD") && lines[0].contains("PATH OR ERROR"),
            "{stdout}"
        );
        let row = |pod: &str, vol: &str| {
            lines
                .iter()
                .find(|l| l.starts_with(pod) && l.split_whitespace().nth(1) == Some(vol))
                .copied()
        };
        let cache = row("default/web", "cache")
            .unwrap_or_else(|| panic!("no cache row in\n{stdout}\n{stderr}"));
        assert!(
            cache.contains("emptyDir")
                && cache.contains("Mounted")
                && cache.contains(&format!("{root_s}/pods/")),
            "{cache}"
        );
        assert!(
            cache.ends_with("/volumes/kubernetes.io~empty-dir/cache"),
            "{cache}"
        );
        let certs = row("default/web", "certs").expect("certs row");
        assert!(
            certs.contains("hostPath") && certs.ends_with("/etc/ssl/certs"),
            "{certs}"
        );
        assert!(
            row("jobs/batch", "work").is_some(),
            "flow-style document in a multi-document file"
        );
        assert!(
            !stdout.lines().any(|l| l.starts_with("default/elsewhere")),
            "the other node's pod is not set up: {stdout}"
        );
        assert!(
            stdout.contains("1 pod assigned to other nodes skipped (this node is demo)"),
            "and the notes say so: {stdout}"
        );
        let data = row("default/db", "data").expect("CSI claim row");
        assert!(
            data.contains("csi")
                && data.contains("Mounted")
                && data.ends_with("/volumes/kubernetes.io~csi/db-data/mount"),
            "{data}"
        );
        let scratch = row("default/db", "scratch").expect("inline CSI row");
        assert!(scratch.contains("Mounted"), "{scratch}");
    }
}

mount_test! {
    fn run_once_exits_non_zero_and_explains_invalid_pods() {
        require_root();
        let root = tempfile::tempdir().unwrap();
        let manifests = tempfile::tempdir().unwrap();
        std::fs::write(manifests.path().join("ok.yaml"), OK_POD).unwrap();
        std::fs::write(manifests.path().join("bad.yaml"), "apiVersion: v1\nkind: Pod\nmetadata: {name: bad}\nspec: {containers: [{name: c, volumeMounts: [{name: v, mountPath: /v}]}], volumes: [{name: v, hostPath: {path: /tmp, type: Folder}}]}\n").unwrap();
        let out = run_once(&[], manifests.path(), root.path());
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(1), "{stdout}");
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with("default/ok") && l.contains("Mounted")),
            "{stdout}"
        );
        let bad = stdout
            .lines()
            .find(|l| l.starts_with("default/bad"))
            .expect("rejected pod row");
        assert!(
            bad.contains("Rejected")
                && bad.contains("bad.yaml (document 1)")
                && bad.contains("spec.volumes[0].hostPath.type: Unsupported value: \"Folder\""),
            "{bad}"
        );
    }
}

mount_test! {
    fn json_logs_are_one_json_object_per_line() {
        require_root();
        let root = tempfile::tempdir().unwrap();
        let manifests = tempfile::tempdir().unwrap();
        std::fs::write(manifests.path().join("ok.yaml"), OK_POD).unwrap();
        let out = run_once(&["--log-format", "json"], manifests.path(), root.path());
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        let lines: Vec<serde_json::Value> = stderr
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
            .collect();
        assert!(
            lines
                .iter()
                .any(|l| l["fields"]["message"] == "every volume of the pod is mounted" && l["level"] == "INFO"),
            "{stderr}"
        );
    }
}

fn status(server: &str, extra: &[&str]) -> String {
    succeeds(
        Command::new(BIN)
            .args(["status", "--server", server])
            .args(extra),
    )
    .0
}

/// `GET path` on a daemon's port: the whole answer (status line, headers and body), or empty
/// while nothing listens.
fn http_get(port: u16, path: &str) -> String {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return String::new();
    };
    let _ = write!(s, "GET {path} HTTP/1.0\r\n\r\n");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

/// Polls `GET path` until `cond` holds for the answer, for at most a minute (a readiness probe,
/// as a kubelet's would be; the daemon's own logs cannot be read in these tests).
fn until_http(port: u16, path: &str, cond: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let answer = http_get(port, path);
        if cond(&answer) {
            return answer;
        }
        assert!(
            Instant::now() < deadline,
            "GET {path} never satisfied the condition; last answer: {answer}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

mount_test! {
    fn run_once_waits_for_retried_volumes_and_says_which_pods_failed_for_good_or_timed_out() {
        require_root();
        let root = tempfile::tempdir().unwrap();
        let manifests = tempfile::tempdir().unwrap();
        let host = tempfile::tempdir().unwrap();
        let parent = host.path().join("made-by-the-other-volume");
        // The file's parent is made by the same pod's other volume: whichever is set up first,
        // the pod is ready once the other has been retried.
        std::fs::write(
            manifests.path().join("pair.yaml"),
            format!(
                "apiVersion: v1\nkind: Pod\nmetadata: {{name: pair}}\nspec:\n  containers: [{{name: c, volumeMounts: [{{name: f, mountPath: /f}}, {{name: d, mountPath: /d}}]}}]\n  volumes:\n  - {{name: f, hostPath: {{path: {p}/file, type: FileOrCreate}}}}\n  - {{name: d, hostPath: {{path: {p}, type: DirectoryOrCreate}}}}\n",
                p = parent.display()
            ),
        )
        .unwrap();
        let mut args = vec![
            "run",
            "--once",
            "--backoff-initial",
            "50ms",
            "--manifests",
            manifests.path().to_str().unwrap(),
            "--root-dir",
            root.path().to_str().unwrap(),
        ];
        let out = in_namespace(&args).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{stdout}");
        assert_eq!(
            stdout
                .lines()
                .filter(|l| l.starts_with("default/pair") && l.contains("Mounted"))
                .count(),
            2,
            "{stdout}"
        );

        // A pod that can never be ready and one that is still retried when time runs out.
        std::fs::write(manifests.path().join("nfs.yaml"), "apiVersion: v1\nkind: Pod\nmetadata: {name: nfs}\nspec: {containers: [{name: c, volumeMounts: [{name: v, mountPath: /v}]}], volumes: [{name: v, nfs: {server: x, path: /y}}]}\n").unwrap();
        std::fs::write(manifests.path().join("waits.yaml"), "apiVersion: v1\nkind: Pod\nmetadata: {name: waits}\nspec: {containers: [{name: c, volumeMounts: [{name: v, mountPath: /v}]}], volumes: [{name: v, configMap: {name: not-there}}]}\n").unwrap();
        // Long enough for a loaded machine to try every volume (the pod that can never be ready
        // ends its own wait at once); the one still retried keeps the run to the end.
        args.extend(["--timeout", "60s"]);
        let out = in_namespace(&args).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(1), "{stdout}");
        assert!(
            !stdout.contains("retry in"),
            "nothing is retried after the table: {stdout}"
        );
        assert!(
            stdout.contains("Failed for good (fix the manifests): default/nfs"),
            "{stdout}"
        );
        assert!(
            stdout.contains("Pods not ready when --timeout 60s ran out (their errors above were still being retried): default/waits"),
            "{stdout}"
        );
    }
}

mount_test! {
    fn run_once_and_status_say_what_the_sources_hold_that_is_not_mounted() {
        require_root();
        let root = tempfile::tempdir().unwrap();
        let manifests = tempfile::tempdir().unwrap();
        std::fs::write(
            manifests.path().join("app.yaml"),
            "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: app}\nspec: {}\n",
        )
        .unwrap();
        std::fs::write(
            manifests.path().join("elsewhere.yaml"),
            OK_POD.replace("spec: {", "spec: {nodeName: node-b, "),
        )
        .unwrap();
        let out = run_once(&[], manifests.path(), root.path());
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{stdout}");
        assert!(stdout.contains("No pods for this node ("), "{stdout}");
        assert!(
            stdout
                .contains("1 object of kinds kubevol does not run: Deployment default/app (app.yaml)"),
            "{stdout}"
        );
        assert!(
            stdout.contains("1 pod assigned to other nodes skipped (this node is")
                && stdout.contains("default/ok (node node-b, "),
            "{stdout}"
        );

        // The daemon on a manifest directory that does not exist: the status says so.
        let port = free_port();
        let listen = format!("127.0.0.1:{port}");
        let missing = manifests.path().join("not-there");
        let mut child = daemon(&missing, root.path(), &listen)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let pods = until_http(port, "/api/v1/pods", |a| a.contains("cannot read it"));
        assert!(
            pods.contains(&format!(
                "pod source file: manifest directory {}: cannot read it",
                missing.display()
            )) && pods.contains("nothing is torn down until it has been listed"),
            "{pods}"
        );
        let table = status(&format!("http://{listen}"), &[]);
        assert!(
            table.contains("Notes:\n  pod source file: manifest directory"),
            "{table}"
        );
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let _ = child.wait();
    }
}

/// The pod also has the `kube-api-access` volume the real server's ServiceAccount admission
/// adds: a token, the cluster's root CA and the namespace.
#[test]
fn run_once_as_a_cluster_node_mounts_the_pods_bound_to_it_and_static_pods_beside_them() {
    require_root();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let cluster = rt.block_on(kubevol_testserver::TestCluster::start_on(
        kubevol_testserver::Backend::Real,
        "node-1",
    ));
    let (node, ns) = (
        cluster.node_name().to_string(),
        cluster.namespace().to_string(),
    );
    let pod = |name: &str, node: &str| {
        serde_json::json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox", "volumeMounts": [{"name": "data", "mountPath": "/data"}, {"name": "cfg", "mountPath": "/cfg"}]}],
                     "volumes": [{"name": "data", "emptyDir": {}}, {"name": "cfg", "configMap": {"name": "settings"}}]}})
    };
    rt.block_on(async {
        cluster.create(serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "settings"}, "data": {"a": "1"}})).await;
        cluster.create(pod("api-pod", &node)).await;
        cluster.create(pod("other-node-pod", "kubevol-test-other-node")).await;
    });
    let root = tempfile::tempdir().unwrap();
    let manifests = tempfile::tempdir().unwrap();
    std::fs::write(manifests.path().join("ok.yaml"), OK_POD).unwrap();
    let kubeconfig = cluster.node_kubeconfig(root.path());
    let (stdout, _) = succeeds(&mut in_namespace(&[
        "run",
        "--once",
        "--kubeconfig",
        kubeconfig.to_str().unwrap(),
        "--manifests",
        manifests.path().to_str().unwrap(),
        "--node-name",
        &node,
        "--register-node",
        "--root-dir",
        root.path().join("root").to_str().unwrap(),
    ]));
    for volume in ["data", "cfg", "kube-api-access-"] {
        assert!(
            stdout
                .lines()
                .any(|l| l.starts_with(&format!("{ns}/api-pod"))
                    && l.contains(volume)
                    && l.contains("Mounted")),
            "{stdout}"
        );
    }
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("default/ok") && l.contains("Mounted")),
        "the static pod: {stdout}"
    );
    assert!(!stdout.contains("other-node-pod"), "{stdout}");
    let registered = rt
        .block_on(cluster.get("v1", "nodes", &node))
        .expect("--register-node created the Node");
    assert_eq!(registered["metadata"]["name"], serde_json::json!(node));
    rt.block_on(cluster.clean_up());
}

mount_test! {
    fn a_host_path_persistent_volume_cannot_lead_out_of_the_allowed_prefixes() {
        require_root();
        let (tmp, manifests, root) = scratch();
        let allowed = tmp.path().join("allowed");
        std::fs::create_dir_all(&allowed).unwrap();
        let escape = format!("{}/x/../../../../../../../etc", allowed.display());
        let created = format!("{}/new/../../made-outside", allowed.display());
        let volume = |name: &str, path: &str| {
            format!(
                "apiVersion: v1\nkind: PersistentVolume\nmetadata: {{name: {name}}}\nspec: {{accessModes: [ReadWriteOnce], capacity: {{storage: 1Gi}}, hostPath: {{path: '{path}', type: DirectoryOrCreate}}, claimRef: {{namespace: default, name: {name}}}}}\n---\napiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {{name: {name}}}\nspec: {{accessModes: [ReadWriteOnce], volumeName: {name}, resources: {{requests: {{storage: 1Gi}}}}}}\nstatus: {{phase: Bound}}\n"
            )
        };
        let pod = "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec: {containers: [{name: c, volumeMounts: [{name: a, mountPath: /a}, {name: b, mountPath: /b}]}], volumes: [{name: a, persistentVolumeClaim: {claimName: escape}}, {name: b, persistentVolumeClaim: {claimName: created}}]}\n";
        std::fs::write(
            manifests.join("all.yaml"),
            volume("escape", &escape) + "---\n" + &volume("created", &created) + "---\n" + pod,
        )
        .unwrap();
        let allowed_s = allowed.to_str().unwrap();
        let (ok, stdout) = once(
            &manifests,
            &root,
            &["--timeout", "60s", "--host-path-allow", allowed_s],
        );
        assert!(!ok, "{stdout}");
        assert!(
            stdout.contains("PersistentVolume escape is invalid (the API server refuses it too): spec.hostPath.path: Invalid value:")
                && stdout.contains("must not contain '..'")
                && stdout.contains("Failed for good (fix the manifests): default/p"),
            "{stdout}"
        );
        assert!(
            !tmp.path().join("made-outside").exists(),
            "no directory is created outside the allowed prefix"
        );
    }
}

mount_test! {
    fn a_volume_that_cannot_work_without_a_change_ends_the_wait_of_once_at_once() {
        require_root();
        let (_tmp, manifests, root) = scratch();
        let pod = "apiVersion: v1\nkind: Pod\nmetadata: {name: tok}\nspec: {containers: [{name: c, volumeMounts: [{name: t, mountPath: /t}]}], volumes: [{name: t, projected: {sources: [{serviceAccountToken: {path: token}}]}}]}\n";
        std::fs::write(manifests.join("tok.yaml"), pod).unwrap();
        std::fs::write(manifests.join("ok.yaml"), OK_POD).unwrap();
        // With a timeout far beyond the test's: a wait until it runs out would show in the output.
        let (ok, stdout) = once(&manifests, &root, &["--timeout", "10m"]);
        assert!(!ok, "{stdout}");
        assert!(
            stdout.contains("needs a Kubernetes API server, which standalone mode does not have")
                && stdout.contains(
                    "failed for good: tried again when the pod or an object it reads changes"
                )
                && stdout.contains("Failed for good (fix the manifests): default/tok")
                && !stdout.contains("--timeout"),
            "{stdout}"
        );
        let ok = stdout
            .lines()
            .find(|l| l.starts_with("default/ok"))
            .unwrap();
        assert!(ok.contains("Mounted"), "other pods carry on: {stdout}");
    }
}

mount_test! {
    fn a_secret_value_in_a_sub_path_expr_appears_in_no_message() {
        require_root();
        let (tmp, manifests, root) = scratch();
        let host = tmp.path().join("host");
        std::fs::create_dir_all(&host).unwrap();
        // Two secret values: one an absolute path (refused when expanded), one a link inside a
        // hostPath volume that leads out of it (refused when bound).
        const ABSOLUTE: &str = "/etc/Zq7-absolute-secret";
        const ESCAPE: &str = "Zq7-escaping-secret";
        std::os::unix::fs::symlink("/etc", host.join(ESCAPE)).unwrap();
        let secret = format!(
            "apiVersion: v1\nkind: Secret\nmetadata: {{name: paths}}\nstringData: {{abs: '{ABSOLUTE}', esc: '{ESCAPE}'}}\n"
        );
        let pod = format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: leaky}}\nspec:\n  containers:\n  - name: c\n    env:\n    - {{name: ABS, valueFrom: {{secretKeyRef: {{name: paths, key: abs}}}}}}\n    - {{name: ESC, valueFrom: {{secretKeyRef: {{name: paths, key: esc}}}}}}\n    - {{name: DERIVED, value: 'x/$(ESC)'}}\n    volumeMounts:\n    - {{name: scratch, mountPath: /a, subPathExpr: '$(ABS)'}}\n    - {{name: host, mountPath: /b, subPathExpr: '$(ESC)'}}\n  volumes:\n  - {{name: scratch, emptyDir: {{}}}}\n  - {{name: host, hostPath: {{path: '{}'}}}}\n",
            host.display()
        );
        std::fs::write(manifests.join("secret.yaml"), secret).unwrap();
        std::fs::write(manifests.join("pod.yaml"), pod).unwrap();
        let (mut child, port, log) = logged_daemon(tmp.path(), &manifests, &root, Some("debug"));
        let pods = until_http(port, "/api/v1/pods", |a| {
            a.contains("from a Secret") && a.contains("<redacted: a Secret's value>")
        });
        let events = http_get(port, "/api/v1/events");
        let table = status(&format!("http://127.0.0.1:{port}"), &["-o", "wide"]);
        sigterm(&mut child);
        let log = std::fs::read_to_string(&log).unwrap();
        assert!(log.contains("FailedMount"), "{log}");
        for (channel, text) in [
            ("/api/v1/pods", &pods),
            ("/api/v1/events", &events),
            ("kubevol status -o wide", &table),
            ("the log", &log),
        ] {
            for value in [ABSOLUTE, ESCAPE, "Zq7"] {
                assert!(!text.contains(value), "{channel} shows {value}:\n{text}");
            }
        }
    }
}

mount_test! {
    fn a_duplicate_definition_is_logged_once_when_it_appears_and_once_when_it_clears() {
        require_root();
        let (tmp, manifests, root) = scratch();
        std::fs::write(manifests.join("a.yaml"), OK_POD).unwrap();
        let (mut child, port, log) = logged_daemon(tmp.path(), &manifests, &root, None);
        until_http(port, "/api/v1/pods", |a| a.contains("\"phase\":\"Ready\""));
        // The same pod again, written three times (each a read of the file, each the same error).
        for round in 0..3 {
            std::fs::write(manifests.join("b.yaml"), OK_POD).unwrap();
            let marker = format!("marker{round}");
            std::fs::write(
                manifests.join(format!("{marker}.yaml")),
                OK_POD.replace("name: ok", &format!("name: {marker}")),
            )
            .unwrap();
            until_http(port, "/api/v1/pods", |a| {
                a.contains(&format!("\"name\":\"{marker}\"")) && a.contains("is also defined by")
            });
        }
        std::fs::remove_file(manifests.join("b.yaml")).unwrap();
        until_http(port, "/api/v1/pods", |a| {
            a.contains("\"name\":\"marker2\"") && !a.contains("is also defined by")
        });
        let log_text = || std::fs::read_to_string(&log).unwrap();
        // The clearing is logged after the store changed, a moment after the status shows it.
        let deadline = Instant::now() + Duration::from_secs(120);
        while !log_text().contains("manifest error cleared") && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        sigterm(&mut child);
        let text = log_text();
        let appeared = text
            .lines()
            .filter(|l| l.contains("WARN") && l.contains("is also defined by"))
            .count();
        let cleared = text
            .lines()
            .filter(|l| l.contains("manifest error cleared") && l.contains("is also defined by"))
            .count();
        assert_eq!((appeared, cleared), (1, 1), "{text}");
    }
}

mount_test! {
    fn misspelt_fields_are_warned_about_with_their_line_and_the_field_meant() {
        require_root();
        let (_tmp, manifests, root) = scratch();
        let typo = "apiVersion: v1\nkind: Pod\nmetadata: {name: typo}\nspec:\n  containers:\n  - name: c\n    volumeMounts:\n    - name: v\n      mountPath: /v\n      readonly: true\n  volumes:\n  - name: v\n    emptyDir: {sizeLimt: 1Gi}\n";
        let invalid = "apiVersion: v1\nkind: Pod\nmetadata: {name: invalid}\nspec:\n  containers:\n  - name: c\n    volumeMounts:\n    - {name: v, mountpath: /v}\n  volumes:\n  - name: v\n    configmap: {name: cm}\n";
        let cm = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: cm}\ndatas: {a: b}\n";
        std::fs::write(manifests.join("typo.yaml"), typo).unwrap();
        std::fs::write(manifests.join("invalid.yaml"), invalid).unwrap();
        std::fs::write(manifests.join("cm.yaml"), cm).unwrap();
        let (_, stdout) = once(&manifests, &root, &[]);
        let row = stdout
            .lines()
            .find(|l| l.starts_with("default/typo"))
            .unwrap_or_default();
        assert!(
            row.contains("Mounted"),
            "a pod with a misspelt field still mounts: {stdout}"
        );
        for want in [
            r#"default/typo: unknown field "spec.containers[0].volumeMounts[0].readonly" (did you mean "readOnly"?) at line 10, column 17: ignored"#,
            r#"default/typo volume v: unknown field "spec.volumes[0].emptyDir.sizeLimt" (did you mean "sizeLimit"?) at line 13, column 26: ignored"#,
            r#"default/invalid: unknown field "spec.containers[0].volumeMounts[0].mountpath" (did you mean "mountPath"?) at line 8, column 28: ignored"#,
            r#"default/invalid: unknown field "spec.volumes[0].configmap" (did you mean "configMap"?) at line 11, column 16: ignored"#,
            "mountPath: Required value",
            r#"cm.yaml: document 1, line 4, column 8: ConfigMap: unknown field "datas" (did you mean "data"?): ignored"#,
        ] {
            assert!(stdout.contains(want), "{want}\nnot in:\n{stdout}");
        }
    }
}

mount_test! {
    fn describe_explains_each_volume_step_by_step_and_summarizes_the_node() {
        require_root();
        let root = tempfile::tempdir().unwrap();
        let root_s = root.path().to_str().unwrap();
        let manifests = tempfile::tempdir().unwrap();
        for e in std::fs::read_dir(examples()).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), manifests.path().join(e.file_name())).unwrap();
        }
        // A claim whose volume belongs to a driver that is not on this node.
        std::fs::write(
            manifests.path().join("stuck.yaml"),
            "apiVersion: v1\nkind: PersistentVolume\nmetadata: {name: far}\nspec: {capacity: {storage: 1Gi}, accessModes: [ReadWriteOnce], claimRef: {namespace: default, name: far}, csi: {driver: absent.csi.example, volumeHandle: far}}\n---\napiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {name: far, namespace: default}\nspec: {accessModes: [ReadWriteOnce], volumeName: far, resources: {requests: {storage: 1Gi}}}\nstatus: {phase: Bound}\n---\napiVersion: v1\nkind: Pod\nmetadata: {name: stuck, namespace: default}\nspec: {containers: [{name: c, volumeMounts: [{name: data, mountPath: /d}]}], volumes: [{name: data, persistentVolumeClaim: {claimName: far}}]}\n",
        )
        .unwrap();
        let port = free_port();
        let listen = format!("127.0.0.1:{port}");
        let server = format!("http://{listen}");
        let child = with_loop_driver(
            root_s,
            &[
                "run",
                "--manifests",
                manifests.path().to_str().unwrap(),
                "--root-dir",
                root_s,
                "--node-name",
                "demo",
                "--listen",
                &listen,
            ],
        )
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
        let mut child = Running(child);
        until_http(port, "/api/v1/pods", |a| {
            let Some(body) = a.split("\r\n\r\n").nth(1) else {
                return false;
            };
            serde_json::from_str::<serde_json::Value>(body).is_ok_and(|s| {
                s["pods"].as_array().is_some_and(|pods| {
                    pods.iter()
                        .any(|p| p["name"] == "db" && p["phase"] == "Ready")
                })
            })
        });
        let describe = |args: &[&str]| {
            succeeds(
                Command::new(BIN)
                    .arg("describe")
                    .args(args)
                    .args(["--server", &server]),
            )
            .0
        };
        let db: serde_json::Value =
            serde_json::from_str(&describe(&["pod", "default/db", "-o", "json"])).unwrap();
        let data = db["chains"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["volume"] == "data")
            .unwrap();
        let steps: Vec<(String, String)> = data["steps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                (
                    s["step"].as_str().unwrap().to_string(),
                    s["state"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        let done = |s: &str| (s.to_string(), "Done".to_string());
        assert_eq!(
            steps,
            [
                done("claim default/db-data"),
                done("PersistentVolume db-data"),
                done("driver loop.csi.kubevol.io"),
                done("attach"),
                done("stage"),
                done("set up"),
                done("fsGroup"),
            ],
            "{data}"
        );
        let driver = data["steps"][2]["detail"].as_str().unwrap();
        assert!(
            driver.contains(
                "node ID demo, capabilities [STAGE_UNSTAGE_VOLUME, GET_VOLUME_STATS, EXPAND_VOLUME, GET_VOLUME_HEALTH, GET_STORAGE_HEALTH]"
            ) && driver.contains("(CSI 1.0.0)"),
            "{driver}"
        );
        let fs_group = &data["steps"][6]["detail"];
        assert_eq!(
            fs_group, "fsGroup 999: applied by kubevol after publish (fsGroupPolicy File)",
            "{data}"
        );
        let stuck = describe(&["pod", "default/stuck"]);
        assert!(
            stuck.contains("[ok] claim default/far")
                && stuck.contains("[..] driver absent.csi.example")
                && stuck.contains("not registered"),
            "{stuck}"
        );
        let uid = db["status"]["uid"].as_str().unwrap();
        assert!(describe(&["pod", uid]).contains("Pod:     default/db"));
        let node = describe(&["node"]);
        assert!(
            node.contains("Drivers:  loop.csi.kubevol.io (healthy)")
                && node.contains("default/stuck volume data: ")
                && node.contains("Attached: "),
            "{node}"
        );
        let missing = Command::new(BIN)
            .args(["describe", "pod", "default/nothing", "--server", &server])
            .output()
            .unwrap();
        assert!(!missing.status.success());
        assert!(
            String::from_utf8_lossy(&missing.stderr).contains("no pod default/nothing on this node"),
            "{}",
            String::from_utf8_lossy(&missing.stderr)
        );
        let code = sigterm(&mut child);
        assert!(code.success(), "{code:?}");
    }
}

mount_test! {
    /// The documentation's generic ephemeral volume (docs/storage.md, the default class):
    /// `run --once` on it is ready every time, also beside two busy loops, where kubevol's own
    /// ephemeral-volume controller has not made the claim yet when the pod is first looked at
    /// (the volume waits for it; it was failed for good, `add it to the manifests`, 13 times in
    /// 20 on a loaded machine).
    fn the_documentations_generic_ephemeral_volume_is_made_and_mounted_every_time() {
        require_root();
        let doc = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/storage.md")).unwrap();
        let yaml = doc
            .split("```yaml\n")
            .skip(1)
            .filter_map(|b| b.split("```").next())
            .find(|b| b.contains("volumeClaimTemplate") && b.contains("my-app"))
            .expect("the example in docs/storage.md")
            .to_string();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let busy: Vec<_> = (0..2)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let mut x = 0u64;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
                    }
                })
            })
            .collect();
        for run in 0..20 {
            let (_tmp, manifests, root) = scratch();
            std::fs::write(manifests.join("my-app.yaml"), &yaml).unwrap();
            let (ok, stdout) = once(&manifests, &root, &["--timeout", "120s", "--node-name", "n"]);
            assert!(ok && stdout.contains("default/my-app") && stdout.contains("Mounted"), "run {run}: {stdout}");
            assert!(!stdout.contains("add it to the manifests"), "run {run}: {stdout}");
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for b in busy {
            b.join().unwrap();
        }
    }
}
