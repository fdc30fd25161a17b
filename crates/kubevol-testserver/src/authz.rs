//! Who may do what: an administrator anything; a node what the real API server's Node
//! authorizer and NodeRestriction admission let a kubelet do, and no more.
//!
//! - pods: list and watch only with the field selector `spec.nodeName=<node>`; get, delete
//!   and patch the status only of pods bound to the node;
//! - ConfigMaps and Secrets: get, and list or watch with the field selector
//!   `metadata.name=<name>`, only when a pod bound to the node references the object (a
//!   Secret also through a PersistentVolume's CSI source);
//! - PersistentVolumeClaims, PersistentVolumes and VolumeAttachments: get only ("can only get
//!   individual resources of this type"), only of a claim a pod of the node uses, the volume
//!   such a claim is bound to, an attachment to the node (one that does not exist is refused,
//!   not "not found"); a claim's status may be patched;
//! - the relationships are learnt from the pod after a delay
//!   ([`crate::TestServer::set_relation_delay`]), as the real authorizer's graph lags;
//! - ServiceAccounts: get only, of the account a pod bound to the node runs as (allowed by
//!   default since 1.34, for credential providers and pod certificates);
//! - its own Node (read by name only: "cannot read all nodes"; create, update and patch it and
//!   its status), CSIDrivers (read), its own CSINode, events.
//!
//! Each answer's status code is held to the real server's by a test that makes the same
//! requests of both (`crates/kubevol/tests/cluster.rs`).

use serde_json::Value;

use crate::store::{ApiError, Resource, Store};

/// The identity a request is made with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum User {
    /// Anything goes.
    Admin,
    /// `system:node:<name>` in the group `system:nodes`.
    Node(String),
}

/// What a request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verb {
    /// Read one object.
    Get,
    /// Read a collection.
    List,
    /// Watch a collection.
    Watch,
    /// Create.
    Create,
    /// Replace.
    Update,
    /// Merge-patch.
    Patch,
    /// Delete.
    Delete,
}

impl Verb {
    /// The verb as Kubernetes names it (`get`, `watch`, `patch`).
    pub fn name(self) -> &'static str {
        match self {
            Verb::Get => "get",
            Verb::List => "list",
            Verb::Watch => "watch",
            Verb::Create => "create",
            Verb::Update => "update",
            Verb::Patch => "patch",
            Verb::Delete => "delete",
        }
    }
}

/// One request, as the authorizer sees it.
pub struct Request<'a> {
    /// The verb.
    pub verb: Verb,
    /// The resource.
    pub resource: &'a Resource,
    /// The subresource (`status`), if any.
    pub subresource: Option<&'a str>,
    /// The namespace, if any.
    pub namespace: Option<&'a str>,
    /// The object's name (for get, update, patch, delete; from the body for create).
    pub name: Option<&'a str>,
    /// The field selector's equalities.
    pub fields: &'a [(String, String)],
}

fn forbidden(user: &str, r: &Request<'_>, why: &str) -> ApiError {
    let what = match r.subresource {
        Some(s) => format!("{}/{s}", r.resource.plural),
        None => r.resource.plural.to_string(),
    };
    let group = r
        .resource
        .group_version
        .rsplit_once('/')
        .map_or("", |(g, _)| g);
    let scope = match r.namespace {
        Some(ns) => format!("in the namespace \"{ns}\""),
        None => "at the cluster scope".to_string(),
    };
    ApiError::new(
        403,
        "Forbidden",
        format!(
            "{what}{} is forbidden: User \"{user}\" cannot {} resource \"{what}\" in API group \"{group}\" {scope}: {why}",
            r.name.map(|n| format!(" \"{n}\"")).unwrap_or_default(),
            r.verb.name()
        ),
    )
}

/// Whether `user` may make the request.
pub fn authorize(store: &Store, user: &User, r: &Request<'_>) -> Result<(), ApiError> {
    let User::Node(node) = user else {
        return Ok(());
    };
    let who = format!("system:node:{node}");
    let field = |k: &str| {
        r.fields
            .iter()
            .find(|(f, _)| f == k)
            .map(|(_, v)| v.as_str())
    };
    let read = matches!(r.verb, Verb::Get | Verb::List | Verb::Watch);
    let relation = |found: bool| relation_of(found, &who, node, r);
    // Allowed where a pod of the node references the object `name` of the request's kind.
    let relation_by_name = |name: Option<&str>| {
        relation(name.is_some_and(|name| {
            related(
                store,
                node,
                r.resource.plural,
                r.namespace.unwrap_or_default(),
                name,
            )
        }))
    };
    // The one object a read names: by its name, or by a metadata.name field selector.
    let named = match r.verb {
        Verb::Get => r.name,
        _ => field("metadata.name"),
    };
    match r.resource.plural {
        "pods" => match (r.verb, r.subresource) {
            (Verb::List | Verb::Watch, None) if field("spec.nodeName") == Some(node) => Ok(()),
            (Verb::List | Verb::Watch, None) => Err(forbidden(
                &who,
                r,
                "can only list/watch pods with spec.nodeName field selector",
            )),
            (Verb::Get | Verb::Delete, None) | (Verb::Patch | Verb::Update, Some("status")) => {
                let bound = r.namespace.zip(r.name).is_some_and(|(ns, name)| {
                    store.list("pods", Some(ns)).iter().any(|p| {
                        p.pointer("/metadata/name").and_then(Value::as_str) == Some(name)
                            && p.pointer("/spec/nodeName").and_then(Value::as_str) == Some(node)
                    })
                });
                relation(bound)
            }
            _ => Err(forbidden(&who, r, "a node may not do this to pods")),
        },
        "configmaps" | "secrets" if read && r.subresource.is_none() => relation_by_name(named),
        "serviceaccounts" if r.verb == Verb::Get && r.subresource.is_none() => {
            relation_by_name(r.name)
        }
        "persistentvolumeclaims"
            if r.subresource == Some("status") && matches!(r.verb, Verb::Patch | Verb::Update) =>
        {
            relation_by_name(r.name)
        }
        "persistentvolumeclaims" | "persistentvolumes" | "volumeattachments"
            if r.verb != Verb::Get =>
        {
            Err(forbidden(
                &who,
                r,
                "can only get individual resources of this type",
            ))
        }
        "persistentvolumeclaims" | "persistentvolumes" => relation_by_name(r.name),
        "volumeattachments" => {
            let key = crate::store::Key {
                plural: "volumeattachments",
                namespace: String::new(),
                name: r.name.unwrap_or_default().into(),
            };
            relation(store.get(&key).is_some_and(|va| {
                va.pointer("/spec/nodeName").and_then(Value::as_str) == Some(node.as_str())
            }))
        }
        "nodes" if read && r.subresource.is_none() => match named {
            Some(n) if n == node => Ok(()),
            Some(n) => Err(forbidden(
                &who,
                r,
                &format!("node '{node}' cannot read '{n}', only its own Node object"),
            )),
            None => Err(forbidden(
                &who,
                r,
                &format!("node '{node}' cannot read all nodes, only its own Node object"),
            )),
        },
        // NodeRestriction admits only the node's own Node.
        "nodes"
            if matches!(r.verb, Verb::Patch | Verb::Update | Verb::Create)
                && r.name == Some(node.as_str()) =>
        {
            Ok(())
        }
        "csidrivers" | "clustertrustbundles" if read => Ok(()),
        "csinodes" if r.name == Some(node.as_str()) && r.verb != Verb::Delete => Ok(()),
        "events" if matches!(r.verb, Verb::Create | Verb::Patch | Verb::Update) => Ok(()),
        _ => Err(forbidden(&who, r, "the node authorizer does not allow it")),
    }
}

/// Allowed where a relationship is found, as the real authorizer words it otherwise.
fn relation_of(found: bool, who: &str, node: &str, r: &Request<'_>) -> Result<(), ApiError> {
    if found {
        Ok(())
    } else {
        Err(forbidden(
            who,
            r,
            &format!("no relationship found between node '{node}' and this object"),
        ))
    }
}

/// Whether a pod bound to `node` (and known to the authorizer) references the object: the
/// store's index answers for what pods name directly; a PersistentVolume (and the Secrets of
/// its CSI source) through the node's pods' claims.
fn related(store: &Store, node: &str, plural: &'static str, namespace: &str, name: &str) -> bool {
    let direct = || {
        store
            .pods_referencing(plural, namespace, name)
            .any(|pod| store.known_pod_of(pod, node))
    };
    let volumes = || {
        let pods: Vec<&Value> = store
            .known_pods_of(node)
            .into_iter()
            .map(|(_, p)| p)
            .collect();
        volumes_of(store, &pods)
    };
    match plural {
        "configmaps" | "persistentvolumeclaims" | "serviceaccounts" => direct(),
        "secrets" => {
            direct()
                || volumes().iter().any(|pv| {
                    pv_secrets(pv)
                        .iter()
                        .any(|(ns, n)| ns == namespace && n == name)
                })
        }
        "persistentvolumes" => volumes()
            .iter()
            .any(|pv| pv.pointer("/metadata/name").and_then(Value::as_str) == Some(name)),
        _ => false,
    }
}

/// The PersistentVolumes the pods' claims are bound to.
fn volumes_of<'s>(store: &'s Store, pods: &[&Value]) -> Vec<&'s Value> {
    let mut out = Vec::new();
    for p in pods {
        let ns = p
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
            .unwrap_or_default();
        for claim in crate::refs::claims(p) {
            let key = crate::store::Key {
                plural: "persistentvolumeclaims",
                namespace: ns.into(),
                name: claim,
            };
            let Some(pv_name) = store
                .get(&key)
                .and_then(|c| c.pointer("/spec/volumeName"))
                .and_then(Value::as_str)
            else {
                continue;
            };
            let pv_key = crate::store::Key {
                plural: "persistentvolumes",
                namespace: String::new(),
                name: pv_name.into(),
            };
            out.extend(store.get(&pv_key));
        }
    }
    out
}

/// The Secrets a PersistentVolume's CSI source references: (namespace, name).
fn pv_secrets(pv: &Value) -> Vec<(String, String)> {
    [
        "nodeStageSecretRef",
        "nodePublishSecretRef",
        "nodeExpandSecretRef",
        "controllerPublishSecretRef",
    ]
    .iter()
    .filter_map(|f| pv.pointer(&format!("/spec/csi/{f}")))
    .filter_map(|r| {
        Some((
            r.get("namespace")?.as_str()?.to_string(),
            r.get("name")?.as_str()?.to_string(),
        ))
    })
    .collect()
}
