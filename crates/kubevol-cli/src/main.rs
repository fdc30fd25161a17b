//! The `kubevol` command: the standalone daemon (`run`), its status client (`status`) and the
//! benchmark (`bench`).

mod bench;
mod client;
mod describe;
mod logs;
mod parse;
use parse::{parse_duration, parse_endpoint, parse_labels, parse_size};
mod signal;
mod table;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use kubevol::source::ManifestSource;
use kubevol::status::{PodPhase, StatusReport};
use kubevol::{Config, VolumeManager};
use kubevol_core::backoff::BackoffPolicy;

/// kubevol: the Kubernetes node volume manager. It mounts what the pods assigned to a node
/// need (emptyDir, hostPath, configMap, secret, downwardAPI, projected, local, CSI) and keeps
/// the node's mounts matching them, from a directory of Kubernetes manifests or a cluster's API
/// server.
#[derive(Parser)]
#[command(name = "kubevol", version, about, long_about)]
struct Cli {
    /// Log format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Mount what the pods in a manifest directory need, and keep it so.
    Run(Box<RunArgs>),
    /// Show the pods and volumes of a running daemon (`kubevol run`, whose --listen address
    /// --server names).
    Status(StatusArgs),
    /// Explain a pod's volumes step by step (what each depends on, what it is stuck on and
    /// what to do), or summarize the node: asks a running daemon (`kubevol run`, whose --listen
    /// address --server names).
    Describe(DescribeArgs),
    /// Show what a container of a pod gets of its volumes (the mounts and devices to hand the
    /// container runtime), asking a running daemon.
    Mounts(MountsArgs),
    /// Measure pod volume-ready latency and throughput against the raw mount syscalls.
    Bench(bench::BenchArgs),
}

#[derive(clap::Args)]
struct RunArgs {
    /// Directory of Kubernetes YAML/JSON manifests (Pod, ConfigMap, Secret, PV, PVC, CSIDriver).
    /// With --kubeconfig or --cluster too: static pods beside the API server's.
    #[arg(long, required_unless_present_any = ["kubeconfig", "cluster"])]
    manifests: Option<PathBuf>,
    /// Run as a node of a Kubernetes cluster: pods bound to --node-name, and the objects they
    /// reference, from the API server this kubeconfig names (the node's own identity).
    #[arg(long, value_name = "PATH")]
    kubeconfig: Option<PathBuf>,
    /// Like --kubeconfig, with the configuration found as kubectl finds it: $KUBECONFIG,
    /// ~/.kube/config, or the in-cluster service account.
    #[arg(long, conflicts_with = "kubeconfig")]
    cluster: bool,
    /// With --kubeconfig or --cluster: create this node's Node object if it does not exist
    /// (with its name and no other fields; whoever runs the node normally creates it).
    #[arg(long)]
    register_node: bool,
    /// Root directory for pod volumes (`--root-dir /var/lib/kubelet` makes kubevol a drop-in).
    #[arg(long, default_value = "/var/lib/kubevol")]
    root_dir: PathBuf,
    /// This node's name; pods whose spec.nodeName names another node are ignored.
    #[arg(long, default_value_t = hostname())]
    node_name: String,
    /// Address of the HTTP server (health, metrics, status API). Not served with --once.
    #[arg(long, default_value = "127.0.0.1:10258")]
    listen: SocketAddr,
    /// Mount what the manifests ask for, print a table and exit (0 only if every pod is ready).
    #[arg(long)]
    once: bool,
    /// With --once: how long failing volumes are retried (with the normal backoff) before the
    /// table is printed; a pod that failed for good (invalid, unsupported volume) ends the wait
    /// for itself at once.
    #[arg(long, default_value = "123s", value_parser = parse_duration)]
    timeout: Duration,
    /// This node's labels, which PersistentVolumes' nodeAffinity is checked against:
    /// KEY=VALUE[,KEY=VALUE...] (repeatable). kubernetes.io/hostname (the node name),
    /// kubernetes.io/os and kubernetes.io/arch are set unless given here.
    #[arg(long = "node-labels", value_name = "KEY=VALUE,...", value_parser = parse_labels)]
    node_labels: Vec<Vec<(String, String)>>,
    /// Host path prefix pods may use, for hostPath volumes and local PersistentVolumes
    /// (repeatable); without any, every host path is allowed.
    #[arg(long = "host-path-allow")]
    host_path_allow: Vec<PathBuf>,
    /// Where the built-in kubevol.io/local-path provisioner makes the directories of the
    /// volumes it provisions for claims (standalone mode) [default: <root-dir>/local-path].
    #[arg(long = "local-path-dir")]
    local_path_dir: Option<PathBuf>,
    /// Delay after an operation's first failure.
    #[arg(long, default_value = "500ms", value_parser = parse_duration)]
    backoff_initial: Duration,
    /// Longest delay between retries of a failing operation.
    #[arg(long, default_value = "122s", value_parser = parse_duration)]
    backoff_max: Duration,
    /// Safety-net resync of the reconciler (it is otherwise driven by events).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    resync_period: Duration,
    /// A CSI node plugin started without a registrar: NAME=unix:///path.sock (repeatable).
    /// Drivers with a registration socket in <root-dir>/plugins_registry need no flag.
    #[arg(long = "csi-driver", value_name = "NAME=ENDPOINT", value_parser = parse_endpoint)]
    csi_drivers: Vec<(String, PathBuf)>,
    /// A CSI controller service for attach and detach: NAME=unix:///path.sock (repeatable).
    #[arg(long = "csi-controller", value_name = "NAME=ENDPOINT", value_parser = parse_endpoint)]
    csi_controllers: Vec<(String, PathBuf)>,
    /// How long one CSI call may take before it counts as DeadlineExceeded.
    #[arg(long, default_value = "2m", value_parser = parse_duration)]
    csi_timeout: Duration,
    /// How often volume usage (kubelet_volume_stats_*, emptyDir usage) is gathered.
    #[arg(long, default_value = "1m", value_parser = parse_duration)]
    volume_stats_period: Duration,
    /// Never give a disk-backed emptyDir a project of its own: its usage is walked even where
    /// the filesystem accounts project quotas.
    #[arg(long)]
    no_project_quotas: bool,
    /// How long one operation may run before its pod shows it as stalled (a hung filesystem
    /// or driver) and other operations take its slot.
    #[arg(long, default_value = "2m", value_parser = parse_duration)]
    operation_timeout: Duration,
    /// Detach a busy mount lazily (umount MNT_DETACH) instead of retrying until it is free.
    #[arg(long)]
    allow_lazy_unmount: bool,
    /// Take pod directories under --root-dir that kubevol never recorded (a kubelet's, another
    /// tool's, or left by a lost record) as kubevol's own: their volumes are torn down when no
    /// pod wants them, and their directories removed. Without it they are reported in the
    /// status and the log, and left alone.
    #[arg(long)]
    adopt_foreign_pods: bool,
    /// The SELinuxMount feature (GA and on by default in Kubernetes 1.37): volumes of every
    /// access mode whose CSIDriver says seLinuxMount are mounted with the pods' SELinux label,
    /// not only ReadWriteOncePod ones. `--selinux-mount=false` turns it off.
    #[arg(long, default_value_t = true, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    selinux_mount: bool,
    /// Whether the node has SELinux: `detect` (/sys/fs/selinux), `disabled`, or the containers'
    /// default file context to assume (`system_u:object_r:container_file_t:s0`).
    #[arg(long, default_value = "detect", value_name = "detect|disabled|CONTEXT")]
    selinux: String,
    /// The largest manifest file read (bytes, or with a Ki, Mi or Gi suffix); a bigger file is
    /// reported as an error of that file and not read.
    #[arg(long, default_value = "8Mi", value_parser = parse_size)]
    max_manifest_size: u64,
    /// Follow the manifest files' symbolic links wherever they lead. Without it a link is
    /// followed only while it stays beneath the manifest directory (kubevol reads as root: a
    /// link written by one of the directory's writers must not read what that writer may not);
    /// give it only if every writer of the directory may read whatever its links lead to.
    #[arg(long)]
    manifests_follow_links: bool,
}

#[derive(clap::Args)]
struct StatusArgs {
    /// The daemon's HTTP address.
    #[arg(long, default_value = "http://127.0.0.1:10258")]
    server: String,
    /// Output format: the table, the table with events, or the raw JSON.
    #[arg(short = 'o', long = "output", value_enum)]
    output: Option<Output>,
}

#[derive(clap::Args)]
struct DescribeArgs {
    /// What to describe.
    #[command(subcommand)]
    what: Describe,
    /// The daemon's HTTP address.
    #[arg(long, global = true, default_value = "http://127.0.0.1:10258")]
    server: String,
    /// Print the raw JSON instead of the text.
    #[arg(short = 'o', long = "output", global = true, value_enum)]
    output: Option<DescribeOutput>,
}

#[derive(clap::Args)]
struct MountsArgs {
    /// NAMESPACE/NAME (NAME alone means the default namespace).
    pod: String,
    /// The container.
    #[arg(short = 'c', long = "container")]
    container: String,
    /// The daemon's HTTP address.
    #[arg(long, default_value = "http://127.0.0.1:10258")]
    server: String,
    /// A table by default; kubevol's JSON, the CRI form or the OCI form.
    #[arg(short = 'o', long = "output", value_enum)]
    output: Option<MountsOutput>,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum MountsOutput {
    Json,
    Cri,
    Oci,
}

#[derive(Subcommand)]
enum Describe {
    /// A pod: NAMESPACE/NAME, or its UID.
    Pod {
        /// NAMESPACE/NAME (NAME alone means the default namespace) or UID.
        pod: String,
    },
    /// The node: sources, drivers, counts per state, what is not ready and why.
    Node,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum DescribeOutput {
    Json,
}

#[derive(Clone, Copy, ValueEnum, PartialEq, Eq)]
enum Output {
    Wide,
    Json,
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_lowercase())
        .unwrap_or_else(|_| "localhost".into())
}

/// Sets up logging to stderr through [`logs::LogWriter`] (never blocking, never panicking),
/// with colour only on a terminal. The returned guard lets the last lines out at exit.
fn init_logs(format: LogFormat, default_level: &str) -> logs::Flush {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        // kube's client and watcher log each failed request themselves, several times a second per
        // watch while the server is away; kubevol says once per retry what failed and when it
        // tries again.
        .unwrap_or_else(|_| {
            tracing_subscriber::EnvFilter::new(format!(
                "{default_level},kube_client=off,kube_runtime::watcher=off"
            ))
        });
    let (writer, flush) = logs::LogWriter::new(std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .log_internal_errors(false)
        .with_writer(writer);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
    flush
}

/// Writes a message to stderr; a closed or full stderr loses it rather than panicking.
fn say(message: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{message}");
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::Bench(args) = &cli.command {
        // Before any thread exists: the benchmark mounts only in its own namespace.
        if let Err(e) = kubevol_mount::ns::enter_private_mount_namespace() {
            say(format_args!(
                "kubevol bench: {e} (the benchmark mounts for real and must run as root)"
            ));
            return ExitCode::FAILURE;
        }
        let _flush = init_logs(cli.log_format, "warn");
        return report(bench::run(args));
    }
    let _flush = init_logs(cli.log_format, "info");
    raise_open_files_limit();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            say(format_args!("kubevol: cannot start the runtime: {e}"));
            return ExitCode::FAILURE;
        }
    };
    let result = match cli.command {
        Command::Run(args) => runtime.block_on(run(*args)),
        Command::Status(args) => status(args),
        Command::Describe(args) => describe(args),
        Command::Mounts(args) => mounts(args),
        Command::Bench(_) => unreachable!("handled above"),
    };
    // A blocking thread stuck in a hung filesystem or a FIFO must not hold the exit: mounts
    // stay in place whatever it is doing.
    runtime.shutdown_timeout(STOP_GRACE);
    report(result)
}

/// Raises the soft limit of open files to the hard one, as the kubelet's systemd unit and
/// client-go's node agents run: a node holds a watch or a connection per referenced object, a
/// descriptor per pod directory it works in and per CSI socket, and the usual soft limit of
/// 1,024 made every request fail with EMFILE at a few hundred pods.
fn raise_open_files_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current < limit.maximum {
        let was = limit.current;
        limit.current = limit.maximum;
        match setrlimit(Resource::Nofile, limit) {
            Ok(()) => tracing::debug!(
                "open files limit raised from {was:?} to {:?}",
                limit.maximum
            ),
            Err(e) => tracing::warn!(
                "cannot raise the open files limit from {was:?}: {e}; many pods may exhaust it"
            ),
        }
    }
}

/// How long a stop waits for the manager's loops and blocking threads before it exits anyway.
const STOP_GRACE: Duration = Duration::from_secs(3);

fn report(result: anyhow::Result<ExitCode>) -> ExitCode {
    match result {
        Ok(code) => code,
        // The reader went away (`kubevol status | head -3`): nothing more to say to anyone.
        Err(e)
            if e.chain().any(|c| {
                c.downcast_ref::<std::io::Error>()
                    .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            }) =>
        {
            ExitCode::SUCCESS
        }
        Err(e) => {
            say(format_args!("kubevol: {e:#}"));
            ExitCode::FAILURE
        }
    }
}

async fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    let mut config = Config::new(&args.root_dir, args.node_name.clone());
    config.backoff = BackoffPolicy {
        initial: args.backoff_initial,
        max: args.backoff_max,
    };
    config.resync_period = args.resync_period;
    config.host_path_allow = args.host_path_allow.clone();
    config.local_path_dir = args.local_path_dir.clone();
    config.node_labels = args.node_labels.iter().flatten().cloned().collect();
    config.csi_drivers = args.csi_drivers.clone();
    config.csi_controllers = args.csi_controllers.clone();
    config.csi_timeout = args.csi_timeout;
    config.volume_stats_period = args.volume_stats_period;
    config.project_quotas = !args.no_project_quotas;
    config.operation_timeout = args.operation_timeout;
    config.allow_lazy_unmount = args.allow_lazy_unmount;
    config.adopt_foreign_pods = args.adopt_foreign_pods;
    config.selinux_mount = args.selinux_mount;
    config.selinux = match args.selinux.as_str() {
        "detect" => kubevol::Selinux::Detect,
        "disabled" => kubevol::Selinux::Disabled,
        context if context.splitn(4, ':').count() == 4 => kubevol::Selinux::Enabled {
            file_context: context.to_string(),
        },
        other => anyhow::bail!(
            "--selinux {other:?}: give detect, disabled, or a file context user:role:type:level (system_u:object_r:container_file_t:s0)"
        ),
    };
    let manager = match VolumeManager::new(config, Arc::new(kubevol_mount::LinuxMounter)) {
        Ok(m) => m,
        // It names the root, the lock and its holder.
        Err(e) if e.kind() == std::io::ErrorKind::ResourceBusy => return Err(e.into()),
        Err(e) => Err(e)
            .with_context(|| format!("cannot use root directory {}", args.root_dir.display()))?,
    };
    // The daemon gives no pod through the library: a pod an embedder gave before, on this
    // root, waits for no one.
    manager.library().synced();
    let mut sources = Vec::new();
    if let Some(client) = cluster_client(&args).await? {
        // Until the API server has listed this node's pods, nothing is torn down; while it
        // cannot be reached, the status says so.
        if args.register_node {
            register_node(&client, &args.node_name).await;
        }
        anyhow::ensure!(
            args.csi_controllers.is_empty(),
            "--csi-controller cannot be used with --kubeconfig or --cluster: in a cluster the attach/detach controller attaches volumes"
        );
        sources.extend(kubevol::source::cluster::join(&manager, client));
    }
    if let Some(dir) = &args.manifests {
        let source = ManifestSource::new(dir)
            .with_max_file_size(args.max_manifest_size)
            .with_links_followed(args.manifests_follow_links);
        sources.push(if args.once {
            // Once: a directory that cannot be read is an error now.
            let sink = manager.store().sink(ManifestSource::NAME);
            source
                .listen(sink)
                .await
                .with_context(|| format!("cannot read manifest directory {}", dir.display()))?
        } else {
            // The daemon keeps running while the directory is missing or unreadable: until it
            // is listed, the source is not synced and nothing is torn down.
            manager.add_source(source)
        });
    }
    let running = tokio::spawn({
        let m = manager.clone();
        async move { m.run().await }
    });
    tracing::info!(root = %manager.config().root_dir.display(), node = %manager.config().node_name, "kubevol started");

    let code = if args.once {
        let (report, timed_out) = settle(&manager, args.timeout).await;
        print_once(&report, timed_out, args.timeout, &mut std::io::stdout())?;
        let all_ready = report.manifest_errors.is_empty()
            && report.pods.iter().all(|p| p.phase == PodPhase::Ready);
        if all_ready {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }
    } else {
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("cannot listen on {}", args.listen))?;
        tracing::info!(address = %args.listen, "serving /healthz, /readyz, /metrics, /api/v1/pods, /api/v1/events");
        let server = tokio::spawn(kubevol::http::serve(
            listener,
            manager.clone(),
            signal::terminated(),
        ));
        signal::terminated().await;
        tracing::info!("stopping; mounts stay in place");
        let _ = server.await;
        ExitCode::SUCCESS
    };
    manager.shutdown();
    for s in sources {
        s.abort();
    }
    if tokio::time::timeout(STOP_GRACE, running).await.is_err() {
        tracing::warn!("the manager did not stop within {STOP_GRACE:?} (an operation is blocked in the kernel or a driver); exiting anyway, mounts stay in place");
    }
    Ok(code)
}

/// Creates the Node object named `name` if it does not exist. A failure is logged: the node's
/// CSI volumes wait (their report needs the Node) and everything else goes on.
async fn register_node(client: &kube::Client, name: &str) {
    use k8s_openapi::api::core::v1::Node;
    let nodes: kube::Api<Node> = kube::Api::all(client.clone());
    let node = Node {
        metadata: kube::api::ObjectMeta {
            name: Some(name.to_string()),
            ..Default::default()
        },
        ..Default::default()
    };
    match nodes.create(&Default::default(), &node).await {
        Ok(_) => tracing::info!(node = name, "Node object created"),
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => tracing::warn!(node = name, "cannot create the Node object: {e}"),
    }
}

/// The API server's client, when kubevol runs as a node of a cluster (`--kubeconfig`,
/// `--cluster`).
async fn cluster_client(args: &RunArgs) -> anyhow::Result<Option<kube::Client>> {
    let config = if let Some(path) = &args.kubeconfig {
        let file = kube::config::Kubeconfig::read_from(path)
            .with_context(|| format!("cannot read kubeconfig {}", path.display()))?;
        kube::Config::from_custom_kubeconfig(file, &Default::default())
            .await
            .with_context(|| format!("kubeconfig {}", path.display()))?
    } else if args.cluster {
        kube::Config::infer()
            .await
            .context("no cluster configuration found ($KUBECONFIG, ~/.kube/config or the in-cluster service account)")?
    } else {
        return Ok(None);
    };
    let server = config.cluster_url.clone();
    let client = kubevol::source::cluster::client(config)
        .with_context(|| format!("cannot make a client of the API server {server}"))?;
    Ok(Some(client))
}

/// Whether a pod's volumes can never become ready without a change to its manifests: it is
/// invalid, held (its file has errors), or a volume cannot be processed (an unsupported type, a source that needs an API
/// server, a claim that is missing or unbound, a volume of other nodes). Other failures are
/// retried with backoff.
fn failed_for_good(p: &kubevol::status::PodStatus) -> bool {
    matches!(p.phase, PodPhase::Rejected | PodPhase::Held)
        || p.volumes
            .iter()
            .any(|v| v.not_processed() || v.retry.permanent)
}

/// Waits, as failing volumes are retried with the normal backoff, until every pod is ready or
/// has failed for good, or `timeout` has passed. Returns the last report and whether it timed
/// out.
async fn settle(manager: &VolumeManager, timeout: Duration) -> (StatusReport, bool) {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut changes = manager.subscribe();
    loop {
        changes.borrow_and_update();
        let report = manager.status(false);
        let settled = report.states_synced
            && report
                .pods
                .iter()
                .all(|p| p.phase == PodPhase::Ready || failed_for_good(p));
        if settled {
            return (report, false);
        }
        if tokio::time::timeout_at(deadline, changes.changed())
            .await
            .is_err()
        {
            return (report, true);
        }
    }
}

/// Prints the final report of `--once`: the table (without retry times: nothing is retried
/// after it), then which pods failed for good and which were still retried when time ran out.
fn print_once(
    report: &StatusReport,
    timed_out: bool,
    timeout: Duration,
    out: &mut impl std::io::Write,
) -> std::io::Result<()> {
    let mut report = report.clone();
    for v in report.pods.iter_mut().flat_map(|p| p.volumes.iter_mut()) {
        v.retry.next_retry_ms = None;
    }
    table::print_report(&report, false, out)?;
    let name = |p: &kubevol::status::PodStatus| format!("{}/{}", p.namespace, p.name);
    let for_good: Vec<String> = report
        .pods
        .iter()
        .filter(|p| failed_for_good(p))
        .map(name)
        .collect();
    let waiting: Vec<String> = report
        .pods
        .iter()
        .filter(|p| p.phase != PodPhase::Ready && !failed_for_good(p))
        .map(name)
        .collect();
    if !for_good.is_empty() {
        writeln!(
            out,
            "\nFailed for good (fix the manifests): {}",
            for_good.join(", ")
        )?;
    }
    if !waiting.is_empty() {
        let why = if timed_out {
            format!("not ready when --timeout {timeout:?} ran out (their errors above were still being retried)")
        } else {
            "not ready".to_string()
        };
        writeln!(out, "\nPods {why}: {}", waiting.join(", "))?;
    }
    Ok(())
}

fn describe(args: DescribeArgs) -> anyhow::Result<ExitCode> {
    let path = match &args.what {
        Describe::Pod { pod } => match pod.split_once('/') {
            Some((ns, name)) => format!("/api/v1/pods/{ns}/{name}/describe"),
            None if kubevol_core::validation::is_canonical_uuid(pod) => {
                format!("/api/v1/pods/{pod}/describe")
            }
            None => format!("/api/v1/pods/default/{pod}/describe"),
        },
        Describe::Node => "/api/v1/node/describe".to_string(),
    };
    let body = client::get(&args.server, &path)?;
    let mut out = std::io::stdout();
    if args.output == Some(DescribeOutput::Json) {
        use std::io::Write;
        writeln!(out, "{body}")?;
        return Ok(ExitCode::SUCCESS);
    }
    match args.what {
        Describe::Pod { .. } => {
            let d: kubevol::describe::PodDescription = serde_json::from_str(&body)
                .context("the server's answer is not a pod description")?;
            describe::print_pod(&d, &mut out)?;
        }
        Describe::Node => {
            let d: kubevol::describe::NodeDescription = serde_json::from_str(&body)
                .context("the server's answer is not a node description")?;
            describe::print_node(&d, &mut out)?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn mounts(args: MountsArgs) -> anyhow::Result<ExitCode> {
    use std::io::Write;
    let (namespace, name) = args.pod.split_once('/').unwrap_or(("default", &args.pod));
    for (what, s) in [
        ("namespace", namespace),
        ("pod name", name),
        ("container name", &args.container),
    ] {
        if let Some(why) = kubevol_core::validation::dns1123_subdomain_error(s) {
            anyhow::bail!("{what} {s:?} {why}");
        }
    }
    let format = match args.output {
        None | Some(MountsOutput::Json) => "json",
        Some(MountsOutput::Cri) => "cri",
        Some(MountsOutput::Oci) => "oci",
    };
    let path = format!(
        "/api/v1/pods/{namespace}/{name}/containers/{}/mounts?format={format}",
        args.container
    );
    let body = client::get(&args.server, &path)?;
    let mut out = std::io::stdout();
    if args.output.is_some() {
        writeln!(out, "{body}")?;
        return Ok(ExitCode::SUCCESS);
    }
    let m: serde_json::Value =
        serde_json::from_str(&body).context("the server's answer is not a container's mounts")?;
    let mut rows = vec![[
        "CONTAINER PATH",
        "VOLUME",
        "MODE",
        "PROPAGATION",
        "HOST PATH OR IMAGE",
    ]
    .map(String::from)];
    for v in m["mounts"].as_array().into_iter().flatten() {
        let text = |k: &str| v[k].as_str().unwrap_or_default().to_string();
        let mode = match (v["readOnly"].as_bool(), v["recursiveReadOnly"].as_bool()) {
            (_, Some(true)) => "rro",
            (Some(true), _) => "ro",
            _ => "rw",
        };
        let source = match v["image"]["reference"].as_str() {
            Some(image) => format!("image {image}"),
            None => text("hostPath"),
        };
        rows.push([
            text("containerPath"),
            text("volume"),
            mode.into(),
            text("propagation"),
            source,
        ]);
    }
    for d in m["devices"].as_array().into_iter().flatten() {
        let text = |k: &str| d[k].as_str().unwrap_or_default().to_string();
        rows.push([
            text("containerPath"),
            text("volume"),
            "device".into(),
            "-".into(),
            text("hostPath"),
        ]);
    }
    table::write_columns(&rows, &mut out)?;
    Ok(ExitCode::SUCCESS)
}

fn status(args: StatusArgs) -> anyhow::Result<ExitCode> {
    let body = client::get(&args.server, "/api/v1/pods")?;
    let drivers = client::get(&args.server, "/api/v1/drivers")?;
    if args.output == Some(Output::Json) {
        use std::io::Write;
        writeln!(std::io::stdout(), "{body}")?;
        return Ok(ExitCode::SUCCESS);
    }
    let drivers: Vec<serde_json::Value> = serde_json::from_str(&drivers)
        .context("the server's answer is not a list of CSI drivers")?;
    let report: StatusReport = serde_json::from_str(&body)
        .context("the server's answer is not a kubevol status report")?;
    table::print_report(
        &report,
        args.output == Some(Output::Wide),
        &mut std::io::stdout(),
    )?;
    table::print_drivers(&drivers, &mut std::io::stdout())?;
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The documentation's pages: README.md and docs/*.md, with their text.
    fn documentation() -> Vec<(String, String)> {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let mut pages = vec![root.join("README.md")];
        let mut docs: Vec<_> = std::fs::read_dir(root.join("docs"))
            .expect("docs/")
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "md"))
            .collect();
        docs.sort();
        pages.extend(docs);
        pages
            .into_iter()
            .map(|p| {
                (
                    p.display().to_string(),
                    std::fs::read_to_string(&p).unwrap(),
                )
            })
            .collect()
    }

    /// The blocks of `text` fenced as `lang`, each with the line it starts on.
    fn blocks(text: &str, lang: &str) -> Vec<(usize, String)> {
        let mut out = Vec::new();
        let mut current: Option<(usize, String)> = None;
        for (i, line) in text.lines().enumerate() {
            match (&mut current, line.trim_start().strip_prefix("```")) {
                (None, Some(l)) if l.trim() == lang => current = Some((i + 1, String::new())),
                (Some(_), Some(_)) => out.extend(current.take()),
                (Some((_, b)), None) => {
                    b.push_str(line);
                    b.push('\n');
                }
                _ => {}
            }
        }
        out
    }

    /// Every `kubevol …` command of the documentation's shell blocks (continuations joined;
    /// `cargo run … -- ARGS` counts as `kubevol ARGS`) is one the command line takes. Lines
    /// that spell a synopsis (`[--flag …]`, `A|B`) are not commands.
    #[test]
    fn the_documentations_commands_are_ones_kubevol_takes() {
        let mut checked = 0;
        for (page, text) in documentation() {
            for (at, block) in blocks(&text, "sh") {
                let joined = block.replace("\\\n", " ");
                let commands = joined
                    .lines()
                    .flat_map(|l| l.split(" #").next().unwrap_or("").split("&&"))
                    .flat_map(|c| c.split(';'))
                    .map(|c| c.trim().trim_end_matches('&').trim());
                for line in commands {
                    let args = if let Some(rest) = line
                        .split_once(" -- ")
                        .filter(|(c, _)| c.starts_with("cargo run") && c.contains("kubevol-cli"))
                    {
                        format!("kubevol {}", rest.1)
                    } else if let Some(i) = line
                        .find("kubevol run")
                        .or(line.find("kubevol status"))
                        .or(line.find("kubevol describe"))
                        .or(line.find("kubevol bench"))
                    {
                        line[i..].to_string()
                    } else {
                        continue;
                    };
                    if ["[", "|", "…", "...", "$("]
                        .iter()
                        .any(|c| args.contains(c))
                    {
                        continue;
                    }
                    let words: Vec<String> = args
                        .split_whitespace()
                        .map(|w| w.trim_matches('"').to_string())
                        .collect();
                    if let Err(e) = Cli::try_parse_from(&words) {
                        panic!("{page}, the block at line {at}: `{args}` is not a command kubevol takes: {e}");
                    }
                    checked += 1;
                }
            }
        }
        assert!(checked >= 5, "only {checked} commands found");
    }

    /// Every YAML block of the documentation is manifests kubevol reads without an error.
    #[test]
    fn the_documentations_manifests_load_without_errors() {
        let mut checked = 0;
        for (page, text) in documentation() {
            for (at, block) in blocks(&text, "yaml") {
                let path = std::path::Path::new(&page);
                let (objects, errors) = kubevol::source::parse_manifest(path, &block);
                assert!(
                    errors.is_empty(),
                    "{page}, the block at line {at}: {errors:?}"
                );
                assert!(
                    !objects.is_empty(),
                    "{page}, the block at line {at}: no object"
                );
                checked += 1;
            }
        }
        assert!(checked >= 3, "only {checked} manifests found");
    }
}
