//! TokenRequest (`POST .../serviceaccounts/<name>/token`): a JWT-shaped token bound to a pod,
//! with the claims a real server puts in it, issued only as the real server issues it to a
//! node: for a pod bound to that node, for the pod's own service account, and (NodeRestriction's
//! audience check) for at most one audience that the pod's spec names — a projected
//! `serviceAccountToken` source's `audience` (`""` when unset), or a `tokenRequests` audience of
//! the CSIDriver of one of its CSI volumes, inline or through a claim.

use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::authz::User;
use crate::store::{rfc3339, ApiError, Key};
use crate::Shared;

fn base64url(data: &[u8]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..=chunk.len() {
            out.push(char::from(ABC[(n >> (18 - 6 * i) & 63) as usize]));
        }
    }
    out
}

/// Issues a token of service account `ns/name` as `user` asks in `body` (a TokenRequest).
pub(crate) fn issue(
    s: &Shared,
    user: &User,
    ns: &str,
    name: &str,
    body: &Value,
) -> Result<Value, ApiError> {
    let mut store = s.store();
    let expiration = body
        .pointer("/spec/expirationSeconds")
        .and_then(Value::as_i64)
        .unwrap_or(3600);
    if expiration < 600 {
        return Err(ApiError::new(422, "Invalid", format!("TokenRequest.authentication.k8s.io \"{name}\" is invalid: spec.expirationSeconds: Invalid value: {expiration}: may not specify a duration less than 10 minutes")));
    }
    let sa_key = Key {
        plural: "serviceaccounts",
        namespace: ns.into(),
        name: name.into(),
    };
    let sa_uid = store
        .get(&sa_key)
        .and_then(|sa| sa.pointer("/metadata/uid"))
        .and_then(Value::as_str)
        .map(String::from)
        .ok_or_else(|| {
            ApiError::new(
                404,
                "NotFound",
                format!("serviceaccounts \"{name}\" not found"),
            )
        })?;
    let bound = body.pointer("/spec/boundObjectRef");
    let pod = match bound {
        Some(r) => {
            let kind = r.get("kind").and_then(Value::as_str).unwrap_or_default();
            if kind != "Pod" {
                return Err(ApiError::new(422, "Invalid", format!("spec.boundObjectRef.kind: Unsupported value: {kind:?}: supported values: \"Pod\", \"Secret\", \"Node\"")));
            }
            let pod_name = r.get("name").and_then(Value::as_str).unwrap_or_default();
            let key = Key {
                plural: "pods",
                namespace: ns.into(),
                name: pod_name.into(),
            };
            // NodeRestriction looks a node's TokenRequest's pod up in its own informer, which
            // learns a new pod moments after it is made: until then the pod is not found.
            if matches!(user, User::Node(_)) && !store.admission_knows(&key) {
                let mut e = ApiError::new(404, "NotFound", format!("pod \"{pod_name}\" not found"));
                e.details = Some(("pod", pod_name.to_string()));
                return Err(e);
            }
            let pod = store.get(&key).cloned().ok_or_else(|| {
                ApiError::new(404, "NotFound", format!("pods \"{pod_name}\" not found"))
            })?;
            let uid = pod
                .pointer("/metadata/uid")
                .and_then(Value::as_str)
                .unwrap_or_default();
            if let Some(want) = r.get("uid").and_then(Value::as_str) {
                if want != uid {
                    return Err(ApiError::new(409, "Conflict", format!("the UID in the bound object reference ({want}) does not match the UID in record ({uid}). The object might have been deleted and then recreated")));
                }
            }
            Some(pod)
        }
        None => None,
    };
    if let User::Node(node) = user {
        let on_node = pod.as_ref().is_some_and(|p| {
            p.pointer("/spec/nodeName").and_then(Value::as_str) == Some(node.as_str())
                && p.pointer("/spec/serviceAccountName")
                    .and_then(Value::as_str)
                    .unwrap_or("default")
                    == name
        });
        if !on_node {
            return Err(ApiError::new(403, "Forbidden", format!("serviceaccounts \"{name}\" is forbidden: User \"system:node:{node}\" cannot create resource \"serviceaccounts/token\" in API group \"\" in the namespace \"{ns}\": node requested token not bound to a pod")));
        }
        let forbidden = |why: String| {
            ApiError::new(
                403,
                "Forbidden",
                format!("serviceaccounts \"{name}\" is forbidden: {why}"),
            )
        };
        let audiences: Vec<&str> = body
            .pointer("/spec/audiences")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let audience = match audiences.as_slice() {
            [] => "",
            [one] => one,
            _ => return Err(forbidden("node may only request 0 or 1 audiences".into())),
        };
        if !pod
            .as_ref()
            .is_some_and(|p| pod_references_audience(&store, ns, p, audience))
        {
            return Err(forbidden(format!("audience \"{audience}\" not found in pod spec volume, system:node:{node} is not authorized to request tokens for this audience")));
        }
    }
    let granted = match store.max_token_lifetime {
        Some(max) => (max.as_secs() as i64).min(expiration),
        None => expiration,
    };
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    store.tokens_issued += 1;
    let audiences = body
        .pointer("/spec/audiences")
        .cloned()
        .filter(|a| a.as_array().is_some_and(|a| !a.is_empty()))
        .unwrap_or(json!(["https://kubernetes.default.svc"]));
    let mut claims = json!({
        "aud": audiences, "exp": now + granted, "iat": now, "nbf": now,
        "iss": "https://kubernetes.default.svc", "jti": store.tokens_issued.to_string(),
        "sub": format!("system:serviceaccount:{ns}:{name}"),
        "kubernetes.io": {"namespace": ns, "serviceaccount": {"name": name, "uid": sa_uid}},
    });
    if let Some(p) = &pod {
        claims["kubernetes.io"]["pod"] =
            json!({"name": p.pointer("/metadata/name"), "uid": p.pointer("/metadata/uid")});
        if let User::Node(node) = user {
            claims["kubernetes.io"]["node"] = json!({"name": node});
        }
    }
    let header = base64url(br#"{"alg":"HS256","typ":"JWT"}"#);
    let payload = base64url(claims.to_string().as_bytes());
    let signature = base64url(&Sha256::digest(
        format!("{header}.{payload}.test-server-key").as_bytes(),
    ));
    Ok(json!({
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
        "metadata": {"name": name, "namespace": ns, "creationTimestamp": null},
        "spec": {"audiences": claims["aud"], "expirationSeconds": granted, "boundObjectRef": bound},
        "status": {"token": format!("{header}.{payload}.{signature}"), "expirationTimestamp": rfc3339(now + granted)},
    }))
}

/// Whether `pod` names `audience`: in a projected `serviceAccountToken` source, or as a
/// `tokenRequests` audience of the CSIDriver of one of its CSI volumes (inline, or through the
/// PersistentVolume of a claim or of a generic ephemeral volume's claim).
fn pod_references_audience(
    store: &crate::store::Store,
    ns: &str,
    pod: &Value,
    audience: &str,
) -> bool {
    let get = |plural: &'static str, namespace: &str, name: &str| {
        store.get(&Key {
            plural,
            namespace: namespace.into(),
            name: name.into(),
        })
    };
    let driver_has = |driver: &str| {
        get("csidrivers", "", driver)
            .and_then(|d| d.pointer("/spec/tokenRequests"))
            .and_then(Value::as_array)
            .is_some_and(|requests| {
                requests
                    .iter()
                    .any(|r| r.get("audience").and_then(Value::as_str) == Some(audience))
            })
    };
    let volumes = pod
        .pointer("/spec/volumes")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    volumes.iter().any(|v| {
        let projected = v
            .pointer("/projected/sources")
            .and_then(Value::as_array)
            .is_some_and(|sources| {
                sources.iter().any(|src| {
                    src.get("serviceAccountToken").is_some_and(|t| {
                        t.get("audience").and_then(Value::as_str).unwrap_or("") == audience
                    })
                })
            });
        // A generic ephemeral volume's claim is `<pod>-<volume>`.
        let ephemeral_claim = v.pointer("/ephemeral/volumeClaimTemplate").and_then(|_| {
            let pod_name = pod.pointer("/metadata/name").and_then(Value::as_str)?;
            let volume = v.get("name").and_then(Value::as_str)?;
            Some(format!("{pod_name}-{volume}"))
        });
        let claim = v
            .pointer("/persistentVolumeClaim/claimName")
            .and_then(Value::as_str)
            .map(String::from)
            .or(ephemeral_claim);
        let driver = match (v.pointer("/csi/driver").and_then(Value::as_str), claim) {
            (Some(d), _) => Some(d.to_string()),
            (None, Some(claim)) => get("persistentvolumeclaims", ns, &claim)
                .and_then(|c| c.pointer("/spec/volumeName"))
                .and_then(Value::as_str)
                .and_then(|pv| get("persistentvolumes", "", pv))
                .and_then(|pv| pv.pointer("/spec/csi/driver"))
                .and_then(Value::as_str)
                .map(String::from),
            (None, None) => None,
        };
        projected || driver.is_some_and(|d| driver_has(&d))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64url_without_padding() {
        assert_eq!(base64url(b"f"), "Zg");
        assert_eq!(base64url(b"fo"), "Zm8");
        assert_eq!(base64url(b"foo"), "Zm9v");
        assert_eq!(base64url(&[0xfb, 0xff]), "-_8");
    }
}
