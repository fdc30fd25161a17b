//! Node selectors: whether a node (its name and labels) matches a PersistentVolume's
//! `spec.nodeAffinity.required`, with the selector written out for messages.
//!
//! The rules are the API's: the terms are ORed, the requirements inside a term ANDed; a term
//! with no requirement matches nothing; `Gt` and `Lt` compare the label as an integer with the
//! one value given; `matchFields` may only name `metadata.name`.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorRequirement, NodeSelectorTerm};

/// A node as selectors see it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeFacts {
    /// `metadata.name`.
    pub name: String,
    /// `metadata.labels`.
    pub labels: BTreeMap<String, String>,
}

impl NodeFacts {
    /// The labels as `k=v, k=v`, for messages.
    pub fn describe_labels(&self) -> String {
        if self.labels.is_empty() {
            return "none".to_string();
        }
        self.labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Whether `node` matches one of the selector's terms. An invalid requirement (an unknown
/// operator, a `Gt` without exactly one integer) matches nothing, as in the API.
pub fn matches(selector: &NodeSelector, node: &NodeFacts) -> bool {
    selector
        .node_selector_terms
        .iter()
        .any(|t| term_matches(t, node))
}

fn term_matches(term: &NodeSelectorTerm, node: &NodeFacts) -> bool {
    let expressions = term.match_expressions.as_deref().unwrap_or_default();
    let fields = term.match_fields.as_deref().unwrap_or_default();
    if expressions.is_empty() && fields.is_empty() {
        return false;
    }
    expressions
        .iter()
        .all(|r| requirement_matches(r, node.labels.get(&r.key).map(String::as_str)))
        && fields.iter().all(|r| {
            r.key == "metadata.name"
                && matches!(r.operator.as_str(), "In" | "NotIn")
                && requirement_matches(r, Some(&node.name))
        })
}

fn requirement_matches(r: &NodeSelectorRequirement, value: Option<&str>) -> bool {
    let values = r.values.as_deref().unwrap_or_default();
    let number = || -> Option<(i64, i64)> {
        let [limit] = values else { return None };
        Some((value?.parse().ok()?, limit.parse().ok()?))
    };
    match r.operator.as_str() {
        "In" => value.is_some_and(|v| values.iter().any(|x| x == v)),
        "NotIn" => value.is_none_or(|v| values.iter().all(|x| x != v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" => number().is_some_and(|(v, limit)| v > limit),
        "Lt" => number().is_some_and(|(v, limit)| v < limit),
        _ => false,
    }
}

/// The selector in the label-selector syntax: `(a in (x, y), !b) or (c > 3)`.
pub fn describe(selector: &NodeSelector) -> String {
    let terms: Vec<String> = selector
        .node_selector_terms
        .iter()
        .map(|t| {
            let parts: Vec<String> = t
                .match_expressions
                .iter()
                .flatten()
                .map(|r| describe_requirement(&r.key, r))
                .chain(
                    t.match_fields
                        .iter()
                        .flatten()
                        .map(|r| describe_requirement(&format!("field {}", r.key), r)),
                )
                .collect();
            if parts.is_empty() {
                "(an empty term, which matches no node)".to_string()
            } else {
                format!("({})", parts.join(", "))
            }
        })
        .collect();
    if terms.is_empty() {
        "no term (which matches no node)".to_string()
    } else {
        terms.join(" or ")
    }
}

fn describe_requirement(key: &str, r: &NodeSelectorRequirement) -> String {
    let values = r.values.as_deref().unwrap_or_default();
    let list = values.join(", ");
    match r.operator.as_str() {
        "In" => format!("{key} in ({list})"),
        "NotIn" => format!("{key} notin ({list})"),
        "Exists" => key.to_string(),
        "DoesNotExist" => format!("!{key}"),
        "Gt" => format!("{key} > {list}"),
        "Lt" => format!("{key} < {list}"),
        other => format!("{key} {other:?} ({list}), an unknown operator"),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn selector(terms: serde_json::Value) -> NodeSelector {
        serde_json::from_value(json!({ "nodeSelectorTerms": terms })).unwrap()
    }

    fn node() -> NodeFacts {
        NodeFacts {
            name: "node-a".into(),
            labels: [
                ("kubernetes.io/hostname", "node-a"),
                ("disk", "ssd"),
                ("rank", "7"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        }
    }

    /// Each operator at its edges, one requirement per row: `DoesNotExist` of a label the node
    /// has and has not, `Gt`/`Lt` at, below and above the limit (strict), a value that is not
    /// a number.
    #[test]
    fn each_operator_at_its_edges() {
        let rows: &[(&str, &str, &[&str], bool)] = &[
            ("absent", "DoesNotExist", &[], true),
            ("disk", "DoesNotExist", &[], false),
            ("rank", "Gt", &["6"], true),
            ("rank", "Gt", &["7"], false),
            ("rank", "Lt", &["8"], true),
            ("rank", "Lt", &["7"], false),
            ("rank", "Lt", &["6"], false),
            ("disk", "Gt", &["1"], false),
            ("rank", "Gt", &["1", "2"], false),
        ];
        for (key, op, values, want) in rows {
            let s = selector(
                json!([{"matchExpressions": [{"key": key, "operator": op, "values": values}]}]),
            );
            assert_eq!(matches(&s, &node()), *want, "{key} {op} {values:?}");
        }
    }

    #[test]
    fn terms_are_ored_and_requirements_anded() {
        let req = |key: &str, op: &str, values: &[&str]| json!({"key": key, "operator": op, "values": values});
        let rows: Vec<(&str, serde_json::Value, bool)> = vec![
            (
                "In",
                json!([{"matchExpressions": [req("disk", "In", &["hdd", "ssd"])]}]),
                true,
            ),
            (
                "In, other value",
                json!([{"matchExpressions": [req("disk", "In", &["hdd"])]}]),
                false,
            ),
            (
                "In, no label",
                json!([{"matchExpressions": [req("zone", "In", &["a"])]}]),
                false,
            ),
            (
                "NotIn",
                json!([{"matchExpressions": [req("disk", "NotIn", &["hdd"])]}]),
                true,
            ),
            (
                "NotIn, no label",
                json!([{"matchExpressions": [req("zone", "NotIn", &["a"])]}]),
                true,
            ),
            (
                "NotIn, that value",
                json!([{"matchExpressions": [req("disk", "NotIn", &["ssd"])]}]),
                false,
            ),
            (
                "Exists",
                json!([{"matchExpressions": [{"key": "disk", "operator": "Exists"}]}]),
                true,
            ),
            (
                "DoesNotExist",
                json!([{"matchExpressions": [{"key": "disk", "operator": "DoesNotExist"}]}]),
                false,
            ),
            (
                "Gt",
                json!([{"matchExpressions": [req("rank", "Gt", &["3"])]}]),
                true,
            ),
            (
                "Gt, equal",
                json!([{"matchExpressions": [req("rank", "Gt", &["7"])]}]),
                false,
            ),
            (
                "Lt",
                json!([{"matchExpressions": [req("rank", "Lt", &["10"])]}]),
                true,
            ),
            (
                "Gt, two values",
                json!([{"matchExpressions": [req("rank", "Gt", &["3", "4"])]}]),
                false,
            ),
            (
                "Gt, not a number",
                json!([{"matchExpressions": [req("disk", "Gt", &["3"])]}]),
                false,
            ),
            (
                "unknown operator",
                json!([{"matchExpressions": [req("disk", "Like", &["ssd"])]}]),
                false,
            ),
            (
                "AND within a term",
                json!([{"matchExpressions": [req("disk", "In", &["ssd"]), req("rank", "Lt", &["5"])]}]),
                false,
            ),
            (
                "OR across terms",
                json!([{"matchExpressions": [req("disk", "In", &["hdd"])]}, {"matchExpressions": [req("rank", "Gt", &["5"])]}]),
                true,
            ),
            ("empty term", json!([{}]), false),
            ("no terms", json!([]), false),
            (
                "field",
                json!([{"matchFields": [req("metadata.name", "In", &["node-a"])]}]),
                true,
            ),
            (
                "field, other node",
                json!([{"matchFields": [req("metadata.name", "In", &["node-b"])]}]),
                false,
            ),
            (
                "field, other key",
                json!([{"matchFields": [req("metadata.uid", "In", &["node-a"])]}]),
                false,
            ),
            (
                "field, Exists",
                json!([{"matchFields": [{"key": "metadata.name", "operator": "Exists"}]}]),
                false,
            ),
        ];
        for (name, terms, want) in rows {
            assert_eq!(matches(&selector(terms), &node()), want, "row {name}");
        }
    }

    #[test]
    fn selectors_are_written_as_label_selectors() {
        let s = selector(json!([
            {"matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": ["node-b", "node-c"]},
                {"key": "gpu", "operator": "DoesNotExist"}]},
            {"matchExpressions": [{"key": "rank", "operator": "Gt", "values": ["3"]}],
             "matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["x"]}]}
        ]));
        assert_eq!(
            describe(&s),
            "(kubernetes.io/hostname in (node-b, node-c), !gpu) or (rank > 3, field metadata.name notin (x))"
        );
        assert_eq!(
            describe(&selector(json!([]))),
            "no term (which matches no node)"
        );
        assert_eq!(
            node().describe_labels(),
            "disk=ssd, kubernetes.io/hostname=node-a, rank=7"
        );
    }
}
