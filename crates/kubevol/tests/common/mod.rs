//! Test harness for tests that mount for real: each runs in its own process inside a private
//! mount namespace (`unshare --mount --propagation private`), on a temporary root that is
//! unmounted and removed when the test ends, so nothing is left on the machine.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kubevol::status::{PodPhase, PodStatus};
use kubevol::{Config, VolumeManager};

pub mod runtime;

const INSIDE: &str = "KUBEVOL_TEST_IN_PRIVATE_NS";

/// The name the test harness knows test `name` of module `module` (a `module_path!()`, which
/// starts with the test binary's crate) by: its path below the crate.
pub fn test_path(module: &str, name: &str) -> String {
    match module.split_once("::") {
        Some((_, below)) => format!("{below}::{name}"),
        None => name.to_string(),
    }
}

/// Runs `body` inside a private mount namespace: the test re-executes its own binary for just
/// this test under unshare(1), and asserts that the child passed.
pub fn in_private_mount_ns(test: &str, body: impl FnOnce()) {
    if std::env::var(INSIDE).as_deref() == Ok(test) {
        // `KUBEVOL_TEST_LOG=kubevol=debug` shows the manager's log beside a failure.
        if let Ok(filter) = std::env::var("KUBEVOL_TEST_LOG") {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
                .with_test_writer()
                .try_init();
        }
        body();
        return;
    }
    let uid = std::process::Command::new("id")
        .arg("-u")
        .output()
        .expect("run id -u");
    assert_eq!(
        String::from_utf8_lossy(&uid.stdout).trim(),
        "0",
        "{test} mounts for real and must run as root (inside its own private mount namespace)"
    );
    let exe = std::env::current_exe().expect("test binary path");
    // The test's temporary files (its roots, a CSI driver's images) go below a directory of
    // its own, so that what it leaves behind can be told from anyone else's. Its name is short:
    // a unix socket's path (a CSI driver's registration, deep below a root) has 107 bytes.
    let tmp = tempfile::Builder::new()
        .prefix("k")
        .tempdir()
        .expect("tempdir");
    let out = std::process::Command::new("unshare")
        .args(["--mount", "--propagation", "private"])
        .arg(exe)
        .args([test, "--exact", "--nocapture", "--test-threads", "1"])
        .env(INSIDE, test)
        .env("TMPDIR", tmp.path())
        .output()
        .expect("run unshare(1): install util-linux");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{test} failed inside its mount namespace:\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
    );
    // The figures a test prints (`KUBEVOL_TEST_SHOW=1`).
    if std::env::var_os("KUBEVOL_TEST_SHOW").is_some() {
        println!("{stdout}");
    }
    // With the namespace gone its mounts are.
    no_loop_devices_left(tmp.path(), test);
}

/// Panics, naming `what` and the devices, unless every loop device bound to a file below `dir`
/// is freed within 120 s (one detached lazily goes at its last close, a moment after its
/// detach; the kernel announces it only to a netlink listener, so sysfs is looked at again).
pub fn no_loop_devices_left(dir: &Path, what: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        let bound = loop_devices_below(dir);
        if bound.is_empty() {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what} left loop devices bound to its files: {bound:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The loop devices whose backing file lies below `dir`, with their files.
fn loop_devices_below(dir: &Path) -> Vec<(String, String)> {
    let Ok(devices) = std::fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    devices
        .filter_map(|d| {
            let d = d.ok()?;
            let file = std::fs::read_to_string(d.path().join("loop/backing_file")).ok()?;
            let file = file.trim_end().to_string();
            Path::new(&file)
                .starts_with(dir)
                .then(|| (d.file_name().to_string_lossy().into_owned(), file))
        })
        .collect()
}

/// Declares a test that runs inside its own private mount namespace.
#[macro_export]
macro_rules! mount_test {
    ($(#[$meta:meta])* fn $name:ident() $body:block) => {
        $(#[$meta])*
        #[test]
        fn $name() {
            $crate::common::in_private_mount_ns(
                &$crate::common::test_path(module_path!(), stringify!($name)),
                || $body,
            );
        }
    };
}

/// A client of `cluster` with the node's identity, made as `kubevol run --kubeconfig` makes it
/// (HTTP/2 over a few connections against a real server).
pub fn node_client(cluster: &kubevol_testserver::TestCluster) -> kube::Client {
    kubevol::source::cluster::client(cluster.node_config()).expect("the node's client")
}

/// Makes sure the cluster has the node's Node object (whoever runs a node creates it).
pub async fn ensure_node(cluster: &kubevol_testserver::TestCluster) {
    let node = cluster.node_name();
    if cluster.get("v1", "nodes", node).await.is_none() {
        cluster
            .create(
                serde_json::json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}}),
            )
            .await;
    }
}

/// Declares a cluster-mode test against a real kube-apiserver (the control plane the README's
/// test command starts; without one it fails and says how to get one), inside its own
/// private mount namespace. The body is given the [`kubevol_testserver::Backend`] to start its
/// cluster on. The in-process server is only for faults the real one cannot make on demand:
/// see [`cluster_test_with_faults!`].
#[macro_export]
macro_rules! cluster_test {
    ($(#[$meta:meta])* fn $name:ident($backend:ident) $body:block) => {
        $(#[$meta])*
        #[test]
        fn $name() {
            fn body($backend: kubevol_testserver::Backend) $body
            $crate::common::in_private_mount_ns(
                &$crate::common::test_path(module_path!(), stringify!($name)),
                || body(kubevol_testserver::Backend::Real),
            );
        }
    };
}

/// A [`cluster_test!`] that runs twice: `<name>::real_cluster` against the real
/// kube-apiserver, and `<name>::in_process` against the project's in-process server, where the
/// body makes what the real one cannot make on demand (an authorizer's lag as long as the test
/// wants, a forgotten history of pods, an API turned off, tokens of seconds).
#[macro_export]
macro_rules! cluster_test_with_faults {
    ($(#[$meta:meta])* fn $name:ident($backend:ident) $body:block) => {
        $(#[$meta])*
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            fn body($backend: kubevol_testserver::Backend) $body

            #[test]
            fn in_process() {
                $crate::common::in_private_mount_ns(
                    &$crate::common::test_path(module_path!(), "in_process"),
                    || body(kubevol_testserver::Backend::InProcess),
                );
            }

            #[test]
            fn real_cluster() {
                $crate::common::in_private_mount_ns(
                    &$crate::common::test_path(module_path!(), "real_cluster"),
                    || body(kubevol_testserver::Backend::Real),
                );
            }
        }
    };
}

/// A temporary directory that unmounts everything below it before it is removed.
pub struct TestRoot {
    dir: Option<tempfile::TempDir>,
}

impl TestRoot {
    pub fn new() -> Self {
        TestRoot {
            dir: Some(
                tempfile::Builder::new()
                    .prefix("kubevol-test")
                    .tempdir()
                    .expect("tempdir"),
            ),
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.as_ref().expect("live").path()
    }

    /// A new, empty manifest directory below the root.
    pub fn manifests(&self) -> PathBuf {
        let dir = self.path().join("manifests");
        std::fs::create_dir(&dir).expect("create the manifest directory");
        dir
    }
}

/// Writes a manifest file whole: written beside it, then renamed, as an editor or `kubectl`
/// wrapper would (the watcher reads settled files).
pub fn write_manifest(dir: &Path, name: &str, yaml: &str) {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, yaml).unwrap();
    std::fs::rename(&tmp, dir.join(name)).unwrap();
}

/// Mount points at or below `dir`, deepest first.
pub fn mounts_under(dir: &Path) -> Vec<(PathBuf, String, String)> {
    use kubevol_mount::Mounter;
    let mut v: Vec<(PathBuf, String, String)> = kubevol_mount::LinuxMounter
        .mount_table()
        .expect("read the mount table")
        .into_iter()
        .filter(|m| m.mount_point.starts_with(dir))
        .map(|m| (m.mount_point, m.fs_type, m.super_options))
        .collect();
    v.sort_by_key(|m| std::cmp::Reverse(m.0.components().count()));
    v
}

impl Drop for TestRoot {
    fn drop(&mut self) {
        let path = self.path().to_path_buf();
        for (m, _, _) in mounts_under(&path) {
            let _ = rustix_unmount(&m);
        }
        if let Some(d) = self.dir.take() {
            let _ = d.close();
        }
    }
}

fn rustix_unmount(p: &Path) -> Result<(), kubevol_mount::MountError> {
    use kubevol_mount::Mounter;
    kubevol_mount::LinuxMounter.unmount(p).map(|_| ())
}

/// A multi-thread runtime for one test.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// A manager over the real mount layer, with fast backoff for tests, running in the background.
pub fn manager(root: &Path, tweak: impl FnOnce(&mut Config)) -> VolumeManager {
    let mut config = Config::new(root.join("root"), "test-node");
    config.backoff.initial = Duration::from_millis(20);
    config.backoff.max = Duration::from_millis(200);
    config.wait_timeout = Duration::from_secs(120);
    tweak(&mut config);
    let m = VolumeManager::new(config, Arc::new(kubevol_mount::LinuxMounter)).expect("manager");
    let run = m.clone();
    tokio::spawn(async move { run.run().await });
    m
}

/// Stops `m` and starts a new manager on its root, as [`manager`] does, once the old one has
/// let go of the root's lock (its tasks end after the shutdown).
pub async fn restart(m: VolumeManager, root: &Path, tweak: impl Fn(&mut Config)) -> VolumeManager {
    restart_with(m, root, tweak, |_| ()).await.0
}

/// [`restart`], with `before_run` done on the new manager before it runs: a source's sink made
/// there holds teardown back until the source has listed (a sink made once the manager runs
/// may come after its first pass has found every source synced and torn down what the record
/// held).
#[allow(dead_code)]
pub async fn restart_with<T>(
    m: VolumeManager,
    root: &Path,
    tweak: impl Fn(&mut Config),
    before_run: impl FnOnce(&VolumeManager) -> T,
) -> (VolumeManager, T) {
    m.shutdown();
    drop(m);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let mut config = Config::new(root.join("root"), "test-node");
        config.backoff.initial = Duration::from_millis(20);
        config.backoff.max = Duration::from_millis(200);
        config.wait_timeout = Duration::from_secs(120);
        tweak(&mut config);
        match VolumeManager::new(config, Arc::new(kubevol_mount::LinuxMounter)) {
            Ok(m) => {
                let before = before_run(&m);
                let run = m.clone();
                tokio::spawn(async move { run.run().await });
                return (m, before);
            }
            Err(e) if e.kind() == std::io::ErrorKind::ResourceBusy => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the old manager still holds the root: {e}"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(e) => panic!("manager: {e}"),
        }
    }
}

/// Waits until `cond` holds, looking again at each change the manager announces (a state
/// changed, an operation concluded); panics after `secs` seconds, naming `what`.
pub async fn until_announced(
    m: &VolumeManager,
    secs: u64,
    what: &str,
    mut cond: impl FnMut() -> bool,
) {
    if let Err(why) = announced(m, secs, || cond().then_some(())).await {
        panic!("{what}: {why}");
    }
}

/// What `probe` finds, looking again at each change the manager announces; why not, after
/// `secs` seconds or when the manager stops first.
async fn announced<T>(
    m: &VolumeManager,
    secs: u64,
    mut probe: impl FnMut() -> Option<T>,
) -> Result<T, String> {
    let mut changes = m.subscribe();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    loop {
        changes.borrow_and_update();
        if let Some(found) = probe() {
            return Ok(found);
        }
        match tokio::time::timeout_at(deadline, changes.changed()).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err("the manager stopped first".into()),
            Err(_) => return Err(format!("not reached within {secs}s")),
        }
    }
}

/// A pod from JSON.
pub fn pod(v: serde_json::Value) -> Pod {
    serde_json::from_value(v).expect("test pod parses")
}

/// A pod named `name` whose single container mounts every volume given.
pub fn pod_with_volumes(name: &str, volumes: serde_json::Value) -> Pod {
    let mounts: Vec<serde_json::Value> = volumes
        .as_array()
        .expect("array")
        .iter()
        .map(|v| serde_json::json!({"name": v["name"], "mountPath": format!("/mnt/{}", v["name"].as_str().unwrap_or(""))}))
        .collect();
    pod(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"containers": [{"name": "c", "image": "busybox", "volumeMounts": mounts}], "volumes": volumes},
    }))
}

/// Waits (woken by state changes) until `cond` holds for the pod's status, or panics after
/// `secs` seconds with the last status.
pub async fn wait_for_status(
    m: &VolumeManager,
    pod: &Pod,
    secs: u64,
    cond: impl Fn(&PodStatus) -> bool,
) -> PodStatus {
    let uid = kubevol::pod_uid(pod);
    let mut last = None;
    let found = announced(m, secs, || {
        last = m.pod_status(&uid);
        last.as_ref().filter(|s| cond(s)).cloned()
    })
    .await;
    found.unwrap_or_else(|why| panic!("condition {why}; last status: {last:#?}"))
}

/// Whether a pod's status is final for a first attempt: ready, rejected, or every volume tried
/// (failed for good, or retried after a failure that can pass).
pub fn settled(s: &PodStatus) -> bool {
    match s.phase {
        PodPhase::Ready | PodPhase::Rejected => true,
        PodPhase::Failed | PodPhase::Pending => {
            !s.volumes.is_empty()
                && s.volumes.iter().all(|v| {
                    v.retry.last_error.is_some() || v.state == kubevol::status::VolumePhase::Mounted
                })
        }
        _ => false,
    }
}

/// A fixed pseudo-random sequence of `steps` creates, renames, copies and removals of `files`
/// manifest files in `dir`, each written with `manifest(name)` for one of `pods` pod names
/// (`p0`, `p1`, ...), so that some pods are defined by two files at once and some by none.
/// Returns the pod names the directory defines at the end.
pub fn churn_manifests(
    dir: &Path,
    files: u64,
    pods: u64,
    steps: usize,
    seed: u64,
    manifest: impl Fn(&str) -> String,
) -> std::collections::BTreeSet<String> {
    let mut seed = seed;
    let mut next = |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    for _ in 0..steps {
        let file = |i: u64| dir.join(format!("f{i:02}.yaml"));
        let (a, b) = (file(next(files)), file(next(files)));
        match next(4) {
            0 => std::fs::write(&a, manifest(&format!("p{}", next(pods)))).unwrap(),
            1 => {
                let _ = std::fs::rename(&a, &b);
            }
            2 => {
                let _ = std::fs::copy(&a, &b);
            }
            _ => {
                let _ = std::fs::remove_file(&a);
            }
        }
    }
    defined_pods(dir)
}

/// The pod names (`name: x}`) the manifest files of `dir` define.
pub fn defined_pods(dir: &Path) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let text = std::fs::read_to_string(e.unwrap().path()).unwrap();
        // (A file copied onto itself is empty.)
        if let Some(name) = text
            .split("name: ")
            .nth(1)
            .and_then(|t| t.split('}').next())
        {
            names.insert(name.to_string());
        }
    }
    names
}

/// Says that a test took another way than the one it is about, and why (the machine cannot do
/// it): written for the test command's closing report (a file in `$KUBEVOL_TEST_SKIPS`, which
/// `test.sh` prints beside the total, as cargo prints ignored tests), and to stderr.
#[allow(dead_code)]
pub fn skipped(what: &str, why: &str) {
    let line = format!("{what}: skipped, {why}");
    eprintln!("{line}");
    if let Some(dir) = std::env::var_os("KUBEVOL_TEST_SKIPS") {
        let name: String = what
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let _ = std::fs::write(Path::new(&dir).join(format!("{name}.txt")), line + "\n");
    }
}

/// A FUSE mount at `target` whose daemon never answers: every request (a lookup or an open of
/// its root) hangs until the returned descriptor is closed, after which it fails with ENOTCONN
/// (a dead mount).
#[allow(dead_code)]
pub fn hung_fuse_mount(target: &Path) -> std::os::fd::OwnedFd {
    use kubevol_mount::Mounter;
    use std::os::fd::AsRawFd;
    let fd: std::os::fd::OwnedFd = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .expect("open /dev/fuse")
        .into();
    let options = kubevol_mount::MountOptions {
        nosuid: true,
        nodev: true,
        data: vec![
            format!("fd={}", fd.as_raw_fd()),
            "rootmode=40000".into(),
            "user_id=0".into(),
            "group_id=0".into(),
        ],
        ..Default::default()
    };
    kubevol_mount::LinuxMounter
        .mount("kubevol-test-hang", target, "fuse", &options)
        .expect("mount fuse");
    fd
}

/// A process working in a directory (a shell left in a volume), killed by its PID when released
/// or dropped, also when its test fails.
pub struct Holder(std::process::Child);

impl Holder {
    /// `sleep` with its working directory in `dir`, without the test's pipes.
    pub fn in_dir(dir: &Path) -> Holder {
        let child = std::process::Command::new("sleep")
            .arg("600")
            .current_dir(dir)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn sleep");
        Holder(child)
    }

    pub fn pid(&self) -> u32 {
        self.0.id()
    }

    /// Ends the process.
    pub fn release(mut self) {
        self.kill();
    }

    fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Sets up pod `default/db` with a memory emptyDir `cache`, then removes it while a process
/// works in the volume, and waits until its teardown has failed as busy: the pod, its UID, the
/// volume's path, the holder and the pod's status then.
pub async fn busy_memory_pod(
    m: &VolumeManager,
) -> (Pod, kubevol_core::PodUid, PathBuf, Holder, PodStatus) {
    let p = pod(serde_json::json!({
        "metadata": {"name": "db", "namespace": "default"},
        "spec": {"containers": [{"name": "c", "volumeMounts": [{"name": "cache", "mountPath": "/c"}]}],
                 "volumes": [{"name": "cache", "emptyDir": {"medium": "Memory"}}]},
    }));
    let uid = m.add_pod(p.clone());
    m.wait_for_attach_and_mount(&p).await.expect("mounted");
    let path = m.mounted_volumes_for_pod(&uid)["cache"].path.clone();
    let holder = Holder::in_dir(&path);
    m.remove_pod(&p);
    let s = wait_for_status(m, &p, 60, |s| {
        s.volumes.iter().any(|v| {
            v.retry
                .last_error
                .as_deref()
                .is_some_and(|e| e.contains("target is busy"))
        })
    })
    .await;
    (p, uid, path, holder, s)
}

/// The claims of a JWT (its second part, base64url without padding).
pub fn jwt_claims(token: &str) -> serde_json::Value {
    let part = token.split('.').nth(1).expect("a JWT has three parts");
    let mut bits = 0u32;
    let mut n = 0;
    let mut out = Vec::new();
    for c in part.bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'-' => 62,
            b'_' => 63,
            _ => panic!("not base64url: {c}"),
        };
        bits = (bits << 6) | u32::from(v);
        n += 6;
        if n >= 8 {
            n -= 8;
            out.push((bits >> n) as u8);
        }
    }
    serde_json::from_slice(&out).expect("JSON claims")
}

/// The manager's log, captured in memory: for a test that must see that something ran (a
/// failed attempt) before it changes what makes the next one pass.
#[derive(Clone, Default)]
pub struct LogCapture(Arc<std::sync::Mutex<Vec<u8>>>);

impl LogCapture {
    /// Captures kubevol's log at `info` and above from now on (the process's one subscriber).
    pub fn install() -> Self {
        let capture = LogCapture::default();
        let writer = capture.clone();
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new("kubevol=info"))
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .try_init()
            .expect("no other log subscriber in this test's process");
        capture
    }

    /// Whether a line so far holds `text`.
    pub fn contains(&self, text: &str) -> bool {
        self.text().contains(text)
    }

    /// Every line so far.
    #[allow(dead_code)]
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl std::io::Write for LogCapture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Waits until kubevol's storage controllers have decided on every change the store holds now
/// (a positive sign that a claim was looked at, before a test asserts what was not done).
pub async fn storage_decided(m: &VolumeManager) {
    let version = *m.store().subscribe().borrow();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while m.storage_seen() < version {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the storage controllers did not look at store version {version} within 120 s (they saw {})",
            m.storage_seen()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// How many times the volumes of `plugin` were set up or written again (the operations'
/// metric).
pub fn volume_writes(m: &kubevol::VolumeManager, plugin: &str) -> u64 {
    m.metrics_text()
        .lines()
        .filter(|l| {
            l.starts_with("storage_operation_duration_seconds_count{")
                && l.contains(&format!("volume_plugin=\"{plugin}\""))
                && l.contains("operation_name=\"volume_mount\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}
