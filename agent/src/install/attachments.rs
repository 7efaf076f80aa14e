//! The run's attachments: listed inline in the assignment (amendment 5) or
//! by the attachments call, each fetched from its `url` under the origin
//! rule ([`crate::urls::attachment_target`]), streamed to a temporary file
//! in the attachments directory while it is hashed, and renamed into place
//! only when its SHA-256 matches. No attachment is ever held in memory whole.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use reqwest::{Method, Url};
use sha2::{Digest, Sha256};
use standby_protocol::layout::StateDir;
use standby_protocol::{Attachment, AttachmentsResponse, Cause, Stage, paths};
use tokio::io::AsyncWriteExt;

use super::InstallInput;
use crate::api::{ApiError, call_backoff, call_name, human_bytes, retry, transport};
use crate::lifecycle::InstallFailure;
use crate::paths::check_file_name;
use crate::urls::{attachment_target, describe_url};

/// Largest attachment accepted.
pub const MAX_ATTACHMENT_BYTES: u64 = 256 << 20;

const STAGE: Stage = Stage::Attachments;

/// Distinguishes the temporary files of concurrent downloads.
static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Lists, checks and writes every attachment of the run.
pub async fn attachments(input: &InstallInput) -> Result<(), InstallFailure> {
    let listed = match &input.run.attachments {
        Some(inline) => inline.clone(),
        None => {
            let path = paths::attachments(&input.execution_id);
            let response: AttachmentsResponse = retry(&format!("GET {path}"), input.deadline, call_backoff(), || {
                input.api.get_json(&input.credential, &path)
            })
            .await
            .map_err(InstallFailure::call_failed(STAGE))?;
            response.attachments
        }
    };
    // Every name and URL is checked before anything is downloaded or written.
    let mut targets = Vec::with_capacity(listed.len());
    for attachment in &listed {
        check_file_name(&attachment.name)
            .map_err(|e| InstallFailure::new(STAGE, Cause::InvalidRun, format!("attachment name: {e}")))?;
        let target = attachment_target(input.api.server(), &attachment.url, input.api.insecure()).map_err(|e| {
            InstallFailure::new(STAGE, Cause::InvalidRun, format!("attachment `{}`: {e}", attachment.name))
        })?;
        targets.push(target);
    }
    let dir = StateDir::of(&input.root).attachments_dir();
    if listed.is_empty() {
        // The run is told where its attachments are: there is none.
        tokio::fs::create_dir_all(&dir)
            .await
            .map_err(|e| InstallFailure::new(STAGE, Cause::Sandbox, format!("creating {}: {e}", dir.display())))?;
    }
    let downloads = listed.iter().zip(&targets).map(|(attachment, target)| download(input, &dir, attachment, target));
    futures::future::try_join_all(downloads).await?;
    Ok(())
}

/// Fetches one attachment (retrying transient failures from the start),
/// then renames it into place if its SHA-256 matches.
async fn download(
    input: &InstallInput,
    dir: &Path,
    attachment: &Attachment,
    target: &Url,
) -> Result<(), InstallFailure> {
    let call = call_name(&Method::GET, target.as_str());
    let temp = dir.join(format!(
        ".{}.{}.{}.part",
        attachment.name,
        std::process::id(),
        TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = async {
        // A disk error is the inner `Err`: retrying the call cannot help.
        let actual = retry(&call, input.deadline, call_backoff(), || stream_to(input, target, &call, &temp))
            .await
            .map_err(InstallFailure::call_failed(STAGE))?
            .map_err(|message| InstallFailure::new(STAGE, Cause::Sandbox, message))?;
        if !actual.eq_ignore_ascii_case(attachment.sha256.trim()) {
            return Err(InstallFailure::new(
                STAGE,
                Cause::Network,
                format!("attachment `{}`: SHA-256 is {actual}, expected {}", attachment.name, attachment.sha256),
            ));
        }
        let file = dir.join(&attachment.name);
        tokio::fs::rename(&temp, &file)
            .await
            .map_err(|e| InstallFailure::new(STAGE, Cause::Sandbox, format!("writing {}: {e}", file.display())))
    }
    .await;
    if result.is_err() {
        // Best effort: the download already failed; a leftover is removed
        // with the run's files when the run ends.
        let _ = tokio::fs::remove_file(&temp).await;
    }
    result
}

/// One attempt: streams the body into `temp` (created anew, mode 0600),
/// hashing as it goes, and returns the SHA-256 in lowercase hex, or (inner
/// `Err`) why the file could not be written.
async fn stream_to(
    input: &InstallInput,
    target: &Url,
    call: &str,
    temp: &Path,
) -> Result<Result<String, String>, ApiError> {
    let io = |e: std::io::Error| format!("writing {}: {e}", temp.display());
    // The file is made while the request is under way: each `tokio::fs`
    // call is a trip to the blocking pool, and these need no answer.
    let open = async {
        if let Some(dir) = temp.parent() {
            tokio::fs::create_dir_all(dir).await?;
        }
        tokio::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(temp).await
    };
    let (response, file) = tokio::join!(input.api.send(Method::GET, &input.credential, target.as_str(), None), open);
    let mut response = response?;
    let too_large = || ApiError::TooLarge { call: call.to_owned(), cap: MAX_ATTACHMENT_BYTES };
    if response.content_length().is_some_and(|length| length > MAX_ATTACHMENT_BYTES) {
        return Err(too_large());
    }
    let mut file = match file {
        Ok(file) => file,
        Err(e) => return Ok(Err(io(e))),
    };
    let mut hasher = Sha256::new();
    let mut written = 0u64;
    while let Some(chunk) = response.chunk().await.map_err(|e| transport(call, e))? {
        written += chunk.len() as u64;
        if written > MAX_ATTACHMENT_BYTES {
            return Err(too_large());
        }
        hasher.update(&chunk);
        if let Err(e) = file.write_all(&chunk).await {
            return Ok(Err(io(e)));
        }
    }
    // Flushed to the file (tokio's file buffers a write), not synced: a run
    // file is worth nothing after a crash, and an fsync would sit on the
    // run's critical path.
    if let Err(e) = file.flush().await {
        return Ok(Err(io(e)));
    }
    tracing::debug!(url = describe_url(target.as_str()), size = %human_bytes(written), "attachment fetched");
    Ok(Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect()))
}
