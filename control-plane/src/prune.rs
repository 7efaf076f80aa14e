//! `standby-server prune`: the command around the library's
//! `provider::docker::prune` (what goes, and whether it may) and
//! `data_dir` (whether a server runs on the data directory). Progress
//! lines on stderr, the summary on stdout.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use clap::ArgGroup;
use standby_control_plane::data_dir::{self, Probe};
use standby_control_plane::provider::docker::prune::{self, Guard, Permission};

/// The exit code of a refusal: the instance's server runs (or may).
pub const REFUSED: u8 = 3;

pub const AFTER_HELP: &str = "\
Which instance is running: every `serve` holds a lock on <data dir>/serve.lock while it runs (the kernel \
drops it when the process ends, a crash included). When ID is the instance of --data-dir (its \
instance-id file) and a server holds that lock, the prune is refused, --force or not; when no server \
holds it, the prune holds it until it is done (a `serve` started on the directory meanwhile waits). An ID \
of another data directory cannot be checked from here: the prune is refused while any of its containers \
runs, unless --force (a crashed server's containers run on too).

Exit codes:
  0  done (or nothing to remove; --dry-run and --list: listed)
  1  failed: the engine unreachable, or something not removed (each named, with its instance)
  2  usage: flags missing or wrong
  3  refused: that instance's server is running (or may be: see above)";

/// `standby-server prune`'s flags.
#[derive(Debug, clap::Args)]
#[command(group(ArgGroup::new("what").required(true).args(["instance", "list"])))]
pub struct PruneArgs {
    /// The instance to remove: the value of the `standby.instance` label
    /// (a data directory's is in `<data dir>/instance-id`; --list shows
    /// every instance on the engine).
    #[arg(long, value_name = "ID", value_parser = instance_arg)]
    instance: Option<String>,
    /// List the instances with containers or images on the engine, with
    /// counts (containers, running ones, images), and which is --data-dir's.
    #[arg(long, conflicts_with_all = ["network", "dry_run", "force"])]
    list: bool,
    /// Also remove this network (the instance's --docker-network) when a
    /// standby server made it (its `standby.network` label) and no
    /// container, of any instance, running or stopped, is left on it.
    #[arg(long, value_name = "NAME", requires = "instance")]
    network: Option<String>,
    /// Print what would be removed; remove nothing.
    #[arg(long)]
    dry_run: bool,
    /// Remove an instance of another data directory though some of its
    /// containers run. Never overrides a server running on --data-dir.
    #[arg(long)]
    force: bool,
    /// The data directory whose running server's instance is never
    /// pruned: `serve`'s, with its default and variable.
    #[arg(long, env = "STANDBY_SERVER_DATA_DIR", default_value = "standby-data", value_name = "DIR")]
    data_dir: PathBuf,
}

/// A refusal: the instance's server runs, or may.
#[derive(Debug, thiserror::Error)]
#[error("refused: {0}")]
pub struct Refused(String);

/// An instance id as the label holds it: not empty, no space or `=`.
fn instance_arg(text: &str) -> Result<String, String> {
    let valid = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if text.is_empty() || !text.chars().all(valid) {
        return Err(format!("`{text}` is not an instance id (letters, digits, `-`, `_`, `.`)"));
    }
    Ok(text.to_owned())
}

fn progress(line: &str) {
    eprintln!("standby-server prune: {line}");
}

/// `standby-server prune`.
pub async fn run(args: PruneArgs) -> anyhow::Result<()> {
    let Some(instance) = args.instance.clone() else {
        return list(&args.data_dir).await;
    };
    // The guard before anything: its lock is held through the removal.
    let (guard, _lock) = if data_dir::instance_id(&args.data_dir).as_deref() == Some(instance.as_str()) {
        let probe = data_dir::lock_for_prune(&args.data_dir)
            .with_context(|| format!("cannot lock the data directory {}", args.data_dir.display()))?;
        match probe {
            Probe::Free(lock) => (Guard::Stopped, Some(lock)),
            Probe::Held => (Guard::Running, None),
            Probe::NoDirectory => (Guard::Elsewhere, None),
        }
    } else {
        (Guard::Elsewhere, None)
    };
    if guard == Guard::Running {
        return refuse(&instance, guard, 0, args.force);
    }
    let docker = prune::connect().await.context("prune")?;
    let survey = prune::survey(&docker, &instance).await.map_err(anyhow::Error::msg)?;
    refuse(&instance, guard, survey.running(), args.force)?;
    progress(&format!(
        "instance {instance}: {} container(s), {} running, {} image(s){}",
        survey.containers.len(),
        survey.running(),
        survey.images.len(),
        if args.dry_run { " (dry run: nothing is removed)" } else { "" }
    ));
    let report =
        prune::remove(&docker, &survey, args.network.as_deref(), args.dry_run, &mut |line| progress(&line)).await;
    let verb = if args.dry_run { "would remove" } else { "removed" };
    let network = match &report.network {
        Some((name, prune::NetworkFate::Remove)) => format!(", network {name}"),
        Some((name, _)) => format!(", network {name} left"),
        None => String::new(),
    };
    let mut stdout = std::io::stdout();
    writeln!(
        stdout,
        "instance {instance}: {verb} {} container(s), {} image(s){network}",
        report.containers, report.images
    )
    .context("cannot write to stdout")?;
    if let Some(first) = report.failures.first() {
        for failure in &report.failures {
            progress(failure);
        }
        anyhow::bail!("{} removal(s) failed, the first: {first}", report.failures.len());
    }
    Ok(())
}

fn refuse(instance: &str, guard: Guard, running: usize, force: bool) -> anyhow::Result<()> {
    match prune::permission(instance, guard, running, force) {
        Permission::Go => Ok(()),
        Permission::Refused(why) => Err(Refused(why).into()),
    }
}

/// `--list`: a table on stdout.
async fn list(data_dir: &Path) -> anyhow::Result<()> {
    let docker = prune::connect().await.context("prune --list")?;
    let counts = prune::instances(&docker).await.map_err(anyhow::Error::msg)?;
    let own = data_dir::instance_id(data_dir);
    let mut stdout = std::io::stdout();
    writeln!(stdout, "{:<24} {:>10} {:>8} {:>7}  NOTE", "INSTANCE", "CONTAINERS", "RUNNING", "IMAGES")
        .context("cannot write to stdout")?;
    for (instance, counts) in &counts {
        let note = if own.as_deref() == Some(instance.as_str()) {
            match data_dir::lock_for_prune(data_dir) {
                Ok(Probe::Held) => "--data-dir's instance: its server is running",
                _ => "--data-dir's instance: no server running on it",
            }
        } else {
            ""
        };
        writeln!(stdout, "{instance:<24} {:>10} {:>8} {:>7}  {note}", counts.containers, counts.running, counts.images)
            .context("cannot write to stdout")?;
    }
    progress(&format!("{} instance(s) with containers or images", counts.len()));
    Ok(())
}
