//! The cluster a cluster-mode test runs against ([`Backend`]): this crate's in-process
//! server, or a real control plane — the kube-apiserver, kube-controller-manager and etcd that
//! `tools/k8s/control-plane.sh up DIR` builds and starts, named by `KUBEVOL_TEST_CLUSTER=DIR`
//! (or any cluster, when `KUBEVOL_TEST_KUBECONFIG` names an administrator's kubeconfig and
//! `KUBEVOL_TEST_NODE_KUBECONFIG` a node's: a client certificate or token of
//! `system:node:<name>`, group `system:nodes`).
//!
//! A test speaks to either through the same requests: the administrator's objects go through
//! the API (create, replace, delete, get), and the node's clients reach the server through a
//! TCP relay that [`TestCluster::cut`] closes, so an outage looks the same against both. On a
//! real cluster every test gets a namespace of its own and, on the project's control plane, a
//! node of its own (a client certificate minted for `<name>-<random>`), so tests run in
//! parallel; what it created is deleted by [`TestCluster::clean_up`], and names that are
//! cluster-wide by nature (a CSI driver's) are held one test at a time
//! ([`TestCluster::exclusive`]). What only the in-process server can do (forget its history,
//! delay the authorizer, cap token lifetimes, stop serving an API) is reached through
//! [`TestCluster::server`], which is `None` against a real cluster.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::http::Uri;
use kube::api::{Api, DeleteParams, DynamicObject, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use sha2::Digest;

pub mod audit;
mod etcd;
mod relay;

pub use audit::NodeRequest;

use relay::Relay;

use crate::store::{Resource, RESOURCES};
use crate::{TestServer, ADMIN_TOKEN};

/// The environment variable naming an administrator's kubeconfig of a real cluster.
pub const ADMIN_KUBECONFIG_ENV: &str = "KUBEVOL_TEST_KUBECONFIG";
/// The environment variable naming a node's kubeconfig of the same cluster.
pub const NODE_KUBECONFIG_ENV: &str = "KUBEVOL_TEST_NODE_KUBECONFIG";
/// The environment variable naming the directory of a control plane that
/// `tools/k8s/control-plane.sh up` started (the README's test command starts one).
pub const CONTROL_PLANE_ENV: &str = "KUBEVOL_TEST_CLUSTER";

/// Which API server a test runs against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// This crate's in-process server.
    InProcess,
    /// A real kube-apiserver: the project's control plane ([`CONTROL_PLANE_ENV`]) or the
    /// cluster of [`ADMIN_KUBECONFIG_ENV`] and [`NODE_KUBECONFIG_ENV`].
    Real,
}

impl Backend {
    /// The real cluster if the environment names one, else the in-process server.
    pub fn from_env() -> Backend {
        if std::env::var_os(CONTROL_PLANE_ENV).is_some()
            || std::env::var_os(ADMIN_KUBECONFIG_ENV).is_some()
        {
            Backend::Real
        } else {
            Backend::InProcess
        }
    }
}

/// A cluster to test against.
pub struct TestCluster {
    server: Option<TestServer>,
    admin: kube::Client,
    /// The node's configuration, pointed at the relay.
    node_config: kube::Config,
    /// The node's kubeconfig file as given (a real cluster), for a command line.
    node_kubeconfig: Option<std::path::PathBuf>,
    node_name: String,
    namespace: String,
    relay: Relay,
    /// Cluster-scoped objects this test created, deleted by `clean_up` on a real cluster.
    created: Mutex<Vec<(&'static Resource, String)>>,
    /// The pods this test created: when, in which namespace, and which objects each references
    /// (what a node may be refused for a moment after).
    pods: Mutex<Vec<CreatedPod>>,
    /// The project's control plane's directory, when this is it.
    control_plane: Option<std::path::PathBuf>,
    /// Whether the test makes requests a node is refused on purpose.
    refusals_expected: std::sync::atomic::AtomicBool,
    /// Requests the test makes as the node, refused on purpose: verb, resource, `ns/name`.
    refusals_made: Mutex<Vec<(String, String, String)>>,
}

/// A pod a test created, and what it references.
struct CreatedPod {
    /// When the API server created it.
    at: Option<k8s_openapi::jiff::Timestamp>,
    namespace: String,
    /// `<resource>/<name>` of every object the pod names, as the Node authorizer relates
    /// them (`crate::refs`).
    references: std::collections::BTreeSet<String>,
}

/// How long after a pod's creation a node may be refused a read of what the pod references:
/// the Node authorizer learns the pod's references from its own watch, moments later.
const AUTHORIZER_LAG: std::time::Duration = std::time::Duration::from_secs(30);

impl TestCluster {
    /// The cluster the environment names ([`Backend::from_env`]), with node `node`.
    pub async fn start(node: &str) -> TestCluster {
        Self::start_on(Backend::from_env(), node).await
    }

    /// The in-process server with node `node` (its name is the test's choice), or the real
    /// cluster the environment names: on the project's control plane the node is
    /// `<node>-<random>`, a node of this test's own; on another cluster it is the identity of
    /// the node kubeconfig. Panics, saying how to get one, when [`Backend::Real`] is asked
    /// for and the environment names no cluster: a test is never skipped silently.
    pub async fn start_on(backend: Backend, node: &str) -> TestCluster {
        if backend == Backend::InProcess {
            return Self::in_process(node).await;
        }
        if let Some(dir) = std::env::var_os(CONTROL_PLANE_ENV) {
            return Self::control_plane(dir.into(), node).await;
        }
        match (
            std::env::var_os(ADMIN_KUBECONFIG_ENV),
            std::env::var_os(NODE_KUBECONFIG_ENV),
        ) {
            (Some(admin), Some(node_file)) => {
                Self::real(admin.into(), node_file.into(), None).await
            }
            (Some(_), None) | (None, Some(_)) => panic!(
                "set both {ADMIN_KUBECONFIG_ENV} (an administrator's kubeconfig) and {NODE_KUBECONFIG_ENV} (a node's) to test against a real cluster, or neither"
            ),
            (None, None) => panic!(
                "this test runs against a real kube-apiserver and none is named: run the README's test command (./test.sh builds and starts one), or start one with `tools/k8s/control-plane.sh up DIR` and set {CONTROL_PLANE_ENV}=DIR"
            ),
        }
    }

    /// A node of this test's own on the project's control plane in `dir`.
    async fn control_plane(dir: std::path::PathBuf, node: &str) -> TestCluster {
        let name = format!("{node}-{}", unique_suffix());
        let script = dir.join("control-plane.sh");
        let out = tokio::process::Command::new(&script)
            .arg("node")
            .arg(&dir)
            .arg(&name)
            .output()
            .await
            .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
        assert!(
            out.status.success(),
            "{} node {name} failed: {}",
            script.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let kubeconfig = String::from_utf8_lossy(&out.stdout).trim().to_string();
        Self::real(dir.join("admin.kubeconfig"), kubeconfig.into(), Some(dir)).await
    }
    async fn in_process(node: &str) -> TestCluster {
        let server = TestServer::start()
            .await
            .expect("the test API server starts");
        let admin = server.client(ADMIN_TOKEN).await;
        let config = config_of(&server.kubeconfig(&TestServer::node_token(node))).await;
        let relay = Relay::start(&config.cluster_url).await;
        TestCluster {
            admin,
            node_config: relay.config_of(config),
            node_kubeconfig: None,
            node_name: node.to_string(),
            namespace: "default".into(),
            relay,
            server: Some(server),
            created: Mutex::default(),
            pods: Mutex::default(),
            control_plane: None,
            refusals_expected: Default::default(),
            refusals_made: Mutex::default(),
        }
    }

    async fn real(
        admin: std::path::PathBuf,
        node: std::path::PathBuf,
        control_plane: Option<std::path::PathBuf>,
    ) -> TestCluster {
        let read = |p: &std::path::Path| {
            std::fs::read_to_string(p)
                .unwrap_or_else(|e| panic!("reading kubeconfig {}: {e}", p.display()))
        };
        let admin = kube::Client::try_from(config_of(&read(&admin)).await)
            .expect("a client of the administrator's kubeconfig");
        let config = config_of(&read(&node)).await;
        let node_name = whoami(
            &kube::Client::try_from(config.clone()).expect("a client of the node's kubeconfig"),
        )
        .await;
        let namespace = format!("kubevol-test-{}", unique_suffix());
        let relay = Relay::start(&config.cluster_url).await;
        let cluster = TestCluster {
            admin,
            node_config: relay.config_of(config),
            node_kubeconfig: Some(node),
            node_name,
            namespace: namespace.clone(),
            relay,
            server: None,
            created: Mutex::default(),
            pods: Mutex::default(),
            control_plane,
            refusals_expected: Default::default(),
            refusals_made: Mutex::default(),
        };
        cluster
            .create(
                json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}),
            )
            .await;
        // The ServiceAccount admission refuses a pod until its namespace's `default` account
        // exists, which the controller manager makes a moment after the namespace.
        let accounts: Api<DynamicObject> = Api::namespaced_with(
            cluster.admin.clone(),
            &cluster.namespace,
            &api_resource(resource_of("v1", "serviceaccounts")),
        );
        eventually(
            &format!(
                "the ServiceAccount default of namespace {}",
                cluster.namespace
            ),
            60,
            || {
                let accounts = accounts.clone();
                async move { matches!(accounts.get_opt("default").await, Ok(Some(_))) }
            },
        )
        .await;
        cluster
    }

    /// Holds `name` (a cluster-wide name that tests share by nature, a CSI driver's) for this
    /// test until the guard is dropped: on a real cluster, one test at a time across every
    /// test process (a lock file of the control plane, or of the temporary directory);
    /// against the in-process server, each test has its own names and nothing is held.
    pub fn exclusive(&self, name: &str) -> Option<std::fs::File> {
        if self.server.is_some() {
            return None;
        }
        let dir = self
            .control_plane
            .clone()
            .unwrap_or_else(std::env::temp_dir)
            .join("locks");
        std::fs::create_dir_all(&dir).expect("the lock directory");
        let path = dir.join(name.replace('/', "_"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("opening lock {}: {e}", path.display()));
        file.lock()
            .unwrap_or_else(|e| panic!("locking {}: {e}", path.display()));
        Some(file)
    }

    /// A name for a cluster-scoped object of this test (a PersistentVolume's): `name` itself
    /// against the in-process server, `<name>-<namespace>` on a real cluster, where other
    /// tests run beside this one.
    pub fn scoped(&self, name: &str) -> String {
        if self.server.is_some() {
            name.to_string()
        } else {
            format!("{name}-{}", self.namespace)
        }
    }

    /// The in-process server, for what only it can do; `None` against a real cluster.
    pub fn server(&self) -> Option<&TestServer> {
        self.server.as_ref()
    }

    /// Whether this is a real cluster.
    pub fn is_real(&self) -> bool {
        self.server.is_none()
    }

    /// The project's control plane's directory (its CA, `ca.crt` and `ca.key`, and the node's
    /// credentials, `nodes/<node>.crt` and `.key`), when this is it.
    pub fn control_plane_dir(&self) -> Option<&std::path::Path> {
        self.control_plane.as_deref()
    }

    /// Whether this is the project's control plane (`KUBEVOL_TEST_CLUSTER`), whose features
    /// and APIs are known: ClusterTrustBundles and PodCertificateRequests are served there (at
    /// `certificates.k8s.io/v1` as a default 1.37 server serves them; at `v1beta1` on 1.36).
    pub fn is_project_plane(&self) -> bool {
        self.control_plane.is_some()
    }

    /// The node's name.
    pub fn node_name(&self) -> &str {
        &self.node_name
    }

    /// The namespace this test's objects live in.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The node's client configuration, pointed at the relay (for the node's client, kubevol's
    /// `source::cluster::client`).
    pub fn node_config(&self) -> kube::Config {
        self.node_config.clone()
    }

    /// A client with the administrator's identity (never cut).
    pub fn admin_client(&self) -> kube::Client {
        self.admin.clone()
    }

    /// The node's kubeconfig as a file in `dir` (for a command line), reaching the server
    /// directly.
    pub fn node_kubeconfig(&self, dir: &std::path::Path) -> std::path::PathBuf {
        if let Some(p) = &self.node_kubeconfig {
            return p.clone();
        }
        let server = self.server.as_ref().expect("an in-process server");
        let path = dir.join("node.kubeconfig");
        std::fs::write(
            &path,
            server.kubeconfig(&TestServer::node_token(&self.node_name)),
        )
        .expect("writing the node's kubeconfig");
        path
    }

    /// Closes the node's connections and refuses new ones, until [`TestCluster::restore`].
    /// Once it returns, nothing more reaches the node: a change made after the cut is never
    /// delivered on a connection from before it, however late that connection's task runs.
    pub async fn cut(&self) {
        let _no_write_in_flight = self.relay.gate.writing.write().await;
        self.relay.gate.open.send_replace(false);
    }

    /// Forgets the change history up to now, so that a watch resumed from an earlier resource
    /// version gets `410 Gone`: the in-process server's store, or etcd's (a physical
    /// compaction at its current revision) on the project's control plane, where ConfigMaps
    /// are served without the watch cache (`--watch-cache-sizes configmaps#0`), so their
    /// watches resume from etcd and see the compaction, as on a server without the cache. Other
    /// kinds are watched from the API server's cache there, whose own window no test can close
    /// on demand. Panics on another real cluster: its etcd is not the test's to reach.
    pub async fn compact_history(&self) {
        if let Some(server) = &self.server {
            server.compact();
            return;
        }
        let dir = self.control_plane.as_ref().expect(
            "compacting the history needs the in-process server or the project's control plane",
        );
        etcd::compact(dir).await;
    }

    /// Lets the node reach the server again (after a cut or a freeze).
    pub fn restore(&self) {
        self.relay
            .gate
            .frozen
            .store(false, std::sync::atomic::Ordering::SeqCst);
        self.relay.gate.open.send_replace(true);
    }

    /// Freezes the network between the node and the server: what either sends is dropped,
    /// and no connection is closed (no reset, no FIN), until [`TestCluster::restore`].
    pub fn freeze(&self) {
        self.relay
            .gate
            .frozen
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// How many connections the node has open to the server now.
    pub fn node_connections(&self) -> usize {
        self.relay
            .gate
            .connections
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Creates `obj` (with its `apiVersion` and `kind`) as the administrator; a namespaced
    /// object is put in the test's namespace.
    pub async fn create(&self, mut obj: Value) -> Value {
        let (res, api, name) = self.api_of(&mut obj);
        let what = format!("{} {name}", res.kind);
        let o: DynamicObject = serde_json::from_value(obj).expect("an object");
        let made = api
            .create(&PostParams::default(), &o)
            .await
            .unwrap_or_else(|e| panic!("creating {what}: {e}"));
        if !res.namespaced {
            self.created
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((res, name));
        }
        let made = serde_json::to_value(made).expect("JSON");
        if res.kind == "Pod" {
            self.pods
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(CreatedPod {
                    at: made["metadata"]["creationTimestamp"]
                        .as_str()
                        .and_then(|t| t.parse().ok()),
                    namespace: made["metadata"]["namespace"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string(),
                    references: crate::refs::of_pod(&made)
                        .into_iter()
                        .map(|(resource, name)| format!("{resource}/{name}"))
                        .collect(),
                });
        }
        made
    }

    /// Replaces `obj` as the administrator, or creates it.
    pub async fn apply(&self, mut obj: Value) -> Value {
        let (res, api, name) = self.api_of(&mut obj);
        match api.get_opt(&name).await {
            Ok(Some(have)) => {
                obj["metadata"]["resourceVersion"] = json!(have.metadata.resource_version);
                let o: DynamicObject = serde_json::from_value(obj).expect("an object");
                let put = api
                    .replace(&name, &PostParams::default(), &o)
                    .await
                    .unwrap_or_else(|e| panic!("replacing {} {name}: {e}", res.kind));
                serde_json::to_value(put).expect("JSON")
            }
            Ok(None) => self.create(obj).await,
            Err(e) => panic!("reading {} {name}: {e}", res.kind),
        }
    }

    /// Deletes an object (`grace` as DeleteOptions' `gracePeriodSeconds`); a namespaced one
    /// in the test's namespace.
    pub async fn delete(&self, group_version: &str, plural: &str, name: &str, grace: Option<u32>) {
        let api = self.api(resource_of(group_version, plural));
        let params = DeleteParams {
            grace_period_seconds: grace,
            ..Default::default()
        };
        api.delete(name, &params)
            .await
            .unwrap_or_else(|e| panic!("deleting {plural} {name}: {e}"));
    }

    /// One object, if it exists; a namespaced one in the test's namespace.
    pub async fn get(&self, group_version: &str, plural: &str, name: &str) -> Option<Value> {
        let api = self.api(resource_of(group_version, plural));
        api.get_opt(name)
            .await
            .unwrap_or_else(|e| panic!("reading {plural} {name}: {e}"))
            .map(|o| serde_json::to_value(o).expect("JSON"))
    }

    /// Every object of a kind in the test's namespace (or the cluster, if cluster-scoped).
    pub async fn list(&self, group_version: &str, plural: &str) -> Vec<Value> {
        let api = self.api(resource_of(group_version, plural));
        api.list(&Default::default())
            .await
            .unwrap_or_else(|e| panic!("listing {plural}: {e}"))
            .items
            .into_iter()
            .map(|o| serde_json::to_value(o).expect("JSON"))
            .collect()
    }

    /// Claim `name` (of the test's namespace) bound to PersistentVolume `volume`, which names
    /// the claim in its `claimRef`, as the PersistentVolume controller binds it: on a real
    /// cluster (the project's control plane runs the controller) its work is waited for; the
    /// in-process server runs no controller, so the claim's `spec.volumeName` and `Bound`
    /// status are written here. Returns the claim.
    pub async fn bind_claim(&self, name: &str, volume: &str) -> Value {
        use kube::api::{Patch, PatchParams};
        let claims: kube::Api<k8s_openapi::api::core::v1::PersistentVolumeClaim> =
            kube::Api::namespaced(self.admin_client(), self.namespace());
        if self.is_real() {
            eventually(
                &format!("claim {name} bound by the PersistentVolume controller"),
                60,
                || {
                    let claims = claims.clone();
                    async move {
                        let claim = claims.get(name).await.ok();
                        claim.and_then(|c| c.status?.phase).as_deref() == Some("Bound")
                    }
                },
            )
            .await;
            let claim = claims.get(name).await.expect("the bound claim");
            return serde_json::to_value(claim).expect("JSON");
        }
        let params = PatchParams::default();
        claims
            .patch(
                name,
                &params,
                &Patch::Merge(json!({"spec": {"volumeName": volume}})),
            )
            .await
            .unwrap_or_else(|e| panic!("binding claim {name}: {e}"));
        // The volume's capacity and access modes, as the controller writes them.
        let pv = self
            .get("v1", "persistentvolumes", volume)
            .await
            .unwrap_or_else(|| panic!("binding claim {name}: no PersistentVolume {volume}"));
        let status = json!({"status": {"phase": "Bound", "accessModes": pv["spec"]["accessModes"], "capacity": pv["spec"]["capacity"]}});
        let claim = claims
            .patch_status(name, &params, &Patch::Merge(status))
            .await
            .unwrap_or_else(|e| panic!("binding claim {name}: {e}"));
        serde_json::to_value(claim).expect("JSON")
    }

    /// The version of `certificates.k8s.io` that serves `plural` (`clustertrustbundles`,
    /// `podcertificaterequests`): `v1` on a default 1.37 server, `v1beta1` on a 1.36 one that
    /// turned it on; `None` where neither does.
    pub async fn certificates_version(&self, plural: &str) -> Option<&'static str> {
        for version in ["v1", "v1beta1"] {
            if self
                .serves(&format!("certificates.k8s.io/{version}"), plural)
                .await
            {
                return Some(version);
            }
        }
        None
    }

    /// Whether the server serves a resource (`certificates.k8s.io/v1`,
    /// `clustertrustbundles`).
    pub async fn serves(&self, group_version: &str, plural: &str) -> bool {
        let path = match group_version.split_once('/') {
            Some(_) => format!("/apis/{group_version}"),
            None => format!("/api/{group_version}"),
        };
        let req = axum::http::Request::get(path)
            .body(Vec::new())
            .expect("a request");
        match self.admin.request::<Value>(req).await {
            Ok(list) => list["resources"]
                .as_array()
                .is_some_and(|r| r.iter().any(|r| r["name"] == plural)),
            Err(_) => false,
        }
    }

    /// The requests the node has made so far, counted by verb and resource (`list
    /// secrets`, `patch nodes/status`): from the in-process server's count, or from the
    /// project's control plane's audit log; `None` on another cluster.
    pub fn node_requests(&self) -> Option<BTreeMap<String, u64>> {
        if let Some(server) = &self.server {
            return Some(server.node_requests());
        }
        Some(audit::count(&self.audited()?))
    }

    /// The CPU seconds the project's control plane's kube-apiserver and etcd have used so far
    /// (from `/proc`); `None` on another cluster or the in-process server.
    pub fn server_cpu_seconds(&self) -> Option<f64> {
        audit::server_cpu_seconds(self.control_plane.as_ref()?)
    }

    /// Every request of this test's node in the project's control plane's audit log, in
    /// order; `None` without one.
    pub fn audited(&self) -> Option<Vec<NodeRequest>> {
        let dir = self.control_plane.as_ref()?;
        let requests = audit::node_requests(dir, |node| node == self.node_name);
        Some(requests.into_iter().map(|(_, r)| r).collect())
    }

    /// Says that this test makes requests a node is refused on purpose, so that
    /// [`TestCluster::clean_up`] does not hold them against kubevol.
    pub fn expect_refusals(&self) {
        self.refusals_expected
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Says that the test itself makes one request as the node that is refused on purpose
    /// (`verb` of `resource`, `object` as `ns/name`, the name empty for a list), so that
    /// [`TestCluster::clean_up`] holds only kubevol's refusals against it.
    pub fn expect_refusal_of(&self, verb: &str, resource: &str, object: &str) {
        self.refusals_made
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((verb.into(), resource.into(), object.into()));
    }

    /// Removes what the test made on a real cluster: its namespace (pods first, at once: no
    /// kubelet finishes them) and the cluster-scoped objects it created. On the project's
    /// control plane it first checks the audit log: every request the node made was allowed,
    /// but for a read of a Secret, ConfigMap or ServiceAccount that a pod this test created
    /// references, in the 30 s after that pod's creation, before the Node authorizer relates it
    /// to the node (unless [`TestCluster::expect_refusals`]).
    pub async fn clean_up(self) {
        if self.server.is_some() {
            return;
        }
        if !self
            .refusals_expected
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            let pods = self.pods.lock().unwrap_or_else(|e| e.into_inner());
            // A read of what a pod of this test references, in the moments after the pod was
            // made, before the Node authorizer has related it to the node.
            let lag = |r: &NodeRequest| {
                let (namespace, name) = r.object.split_once('/').unwrap_or_default();
                let name = r
                    .selected
                    .as_deref()
                    .filter(|_| name.is_empty())
                    .unwrap_or(name);
                r.code == 403
                    && ["get", "list", "watch"].contains(&r.verb.as_str())
                    && pods.iter().any(|p| {
                        p.namespace == namespace
                            && p.references.contains(&format!("{}/{name}", r.resource))
                            && match (p.at, r.at) {
                                (Some(made), Some(asked)) => {
                                    let after = asked.duration_since(made);
                                    // Timestamps of one server, to the second and the
                                    // microsecond: a read in the second it was made counts.
                                    after.as_secs_f64() > -1.0
                                        && after.as_secs_f64() < AUTHORIZER_LAG.as_secs_f64()
                                }
                                _ => false,
                            }
                    })
            };
            let refused: Vec<NodeRequest> = self
                .audited()
                .unwrap_or_default()
                .into_iter()
                .filter(|r| (r.code == 401 || r.code == 403) && !lag(r))
                .filter(|r| {
                    !self
                        .refusals_made
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .iter()
                        .any(|(verb, resource, object)| {
                            *verb == r.verb && *resource == r.resource && *object == r.object
                        })
                })
                .collect();
            drop(pods);
            assert!(
                refused.is_empty(),
                "the API server refused requests of node {}: {refused:#?}",
                self.node_name
            );
        }
        let pods: Api<DynamicObject> = Api::namespaced_with(
            self.admin.clone(),
            &self.namespace,
            &api_resource(resource_of("v1", "pods")),
        );
        let now = DeleteParams {
            grace_period_seconds: Some(0),
            ..Default::default()
        };
        if let Ok(list) = pods.list(&Default::default()).await {
            for p in list.items {
                let _ = pods
                    .delete(&p.metadata.name.unwrap_or_default(), &now)
                    .await;
            }
        }
        if self.control_plane.is_some() {
            // The node is this test's own: its Node and CSINode go too.
            for (gv, plural) in [("v1", "nodes"), ("storage.k8s.io/v1", "csinodes")] {
                let _ = Api::<DynamicObject>::all_with(
                    self.admin.clone(),
                    &api_resource(resource_of(gv, plural)),
                )
                .delete(&self.node_name, &Default::default())
                .await;
            }
        }
        let created = std::mem::take(&mut *self.created.lock().unwrap_or_else(|e| e.into_inner()));
        for (res, name) in created.into_iter().rev() {
            let _ = Api::<DynamicObject>::all_with(self.admin.clone(), &api_resource(res))
                .delete(&name, &Default::default())
                .await;
        }
    }

    fn api(&self, res: &'static Resource) -> Api<DynamicObject> {
        let ar = api_resource(res);
        if res.namespaced {
            Api::namespaced_with(self.admin.clone(), &self.namespace, &ar)
        } else {
            Api::all_with(self.admin.clone(), &ar)
        }
    }

    /// The API of `obj`'s kind and its name, with a namespaced `obj` moved to the test's
    /// namespace.
    fn api_of(&self, obj: &mut Value) -> (&'static Resource, Api<DynamicObject>, String) {
        let gv = obj["apiVersion"].as_str().unwrap_or_default().to_string();
        let kind = obj["kind"].as_str().unwrap_or_default().to_string();
        let res = RESOURCES
            .iter()
            .chain(&[NAMESPACES])
            .find(|r| r.group_version == gv && r.kind == kind)
            .unwrap_or_else(|| panic!("no resource for {gv} {kind}"));
        if res.namespaced {
            obj["metadata"]["namespace"] = json!(self.namespace);
        }
        let name = obj["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        (res, self.api(res), name)
    }
}

/// Polls `cond` (for what the test cannot watch: the server's objects) until it holds;
/// panics naming `what` after `secs`.
pub async fn eventually<F: std::future::Future<Output = bool>>(
    what: &str,
    secs: u64,
    mut cond: impl FnMut() -> F,
) {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(secs);
    while !cond().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not within {secs}s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Eight hexadecimal digits that no other test of this run has (the process, the clock and a
/// counter).
fn unique_suffix() -> String {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mix = nanos ^ (u128::from(std::process::id()) << 64) ^ (u128::from(n) << 96);
    let hash = sha2::Sha256::digest(mix.to_le_bytes());
    hash[..4].iter().map(|b| format!("{b:02x}")).collect()
}

/// Namespaces, which only the real cluster needs (the in-process server has no such check).
const NAMESPACES: Resource = Resource {
    plural: "namespaces",
    group_version: "v1",
    kind: "Namespace",
    namespaced: false,
};

fn resource_of(group_version: &str, plural: &str) -> &'static Resource {
    crate::store::resource(group_version, plural)
        .unwrap_or_else(|| panic!("no resource {group_version} {plural}"))
}

fn api_resource(res: &Resource) -> ApiResource {
    let (group, version) = res
        .group_version
        .split_once('/')
        .unwrap_or(("", res.group_version));
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, res.kind), res.plural)
}

async fn config_of(kubeconfig: &str) -> kube::Config {
    let file = kube::config::Kubeconfig::from_yaml(kubeconfig).expect("a kubeconfig");
    kube::Config::from_custom_kubeconfig(file, &Default::default())
        .await
        .expect("a complete kubeconfig")
}

/// The node name of a node's identity (`system:node:<name>`), as the server sees it.
async fn whoami(client: &kube::Client) -> String {
    let review = json!({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"});
    let req = axum::http::Request::post("/apis/authentication.k8s.io/v1/selfsubjectreviews")
        .header("content-type", "application/json")
        .body(serde_json::to_vec(&review).expect("JSON"))
        .expect("a request");
    let answer: Value = client
        .request(req)
        .await
        .unwrap_or_else(|e| panic!("asking the server who the node kubeconfig is: {e}"));
    let user = answer["status"]["userInfo"]["username"]
        .as_str()
        .unwrap_or_default();
    user.strip_prefix("system:node:")
        .unwrap_or_else(|| {
            panic!(
                "{NODE_KUBECONFIG_ENV} is the identity {user:?}, not a node's (system:node:<name>)"
            )
        })
        .to_string()
}
