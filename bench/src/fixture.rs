//! The realistic workspace of the latency benchmark, generated on disk: a
//! git repository of about 2,000 files and 20 MB, a setup step that does
//! real work offline (a Python virtual environment and a local package
//! installed into it with pip), one MCP server, and the agent wrappers the
//! server launches.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result, bail};
use serde_json::{Value, json};

/// How big the generated repository is.
#[derive(Debug, Clone, Copy)]
pub struct RepoSize {
    pub files: usize,
    pub bytes_per_file: usize,
}

/// What the setup step does (see [`SETUP`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetupKind {
    Full,
    Light,
}

impl SetupKind {
    fn arg(self) -> &'static str {
        match self {
            Self::Full => "full",
            Self::Light => "light",
        }
    }
}

/// Everything the servers of the latency benchmark are started with.
#[derive(Debug)]
pub struct Fixture {
    pub spec_path: PathBuf,
    /// The spec's `workspace`: every run carries it (`same_preparation`).
    pub workspace: Value,
    /// Wrapper scripts around the real agent, by install plan.
    pub agent_parallel: PathBuf,
    pub agent_sequential: PathBuf,
    /// Where every agent's JSON log goes, one file per sandbox, kept after
    /// the server deletes the sandbox.
    pub agent_logs: PathBuf,
    pub repo_files: usize,
    pub repo_bytes: u64,
}

/// The interpreter behind `python3` on the PATH: the setup step and the
/// MCP server run it directly, since a version manager's shim (pyenv) would
/// add its own start-up to every setup and every MCP server start.
pub fn python() -> Result<PathBuf> {
    let output = std::process::Command::new("python3")
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .context("running python3 (needed by the setup step and the MCP server)")?;
    let path = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    if !output.status.success() || !path.is_file() {
        bail!("python3 did not name its interpreter: {}", String::from_utf8_lossy(&output.stderr).trim());
    }
    Ok(path)
}

/// Whether the interpreter's pip can install into another environment
/// (`pip --python`, pip 22.3 and later): what the light setup needs.
pub fn pip_installs_elsewhere(python: &Path) -> bool {
    let Ok(output) = std::process::Command::new(python).args(["-m", "pip", "--version"]).output() else {
        return false;
    };
    let text = String::from_utf8_lossy(&output.stdout);
    let version: Vec<u32> =
        text.split_whitespace().nth(1).unwrap_or("").split('.').map_while(|part| part.parse().ok()).collect();
    output.status.success() && version.as_slice() >= [22, 3].as_slice()
}

/// The setup step: a virtual environment with a local package installed
/// into it by pip, offline. The package is built by a PEP 517 backend of a
/// few lines in the repository (no setuptools or wheel needed). `$1` is the
/// interpreter; `$2` is `full` (the venv gets its own pip, through
/// ensurepip, as `python3 -m venv` does by default) or `light` (quick mode:
/// no pip in the venv; the interpreter's own pip installs into it, about a
/// quarter of the CPU).
const SETUP: &str = r#"#!/bin/sh
set -eu
python=$1
if [ "${2:-full}" = light ]; then
  "$python" -m venv --without-pip .venv
  "$python" -m pip --python .venv/bin/python install --quiet --no-index --no-build-isolation --disable-pip-version-check ./pkg
else
  "$python" -m venv .venv
  .venv/bin/python -m pip install --quiet --no-index --no-build-isolation --disable-pip-version-check ./pkg
fi
.venv/bin/python -c "import benchpkg; benchpkg.check()"
"#;

const PYPROJECT: &str = r#"[build-system]
requires = []
build-backend = "wheel_backend"
backend-path = ["."]

[project]
name = "benchpkg"
version = "0.1.0"
"#;

const BACKEND: &str = r#""""A PEP 517 backend of a few lines: builds a pure-Python wheel offline."""
import base64
import hashlib
import os
import zipfile

NAME, VERSION = "benchpkg", "0.1.0"
DIST = f"{NAME}-{VERSION}.dist-info"


def get_requires_for_build_wheel(config_settings=None):
    return []


def _record(entries):
    lines = []
    for path, data in entries:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        lines.append(f"{path},sha256={digest},{len(data)}")
    lines.append(f"{DIST}/RECORD,,")
    return ("\n".join(lines) + "\n").encode()


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    entries = []
    for root, _, files in os.walk(NAME):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path, "rb") as f:
                    entries.append((path, f.read()))
    entries.append((f"{DIST}/METADATA", f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n".encode()))
    entries.append((f"{DIST}/WHEEL", b"Wheel-Version: 1.0\nGenerator: wheel_backend\nRoot-Is-Purelib: true\nTag: py3-none-any\n"))
    wheel = f"{NAME}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, wheel), "w") as archive:
        for path, data in entries:
            archive.writestr(path, data)
        archive.writestr(f"{DIST}/RECORD", _record(entries))
    return wheel
"#;

const PACKAGE: &str = r#""""The benchmark's local package: installed by the setup step."""


def check():
    return True
"#;

/// Stands in for an MCP server speaking HTTP: answers every request with a
/// JSON-RPC result. It listens on a port of its own choosing (local
/// sandboxes share this machine's ports, so a fixed `ready_tcp` would
/// collide), so the agent counts it up as soon as it started.
const MCP_SERVER: &str = r#"import http.server
import json
import os


class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.dumps({"jsonrpc": "2.0", "id": 1, "result": {"mode": os.environ.get("MCP_MODE")}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


http.server.HTTPServer(("127.0.0.1", 0), Handler).serve_forever()
"#;

fn git(dir: &Path, args: &[&str]) -> Result<String> {
    let output = std::process::Command::new("git")
        .args(args)
        .current_dir(dir)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_AUTHOR_NAME", "Standby Bench")
        .env("GIT_AUTHOR_EMAIL", "bench@standby.invalid")
        .env("GIT_COMMITTER_NAME", "Standby Bench")
        .env("GIT_COMMITTER_EMAIL", "bench@standby.invalid")
        .output()
        .with_context(|| format!("running git {} in {}", args.join(" "), dir.display()))?;
    if !output.status.success() {
        bail!("git {} failed in {}: {}", args.join(" "), dir.display(), String::from_utf8_lossy(&output.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

fn write(path: &Path, contents: &[u8]) -> Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    }
    std::fs::write(path, contents).with_context(|| format!("writing {}", path.display()))
}

/// `<root>/agent-<tag><plan>`: runs `standby_bin` with the install `plan`.
fn wrapper(root: &Path, tag: &str, standby_bin: &Path, plan: &str, agent_logs: &Path) -> Result<PathBuf> {
    let path = root.join(format!("agent-{tag}{plan}"));
    // `exec` keeps the pid the server launched (and its parent-death
    // signal); stderr (the agent's log) goes to a file the benchmark reads
    // after the server deleted the sandbox.
    let script = format!(
        "#!/bin/sh\nexec '{}' --log-format json --install-plan {plan} \"$@\" 2>>'{}'/\"${{LOCAL_SANDBOX_ID:-$$}}\".log\n",
        standby_bin.display(),
        agent_logs.display()
    );
    executable(&path, &script)?;
    Ok(path)
}

impl Fixture {
    /// The same workspace and spec, with another agent binary (a baseline
    /// build's): its wrappers are named after `tag`.
    pub fn with_agent(&self, standby_bin: &Path, tag: &str) -> Result<Self> {
        let root = self.spec_path.parent().ok_or_else(|| anyhow::anyhow!("the spec has no directory"))?;
        Ok(Self {
            spec_path: self.spec_path.clone(),
            workspace: self.workspace.clone(),
            agent_parallel: wrapper(root, &format!("{tag}-"), standby_bin, "parallel", &self.agent_logs)?,
            agent_sequential: wrapper(root, &format!("{tag}-"), standby_bin, "sequential", &self.agent_logs)?,
            agent_logs: self.agent_logs.clone(),
            repo_files: self.repo_files,
            repo_bytes: self.repo_bytes,
        })
    }
}

fn executable(path: &Path, contents: &str) -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    write(path, contents.as_bytes())?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .with_context(|| format!("making {} executable", path.display()))
}

/// A deterministic generator of source-like text (xorshift64*), so every
/// run of the benchmark works on the same bytes.
struct Text(u64);

impl Text {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn file(&mut self, module: usize, index: usize, bytes: usize) -> String {
        const WORDS: [&str; 16] = [
            "request", "buffer", "window", "commit", "sandbox", "token", "offset", "handle", "config", "stream",
            "socket", "record", "worker", "signal", "module", "cursor",
        ];
        let mut text = format!("\"\"\"Module {module}, file {index}: generated for the benchmark.\"\"\"\n\n");
        let mut line = 0;
        while text.len() < bytes {
            let r = self.next();
            let (a, b) = (WORDS[(r & 15) as usize], WORDS[((r >> 4) & 15) as usize]);
            text.push_str(&format!(
                "def {a}_{b}_{line}(value):\n    return value * {} + 0x{:012x}  # {b} of the {a}\n\n",
                (r >> 8) % 1000,
                r >> 16
            ));
            line += 1;
        }
        text
    }
}

/// Generates the fixture under `root` (which must be empty or missing).
pub fn generate(root: &Path, size: RepoSize, setup: SetupKind, standby_bin: &Path) -> Result<Fixture> {
    let python = python()?;
    let repo = root.join("repo");
    std::fs::create_dir_all(&repo).with_context(|| format!("creating {}", repo.display()))?;
    let mut text = Text(0x9e37_79b9_7f4a_7c15);
    let mut repo_bytes = 0u64;
    let per_module = 50;
    for index in 0..size.files {
        let module = index / per_module;
        let content = text.file(module, index, size.bytes_per_file);
        repo_bytes += content.len() as u64;
        write(&repo.join(format!("src/mod{module:03}/file{index:04}.py")), content.as_bytes())?;
    }
    write(&repo.join("README.md"), b"# Benchmark workspace\nGenerated by standby-bench.\n")?;
    write(&repo.join(".gitignore"), b".venv/\n__pycache__/\n*.egg-info/\nbuild/\n")?;
    executable(&repo.join("setup.sh"), SETUP)?;
    write(&repo.join("pkg/pyproject.toml"), PYPROJECT.as_bytes())?;
    write(&repo.join("pkg/wheel_backend.py"), BACKEND.as_bytes())?;
    write(&repo.join("pkg/benchpkg/__init__.py"), PACKAGE.as_bytes())?;
    git(&repo, &["init", "--quiet", "--initial-branch=main"])?;
    git(&repo, &["add", "--all"])?;
    git(&repo, &["commit", "--quiet", "--message", "benchmark workspace"])?;
    // One pack: clones copy compressed objects instead of compressing
    // thousands of loose ones again for every sandbox.
    git(&repo, &["repack", "-a", "-d", "-q"])?;
    let head = git(&repo, &["rev-parse", "HEAD"])?;
    let mcp_script = root.join("mcp_server.py");
    write(&mcp_script, MCP_SERVER.as_bytes())?;

    // Pinned, as a control plane dispatches a run for a known commit: the
    // refresh then checks it out without a fetch when the pool was prepared
    // at it (a run by `ref` alone adds a fetch from the git remote).
    let workspace = json!({
        "repos": [{
            "url": format!("file://{}", repo.display()),
            "path": "app",
            "ref": "main",
            "expected_sha": head,
        }],
        "setup": [{
            "name": "venv",
            "command": ["sh", "setup.sh", python.display().to_string(), setup.arg()],
            "cwd": "app",
            "timeout_s": 600,
        }],
    });
    let spec = json!({
        "workspace": workspace,
        "mcp_servers": [{
            "name": "notes",
            "command": [python.display().to_string(), mcp_script.display().to_string()],
            "env": {"MCP_MODE": "read-only"},
        }],
        "shell": ["/bin/sh"],
    });
    let spec_path = root.join("spec.json");
    write(&spec_path, serde_json::to_string_pretty(&spec).context("encoding the spec")?.as_bytes())?;

    let agent_logs = root.join("agent-logs");
    std::fs::create_dir_all(&agent_logs).with_context(|| format!("creating {}", agent_logs.display()))?;
    Ok(Fixture {
        spec_path,
        workspace,
        agent_parallel: wrapper(root, "", standby_bin, "parallel", &agent_logs)?,
        agent_sequential: wrapper(root, "", standby_bin, "sequential", &agent_logs)?,
        agent_logs,
        repo_files: size.files + 5,
        repo_bytes,
    })
}
