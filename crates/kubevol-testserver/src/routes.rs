//! The REST paths: `/api/v1/...` and `/apis/<group>/<version>/...`, namespaced or not, with
//! get, list, watch, create, update, merge patch (whole object or `status`) and delete.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Router;
use serde_json::{json, Value};
use tokio::sync::{broadcast, mpsc};

use crate::authz::{authorize, Request, User, Verb};
use crate::store::{not_found, resource, ApiError, Change, Key, Resource};
use crate::Shared;

pub(crate) fn router(shared: Arc<Shared>) -> Router {
    Router::new().fallback(handle).with_state(shared)
}

fn error(e: &ApiError) -> Response {
    let code = StatusCode::from_u16(e.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        code,
        [("content-type", "application/json")],
        e.status().to_string(),
    )
        .into_response()
}

fn ok(code: StatusCode, v: &Value) -> Response {
    (code, [("content-type", "application/json")], v.to_string()).into_response()
}

/// The answer for a path the server does not serve.
fn not_served(path: &str) -> ApiError {
    ApiError::new(
        404,
        "NotFound",
        format!("the server could not find the requested resource ({path})"),
    )
}

/// `%XX` and `+` decoded.
fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                match u8::from_str_radix(std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("zz"), 16)
                {
                    Ok(v) => {
                        out.push(v);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn query(uri: &Uri, name: &str) -> Option<String> {
    uri.query()?
        .split('&')
        .filter_map(|kv| kv.split_once('=').or(Some((kv, ""))))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| decode(v))
}

/// A field selector's terms: (field, value, equal?).
type Selector = Vec<(String, String, bool)>;

fn field_selector(uri: &Uri, res: &Resource) -> Result<Selector, ApiError> {
    let Some(text) = query(uri, "fieldSelector").filter(|t| !t.is_empty()) else {
        return Ok(Vec::new());
    };
    text.split(',')
        .map(|term| {
            let (k, v, eq) = if let Some((k, v)) = term.split_once("!=") {
                (k, v, false)
            } else if let Some((k, v)) = term.split_once("==") {
                (k, v, true)
            } else if let Some((k, v)) = term.split_once('=') {
                (k, v, true)
            } else {
                return Err(ApiError::new(
                    400,
                    "BadRequest",
                    format!("invalid field selector: {term:?}"),
                ));
            };
            let supported = matches!(k, "metadata.name" | "metadata.namespace")
                || (res.plural == "pods" && matches!(k, "spec.nodeName" | "status.phase"))
                || (res.plural == "clustertrustbundles" && k == "spec.signerName");
            if !supported {
                return Err(ApiError::new(
                    400,
                    "BadRequest",
                    format!("field label not supported: {k}"),
                ));
            }
            Ok((k.to_string(), v.to_string(), eq))
        })
        .collect()
}

/// A label selector's terms: (key, operator, values); operators `=`, `!=`, `in`, `notin`,
/// `exists`, `!`.
type Labels = Vec<(String, &'static str, Vec<String>)>;

fn label_selector(uri: &Uri) -> Result<Labels, ApiError> {
    let Some(text) = query(uri, "labelSelector").filter(|t| !t.is_empty()) else {
        return Ok(Vec::new());
    };
    // Split on commas outside parentheses.
    let mut terms = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                terms.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    terms.push(&text[start..]);
    terms
        .into_iter()
        .map(|t| {
            let t = t.trim();
            let set = |rest: &str| {
                rest.trim()
                    .trim_start_matches('(')
                    .trim_end_matches(')')
                    .split(',')
                    .map(|v| v.trim().to_string())
                    .collect()
            };
            if let Some((k, v)) = t.split_once("!=") {
                Ok((k.trim().into(), "!=", vec![v.trim().into()]))
            } else if let Some((k, v)) = t.split_once("==").or_else(|| t.split_once('=')) {
                Ok((k.trim().into(), "=", vec![v.trim().into()]))
            } else if let Some((k, rest)) = t.split_once(" notin ") {
                Ok((k.trim().into(), "notin", set(rest)))
            } else if let Some((k, rest)) = t.split_once(" in ") {
                Ok((k.trim().into(), "in", set(rest)))
            } else if let Some(k) = t.strip_prefix('!') {
                Ok((k.trim().into(), "!", Vec::new()))
            } else if !t.is_empty() && !t.contains(' ') {
                Ok((t.into(), "exists", Vec::new()))
            } else {
                Err(ApiError::new(
                    400,
                    "BadRequest",
                    format!("unable to parse requirement: {t:?}"),
                ))
            }
        })
        .collect()
}

fn labels_match(labels: &Labels, obj: &Value) -> bool {
    labels.iter().all(|(k, op, values)| {
        let v = obj
            .pointer("/metadata/labels")
            .and_then(|l| l.get(k))
            .and_then(Value::as_str);
        match *op {
            "=" => v == Some(values[0].as_str()),
            "!=" => v != Some(values[0].as_str()),
            "in" => v.is_some_and(|v| values.iter().any(|x| x == v)),
            "notin" => v.is_none_or(|v| values.iter().all(|x| x != v)),
            "exists" => v.is_some(),
            _ => v.is_none(),
        }
    })
}

fn field_of(obj: &Value, field: &str) -> String {
    let pointer = format!("/{}", field.replace('.', "/"));
    obj.pointer(&pointer)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string()
}

fn selects(sel: &Selector, obj: &Value) -> bool {
    sel.iter().all(|(k, v, eq)| (field_of(obj, k) == *v) == *eq)
}

/// The resources of a group version (`/api/v1`, `/apis/<group>/<version>`), as a client's
/// discovery reads them; a disabled resource is not listed.
fn discovery(s: &Shared, path: &str) -> Option<Value> {
    let gv = match path
        .trim_end_matches('/')
        .split('/')
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["", "api", v] => v.to_string(),
        ["", "apis", g, v] => format!("{g}/{v}"),
        _ => return None,
    };
    let store = s.store();
    let resources: Vec<Value> = crate::store::RESOURCES
        .iter()
        .filter(|r| r.group_version == gv && !store.disabled.contains(r.plural))
        .map(|r| json!({"name": r.plural, "kind": r.kind, "namespaced": r.namespaced}))
        .collect();
    (!resources.is_empty()).then(|| {
        json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources})
    })
}

/// The parsed path.
struct Target {
    res: &'static Resource,
    namespace: Option<String>,
    name: Option<String>,
    subresource: Option<String>,
}

fn target(path: &str) -> Result<Target, ApiError> {
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    let (gv, rest) = match parts.as_slice() {
        ["api", "v1", rest @ ..] => ("v1".to_string(), rest),
        ["apis", g, v, rest @ ..] => (format!("{g}/{v}"), rest),
        _ => return Err(not_served(path)),
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some(ns.to_string()), rest),
        r => (None, r),
    };
    let (plural, name, sub) = match rest {
        [p] => (*p, None, None),
        [p, n] => (*p, Some(n.to_string()), None),
        [p, n, s] => (*p, Some(n.to_string()), Some(s.to_string())),
        _ => return Err(not_served(path)),
    };
    let res = resource(&gv, plural).ok_or_else(|| not_served(path))?;
    if !res.namespaced && namespace.is_some() {
        return Err(ApiError::new(
            404,
            "NotFound",
            format!("{} is not namespaced", res.plural),
        ));
    }
    if res.namespaced && name.is_some() && namespace.is_none() {
        return Err(ApiError::new(
            404,
            "NotFound",
            format!("{} are namespaced: name the namespace", res.plural),
        ));
    }
    Ok(Target {
        res,
        namespace,
        name,
        subresource: sub,
    })
}

async fn handle(
    State(s): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match serve(&s, &method, &uri, &headers, &body) {
        Ok(Reply::Object(code, v)) => ok(code, &v),
        Ok(Reply::Watch(w)) => watch(s, w),
        Err(e) => error(&e),
    }
}

enum Reply {
    Object(StatusCode, Value),
    Watch(WatchRequest),
}

struct WatchRequest {
    res: &'static Resource,
    namespace: Option<String>,
    selector: Selector,
    resource_version: Option<u64>,
    /// `sendInitialEvents` (a streaming list): every object as `ADDED` first, then, with
    /// bookmarks, one marked `k8s.io/initial-events-end`.
    initial_events: Option<bool>,
    timeout: Duration,
    bookmarks: bool,
}

fn serve(
    s: &Shared,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Reply, ApiError> {
    let token = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or_default();
    let user =
        Shared::user(token).ok_or_else(|| ApiError::new(401, "Unauthorized", "Unauthorized"))?;
    if let Some(list) = discovery(s, uri.path()) {
        return Ok(Reply::Object(StatusCode::OK, list));
    }
    let t = target(uri.path())?;
    if s.store().disabled.contains(t.res.plural) {
        return Err(not_served(uri.path()));
    }
    let parse_body = || -> Result<Value, ApiError> {
        serde_json::from_slice(body).map_err(|e| {
            ApiError::new(
                400,
                "BadRequest",
                format!("the request body is not JSON: {e}"),
            )
        })
    };
    let is_watch = query(uri, "watch").is_some_and(|w| w == "true" || w == "1");
    let verb = match (method, &t.name) {
        (&Method::GET, None) if is_watch => Verb::Watch,
        (&Method::GET, None) => Verb::List,
        (&Method::GET, Some(_)) => Verb::Get,
        (&Method::POST, None) => Verb::Create,
        (&Method::POST, Some(_)) if t.subresource.as_deref() == Some("token") => Verb::Create,
        (&Method::PUT, Some(_)) => Verb::Update,
        (&Method::PATCH, Some(_)) => Verb::Patch,
        (&Method::DELETE, Some(_)) => Verb::Delete,
        _ => {
            return Err(ApiError::new(
                405,
                "MethodNotAllowed",
                format!("{method} is not allowed on {}", uri.path()),
            ))
        }
    };
    if let User::Node(_) = user {
        let what = match &t.subresource {
            Some(sub) => format!("{} {}/{sub}", verb.name(), t.res.plural),
            None => format!("{} {}", verb.name(), t.res.plural),
        };
        *s.store().node_requests.entry(what).or_default() += 1;
    }
    if t.res.plural == "serviceaccounts"
        && t.subresource.as_deref() == Some("token")
        && verb == Verb::Create
    {
        let body = parse_body()?;
        let (ns, name) = (
            t.namespace.as_deref().unwrap_or_default(),
            t.name.as_deref().unwrap_or_default(),
        );
        return crate::token::issue(s, &user, ns, name, &body)
            .map(|o| Reply::Object(StatusCode::CREATED, o));
    }
    if t.subresource.as_deref().is_some_and(|s| s != "status")
        || (t.subresource.is_some() && !matches!(verb, Verb::Get | Verb::Update | Verb::Patch))
    {
        return Err(not_served(uri.path()));
    }
    let selector = field_selector(uri, t.res)?;
    let fields: Vec<(String, String)> = selector
        .iter()
        .filter(|(_, _, eq)| *eq)
        .map(|(k, v, _)| (k.clone(), v.clone()))
        .collect();
    let created = if verb == Verb::Create {
        Some(parse_body()?)
    } else {
        None
    };
    let name = t.name.clone().or_else(|| {
        created
            .as_ref()
            .and_then(|o| o.pointer("/metadata/name"))
            .and_then(Value::as_str)
            .map(String::from)
    });
    authorize(
        &s.store(),
        &user,
        &Request {
            verb,
            resource: t.res,
            subresource: t.subresource.as_deref(),
            namespace: t.namespace.as_deref(),
            name: name.as_deref(),
            fields: &fields,
        },
    )?;
    let key = Key {
        plural: t.res.plural,
        namespace: t.namespace.clone().unwrap_or_default(),
        name: t.name.clone().unwrap_or_default(),
    };
    let initial_events = list_options(uri, verb, s.store().watch_list)?;
    match verb {
        Verb::Watch => Ok(Reply::Watch(WatchRequest {
            initial_events,
            res: t.res,
            namespace: t.namespace,
            selector,
            resource_version: query(uri, "resourceVersion")
                .and_then(|v| v.parse().ok())
                .filter(|v| *v > 0),
            timeout: Duration::from_secs(
                query(uri, "timeoutSeconds")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(1800),
            ),
            bookmarks: query(uri, "allowWatchBookmarks").is_some_and(|v| v == "true"),
        })),
        Verb::List => {
            let store = s.store();
            let labels = label_selector(uri)?;
            let items: Vec<Value> = store
                .list(t.res.plural, t.namespace.as_deref())
                .into_iter()
                .filter(|o| selects(&selector, o) && labels_match(&labels, o))
                .map(|o| {
                    let mut o = o.clone();
                    if let Some(m) = o.as_object_mut() {
                        m.remove("apiVersion");
                        m.remove("kind");
                    }
                    o
                })
                .collect();
            Ok(Reply::Object(
                StatusCode::OK,
                json!({"kind": format!("{}List", t.res.kind), "apiVersion": t.res.group_version,
                       "metadata": {"resourceVersion": store.resource_version().to_string()}, "items": items}),
            ))
        }
        Verb::Get => s
            .store()
            .get(&key)
            .cloned()
            .map(|o| Reply::Object(StatusCode::OK, o))
            .ok_or_else(|| not_found(&key)),
        Verb::Create => {
            let obj = created.unwrap_or_default();
            if let (Some(path_ns), Some(body_ns)) = (
                &t.namespace,
                obj.pointer("/metadata/namespace").and_then(Value::as_str),
            ) {
                if path_ns != body_ns {
                    return Err(ApiError::new(400, "BadRequest", "the namespace of the provided object does not match the namespace sent on the request"));
                }
            }
            let o = s
                .store()
                .create(t.res, t.namespace.as_deref().unwrap_or_default(), obj)?;
            Ok(Reply::Object(StatusCode::CREATED, o))
        }
        Verb::Update => {
            let mut obj = parse_body()?;
            let mut store = s.store();
            if t.subresource.is_some() {
                // Only the status changes through the subresource.
                let mut whole = store.get(&key).cloned().ok_or_else(|| not_found(&key))?;
                whole["status"] = obj.get("status").cloned().unwrap_or_default();
                if let Some(rv) = obj.pointer("/metadata/resourceVersion").cloned() {
                    whole["metadata"]["resourceVersion"] = rv;
                }
                obj = whole;
            }
            store
                .update(&key, t.res, obj)
                .map(|o| Reply::Object(StatusCode::OK, o))
        }
        Verb::Patch => {
            let kind = headers
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default();
            if !matches!(
                kind,
                "application/merge-patch+json" | "application/strategic-merge-patch+json"
            ) {
                return Err(ApiError::new(415, "UnsupportedMediaType", format!("the patch type {kind:?} is not supported here: use application/merge-patch+json")));
            }
            let patch = parse_body()?;
            s.store()
                .patch(&key, &patch, t.subresource.is_some())
                .map(|o| Reply::Object(StatusCode::OK, o))
        }
        Verb::Delete => {
            let options = serde_json::from_slice::<Value>(body).ok();
            if let Some(want) = options
                .as_ref()
                .and_then(|o| o.pointer("/preconditions/uid"))
                .and_then(Value::as_str)
            {
                let have = s.store().get(&key).and_then(|o| {
                    o.pointer("/metadata/uid")
                        .and_then(Value::as_str)
                        .map(String::from)
                });
                if have.as_deref().is_some_and(|h| h != want) {
                    return Err(ApiError::new(409, "Conflict", format!("Precondition failed: UID in precondition: {want}, UID in object meta: {}", have.unwrap_or_default())));
                }
            }
            let grace = query(uri, "gracePeriodSeconds")
                .and_then(|g| g.parse().ok())
                .or_else(|| {
                    serde_json::from_slice::<Value>(body)
                        .ok()
                        .and_then(|b| b.get("gracePeriodSeconds")?.as_i64())
                });
            s.store()
                .delete(&key, grace)
                .map(|o| Reply::Object(StatusCode::OK, o))
        }
    }
}

/// The list options of a list or watch that the API server checks (`ValidateListOptions`):
/// `sendInitialEvents` only on a watch and only with `resourceVersionMatch=NotOlderThan`,
/// which a watch takes with it only; a list takes `resourceVersionMatch` only with a
/// `resourceVersion`. A server with the WatchList feature off refuses `sendInitialEvents`.
/// Returns `sendInitialEvents`.
fn list_options(uri: &Uri, verb: Verb, watch_list: bool) -> Result<Option<bool>, ApiError> {
    if !matches!(verb, Verb::List | Verb::Watch) {
        return Ok(None);
    }
    let initial = query(uri, "sendInitialEvents");
    let matching = query(uri, "resourceVersionMatch");
    let version = query(uri, "resourceVersion").filter(|v| !v.is_empty());
    let mut causes = Vec::new();
    if verb == Verb::List {
        if matching.is_some() && version.is_none() {
            causes.push((
                "resourceVersionMatch",
                "resourceVersionMatch is forbidden unless resourceVersion is provided",
            ));
        }
        if initial.is_some() {
            causes.push((
                "sendInitialEvents",
                "sendInitialEvents is forbidden for list",
            ));
        }
    } else if initial.is_some() {
        if !watch_list {
            causes.push((
                "sendInitialEvents",
                "sendInitialEvents is forbidden for watch unless the WatchList feature gate is enabled",
            ));
        } else if matching.as_deref() != Some("NotOlderThan") {
            causes.push((
                "resourceVersionMatch",
                "sendInitialEvents requires setting resourceVersionMatch to NotOlderThan",
            ));
        }
    } else if matching.is_some() {
        causes.push((
            "resourceVersionMatch",
            "resourceVersionMatch is forbidden for watch unless sendInitialEvents is provided",
        ));
    }
    if !causes.is_empty() {
        let list: Vec<String> = causes
            .iter()
            .map(|(field, why)| format!("{field}: Forbidden: {why}"))
            .collect();
        let list = match list.len() {
            1 => list[0].clone(),
            _ => format!("[{}]", list.join(", ")),
        };
        return Err(ApiError::new(
            422,
            "Invalid",
            format!("ListOptions.meta.k8s.io \"\" is invalid: {list}"),
        ));
    }
    Ok(initial.map(|v| v == "true"))
}

fn event_line(kind: &str, object: &Value) -> String {
    let mut line = json!({"type": kind, "object": object}).to_string();
    line.push('\n');
    line
}

/// Streams a watch: the changes after its resource version (or every object as `ADDED` when
/// it has none, or when it asks for the initial events, which then end with a bookmark), then
/// every change as it happens, until its timeout or the server stops.
fn watch(s: Arc<Shared>, w: WatchRequest) -> Response {
    let (tx, rx) = mpsc::channel::<Result<String, Infallible>>(256);
    let mut stopping = s.stopping.clone();
    tokio::spawn(async move {
        let matches = |c: &Change| {
            c.key.plural == w.res.plural
                && w.namespace.as_ref().is_none_or(|n| &c.key.namespace == n)
                && selects(&w.selector, &c.object)
        };
        let (mut feed, first, mut last) = {
            let mut store = s.store();
            let feed = store.subscribe(w.res.plural);
            let now = store.resource_version();
            let first = match (w.initial_events, w.resource_version) {
                // A watch from now on, or a streaming list from a cache that lags behind.
                (Some(false), None) => Ok(Vec::new()),
                (Some(true), _) if store.stale_streams => Ok(Vec::new()),
                (None | Some(false), Some(rv)) => store.since(rv),
                // The state now (not older than any version asked), then the changes.
                (None | Some(true), _) => Ok(store
                    .list(w.res.plural, w.namespace.as_deref())
                    .into_iter()
                    .map(|o| Change {
                        rv: now,
                        kind: "ADDED",
                        key: crate::store::key_of(w.res.plural, o),
                        object: Arc::new(o.clone()),
                    })
                    .collect()),
            };
            (feed, first, now)
        };
        let first = match first {
            Ok(f) => f,
            Err(e) => {
                let _ = tx.send(Ok(event_line("ERROR", &e.status()))).await;
                return;
            }
        };
        for c in first.iter().filter(|c| matches(c)) {
            if tx.send(Ok(event_line(c.kind, &c.object))).await.is_err() {
                return;
            }
        }
        if w.initial_events == Some(true) && w.bookmarks {
            let end = json!({"kind": w.res.kind, "apiVersion": w.res.group_version, "metadata": {
                "resourceVersion": last.to_string(),
                "annotations": {"k8s.io/initial-events-end": "true"}}});
            if tx.send(Ok(event_line("BOOKMARK", &end))).await.is_err() {
                return;
            }
        }
        let deadline = tokio::time::Instant::now() + w.timeout;
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                ev = feed.recv() => match ev {
                    Ok(c) if c.rv > last => {
                        last = c.rv;
                        if matches(&c) && tx.send(Ok(event_line(c.kind, &c.object))).await.is_err() {
                            return;
                        }
                    }
                    Ok(_) => {}
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        let e = ApiError::new(410, "Expired", "the watch fell behind: list again");
                        let _ = tx.send(Ok(event_line("ERROR", &e.status()))).await;
                        return;
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                _ = tick.tick(), if w.bookmarks => {
                    let mark = json!({"kind": w.res.kind, "apiVersion": w.res.group_version, "metadata": {"resourceVersion": last.to_string()}});
                    if tx.send(Ok(event_line("BOOKMARK", &mark))).await.is_err() {
                        return;
                    }
                }
                _ = tokio::time::sleep_until(deadline) => return,
                _ = async { stopping.wait_for(|s| *s).await.map(|_| ()) } => return,
            }
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .body(Body::from_stream(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        ))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_queries() {
        let t = target("/api/v1/namespaces/ns/pods/p/status").unwrap();
        assert_eq!(
            (
                t.res.plural,
                t.namespace.as_deref(),
                t.name.as_deref(),
                t.subresource.as_deref()
            ),
            ("pods", Some("ns"), Some("p"), Some("status"))
        );
        let t = target("/apis/storage.k8s.io/v1/csidrivers").unwrap();
        assert_eq!((t.res.kind, t.name), ("CSIDriver", None));
        assert_eq!(
            target("/api/v1/namespaces/ns/persistentvolumes")
                .err()
                .map(|e| e.code),
            Some(404)
        );
        let uri: Uri = "/api/v1/pods?fieldSelector=spec.nodeName%3Dnode-1&watch=true"
            .parse()
            .unwrap();
        let sel = field_selector(&uri, resource("v1", "pods").unwrap()).unwrap();
        assert_eq!(
            sel,
            vec![("spec.nodeName".to_string(), "node-1".to_string(), true)]
        );
        let uri: Uri = "/api/v1/secrets?fieldSelector=spec.nodeName%3Dx"
            .parse()
            .unwrap();
        assert_eq!(
            field_selector(&uri, resource("v1", "secrets").unwrap())
                .unwrap_err()
                .code,
            400
        );
    }
}
