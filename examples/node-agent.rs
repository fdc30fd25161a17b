//! A node agent of a Kubernetes cluster with kubevol as its volume manager: the kubelet's
//! syncPod gate for volumes.
//!
//! It watches the pods bound to its node, and for each one:
//! - waits until its volumes are mounted ([`VolumeManager::wait_for_attach_and_mount`]) before
//!   it would start the pod's containers, and records the outcome on the pod's status as a
//!   condition of its own type, `kubevol.io/VolumesReady` (`True` with reason
//!   `VolumesMounted`, or `False` with reason `VolumesNotReady` and what is missing), retrying
//!   until the volumes are ready or the pod goes;
//! - when the pod is being deleted, would kill its containers, waits until its volumes are
//!   torn down ([`VolumeManager::wait_for_unmount`]), then deletes the pod for good (a
//!   grace period of 0), as the kubelet does once a pod is gone from its node.
//!
//! With `--run-containers ROOTFS` it is a working minimal node for batch pods: once a pod's
//! volumes are ready it runs the pod's containers to their end with crun on ROOTFS (every
//! container on that one root filesystem, with the mounts [`VolumeManager::container_mounts`]
//! resolved; see `examples/oci_runner.rs`), prints their output and sets the pod's phase to
//! `Succeeded` or `Failed`. It pulls no image and restarts nothing.
//!
//! kubevol itself reads the pods and the objects they reference, issues their service account
//! tokens, reports the node's volumes in use, waits for the attach/detach controller, keeps
//! CSINode and posts events; the agent only gates.
//!
//! Run as root on a node: `cargo run -p kubevol --example node-agent -- KUBECONFIG NODE ROOT
//! [--run-containers ROOTFS]` (ROOT is the kubelet root directory, e.g. `/var/lib/kubelet`).

#[path = "oci_runner.rs"]
mod oci_runner;

use std::collections::HashMap;
use std::sync::Arc;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::runtime::watcher::{self, watcher, Event};
use kube::runtime::WatchStreamExt;
use kubevol::source::cluster::{
    ClusterTokens, ControllerAttach, CsiNodePublisher, EventPoster, NodeStatusReporter,
};
use kubevol::source::ClusterSource;
use kubevol::{Config, VolumeManager};
use tokio::task::JoinHandle;

pub use oci_runner::ContainerRunner;

/// The pod condition the agent sets.
pub const CONDITION: &str = "kubevol.io/VolumesReady";

#[allow(dead_code)]
fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (kubeconfig, node, root, rootfs) = match args.as_slice() {
        [_, k, n, r] => (k, n, r, None),
        [_, k, n, r, flag, rootfs] if flag == "--run-containers" => (k, n, r, Some(rootfs)),
        _ => anyhow::bail!("usage: node-agent KUBECONFIG NODE ROOT [--run-containers ROOTFS]"),
    };
    let runner = rootfs.map(|rootfs| {
        Arc::new(ContainerRunner {
            runtime: "crun".into(),
            rootfs: rootfs.into(),
            state: std::path::Path::new(root).join("kubevol-containers"),
        })
    });
    tokio::runtime::Runtime::new()?.block_on(async {
        let file = kube::config::Kubeconfig::read_from(kubeconfig)?;
        let config = kube::Config::from_custom_kubeconfig(file, &Default::default()).await?;
        let client = kubevol::source::cluster::client(config)?;
        run_with(client, Config::new(root, node.as_str()), runner).await
    })
}

/// Runs the agent with `client` (the node's identity) until the pod watch ends.
#[allow(dead_code)]
pub async fn run(client: kube::Client, config: Config) -> anyhow::Result<()> {
    run_with(client, config, None).await
}

/// [`run`], running each pod's containers with `runner` once its volumes are ready.
pub async fn run_with(
    client: kube::Client,
    config: Config,
    runner: Option<Arc<ContainerRunner>>,
) -> anyhow::Result<()> {
    let node = config.node_name.clone();
    let manager = VolumeManager::new(config, Arc::new(kubevol_mount::LinuxMounter))?;
    manager.set_token_issuer(Arc::new(ClusterTokens::new(client.clone())));
    manager.set_attach_controller(Arc::new(ControllerAttach::new(
        client.clone(),
        node.clone(),
        manager.node_drivers(),
    )));
    manager.set_event_sink(EventPoster::spawn(client.clone(), node.clone()).0);
    let _reporter =
        NodeStatusReporter::spawn(client.clone(), node.clone(), Arc::new(manager.clone()));
    let _csinode = CsiNodePublisher::spawn(client.clone(), node.clone(), manager.node_drivers());
    let _source = manager.add_source(ClusterSource::new(client.clone(), node.clone()));
    let _running = tokio::spawn({
        let m = manager.clone();
        async move { m.run().await }
    });

    // The agent's own view of its pods: what it would start and stop.
    let pods: Api<Pod> = Api::all(client.clone());
    let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
    let mut events = watcher(pods, config).default_backoff().boxed();
    let mut gates: HashMap<String, JoinHandle<()>> = HashMap::new();
    while let Some(event) = events.next().await {
        let pod = match event {
            Ok(Event::Apply(p) | Event::InitApply(p)) => p,
            Ok(_) => continue,
            Err(e) => {
                eprintln!("node-agent: watching pods: {e}");
                continue;
            }
        };
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        // A pod that has ended is not started again: its own last status patch comes back as
        // an event, after its start has finished (a started pod keeps its gate until deleted).
        let ended = pod
            .status
            .as_ref()
            .and_then(|s| s.phase.as_deref())
            .is_some_and(|p| p == "Succeeded" || p == "Failed");
        if pod.metadata.deletion_timestamp.is_some() {
            if let Some(g) = gates.remove(&uid) {
                g.abort();
            }
            // Its containers would be killed here; then its volumes go, then the pod.
            tokio::spawn(finish(client.clone(), manager.clone(), pod));
        } else if ended {
            continue;
        } else if let std::collections::hash_map::Entry::Vacant(gate) = gates.entry(uid) {
            let runner = runner.clone();
            gate.insert(tokio::spawn(start(
                client.clone(),
                manager.clone(),
                pod,
                runner,
            )));
        }
    }
    Ok(())
}

/// Waits for the pod's volumes, recording each outcome on the pod, until they are ready; then
/// runs its containers with `runner`, if any.
async fn start(
    client: kube::Client,
    manager: VolumeManager,
    pod: Pod,
    runner: Option<Arc<ContainerRunner>>,
) {
    loop {
        let (ready, reason, message) = match manager.wait_for_attach_and_mount(&pod).await {
            Ok(()) => (
                true,
                "VolumesMounted",
                "every volume of the pod is mounted".to_string(),
            ),
            Err(e) => (false, "VolumesNotReady", e.to_string()),
        };
        // The containers would be started here once `ready`.
        if let Err(e) = set_condition(&client, &pod, ready, reason, &message).await {
            eprintln!("node-agent: cannot record the volumes' state on the pod: {e}");
        }
        if ready {
            break;
        }
    }
    let Some(runner) = runner else { return };
    let name = pod.metadata.name.clone().unwrap_or_default();
    let (phase, message) = match runner.run_pod(&manager, &pod).await {
        Ok(ran) => {
            for r in &ran {
                println!(
                    "node-agent: pod {name}, container {} (success: {}):\n{}",
                    r.container, r.success, r.output
                );
            }
            match ran.iter().find(|r| !r.success) {
                None => ("Succeeded", "every container exited with 0".to_string()),
                Some(r) => (
                    "Failed",
                    format!("container {} failed: {}", r.container, r.output.trim()),
                ),
            }
        }
        Err(e) => ("Failed", format!("the containers could not be run: {e}")),
    };
    if let Err(e) = set_phase(&client, &pod, phase, &message).await {
        eprintln!("node-agent: cannot record pod {name} as {phase}: {e}");
    }
}

/// Sets the pod's phase once its containers have ended (a batch pod's last status).
async fn set_phase(
    client: &kube::Client,
    pod: &Pod,
    phase: &str,
    message: &str,
) -> Result<(), kube::Error> {
    let status = serde_json::json!({"phase": phase, "message": message});
    patch_status(client, pod, status).await
}

/// Patches the pod's status with `status` (a strategic merge patch: what it does not name
/// stays).
async fn patch_status(
    client: &kube::Client,
    pod: &Pod,
    status: serde_json::Value,
) -> Result<(), kube::Error> {
    let ns = pod.metadata.namespace.as_deref().unwrap_or("default");
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let patch = serde_json::json!({ "status": status });
    pods.patch_status(
        pod.metadata.name.as_deref().unwrap_or_default(),
        &PatchParams::default(),
        &Patch::Strategic(&patch),
    )
    .await
    .map(|_| ())
}

/// Waits until the pod's volumes are torn down, then deletes the pod for good.
async fn finish(client: kube::Client, manager: VolumeManager, pod: Pod) {
    if let Err(e) = manager.wait_for_unmount(&pod).await {
        eprintln!("node-agent: volumes of a deleted pod are still mounted: {e}");
        return;
    }
    let (ns, name) = (
        pod.metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into()),
        pod.metadata.name.clone().unwrap_or_default(),
    );
    let pods: Api<Pod> = Api::namespaced(client, &ns);
    let mut params = DeleteParams::default().grace_period(0);
    // Only this incarnation of the pod.
    params.preconditions = Some(kube::api::Preconditions {
        uid: pod.metadata.uid.clone(),
        resource_version: None,
    });
    if let Err(e) = pods.delete(&name, &params).await {
        eprintln!("node-agent: cannot delete pod {ns}/{name}: {e}");
    }
}

/// Sets the pod's `kubevol.io/VolumesReady` condition (a strategic merge patch of its status:
/// the other conditions stay).
async fn set_condition(
    client: &kube::Client,
    pod: &Pod,
    ready: bool,
    reason: &str,
    message: &str,
) -> Result<(), kube::Error> {
    let condition = serde_json::json!({
        "type": CONDITION,
        "status": if ready { "True" } else { "False" },
        "reason": reason,
        "message": message,
        "lastTransitionTime": k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now()),
    });
    patch_status(
        client,
        pod,
        serde_json::json!({ "conditions": [condition] }),
    )
    .await
}
