//! CSI drivers as kubevol sees them: the registry of node plugins (registered through
//! `plugins_registry/` or given on the command line), their controller endpoints, and every
//! call to them, with a per-call timeout, the `csi_operations_seconds` metric and the kubelet's
//! split of gRPC codes into final and non-final errors.

pub mod registration;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use kubevol_csi::v1::controller_client::ControllerClient;
use kubevol_csi::v1::node_client::NodeClient;
use kubevol_csi::v1::{controller_service_capability, node_service_capability};
use tonic::transport::Channel;
use tonic::Code;

use crate::metrics::Metrics;

/// How long one CSI call may take (the kubelet's csiTimeout is 2 minutes; drivers that take
/// longer than this are told to give up with DeadlineExceeded and the call is retried).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// A failed CSI call.
#[derive(Clone, Debug, thiserror::Error)]
#[error("CSI driver {driver}: {method} failed: {} ({message})", code_name(*code))]
pub struct CsiError {
    /// The driver.
    pub driver: String,
    /// The method, e.g. `NodeStageVolume`.
    pub method: &'static str,
    /// The gRPC code.
    pub code: Code,
    /// The driver's message (never kubevol's request: that may carry secrets).
    pub message: String,
}

impl CsiError {
    /// Whether the call certainly did nothing lasting. The kubelet treats DeadlineExceeded,
    /// Unavailable, Canceled, ResourceExhausted and Aborted as "the operation may be in
    /// progress": the volume stays uncertain until a later call succeeds or is final.
    pub fn is_final(&self) -> bool {
        !matches!(
            self.code,
            Code::DeadlineExceeded
                | Code::Unavailable
                | Code::Cancelled
                | Code::ResourceExhausted
                | Code::Aborted
        )
    }
}

/// The gRPC status code names the kubelet's metrics use.
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "Canceled",
        Code::Unknown => "Unknown",
        Code::InvalidArgument => "InvalidArgument",
        Code::DeadlineExceeded => "DeadlineExceeded",
        Code::NotFound => "NotFound",
        Code::AlreadyExists => "AlreadyExists",
        Code::PermissionDenied => "PermissionDenied",
        Code::ResourceExhausted => "ResourceExhausted",
        Code::FailedPrecondition => "FailedPrecondition",
        Code::Aborted => "Aborted",
        Code::OutOfRange => "OutOfRange",
        Code::Unimplemented => "Unimplemented",
        Code::Internal => "Internal",
        Code::Unavailable => "Unavailable",
        Code::DataLoss => "DataLoss",
        Code::Unauthenticated => "Unauthenticated",
    }
}

/// What a node plugin can do (NodeGetCapabilities).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct NodeCapabilities {
    /// STAGE_UNSTAGE_VOLUME: kubevol stages (NodeStageVolume) before publishing.
    pub stage_unstage_volume: bool,
    /// GET_VOLUME_STATS.
    pub get_volume_stats: bool,
    /// EXPAND_VOLUME.
    pub expand_volume: bool,
    /// VOLUME_CONDITION (drivers before CSI 1.13: a condition in NodeGetVolumeStats).
    pub volume_condition: bool,
    /// GET_VOLUME_HEALTH (CSI 1.13, alpha): NodeGetVolumeHealth.
    pub get_volume_health: bool,
    /// GET_STORAGE_HEALTH (CSI 1.13, alpha): NodeGetStorageHealth.
    pub get_storage_health: bool,
    /// SINGLE_NODE_MULTI_WRITER.
    pub single_node_multi_writer: bool,
    /// VOLUME_MOUNT_GROUP: the driver applies fsGroup itself.
    pub volume_mount_group: bool,
}

/// How a driver came to kubevol.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DriverSource {
    /// Through a registration socket in `plugins_registry/`.
    Registration {
        /// The registration socket.
        socket: PathBuf,
        /// The highest CSI version the plugin reported that kubevol speaks (e.g. `1.0.0`).
        version: String,
    },
    /// From `--csi-driver NAME=ENDPOINT`.
    CommandLine,
}

/// A registered node plugin.
#[derive(Clone, Debug)]
pub struct Driver {
    /// The driver's name.
    pub name: String,
    /// Its socket.
    pub endpoint: PathBuf,
    /// How it was registered.
    pub source: DriverSource,
    /// The node ID it reported (passed to ControllerPublishVolume).
    pub node_id: String,
    /// Its maximum number of volumes on this node (0: no limit).
    pub max_volumes_per_node: i64,
    /// The topology segments it reported for this node (`NodeGetInfo`'s
    /// `accessible_topology`).
    pub topology: std::collections::BTreeMap<String, String>,
    /// Its capabilities.
    pub capabilities: NodeCapabilities,
    channel: Channel,
}

/// A driver as `kubevol status` and `/api/v1/drivers` show it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DriverStatus {
    /// The driver's name.
    pub name: String,
    /// Its socket.
    pub endpoint: String,
    /// How it was registered.
    pub source: DriverSource,
    /// Its node ID.
    pub node_id: String,
    /// Its maximum number of volumes on this node (0: no limit).
    pub max_volumes_per_node: i64,
    /// The topology segments it reported for this node.
    pub topology: std::collections::BTreeMap<String, String>,
    /// Its node capabilities.
    pub capabilities: NodeCapabilities,
    /// The controller endpoint configured for it, if any.
    pub controller: Option<String>,
    /// `healthy`, or the last failed call.
    pub health: String,
    /// The adverse conditions the driver reports of its storage (NodeGetStorageHealth).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub storage_health: Vec<crate::report::health::Condition>,
    /// What happened to registrations under this name that an operator should know: another
    /// endpoint replacing this one, or refused (newest last).
    pub warnings: Vec<String>,
}

/// How many warnings are kept per driver name.
const WARNINGS_KEPT: usize = 5;

/// A CSI version as `major.minor.patch` numbers, for comparing registrations (`v1.2`, `1.2.0`).
fn parse_version(v: &str) -> Option<(u64, u64, u64)> {
    let mut parts = v.trim().trim_start_matches('v').split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next().map_or(Some(0), |p| p.parse().ok())?;
    let patch = parts.next().map_or(Some(0), |p| p.parse().ok())?;
    Some((major, minor, patch))
}

/// The highest of `versions` that kubevol speaks (CSI 1.x), as the kubelet picks it.
pub fn highest_supported_version(versions: &[String]) -> Option<String> {
    versions
        .iter()
        .filter_map(|v| parse_version(v).map(|p| (p, v)))
        .filter(|((major, _, _), _)| *major == 1)
        .max_by_key(|(p, _)| *p)
        .map(|((a, b, c), _)| format!("{a}.{b}.{c}"))
}

/// Whether a registration may take `name` from the driver registered under it now. As the
/// kubelet decides: the same registration socket again is the driver restarting; another
/// endpoint must report a strictly higher CSI version. A driver given on the command line is
/// the operator's choice and is never replaced by a registration.
fn may_replace(existing: &Driver, new_source: &DriverSource) -> Result<(), String> {
    use DriverSource::{CommandLine, Registration};
    match (&existing.source, new_source) {
        (Registration { socket: a, .. }, Registration { socket: b, .. }) if a == b => Ok(()),
        (CommandLine, CommandLine) => Ok(()),
        (Registration { version: old, .. }, Registration { version: new, .. })
            if parse_version(old) < parse_version(new) =>
        {
            Ok(())
        }
        (Registration { version: old, .. }, _) => Err(format!(
            "another driver with the same name is already registered at {} with a higher or equal supported version: {old:?}",
            existing.endpoint.display()
        )),
        (CommandLine, _) => Err(format!(
            "the driver is given on the command line (--csi-driver) with endpoint {}, which a registration does not replace",
            existing.endpoint.display()
        )),
    }
}

/// What NodeGetInfo says of this node.
struct NodeInfo {
    node_id: String,
    max_volumes_per_node: i64,
    topology: std::collections::BTreeMap<String, String>,
}

/// The CSI drivers kubevol knows.
pub struct Drivers {
    timeout: Duration,
    metrics: Arc<Metrics>,
    nodes: RwLock<HashMap<String, Arc<Driver>>>,
    controllers: RwLock<HashMap<String, (PathBuf, Channel)>>,
    controller_caps: Mutex<HashMap<String, Vec<i32>>>,
    /// Driver → the last call's failure (cleared by a success).
    health: Mutex<HashMap<String, String>>,
    /// Driver name → registrations that replaced another endpoint or were refused.
    warnings: Mutex<HashMap<String, Vec<String>>>,
    /// Bumped on every registration change, so that waiting volumes are retried at once.
    changed: tokio::sync::watch::Sender<u64>,
}

impl Drivers {
    /// An empty registry.
    pub fn new(timeout: Duration, metrics: Arc<Metrics>) -> Self {
        Drivers {
            timeout,
            metrics,
            nodes: RwLock::default(),
            controllers: RwLock::default(),
            controller_caps: Mutex::default(),
            health: Mutex::default(),
            warnings: Mutex::default(),
            changed: tokio::sync::watch::channel(0).0,
        }
    }

    /// A receiver woken on every registration change.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// The per-call timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Runs one call with the timeout, records `csi_operations_seconds` and the driver's
    /// health. `service` and `method` name the gRPC method (`Node`, `NodeStageVolume`).
    pub async fn call<T, Fut>(
        &self,
        driver: &str,
        service: &'static str,
        method: &'static str,
        call: Fut,
    ) -> Result<T, CsiError>
    where
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let started = Instant::now();
        let result = match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(status)) => Err((status.code(), status.message().to_string())),
            Err(_) => Err((
                Code::DeadlineExceeded,
                format!("no answer within {:?}", self.timeout),
            )),
        };
        let code = result.as_ref().err().map_or(Code::Ok, |e| e.0);
        self.metrics.observe_csi(
            driver,
            &format!("/csi.v1.{service}/{method}"),
            code_name(code),
            started.elapsed().as_secs_f64(),
        );
        let mut health = crate::sync::lock(&self.health);
        match result {
            Ok(v) => {
                health.remove(driver);
                Ok(v)
            }
            Err((code, message)) => {
                let e = CsiError {
                    driver: driver.to_string(),
                    method,
                    code,
                    message,
                };
                // A refusal (final error) says nothing about the driver's health.
                if !e.is_final() {
                    health.insert(driver.to_string(), e.to_string());
                }
                Err(e)
            }
        }
    }

    /// Connects to a node plugin, asks for its node ID and capabilities, and registers it
    /// (replacing an earlier registration of the same name).
    pub async fn register(
        &self,
        name: &str,
        endpoint: PathBuf,
        source: DriverSource,
    ) -> Result<Arc<Driver>, CsiError> {
        // A registration that may not take the name is refused before the driver is called.
        if let Some(existing) = self.get(name) {
            self.admit(name, &existing, &endpoint, &source)?;
        }
        let channel = kubevol_csi::connect(&endpoint);
        let mut node = NodeClient::new(channel.clone());
        let info = self.node_info(name, &channel).await?;
        let caps = self
            .call(
                name,
                "Node",
                "NodeGetCapabilities",
                node.node_get_capabilities(kubevol_csi::v1::NodeGetCapabilitiesRequest {}),
            )
            .await?;
        let mut capabilities = NodeCapabilities::default();
        use node_service_capability::rpc::Type;
        for c in caps.capabilities {
            let Some(node_service_capability::Type::Rpc(rpc)) = c.r#type else {
                continue;
            };
            match Type::try_from(rpc.r#type) {
                Ok(Type::StageUnstageVolume) => capabilities.stage_unstage_volume = true,
                Ok(Type::GetVolumeStats) => capabilities.get_volume_stats = true,
                Ok(Type::ExpandVolume) => capabilities.expand_volume = true,
                Ok(Type::VolumeCondition) => capabilities.volume_condition = true,
                Ok(Type::SingleNodeMultiWriter) => capabilities.single_node_multi_writer = true,
                Ok(Type::VolumeMountGroup) => capabilities.volume_mount_group = true,
                Ok(Type::GetVolumeHealth) => capabilities.get_volume_health = true,
                Ok(Type::GetStorageHealth) => capabilities.get_storage_health = true,
                _ => {}
            }
        }
        if info.node_id.is_empty() {
            return Err(CsiError {
                driver: name.to_string(),
                method: "NodeGetInfo",
                code: Code::FailedPrecondition,
                message: "the driver reported an empty node ID".into(),
            });
        }
        let driver = Arc::new(Driver {
            name: name.to_string(),
            endpoint,
            source,
            node_id: info.node_id,
            max_volumes_per_node: info.max_volumes_per_node,
            topology: info.topology,
            capabilities,
            channel,
        });
        {
            let mut nodes = self.nodes.write().unwrap_or_else(|e| e.into_inner());
            if let Some(existing) = nodes.get(name) {
                let same_endpoint = existing.endpoint == driver.endpoint;
                // Checked again: another registration may have come in during the calls.
                self.admit(name, existing, &driver.endpoint, &driver.source)?;
                if !same_endpoint {
                    let warning = format!(
                        "{name} at {} (node ID {}) was replaced by a registration at {} (node ID {}) with a higher CSI version; its volumes are served by the new endpoint",
                        existing.endpoint.display(),
                        existing.node_id,
                        driver.endpoint.display(),
                        driver.node_id
                    );
                    tracing::warn!(driver = name, old = %existing.endpoint.display(), new = %driver.endpoint.display(), "{warning}");
                    self.warn(name, warning);
                }
            }
            nodes.insert(name.to_string(), driver.clone());
        }
        tracing::info!(driver = name, endpoint = %driver.endpoint.display(), node_id = %driver.node_id, capabilities = ?driver.capabilities, "CSI driver registered");
        self.changed.send_modify(|g| *g += 1);
        Ok(driver)
    }

    /// NodeGetInfo of the driver `name` at `channel`.
    async fn node_info(&self, name: &str, channel: &Channel) -> Result<NodeInfo, CsiError> {
        let mut node = NodeClient::new(channel.clone());
        let info = self
            .call(
                name,
                "Node",
                "NodeGetInfo",
                node.node_get_info(kubevol_csi::v1::NodeGetInfoRequest {}),
            )
            .await?;
        Ok(NodeInfo {
            node_id: info.node_id,
            max_volumes_per_node: info.max_volumes_per_node,
            topology: info
                .accessible_topology
                .map(|t| t.segments.into_iter().collect())
                .unwrap_or_default(),
        })
    }

    /// Asks a registered driver for its node information again (`NodeGetInfo`) and takes its
    /// new volume limit and topology; returns the limit, and whether anything changed (then
    /// registration watchers, such as the CSINode publisher, are woken). A driver that reports
    /// another node ID keeps its registered one: volumes were published with it.
    pub async fn refresh_info(&self, name: &str) -> Result<(i64, bool), CsiError> {
        let Some(driver) = self.get(name) else {
            return Err(CsiError {
                driver: name.to_string(),
                method: "NodeGetInfo",
                code: Code::FailedPrecondition,
                message: "the driver is not registered".into(),
            });
        };
        let info = self.node_info(name, &driver.channel).await?;
        let topology = info.topology;
        let max = info.max_volumes_per_node;
        if info.node_id != driver.node_id && !info.node_id.is_empty() {
            tracing::warn!(driver = name, registered = %driver.node_id, reported = %info.node_id, "CSI driver reports another node ID than at registration; the registered one is kept");
        }
        if max == driver.max_volumes_per_node && topology == driver.topology {
            return Ok((max, false));
        }
        {
            let mut nodes = self.nodes.write().unwrap_or_else(|e| e.into_inner());
            // Only the registration that was asked: one that replaced it meanwhile stays.
            match nodes.get(name) {
                Some(now) if Arc::ptr_eq(now, &driver) => {}
                _ => return Ok((max, false)),
            }
            let updated = Driver {
                max_volumes_per_node: max,
                topology,
                ..(*driver).clone()
            };
            nodes.insert(name.to_string(), Arc::new(updated));
        }
        tracing::info!(
            driver = name,
            old = driver.max_volumes_per_node,
            new = max,
            "CSI driver's volume limit on this node changed (NodeGetInfo)"
        );
        self.changed.send_modify(|g| *g += 1);
        Ok((max, true))
    }

    /// Whether a registration at `endpoint` may take `name` from `existing`; a refusal is
    /// logged and kept as a warning for the status API.
    fn admit(
        &self,
        name: &str,
        existing: &Driver,
        endpoint: &std::path::Path,
        source: &DriverSource,
    ) -> Result<(), CsiError> {
        let Err(why) = may_replace(existing, source) else {
            return Ok(());
        };
        let warning = format!(
            "a registration of {name} at {} was refused: {why}",
            endpoint.display()
        );
        tracing::warn!(driver = name, registered = %existing.endpoint.display(), refused = %endpoint.display(), "{warning}");
        self.warn(name, warning);
        Err(CsiError {
            driver: name.to_string(),
            method: "registration",
            code: Code::AlreadyExists,
            message: why,
        })
    }

    /// Keeps a warning for a driver name, for the status API.
    fn warn(&self, name: &str, warning: String) {
        let mut w = crate::sync::lock(&self.warnings);
        let list = w.entry(name.to_string()).or_default();
        list.push(warning);
        let over = list.len().saturating_sub(WARNINGS_KEPT);
        list.drain(..over);
    }

    /// Forgets a driver registered through `socket` (a driver since registered again another
    /// way stays).
    pub fn deregister_socket(&self, socket: &std::path::Path) -> Option<String> {
        let mut nodes = self.nodes.write().unwrap_or_else(|e| e.into_inner());
        let name = nodes
            .iter()
            .find(|(_, d)| matches!(&d.source, DriverSource::Registration { socket: s, .. } if s == socket))
            .map(|(n, _)| n.clone())?;
        nodes.remove(&name);
        drop(nodes);
        tracing::info!(driver = %name, socket = %socket.display(), "CSI driver deregistered: its registration socket is gone");
        self.changed.send_modify(|g| *g += 1);
        Some(name)
    }

    /// The sockets of the drivers registered through the plugin registry directory.
    pub fn registration_sockets(&self) -> BTreeSet<std::path::PathBuf> {
        self.nodes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .filter_map(|d| match &d.source {
                DriverSource::Registration { socket, .. } => Some(socket.clone()),
                _ => None,
            })
            .collect()
    }

    /// A registered driver.
    pub fn get(&self, name: &str) -> Option<Arc<Driver>> {
        self.nodes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned()
    }

    /// A node client for a driver.
    pub fn node_client(driver: &Driver) -> NodeClient<Channel> {
        NodeClient::new(driver.channel.clone())
    }

    /// Sets the controller endpoint of a driver (`--csi-controller`).
    pub fn set_controller(&self, name: &str, endpoint: PathBuf) {
        let channel = kubevol_csi::connect(&endpoint);
        self.controllers
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_string(), (endpoint, channel));
    }

    /// The topology segments every registered driver reported for this node, as the labels
    /// the kubelet gives the Node for them.
    pub fn topology_labels(&self) -> BTreeMap<String, String> {
        let nodes = self.nodes.read().unwrap_or_else(|e| e.into_inner());
        nodes.values().flat_map(|d| d.topology.clone()).collect()
    }

    /// A controller client for a driver, if an endpoint is configured.
    pub fn controller_client(&self, name: &str) -> Option<ControllerClient<Channel>> {
        self.controllers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .map(|(_, c)| ControllerClient::new(c.clone()))
    }

    /// Whether a driver's controller has a capability (asked once, then remembered).
    pub async fn controller_has(
        &self,
        name: &str,
        cap: controller_service_capability::rpc::Type,
    ) -> Result<bool, CsiError> {
        if let Some(caps) = crate::sync::lock(&self.controller_caps).get(name) {
            return Ok(caps.contains(&(cap as i32)));
        }
        let Some(mut client) = self.controller_client(name) else {
            return Ok(false);
        };
        let resp = self
            .call(
                name,
                "Controller",
                "ControllerGetCapabilities",
                client.controller_get_capabilities(
                    kubevol_csi::v1::ControllerGetCapabilitiesRequest {},
                ),
            )
            .await?;
        let caps: Vec<i32> = resp
            .capabilities
            .iter()
            .filter_map(|c| {
                c.r#type
                    .as_ref()
                    .map(|controller_service_capability::Type::Rpc(r)| r.r#type)
            })
            .collect();
        let has = caps.contains(&(cap as i32));
        crate::sync::lock(&self.controller_caps).insert(name.to_string(), caps);
        Ok(has)
    }

    /// Every registered driver's node plugin.
    pub fn all(&self) -> Vec<Arc<Driver>> {
        let nodes = self.nodes.read().unwrap_or_else(|e| e.into_inner());
        nodes.values().cloned().collect()
    }

    /// Every driver, for the status API.
    pub fn status(&self) -> Vec<DriverStatus> {
        let nodes = self.nodes.read().unwrap_or_else(|e| e.into_inner());
        let controllers = self.controllers.read().unwrap_or_else(|e| e.into_inner());
        let health = crate::sync::lock(&self.health);
        let warnings = crate::sync::lock(&self.warnings);
        let mut out: BTreeMap<String, DriverStatus> = BTreeMap::new();
        for d in nodes.values() {
            out.insert(
                d.name.clone(),
                DriverStatus {
                    name: d.name.clone(),
                    endpoint: d.endpoint.display().to_string(),
                    source: d.source.clone(),
                    node_id: d.node_id.clone(),
                    max_volumes_per_node: d.max_volumes_per_node,
                    topology: d.topology.clone(),
                    capabilities: d.capabilities,
                    controller: controllers
                        .get(&d.name)
                        .map(|(p, _)| p.display().to_string()),
                    health: health
                        .get(&d.name)
                        .cloned()
                        .unwrap_or_else(|| "healthy".into()),
                    warnings: warnings.get(&d.name).cloned().unwrap_or_default(),
                    storage_health: Vec::new(),
                },
            );
        }
        out.into_values().collect()
    }
}

/// Registers the drivers that are there at start, before the first reconcile (so that their
/// volumes do not fail a first attempt for want of a driver): every socket in the plugin
/// registry `registry`, and one attempt at each driver given on the command line. Returns the
/// drivers from the command line that did not answer.
pub(crate) async fn register_at_start(
    drivers: &Arc<Drivers>,
    registry: &std::path::Path,
    command_line: &[(String, PathBuf)],
) -> AtStart {
    let _ = std::fs::create_dir_all(registry);
    let handled = registration::register_present(registry, drivers).await;
    let mut missing = Vec::new();
    for (name, endpoint) in command_line {
        if let Err(e) = drivers
            .register(name, endpoint.clone(), DriverSource::CommandLine)
            .await
        {
            tracing::warn!(driver = %name, endpoint = %endpoint.display(), "CSI driver not reachable at start; retrying: {e}");
            missing.push((name.clone(), endpoint.clone()));
        }
    }
    AtStart { missing, handled }
}

/// What registration at start did, for [`run`] to go on from.
pub(crate) struct AtStart {
    /// Drivers from the command line that did not answer.
    missing: Vec<(String, PathBuf)>,
    /// The registration sockets that were there, accepted or refused.
    handled: std::collections::BTreeSet<PathBuf>,
}

/// Runs the registration side until aborted: the plugin registry watch, and registration of
/// command-line drivers that did not answer at start (retried until they do). Every change is
/// announced on [`Drivers::changed`].
pub(crate) async fn run(drivers: Arc<Drivers>, registry: PathBuf, at_start: AtStart) {
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(registration::watch(
        registry,
        drivers.clone(),
        at_start.handled,
    ));
    for (name, endpoint) in at_start.missing {
        let d = drivers.clone();
        tasks.spawn(async move {
            for delay in kubevol_core::backoff::BackoffPolicy::RECONNECT.delays() {
                tokio::time::sleep(delay).await;
                match d
                    .register(&name, endpoint.clone(), DriverSource::CommandLine)
                    .await
                {
                    Ok(_) => return,
                    Err(e) => {
                        tracing::warn!(driver = %name, endpoint = %endpoint.display(), "CSI driver not reachable yet, retrying with backoff (500 ms doubling to 30 s): {e}");
                    }
                }
            }
        });
    }
    while tasks.join_next().await.is_some() {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_highest_csi_1_version_is_compared() {
        let v = |list: &[&str]| {
            highest_supported_version(&list.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        };
        assert_eq!(
            v(&["0.3.0", "v1.2", "1.10.0", "1.9.9"]).as_deref(),
            Some("1.10.0")
        );
        assert_eq!(v(&["0.3.0", "2.0.0"]), None);
        assert!(parse_version("1.2.0") < parse_version("1.10.0"));
        assert!(parse_version("v1") == parse_version("1.0.0"));
    }
}
