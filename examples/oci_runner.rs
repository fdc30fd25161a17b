//! Runs a pod's containers with an OCI runtime (crun or runc) on a root filesystem the agent
//! already has, with the mounts and devices kubevol resolved for each container: the step a
//! node agent takes once [`VolumeManager::wait_for_attach_and_mount`] has returned. Each
//! container gets an overlay of the root filesystem to write into (its mount points among
//! what it writes), so that containers run side by side on one root. Init
//! containers run one after another, then the containers together; each runs to its end (a
//! batch pod). Shared by the examples that run containers.

use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Pod;
use kubevol::VolumeManager;

/// An OCI runtime and the root filesystem every container runs on.
pub struct ContainerRunner {
    /// The runtime's binary (`crun`, `runc`).
    pub runtime: String,
    /// The root filesystem (e.g. a static busybox as `bin/sh`).
    pub rootfs: PathBuf,
    /// Where the runtime keeps its state and the bundles are written.
    pub state: PathBuf,
}

/// How one container ended.
#[derive(Debug)]
pub struct Ran {
    /// The container.
    pub container: String,
    /// Whether it exited with 0.
    pub success: bool,
    /// Its output, stdout then stderr.
    pub output: String,
}

impl ContainerRunner {
    /// Runs the pod's init containers in order (stopping at the first that fails), then its
    /// containers together, and returns how each ended.
    pub async fn run_pod(&self, m: &VolumeManager, pod: &Pod) -> anyhow::Result<Vec<Ran>> {
        let spec = pod.spec.clone().unwrap_or_default();
        let mut ran = Vec::new();
        for c in spec.init_containers.iter().flatten() {
            let r = self.run(m, pod, &c.name).await?;
            let failed = !r.success;
            ran.push(r);
            if failed {
                return Ok(ran);
            }
        }
        let all = spec.containers.iter().map(|c| self.run(m, pod, &c.name));
        for r in futures_util::future::join_all(all).await {
            ran.push(r?);
        }
        Ok(ran)
    }

    /// Runs one container to its end.
    async fn run(&self, m: &VolumeManager, pod: &Pod, container: &str) -> anyhow::Result<Ran> {
        let mounts = m.container_mounts(pod, container)?;
        let groups = m.extra_supplemental_groups_for_pod(pod);
        let uid = kubevol::pod_uid(pod);
        let id = format!("{uid}-{container}");
        let bundle = self.state.join("bundles").join(&id);
        let rootfs = bundle.join("rootfs");
        for dir in ["upper", "work", "rootfs"] {
            std::fs::create_dir_all(bundle.join(dir))?;
        }
        // Each container writes into a root of its own (the runtime makes its mount points
        // there): an overlay of the shared root filesystem, as a runtime's snapshots are.
        let layers = [&self.rootfs, &bundle.join("upper"), &bundle.join("work")];
        if layers
            .iter()
            .any(|p| p.to_string_lossy().contains([',', ':']))
        {
            anyhow::bail!(
                "the root filesystem and state paths may not hold ',' or ':' (overlay options)"
            );
        }
        let options = format!(
            "lowerdir={},upperdir={},workdir={}",
            layers[0].display(),
            layers[1].display(),
            layers[2].display()
        );
        let data = std::ffi::CString::new(options)?;
        let flags = rustix::mount::MountFlags::empty();
        rustix::mount::mount("overlay", &rootfs, "overlay", flags, Some(data.as_c_str())).map_err(
            |e| {
                anyhow::anyhow!(
                    "cannot mount the container's root at {}: {e}",
                    rootfs.display()
                )
            },
        )?;
        let config = kubevol::containers::oci::oci_config(pod, &mounts, &groups, &rootfs)
            .map_err(anyhow::Error::msg)?;
        std::fs::write(
            bundle.join("config.json"),
            serde_json::to_vec_pretty(&config)?,
        )?;
        let mut cmd = std::process::Command::new(&self.runtime);
        cmd.arg("--root")
            .arg(self.state.join("runtime"))
            .args(cgroup_manager(&self.runtime))
            .args(["run", "--bundle"])
            .arg(&bundle)
            .arg(&id)
            .stdin(std::process::Stdio::null());
        let runtime = self.runtime.clone();
        let out = tokio::task::spawn_blocking(move || cmd.output())
            .await?
            .map_err(|e| anyhow::anyhow!("cannot run {runtime}: {e}"))?;
        let _ = rustix::mount::unmount(&rootfs, rustix::mount::UnmountFlags::DETACH);
        let _ = std::fs::remove_dir_all(&bundle);
        let mut output = String::from_utf8_lossy(&out.stdout).into_owned();
        output.push_str(&String::from_utf8_lossy(&out.stderr));
        Ok(Ran {
            container: container.into(),
            success: out.status.success(),
            output,
        })
    }
}

/// crun makes no cgroup for the container when told so (resources are a full runtime's).
fn cgroup_manager(runtime: &str) -> &'static [&'static str] {
    match Path::new(runtime).file_name().and_then(|n| n.to_str()) {
        Some("crun") => &["--cgroup-manager=disabled"],
        _ => &[],
    }
}
