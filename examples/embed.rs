//! Embedding kubevol in a node agent: add a pod, wait for its volumes before "starting
//! containers", hand the paths to the runtime, then remove the pod and wait for teardown.
//!
//! Run as root: `cargo run -p kubevol --example embed`. It enters a private mount namespace
//! first and works on a temporary root, so it leaves nothing behind.

use std::sync::Arc;

use kubevol::{Config, VolumeManager};

fn main() -> anyhow::Result<()> {
    // Demo hygiene only: a real agent mounts in the host's namespace.
    kubevol_mount::ns::enter_private_mount_namespace()?;
    let root = tempfile::tempdir()?;
    tokio::runtime::Runtime::new()?.block_on(agent(root.path()))
}

async fn agent(root: &std::path::Path) -> anyhow::Result<()> {
    let manager = VolumeManager::new(
        Config::new(root, "node-1"),
        Arc::new(kubevol_mount::LinuxMounter),
    )?;
    let running = tokio::spawn({
        let m = manager.clone();
        async move { m.run().await }
    });

    let pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "api", "namespace": "shop"},
        "spec": {
            "containers": [{"name": "api", "image": "shop/api:1",
                "volumeMounts": [{"name": "sessions", "mountPath": "/sessions"}, {"name": "tz", "mountPath": "/etc/localtime", "readOnly": true}]}],
            "volumes": [
                {"name": "sessions", "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}},
                {"name": "tz", "hostPath": {"path": "/etc/localtime"}}
            ]
        }
    }))?;
    let uid = manager.add_pod(pod);
    let pod = manager
        .store()
        .pod(&uid)
        .map(|p| (*p.pod).clone())
        .expect("just added");
    manager.wait_for_attach_and_mount(&pod).await?;
    println!("pod shop/api ({uid}) is ready to start; volumes for the runtime:");
    for (name, v) in manager.mounted_volumes_for_pod(&uid) {
        println!(
            "  {name:9} {} {}",
            v.path.display(),
            if v.read_only { "(ro)" } else { "" }
        );
    }

    manager.remove_pod(&pod);
    manager.wait_for_unmount(&pod).await?;
    println!(
        "pod removed; volumes torn down: {}",
        !manager.has_possibly_mounted_volumes(&uid)
    );
    manager.shutdown();
    running.await?;
    Ok(())
}
