//! What the OpenAPI document states alike in several places, written once:
//! the refusals several calls answer with the same status and meaning, and
//! a thread id's constraints (`check_thread_id`'s), for a submission and
//! the lists' filters alike. `#[utoipa::path]` names these types; the code
//! never builds them (its refusals are `Problem`s, its thread ids strings
//! that `check_thread_id` checks), each exists for what its derive writes.
#![expect(dead_code, reason = "each type's field is only the schema its derive puts in the document")]

use utoipa::{IntoResponses, ToSchema};

use crate::problem::{PROBLEM_JSON, Problem};

/// Every call but the document's own needs the API key (`authorize`).
#[derive(IntoResponses)]
#[response(status = 401, description = "No API key, or not this server's", content_type = PROBLEM_JSON)]
pub(crate) struct Unauthorized(Problem);

/// A query parameter of a read (a page's `limit` or `cursor`, a filter),
/// or one the call does not take.
#[derive(IntoResponses)]
#[response(
    status = 400,
    description = "A parameter is refused, or is not one of this call's: `errors` names it",
    content_type = PROBLEM_JSON
)]
pub(crate) struct BadParameter(Problem);

/// A call under `/v1/runs/{id}` whose run is neither in memory nor stored.
#[derive(IntoResponses)]
#[response(status = 404, description = "No run with this id", content_type = PROBLEM_JSON)]
pub(crate) struct NoSuchRun(Problem);

/// A call that reads or writes the store.
#[derive(IntoResponses)]
#[response(status = 500, description = "The store failed", content_type = PROBLEM_JSON)]
pub(crate) struct StoreFailed(Problem);

/// A call the engine answers, once it has stopped.
#[derive(IntoResponses)]
#[response(status = 503, description = "The server is shutting down", content_type = PROBLEM_JSON)]
pub(crate) struct ShuttingDown(Problem);

/// A thread id: 1 to 128 letters, digits, `.`, `_`, `-` or `:`, and not
/// `.` or `..` (the pattern says so without look-ahead, which not every
/// validator has).
#[derive(ToSchema)]
#[schema(
    min_length = 1,
    max_length = 128,
    pattern = r"^(?:[A-Za-z0-9_:-]|\.[A-Za-z0-9_:-]|\.\.[A-Za-z0-9._:-])[A-Za-z0-9._:-]*$"
)]
pub(crate) struct ThreadId(String);
