//! The HTTP side: paths as the API server lays them out, each request
//! recorded as RBAC names it ([`super::Call`]), then get, list, watch,
//! create, update, patch, delete and deletecollection on the store, the pod
//! subresources (`status`, `log`, `exec`), and minimal discovery.

use std::sync::Arc;

use axum::Router;
use axum::extract::{FromRequestParts, Query, Request, State};
use axum::http::{Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};

use super::error::ApiError;
use super::selector::Selector;
use super::store::{ObjKey, Part, ResourceType, merge_patch, name_of};
use super::{Call, Shared, exec, objects, watch};

/// The largest body the fake reads.
const MAX_BODY: usize = 16 << 20;

pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/version", get(version))
        .route("/api", get(api_versions))
        .route("/apis", get(api_groups))
        .fallback(dispatch)
        .with_state(shared)
}

async fn version() -> Response {
    axum::Json(json!({"major": "1", "minor": "33", "gitVersion": "v1.33.0-fake", "platform": "linux/amd64"}))
        .into_response()
}

async fn api_versions() -> Response {
    axum::Json(json!({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []})).into_response()
}

async fn api_groups(State(shared): State<Arc<Shared>>) -> Response {
    let mut groups: Vec<Value> = Vec::new();
    for rt in shared.store.resources().iter().filter(|rt| !rt.group.is_empty()) {
        if groups.iter().any(|g| g["name"] == rt.group) {
            continue;
        }
        let gv = json!({"groupVersion": rt.api_version(), "version": rt.version});
        groups.push(json!({"name": rt.group, "versions": [gv.clone()], "preferredVersion": gv}));
    }
    axum::Json(json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})).into_response()
}

/// A request's target, parsed from its path.
#[derive(Debug)]
struct Target {
    rt: Arc<ResourceType>,
    /// None for a request across all namespaces.
    namespace: Option<String>,
    name: Option<String>,
    sub: Option<String>,
}

fn parse_target(shared: &Shared, path: &str) -> Result<Target, ApiError> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, version, rest) = match parts.as_slice() {
        ["api", version, rest @ ..] => ("", *version, rest),
        ["apis", group, version, rest @ ..] => (*group, *version, rest),
        _ => return Err(ApiError::NoSuchResource),
    };
    let (namespace, rest) = match rest {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some((*ns).to_owned()), rest),
        rest => (None, rest),
    };
    let (plural, name, sub) = match rest {
        [plural] => (*plural, None, None),
        [plural, name] => (*plural, Some((*name).to_owned()), None),
        [plural, name, sub] => (*plural, Some((*name).to_owned()), Some((*sub).to_owned())),
        _ => return Err(ApiError::NoSuchResource),
    };
    let rt = shared.store.resource(group, version, plural).ok_or(ApiError::NoSuchResource)?;
    if rt.namespaced && namespace.is_none() && name.is_some() {
        return Err(ApiError::NoSuchResource);
    }
    Ok(Target { rt, namespace, name, sub })
}

/// The query as pairs, repeated keys kept (exec's `command`).
pub type Params = Vec<(String, String)>;

pub fn param<'a>(q: &'a Params, key: &str) -> Option<&'a str> {
    q.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

pub fn flag(q: &Params, key: &str) -> bool {
    matches!(param(q, key), Some("true" | "1"))
}

fn verb(method: &Method, target: &Target, q: &Params) -> &'static str {
    let exec = target.sub.as_deref() == Some("exec");
    match (method, &target.name) {
        _ if exec => "create",
        (&Method::GET, None) if flag(q, "watch") => "watch",
        (&Method::GET, None) => "list",
        (&Method::GET, Some(_)) => "get",
        (&Method::POST, _) => "create",
        (&Method::PUT, _) => "update",
        (&Method::PATCH, _) => "patch",
        (&Method::DELETE, None) => "deletecollection",
        (&Method::DELETE, Some(_)) => "delete",
        _ => "unknown",
    }
}

async fn dispatch(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    match serve(shared, request).await {
        Ok(response) => response,
        Err(e) => e.into_response(),
    }
}

async fn serve(shared: Arc<Shared>, request: Request) -> Result<Response, ApiError> {
    let target = parse_target(&shared, request.uri().path())?;
    let q: Params = Query::<Params>::try_from_uri(request.uri())
        .map(|Query(q)| q)
        .map_err(|e| ApiError::BadRequest(format!("query: {e}")))?;
    let method = request.method().clone();
    let verb = verb(&method, &target, &q);
    let resource = match &target.sub {
        Some(sub) => format!("{}/{sub}", target.rt.plural),
        None => target.rt.plural.clone(),
    };
    shared.calls.lock().unwrap_or_else(|p| p.into_inner()).push(Call {
        verb: verb.into(),
        group: target.rt.group.clone(),
        resource,
        namespace: target.namespace.clone(),
    });

    let rt = target.rt.clone();
    let ns = target.namespace.clone().unwrap_or_default();
    let Some(name) = target.name.clone() else {
        return match method {
            Method::GET if flag(&q, "watch") => watch::serve(shared, rt, target.namespace, &q),
            Method::GET => list(&shared, &rt, target.namespace.as_deref(), &q),
            Method::POST => {
                let body = read_json(request).await?;
                create(&shared, &rt, &ns, body, &q)
            }
            Method::DELETE => delete_collection(&shared, &rt, &ns, &q),
            _ => Err(ApiError::MethodNotAllowed),
        };
    };
    let key = ObjKey { rt: rt.clone(), namespace: ns.clone(), name: name.clone() };
    let is_pod = objects::is_pod(&rt.plural, &rt.group);
    match (target.sub.as_deref(), method) {
        (Some("exec"), Method::GET | Method::POST) if is_pod => {
            let (mut parts, _body) = request.into_parts();
            // The WebSocket extractor insists on GET for HTTP/1.1; a POST
            // upgrade (what kubectl once sent) upgrades the same way.
            parts.method = Method::GET;
            let ws = axum::extract::ws::WebSocketUpgrade::from_request_parts(&mut parts, &shared)
                .await
                .map_err(|e| ApiError::BadRequest(format!("unable to upgrade connection: {e}")))?;
            exec::serve(shared, &key, &q, ws)
        }
        (Some("log"), Method::GET) if is_pod => {
            shared.store.get(&key).ok_or_else(|| rt.not_found(&name))?;
            let text = shared.kubelet.log(&ns, &name);
            Ok(([(header::CONTENT_TYPE, "text/plain")], text).into_response())
        }
        (None | Some("status"), Method::GET) => Ok(json_ok(shared.store.get(&key).ok_or_else(|| rt.not_found(&name))?)),
        (sub @ (None | Some("status")), Method::PUT) => {
            let body = read_json(request).await?;
            if name_of(&body) != name {
                return Err(ApiError::BadRequest(format!(
                    "the name of the object ({}) does not match the name on the URL ({name})",
                    name_of(&body)
                )));
            }
            let part = if sub.is_some() { Part::Status } else { Part::Main };
            let updated = shared.store.modify(&key, part, |obj| {
                check_version(&key, &body, obj)?;
                let old = std::mem::replace(obj, body.clone());
                objects::admit_update(&key, part, &old, obj)
            })?;
            Ok(json_ok(updated))
        }
        (sub @ (None | Some("status")), Method::PATCH) => {
            let part = if sub.is_some() { Part::Status } else { Part::Main };
            patch(&shared, &key, part, request, &q).await
        }
        (Some("eviction"), Method::POST) if is_pod => {
            // The eviction API: a graceful delete (no disruption budgets here).
            let body = read_json(request).await?;
            let grace = body.pointer("/deleteOptions/gracePeriodSeconds").and_then(Value::as_i64);
            objects::delete(&shared, &key, grace)?;
            let status =
                json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201});
            Ok((StatusCode::CREATED, axum::Json(status)).into_response())
        }
        (None, Method::DELETE) => {
            let grace = grace_period(request, &q).await?;
            Ok(json_ok(objects::delete(&shared, &key, grace)?))
        }
        _ => Err(ApiError::MethodNotAllowed),
    }
}

fn json_ok(obj: Value) -> Response {
    (StatusCode::OK, axum::Json(obj)).into_response()
}

async fn read_body(request: Request) -> Result<axum::body::Bytes, ApiError> {
    axum::body::to_bytes(request.into_body(), MAX_BODY).await.map_err(|e| ApiError::BadRequest(format!("body: {e}")))
}

async fn read_json(request: Request) -> Result<Value, ApiError> {
    let bytes = read_body(request).await?;
    serde_json::from_slice(&bytes).map_err(|e| ApiError::BadRequest(format!("the body is not JSON: {e}")))
}

fn list(shared: &Shared, rt: &Arc<ResourceType>, ns: Option<&str>, q: &Params) -> Result<Response, ApiError> {
    let selector = Selector::parse(param(q, "labelSelector"), param(q, "fieldSelector"))?;
    let (items, rv) = shared.store.list(rt, ns);
    let items: Vec<Value> = items.into_iter().filter(|o| selector.matches(o)).collect();
    Ok(json_ok(json!({
        "kind": format!("{}List", rt.kind),
        "apiVersion": rt.api_version(),
        "metadata": { "resourceVersion": rv.to_string() },
        "items": items,
    })))
}

fn create(
    shared: &Shared,
    rt: &Arc<ResourceType>,
    ns: &str,
    mut body: Value,
    q: &Params,
) -> Result<Response, ApiError> {
    if let Some(sent) = body.pointer("/metadata/namespace").and_then(Value::as_str)
        && rt.namespaced
        && sent != ns
    {
        return Err(ApiError::BadRequest(
            "the namespace of the provided object does not match the namespace sent on the request".into(),
        ));
    }
    if param(q, "dryRun").is_some() {
        return Err(ApiError::BadRequest("the fake cluster does not do dry runs".into()));
    }
    objects::admit_create(&rt.plural, &rt.group, ns, &mut body)?;
    let created = shared.store.create(rt, ns, body)?;
    let key = ObjKey { rt: rt.clone(), namespace: ns.into(), name: name_of(&created).into() };
    objects::after_create(shared, &key)?;
    Ok((StatusCode::CREATED, axum::Json(created)).into_response())
}

/// PATCH: JSON merge patch; strategic merge patch applied as a JSON merge
/// patch (lists replace whole, no patch directives — the fake knows no
/// schemas); server-side apply (`application/apply-patch+yaml`, with
/// `fieldManager`) as create-or-merge of the sent object, without field
/// ownership or manager conflicts. The body of an apply must be JSON (valid
/// YAML, and what kube sends).
async fn patch(shared: &Shared, key: &ObjKey, part: Part, request: Request, q: &Params) -> Result<Response, ApiError> {
    let content_type = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_owned();
    let apply = match content_type.as_str() {
        "application/merge-patch+json" | "application/strategic-merge-patch+json" => false,
        "application/apply-patch+yaml" => true,
        _ => {
            return Err(ApiError::UnsupportedMediaType(
                "application/merge-patch+json, application/strategic-merge-patch+json, application/apply-patch+yaml"
                    .into(),
            ));
        }
    };
    let body = read_json(request).await?;
    if apply {
        if param(q, "fieldManager").is_none_or(str::is_empty) {
            return Err(ApiError::BadRequest("PATCH, with apply, must have a fieldManager".into()));
        }
        if shared.store.get(key).is_none() && part == Part::Main {
            let mut obj = body;
            obj["metadata"]["name"] = json!(key.name);
            return create(shared, &key.rt, &key.namespace, obj, q);
        }
    }
    let updated = shared.store.modify(key, part, |obj| {
        check_version(key, &body, obj)?;
        let mut patch = body.clone();
        if let Some(meta) = patch.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.remove("resourceVersion");
        }
        let old = obj.clone();
        merge_patch(obj, &patch);
        objects::admit_update(key, part, &old, obj)
    })?;
    Ok(json_ok(updated))
}

/// The optimistic-concurrency precondition of an update or patch: a
/// `metadata.resourceVersion` sent must be the current one (409 if not).
fn check_version(key: &ObjKey, sent: &Value, current: &Value) -> Result<(), ApiError> {
    match sent.pointer("/metadata/resourceVersion").and_then(Value::as_str) {
        Some(sent)
            if !sent.is_empty()
                && Some(sent) != current.pointer("/metadata/resourceVersion").and_then(Value::as_str) =>
        {
            Err(ApiError::Conflict {
                resource: key.rt.plural.clone(),
                group: key.rt.group.clone(),
                name: key.name.clone(),
            })
        }
        _ => Ok(()),
    }
}

/// The grace period of a DELETE: `?gracePeriodSeconds=` or the
/// `DeleteOptions` body.
async fn grace_period(request: Request, q: &Params) -> Result<Option<i64>, ApiError> {
    if let Some(g) = param(q, "gracePeriodSeconds") {
        return g.parse().map(Some).map_err(|_| ApiError::BadRequest(format!("gracePeriodSeconds: {g}")));
    }
    let bytes = read_body(request).await?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    let options: Value =
        serde_json::from_slice(&bytes).map_err(|e| ApiError::BadRequest(format!("DeleteOptions: {e}")))?;
    Ok(options.get("gracePeriodSeconds").and_then(Value::as_i64))
}

fn delete_collection(shared: &Shared, rt: &Arc<ResourceType>, ns: &str, q: &Params) -> Result<Response, ApiError> {
    let selector = Selector::parse(param(q, "labelSelector"), param(q, "fieldSelector"))?;
    let grace = param(q, "gracePeriodSeconds").and_then(|g| g.parse().ok());
    let (items, _) = shared.store.list(rt, Some(ns));
    let mut deleted = Vec::new();
    for obj in items.into_iter().filter(|o| selector.matches(o)) {
        let key = ObjKey { rt: rt.clone(), namespace: ns.into(), name: name_of(&obj).into() };
        match objects::delete(shared, &key, grace) {
            Ok(obj) => deleted.push(obj),
            Err(ApiError::NotFound { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    let (_, rv) = shared.store.list(rt, Some(ns));
    Ok(json_ok(json!({
        "kind": format!("{}List", rt.kind),
        "apiVersion": rt.api_version(),
        "metadata": { "resourceVersion": rv.to_string() },
        "items": deleted,
    })))
}
