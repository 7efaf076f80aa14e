//! The API server's failures, as the `Status` objects a real kube-apiserver
//! answers with: kube turns any non-2xx body of this shape into
//! `kube::Error::Api`, so the reasons and codes here are what the provider's
//! error handling is tested against.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

/// A failed API request. `resource` is the plural (`pods`), `group` the API
/// group ("" for core): the message names the group-qualified resource as the
/// real server does (`sandboxes.agents.x-k8s.io "x" not found`).
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{} \"{name}\" not found", qualified(.resource, .group))]
    NotFound { resource: String, group: String, name: String },
    #[error("{} \"{name}\" already exists", qualified(.resource, .group))]
    AlreadyExists { resource: String, group: String, name: String },
    #[error(
        "Operation cannot be fulfilled on {} \"{name}\": the object has been modified; please apply your changes to the latest version and try again",
        qualified(.resource, .group)
    )]
    Conflict { resource: String, group: String, name: String },
    /// 422: the object fails validation.
    #[error("{0}")]
    Invalid(String),
    /// 400: the request itself is malformed, or asks for something the pod's
    /// state does not allow (exec into a pod that is not running).
    #[error("{0}")]
    BadRequest(String),
    /// 404 for a path the server has no resource for.
    #[error("the server could not find the requested resource")]
    NoSuchResource,
    #[error("the server does not allow this method on the requested resource")]
    MethodNotAllowed,
    #[error("the body of the request was in an unknown format - accepted media types include: {0}")]
    UnsupportedMediaType(String),
    /// 410: a watch asked for a version older than the kept history.
    #[error("too old resource version: {requested} ({oldest})")]
    Expired { requested: u64, oldest: u64 },
    #[error("{0}")]
    Internal(String),
}

fn qualified(resource: &str, group: &str) -> String {
    if group.is_empty() { resource.to_owned() } else { format!("{resource}.{group}") }
}

impl ApiError {
    pub fn code(&self) -> u16 {
        match self {
            Self::NotFound { .. } | Self::NoSuchResource => 404,
            Self::AlreadyExists { .. } | Self::Conflict { .. } => 409,
            Self::Invalid(_) => 422,
            Self::BadRequest(_) => 400,
            Self::MethodNotAllowed => 405,
            Self::UnsupportedMediaType(_) => 415,
            Self::Expired { .. } => 410,
            Self::Internal(_) => 500,
        }
    }

    pub fn reason(&self) -> &'static str {
        match self {
            Self::NotFound { .. } | Self::NoSuchResource => "NotFound",
            Self::AlreadyExists { .. } => "AlreadyExists",
            Self::Conflict { .. } => "Conflict",
            Self::Invalid(_) => "Invalid",
            Self::BadRequest(_) => "BadRequest",
            Self::MethodNotAllowed => "MethodNotAllowed",
            Self::UnsupportedMediaType(_) => "UnsupportedMediaType",
            Self::Expired { .. } => "Expired",
            Self::Internal(_) => "InternalError",
        }
    }

    /// The `Status` object of this failure.
    pub fn status(&self) -> Value {
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.to_string(),
            "reason": self.reason(),
            "code": self.code(),
        });
        if let Self::NotFound { resource, group, name }
        | Self::AlreadyExists { resource, group, name }
        | Self::Conflict { resource, group, name } = self
        {
            status["details"] = json!({ "name": name, "group": group, "kind": resource });
        }
        status
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let code = StatusCode::from_u16(self.code()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (code, axum::Json(self.status())).into_response()
    }
}
