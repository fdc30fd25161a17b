//! Real containers for the tests: an OCI runtime (crun) running a container of a pod with the
//! mounts kubevol resolved for it, on a static busybox root filesystem.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use k8s_openapi::api::core::v1::Pod;
use kubevol::VolumeManager;

/// An OCI runtime on a busybox root, its state and bundles below `dir`.
pub struct Runtime {
    dir: PathBuf,
    pub rootfs: PathBuf,
}

impl Runtime {
    /// Makes the root filesystem (a static busybox, as `/bin/sh` and its applets) and gives
    /// crun a cgroup2 hierarchy of this namespace's own (on a node whose controllers are in
    /// cgroup v1, crun refuses the hybrid layout; it makes no cgroup here).
    pub fn new(dir: &Path) -> Runtime {
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
    pub fn start(&self, m: &VolumeManager, pod: &Pod, container: &str) -> std::process::Child {
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
    pub fn run(&self, m: &VolumeManager, pod: &Pod, container: &str) -> String {
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
pub fn finish(child: std::process::Child) -> Output {
    child.wait_with_output().expect("wait for crun")
}
