//! What the project's control plane records of its nodes: the API server's audit log
//! (`DIR/audit.log`, every request of group `system:nodes`, JSON lines) and the CPU its
//! kube-apiserver and etcd have used (`DIR/processes`).

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

/// One request of a node, as the API server's audit log has it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeRequest {
    /// `get`, `list`, `watch`, `create`, `patch`, ...
    pub verb: String,
    /// The resource, with its subresource (`nodes/status`).
    pub resource: String,
    /// The namespace and name asked for, `ns/name` (either may be empty).
    pub object: String,
    /// The answer's status code.
    pub code: u16,
    /// When the server received it.
    pub at: Option<k8s_openapi::jiff::Timestamp>,
    /// The name a list or watch selects (`fieldSelector=metadata.name=<name>`).
    pub selected: Option<String>,
    /// Whether its answer has ended (a watch closed: the log has its `ResponseComplete`).
    pub ended: bool,
}

impl NodeRequest {
    /// `verb resource`, the key requests are counted by (`list secrets`).
    pub fn what(&self) -> String {
        format!("{} {}", self.verb, self.resource)
    }
}

/// Every node's requests in the audit log of the control plane in `dir`, in order, each with
/// the node's name (of user `system:node:<name>`); `keep` chooses by node name. A request is
/// there once, though the log has a long-running one (a watch) twice: when its answer
/// started and when it ended.
pub fn node_requests(dir: &Path, keep: impl Fn(&str) -> bool) -> Vec<(String, NodeRequest)> {
    use std::io::BufRead;
    // Line by line: the log of a long-lived control plane grows to hundreds of megabytes,
    // which a benchmark reading it whole would count as its own memory.
    let Ok(log) = std::fs::File::open(dir.join("audit.log")) else {
        return Vec::new();
    };
    let mut at: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    let mut out: Vec<(String, NodeRequest)> = Vec::new();
    for e in std::io::BufReader::new(log)
        .lines()
        .map_while(Result::ok)
        .filter(|l| l.contains("\"system:node:"))
        .filter_map(|l| serde_json::from_str::<Value>(&l).ok())
    {
        let Some(node) = e["user"]["username"]
            .as_str()
            .and_then(|u| u.strip_prefix("system:node:"))
        else {
            continue;
        };
        let Some(id) = e["auditID"].as_str() else {
            continue;
        };
        if !keep(node) {
            continue;
        }
        let ended = matches!(e["stage"].as_str(), Some("ResponseComplete" | "Panic"));
        match at.get(id) {
            Some(&i) => out[i].1.ended |= ended,
            None => {
                at.insert(id.to_string(), out.len());
                let mut r = request(&e);
                r.ended = ended;
                out.push((node.to_string(), r));
            }
        }
    }
    out
}

fn request(e: &Value) -> NodeRequest {
    let o = &e["objectRef"];
    let text = |v: &Value| v.as_str().unwrap_or_default().to_string();
    let mut resource = text(&o["resource"]);
    if let Some(sub) = o["subresource"].as_str() {
        resource = format!("{resource}/{sub}");
    }
    let uri = text(&e["requestURI"]);
    let selected = uri
        .split_once("fieldSelector=metadata.name%3D")
        .map(|(_, rest)| rest.split('&').next().unwrap_or_default().to_string());
    NodeRequest {
        verb: text(&e["verb"]),
        resource,
        object: format!("{}/{}", text(&o["namespace"]), text(&o["name"])),
        code: e["responseStatus"]["code"].as_u64().unwrap_or(0) as u16,
        at: e["requestReceivedTimestamp"]
            .as_str()
            .and_then(|t| t.parse().ok()),
        selected,
        ended: false,
    }
}

/// `requests` counted by [`NodeRequest::what`].
pub fn count<'a>(requests: impl IntoIterator<Item = &'a NodeRequest>) -> BTreeMap<String, u64> {
    let mut counts = BTreeMap::new();
    for r in requests {
        *counts.entry(r.what()).or_default() += 1;
    }
    counts
}

/// The CPU seconds the kube-apiserver and etcd of the control plane in `dir` have used so far
/// (from `/proc`); `None` when they are not running.
pub fn server_cpu_seconds(dir: &Path) -> Option<f64> {
    let processes = std::fs::read_to_string(dir.join("processes")).ok()?;
    let mut total = 0.0;
    for line in processes.lines() {
        let Some(("kube-apiserver" | "etcd", pid)) = line.split_once(' ') else {
            continue;
        };
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
        // utime and stime, the 14th and 15th fields, in USER_HZ (100) ticks.
        let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok());
        total += (ticks(11)? + ticks(12)?) / 100.0;
    }
    Some(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A watch is logged when its answer starts and again when it ends; a request of a user
    /// that is not a node is not a node's.
    #[test]
    fn a_watch_logged_twice_is_one_request_and_only_nodes_count() {
        let dir = tempfile::tempdir().unwrap();
        let line = |id: &str, user: &str, verb: &str, stage: &str| {
            serde_json::json!({"auditID": id, "stage": stage, "verb": verb,
                "user": {"username": user},
                "requestURI": "/api/v1/namespaces/ns/secrets?fieldSelector=metadata.name%3Ds1&watch=true",
                "objectRef": {"resource": "secrets", "namespace": "ns"},
                "responseStatus": {"code": 200},
                "requestReceivedTimestamp": "2026-11-28T19:00:00.000001Z"})
            .to_string()
        };
        let log = [
            line("a", "system:node:n1", "watch", "ResponseStarted"),
            line("b", "system:node:n2", "list", "ResponseComplete"),
            line("a", "system:node:n1", "watch", "ResponseComplete"),
            line("c", "kubevol-test-admin", "list", "ResponseComplete"),
        ]
        .join("\n");
        std::fs::write(dir.path().join("audit.log"), log).unwrap();
        let all = node_requests(dir.path(), |_| true);
        assert_eq!(all.len(), 2, "{all:#?}");
        assert_eq!(all[0].0, "n1");
        assert_eq!(all[0].1.selected.as_deref(), Some("s1"));
        assert_eq!(all[0].1.object, "ns/");
        let n2 = node_requests(dir.path(), |n| n == "n2");
        assert_eq!(
            count(n2.iter().map(|(_, r)| r)),
            BTreeMap::from([("list secrets".to_string(), 1)])
        );
    }
}
