//! The workspace's state directory, `<workspace>/.standby`: what the agent
//! keeps there and what it names to the run. One definition, so that
//! preparation, the install, per-turn hygiene and the tests agree.

use std::path::{Path, PathBuf};

/// Name of the state directory inside the workspace.
pub const STATE_DIR: &str = ".standby";

/// The state directory of one workspace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateDir(PathBuf);

impl StateDir {
    pub fn of(workspace: &Path) -> Self {
        Self(workspace.join(STATE_DIR))
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    /// Keeps the state directory out of a repo checked out at the
    /// workspace root (`*`): it holds credentials, and `git add -A` must
    /// never pick them up.
    pub fn gitignore(&self) -> PathBuf {
        self.0.join(".gitignore")
    }

    /// The recorded fingerprint of a finished preparation.
    pub fn state_file(&self) -> PathBuf {
        self.0.join("state.json")
    }

    /// Output of the setup steps.
    pub fn setup_log(&self) -> PathBuf {
        self.0.join("setup.log")
    }

    /// The MCP servers listed for the run (`STANDBY_MCP_CONFIG`).
    pub fn mcp_config(&self) -> PathBuf {
        self.0.join("mcp.json")
    }

    /// Output of the MCP server `name`.
    pub fn mcp_log(&self, name: &str) -> PathBuf {
        self.0.join(format!("mcp-{name}.log"))
    }

    /// The run's metadata (`STANDBY_METADATA_FILE`).
    pub fn metadata_file(&self) -> PathBuf {
        self.0.join("metadata.json")
    }

    /// Where attachments are written (`STANDBY_ATTACHMENTS_DIR`).
    pub fn attachments_dir(&self) -> PathBuf {
        self.0.join("attachments")
    }

    /// Git credentials for the run (mode 0600).
    pub fn git_credentials(&self) -> PathBuf {
        self.0.join("git-credentials")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_file_is_inside_the_state_dir() {
        let dir = StateDir::of(Path::new("/w"));
        assert_eq!(dir.state_file(), Path::new("/w/.standby/state.json"));
        assert_eq!(dir.mcp_config(), Path::new("/w/.standby/mcp.json"));
        assert_eq!(dir.mcp_log("web"), Path::new("/w/.standby/mcp-web.log"));
        assert_eq!(dir.attachments_dir(), Path::new("/w/.standby/attachments"));
    }
}
