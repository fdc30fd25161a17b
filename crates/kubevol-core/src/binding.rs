//! Which PersistentVolume an unbound claim binds to, by the PersistentVolume controller's
//! rules, and why each other volume does not fit.
//!
//! A volume pre-bound to the claim (`spec.claimRef` naming it, and its UID if the reference
//! has one) is the claim's whatever else it says, unless it is being deleted or its node
//! affinity excludes the node. Otherwise a volume fits when nobody has it (no `claimRef`, not
//! taken by another binding), it is not being deleted, its capacity is at least the claim's
//! `resources.requests.storage`, its volumeMode, storage class and volume attributes class
//! are the claim's, its access modes include the claim's, its labels match the claim's
//! `selector`, and its node affinity admits this node. Of the volumes that fit, the one with
//! the fewest access modes wins, then the smallest; equal ones are told apart by name, so the
//! choice never depends on the order volumes were listed in.

use k8s_openapi::api::core::v1::{
    PersistentVolume, PersistentVolumeClaim, PersistentVolumeClaimSpec, PersistentVolumeSpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use crate::affinity::{self, NodeFacts};
use crate::quantity::Quantity;

/// The storage class annotation older objects use instead of `storageClassName`.
const BETA_CLASS_ANNOTATION: &str = "volume.beta.kubernetes.io/storage-class";

/// A claim's storage class: the beta annotation, else `spec.storageClassName`, else none
/// (`""`).
pub fn claim_class(claim: &PersistentVolumeClaim) -> &str {
    named_class(claim).unwrap_or_default()
}

/// The storage class a claim names (the beta annotation, else `spec.storageClassName`; `""`
/// names no class), or `None` when it names none at all (the default class applies).
pub fn named_class(claim: &PersistentVolumeClaim) -> Option<&str> {
    if let Some(c) = claim
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(BETA_CLASS_ANNOTATION))
    {
        return Some(c);
    }
    claim
        .spec
        .as_ref()
        .and_then(|s| s.storage_class_name.as_deref())
}

/// A volume's storage class: the beta annotation, else `spec.storageClassName`.
pub fn volume_class(pv: &PersistentVolume) -> &str {
    if let Some(c) = pv
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(BETA_CLASS_ANNOTATION))
    {
        return c;
    }
    pv.spec
        .as_ref()
        .and_then(|s| s.storage_class_name.as_deref())
        .unwrap_or_default()
}

/// Whether `pv`'s `claimRef` names the claim `namespace/claim` (and its UID, if the reference
/// has one).
pub fn pre_bound(pv: &PersistentVolume, namespace: &str, claim: &PersistentVolumeClaim) -> bool {
    claim_ref_names(
        pv,
        namespace,
        claim.metadata.name.as_deref().unwrap_or_default(),
        claim.metadata.uid.as_deref(),
    )
}

/// Whether `pv`'s `claimRef` names claim `namespace/name` of UID `uid`: a reference with a UID
/// names that claim only, never a later one of its name (for which the volume is Released),
/// and a claim of unknown UID only a reference without one.
pub fn claim_ref_names(
    pv: &PersistentVolume,
    namespace: &str,
    name: &str,
    uid: Option<&str>,
) -> bool {
    let Some(r) = pv.spec.as_ref().and_then(|s| s.claim_ref.as_ref()) else {
        return false;
    };
    r.namespace.as_deref() == Some(namespace)
        && r.name.as_deref() == Some(name)
        && match (r.uid.as_deref().filter(|u| !u.is_empty()), uid) {
            (Some(want), Some(has)) => want == has,
            (Some(_), None) => false,
            (None, _) => true,
        }
}

/// Whether `labels` match a label selector (its `matchLabels` and `matchExpressions` ANDed;
/// an unknown operator matches nothing).
pub fn selector_matches(
    selector: &LabelSelector,
    labels: &std::collections::BTreeMap<String, String>,
) -> bool {
    let by_label = selector
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    let by_expression = selector.match_expressions.iter().flatten().all(|e| {
        let values = e.values.as_deref().unwrap_or_default();
        let has = labels.get(&e.key);
        match e.operator.as_str() {
            "In" => has.is_some_and(|v| values.contains(v)),
            "NotIn" => has.is_none_or(|v| !values.contains(v)),
            "Exists" => has.is_some(),
            "DoesNotExist" => has.is_none(),
            _ => false,
        }
    });
    by_label && by_expression
}

/// A storage quantity in bytes, and as written (none: 0, `0`).
fn storage(q: Option<&k8s_openapi::apimachinery::pkg::api::resource::Quantity>) -> (i64, String) {
    match q {
        Some(q) => (Quantity::parse(&q.0).map_or(0, |q| q.value()), q.0.clone()),
        None => (0, "0".into()),
    }
}

/// The storage a claim asks for (`resources.requests.storage`), in bytes and as written, if
/// it asks.
pub fn requested(claim: &PersistentVolumeClaim) -> Option<(i64, String)> {
    let q = claim
        .spec
        .as_ref()?
        .resources
        .as_ref()?
        .requests
        .as_ref()?
        .get("storage")?;
    Some(storage(Some(q)))
}

/// A volume's capacity in bytes (none given: 0).
pub fn capacity(pv: &PersistentVolume) -> i64 {
    capacity_of(pv).0
}

fn capacity_of(pv: &PersistentVolume) -> (i64, String) {
    storage(
        pv.spec
            .as_ref()
            .and_then(|s| s.capacity.as_ref())
            .and_then(|c| c.get("storage")),
    )
}

fn mode(m: Option<&String>) -> &str {
    m.map_or("Filesystem", String::as_str)
}

/// Why one volume does not fit a claim: each reason, as a user reads it.
pub type Unfit = Vec<String>;

/// What [`find`] found.
#[derive(Debug, PartialEq)]
pub enum Found<'a> {
    /// The volume to bind.
    Volume(&'a PersistentVolume),
    /// None fits: each volume's name and why, closest first (the fewest reasons).
    Nothing(Vec<(String, Unfit)>),
}

/// The volume the claim `namespace/claim` of storage class `class` (the claim's own, or the
/// default class for a claim that names none) binds to among `volumes`, on `node`; `taken`
/// says which claim (`namespace/name`) already has a volume of that name.
pub fn find<'a>(
    namespace: &str,
    claim: &PersistentVolumeClaim,
    class: &str,
    volumes: &[&'a PersistentVolume],
    taken: &dyn Fn(&str) -> Option<String>,
    node: &NodeFacts,
) -> Found<'a> {
    let no_claim_spec = PersistentVolumeClaimSpec::default();
    let no_volume_spec = PersistentVolumeSpec::default();
    let spec = claim.spec.as_ref().unwrap_or(&no_claim_spec);
    let (want, want_text) = requested(claim).unwrap_or((0, "0".into()));
    let want_modes = spec.access_modes.as_deref().unwrap_or_default();
    let want_mode = mode(spec.volume_mode.as_ref());
    let want_class = class;
    let want_attributes = spec.volume_attributes_class_name.as_deref().unwrap_or("");
    let mut fits: Vec<&PersistentVolume> = Vec::new();
    let mut unfit: Vec<(String, Unfit)> = Vec::new();
    for &pv in volumes {
        let name = pv.metadata.name.clone().unwrap_or_default();
        let pv_spec = pv.spec.as_ref().unwrap_or(&no_volume_spec);
        let node_ok = pv_spec
            .node_affinity
            .as_ref()
            .and_then(|a| a.required.as_ref())
            .is_none_or(|s| affinity::matches(s, node));
        let deleting = pv.metadata.deletion_timestamp.is_some();
        let mine = pre_bound(pv, namespace, claim);
        let mut why: Unfit = Vec::new();
        if let Some(r) = pv_spec.claim_ref.as_ref().filter(|_| !mine) {
            why.push(format!(
                "its claimRef names claim {}/{}",
                r.namespace.as_deref().unwrap_or_default(),
                r.name.as_deref().unwrap_or_default()
            ));
        } else if let Some(other) = taken(&name).filter(|_| !mine) {
            why.push(format!("it is bound to claim {other}"));
        }
        // What even a volume pre-bound to the claim must have, as the PersistentVolume
        // controller checks it: the capacity, the volume mode, the attributes class, and not
        // being deleted.
        let (has, has_text) = capacity_of(pv);
        if has < want {
            why.push(format!(
                "its capacity {has_text} is less than the claim's request {want_text}"
            ));
        }
        let has_mode = mode(pv_spec.volume_mode.as_ref());
        if has_mode != want_mode {
            why.push(format!(
                "its volumeMode is {has_mode}, the claim's {want_mode}"
            ));
        }
        let has_attributes = pv_spec
            .volume_attributes_class_name
            .as_deref()
            .unwrap_or("");
        if has_attributes != want_attributes {
            why.push(format!(
                "its volumeAttributesClassName is {has_attributes:?}, the claim's {want_attributes:?}"
            ));
        }
        if deleting {
            why.push("it is being deleted".into());
        }
        if mine && why.is_empty() {
            // The claim's own volume, whatever its class, access modes and labels say; where
            // its nodeAffinity excludes the node, the claim binds to no other volume here.
            if node_ok {
                return Found::Volume(pv);
            }
            return Found::Nothing(vec![(
                name,
                vec![
                    "its claimRef names this claim, but its nodeAffinity excludes this node (the claim binds to no other volume)".into(),
                ],
            )]);
        }
        let has_class = volume_class(pv);
        if has_class != want_class {
            why.push(format!(
                "its storageClassName is {has_class:?}, the claim's {want_class:?}"
            ));
        }
        let modes = pv_spec.access_modes.clone().unwrap_or_default();
        let missing: Vec<&String> = want_modes.iter().filter(|m| !modes.contains(m)).collect();
        if !missing.is_empty() {
            why.push(format!(
                "its accessModes [{}] lack {}",
                modes.join(", "),
                missing
                    .iter()
                    .map(|m| m.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        if let Some(selector) = &spec.selector {
            let labels = pv.metadata.labels.clone().unwrap_or_default();
            if !selector_matches(selector, &labels) {
                why.push("its labels do not match the claim's selector".into());
            }
        }
        if !node_ok {
            why.push("its nodeAffinity excludes this node".into());
        }
        if why.is_empty() {
            fits.push(pv);
        } else {
            unfit.push((name, why));
        }
    }
    let key = |pv: &&PersistentVolume| {
        (
            pv.spec
                .as_ref()
                .and_then(|s| s.access_modes.as_ref())
                .map_or(0, Vec::len),
            capacity(pv),
            pv.metadata.name.clone().unwrap_or_default(),
        )
    };
    match fits.into_iter().min_by_key(key) {
        Some(pv) => Found::Volume(pv),
        None => {
            unfit.sort_by(|(a, x), (b, y)| x.len().cmp(&y.len()).then_with(|| a.cmp(b)));
            Found::Nothing(unfit)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pv(v: serde_json::Value) -> PersistentVolume {
        serde_json::from_value(v).unwrap()
    }

    fn volume(name: &str, size: &str, modes: &[&str]) -> serde_json::Value {
        json!({"metadata": {"name": name, "labels": {"tier": "fast"}},
               "spec": {"capacity": {"storage": size}, "accessModes": modes, "storageClassName": "local",
                        "hostPath": {"path": "/data"}}})
    }

    fn claim(extra: serde_json::Value) -> PersistentVolumeClaim {
        let mut c = json!({"metadata": {"name": "data", "namespace": "ns", "uid": "claim-uid"},
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}, "storageClassName": "local"}});
        if let (Some(c), Some(extra)) = (c["spec"].as_object_mut(), extra.as_object()) {
            c.extend(extra.clone());
        }
        serde_json::from_value(c).unwrap()
    }

    fn node() -> NodeFacts {
        NodeFacts {
            name: "node-1".into(),
            labels: [("zone".to_string(), "a".to_string())].into(),
        }
    }

    fn chosen(
        c: &PersistentVolumeClaim,
        pvs: &[PersistentVolume],
        taken: &dyn Fn(&str) -> Option<String>,
    ) -> Result<String, Vec<(String, Unfit)>> {
        let refs: Vec<&PersistentVolume> = pvs.iter().collect();
        match find("ns", c, claim_class(c), &refs, taken, &node()) {
            Found::Volume(v) => Ok(v.metadata.name.clone().unwrap()),
            Found::Nothing(why) => Err(why),
        }
    }

    #[test]
    fn the_smallest_volume_with_the_fewest_access_modes_that_fits_is_chosen() {
        let free = |_: &str| None;
        let pvs = [
            pv(volume("big", "10Gi", &["ReadWriteOnce"])),
            pv(volume("small", "2Gi", &["ReadWriteOnce"])),
            pv(volume("tiny", "512Mi", &["ReadWriteOnce"])),
            pv(volume(
                "many-modes",
                "1Gi",
                &["ReadWriteOnce", "ReadOnlyMany"],
            )),
            pv(volume("twin", "2Gi", &["ReadWriteOnce"])),
        ];
        assert_eq!(
            chosen(&claim(json!({})), &pvs, &free),
            Ok("small".into()),
            "fewest modes, then smallest, then by name"
        );
        let mut reversed = pvs.clone();
        reversed.reverse();
        assert_eq!(
            chosen(&claim(json!({})), &reversed, &free),
            Ok("small".into()),
            "whatever the order"
        );
        // Taken volumes are skipped.
        let taken = |n: &str| (n == "small" || n == "twin").then(|| "ns/other".to_string());
        assert_eq!(chosen(&claim(json!({})), &pvs, &taken), Ok("big".into()));
        // Only the two-mode volume has ReadOnlyMany.
        let c = claim(json!({"accessModes": ["ReadOnlyMany"]}));
        assert_eq!(chosen(&c, &pvs, &free), Ok("many-modes".into()));
    }

    #[test]
    fn a_volume_pre_bound_to_the_claim_is_its_own() {
        let mut mine = volume("mine", "1Gi", &["ReadOnlyMany"]);
        mine["spec"]["claimRef"] = json!({"namespace": "ns", "name": "data"});
        mine["spec"]["storageClassName"] = json!("other");
        let pvs = [
            pv(volume("fits", "1Gi", &["ReadWriteOnce"])),
            pv(mine.clone()),
        ];
        assert_eq!(
            chosen(&claim(json!({})), &pvs, &|_| None),
            Ok("mine".into()),
            "whatever else it says"
        );
        mine["spec"]["claimRef"]["uid"] = json!("another-uid");
        let pvs = [pv(volume("fits", "1Gi", &["ReadWriteOnce"])), pv(mine)];
        assert_eq!(
            chosen(&claim(json!({})), &pvs, &|_| None),
            Ok("fits".into()),
            "another claim of that name"
        );
    }

    /// As the PersistentVolume controller's FindMatchingVolume: a volume pre-bound to the
    /// claim must still have the capacity and the volume mode the claim asks for (else it is
    /// passed over like any other); where its nodeAffinity excludes the node, the claim binds
    /// to no volume at all, not to another that fits.
    #[test]
    fn a_pre_bound_volume_is_passed_over_only_for_capacity_or_mode_and_holds_the_claim_off_other_nodes(
    ) {
        let pre_bound = |extra: serde_json::Value| {
            let mut v = volume("mine", "1Gi", &["ReadWriteOnce"]);
            v["spec"]["claimRef"] = json!({"namespace": "ns", "name": "data"});
            if let (Some(spec), Some(extra)) = (v["spec"].as_object_mut(), extra.as_object()) {
                spec.extend(extra.clone());
            }
            pv(v)
        };
        let fits = || pv(volume("fits", "1Gi", &["ReadWriteOnce"]));
        let rows: Vec<(&str, PersistentVolume, Result<&str, &str>)> = vec![
            ("too small", pre_bound(json!({"capacity": {"storage": "100Mi"}})), Ok("fits")),
            ("another volume mode", pre_bound(json!({"volumeMode": "Block"})), Ok("fits")),
            (
                "another node",
                pre_bound(json!({"nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]}]}}})),
                Err("its claimRef names this claim, but its nodeAffinity excludes this node (the claim binds to no other volume)"),
            ),
            ("its own", pre_bound(json!({})), Ok("mine")),
        ];
        for (row, mine, want) in rows {
            let pvs = [fits(), mine];
            let got = chosen(&claim(json!({})), &pvs, &|_| None);
            match want {
                Ok(name) => assert_eq!(got, Ok(name.to_string()), "{row}"),
                Err(why) => assert_eq!(
                    got,
                    Err(vec![("mine".to_string(), vec![why.to_string()])]),
                    "{row}"
                ),
            }
        }
    }

    #[test]
    fn when_nothing_fits_the_closest_volumes_say_why() {
        let mut zoned = volume("zoned", "1Gi", &["ReadWriteOnce"]);
        zoned["spec"]["nodeAffinity"] = json!({"required": {"nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]}]}});
        let mut block = volume("block", "1Gi", &["ReadWriteOnce"]);
        block["spec"]["volumeMode"] = json!("Block");
        let mut other = volume("other-class", "100Mi", &["ReadOnlyMany"]);
        other["spec"]["storageClassName"] = json!("slow");
        let mut claimed = volume("claimed", "1Gi", &["ReadWriteOnce"]);
        claimed["spec"]["claimRef"] = json!({"namespace": "ns", "name": "someone"});
        let pvs = [
            pv(other),
            pv(zoned),
            pv(block),
            pv(claimed),
            pv(volume("bound", "5Gi", &["ReadWriteOnce"])),
        ];
        let taken = |n: &str| (n == "bound").then(|| "ns/first".to_string());
        let c = claim(json!({"selector": {"matchLabels": {"tier": "fast"}}}));
        let why = chosen(&c, &pvs, &taken).unwrap_err();
        let text: Vec<String> = why
            .iter()
            .map(|(n, w)| format!("{n}: {}", w.join("; ")))
            .collect();
        assert_eq!(
            text,
            [
                "block: its volumeMode is Block, the claim's Filesystem",
                "bound: it is bound to claim ns/first",
                "claimed: its claimRef names claim ns/someone",
                "zoned: its nodeAffinity excludes this node",
                "other-class: its capacity 100Mi is less than the claim's request 1Gi; its storageClassName is \"slow\", the claim's \"local\"; its accessModes [ReadOnlyMany] lack ReadWriteOnce",
            ]
        );
        let c = claim(
            json!({"selector": {"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["fast"]}]}}),
        );
        let why = chosen(&c, &[pv(volume("fast", "1Gi", &["ReadWriteOnce"]))], &taken).unwrap_err();
        assert_eq!(why[0].1, ["its labels do not match the claim's selector"]);
    }

    #[test]
    fn label_selectors_follow_the_api() {
        let labels = [("a".to_string(), "1".to_string())].into();
        let s = |v: serde_json::Value| -> LabelSelector { serde_json::from_value(v).unwrap() };
        assert!(selector_matches(
            &s(json!({"matchExpressions": [{"key": "b", "operator": "DoesNotExist"}]})),
            &labels
        ));
        assert!(!selector_matches(
            &s(json!({"matchExpressions": [{"key": "a", "operator": "DoesNotExist"}]})),
            &labels
        ));
        assert!(
            selector_matches(&s(json!({})), &labels),
            "empty: everything"
        );
        assert!(selector_matches(
            &s(json!({"matchLabels": {"a": "1"}})),
            &labels
        ));
        assert!(!selector_matches(
            &s(json!({"matchLabels": {"a": "2"}})),
            &labels
        ));
        assert!(selector_matches(
            &s(json!({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1", "2"]}]})),
            &labels
        ));
        assert!(selector_matches(
            &s(json!({"matchExpressions": [{"key": "b", "operator": "NotIn", "values": ["1"]}]})),
            &labels
        ));
        assert!(selector_matches(
            &s(json!({"matchExpressions": [{"key": "a", "operator": "Exists"}]})),
            &labels
        ));
        assert!(!selector_matches(
            &s(json!({"matchExpressions": [{"key": "a", "operator": "DoesNotExist"}]})),
            &labels
        ));
        assert!(
            !selector_matches(
                &s(json!({"matchExpressions": [{"key": "a", "operator": "Gt", "values": ["0"]}]})),
                &labels
            ),
            "not a label selector operator"
        );
    }

    #[test]
    fn the_beta_class_annotation_comes_first() {
        let c = claim(json!({}));
        assert_eq!(claim_class(&c), "local");
        let mut c = c;
        c.metadata.annotations =
            Some([(BETA_CLASS_ANNOTATION.to_string(), "old".to_string())].into());
        assert_eq!(claim_class(&c), "old");
        let v = pv(
            json!({"metadata": {"name": "x", "annotations": {BETA_CLASS_ANNOTATION: "old"}}, "spec": {"storageClassName": "new"}}),
        );
        assert_eq!(volume_class(&v), "old");
    }
}
