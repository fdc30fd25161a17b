//! An in-process Kubernetes API server for kubevol's cluster-mode tests.
//!
//! It keeps the rules of the real API server that a node agent depends on, so that code that
//! passes here passes against a real `kube-apiserver --authorization-mode=Node,RBAC` with
//! NodeRestriction:
//! - list and watch with resource versions: a watch resumes after the version it is given,
//!   gets `410 Gone` (an `ERROR` event with reason `Expired`) when that version is no longer
//!   kept ([`TestServer::compact`]), and ends after its `timeoutSeconds`;
//! - field selectors (`metadata.name`, `metadata.namespace`, `spec.nodeName`), enforced;
//! - a pod bound to a node is deleted gracefully (a `deletionTimestamp`, then its node deletes
//!   it with a grace period of 0);
//! - create conflicts, `resourceVersion` preconditions on update, JSON merge patches, the
//!   `status` subresource (only `status` changes through it);
//! - bearer tokens: an administrator, and one identity per node with exactly the Node
//!   authorizer's rights ([`authz`]).
//!
//! It can be stopped and started again on the same address with its objects kept, to test
//! outages.

pub mod authz;
pub mod cluster;
mod refs;
mod routes;
pub mod store;
mod token;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::authz::User;
pub use crate::cluster::{Backend, TestCluster};
use crate::store::{ApiError, Key, Store};

/// The administrator's bearer token.
pub const ADMIN_TOKEN: &str = "admin-token";

/// What the routes share.
pub(crate) struct Shared {
    pub(crate) store: Mutex<Store>,
    /// Tells watches to end (the server is stopping).
    pub(crate) stopping: watch::Receiver<bool>,
}

impl Shared {
    pub(crate) fn store(&self) -> std::sync::MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The identity of a bearer token.
    pub(crate) fn user(token: &str) -> Option<User> {
        if token == ADMIN_TOKEN {
            return Some(User::Admin);
        }
        token
            .strip_prefix("node-token-")
            .map(|n| User::Node(n.to_string()))
    }
}

/// A running (or stopped) test server.
pub struct TestServer {
    addr: SocketAddr,
    store: Arc<Shared>,
    stop: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
}

impl TestServer {
    /// Starts a server on a free loopback port.
    pub async fn start() -> std::io::Result<TestServer> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (stop, stopping) = watch::channel(false);
        let store = Arc::new(Shared {
            store: Mutex::new(Store::default()),
            stopping,
        });
        let mut s = TestServer {
            addr,
            store,
            stop,
            task: None,
        };
        s.serve(listener);
        Ok(s)
    }

    fn serve(&mut self, listener: tokio::net::TcpListener) {
        let app = routes::router(self.store.clone());
        let mut stopping = self.stop.subscribe();
        self.task = Some(tokio::spawn(async move {
            let shutdown = async move {
                let _ = stopping.wait_for(|s| *s).await;
            };
            if let Err(e) = axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await
            {
                tracing::warn!("test API server: {e}");
            }
        }));
    }

    /// The server's URL (`http://127.0.0.1:<port>`).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The bearer token of node `name` (`system:node:<name>`).
    pub fn node_token(name: &str) -> String {
        format!("node-token-{name}")
    }

    /// A kubeconfig for `token`.
    pub fn kubeconfig(&self, token: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster: {{server: \"{}\"}}\nusers:\n- name: user\n  user: {{token: \"{token}\"}}\ncontexts:\n- name: test\n  context: {{cluster: test, user: user}}\ncurrent-context: test\n",
            self.url()
        )
    }

    /// A client of this server with `token`'s identity, made from [`TestServer::kubeconfig`]
    /// as any kubeconfig is read.
    pub async fn client(&self, token: &str) -> kube::Client {
        let file = kube::config::Kubeconfig::from_yaml(&self.kubeconfig(token))
            .expect("the test server's kubeconfig parses");
        let config = kube::Config::from_custom_kubeconfig(file, &Default::default())
            .await
            .expect("the test server's kubeconfig is complete");
        kube::Client::try_from(config).expect("a client of the test server")
    }

    /// Stops serving: open connections and watches end, new connections are refused. Objects
    /// are kept.
    pub async fn stop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take() {
            let abort = task.abort_handle();
            if tokio::time::timeout(Duration::from_secs(5), task)
                .await
                .is_err()
            {
                abort.abort();
            }
        }
    }

    /// Serves again on the same address.
    pub async fn restart(&mut self) -> std::io::Result<()> {
        let _ = self.stop.send(false);
        let listener = tokio::net::TcpListener::bind(self.addr).await?;
        self.serve(listener);
        Ok(())
    }

    /// Forgets the change history: a watch that resumes gets `410 Gone` and must list again.
    pub fn compact(&self) {
        self.store.store().compact();
    }

    /// The longest lifetime a service account token is granted (default: what is asked).
    pub fn set_max_token_lifetime(&self, max: Duration) {
        self.store.store().max_token_lifetime = Some(max);
    }

    /// Stops serving a resource (`clustertrustbundles`), as a server without that API: its
    /// paths answer 404.
    pub fn disable(&self, plural: &'static str) {
        self.store.store().disabled.insert(plural);
    }

    /// How many watches of a resource (`secrets`) are open. A watch whose client has gone ends
    /// at its next event or bookmark (one a second).
    pub fn open_watches(&self, plural: &str) -> usize {
        self.store.store().watchers(plural)
    }

    /// Serves streaming lists from a watch cache that has not caught up: their first events
    /// leave out every object that exists (a GET still finds it, and later changes are sent).
    pub fn lag_watch_cache(&self) {
        self.store.store().stale_streams = true;
    }

    /// Serves as a server with the WatchList feature off: a watch asking for the initial
    /// events (`sendInitialEvents`) is refused (422), and only list and watch remain.
    pub fn disable_watch_list(&self) {
        self.store.store().watch_list = false;
    }

    /// How many service account tokens were issued.
    pub fn tokens_issued(&self) -> u64 {
        self.store.store().tokens_issued
    }

    /// The requests nodes have made, by verb and resource (`watch configmaps`,
    /// `create serviceaccounts/token`, `patch nodes/status`).
    pub fn node_requests(&self) -> std::collections::BTreeMap<String, u64> {
        self.store.store().node_requests.clone()
    }

    /// Makes the authorizer learn the references of every pod it has now, ahead of its lag.
    pub fn learn_relations(&self) {
        self.store.store().learn_relations();
    }

    /// How long the authorizer takes to learn a new pod's references (default 0).
    pub fn set_relation_delay(&self, delay: Duration) {
        self.store.store().relation_delay = delay;
    }

    /// Creates an object (as the administrator, without a request): `obj` has its
    /// `apiVersion` and `kind`.
    pub fn create(&self, obj: Value) -> Result<Value, ApiError> {
        let (res, ns) = Self::place(&obj)?;
        self.store.store().create(res, &ns, obj)
    }

    /// Replaces an object, or creates it.
    pub fn apply(&self, obj: Value) -> Result<Value, ApiError> {
        let (res, ns) = Self::place(&obj)?;
        let key = Key {
            plural: res.plural,
            namespace: ns.clone(),
            name: obj
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .into(),
        };
        let mut s = self.store.store();
        if s.get(&key).is_some() {
            let mut obj = obj;
            if let Some(m) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
                m.remove("resourceVersion");
            }
            s.update(&key, res, obj)
        } else {
            s.create(res, &ns, obj)
        }
    }

    /// Deletes an object; `grace` as DeleteOptions' `gracePeriodSeconds`.
    pub fn delete(
        &self,
        group_version: &str,
        plural: &str,
        namespace: &str,
        name: &str,
        grace: Option<i64>,
    ) -> Result<Value, ApiError> {
        let key = Self::key(group_version, plural, namespace, name)
            .ok_or_else(|| ApiError::new(404, "NotFound", "no such resource"))?;
        self.store.store().delete(&key, grace)
    }

    /// One object, if it exists.
    pub fn get(
        &self,
        group_version: &str,
        plural: &str,
        namespace: &str,
        name: &str,
    ) -> Option<Value> {
        let key = Self::key(group_version, plural, namespace, name)?;
        self.store.store().get(&key).cloned()
    }

    /// The place of an object of a served resource (`namespace` is ignored for cluster-scoped
    /// ones).
    fn key(group_version: &str, plural: &str, namespace: &str, name: &str) -> Option<Key> {
        let res = store::resource(group_version, plural)?;
        Some(Key {
            plural: res.plural,
            namespace: if res.namespaced {
                namespace.into()
            } else {
                String::new()
            },
            name: name.into(),
        })
    }

    fn place(obj: &Value) -> Result<(&'static store::Resource, String), ApiError> {
        let gv = obj
            .get("apiVersion")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let kind = obj.get("kind").and_then(Value::as_str).unwrap_or_default();
        let res = store::RESOURCES
            .iter()
            .find(|r| r.group_version == gv && r.kind == kind)
            .ok_or_else(|| {
                ApiError::new(404, "NotFound", format!("no resource for {gv} {kind}"))
            })?;
        let ns = if res.namespaced {
            obj.pointer("/metadata/namespace")
                .and_then(Value::as_str)
                .filter(|n| !n.is_empty())
                .unwrap_or("default")
                .to_string()
        } else {
            String::new()
        };
        Ok((res, ns))
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}
