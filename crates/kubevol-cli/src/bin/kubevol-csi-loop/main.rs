//! `kubevol-csi-loop`: a CSI driver (Identity, Controller and Node services) whose volumes are
//! sparse files attached to loop devices. It needs root, util-linux and e2fsprogs.

mod driver;
mod faults;
#[path = "../../signal.rs"]
mod signal;
mod sys;

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use kubevol_csi::registration::registration_server::RegistrationServer;
use kubevol_csi::v1::controller_server::ControllerServer;
use kubevol_csi::v1::identity_server::IdentityServer;
use kubevol_csi::v1::node_server::NodeServer;

/// A CSI driver whose volumes are sparse files on loop devices.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Where to serve CSI: unix:///path.sock.
    #[arg(long, required_unless_present = "detach_all")]
    endpoint: Option<String>,
    /// Where volumes (sparse files) are kept.
    #[arg(long)]
    data_dir: PathBuf,
    /// This node's ID (NodeGetInfo; ControllerPublishVolume accepts only this node).
    #[arg(long, required_unless_present = "detach_all")]
    node_id: Option<String>,
    /// The driver's name.
    #[arg(long, default_value = "loop.csi.kubevol.io")]
    driver_name: String,
    /// Register with a node agent: serve the registration API on
    /// DIR/<driver-name>-reg.sock (DIR is the agent's plugins_registry directory).
    #[arg(long, value_name = "DIR")]
    registration_dir: Option<PathBuf>,
    /// The registration socket's file name in --registration-dir, instead of
    /// <driver-name>-reg.sock (two instances of one driver need two names).
    #[arg(long, value_name = "NAME")]
    registration_socket: Option<String>,
    /// The CSI versions offered at registration (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1.0.0")]
    registration_versions: Vec<String>,
    /// Fail the next COUNT calls of METHOD (all, without COUNT) with a gRPC code, e.g.
    /// NodeStageVolume:UNAVAILABLE:2. Repeatable.
    #[arg(long, value_name = "METHOD:CODE[:COUNT]")]
    inject: Vec<faults::Inject>,
    /// Make every call of METHOD take MS milliseconds more (after its work). Repeatable.
    #[arg(long, value_name = "METHOD:MS")]
    delay: Vec<faults::Delay>,
    /// Append one JSON line per call (method, volume_id, path, code) to this file, and one per
    /// stage or publish request (context, mount flags, read-only, secret names).
    #[arg(long)]
    call_log: Option<PathBuf>,
    /// NodeGetInfo reports the number in this file (read at each call) as the most volumes this
    /// node takes (`max_volumes_per_node`); absent, empty or 0: no limit. Lets an operator
    /// change the driver's share of the node's loop devices while it runs.
    #[arg(long, value_name = "FILE")]
    max_volumes_file: Option<PathBuf>,
    /// The controller does not publish volumes (no PUBLISH_UNPUBLISH_VOLUME, as
    /// csi-driver-host-path without --enable-attach): the node attaches a volume's loop device
    /// at NodeStageVolume and detaches it at NodeUnstageVolume.
    #[arg(long)]
    no_controller_publish: bool,
    /// Do not serve: detach the loop devices of every volume under --data-dir and exit. For
    /// cleaning up after a demo or test whose mounts are gone; files are kept.
    #[arg(long)]
    detach_all: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    if args.detach_all {
        return driver::detach_all(&args.data_dir).map_err(anyhow::Error::msg);
    }
    let (Some(endpoint), Some(node_id)) = (args.endpoint.clone(), args.node_id.clone()) else {
        anyhow::bail!("--endpoint and --node-id are required");
    };
    let socket = kubevol_csi::socket_path(&endpoint).map_err(anyhow::Error::msg)?;
    let call_log = args
        .call_log
        .as_ref()
        .map(|p| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
        })
        .transpose()
        .context("cannot open the call log")?;
    let mut driver = driver::Driver::new(
        args.driver_name.clone(),
        node_id.clone(),
        args.data_dir.clone(),
        socket.clone(),
        faults::Faults::new(args.inject, args.delay),
        call_log,
    )
    .with_context(|| format!("cannot use data directory {}", args.data_dir.display()))?;
    driver.registration_versions = args.registration_versions;
    driver.max_volumes_file = args.max_volumes_file;
    driver.controller_publish = !args.no_controller_publish;
    let driver = Arc::new(driver);

    let incoming = kubevol_csi::bind(&socket)
        .with_context(|| format!("cannot listen on {}", socket.display()))?;
    let csi = tonic::transport::Server::builder()
        .add_service(IdentityServer::new(driver::Svc(driver.clone())))
        .add_service(ControllerServer::new(driver::Svc(driver.clone())))
        .add_service(NodeServer::new(driver::Svc(driver.clone())))
        .serve_with_incoming_shutdown(incoming, signal::terminated());
    tracing::info!(driver = %args.driver_name, endpoint = %socket.display(), node = %node_id, "serving CSI");

    let reg_socket = args.registration_dir.as_ref().map(|d| {
        d.join(
            args.registration_socket
                .clone()
                .unwrap_or_else(|| format!("{}-reg.sock", args.driver_name)),
        )
    });
    let registration = async {
        let Some(path) = &reg_socket else {
            return Ok(());
        };
        let incoming = kubevol_csi::bind(path)
            .with_context(|| format!("cannot listen on {}", path.display()))?;
        tracing::info!(socket = %path.display(), "serving plugin registration");
        tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(driver::Svc(driver.clone())))
            .serve_with_incoming_shutdown(incoming, signal::terminated())
            .await
            .context("registration server failed")
    };
    let (a, b) = tokio::join!(
        async { csi.await.context("CSI server failed") },
        registration
    );
    // Going away: the sockets go too, so the node agent deregisters the driver.
    let _ = std::fs::remove_file(&socket);
    if let Some(p) = reg_socket {
        let _ = std::fs::remove_file(p);
    }
    a.and(b)
}
