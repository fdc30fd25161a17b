//! The downward API: a pod's fields (labels and annotations in the kubelet's format, Go string
//! quoting) and its containers' resources (divided by the divisor, rounded up), as files and as
//! environment values.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Container, DownwardAPIVolumeFile, ObjectFieldSelector, Pod, ResourceFieldSelector,
};

use super::{
    insert, mode_of, pod_namespace, FileProjection, NodeAllocatable, Payload, ProjectionError,
};
use crate::quantity::Quantity;
use crate::validation::split_subscript;

pub(super) fn project_downward(
    pod: &Pod,
    field: &str,
    items: &[DownwardAPIVolumeFile],
    default_mode: u32,
    node: &NodeAllocatable,
    payload: &mut Payload,
) -> Result<(), ProjectionError> {
    for (i, item) in items.iter().enumerate() {
        let f = format!("{field}.items[{i}]");
        let value = match (&item.field_ref, &item.resource_field_ref) {
            (Some(r), None) => field_value(pod, r).map_err(|detail| ProjectionError::Field {
                field: format!("{f}.fieldRef"),
                detail,
            })?,
            (None, Some(r)) => {
                resource_value(pod, r, None, node).map_err(|detail| ProjectionError::Field {
                    field: format!("{f}.resourceFieldRef"),
                    detail,
                })?
            }
            _ => {
                return Err(ProjectionError::Field {
                    field: f,
                    detail: "exactly one of fieldRef and resourceFieldRef is required".into(),
                })
            }
        };
        insert(
            payload,
            &item.path,
            FileProjection {
                data: value.into_bytes(),
                mode: mode_of(item.mode, default_mode),
            },
        )?;
    }
    Ok(())
}

/// Quotes a string as Go's `%q` does (the kubelet's label and annotation format).
pub fn go_quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{7}' => out.push_str("\\a"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\u{b}' => out.push_str("\\v"),
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32))
            }
            c if c.is_control() => {
                let n = c as u32;
                if n <= 0xffff {
                    out.push_str(&format!("\\u{n:04x}"));
                } else {
                    out.push_str(&format!("\\U{n:08x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Labels or annotations as the kubelet writes them: sorted `key="value"` lines, no trailing
/// newline.
pub fn format_map(m: Option<&BTreeMap<String, String>>) -> String {
    m.into_iter()
        .flatten()
        .map(|(k, v)| format!("{k}={}", go_quote(v)))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The value of a downward API fieldRef (the fields a volume may read).
pub fn field_value(pod: &Pod, r: &ObjectFieldSelector) -> Result<String, String> {
    let meta = &pod.metadata;
    if let Some((base, key)) = split_subscript(&r.field_path) {
        let map = match base {
            "metadata.labels" => meta.labels.as_ref(),
            "metadata.annotations" => meta.annotations.as_ref(),
            _ => return Err(format!("unsupported fieldPath {:?}", r.field_path)),
        };
        return Ok(map.and_then(|m| m.get(key)).cloned().unwrap_or_default());
    }
    Ok(match r.field_path.as_str() {
        "metadata.name" => meta.name.clone().unwrap_or_default(),
        "metadata.namespace" => pod_namespace(pod).to_string(),
        "metadata.uid" => meta.uid.clone().unwrap_or_default(),
        "metadata.labels" => format_map(meta.labels.as_ref()),
        "metadata.annotations" => format_map(meta.annotations.as_ref()),
        other => return Err(format!("unsupported fieldPath {other:?}")),
    })
}

fn container_named<'a>(pod: &'a Pod, name: &str) -> Option<&'a Container> {
    let spec = pod.spec.as_ref()?;
    spec.containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .find(|c| c.name == name)
}

fn div_ceil(a: i64, b: i64) -> i64 {
    if b <= 0 {
        return a;
    }
    if a <= 0 {
        return a / b;
    }
    (a + b - 1) / b
}

/// The value of a resourceFieldRef: the container's limit or request divided by the divisor,
/// rounded up. A missing limit is the node's allocatable; a missing request is the limit when
/// one is set (the API server's defaulting), else zero. `container` overrides the selector's
/// container name (an env var refers to its own container).
pub fn resource_value(
    pod: &Pod,
    r: &ResourceFieldSelector,
    container: Option<&str>,
    node: &NodeAllocatable,
) -> Result<String, String> {
    let name = container
        .or(r.container_name.as_deref())
        .filter(|n| !n.is_empty())
        .ok_or("containerName is required")?;
    let c = container_named(pod, name).ok_or_else(|| format!("container {name:?} not found"))?;
    let (kind, res) = r
        .resource
        .split_once('.')
        .ok_or_else(|| format!("unsupported resource {:?}", r.resource))?;
    let get = |m: Option<
        &BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>,
    >| { m.and_then(|m| m.get(res)).map(|q| Quantity::parse(&q.0)) };
    let resources = c.resources.as_ref();
    let limit = get(resources.and_then(|r| r.limits.as_ref()));
    let request = get(resources.and_then(|r| r.requests.as_ref()));
    let parsed = match kind {
        "limits" => limit,
        "requests" => request.or(limit),
        _ => return Err(format!("unsupported resource {:?}", r.resource)),
    };
    let q = match parsed {
        Some(q) => Some(q.map_err(|e| format!("{}: {e}", r.resource))?),
        None => None,
    };
    let divisor = match &r.divisor {
        Some(d) => Quantity::parse(&d.0).map_err(|e| format!("divisor {:?}: {e}", d.0))?,
        None => Quantity::parse("1").map_err(|e| e.to_string())?,
    };
    let v = match res {
        "cpu" => {
            let milli = match (q, kind) {
                (Some(q), _) => q.milli_value(),
                (None, "limits") => node.cpu_milli,
                (None, _) => 0,
            };
            div_ceil(milli, divisor.milli_value())
        }
        "memory" | "ephemeral-storage" => {
            let bytes = match (q, kind) {
                (Some(q), _) => q.value(),
                (None, "limits") if res == "memory" => node.memory,
                (None, "limits") => node.ephemeral_storage,
                (None, _) => 0,
            };
            div_ceil(bytes, divisor.value())
        }
        r if r.starts_with("hugepages-") => {
            div_ceil(q.map(|q| q.value()).unwrap_or(0), divisor.value())
        }
        other => return Err(format!("unsupported resource {other:?}")),
    };
    Ok(v.to_string())
}
