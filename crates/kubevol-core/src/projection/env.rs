//! A container's environment, as far as a node resolves it (literal values, downward API fields
//! and resources, ConfigMap and Secret keys), the `$(VAR)` expansion of `subPathExpr`, and keeping
//! Secret values out of messages.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, Pod};

use super::{field_value, pod_namespace, resource_value, Lookup, NodeAllocatable, Objects};

/// A container's environment, and which of its variables carry a Secret's value (read with
/// `secretKeyRef`, or expanded from such a variable): those values never appear in a message.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ContainerEnv {
    /// The variables' values.
    pub values: BTreeMap<String, String>,
    /// The names of the variables whose value comes from a Secret.
    pub secret: std::collections::BTreeSet<String>,
}

impl ContainerEnv {
    /// The Secret-derived values, to be kept out of messages.
    pub fn secret_values(&self) -> Vec<String> {
        self.secret
            .iter()
            .filter_map(|n| self.values.get(n))
            .filter(|v| !v.is_empty())
            .cloned()
            .collect()
    }
}

/// `text` with every one of `secrets` (longest first) replaced by a placeholder: a message
/// about something a Secret's value went into.
pub fn redact(text: &str, secrets: &[String]) -> String {
    let mut secrets: Vec<&String> = secrets.iter().filter(|s| !s.is_empty()).collect();
    secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
    secrets.into_iter().fold(text.to_string(), |t, s| {
        t.replace(s.as_str(), "<redacted: a Secret's value>")
    })
}

/// A container's environment as far as a node can resolve it without a cluster: literal values
/// (with `$(VAR)` references to earlier variables expanded), downward API fields and resources,
/// and ConfigMap and Secret keys. Variables that cannot be resolved are left out, so a
/// `subPathExpr` that uses them fails with a message naming them.
pub fn container_env(
    pod: &Pod,
    container: &Container,
    node_name: &str,
    objects: &dyn Objects,
    node: &NodeAllocatable,
) -> ContainerEnv {
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    let mut secret = std::collections::BTreeSet::new();
    let ns = pod_namespace(pod);
    for var in container.env.iter().flatten() {
        let mut from_secret = false;
        let value = if let Some(v) = &var.value {
            let used = std::cell::RefCell::new(Vec::new());
            let expanded = expand(v, |k| {
                used.borrow_mut().push(k.to_string());
                env.get(k).cloned()
            })
            .0;
            from_secret = used.borrow().iter().any(|k| secret.contains(k));
            Some(expanded)
        } else if let Some(from) = &var.value_from {
            if let Some(f) = &from.field_ref {
                match f.field_path.as_str() {
                    "spec.nodeName" => Some(
                        pod.spec
                            .as_ref()
                            .and_then(|s| s.node_name.clone())
                            .filter(|n| !n.is_empty())
                            .unwrap_or_else(|| node_name.to_string()),
                    ),
                    "spec.serviceAccountName" => Some(
                        pod.spec
                            .as_ref()
                            .and_then(|s| s.service_account_name.clone())
                            .unwrap_or_else(|| "default".into()),
                    ),
                    _ => field_value(pod, f).ok(),
                }
            } else if let Some(r) = &from.resource_field_ref {
                resource_value(pod, r, Some(&container.name), node).ok()
            } else if let Some(k) = &from.config_map_key_ref {
                match objects.config_map(ns, &k.name) {
                    Lookup::Found(cm) => cm.data.as_ref().and_then(|d| d.get(&k.key)).cloned(),
                    _ => None,
                }
            } else if let Some(k) = &from.secret_key_ref {
                from_secret = true;
                match objects.secret(ns, &k.name) {
                    Lookup::Found(s) => s
                        .data
                        .as_ref()
                        .and_then(|d| d.get(&k.key))
                        .and_then(|v| String::from_utf8(v.0.clone()).ok()),
                    _ => None,
                }
            } else {
                None
            }
        } else {
            Some(String::new())
        };
        match value {
            Some(v) => {
                env.insert(var.name.clone(), v);
            }
            None => {
                env.remove(&var.name);
            }
        }
        if from_secret {
            secret.insert(var.name.clone());
        } else {
            secret.remove(&var.name);
        }
    }
    ContainerEnv {
        values: env,
        secret,
    }
}

/// Expands `$(VAR)` references as the kubelet does: `$$` is a literal `$`, an unterminated
/// `$(` or a `$` before anything else is kept as written, and a reference `lookup` cannot
/// resolve is kept as written. Returns the result and the names that could not be resolved.
pub fn expand(input: &str, lookup: impl Fn(&str) -> Option<String>) -> (String, Vec<String>) {
    let mut out = String::with_capacity(input.len());
    let mut missing = Vec::new();
    let mut rest = input;
    while let Some(pos) = rest.find('$') {
        out.push_str(&rest[..pos]);
        let after = &rest[pos + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(tail) = after.strip_prefix('(') {
            match tail.find(')') {
                Some(end) => {
                    let name = &tail[..end];
                    match lookup(name) {
                        Some(v) => out.push_str(&v),
                        None => {
                            missing.push(name.to_string());
                            out.push_str("$(");
                            out.push_str(name);
                            out.push(')');
                        }
                    }
                    rest = &tail[end + 1..];
                }
                None => {
                    out.push_str("$(");
                    rest = tail;
                }
            }
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    (out, missing)
}

/// Expands a `subPathExpr` with a container's environment and checks the result as the kubelet
/// does: every variable defined and non-empty, the result relative and without `..`.
/// A path made with a Secret's value is not shown: the message names the variables instead.
pub fn expand_sub_path(expr: &str, env: &ContainerEnv) -> Result<String, String> {
    let used = std::cell::RefCell::new(Vec::new());
    let (out, missing) = expand(expr, |k| {
        used.borrow_mut().push(k.to_string());
        env.values.get(k).filter(|v| !v.is_empty()).cloned()
    });
    if !missing.is_empty() {
        return Err(format!(
            "subPathExpr {expr:?}: missing value for {}; define the variable in the container's env",
            missing.join(", ")
        ));
    }
    if let Some(d) = crate::validation::local_descending_path_error(&out) {
        let secret: Vec<String> = used
            .into_inner()
            .into_iter()
            .filter(|k| env.secret.contains(k))
            .collect();
        if !secret.is_empty() {
            return Err(format!(
                "subPathExpr {expr:?} expands to a path that {d} (not shown: it holds the value of {}, from a Secret)",
                secret.join(", ")
            ));
        }
        return Err(format!(
            "subPathExpr {expr:?} expands to {out:?}, which {d}"
        ));
    }
    Ok(out)
}
