//! Real containers on what kubevol mounted: each test resolves a container's mounts
//! ([`kubevol::VolumeManager::container_mounts`]), turns them into an OCI `config.json`
//! ([`kubevol::containers::oci::oci_config`]) on a static busybox root filesystem, and runs it
//! with crun, in the test's own private mount namespace.

#[macro_use]
mod common;

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::*;
use k8s_openapi::api::core::v1::Pod;
use kubevol::source::ManifestSource;
use kubevol::status::PodPhase;
use kubevol::VolumeManager;

/// An OCI runtime on a busybox root, its state and bundles below `dir`.
struct Runtime {
    dir: PathBuf,
    rootfs: PathBuf,
}

impl Runtime {
    /// Makes the root filesystem (a static busybox, as `/bin/sh` and its applets) and gives
    /// crun a cgroup2 hierarchy of this namespace's own (on a node whose controllers are in
    /// cgroup v1, crun refuses the hybrid layout; it makes no cgroup here).
    fn new(dir: &Path) -> Runtime {
        let busybox = Path::new("/bin/busybox");
        let ldd = Command::new("ldd").arg(busybox).output();
        assert!(
            busybox.exists() && ldd.is_ok_and(|o| !o.status.success()),
            "the container tests need a static /bin/busybox: apt-get install busybox-static"
        );
        let rootfs = dir.join("rootfs");
        fs::create_dir_all(rootfs.join("bin")).unwrap();
        fs::copy(busybox, rootfs.join("bin/busybox")).unwrap();
        let applets = Command::new(busybox).arg("--list").output().unwrap();
        for applet in String::from_utf8_lossy(&applets.stdout).lines() {
            let link = rootfs.join("bin").join(applet);
            if !link.exists() {
                std::os::unix::fs::symlink("busybox", link).unwrap();
            }
        }
        let _ = rustix::mount::mount(
            "cgroup2",
            "/sys/fs/cgroup",
            "cgroup2",
            rustix::mount::MountFlags::empty(),
            None,
        );
        Runtime {
            dir: dir.to_path_buf(),
            rootfs,
        }
    }

    /// Starts `container` of `pod` with what `m` resolved for it.
    fn start(&self, m: &VolumeManager, pod: &Pod, container: &str) -> std::process::Child {
        let mounts = m
            .container_mounts(pod, container)
            .expect("the container's mounts");
        let groups = m.extra_supplemental_groups_for_pod(pod);
        let config = kubevol::containers::oci::oci_config(pod, &mounts, &groups, &self.rootfs)
            .expect("an OCI config");
        let bundle = self.dir.join(format!("bundle-{container}"));
        fs::create_dir_all(&bundle).unwrap();
        fs::write(
            bundle.join("config.json"),
            serde_json::to_vec_pretty(&config).unwrap(),
        )
        .unwrap();
        Command::new("crun")
            .arg("--root")
            .arg(self.dir.join("state"))
            .args(["--cgroup-manager=disabled", "run", "--bundle"])
            .arg(&bundle)
            .arg(container)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run crun: apt-get install crun")
    }

    /// Runs `container` of `pod` to its end and returns its output (which must be a success).
    fn run(&self, m: &VolumeManager, pod: &Pod, container: &str) -> String {
        let out = finish(self.start(m, pod, container));
        assert!(
            out.status.success(),
            "container {container}: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }
}

/// Waits for a container that ends by itself (each script here bounds its own waits).
fn finish(child: std::process::Child) -> Output {
    child.wait_with_output().expect("wait for crun")
}

/// Starts a manager on the manifests in `dir`, waits until `pod` is ready and returns both.
async fn ready(root: &TestRoot, manifests: &Path, name: &str) -> (VolumeManager, Pod) {
    let m = manager(root.path(), |c| {
        c.host_path_allow = vec![root.path().join("host")];
    });
    let source = ManifestSource::new(manifests);
    // The watch goes on by itself (its handle is not needed to keep it).
    source
        .listen(m.store().sink(ManifestSource::NAME))
        .await
        .expect("watch manifests");
    let key = pod(serde_json::json!({"metadata": {"name": name, "namespace": "default"}, "spec": {"containers": []}}));
    let status = wait_for_status(&m, &key, 30, |s| s.phase == PodPhase::Ready).await;
    assert_eq!(status.phase, PodPhase::Ready, "{status:#?}");
    let uid = kubevol::pod_uid(&key);
    let stored = m.store().pod(&uid).expect("the pod is stored");
    (m, (*stored.pod).clone())
}

const SECRET_AND_CACHE: &str = r#"
apiVersion: v1
kind: Secret
metadata: {name: db}
stringData: {password: "s3cret"}
---
apiVersion: v1
kind: Pod
metadata: {name: batch}
spec:
  securityContext: {runAsUser: 1000, runAsGroup: 1000, fsGroup: 2000}
  containers:
  - name: job
    command: [sh, -c]
    args:
    - |
      id
      cat /run/db/password; echo
      ls -ln /run/db/..data/password
      echo written > /cache/out && echo cache=ok
      if echo x > /frozen/x 2>/dev/null; then echo frozen=writable; else echo frozen=refused; fi
      if echo x > /run/db/x 2>/dev/null; then echo secret=writable; else echo secret=refused; fi
    volumeMounts:
    - {name: db, mountPath: /run/db}
    - {name: cache, mountPath: /cache}
    - {name: cache, mountPath: /frozen, readOnly: true}
  volumes:
  - {name: db, secret: {secretName: db, defaultMode: 0440}}
  - {name: cache, emptyDir: {}}
"#;

mount_test! {
    /// A container running as uid 1000 with fsGroup 2000 reads its Secret (0440, group
    /// 2000), writes its emptyDir (which the host then sees, owned by the container's user),
    /// and is refused writing a read-only mount of the same emptyDir and its Secret.
    fn a_container_reads_its_secret_writes_its_empty_dir_and_is_refused_read_only_mounts() {
        let root = TestRoot::new();
        let manifests = root.manifests();
        write_manifest(&manifests, "batch.yaml", SECRET_AND_CACHE);
        let rt = Runtime::new(&root.path().join("runtime"));
        runtime().block_on(async {
            let (m, pod) = ready(&root, &manifests, "batch").await;
            let out = rt.run(&m, &pod, "job");
            let lines: Vec<&str> = out.lines().collect();
            assert!(lines[0].starts_with("uid=1000 gid=1000 groups=2000"), "{out}");
            assert_eq!(lines[1], "s3cret", "{out}");
            let ls: Vec<&str> = lines[2].split_whitespace().collect();
            assert_eq!((ls[0], ls[2], ls[3]), ("-r--r-----", "0", "2000"), "{out}");
            assert_eq!(&lines[3..], ["cache=ok", "frozen=refused", "secret=refused"], "{out}");
            let cache = &m.mounted_volumes_for_pod(&kubevol::pod_uid(&pod))["cache"].path;
            assert_eq!(fs::read_to_string(cache.join("out")).unwrap(), "written\n");
            assert_eq!(fs::metadata(cache.join("out")).unwrap().uid(), 1000);
            m.shutdown();
        });
    }
}
