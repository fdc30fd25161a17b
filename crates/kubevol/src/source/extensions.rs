//! What a pod's manifest says of its volumes beyond the API types kubevol is built with. The
//! typed pod drops a field its types do not know; this compares the manifest's volumes with
//! the typed ones, so that newer fields are not lost silently: `emptyDir.mode` (Kubernetes
//! 1.37, alpha) is read and honoured, every other unknown field is reported by its path.

use k8s_openapi::api::core::v1::Pod;
use kubevol_core::state::{PodExtensions, VolumeExtensions};
use serde_json::Value;

use super::unknown::{Part, Unknown};

/// The highest `emptyDir.mode`: the permission bits and the sticky bit.
pub const MAX_EMPTY_DIR_MODE: i64 = 0o1777;

/// The extensions of `pod`'s volumes, and the fields it sets that the types do not have, from
/// `raw` (the pod as its manifest or the API server wrote it) and `unknown` (what
/// [`super::unknown`] found in it). `locate` says where a field is in its manifest, when there
/// is one. Errors are the API server's validation errors of the
/// fields read here, each with the index of its volume (the field is that volume's
/// `emptyDir.mode`).
pub fn pod_extensions(
    raw: &Value,
    pod: &Pod,
    unknown: Vec<Unknown>,
    locate: &dyn Fn(&[Part]) -> Option<String>,
) -> Result<PodExtensions, Vec<(usize, String)>> {
    let mut out = PodExtensions::default();
    let mut errors = Vec::new();
    let typed = pod
        .spec
        .as_ref()
        .and_then(|s| s.volumes.as_deref())
        .unwrap_or_default();
    let raw_volumes = raw
        .pointer("/spec/volumes")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let mut volumes: Vec<VolumeExtensions> = vec![VolumeExtensions::default(); typed.len()];
    for (i, (raw, ext)) in raw_volumes.iter().zip(&mut volumes).enumerate() {
        let path = format!("spec.volumes[{i}]");
        if let Some(mode) = raw
            .get("emptyDir")
            .and_then(|e| e.get("mode"))
            .filter(|m| !m.is_null())
        {
            match mode.as_i64().filter(|m| (0..=MAX_EMPTY_DIR_MODE).contains(m)) {
                Some(m) => ext.empty_dir_mode = u32::try_from(m).ok(),
                None => errors.push((
                    i,
                    format!("{path}.emptyDir.mode: Invalid value: {mode}: must be a number between 0 and 01777 (octal), both inclusive"),
                )),
            }
        }
    }
    for (i, (raw, ext)) in raw_volumes.iter().zip(&mut volumes).enumerate() {
        read_users(raw, ext, &format!("spec.volumes[{i}]"), &mut |e| {
            errors.push((i, e))
        });
    }
    for unknown in unknown {
        let field = unknown.field(locate(&unknown.path));
        match unknown.path.as_slice() {
            [Part::Key(s), Part::Key(v), Part::Index(i), rest @ ..]
                if s == "spec" && v == "volumes" && *i < volumes.len() =>
            {
                // Read and honoured above.
                let mode =
                    matches!(rest, [Part::Key(e), Part::Key(m)] if e == "emptyDir" && m == "mode");
                if !mode && !is_user_field(rest) {
                    volumes[*i].unknown_fields.push(field);
                }
            }
            _ => out.unknown_fields.push(field),
        }
    }
    for (typed, ext) in typed.iter().zip(volumes) {
        if ext != VolumeExtensions::default() {
            out.volumes.insert(typed.name.clone(), ext);
        }
    }
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(errors)
    }
}

/// The volume kinds whose files the atomic writer makes, and may own by `defaultUser`.
const ATOMIC: [&str; 4] = ["secret", "configMap", "downwardAPI", "projected"];

/// The most a `defaultUser` or `user` may be (the API server's `IsValidUserID`).
const MAX_USER: i64 = 2_147_483_647;

/// Whether a volume's field path (below `spec.volumes[i]`) is a `defaultUser` or `user` field
/// of Kubernetes 1.37 (`AtomicWriteVolumeUserFields`), read by [`read_users`].
fn is_user_field(rest: &[Part]) -> bool {
    let key = |p: &Part, k: &str| matches!(p, Part::Key(x) if x == k);
    match rest {
        [kind, last] => ATOMIC.iter().any(|k| key(kind, k)) && key(last, "defaultUser"),
        [kind, items, Part::Index(_), last] => {
            ["secret", "configMap", "downwardAPI"]
                .iter()
                .any(|k| key(kind, k))
                && key(items, "items")
                && key(last, "user")
        }
        [p, sources, Part::Index(_), source, items, Part::Index(_), last] => {
            key(p, "projected")
                && key(sources, "sources")
                && ["secret", "configMap", "downwardAPI"]
                    .iter()
                    .any(|k| key(source, k))
                && key(items, "items")
                && key(last, "user")
        }
        [p, sources, Part::Index(_), source, last] => {
            key(p, "projected")
                && key(sources, "sources")
                && [
                    "serviceAccountToken",
                    "clusterTrustBundle",
                    "podCertificate",
                ]
                .iter()
                .any(|k| key(source, k))
                && key(last, "user")
        }
        _ => false,
    }
}

/// A list field of `v`, read in place (empty when absent or not a list).
fn list<'a>(v: &'a Value, key: &str) -> &'a [Value] {
    v.get(key)
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default()
}

/// Reads the `defaultUser` and `user` fields of one volume (`raw`, at `path`) into `ext`,
/// each checked as the API server checks it; `error` gets what is refused.
fn read_users(raw: &Value, ext: &mut VolumeExtensions, path: &str, error: &mut dyn FnMut(String)) {
    let mut user = |v: Option<&Value>, field: String| -> Option<u32> {
        let v = v.filter(|v| !v.is_null())?;
        match v.as_i64().filter(|u| (0..=MAX_USER).contains(u)) {
            Some(u) => u32::try_from(u).ok(),
            None => {
                error(format!(
                    "{field}: Invalid value: {v}: must be between 0 and {MAX_USER}, inclusive"
                ));
                None
            }
        }
    };
    for kind in ATOMIC {
        let Some(source) = raw.get(kind) else {
            continue;
        };
        ext.default_user = user(
            source.get("defaultUser"),
            format!("{path}.{kind}.defaultUser"),
        );
        if kind != "projected" {
            for (j, item) in list(source, "items").iter().enumerate() {
                if let Some(u) = user(item.get("user"), format!("{path}.{kind}.items[{j}].user")) {
                    ext.item_users.insert((0, j), u);
                }
            }
            continue;
        }
        for (i, s) in list(source, "sources").iter().enumerate() {
            let at = format!("{path}.projected.sources[{i}]");
            for inner in ["secret", "configMap", "downwardAPI"] {
                let Some(inner_source) = s.get(inner) else {
                    continue;
                };
                for (j, item) in list(inner_source, "items").iter().enumerate() {
                    let field = format!("{at}.{inner}.items[{j}].user");
                    if let Some(u) = user(item.get("user"), field) {
                        ext.item_users.insert((i, j), u);
                    }
                }
            }
            for own in [
                "serviceAccountToken",
                "clusterTrustBundle",
                "podCertificate",
            ] {
                let Some(own_source) = s.get(own) else {
                    continue;
                };
                if let Some(u) = user(own_source.get("user"), format!("{at}.{own}.user")) {
                    ext.source_users.insert(i, u);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// `defaultUser` and `user` (Kubernetes 1.37) are read where the API has them, checked as
    /// the API server checks them, and not reported as unknown fields.
    #[test]
    fn default_user_and_item_users_are_read_and_checked() {
        let ext = extensions(json!([
            {"name": "s", "secret": {"secretName": "s", "defaultUser": 1000, "items": [{"key": "k", "path": "p", "user": 2000}]}},
            {"name": "p", "projected": {"defaultUser": 0, "sources": [
                {"configMap": {"name": "c", "items": [{"key": "k", "path": "q", "user": 3000}]}},
                {"serviceAccountToken": {"path": "t", "user": 4000}}]}},
        ]))
        .unwrap();
        let s = &ext.volumes["s"];
        assert_eq!(
            (s.default_user, s.item_users.clone()),
            (Some(1000), [((0, 0), 2000)].into())
        );
        assert!(s.unknown_fields.is_empty(), "{s:?}");
        let p = &ext.volumes["p"];
        assert_eq!(p.default_user, Some(0));
        assert_eq!(p.item_users, [((0, 0), 3000)].into());
        assert_eq!(p.source_users, [(1, 4000)].into());
        assert!(
            p.unknown_fields.is_empty() && ext.unknown_fields.is_empty(),
            "{ext:?}"
        );
        let errors = extensions(json!([
            {"name": "d", "downwardAPI": {"defaultUser": -1, "items": [{"path": "x", "fieldRef": {"fieldPath": "metadata.name"}, "user": 2147483648_i64}]}},
        ]))
        .unwrap_err();
        assert_eq!(
            errors,
            [
                "spec.volumes[0].downwardAPI.defaultUser: Invalid value: -1: must be between 0 and 2147483647, inclusive",
                "spec.volumes[0].downwardAPI.items[0].user: Invalid value: 2147483648: must be between 0 and 2147483647, inclusive",
            ]
        );
    }

    fn extensions(volumes: Value) -> Result<PodExtensions, Vec<String>> {
        let raw = json!({"spec": {"containers": [], "volumes": volumes}});
        let pod: Pod = serde_json::from_value(raw.clone()).unwrap();
        let unknown = crate::source::unknown::unknown_fields::<Pod>(&raw);
        pod_extensions(&raw, &pod, unknown, &|_| None)
            .map_err(|e| e.into_iter().map(|(_, m)| m).collect())
    }

    #[test]
    fn empty_dir_mode_is_read_and_other_unknown_fields_are_named() {
        let ext = extensions(json!([
            {"name": "a", "emptyDir": {"medium": "Memory", "mode": 0o1770}},
            {"name": "b", "emptyDir": {}},
            {"name": "c", "configMap": {"name": "x", "items": [{"key": "k", "path": "p", "future": true}], "shiny": 1}, "alsoNew": {}},
            {"name": "d", "secret": {"secretName": "s", "nullIsNotSet": null}},
        ]))
        .unwrap();
        assert_eq!(ext.volumes.len(), 2, "{ext:?}");
        assert_eq!(
            ext.volumes["a"],
            VolumeExtensions {
                empty_dir_mode: Some(0o1770),
                ..Default::default()
            }
        );
        let paths: Vec<&str> = ext.volumes["c"]
            .unknown_fields
            .iter()
            .map(|f| f.path.as_str())
            .collect();
        assert_eq!(
            paths,
            vec![
                "spec.volumes[2].alsoNew",
                "spec.volumes[2].configMap.items[0].future",
                "spec.volumes[2].configMap.shiny"
            ]
        );
    }

    #[test]
    fn empty_dir_mode_is_validated_as_the_api_server_does() {
        for bad in [json!(0o2000), json!(-1), json!("0750"), json!(1.5)] {
            let err = extensions(json!([{"name": "a", "emptyDir": {"mode": bad}}])).unwrap_err();
            assert_eq!(err.len(), 1);
            assert!(
                err[0].starts_with("spec.volumes[0].emptyDir.mode: Invalid value: "),
                "{err:?}"
            );
            assert!(
                err[0].ends_with("must be a number between 0 and 01777 (octal), both inclusive"),
                "{err:?}"
            );
        }
        assert_eq!(
            extensions(json!([{"name": "a", "emptyDir": {"mode": 0}}]))
                .unwrap()
                .volumes["a"]
                .empty_dir_mode,
            Some(0)
        );
    }
}
