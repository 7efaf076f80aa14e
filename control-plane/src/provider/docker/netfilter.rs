//! The sandboxes' firewall on the host (`firewall.rs` decides the rules):
//! `iptables` and `ip6tables` run as commands, as the Engine itself runs
//! them, so that the rules live in the same backend (nf_tables or legacy)
//! as the Engine's.
//!
//! Several servers may serve on one network (replicas on one machine): the
//! chains are the network's, each server adds its openings to the `IN`
//! chain and removes them at its clean stop, and the last one out removes
//! the chains and their jumps. The `OUT` chain is replaced whole, in one
//! `iptables-restore` transaction (never empty for a moment), by each
//! server that starts: the last started sets the policy. A lock file
//! serialises servers of this machine between reading the chains and
//! changing them. A crash leaves the rules: closed, never open; the next
//! start on the network replaces them, and `standby-server prune
//! --network` removes them with the network.

use std::fs::File;
use std::io::Write as _;
use std::process::{Command, Stdio};

use super::firewall::{self, Allow, Policy};

/// A failed netfilter command, named with its arguments.
#[derive(Debug, thiserror::Error)]
pub enum NetfilterError {
    #[error(
        "`{command}` failed: {message}. Managing the sandboxes' firewall needs root (CAP_NET_ADMIN) and \
         iptables on the host; where the server cannot have them, --sandbox-egress unfiltered leaves the \
         filtering to the host's own firewall (docs/deploy.md, \"Isolation\")"
    )]
    Command { command: String, message: String },
    #[error("cannot open the firewall lock {path}: {source}")]
    Lock {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// The two tables' commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Family {
    V4,
    V6,
}

impl Family {
    fn program(self) -> &'static str {
        match self {
            Self::V4 => "iptables",
            Self::V6 => "ip6tables",
        }
    }
}

/// Runs `iptables -w ARGS` (or ip6tables): its standard output.
fn run(family: Family, args: &[String]) -> Result<String, NetfilterError> {
    let program = family.program();
    let command = || format!("{program} -w {}", args.join(" "));
    let output = Command::new(program)
        .arg("-w")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|error| NetfilterError::Command { command: command(), message: error.to_string() })?;
    if output.status.success() {
        return Ok(String::from_utf8_lossy(&output.stdout).into_owned());
    }
    let message = String::from_utf8_lossy(&output.stderr).trim().to_owned();
    Err(NetfilterError::Command { command: command(), message })
}

/// Whether a rule exists (`-C`): a check that fails for any other reason
/// than "no such rule" counts as missing, and the following insert reports it.
fn exists(family: Family, chain: &str, rule: &[String]) -> bool {
    let mut args = vec!["-C".to_owned(), chain.to_owned()];
    args.extend_from_slice(rule);
    run(family, &args).is_ok()
}

fn with(words: &[&str], rule: &[String]) -> Vec<String> {
    let mut args: Vec<String> = words.iter().map(|word| (*word).to_owned()).collect();
    args.extend_from_slice(rule);
    args
}

/// Replaces a chain's rules in one transaction, creating it when missing.
fn replace_chain(family: Family, chain: &str, rules: &[Vec<String>]) -> Result<(), NetfilterError> {
    let program = format!("{}-restore", family.program());
    let mut text = format!("*filter\n:{chain} - [0:0]\n");
    for rule in rules {
        text.push_str(&format!("-A {chain} {}\n", rule.iter().map(|word| quoted(word)).collect::<Vec<_>>().join(" ")));
    }
    text.push_str("COMMIT\n");
    let command = || format!("{program} -w --noflush (chain {chain})");
    let failed = |message: String| NetfilterError::Command { command: command(), message };
    let mut child = Command::new(&program)
        .args(["-w", "--noflush"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|error| failed(error.to_string()))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(text.as_bytes()).map_err(|error| failed(error.to_string()))?;
    }
    let output = child.wait_with_output().map_err(|error| failed(error.to_string()))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(failed(String::from_utf8_lossy(&output.stderr).trim().to_owned()))
    }
}

/// A word of a restore file: quoted when it holds a space (a comment).
fn quoted(word: &str) -> String {
    if word.contains(' ') { format!("\"{word}\"") } else { word.to_owned() }
}

/// Inserts `-i bridge -j chain` first in `hook` unless it is there.
fn hook(family: Family, hook: &str, bridge: &str, chain: &str) -> Result<(), NetfilterError> {
    let jump: Vec<String> = ["-i", bridge, "-j", chain].iter().map(|word| (*word).to_owned()).collect();
    if !exists(family, hook, &jump) {
        run(family, &with(&["-I", hook, "1"], &jump))?;
    }
    Ok(())
}

/// Deletes every `-i bridge -j chain` of `hook`, then the chain; missing
/// ones are fine.
fn unhook(family: Family, hook: &str, bridge: &str, chain: &str) {
    let jump: Vec<String> = ["-i", bridge, "-j", chain].iter().map(|word| (*word).to_owned()).collect();
    while exists(family, hook, &jump) {
        if run(family, &with(&["-D", hook], &jump)).is_err() {
            break;
        }
    }
    let _ = run(family, &["-F".to_owned(), chain.to_owned()]);
    let _ = run(family, &["-X".to_owned(), chain.to_owned()]);
}

/// The chain the Engine leaves to its users in `family`'s table; `FORWARD`
/// where it has none (an Engine with ip6tables off).
fn forward_hook(family: Family) -> &'static str {
    if run(family, &["-S".to_owned(), "DOCKER-USER".to_owned()]).is_ok() { "DOCKER-USER" } else { "FORWARD" }
}

/// Holds the machine's firewall lock until dropped.
struct Locked {
    _file: File,
}

fn lock() -> Result<Locked, NetfilterError> {
    let dir = if std::path::Path::new("/run/lock").is_dir() { "/run/lock".into() } else { std::env::temp_dir() };
    let path = dir.join("standby-firewall.lock");
    let failed = |source| NetfilterError::Lock { path: path.display().to_string(), source };
    let file = File::options().create(true).truncate(false).write(true).open(&path).map_err(failed)?;
    file.lock().map_err(failed)?;
    Ok(Locked { _file: file })
}

/// Whether the host has IPv6 at all: without it there is nothing to guard,
/// and ip6tables may have no table to change.
fn host_has_ipv6() -> bool {
    std::path::Path::new("/proc/net/if_inet6").exists()
}

/// Puts the network's chains in place for a server serving on `port`: the
/// `OUT` chain replaced by `policy`, the `IN` chain made when missing and
/// given this server's openings, the IPv6 chains, and the jumps to them.
/// Blocking: call it off the runtime's workers.
/// Not for `--sandbox-egress unfiltered`, which puts nothing in place.
pub fn guard(bridge: &str, policy: &Policy, port: u16) -> Result<(), NetfilterError> {
    let _locked = lock()?;
    let (input, output) = firewall::chains(bridge);
    replace_chain(Family::V4, &output, &firewall::output_rules(policy))?;
    hook(Family::V4, forward_hook(Family::V4), bridge, &output)?;
    if run(Family::V4, &["-S".to_owned(), input.clone()]).is_err() {
        replace_chain(Family::V4, &input, &firewall::input_rules())?;
    }
    for rule in firewall::openings(port, &policy.allow) {
        if !exists(Family::V4, &input, &rule) {
            // After the replies, before the refusal.
            run(Family::V4, &with(&["-I", &input, "2"], &rule))?;
        }
    }
    hook(Family::V4, "INPUT", bridge, &input)?;
    if host_has_ipv6() {
        for (chain, place) in [(&input, "INPUT"), (&output, forward_hook(Family::V6))] {
            replace_chain(Family::V6, chain, &firewall::ipv6_rules())?;
            hook(Family::V6, place, bridge, chain)?;
        }
    }
    Ok(())
}

/// Removes this server's openings; when no server's are left, every chain
/// of the network and the jumps to them. Failures are logged: a stop goes on.
pub fn release(bridge: &str, allow: &[Allow], port: u16) {
    let Ok(_locked) = lock() else {
        tracing::warn!(bridge, "the firewall lock cannot be taken: the sandboxes' rules are left in place");
        return;
    };
    let (input, _) = firewall::chains(bridge);
    for rule in firewall::openings(port, allow) {
        if let Err(error) = run(Family::V4, &with(&["-D", &input], &rule)) {
            tracing::debug!(%error, "a server's opening was already gone");
        }
    }
    let listed = run(Family::V4, &["-S".to_owned(), input]).unwrap_or_default();
    if listed.lines().any(firewall::is_opening) {
        tracing::info!(bridge, "another server still serves on the sandboxes' network: its rules stay");
        return;
    }
    remove_locked(bridge);
}

/// Removes every chain of the network and the jumps to them, whoever made
/// them (the network is going: `prune --network`, a test's cleanup).
pub fn remove(bridge: &str) {
    match lock() {
        Ok(_locked) => remove_locked(bridge),
        Err(error) => tracing::warn!(%error, bridge, "the sandboxes' rules are left in place"),
    }
}

fn remove_locked(bridge: &str) {
    let (input, output) = firewall::chains(bridge);
    unhook(Family::V4, "INPUT", bridge, &input);
    unhook(Family::V4, forward_hook(Family::V4), bridge, &output);
    if host_has_ipv6() {
        unhook(Family::V6, "INPUT", bridge, &input);
        unhook(Family::V6, forward_hook(Family::V6), bridge, &output);
    }
    tracing::info!(bridge, "the sandboxes' firewall rules removed");
}
