//! The user API's OpenAPI 3.1 document, derived from the handlers'
//! `#[utoipa::path]` attributes and the types they read and answer with,
//! plus the contract's own types (a workspace, a git credential, an event)
//! as `standby-protocol` describes them (schemars), so that neither is
//! restated here. Served at `GET /openapi.json`; `docs/openapi.json` is a
//! copy that a test holds equal to it.

use std::sync::LazyLock;

use axum::http::header;
use axum::response::{IntoResponse, Response};
use schemars::generate::SchemaSettings;
use serde_json::Value;
use serde_json::json;
use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, OneOfBuilder, Schema, SchemaType, Type};
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::openapi::{Ref, RefOr};
use utoipa::{Modify, OpenApi};

use super::documented::ThreadId;
use super::submission::{AttachmentInput, Submission};
use super::views::{
    AttemptView, Durations, EventView, EventsPage, ParkView, ResumeView, RunView, RunsPage, SandboxView, SandboxesPage,
    ThreadView, Timestamps, WaitView,
};
use crate::problem::{FieldProblem, Problem, TYPES};

/// Where the contract's types go in the document: beside the API's own.
const COMPONENTS: &str = "/components/schemas";

#[derive(OpenApi)]
#[openapi(
    info(
        title = "standby user API",
        description = "Submit, inspect and cancel runs on pre-warmed sandboxes; list sandboxes and threads; \
            metrics. Every call but this document needs `Authorization: Bearer <api key>`. Every 4xx and 5xx \
            answer is `application/problem+json` (RFC 9457)."
    ),
    paths(
        super::submit,
        super::reads::list,
        super::get,
        super::reads::log,
        super::reads::events,
        super::cancel,
        super::reads::sandboxes,
        super::thread,
        super::metrics,
        super::cluster_status::cluster,
        openapi_json,
    ),
    components(schemas(
        Problem,
        FieldProblem,
        Submission,
        AttachmentInput,
        ThreadId,
        RunView,
        AttemptView,
        Timestamps,
        Durations,
        WaitView,
        ResumeView,
        RunsPage,
        EventView,
        EventsPage,
        SandboxView,
        ParkView,
        SandboxesPage,
        ThreadView,
        super::cluster_status::ClusterInfo,
        super::cluster_status::ReplicaInfo,
    )),
    modifiers(&Security),
    security(("api_key" = [])),
    tags((name = "runs"), (name = "sandboxes"), (name = "server")),
)]
struct ApiDoc;

/// A string with no NUL byte: no process can be given one (`submission::first_nul`).
pub(crate) const NO_NUL: &str = "^[^\0]*$";
/// A string with no NUL byte and something in it.
const NOT_EMPTY: &str = "^[^\0]+$";
/// An environment variable's name: not empty, no `=`, no NUL.
const ENV_NAME: &str = "^[^=\0]+$";
/// A string holding more than whitespace (Rust's `char::is_whitespace`, so
/// exactly what `str::trim` removes) and no NUL.
const NOT_BLANK: &str =
    "^[^\0]*[^\0\t\n\u{b}\u{c}\r \u{85}\u{a0}\u{1680}\u{2000}-\u{200a}\u{2028}\u{2029}\u{202f}\u{205f}\u{3000}][^\0]*$";
/// A path inside the workspace (`check_relative`): not empty, not absolute,
/// no `..` segment, no NUL.
pub(crate) const RELATIVE_PATH: &str =
    "^(?:\\.|\\.?[^/.\0][^/\0]*|\\.\\.[^/\0]+)(?:/(?:\\.?|\\.?[^/.\0][^/\0]*|\\.\\.[^/\0]+))*$";

/// A path inside the workspace, or `null`: the workspace itself.
pub(crate) fn relative_path_schema() -> Schema {
    ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::SchemaType::from_iter([Type::String, Type::Null]))
        .pattern(Some(RELATIVE_PATH))
        .description(Some("A relative path inside the workspace (no `..`); the workspace itself when absent."))
        .into()
}

/// A string matching `pattern`.
fn text(pattern: &str) -> ObjectBuilder {
    ObjectBuilder::new().schema_type(Type::String).pattern(Some(pattern))
}

/// A command: the program (not empty), then any arguments; no NUL.
pub(crate) fn command_schema() -> Schema {
    ArrayBuilder::new()
        .prefix_items([text(NOT_EMPTY)])
        .items(text(NO_NUL))
        .min_items(Some(1))
        .description(Some("The program and its arguments; the program must not be empty."))
        .into()
}

/// Environment variables: names not empty and without `=`, nothing with a
/// NUL.
pub(crate) fn environment_schema() -> Schema {
    ObjectBuilder::new()
        .schema_type(Type::Object)
        .property_names(Some(text(ENV_NAME)))
        .additional_properties(Some(text(NO_NUL)))
        .into()
}

/// Any JSON value (`null`: none, the run gets `{}`).
pub(crate) fn any_json_schema() -> Schema {
    ObjectBuilder::new()
        .schema_type(SchemaType::AnyValue)
        .description(Some("Any JSON, handed to the run as a file (`{}` when absent or `null`)."))
        .into()
}

/// What utoipa's attributes and schemars' derives cannot say, and the
/// server checks at submit (`Submission::validate`): an attachment has
/// exactly one of its two contents; the contract's workspace and git
/// credentials have no empty or blank required string, no path leaving
/// the workspace, no NUL. Stated here so that every schema-valid
/// submission is one the server takes.
fn constrain(schemas: &mut serde_json::Map<String, Value>) {
    let mut set = |pointer: &str, key: &str, value: Value| {
        let (name, rest) = pointer.split_once('/').unwrap_or((pointer, ""));
        let target = schemas
            .get_mut(name)
            .and_then(|schema| if rest.is_empty() { Some(schema) } else { schema.pointer_mut(&format!("/{rest}")) })
            .and_then(Value::as_object_mut)
            .unwrap_or_else(|| panic!("the document has no schema at {pointer}"));
        target.insert(key.to_owned(), value);
    };
    let content = |name: &str| json!({"properties": {name: {"type": "string"}}, "required": [name]});
    set("AttachmentInput", "oneOf", json!([content("content"), content("content_base64")]));
    set("Repo/properties/url", "pattern", json!(NOT_BLANK));
    set("Repo/properties/path", "pattern", json!(RELATIVE_PATH));
    set("Repo/properties/ref", "pattern", json!(NO_NUL));
    set("Repo/properties/expected_sha", "pattern", json!(NO_NUL));
    set("SetupStep/properties/name", "pattern", json!(NOT_BLANK));
    set("SetupStep/properties/cwd", "pattern", json!(RELATIVE_PATH));
    set("SetupStep/properties/inputs/items", "pattern", json!(RELATIVE_PATH));
    set("SetupStep/properties", "command", serde_json::to_value(command_schema()).expect("a schema serialises"));
    set("GitCredential/properties/protocol", "pattern", json!(NOT_EMPTY));
    set("GitCredential/properties/host", "pattern", json!(NOT_EMPTY));
    set("GitCredential/properties/username", "pattern", json!(NO_NUL));
    set("Secret", "pattern", json!(NO_NUL));
}

/// `offset` and `limit` of a run's log take any whole number (`reads::number`
/// saturates), where utoipa would write a `u64` as `int64`, whose bound the
/// server does not have.
fn unbounded_log_range(document: &mut Value) {
    let parameters = document
        .pointer_mut("/paths/~1v1~1runs~1{id}~1log/get/parameters")
        .and_then(Value::as_array_mut)
        .expect("the log has parameters");
    for parameter in parameters.iter_mut().filter(|parameter| parameter["in"] == "query") {
        if let Some(schema) = parameter["schema"].as_object_mut() {
            schema.remove("format");
        }
    }
}

/// The API key as an HTTP bearer scheme, and the list of problem types.
struct Security;

impl Modify for Security {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme("api_key", SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)));
        let types: Vec<String> =
            TYPES.iter().map(|(uri, title, meaning)| format!("- `{uri}` ({title}): {meaning}")).collect();
        let description = openapi.info.description.get_or_insert_with(String::new);
        description.push_str("\n\nProblem types:\n\n");
        description.push_str(&types.join("\n"));
    }
}

/// The document, as served and as committed.
pub fn document() -> Value {
    let mut document = serde_json::to_value(ApiDoc::openapi()).expect("the OpenAPI document serialises");
    let schemas =
        document.pointer_mut(COMPONENTS).and_then(Value::as_object_mut).expect("the document has component schemas");
    for (name, schema) in protocol_schemas() {
        assert!(!schemas.contains_key(&name), "the contract's `{name}` and an API type share a schema name");
        schemas.insert(name, schema);
    }
    constrain(schemas);
    unbounded_log_range(&mut document);
    document
}

/// The document's text, made once.
static TEXT: LazyLock<String> =
    LazyLock::new(|| serde_json::to_string_pretty(&document()).expect("the OpenAPI document serialises") + "\n");

/// The contract's types the API shows, with everything they refer to, as
/// `standby-protocol` describes them (JSON Schema 2020-12, OpenAPI 3.1's
/// own dialect), referring to one another under `#/components/schemas/`.
fn protocol_schemas() -> serde_json::Map<String, Value> {
    let mut generator =
        SchemaSettings::draft2020_12().with(|settings| settings.definitions_path = COMPONENTS.into()).into_generator();
    generator.subschema_for::<standby_protocol::Workspace>();
    generator.subschema_for::<standby_protocol::GitCredential>();
    generator.subschema_for::<standby_protocol::Event>();
    generator.subschema_for::<standby_protocol::AgentState>();
    generator.take_definitions(true)
}

fn null() -> Schema {
    ObjectBuilder::new().schema_type(Type::Null).build().into()
}

fn contract(name: &str) -> RefOr<Schema> {
    RefOr::Ref(Ref::from_schema_name(name))
}

/// `Event` of the contract.
pub(crate) fn event_schema() -> RefOr<Schema> {
    contract("Event")
}

/// `AgentState` of the contract, or `null`.
pub(crate) fn agent_state_schema() -> RefOr<Schema> {
    Schema::OneOf(OneOfBuilder::new().item(null()).item(contract("AgentState")).build()).into()
}

/// `Workspace` of the contract, or `null`.
pub(crate) fn workspace_schema() -> RefOr<Schema> {
    Schema::OneOf(OneOfBuilder::new().item(null()).item(contract("Workspace")).build()).into()
}

/// A list of the contract's `GitCredential`s.
pub(crate) fn git_credentials_schema() -> RefOr<Schema> {
    Schema::Array(ArrayBuilder::new().items(contract("GitCredential")).build()).into()
}

/// `GET /openapi.json`: this document. It needs no key.
#[utoipa::path(
    get,
    path = "/openapi.json",
    operation_id = "getOpenApi",
    tag = "server",
    security(()),
    responses((status = 200, description = "The OpenAPI 3.1 document of this API", content_type = "application/json", body = Object)),
)]
pub(crate) async fn openapi_json() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], TEXT.as_str()).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `docs/openapi.json` is what the code generates; `STANDBY_BLESS=1`
    /// rewrites it.
    #[test]
    fn the_committed_document_is_the_generated_one() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/openapi.json");
        if std::env::var_os("STANDBY_BLESS").is_some_and(|bless| bless == "1") {
            std::fs::write(&path, TEXT.as_str()).expect("write docs/openapi.json");
        }
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == *TEXT,
            "docs/openapi.json differs from the document the code generates: \
             run `STANDBY_BLESS=1 cargo test -p standby-control-plane openapi` and commit the result"
        );
    }

    #[test]
    fn the_document_is_openapi_3_1_and_every_reference_resolves() {
        let document = document();
        assert_eq!(document["openapi"], "3.1.0");
        fn refs<'a>(value: &'a Value, found: &mut Vec<&'a str>) {
            match value {
                Value::Object(map) => {
                    if let Some(Value::String(target)) = map.get("$ref") {
                        found.push(target);
                    }
                    map.values().for_each(|value| refs(value, found));
                }
                Value::Array(items) => items.iter().for_each(|value| refs(value, found)),
                _ => {}
            }
        }
        let mut found = Vec::new();
        refs(&document, &mut found);
        assert!(found.contains(&"#/components/schemas/Workspace"), "{found:?}");
        for target in found {
            let pointer = target.strip_prefix('#').expect("a local reference");
            assert!(document.pointer(pointer).is_some(), "{target} does not resolve");
        }
    }

    #[test]
    fn every_error_answer_is_a_problem() {
        let document = document();
        let paths = document["paths"].as_object().expect("paths");
        for (path, item) in paths {
            for (method, operation) in item.as_object().expect("a path item") {
                for (status, response) in operation["responses"].as_object().expect("responses") {
                    if status.starts_with('4') || status.starts_with('5') {
                        let content = &response["content"]["application/problem+json"]["schema"]["$ref"];
                        assert_eq!(content, "#/components/schemas/Problem", "{method} {path} {status}");
                    }
                }
            }
        }
    }
}
