//! A minimal node for batch pods, standalone: kubevol mounts the volumes of the pods in a
//! manifest directory, and each pod's containers run to their end with an OCI runtime (crun
//! or runc) on a root filesystem given to it, with the mounts and devices
//! [`VolumeManager::container_mounts`] resolved for each. It prints each container's output,
//! then removes the pods and waits for their volumes to be torn down.
//!
//! What it does not do: pull images (every container runs on the one root filesystem, and
//! needs a `command`), networking (containers share the host's), restarts, probes, resource
//! limits. `./run-demo.sh --containers` runs it on `examples/batch` with a static busybox.
//!
//! Run as root: `cargo run -p kubevol --example batch-node -- MANIFESTS ROOTFS [RUNTIME]`. It
//! enters a private mount namespace first and works on a temporary root, so it leaves nothing
//! behind.

#[path = "oci_runner.rs"]
mod oci_runner;

use std::sync::Arc;

use kubevol::{Config, VolumeManager};
use oci_runner::ContainerRunner;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (manifests, rootfs, runtime) = match args.as_slice() {
        [_, m, r] => (m, r, "crun".to_string()),
        [_, m, r, rt] => (m, r, rt.clone()),
        _ => anyhow::bail!("usage: batch-node MANIFESTS ROOTFS [RUNTIME]"),
    };
    // Demo hygiene only: a real agent mounts in the host's namespace.
    kubevol_mount::ns::enter_private_mount_namespace()?;
    // crun refuses a node whose cgroup controllers are in v1 beside an empty v2 hierarchy; in
    // this namespace of its own it gets a v2 hierarchy (it makes no cgroup here).
    let _ = rustix::mount::mount(
        "cgroup2",
        "/sys/fs/cgroup",
        "cgroup2",
        rustix::mount::MountFlags::empty(),
        None,
    );
    let root = tempfile::tempdir()?;
    let runner = ContainerRunner {
        runtime,
        rootfs: std::fs::canonicalize(rootfs)?,
        state: root.path().join("containers"),
    };
    let manifests = std::path::PathBuf::from(manifests);
    tokio::runtime::Runtime::new()?.block_on(node(root.path(), &manifests, &runner))
}

async fn node(
    root: &std::path::Path,
    manifests: &std::path::Path,
    runner: &ContainerRunner,
) -> anyhow::Result<()> {
    let manager = VolumeManager::new(
        Config::new(root.join("root"), "batch-node"),
        Arc::new(kubevol_mount::LinuxMounter),
    )?;
    let running = tokio::spawn({
        let m = manager.clone();
        async move { m.run().await }
    });
    // The manifests, read as the daemon reads them, handed to the library: an agent that
    // feeds its pods itself can remove them once their containers are done.
    let mut objects = Vec::new();
    for entry in std::fs::read_dir(manifests)? {
        let path = entry?.path();
        if !matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("yaml" | "yml" | "json")
        ) {
            continue;
        }
        let (found, errors) =
            kubevol::source::parse_manifest(&path, &std::fs::read_to_string(&path)?);
        for e in errors {
            println!("{e}");
        }
        objects.extend(found.into_iter().map(|(_, o)| o));
    }
    let pods: Vec<_> = objects
        .iter()
        .filter_map(|o| match o {
            kubevol::store::Object::Pod(p, _) => Some(p.clone()),
            _ => None,
        })
        .collect();
    for problem in manager.library().upsert_objects(objects) {
        println!("{problem}");
    }
    let mut failed = 0;
    for pod in &pods {
        let name = format!(
            "{}/{}",
            pod.metadata.namespace.as_deref().unwrap_or("default"),
            pod.metadata.name.as_deref().unwrap_or_default()
        );
        if let Err(e) = manager.wait_for_attach_and_mount(pod).await {
            println!("pod {name}: volumes not ready, its containers not started: {e}");
            failed += 1;
            continue;
        }
        match runner.run_pod(&manager, pod).await {
            Ok(ran) => {
                for r in ran {
                    let how = if r.success { "succeeded" } else { "failed" };
                    println!("pod {name}, container {} {how}:", r.container);
                    for line in r.output.lines() {
                        println!("  {line}");
                    }
                    failed += usize::from(!r.success);
                }
            }
            Err(e) => {
                println!("pod {name}: {e}");
                failed += 1;
            }
        }
    }
    // The pods are done: their volumes go (in a real node, once the pod is deleted).
    manager.remove_pods(&pods);
    for pod in &pods {
        manager.wait_for_unmount(pod).await?;
    }
    println!("every volume torn down");
    manager.shutdown();
    running.await?;
    anyhow::ensure!(failed == 0, "{failed} container(s) or pod(s) failed");
    Ok(())
}
