//! The demo's sample repository and the spec that prepares it: a real
//! setup step (a Python virtual environment where python3 can make one),
//! an MCP server, and the task every run executes.

use std::path::Path;
use std::time::Duration;

use standby_protocol::{McpServer, Repo, SetupStep, Spec, Workspace};

use super::{DemoError, io};

pub(super) fn git(dir: &Path, args: &[&str]) -> Result<(), DemoError> {
    let output = std::process::Command::new("git")
        .args(args)
        .current_dir(dir)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_AUTHOR_NAME", "Standby Demo")
        .env("GIT_AUTHOR_EMAIL", "demo@standby.invalid")
        .env("GIT_COMMITTER_NAME", "Standby Demo")
        .env("GIT_COMMITTER_EMAIL", "demo@standby.invalid")
        .output()
        .map_err(io("run git in", dir))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(DemoError::Git {
            args: args.join(" "),
            dir: dir.to_owned(),
            message: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        })
    }
}

/// The sample's setup step where python3 can make a virtual environment:
/// what `pip install -r requirements.txt`, `npm ci` or `cargo build` is in a
/// real repository, seconds of real work that a cold sandbox pays after the
/// run was submitted and a standby paid before. A virtual environment with
/// its own pip (ensurepip), and the repository's package installed into it
/// by a `.pth` file, as an editable install does, so nothing is fetched.
const SETUP_VENV: &str = r#"#!/bin/sh
set -e
python3 -m venv .venv
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
pwd > "$site/sample_pkg.pth"
.venv/bin/python -m compileall -q sample_pkg
mkdir -p build
.venv/bin/python -c 'import sample_pkg; sample_pkg.build()' > build/info.txt
"#;

/// The sample's setup step without python3's `venv`: a stand-in build.
const SETUP_PLAIN: &str = "#!/bin/sh
set -e
mkdir -p build
echo \"built from $(git rev-parse --short HEAD)\" > build/info.txt
";

/// The sample repository's package, installed by [`SETUP_VENV`].
const SAMPLE_PACKAGE: &str = r#""""The sample repository's package, installed by its setup step."""
import subprocess


def build():
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
    print(f"built from {head.stdout.strip()} in a virtual environment")
"#;

const TASK: &str = "#!/bin/sh
# The sample's run: reads what setup built.
echo \"task $1: $(cat build/info.txt), DEMO_TASK=$DEMO_TASK\"
";

/// A tiny TCP server standing in for an MCP server: it accepts and answers
/// one line per connection. It listens on a port of its own choosing, since
/// every local sandbox shares this machine's ports.
const MCP_SERVER: &str = "import socket
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(('127.0.0.1', 0))
server.listen()
while True:
    connection, _ = server.accept()
    connection.sendall(b'{\"jsonrpc\":\"2.0\",\"result\":\"demo notes\"}\\n')
    connection.close()
";

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}

/// Whether `python3` can make a virtual environment with its own pip
/// (Debian splits `venv` and `ensurepip` into python3-venv).
fn python_venv() -> bool {
    std::process::Command::new("python3")
        .args(["-c", "import venv, ensurepip"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// What the sample's standbys have: an MCP server (python3 on the PATH),
/// and a setup step that builds a Python virtual environment.
#[derive(Debug, Clone, Copy)]
pub(super) struct Sample {
    pub(super) mcp: bool,
    pub(super) venv: bool,
}

/// The sample repository and the spec that prepares it. In a container
/// (`in_container`) there is no python3 (the sandbox image has git and a
/// shell), so no MCP server and the stand-in build.
pub(super) fn sample(dir: &Path, setup_cost: Duration, in_container: bool) -> Result<(Spec, Sample), DemoError> {
    let python = !in_container && on_path("python3");
    let venv = python && python_venv();
    let base = if venv { SETUP_VENV } else { SETUP_PLAIN };
    let setup =
        if setup_cost.is_zero() { base.to_owned() } else { format!("{base}sleep {:.3}\n", setup_cost.as_secs_f64()) };
    let repo = dir.join("sample-repo");
    std::fs::create_dir_all(repo.join("sample_pkg")).map_err(io("create", &repo))?;
    for (name, content) in [
        ("README.md", "# Sample\nA repository the demo's standbys prepare.\n"),
        (".gitignore", ".venv/\nbuild/\n__pycache__/\n"),
        ("setup.sh", &setup),
        ("task.sh", TASK),
        ("sample_pkg/__init__.py", SAMPLE_PACKAGE),
    ] {
        let path = repo.join(name);
        std::fs::write(&path, content).map_err(io("write", &path))?;
    }
    git(&repo, &["init", "--quiet", "--initial-branch=main"])?;
    git(&repo, &["add", "--all"])?;
    git(&repo, &["commit", "--quiet", "--message", "sample"])?;
    let mut mcp_servers = Vec::new();
    if python {
        let script = dir.join("mcp_notes.py");
        std::fs::write(&script, MCP_SERVER).map_err(io("write", &script))?;
        mcp_servers.push(McpServer {
            name: "notes".into(),
            command: vec!["python3".into(), script.display().to_string()],
            env: [("NOTES_MODE".to_owned(), "read-only".to_owned())].into(),
            ready_tcp: None,
            transport: None,
            url: None,
            client_capabilities: None,
            workspace_root: None,
        });
    }
    let spec = Spec {
        workspace: Workspace {
            repos: vec![Repo {
                url: format!("file://{}", repo.display()),
                path: "app".into(),
                git_ref: Some("main".into()),
                expected_sha: None,
            }],
            setup: vec![SetupStep {
                name: "build".into(),
                command: vec!["sh".into(), "setup.sh".into()],
                cwd: Some("app".into()),
                timeout_s: Some(120),
                inputs: None,
            }],
        },
        mcp_servers,
        mcp_client_capabilities: None,
        shell: Some(vec!["/bin/sh".into()]),
        deadline: None,
    };
    Ok((spec, Sample { mcp: python, venv }))
}
