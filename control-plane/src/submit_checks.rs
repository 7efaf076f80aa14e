//! Strings of a submission that no process can be given: a NUL byte ends a
//! C string, so an argument, a path or an environment entry holding one
//! fails only at the agent, after a sandbox (and an attempt) was spent on
//! it. Refused at submit instead, naming the field.
//!
//! `metadata` is not checked: it reaches the run as a JSON file, where a
//! NUL is the escape `\u0000` and harmless. Attachment contents are bytes.

use std::collections::BTreeMap;

use standby_protocol::{Secret, Workspace};

use crate::user_api::Submission;

/// The path of the first string of `submission` holding a NUL byte, in the
/// API's field syntax (`env.NAME`, `command[2]`, `git_credentials[0].host`).
pub(crate) fn first_nul(submission: &Submission) -> Option<String> {
    let mut found = Found::default();
    for (i, arg) in submission.command.iter().enumerate() {
        found.check(|| format!("command[{i}]"), arg);
    }
    if let Some(cwd) = &submission.cwd {
        found.check(|| "cwd".into(), cwd);
    }
    found.map("env", submission.env.iter().map(|(k, v)| (k, v.as_str())));
    found.map("mcp_env", submission.mcp_env.iter().map(|(k, v)| (k, v.as_str())));
    found.map("secrets", secrets(&submission.secrets));
    found.map("cloud_env", secrets(&submission.cloud_env));
    for (i, credential) in submission.git_credentials.iter().enumerate() {
        found.check(|| format!("git_credentials[{i}].protocol"), &credential.protocol);
        found.check(|| format!("git_credentials[{i}].host"), &credential.host);
        found.check(|| format!("git_credentials[{i}].username"), &credential.username);
        found.check(|| format!("git_credentials[{i}].password"), credential.password.expose());
    }
    for (i, attachment) in submission.attachments.iter().enumerate() {
        found.check(|| format!("attachments[{i}].name"), &attachment.name);
    }
    if let Some(thread_id) = &submission.thread_id {
        found.check(|| "thread_id".into(), thread_id);
    }
    if let Some(workspace) = &submission.workspace {
        found.workspace(workspace);
    }
    found.0
}

fn secrets(map: &BTreeMap<String, Secret>) -> impl Iterator<Item = (&String, &str)> {
    map.iter().map(|(name, value)| (name, value.expose()))
}

/// The first offending field, once found.
#[derive(Debug, Default)]
struct Found(Option<String>);

impl Found {
    fn check(&mut self, field: impl FnOnce() -> String, value: &str) {
        if self.0.is_none() && value.contains('\0') {
            self.0 = Some(field());
        }
    }

    /// A map's names and values; a name holding a NUL is shown escaped.
    fn map<'a>(&mut self, field: &str, entries: impl Iterator<Item = (&'a String, &'a str)>) {
        for (name, value) in entries {
            let path = || format!("{field}.{}", name.replace('\0', "\\0"));
            self.check(path, name);
            self.check(path, value);
        }
    }

    fn workspace(&mut self, workspace: &Workspace) {
        for (i, repo) in workspace.repos.iter().enumerate() {
            self.check(|| format!("workspace.repos[{i}].url"), &repo.url);
            self.check(|| format!("workspace.repos[{i}].path"), &repo.path);
            if let Some(git_ref) = &repo.git_ref {
                self.check(|| format!("workspace.repos[{i}].ref"), git_ref);
            }
            if let Some(sha) = &repo.expected_sha {
                self.check(|| format!("workspace.repos[{i}].expected_sha"), sha);
            }
        }
        for (i, step) in workspace.setup.iter().enumerate() {
            self.check(|| format!("workspace.setup[{i}].name"), &step.name);
            for (j, arg) in step.command.iter().enumerate() {
                self.check(|| format!("workspace.setup[{i}].command[{j}]"), arg);
            }
            if let Some(cwd) = &step.cwd {
                self.check(|| format!("workspace.setup[{i}].cwd"), cwd);
            }
        }
    }
}
