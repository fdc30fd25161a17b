//! Restart safety of the `kubevol run` daemon: SIGKILL at random moments and at every named
//! fail point during a storm of pod adds and deletes, a pod deleted while the daemon is down,
//! a pod source missing at start, hung and dead FUSE mounts, and a busy volume. Each test runs
//! in its own private mount namespace, with the real daemon and the loop CSI driver as child
//! processes.

#[macro_use]
#[path = "../../kubevol/tests/common/mod.rs"]
mod common;
mod loop_driver;

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

/// kubevol's bindings in `root`, claim to volume, as on disk.
fn bindings_on_disk(root: &Path) -> BTreeMap<String, String> {
    let path = root
        .join(kubevol::record::RECORD_DIR)
        .join(kubevol::store::BINDINGS_FILE);
    let Ok(text) = std::fs::read_to_string(&path) else {
        return BTreeMap::new();
    };
    let v: serde_json::Value = serde_json::from_str(&text).expect("the bindings file is whole");
    v["bindings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            (
                format!(
                    "{}/{}",
                    b["namespace"].as_str().unwrap(),
                    b["claim"].as_str().unwrap()
                ),
                b["volume"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// A claim of 100Mi (of class `manual`, or else the default class) and a pod of the same name
/// that mounts it.
fn bound_claim_and_pod(name: &str, manual: bool) -> String {
    let class = if manual {
        "storageClassName: manual, "
    } else {
        ""
    };
    format!(
        "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {{name: {name}}}\nspec: {{{class}accessModes: [ReadWriteOnce], resources: {{requests: {{storage: 100Mi}}}}}}\n---\n\
         apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}}}\nspec:\n  containers: [{{name: c, image: busybox, volumeMounts: [{{name: data, mountPath: /data}}]}}]\n  volumes: [{{name: data, persistentVolumeClaim: {{claimName: {name}}}}}]\n"
    )
}

mount_test! {
    /// Binding under SIGKILL: killed before a binding is on disk, the claim is unbound after
    /// the restart and bound then; killed after, it keeps that volume. Then claims are bound
    /// while the daemon is killed at random: after the last restart every binding ever on
    /// disk is unchanged, no volume has two claims, and each pod's volume is the one its claim
    /// is bound to (a file written through the pod lands in that volume's directory).
    fn sigkill_while_claims_are_bound_leaves_the_old_bindings_or_the_new() {
        let env = Env::new();
        let pool: String = (0..8)
            .map(|i| {
                format!(
                    "apiVersion: v1\nkind: PersistentVolume\nmetadata: {{name: pool-{i}}}\nspec: {{storageClassName: manual, capacity: {{storage: {}Mi}}, accessModes: [ReadWriteOnce], hostPath: {{path: {}, type: DirectoryOrCreate}}}}\n---\n",
                    100 + 10 * i,
                    env.host().join(format!("pool-{i}")).display()
                )
            })
            .collect();
        env.write("pool.yaml", &pool);
        let root = env.root();
        // Killed before a binding reaches the disk, nothing is bound; after, the one binding
        // made (of whichever claim the binder took first) is there, and what was is unchanged.
        let mut before = bindings_on_disk(&root);
        for (claim, point) in [("first", "bind:before"), ("second", "bind:after")] {
            env.write(&format!("{claim}.yaml"), &bound_claim_and_pod(claim, true));
            die_at(&env, point);
            let on_disk = bindings_on_disk(&root);
            match point {
                "bind:before" => assert_eq!(on_disk, before),
                _ => {
                    assert_eq!(on_disk.len(), before.len() + 1, "{on_disk:?}");
                    assert!(before.iter().all(|(k, v)| on_disk.get(k) == Some(v)), "{on_disk:?}");
                }
            }
            before = on_disk;
        }
        let named = bindings_on_disk(&root);
        let mut rng = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos() as u64
            | 1;
        let mut random = |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        let mut claims = vec!["first".to_string(), "second".to_string()];
        for round in 0..random_kills() {
            let name = format!("r{round}");
            env.write(&format!("{name}.yaml"), &bound_claim_and_pod(&name, true));
            claims.push(name);
            let mut d = Daemon::start(&env, None, &[]);
            std::thread::sleep(Duration::from_millis(50 + random(400)));
            d.kill();
            let now = bindings_on_disk(&root);
            for (claim, volume) in &named {
                assert_eq!(now.get(claim), Some(volume), "a binding moved");
            }
        }
        // The last daemon runs until every claim that a volume is left for is mounted.
        let d = Daemon::start(&env, None, &[]);
        let deadline = Instant::now() + Duration::from_secs(60);
        let mounted = loop {
            let status = d.status();
            let paths: BTreeMap<String, String> = status
                .iter()
                .flat_map(|s| s["pods"].as_array().cloned().unwrap_or_default())
                .filter(|p| p["volumes"][0]["state"] == "Mounted")
                .map(|p| (format!("default/{}", p["name"].as_str().unwrap()), p["volumes"][0]["path"].as_str().unwrap().to_string()))
                .collect();
            if paths.len() == claims.len().min(8) {
                break paths;
            }
            assert!(Instant::now() < deadline, "not converged: {status:#?}\n{}", d.log_tail());
            std::thread::sleep(Duration::from_millis(50));
        };
        let bound = bindings_on_disk(&root);
        for (claim, volume) in &named {
            assert_eq!(bound.get(claim), Some(volume), "a binding moved");
        }
        let volumes: BTreeSet<&String> = bound.values().collect();
        assert_eq!(volumes.len(), bound.len(), "a volume with two claims: {bound:?}");
        for (claim, path) in &mounted {
            let volume = &bound[claim];
            std::fs::write(Path::new(path).join("canary"), claim).unwrap();
            assert_eq!(
                std::fs::read_to_string(env.host().join(volume).join("canary")).unwrap(),
                *claim,
                "the pod of {claim} uses {volume}"
            );
        }
        eprintln!("{} claims, {} bound: {bound:?}", claims.len(), bound.len());
    }
}

/// Runs a daemon armed with fail point `point` until it dies there.
fn die_at(env: &Env, point: &str) {
    let mut d = Daemon::start(env, Some(point), &[]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !d.exited() {
        assert!(
            Instant::now() < deadline,
            "{point} not reached:\n{}",
            d.log_tail()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = std::fs::read_to_string(&d.log).unwrap_or_default();
    assert!(
        log.contains(&format!("fail point {point} reached")),
        "{}",
        d.log_tail()
    );
}

/// Waits until `ready` holds of the daemon's status; panics after 60 s.
fn until_status(
    d: &Daemon,
    what: &str,
    ready: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(s) = d.status().filter(|s| ready(s)) {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within 60 s: {:#?}\n{}",
            d.status(),
            d.log_tail()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The path of pod `name`'s first volume once it is mounted.
fn mounted_path(status: &serde_json::Value, name: &str) -> Option<PathBuf> {
    status["pods"]
        .as_array()?
        .iter()
        .find(|p| p["name"] == name)
        .filter(|p| p["volumes"][0]["state"] == "Mounted")
        .and_then(|p| p["volumes"][0]["path"].as_str())
        .map(PathBuf::from)
}

mount_test! {
    /// Provisioning and reclaiming under SIGKILL. Killed before a provisioned volume is on
    /// disk and after; before a removed claim's volume is deleted and after: each restart
    /// converges, the volumes of present claims keep their data, a deleted one leaves no
    /// directory and no record, and nothing else under the local-path directory is touched.
    fn sigkill_while_volumes_are_provisioned_and_reclaimed_loses_nothing() {
        let env = Env::new();
        let claim = |name: &str| bound_claim_and_pod(name, false);
        for (name, point) in [("p1", "bind:before"), ("p2", "bind:after")] {
            env.write(&format!("{name}.yaml"), &claim(name));
            die_at(&env, point);
        }
        let local = env.root().join("local-path");
        std::fs::create_dir_all(&local).unwrap();
        std::fs::write(local.join("not-a-volume"), "someone else's").unwrap();
        let d = Daemon::start(&env, None, &[]);
        let s = until_status(&d, "both provisioned and mounted", |s| mounted_path(s, "p1").is_some() && mounted_path(s, "p2").is_some());
        for name in ["p1", "p2"] {
            std::fs::write(mounted_path(&s, name).unwrap().join("canary"), name).unwrap();
        }
        drop(d);
        let provisioned = || {
            let text = std::fs::read_to_string(env.root().join(kubevol::record::RECORD_DIR).join(kubevol::store::BINDINGS_FILE)).unwrap();
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            v["provisioned"].as_array().unwrap().len()
        };
        assert_eq!(provisioned(), 2);
        let dirs = || {
            // (Without the directory's lock file, `.kubevol.lock`.)
            let mut d: Vec<String> = std::fs::read_dir(&local).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).filter(|n| n != kubevol::record::LOCAL_PATH_LOCK_FILE).collect();
            d.sort();
            d
        };
        assert_eq!(dirs().len(), 3, "{:?}", dirs());

        // p1 removed: killed before its directory goes, then after.
        env.remove("p1.yaml");
        die_at(&env, "reclaim:before");
        assert_eq!(dirs().len(), 3, "nothing removed yet");
        let p2 = dirs().into_iter().find(|d| d.ends_with("_default_p2")).unwrap();
        assert_eq!(std::fs::read_to_string(local.join(&p2).join("canary")).unwrap(), "p2", "a present claim's data");
        env.remove("p2.yaml");
        die_at(&env, "reclaim:after");
        let d = Daemon::start(&env, None, &[]);
        until_status(&d, "both deleted", |s| s["pods"].as_array().is_some_and(|p| p.is_empty()) && s.get("bindings").is_none_or(|b| b.as_array().is_some_and(|b| b.is_empty())));
        let deadline = Instant::now() + Duration::from_secs(30);
        while dirs() != ["not-a-volume"] || provisioned() != 0 {
            assert!(Instant::now() < deadline, "{:?} {}\n{}", dirs(), provisioned(), d.log_tail());
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(std::fs::read_to_string(local.join("not-a-volume")).unwrap(), "someone else's");
    }
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

mount_test! {
    fn a_pod_deleted_while_down_is_torn_down_on_return_even_with_a_corrupt_record() {
        let env = Env::new();
        let mut w = World::new(&env, 1);
        for name in ["memory", "csi-a", "csi-b"] {
            let i = index(&w, name);
            w.toggle(&env, i);
        }
        let mut d = Daemon::start(&env, None, &[]);
        converge(&env, &d, &w, 60);
        check_invariants(&env, &mut w);
        d.kill();

        // While down: two pods go, and the record of one of their volumes is cut in half.
        for name in ["memory", "csi-a"] {
            let i = index(&w, name);
            w.toggle(&env, i);
        }
        let memory = &w.pods[index(&w, "memory")];
        let record = env.root().join("volume-record").join(kubevol::record::JOURNAL);
        let text = std::fs::read_to_string(&record).unwrap();
        let cut: Vec<String> = text
            .lines()
            .map(|l| {
                if l.contains(&memory.uid) && l.contains("\"volume\":\"cache\"") {
                    l[..l.len() / 2].to_string()
                } else {
                    l.to_string()
                }
            })
            .collect();
        assert_ne!(cut.join("\n") + "\n", text, "the emptyDir's record lines");
        // A whole line after them (a removal of nothing), so that they are not a write cut short.
        let after = r#"{"removePodVolume":{"pod":"none","unique":"none"}}"#;
        let torn = r#"{"podVolume":{"version":1,"pod":{"namespace":"default","name":"gone","uid":"00000000-0000-4000-8000-0000000000aa"},"#;
        std::fs::write(&record, cut.join("\n") + "\n" + torn + "\n" + after + "\n").unwrap();
        // A gone pod's directory with a file of someone else's in it: kept and reported. Its
        // record is a line that cannot be read, which still names it as kubevol's.
        let orphan = env.root().join("pods/00000000-0000-4000-8000-0000000000aa");
        std::fs::create_dir_all(orphan.join("volumes")).unwrap();
        std::fs::write(orphan.join("notes.txt"), "not kubevol's\n").unwrap();

        let d = Daemon::start(&env, None, &[]);
        converge(&env, &d, &w, 60);
        check_invariants(&env, &mut w);
        let s = d.status().unwrap();
        let problems = s["reconstruction"]["problems"].to_string();
        assert!(
            problems.contains(&record.display().to_string()) && problems.contains("possibly mounted"),
            "the corrupt record is reported: {problems}"
        );
        assert!(s["reconstruction"]["from_layout"].as_u64().unwrap() >= 1, "{s}");
        wait_status(&d, 30, "the orphan's leftover is reported", |s| {
            s["leftovers"].to_string().contains("notes.txt")
        });
        assert_eq!(
            std::fs::read_to_string(orphan.join("notes.txt")).unwrap(),
            "not kubevol's\n",
            "never force-deleted"
        );
        assert!(!orphan.join("volumes").exists(), "its empty directories are removed");
        let metrics = d.get("/metrics").unwrap().1;
        assert!(
            metrics.contains("kubelet_orphan_pod_cleaned_volumes_errors 1"),
            "{metrics}"
        );
        let calls = env.driver.calls();
        let unpublished = calls
            .iter()
            .any(|c| c.0 == "NodeUnpublishVolume" && c.1 == "pv-a" && c.3 == "Ok");
        assert!(unpublished, "the deleted pod's claim was unpublished");
        // Its claim comes back with another pod: the canary written before is still there.
        let i = index(&w, "csi-a2");
        w.toggle(&env, i);
        converge(&env, &d, &w, 60);
        check_invariants(&env, &mut w);
    }
}

mount_test! {
    fn a_pod_source_missing_for_a_minute_at_start_unmounts_nothing() {
        let env = Env::new();
        let mut w = World::new(&env, 1);
        for name in ["memory", "csi-a", "disk", "host"] {
            let i = index(&w, name);
            w.toggle(&env, i);
        }
        let mut d = Daemon::start(&env, None, &[]);
        converge(&env, &d, &w, 60);
        check_invariants(&env, &mut w);
        let before = mount_ids(&env.root());
        d.kill();

        let away = env.tmp.path().join("manifests.away");
        std::fs::rename(env.manifests(), &away).unwrap();
        let d = Daemon::start(&env, None, &[]);
        let outage = Instant::now();
        while outage.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_secs(1));
            assert_eq!(mount_ids(&env.root()), before, "nothing is unmounted or remounted while the source is missing");
            if let Some((code, _)) = d.get("/readyz") {
                assert_eq!(code, 503, "not ready before the source is listed");
            }
        }
        let s = d.status().expect("the daemon serves its status while it waits");
        assert_eq!(s["states_synced"], false);
        assert!(
            std::fs::read_to_string(&d.log).unwrap().contains("cannot read the manifest directory"),
            "the wait is logged"
        );
        std::fs::rename(&away, env.manifests()).unwrap();
        converge(&env, &d, &w, 60);
        check_invariants(&env, &mut w);
        assert_eq!(mount_ids(&env.root()), before, "the same mounts: set up again without a second mount");
        assert_eq!(d.get("/readyz").map(|r| r.0), Some(200));
    }
}

mount_test! {
    fn hung_fuse_mounts_stall_only_their_own_pod_and_dead_ones_are_unmounted() {
        let env = Env::new();
        let mut w = World::new(&env, 1);
        let hung = env.tmp.path().join("hung");
        std::fs::create_dir_all(&hung).unwrap();
        let hung_fd = hung_fuse_mount(&hung);
        env.write(
            "stuck.yaml",
            &format!(
                "apiVersion: v1\nkind: Pod\nmetadata: {{name: stuck, namespace: default, uid: 00000000-0000-4000-8000-0000000000ff}}\n\
                 spec: {{containers: [{{name: c, volumeMounts: [{{name: data, mountPath: /data}}]}}], volumes: [{{name: data, hostPath: {{path: {}, type: Directory}}}}]}}\n",
                hung.display()
            ),
        );
        let i = index(&w, "memory");
        w.toggle(&env, i);
        let mut d = Daemon::start(&env, None, &["--operation-timeout", "2s"]);
        // The pod on the hung filesystem says so; the other one mounts meanwhile.
        wait_status(&d, 60, "memory ready while stuck stalls", |s| {
            let ready = status_of(s, "memory").is_some_and(|p| p["phase"] == "Ready");
            let stalled = status_of(s, "stuck").is_some_and(|p| {
                p["volumes"][0]["last_error"]
                    .as_str()
                    .is_some_and(|e| e.contains("has not finished after"))
            });
            ready && stalled
        });
        let memory = &w.pods[i];
        let cache = env
            .root()
            .join("pods")
            .join(&memory.uid)
            .join("volumes/kubernetes.io~empty-dir/cache");
        std::fs::write(cache.join("canary"), "in memory\n").unwrap();
        // A thread is blocked in the hung filesystem: the stop does not wait for it.
        let took = d.terminate();
        assert!(took < Duration::from_secs(20), "SIGTERM took {took:?} with a blocked thread");

        // Down: a hung mount lands on the memory volume too, and another pod arrives.
        let stacked_fd = hung_fuse_mount(&cache);
        let j = index(&w, "disk");
        w.toggle(&env, j);
        let d = Daemon::start(&env, None, &["--operation-timeout", "2s"]);
        wait_status(&d, 60, "the new pod is ready while memory's volume hangs", |s| {
            status_of(s, "disk").is_some_and(|p| p["phase"] == "Ready")
                && s["states_synced"] == true
        });
        // The filesystems die: the stacked dead mount is removed, the tmpfs below kept.
        drop(stacked_fd);
        drop(hung_fd);
        wait_status(&d, 60, "stuck fails with the dead mount's error", |s| {
            status_of(s, "stuck").is_some_and(|p| {
                p["volumes"][0]["last_error"]
                    .as_str()
                    .is_some_and(|e| e.contains("not connected"))
            })
        });
        env.remove("stuck.yaml");
        {
            use kubevol_mount::Mounter;
            kubevol_mount::LinuxMounter.unmount(&hung).unwrap();
        }
        converge(&env, &d, &w, 60);
        assert_eq!(
            std::fs::read_to_string(cache.join("canary")).unwrap(),
            "in memory\n",
            "the memory volume under the dead mount kept its content"
        );
        // A dead mount over a volume whose pod is deleted: unmounted with it.
        let dead = hung_fuse_mount(&cache);
        drop(dead);
        w.toggle(&env, i);
        converge(&env, &d, &w, 60);
        check_invariants(&env, &mut w);
    }
}

/// The storm's "memory" pod, ready under a daemon started with `extra`, with a file `work`
/// in its memory emptyDir: (world, the pod's index, daemon, the volume's path).
fn memory_pod_with_work(env: &Env, extra: &[&str]) -> (World, usize, Daemon, PathBuf) {
    let mut w = World::new(env, 1);
    let i = index(&w, "memory");
    w.toggle(env, i);
    let d = Daemon::start(env, None, extra);
    converge(env, &d, &w, 60);
    let cache = env
        .root()
        .join("pods")
        .join(&w.pods[i].uid)
        .join("volumes/kubernetes.io~empty-dir/cache");
    std::fs::write(cache.join("work"), "unsaved\n").unwrap();
    (w, i, d, cache)
}

mount_test! {
    fn a_busy_volume_is_retried_with_the_reason_shown_and_never_lazily_detached() {
        let env = Env::new();
        let (mut w, i, d, cache) = memory_pod_with_work(&env, &[]);
        // Without the test's pipes: a failed test is not held until it ends.
        let mut holder = Command::new("sleep")
            .arg("600")
            .current_dir(&cache)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        w.toggle(&env, i);
        wait_status(&d, 60, "the busy unmount is shown", |s| {
            status_of(s, "memory").is_some_and(|p| {
                p["phase"] == "Terminating"
                    && p["volumes"]
                        .to_string()
                        .contains("target is busy: held by pid")
            })
        });
        assert!(
            actual_mounts(&env.root()).contains(&cache),
            "still mounted: no lazy unmount without --allow-lazy-unmount"
        );
        assert_eq!(std::fs::read_to_string(cache.join("work")).unwrap(), "unsaved\n");
        let _ = holder.kill();
        let _ = holder.wait();
        converge(&env, &d, &w, 60);
        check_invariants(&env, &mut w);
    }
}

mount_test! {
    fn allow_lazy_unmount_detaches_a_busy_volume_and_the_holder_keeps_its_files() {
        let env = Env::new();
        let (mut w, i, d, cache) = memory_pod_with_work(&env, &["--allow-lazy-unmount"]);
        // The holder reads its file through its working directory once the pod is gone.
        let mut holder = Command::new("sh")
            .args(["-c", "read _; cat work"])
            .current_dir(&cache)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        w.toggle(&env, i);
        converge(&env, &d, &w, 60);
        assert!(
            std::fs::read_to_string(&d.log).unwrap().contains("detaching it lazily"),
            "the lazy detach is logged"
        );
        holder.stdin.take().unwrap().write_all(b"go\n").unwrap();
        let mut out = String::new();
        holder.stdout.take().unwrap().read_to_string(&mut out).unwrap();
        let _ = holder.wait();
        assert_eq!(out, "unsaved\n", "the detached tmpfs lives on for its last user");
        check_invariants(&env, &mut w);
    }
}

/// `kubevol ARGS` on the test's root with an empty manifest directory, to its end: (success,
/// stdout, stderr).
fn kubevol_on_root(env: &Env, args: &[&str]) -> (bool, String, String) {
    let empty = env.tmp.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let port = free_port();
    let out = Command::new(BIN)
        .args(["run", "--manifests"])
        .arg(&empty)
        .arg("--root-dir")
        .arg(env.root())
        .args(["--node-name", "test-node", "--listen"])
        .arg(format!("127.0.0.1:{port}"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

mount_test! {
    fn a_second_kubevol_on_the_same_root_refuses_and_changes_nothing() {
        let env = Env::new();
        let (mut w, i, mut d, cache) = memory_pod_with_work(&env, &[]);
        let pid = d.child.as_ref().unwrap().id();
        let lock = env.root().join(kubevol::record::LOCK_FILE);
        for extra in [&[][..], &["--once", "--timeout", "5s"][..]] {
            let (ok, _, stderr) = kubevol_on_root(&env, extra);
            assert!(!ok, "{extra:?} must refuse: {stderr}");
            assert!(
                stderr.contains(&format!("in use by process {pid}"))
                    && stderr.contains(&lock.display().to_string())
                    && stderr.contains(&env.root().display().to_string()),
                "{extra:?}: the root, the lock and the holder are named: {stderr}"
            );
        }
        assert_eq!(std::fs::read_to_string(cache.join("work")).unwrap(), "unsaved\n");
        converge(&env, &d, &w, 60);
        check_invariants(&env, &mut w);
        // The lock goes with its holder however it ends.
        d.kill();
        let (ok, stdout, stderr) = kubevol_on_root(&env, &["--once", "--timeout", "5s"]);
        assert!(ok, "the root is free once its owner is gone: {stdout}\n{stderr}");
        let _ = i;
    }
}

mount_test! {
    fn pod_directories_kubevol_never_recorded_are_left_alone_unless_adopted() {
        let env = Env::new();
        let (mut w, i, mut d, _) = memory_pod_with_work(&env, &[]);
        d.kill();
        // While down: the pod is removed, and someone else's pod appears under the root, with a
        // mounted volume holding data.
        w.toggle(&env, i);
        let foreign = env.root().join("pods/00000000-0000-4000-8000-0000000000fe");
        let volume = foreign.join("volumes/kubernetes.io~empty-dir/data");
        std::fs::create_dir_all(&volume).unwrap();
        let st = Command::new("mount")
            .args(["-t", "tmpfs", "tmpfs"])
            .arg(&volume)
            .status()
            .unwrap();
        assert!(st.success());
        std::fs::write(volume.join("db"), "someone else's\n").unwrap();

        let d = Daemon::start(&env, None, &[]);
        // Kubevol's own gone pod is torn down and swept; the foreign one is reported.
        let own = env.root().join("pods").join(&w.pods[i].uid);
        let s = wait_status(&d, 60, "the own pod is swept, the foreign one reported", |s| {
            s["states_synced"] == true
                && s["pods"] == serde_json::json!([])
                && !own.exists()
                && s["reconstruction"]["foreign_pods"]
                    .to_string()
                    .contains("0000000000fe")
        });
        assert!(
            s["reconstruction"]["foreign_pods"].to_string().contains("kubernetes.io/empty-dir/data"),
            "{s}"
        );
        assert!(actual_mounts(&env.root()).contains(&volume), "its mount stays");
        assert_eq!(std::fs::read_to_string(volume.join("db")).unwrap(), "someone else's\n");
        assert!(
            std::fs::read_to_string(&d.log).unwrap().contains("--adopt-foreign-pods"),
            "the log says how to adopt them"
        );
        let out = Command::new(BIN)
            .args(["status", "--server", &format!("http://127.0.0.1:{}", d.port)])
            .output()
            .unwrap();
        let table = String::from_utf8_lossy(&out.stdout);
        assert!(
            table.contains("Foreign pod directories") && table.contains(&foreign.display().to_string()),
            "{table}"
        );
        drop(d);

        // Adopted: it is kubevol's to tear down.
        let d = Daemon::start(&env, None, &["--adopt-foreign-pods"]);
        wait_status(&d, 60, "the adopted pod is torn down", |_| !foreign.exists());
        assert!(!actual_mounts(&env.root()).contains(&volume));
        let s = d.status().unwrap();
        assert_eq!(s["reconstruction"]["foreign_pods"], serde_json::json!([]), "{s}");
    }
}

mount_test! {
    fn a_pod_whose_manifest_is_broken_at_start_keeps_its_volumes_until_the_file_is_fixed() {
        let env = Env::new();
        let (mut w, i, mut d, cache) = memory_pod_with_work(&env, &[]);
        let j = index(&w, "disk");
        w.toggle(&env, j);
        converge(&env, &d, &w, 60);
        d.kill();
        // While down, the memory pod's file is left half-saved.
        let file = env.manifests().join("memory.yaml");
        let text = std::fs::read_to_string(&file).unwrap();
        std::fs::write(&file, &text[..text.len() / 2]).unwrap();

        let d = Daemon::start(&env, None, &[]);
        let s = wait_status(&d, 60, "the pod is held", |s| {
            s["states_synced"] == true
                && status_of(s, "memory").is_some_and(|p| p["phase"] == "Held")
                && status_of(s, "disk").is_some_and(|p| p["phase"] == "Ready")
        });
        let memory = status_of(&s, "memory").unwrap();
        assert!(
            memory["errors"].to_string().contains("memory.yaml has errors"),
            "it says why: {memory}"
        );
        for v in memory["volumes"].as_array().unwrap() {
            // Found at start, and neither set up again nor torn down while held.
            assert!(v["state"] == "Uncertain" || v["state"] == "Mounted", "{v}");
        }
        assert!(actual_mounts(&env.root()).contains(&cache), "still mounted");
        assert_eq!(std::fs::read_to_string(cache.join("work")).unwrap(), "unsaved\n");
        // Fixed: the pod is back, with its data.
        std::fs::write(&file, &text).unwrap();
        converge(&env, &d, &w, 60);
        assert_eq!(std::fs::read_to_string(cache.join("work")).unwrap(), "unsaved\n");
        let _ = i;
    }
}
