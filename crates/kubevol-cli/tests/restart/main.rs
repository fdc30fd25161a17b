//! Restart safety of the `kubevol run` daemon: SIGKILL at random moments and at every named
//! fail point during a storm of pod adds and deletes, a pod deleted while the daemon is down,
//! a pod source missing at start, hung and dead FUSE mounts, and a busy volume. Each test runs
//! in its own private mount namespace, with the real daemon and the loop CSI driver as child
//! processes.

#[macro_use]
#[path = "../../../kubevol/tests/common/mod.rs"]
mod common;
mod claims;
#[path = "../loop_driver/mod.rs"]
mod loop_driver;
mod returns;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use kubevol::source::parse_manifest;
use kubevol::store::Object;
use loop_driver::{free_port, Driver, DRIVER};
use sha2::Digest;

const BIN: &str = env!("CARGO_BIN_EXE_kubevol");

/// The test's directories and the driver, shared by every daemon it starts. The driver is
/// dropped first (killed, its loop devices detached), then the directories are unmounted and
/// removed.
struct Env {
    driver: Driver,
    tmp: TestRoot,
}

impl Env {
    fn new() -> Env {
        let tmp = TestRoot::new();
        let root = tmp.path().join("root");
        std::fs::create_dir_all(root.join("plugins_registry")).unwrap();
        std::fs::create_dir_all(tmp.path().join("manifests")).unwrap();
        std::fs::create_dir_all(tmp.path().join("host")).unwrap();
        let driver = Driver::start(
            &tmp.path().join("driver"),
            Some(&root.join("plugins_registry")),
            &[],
        );
        Env { driver, tmp }
    }

    fn root(&self) -> PathBuf {
        self.tmp.path().join("root")
    }

    fn manifests(&self) -> PathBuf {
        self.tmp.path().join("manifests")
    }

    fn host(&self) -> PathBuf {
        self.tmp.path().join("host")
    }

    fn write(&self, file: &str, text: &str) {
        let tmp = self.manifests().join(format!(".{file}.tmp"));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, self.manifests().join(file)).unwrap();
    }

    fn remove(&self, file: &str) {
        let _ = std::fs::remove_file(self.manifests().join(file));
    }
}

/// A `kubevol run` child process.
struct Daemon {
    child: Option<Child>,
    port: u16,
    log: PathBuf,
}

impl Daemon {
    fn start(env: &Env, fail_point: Option<&str>, extra: &[&str]) -> Daemon {
        let port = free_port();
        let log = env.tmp.path().join("daemon.log");
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        let mut c = Command::new(BIN);
        c.args(["run", "--manifests"])
            .arg(env.manifests())
            .arg("--root-dir")
            .arg(env.root())
            .args(["--node-name", "test-node", "--listen"])
            .arg(format!("127.0.0.1:{port}"))
            .args(["--backoff-initial", "20ms", "--backoff-max", "500ms"])
            .args(["--resync-period", "1s"])
            .arg("--csi-controller")
            .arg(format!("{DRIVER}=unix://{}", env.driver.socket().display()))
            .args(extra)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(out);
        match fail_point {
            Some(f) => c.env("KUBEVOL_FAIL_POINT", f),
            None => c.env_remove("KUBEVOL_FAIL_POINT"),
        };
        Daemon {
            child: Some(c.spawn().expect("start kubevol")),
            port,
            log,
        }
    }

    /// GET `path`: (status code, body), or `None` while the server is not up.
    fn get(&self, path: &str) -> Option<(u16, String)> {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
        write!(s, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").ok()?;
        let mut text = String::new();
        s.read_to_string(&mut text).ok()?;
        let (head, body) = text.split_once("\r\n\r\n")?;
        let code = head.split_whitespace().nth(1)?.parse().ok()?;
        Some((code, body.to_string()))
    }

    fn status(&self) -> Option<serde_json::Value> {
        let (code, body) = self.get("/api/v1/pods")?;
        (code == 200).then(|| serde_json::from_str(&body).ok())?
    }

    /// Whether the process has exited (a fail point killed it).
    fn exited(&mut self) -> bool {
        match &mut self.child {
            Some(c) => c.try_wait().ok().flatten().is_some(),
            None => true,
        }
    }

    /// SIGKILL, as an OOM kill or a crash would.
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, and how long the process took to exit (it must exit cleanly).
    fn terminate(&mut self) -> Duration {
        let mut c = self.child.take().expect("running");
        let started = std::time::Instant::now();
        let st = Command::new("kill")
            .args(["-TERM", &c.id().to_string()])
            .status()
            .unwrap();
        assert!(st.success());
        let code = c.wait().unwrap();
        assert!(
            code.success(),
            "a clean stop: {code:?}\n{}",
            self.log_tail()
        );
        started.elapsed()
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The shared objects: a ConfigMap, a Secret, the driver's CSIDriver (attach required, so
/// attach and detach happen too) and two PersistentVolumes with their claims.
fn objects(env: &Env) -> String {
    let mut s = String::from(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: app}\ndata: {level: info}\n---\n\
         apiVersion: v1\nkind: Secret\nmetadata: {name: token}\nstringData: {token: s3cret}\n---\n",
    );
    s.push_str(&format!(
        "apiVersion: storage.k8s.io/v1\nkind: CSIDriver\nmetadata: {{name: {DRIVER}}}\n\
         spec: {{attachRequired: true, podInfoOnMount: true, fsGroupPolicy: File, volumeLifecycleModes: [Persistent, Ephemeral]}}\n"
    ));
    s.push_str(&format!(
        "---\napiVersion: v1\nkind: PersistentVolume\nmetadata: {{name: local-pv}}\n\
         spec: {{capacity: {{storage: 1Gi}}, accessModes: [ReadWriteOnce], claimRef: {{namespace: default, name: local-pv}},\n\
         \x20 local: {{path: {}}},\n\
         \x20 nodeAffinity: {{required: {{nodeSelectorTerms: [{{matchExpressions: [{{key: kubernetes.io/hostname, operator: In, values: [test-node]}}]}}]}}}}}}\n\
         ---\napiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {{name: local-pv, namespace: default}}\n\
         spec: {{accessModes: [ReadWriteOnce], volumeName: local-pv, resources: {{requests: {{storage: 1Gi}}}}}}\n",
        env.host().join("host").display()
    ));
    for pv in ["pv-a", "pv-b"] {
        s.push_str(&format!(
            "---\napiVersion: v1\nkind: PersistentVolume\nmetadata: {{name: {pv}}}\n\
             spec: {{capacity: {{storage: 32Mi}}, accessModes: [ReadWriteOnce], claimRef: {{namespace: default, name: {pv}}},\n\
             \x20 csi: {{driver: {DRIVER}, volumeHandle: {pv}, fsType: ext4, volumeAttributes: {{size: 32Mi}}}}}}\n\
             ---\napiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {{name: {pv}, namespace: default}}\n\
             spec: {{accessModes: [ReadWriteOnce], volumeName: {pv}, resources: {{requests: {{storage: 32Mi}}}}}}\n"
        ));
    }
    s
}

/// One pod of the storm: its manifest and the mounts it needs on the node.
struct StormPod {
    name: &'static str,
    uid: String,
    /// Its volumes' names.
    names: Vec<String>,
    /// (volume name, plugin directory, its own mount?) for every volume kubevol makes a
    /// directory for.
    volumes: Vec<(&'static str, &'static str, bool)>,
    /// The PersistentVolumes it uses.
    pvs: Vec<&'static str>,
    yaml: String,
}

fn storm_pods(env: &Env) -> Vec<StormPod> {
    let host = env.host();
    type Def = (
        &'static str,
        &'static str,
        Vec<(&'static str, &'static str, bool)>,
        Vec<&'static str>,
    );
    let defs: Vec<Def> = vec![
        (
            "disk",
            "[{name: scratch, emptyDir: {}}, {name: config, configMap: {name: app}}]",
            vec![
                ("scratch", "kubernetes.io~empty-dir", false),
                ("config", "kubernetes.io~configmap", false),
            ],
            vec![],
        ),
        (
            "memory",
            "[{name: cache, emptyDir: {medium: Memory}}, {name: token, secret: {secretName: token}}]",
            vec![
                ("cache", "kubernetes.io~empty-dir", true),
                ("token", "kubernetes.io~secret", true),
            ],
            vec![],
        ),
        (
            "host",
            "[{name: data, hostPath: {path: HOST/host, type: Directory}}, {name: all, projected: {sources: [{configMap: {name: app}}, {secret: {name: token}}]}}, {name: disk, persistentVolumeClaim: {claimName: local-pv}}]",
            vec![
                ("all", "kubernetes.io~projected", true),
                ("local-pv", "kubernetes.io~local-volume", true),
            ],
            vec![],
        ),
        (
            "csi-a",
            "[{name: data, persistentVolumeClaim: {claimName: pv-a}}, {name: config, configMap: {name: app}}]",
            vec![("config", "kubernetes.io~configmap", false)],
            vec!["pv-a"],
        ),
        (
            "csi-a2",
            "[{name: data, persistentVolumeClaim: {claimName: pv-a}}]",
            vec![],
            vec!["pv-a"],
        ),
        (
            "csi-b",
            "[{name: data, persistentVolumeClaim: {claimName: pv-b}}, {name: scratch, emptyDir: {}}]",
            vec![("scratch", "kubernetes.io~empty-dir", false)],
            vec!["pv-b"],
        ),
    ];
    defs.into_iter()
        .enumerate()
        .map(|(i, (name, volumes_yaml, volumes, pvs))| {
            let uid = format!("00000000-0000-4000-8000-{:012}", i + 1);
            let volumes_yaml = volumes_yaml.replace("HOST", &host.display().to_string());
            // The volumes' names, read by the project's own manifest parser.
            let probe = format!(
                "apiVersion: v1\nkind: Pod\nmetadata: {{name: probe}}\nspec:\n  containers: [{{name: c}}]\n  volumes: {volumes_yaml}\n"
            );
            let (objects, errors) = parse_manifest(Path::new("storm.yaml"), &probe);
            assert!(errors.is_empty(), "{errors:?}");
            let Some(Object::Pod(parsed, _)) = objects.into_iter().map(|(_, o)| o).next() else {
                panic!("the storm pod {name} does not parse")
            };
            let names: Vec<String> = parsed
                .spec
                .iter()
                .flat_map(|s| s.volumes.iter().flatten())
                .map(|v| v.name.clone())
                .collect();
            let mounts: Vec<String> = names
                .iter()
                .map(|n| format!("{{name: {n}, mountPath: /mnt/{n}}}"))
                .collect();
            let yaml = format!(
                "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: default, uid: {uid}}}\n\
                 spec:\n  containers: [{{name: c, image: busybox, volumeMounts: [{}]}}]\n  volumes: {volumes_yaml}\n",
                mounts.join(", ")
            );
            StormPod {
                name,
                names,
                uid,
                volumes,
                pvs,
                yaml,
            }
        })
        .collect()
}

fn staging_path(root: &Path, pv: &str) -> PathBuf {
    let hash: String = sha2::Sha256::digest(pv.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    root.join("plugins/kubernetes.io/csi")
        .join(DRIVER)
        .join(hash)
        .join("globalmount")
}

fn publish_path(root: &Path, pod: &StormPod, pv: &str) -> PathBuf {
    root.join("pods")
        .join(&pod.uid)
        .join("volumes/kubernetes.io~csi")
        .join(pv)
        .join("mount")
}

/// The mounts the node must hold for `present` pods: exactly these, each once.
fn expected_mounts(root: &Path, pods: &[StormPod], present: &BTreeSet<usize>) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut pvs = BTreeSet::new();
    for &i in present {
        let p = &pods[i];
        for (name, dir, own) in &p.volumes {
            if *own {
                out.push(
                    root.join("pods")
                        .join(&p.uid)
                        .join("volumes")
                        .join(dir)
                        .join(name),
                );
            }
        }
        for pv in &p.pvs {
            out.push(publish_path(root, p, pv));
            pvs.insert(*pv);
        }
    }
    out.extend(pvs.iter().map(|pv| staging_path(root, pv)));
    out.sort();
    out
}

fn actual_mounts(root: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = mounts_under(root).into_iter().map(|m| m.0).collect();
    v.sort();
    v
}

/// What the storm knows: which pods are present and what each canary holds.
struct World {
    pods: Vec<StormPod>,
    present: BTreeSet<usize>,
    /// Canary files outside the root (hostPath) and what they hold.
    canaries: BTreeMap<PathBuf, String>,
    /// What the canary in each claim holds, once written.
    claim_canaries: BTreeMap<&'static str, String>,
    /// What the canary in each emptyDir of a present pod holds, once written (by pod index and
    /// volume name): an emptyDir is its pod's for as long as the pod stays, across every kill.
    dir_canaries: BTreeMap<(usize, &'static str), String>,
    /// The mount ID of each emptyDir with a mount of its own (tmpfs) of a present pod: a
    /// remount while the pod stays, even one that kept the files, is a new ID.
    dir_mounts: BTreeMap<(usize, &'static str), u32>,
    rng: u64,
}

impl World {
    fn new(env: &Env, seed: u64) -> World {
        env.write("objects.yaml", &objects(env));
        std::fs::create_dir_all(env.host().join("host")).unwrap();
        let canary = env.host().join("host/canary");
        std::fs::write(&canary, "host canary\n").unwrap();
        World {
            pods: storm_pods(env),
            present: BTreeSet::new(),
            canaries: BTreeMap::from([(canary, "host canary\n".to_string())]),
            claim_canaries: BTreeMap::new(),
            dir_canaries: BTreeMap::new(),
            dir_mounts: BTreeMap::new(),
            rng: seed | 1,
        }
    }

    fn random(&mut self, n: u64) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng % n.max(1)
    }

    fn toggle(&mut self, env: &Env, i: usize) {
        let file = format!("{}.yaml", self.pods[i].name);
        if self.present.remove(&i) {
            env.remove(&file);
            // Its volumes go with it: a pod added again has new ones.
            self.dir_canaries.retain(|(p, _), _| *p != i);
            self.dir_mounts.retain(|(p, _), _| *p != i);
        } else {
            env.write(&file, &self.pods[i].yaml);
            self.present.insert(i);
        }
    }

    fn toggle_random(&mut self, env: &Env) {
        let i = self.random(self.pods.len() as u64) as usize;
        self.toggle(env, i);
    }

    fn wanted(&self) -> BTreeSet<String> {
        self.present
            .iter()
            .map(|&i| format!("default/{}", self.pods[i].name))
            .collect()
    }
}

/// Waits until the daemon has synced, every present pod is ready, no gone pod is left (in the
/// status, the pods directory or the mount table) and the mount table holds exactly what the
/// present pods need. Panics with the evidence after `secs`.
fn converge(env: &Env, d: &Daemon, w: &World, secs: u64) {
    let root = env.root();
    let want = w.wanted();
    let expected = expected_mounts(&root, &w.pods, &w.present);
    let gone: Vec<PathBuf> = (0..w.pods.len())
        .filter(|i| !w.present.contains(i))
        .map(|i| root.join("pods").join(&w.pods[i].uid))
        .collect();
    let pvs_in_use: BTreeSet<&str> = w
        .present
        .iter()
        .flat_map(|&i| w.pods[i].pvs.iter().copied())
        .collect();
    // Node-wide records go once a volume is unstaged and detached.
    let device_records = || {
        kubevol::record::Record::read(&root)
            .map(|r| r.devices.len())
            .unwrap_or(usize::MAX)
    };
    let want_records: usize = w.present.iter().map(|&i| w.pods[i].names.len()).sum();
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut last = None;
    loop {
        if let Some(s) = d.status() {
            let synced = s["states_synced"] == true;
            let pods = s["pods"].as_array().cloned().unwrap_or_default();
            let ready: BTreeSet<String> = pods
                .iter()
                .filter(|p| p["phase"] == "Ready")
                .map(|p| {
                    format!(
                        "{}/{}",
                        p["namespace"].as_str().unwrap(),
                        p["name"].as_str().unwrap()
                    )
                })
                .collect();
            let done = synced
                && ready == want
                && pods.len() == want.len()
                && gone.iter().all(|g| !g.exists())
                && actual_mounts(&root) == expected
                && device_records() == pvs_in_use.len()
                && pod_records(&root) == want_records;
            if done {
                return;
            }
            last = Some(s);
        }
        if Instant::now() > deadline {
            panic!(
                "not converged after {secs}s\nwanted pods: {want:?}\nexpected mounts: {expected:#?}\nactual mounts: {:#?}\nnode-wide records: {} for claims in use {pvs_in_use:?}\npod volume records: {} of {want_records}\ngone pod directories still there: {:?}\nstatus: {}\ndaemon log:\n{}",
                actual_mounts(&root),
                device_records(),
                pod_records(&root),
                gone.iter().filter(|g| g.exists()).collect::<Vec<_>>(),
                serde_json::to_string_pretty(&last).unwrap_or_default(),
                d.log_tail()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The invariants after convergence: canaries byte-identical (and one written into every
/// claim seen for the first time), every stage and attach of a volume no pod uses undone, and
/// the record holding exactly the present pods' volumes.
fn check_invariants(env: &Env, w: &mut World) {
    let root = env.root();
    let mut in_use = BTreeSet::new();
    for &i in &w.present {
        for pv in &w.pods[i].pvs {
            in_use.insert(*pv);
            let canary = publish_path(&root, &w.pods[i], pv).join("canary");
            match w.claim_canaries.get(pv) {
                Some(want) => assert_eq!(
                    std::fs::read_to_string(&canary).ok().as_ref(),
                    Some(want),
                    "the canary in claim {pv} changed"
                ),
                None => {
                    let text = format!("canary of {pv} written {:?}\n", Instant::now());
                    std::fs::write(&canary, &text).unwrap();
                    w.claim_canaries.insert(pv, text);
                }
            }
        }
    }
    let mounted: BTreeMap<PathBuf, u32> = mount_ids(&root)
        .into_iter()
        .map(|(id, path)| (path, id))
        .collect();
    for &i in &w.present {
        let pod = &w.pods[i];
        for &(name, plugin, own_mount) in &pod.volumes {
            if plugin != "kubernetes.io~empty-dir" {
                continue;
            }
            let dir = root
                .join("pods")
                .join(&pod.uid)
                .join("volumes")
                .join(plugin)
                .join(name);
            let canary = dir.join("canary");
            match w.dir_canaries.get(&(i, name)) {
                Some(want) => assert_eq!(
                    std::fs::read_to_string(&canary).ok().as_ref(),
                    Some(want),
                    "the canary in emptyDir {name} of pod {} changed while the pod stayed",
                    pod.name
                ),
                None => {
                    let text = format!(
                        "canary of {}/{name} written {:?}\n",
                        pod.name,
                        Instant::now()
                    );
                    std::fs::write(&canary, &text).unwrap();
                    w.dir_canaries.insert((i, name), text);
                }
            }
            if own_mount {
                let id = *mounted
                    .get(&dir)
                    .unwrap_or_else(|| panic!("emptyDir {name} of pod {} is mounted", pod.name));
                let was = *w.dir_mounts.entry((i, name)).or_insert(id);
                assert_eq!(
                    was, id,
                    "emptyDir {name} of pod {} was mounted again while the pod stayed",
                    pod.name
                );
            }
        }
    }
    for (path, want) in &w.canaries {
        assert_eq!(
            &std::fs::read_to_string(path).unwrap(),
            want,
            "{}",
            path.display()
        );
    }
    let want: usize = w.present.iter().map(|&i| w.pods[i].names.len()).sum();
    assert_eq!(
        pod_records(&root),
        want,
        "one record per present pod volume, none leaked"
    );
}

/// The pod volume records under `root` (whole lines, not a write in flight).
fn pod_records(root: &Path) -> usize {
    kubevol::record::Record::read(root)
        .map(|r| r.pods.len())
        .unwrap_or(usize::MAX)
}

/// How many random kills the harness adds to the named fail points
/// (`KUBEVOL_CRASH_RANDOM_KILLS`, 8 by default; large local runs set hundreds).
fn random_kills() -> usize {
    std::env::var("KUBEVOL_CRASH_RANDOM_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8)
}

/// The fail points of volume operations (those of binding and reclaiming have tests of their
/// own: a claim is bound once in a root's life).
fn volume_fail_points() -> impl Iterator<Item = &'static str> {
    kubevol::record::FAIL_POINTS
        .iter()
        .copied()
        .filter(|p| !p.starts_with("bind:") && !p.starts_with("reclaim:"))
}

mount_test! {
    fn sigkill_at_every_fail_point_and_at_random_during_a_storm_loses_nothing() {
        let env = Env::new();
        let seed = std::env::var("KUBEVOL_CRASH_SEED")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
            });
        eprintln!("crash harness seed {seed} (KUBEVOL_CRASH_SEED reproduces the storm)");
        let mut w = World::new(&env, seed);
        let started = Instant::now();
        let points: Vec<Option<&str>> = volume_fail_points()
            .map(Some)
            .chain(std::iter::repeat_n(None, random_kills()))
            .collect();
        let mut fired = BTreeSet::new();
        for (round, point) in points.iter().enumerate() {
            let mut d = Daemon::start(&env, *point, &[]);
            let until = Instant::now()
                + match point {
                    Some(_) => Duration::from_secs(10),
                    None => Duration::from_millis(100 + w.random(1400)),
                };
            let mut flip = 0;
            while Instant::now() < until && !d.exited() {
                match point {
                    // Every operation happens: all pods come, then all go, and again.
                    Some(_) => {
                        for i in 0..w.pods.len() {
                            if (flip % 2 == 0) != w.present.contains(&i) {
                                w.toggle(&env, i);
                            }
                        }
                        flip += 1;
                        std::thread::sleep(Duration::from_millis(600));
                    }
                    None => {
                        w.toggle_random(&env);
                        std::thread::sleep(Duration::from_millis(20 + w.random(80)));
                    }
                }
            }
            if let Some(p) = point {
                let log = std::fs::read_to_string(&d.log).unwrap_or_default();
                if d.exited() && log.contains(&format!("fail point {p} reached")) {
                    fired.insert(*p);
                }
            }
            d.kill();
            // While it is down, the world moves on: a pod deleted or added.
            w.toggle_random(&env);
            let d = Daemon::start(&env, None, &[]);
            converge(&env, &d, &w, 90);
            check_invariants(&env, &mut w);
            eprintln!(
                "round {round} ({}): converged with {} pods",
                point.unwrap_or("random kill"),
                w.present.len()
            );
            // Killed again once idle: every round starts from a crash.
            drop(d);
        }
        let missed: Vec<&str> = volume_fail_points()
            .filter(|p| !fired.contains(p))
            .collect();
        assert!(missed.is_empty(), "fail points never reached: {missed:?}");
        // Finally everything goes away, and nothing of it is left.
        for i in 0..w.pods.len() {
            if w.present.contains(&i) {
                w.toggle(&env, i);
            }
        }
        let d = Daemon::start(&env, None, &[]);
        converge(&env, &d, &w, 90);
        check_invariants(&env, &mut w);
        eprintln!(
            "crash harness: {} kill points ({} named fail points, {} random kills) plus {} idle kills, {} restarts, {:?}",
            points.len(),
            volume_fail_points().count(),
            random_kills(),
            points.len(),
            2 * points.len() + 1,
            started.elapsed()
        );
    }
}

/// The index of a storm pod by name.
fn index(w: &World, name: &str) -> usize {
    w.pods.iter().position(|p| p.name == name).unwrap()
}

/// Mount ID and mount point of every mount under `dir`: a remount changes the ID.
fn mount_ids(dir: &Path) -> Vec<(u32, PathBuf)> {
    use kubevol_mount::Mounter;
    let mut v: Vec<(u32, PathBuf)> = kubevol_mount::LinuxMounter
        .mount_table()
        .unwrap()
        .into_iter()
        .filter(|m| m.mount_point.starts_with(dir))
        .map(|m| (m.id, m.mount_point))
        .collect();
    v.sort();
    v
}

fn status_of<'a>(s: &'a serde_json::Value, pod: &str) -> Option<&'a serde_json::Value> {
    s["pods"].as_array()?.iter().find(|p| p["name"] == pod)
}

/// Waits until `cond` holds for the daemon's status; panics with it after `secs`.
fn wait_status(
    d: &Daemon,
    secs: u64,
    what: &str,
    cond: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut last = None;
    while Instant::now() < deadline {
        if let Some(s) = d.status() {
            if cond(&s) {
                return s;
            }
            last = Some(s);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!(
        "{what}: not reached in {secs}s; status {}\nlog:\n{}",
        serde_json::to_string_pretty(&last).unwrap_or_default(),
        d.log_tail()
    );
}
