//! The sandbox's pseudo-terminal: the idle shell a standby keeps open on it,
//! and the run that replaces that shell.
//!
//! A run must find the terminal an interactive user would: a session of its
//! own with the pseudo-terminal as controlling terminal, 40x120, default
//! settings. Keeping a shell open on it while idle proves the terminal
//! works before a run depends on it; the run then replaces the shell on the
//! same terminal, as the contract says.
//!
//! One reader thread drains the terminal for its whole life, so neither the
//! shell nor the run ever blocks on a full buffer. While idle the output is
//! nobody's and is dropped. At replacement a random marker, written to the
//! terminal after the shell is dead and before the run starts, separates
//! the two: everything before it was the shell's, everything after is the
//! run's, however the reads happen to split it.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::AsFd;

use filedescriptor::FileDescriptor;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus};
use std::sync::mpsc::{self as std_mpsc, RecvTimeoutError};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{Signal, killpg};
use nix::sys::termios::{FlushArg, SetArg, Termios, tcflush, tcgetattr, tcsetattr};
use nix::unistd::Pid;
use portable_pty::{Child as PtyChild, CommandBuilder, MasterPty, PtySize, SlavePty, native_pty_system};
use tokio::sync::{mpsc, watch};
use tracing::{debug, error, trace, warn};

use crate::git::describe_status;
use crate::process::{register, unregister};
use crate::reaper::{session_groups, signal_group};

/// The terminal's size: what the run sees until someone resizes it.
const SIZE: PtySize = PtySize { rows: 40, cols: 120, pixel_width: 0, pixel_height: 0 };
/// The largest chunk of output [`RunProcess::take_output`] yields.
pub const MAX_CHUNK: usize = 16 * 1024;
/// Chunks the output channel holds before the reader waits for its
/// consumer (and, once the kernel's buffer is full too, the run waits).
const OUTPUT_BACKLOG: usize = 64;
/// How long the output stays open after the run exited when something
/// else still holds the terminal (a daemon the run left behind).
const LINGER: Duration = Duration::from_secs(2);
/// How long [`IdleShell::close`] waits after SIGHUP before SIGKILL.
const HANGUP_GRACE: Duration = Duration::from_secs(1);
/// How long [`IdleShell::close`] waits after SIGKILL before it leaves the
/// shell to the orphan reaper.
const KILL_WAIT: Duration = Duration::from_secs(5);
/// How often [`IdleShell::close`] checks whether the shell is gone.
const EXIT_POLL: Duration = Duration::from_millis(20);
/// What [`RunProcess::wait`] returns when the run's exit status was lost
/// (someone else reaped it); no real exit code is negative.
pub const STATUS_LOST: i32 = -1;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why the terminal, the idle shell or the run failed; each names the
/// condition, the program or the terminal involved.
#[derive(Debug, thiserror::Error)]
pub enum ShellError {
    #[error("the command line is empty")]
    EmptyCommand,
    #[error("working directory {}: {source}", path.display())]
    Cwd { path: PathBuf, source: io::Error },
    #[error("cannot open a pseudo-terminal: {source}")]
    OpenPty { source: BoxError },
    #[error("cannot start {program:?} on the pseudo-terminal: {source}")]
    Spawn { program: String, source: BoxError },
    #[error("the idle shell is not alive ({status})")]
    NotAlive { status: String },
    #[error("the idle shell has a foreground job (process group {foreground_pgid})")]
    Busy { foreground_pgid: i32 },
    #[error("the idle shell's terminal has no foreground process group")]
    NoForeground,
    #[error("the idle shell's terminal is not writable")]
    NotWritable,
    #[error("{program:?} cannot take the terminal {}: it is still another session's", tty.display())]
    TerminalTaken { program: String, tty: PathBuf },
    #[error("cannot {action} (pseudo-terminal {}): {source}", tty.display())]
    Io { action: &'static str, tty: PathBuf, source: io::Error },
    #[error("cannot send {signal} to the run's process group {pgid}: {source}")]
    Signal { pgid: i32, signal: Signal, source: Errno },
}

/// The idle shell: a program kept running on the sandbox's
/// pseudo-terminal until a run replaces it. Dropping it kills it.
pub struct IdleShell {
    shell: ShellProcess,
    terminal: Terminal,
}

impl fmt::Debug for IdleShell {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdleShell")
            .field("pid", &self.shell.pid)
            .field("tty", &self.terminal.tty)
            .finish_non_exhaustive()
    }
}

impl IdleShell {
    /// Starts `argv` on a fresh 40x120 pseudo-terminal, in `cwd`, with
    /// exactly `env` (portable-pty adds `SHELL` when `env` has none). A
    /// reader thread drains the terminal from here on; while idle, the
    /// output is discarded.
    pub fn open(argv: &[String], cwd: &Path, env: &BTreeMap<String, String>) -> Result<Self, ShellError> {
        let (command, program) = command_line(argv, cwd, env)?;
        let terminal = Terminal::open()?;
        let child = terminal.spawn(command, program)?;
        let pid = child.id();
        debug!(pid, tty = %terminal.tty.display(), "idle shell started");
        Ok(Self { shell: ShellProcess { pid, child, reaped: false }, terminal })
    }

    #[cfg(test)]
    pub fn pid(&self) -> u32 {
        self.shell.pid
    }

    /// Refuses, naming the condition, unless the shell is alive, idle (the
    /// terminal's foreground process group is the shell's own, so no job
    /// would be cut short) and the terminal is writable (its input is not
    /// backed up).
    pub fn check_replaceable(&mut self) -> Result<(), ShellError> {
        if let Some(status) = self.shell.try_exit(&self.terminal.tty)? {
            return Err(ShellError::NotAlive { status: describe_status(status) });
        }
        match self.terminal.foreground(self.shell.pid)? {
            Some(pgid) if u32::try_from(pgid).is_ok_and(|pgid| pgid == self.shell.pid) => {}
            Some(pgid) => {
                return Err(ShellError::Busy { foreground_pgid: pgid });
            }
            None => return Err(ShellError::NoForeground),
        }
        if !self.terminal.writable()? {
            return Err(ShellError::NotWritable);
        }
        Ok(())
    }

    /// Replaces the shell with the run: [`check_replaceable`], then the
    /// shell's session is killed (SIGKILL) and the shell reaped, the
    /// terminal's settings and input reset, and `argv` started on the same
    /// terminal in `cwd` with exactly `env`, as session leader with the
    /// terminal as controlling terminal. The shell's output is not the
    /// run's. Consumes the shell: on error it is gone too.
    ///
    /// [`check_replaceable`]: IdleShell::check_replaceable
    pub fn replace(
        mut self,
        argv: &[String],
        cwd: &Path,
        env: &BTreeMap<String, String>,
    ) -> Result<RunProcess, ShellError> {
        let (command, program) = command_line(argv, cwd, env)?;
        self.check_replaceable()?;
        let IdleShell { mut shell, terminal } = self;
        shell.kill();
        terminal.reset()?;
        let (output, output_rx) = mpsc::channel(OUTPUT_BACKLOG);
        terminal.expect_run(output.clone())?;
        let (terminal, child) = match terminal.spawn(command.clone(), program) {
            Ok(child) => (terminal, child),
            Err(ShellError::TerminalTaken { .. }) => {
                // gVisor keeps a terminal its dead session leader had: the
                // run gets a fresh one, with none of the shell's output.
                debug!(tty = %terminal.tty.display(), "the terminal is still the dead shell's: the run gets a fresh one");
                // Its reader may never see the end of its output: it must
                // not hold the run's.
                *lock(&terminal.sink) = Sink::Discard;
                drop(terminal);
                let fresh = Terminal::open()?;
                *lock(&fresh.sink) = Sink::Run(output);
                let child = fresh.spawn(command, program)?;
                (fresh, child)
            }
            Err(error) => return Err(error),
        };
        let pid = child.id();
        let Terminal { master, slave, slave_file, tty, sink, reader_done, .. } = terminal;
        // Only the run holds the terminal's slave side now: the reader sees
        // the end of the output when the run's side closes.
        drop(slave);
        drop(slave_file);
        let exit = watch_run(child, sink, reader_done).map_err(|source| ShellError::Io {
            action: "start the thread that waits for the run",
            tty: tty.clone(),
            source,
        })?;
        debug!(pid, tty = %tty.display(), "run started on the terminal");
        Ok(RunProcess { pid, tty, _master: master, output: Some(output_rx), exit })
    }

    /// Ends the shell: SIGHUP to its session's process groups, SIGKILL
    /// after a second, and reaps it.
    pub async fn close(self) {
        let IdleShell { shell, terminal } = self;
        shell.hang_up().await;
        drop(terminal);
    }

    /// Types `text` on the terminal, as a user would.
    #[cfg(test)]
    fn type_input(&self, text: &str) {
        let mut writer = self.terminal.master.take_writer().expect("the terminal's writer");
        writer.write_all(text.as_bytes()).expect("the terminal takes input");
    }
}

/// The process group of a run (the run is its leader).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunGroup(i32);

impl RunGroup {
    /// Sends `signal` to the group; a group that is already gone is no
    /// error.
    pub fn signal(self, signal: Signal) -> Result<(), ShellError> {
        match killpg(Pid::from_raw(self.0), signal) {
            Ok(()) | Err(Errno::ESRCH) => Ok(()),
            Err(source) => Err(ShellError::Signal { pgid: self.0, signal, source }),
        }
    }
}

/// The run on the terminal. Dropping it before it exited kills its process
/// group; its exit status is always reaped.
pub struct RunProcess {
    pid: u32,
    tty: PathBuf,
    /// Kept so the terminal lives as long as the run's handle.
    _master: Box<dyn MasterPty + Send>,
    output: Option<mpsc::Receiver<Vec<u8>>>,
    exit: watch::Receiver<Option<i32>>,
}

impl fmt::Debug for RunProcess {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RunProcess")
            .field("pid", &self.pid)
            .field("tty", &self.tty)
            .field("exit", &*self.exit.borrow())
            .finish_non_exhaustive()
    }
}

impl RunProcess {
    #[cfg(test)]
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The terminal's output from the run's start, in order, in chunks of
    /// at most [`MAX_CHUNK`] bytes. The channel closes when the terminal
    /// reports end of output (every holder of its slave side closed it), or
    /// at most 2 s after the run exited when something else keeps it open.
    /// Until taken, up to 64 chunks wait; then the run waits. Later calls
    /// get a closed channel.
    pub fn take_output(&mut self) -> mpsc::Receiver<Vec<u8>> {
        self.output.take().unwrap_or_else(|| mpsc::channel(1).1)
    }

    /// The run's process group, to signal while another task waits for the
    /// run.
    pub fn group(&self) -> RunGroup {
        RunGroup(pid_i32(self.pid))
    }

    /// Waits for the run to exit: its exit code, or 128+N when signal N
    /// killed it ([`STATUS_LOST`] if the status was lost). Cancel-safe: a
    /// dropped call loses nothing, and every call after the exit returns
    /// at once.
    pub async fn wait(&mut self) -> i32 {
        match self.exit.wait_for(Option::is_some).await {
            Ok(code) => (*code).unwrap_or(STATUS_LOST),
            Err(_) => STATUS_LOST,
        }
    }
}

impl Drop for RunProcess {
    fn drop(&mut self) {
        if self.exit.borrow().is_none() {
            debug!(pid = self.pid, "run handle dropped while the run is alive; killing it");
            signal_group(pid_i32(self.pid), Signal::SIGKILL);
        }
    }
}

/// The idle shell's process. Dropped before it was reaped, it is killed
/// and reaped.
struct ShellProcess {
    pid: u32,
    child: Child,
    reaped: bool,
}

impl ShellProcess {
    /// The shell's exit status if it has exited (and is now reaped).
    fn try_exit(&mut self, tty: &Path) -> Result<Option<ExitStatus>, ShellError> {
        let status = self.child.try_wait().map_err(|source| ShellError::Io {
            action: "check whether the idle shell is alive",
            tty: tty.to_path_buf(),
            source,
        })?;
        if status.is_some() {
            self.mark_reaped();
        }
        Ok(status)
    }

    /// SIGKILL to every process group of the shell's session (background
    /// jobs too: they could still write to the terminal), then reaps the
    /// shell.
    fn kill(&mut self) {
        if self.reaped {
            return;
        }
        kill_session(self.pid, Signal::SIGKILL);
        match self.child.wait() {
            Ok(status) => debug!(pid = self.pid, status = %describe_status(status), "idle shell killed"),
            Err(error) => warn!(pid = self.pid, %error, "cannot reap the idle shell"),
        }
        self.mark_reaped();
        // Whatever the shell started between the first sweep and its death.
        kill_session(self.pid, Signal::SIGKILL);
    }

    /// SIGHUP, as a closing terminal would, then SIGKILL if the shell is
    /// still there after [`HANGUP_GRACE`].
    async fn hang_up(mut self) {
        if self.reaped {
            return;
        }
        kill_session_off_runtime(self.pid, Signal::SIGHUP).await;
        let mut killed = false;
        let mut deadline = Instant::now() + HANGUP_GRACE;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => {
                    debug!(pid = self.pid, status = %describe_status(status), "idle shell closed");
                    break;
                }
                Ok(None) => {}
                Err(error) => {
                    warn!(pid = self.pid, %error, "cannot wait for the idle shell");
                    break;
                }
            }
            if Instant::now() >= deadline {
                if killed {
                    warn!(pid = self.pid, "the idle shell survived SIGKILL; leaving it to the reaper");
                    break;
                }
                kill_session_off_runtime(self.pid, Signal::SIGKILL).await;
                killed = true;
                deadline = Instant::now() + KILL_WAIT;
            }
            tokio::time::sleep(EXIT_POLL).await;
        }
        self.mark_reaped();
        kill_session_off_runtime(self.pid, Signal::SIGKILL).await;
    }

    fn mark_reaped(&mut self) {
        if !self.reaped {
            self.reaped = true;
            unregister(self.pid);
        }
    }
}

impl Drop for ShellProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// [`kill_session`] on the blocking pool: finding the session's groups
/// reads every process in `/proc`.
async fn kill_session_off_runtime(leader: u32, signal: Signal) {
    crate::process::off_runtime(move || kill_session(leader, signal)).await;
}

/// Signals every process group of the session `leader` leads.
fn kill_session(leader: u32, signal: Signal) {
    for group in session_groups(pid_i32(leader)) {
        signal_group(group, signal);
    }
}

/// The pseudo-terminal and the thread that drains it.
struct Terminal {
    master: Box<dyn MasterPty + Send>,
    slave: Box<dyn SlavePty + Send>,
    /// Our own handle on the slave side, for what portable-pty does not
    /// offer: its settings, its input queue, writing the start marker.
    slave_file: File,
    tty: PathBuf,
    /// The settings before any program could change them.
    termios: Termios,
    sink: Arc<Mutex<Sink>>,
    /// Disconnects when the reader thread ends (end of output).
    reader_done: std_mpsc::Receiver<()>,
}

impl Terminal {
    fn open() -> Result<Self, ShellError> {
        let pair = native_pty_system().openpty(SIZE).map_err(|error| ShellError::OpenPty { source: error.into() })?;
        let tty = pair
            .master
            .tty_name()
            .ok_or_else(|| ShellError::OpenPty { source: "the new pseudo-terminal has no device name".into() })?;
        let io_error = |action: &'static str| {
            let tty = tty.clone();
            move |source| ShellError::Io { action, tty, source }
        };
        let slave_file = OpenOptions::new()
            .read(true)
            .write(true)
            // Never the agent's controlling terminal; never block the agent.
            .custom_flags((OFlag::O_NOCTTY | OFlag::O_NONBLOCK).bits())
            .open(&tty)
            .map_err(io_error("open the terminal's slave side"))?;
        let termios = tcgetattr(&slave_file).map_err(|errno| io_error("read the terminal's settings")(errno.into()))?;
        let mut reader = pair
            .master
            .try_clone_reader()
            .map_err(|error| io_error("open a reader on the terminal")(io::Error::other(error)))?;
        let sink = Arc::new(Mutex::new(Sink::Discard));
        let (done, reader_done) = std_mpsc::channel::<()>();
        let pump_sink = Arc::clone(&sink);
        thread::Builder::new()
            .name("standby-pty".into())
            .spawn(move || {
                let _done = done;
                pump(&mut *reader, &pump_sink);
            })
            .map_err(io_error("start the terminal's reader thread"))?;
        Ok(Self { master: pair.master, slave: pair.slave, slave_file, tty, termios, sink, reader_done })
    }

    /// Starts `command` as a new session led by it, with the terminal as
    /// its controlling terminal, and registers it as ours to wait for.
    fn spawn(&self, command: CommandBuilder, program: &str) -> Result<Child, ShellError> {
        let spawn_error = |source: BoxError| ShellError::Spawn { program: program.to_owned(), source };
        let child: Box<dyn PtyChild> = self.slave.spawn_command(command).map_err(|error| {
            // The child's TIOCSCTTY refused: the terminal still belongs to
            // a session (a dead one, under gVisor).
            if error.downcast_ref::<io::Error>().and_then(io::Error::raw_os_error) == Some(Errno::EPERM as i32) {
                return ShellError::TerminalTaken { program: program.to_owned(), tty: self.tty.clone() };
            }
            spawn_error(error.into())
        })?;
        match child.downcast::<Child>() {
            Ok(child) => {
                register(child.id());
                Ok(*child)
            }
            Err(mut other) => {
                // portable-pty spawns a std child on Unix; anything else
                // has no signal number in its status, so 128+N is out.
                let _ = other.kill();
                let _ = other.wait();
                Err(spawn_error("portable-pty returned an unknown child type".into()))
            }
        }
    }

    /// The terminal's foreground process group, asked of the terminal
    /// (`tcgetpgrp` on its master). Where the terminal cannot tell (gVisor
    /// answers ENOTTY), a group of the shell's session other than the
    /// shell's own stands in: a job of the shell's, in the foreground or
    /// not, counts as busy.
    fn foreground(&self, shell: u32) -> Result<Option<i32>, ShellError> {
        let fd_error =
            |source| ShellError::Io { action: "ask the terminal for its foreground", tty: self.tty.clone(), source };
        let raw =
            self.master.as_raw_fd().ok_or_else(|| fd_error(io::Error::other("the master has no file descriptor")))?;
        let fd = FileDescriptor::dup(&raw).map_err(|e| fd_error(io::Error::other(e)))?;
        match nix::unistd::tcgetpgrp(fd.as_fd()) {
            Ok(group) => Ok(Some(group.as_raw())),
            Err(errno @ (Errno::ENOTTY | Errno::EINVAL | Errno::ENOSYS)) => {
                let shell = pid_i32(shell);
                let job = session_groups(shell).into_iter().filter(|group| *group != shell).min();
                debug!(%errno, ?job, "the terminal cannot name its foreground: the shell's session's groups stand in");
                Ok(Some(job.unwrap_or(shell)))
            }
            Err(_) => Ok(None),
        }
    }

    /// Whether input can be written to the terminal now.
    fn writable(&self) -> Result<bool, ShellError> {
        let poll_error =
            |source| ShellError::Io { action: "poll the terminal for writing", tty: self.tty.clone(), source };
        let raw =
            self.master.as_raw_fd().ok_or_else(|| poll_error(io::Error::other("the master has no file descriptor")))?;
        // portable-pty exposes its master only as a raw descriptor; a
        // duplicate is an owned one that nix's `poll` can borrow safely.
        let fd = FileDescriptor::dup(&raw).map_err(|e| poll_error(io::Error::other(e)))?;
        let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLOUT)];
        loop {
            match poll(&mut fds, PollTimeout::ZERO) {
                Ok(_) => break,
                Err(Errno::EINTR) => {}
                Err(errno) => return Err(poll_error(errno.into())),
            }
        }
        Ok(fds[0].revents().is_some_and(|events| events.contains(PollFlags::POLLOUT)))
    }

    /// Undoes what the shell left behind: its terminal settings (a line
    /// editor killed mid-prompt leaves echo and line mode off) and input it
    /// never read.
    fn reset(&self) -> Result<(), ShellError> {
        let io_error = |action: &'static str| {
            move |errno: Errno| ShellError::Io { action, tty: self.tty.clone(), source: errno.into() }
        };
        tcsetattr(&self.slave_file, SetArg::TCSANOW, &self.termios)
            .map_err(io_error("restore the terminal's settings"))?;
        match tcflush(&self.slave_file, FlushArg::TCIFLUSH) {
            // A terminal that cannot flush (gVisor's): nothing types into
            // the idle shell but a user, so there is nothing to discard.
            Err(Errno::ENOTTY | Errno::EINVAL) => {
                debug!(tty = %self.tty.display(), "the terminal cannot discard its input; none was typed");
                Ok(())
            }
            result => result.map_err(io_error("discard the idle shell's unread input")),
        }
    }

    /// From now on, output after a fresh marker goes to `output`; the
    /// marker is written to the terminal, after everything the dead shell
    /// wrote.
    fn expect_run(&self, output: mpsc::Sender<Vec<u8>>) -> Result<(), ShellError> {
        let marker = format!("standby-run-starts-{:032x}", rand::random::<u128>()).into_bytes();
        // The sink first: the reader must not take the marker for idle output.
        *lock(&self.sink) = Sink::Marker { marker: marker.clone(), seen: Vec::new(), run: output };
        let mut writer = &self.slave_file;
        writer.write_all(&marker).map_err(|source| ShellError::Io {
            action: "write the run's start marker to the terminal",
            tty: self.tty.clone(),
            source,
        })
    }
}

/// Where the terminal's output goes.
enum Sink {
    /// Idle: the shell's output, nobody's business.
    Discard,
    /// Replacing: everything up to `marker` is still the dead shell's.
    Marker {
        marker: Vec<u8>,
        /// Output since the last chunk that could not end a partial marker.
        seen: Vec<u8>,
        run: mpsc::Sender<Vec<u8>>,
    },
    /// The run's output.
    Run(mpsc::Sender<Vec<u8>>),
}

impl Sink {
    /// Takes `data` read from the terminal; returns what to send where.
    fn accept(&mut self, data: &[u8]) -> Option<(mpsc::Sender<Vec<u8>>, Vec<u8>)> {
        match std::mem::replace(self, Sink::Discard) {
            Sink::Discard => {
                trace!(bytes = data.len(), "idle terminal output discarded");
                None
            }
            Sink::Run(run) => {
                *self = Sink::Run(run.clone());
                Some((run, data.to_vec()))
            }
            Sink::Marker { marker, mut seen, run } => {
                seen.extend_from_slice(data);
                if let Some(at) = seen.windows(marker.len()).position(|w| w == marker) {
                    trace!(bytes = at, "idle terminal output discarded");
                    let rest = seen.split_off(at + marker.len());
                    *self = Sink::Run(run.clone());
                    return (!rest.is_empty()).then_some((run, rest));
                }
                // Keep what could be the start of a marker split across reads.
                let excess = seen.len().saturating_sub(marker.len() - 1);
                trace!(bytes = excess, "idle terminal output discarded");
                seen.drain(..excess);
                *self = Sink::Marker { marker, seen, run };
                None
            }
        }
    }
}

fn lock(sink: &Mutex<Sink>) -> MutexGuard<'_, Sink> {
    sink.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The reader thread: drains the terminal into the sink until end of
/// output. Its end drops the sink's sender, which closes the run's output.
fn pump(reader: &mut dyn Read, sink: &Mutex<Sink>) {
    let mut buffer = vec![0; MAX_CHUNK];
    loop {
        let read = match reader.read(&mut buffer) {
            Ok(0) => break,
            Ok(read) => read,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
            Err(error) => {
                debug!(%error, "the terminal can no longer be read");
                break;
            }
        };
        let delivery = lock(sink).accept(&buffer[..read]);
        if let Some((run, chunk)) = delivery
            && run.blocking_send(chunk).is_err()
        {
            // Nobody wants the output any more; keep draining so the run
            // never blocks on a full terminal.
            *lock(sink) = Sink::Discard;
        }
    }
    *lock(sink) = Sink::Discard;
    debug!("terminal output ended");
}

/// Waits for the run on a thread of its own (a blocking `waitpid` on its
/// pid, which nobody else waits for), publishes its exit code, and ends its
/// output at most [`LINGER`] later.
fn watch_run(
    child: Child,
    sink: Arc<Mutex<Sink>>,
    reader_done: std_mpsc::Receiver<()>,
) -> io::Result<watch::Receiver<Option<i32>>> {
    let pid = child.id();
    let (exit, exit_rx) = watch::channel(None);
    let spawned = thread::Builder::new().name("standby-run".into()).spawn(move || {
        let mut child = child;
        let code = match child.wait() {
            Ok(status) => exit_code(status),
            Err(error) => {
                error!(pid, %error, "cannot wait for the run; its exit status is lost");
                STATUS_LOST
            }
        };
        unregister(pid);
        debug!(pid, code, "run exited");
        exit.send_replace(Some(code));
        if let Err(RecvTimeoutError::Timeout) = reader_done.recv_timeout(LINGER) {
            debug!(pid, "the terminal is still held open after the run exited; its output ends here");
            *lock(&sink) = Sink::Discard;
        }
    });
    if let Err(error) = spawned {
        // Nobody would wait for the run: kill it and leave it to the reaper.
        signal_group(pid_i32(pid), Signal::SIGKILL);
        unregister(pid);
        return Err(error);
    }
    Ok(exit_rx)
}

fn exit_code(status: ExitStatus) -> i32 {
    status.code().or_else(|| status.signal().map(|signal| 128 + signal)).unwrap_or(STATUS_LOST)
}

/// Checks `argv` and `cwd` and builds the command, with exactly `env`.
fn command_line<'a>(
    argv: &'a [String],
    cwd: &Path,
    env: &BTreeMap<String, String>,
) -> Result<(CommandBuilder, &'a str), ShellError> {
    let Some(program) = argv.first() else {
        return Err(ShellError::EmptyCommand);
    };
    // portable-pty silently falls back to the home directory otherwise.
    match std::fs::metadata(cwd) {
        Ok(metadata) if metadata.is_dir() => {}
        Ok(_) => {
            return Err(ShellError::Cwd {
                path: cwd.to_path_buf(),
                source: io::Error::new(io::ErrorKind::NotADirectory, "not a directory"),
            });
        }
        Err(source) => {
            return Err(ShellError::Cwd { path: cwd.to_path_buf(), source });
        }
    }
    let mut words: Vec<OsString> = argv.iter().map(OsString::from).collect();
    if let Some(path) = in_cwd(program, cwd) {
        words[0] = path.into_os_string();
    }
    let mut command = CommandBuilder::from_argv(words);
    command.env_clear();
    for (name, value) in env {
        command.env(name, value);
    }
    command.cwd(cwd);
    Ok((command, program))
}

/// The path a relative program with a slash (`.venv/bin/python`) names in
/// `cwd`, as a shell's exec would find it. portable-pty resolves only
/// `./`- and `../`-prefixed programs against the working directory and
/// looks any other relative one up in `PATH` ("No viable candidates found
/// in PATH"), so the agent joins it itself; the program then sees that
/// absolute path as its `argv[0]`. A bare name (no slash) stays a `PATH`
/// lookup.
fn in_cwd(program: &str, cwd: &Path) -> Option<PathBuf> {
    let path = Path::new(program);
    (path.is_relative() && program.contains('/')).then(|| cwd.join(path))
}

fn pid_i32(pid: u32) -> i32 {
    i32::try_from(pid).unwrap_or(i32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::process::child_env;
    use crate::reaper::{process_info, processes};

    fn argv(words: &[&str]) -> Vec<String> {
        words.iter().map(|word| (*word).to_owned()).collect()
    }

    fn env() -> BTreeMap<String, String> {
        let mut env = child_env();
        env.insert("TERM".into(), "dumb".into());
        env.insert("PS1".into(), "idle-prompt$ ".into());
        env
    }

    fn tempdir() -> tempfile::TempDir {
        tempfile::tempdir().expect("a temporary directory")
    }

    /// Polls `condition` every 10 ms, for at most 10 s.
    async fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !condition() {
            assert!(Instant::now() < deadline, "timed out waiting until {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Every chunk of the run's output until the channel closes (bounded).
    async fn output_of(run: &mut RunProcess) -> Vec<Vec<u8>> {
        let mut output = run.take_output();
        let mut chunks = Vec::new();
        tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(chunk) = output.recv().await {
                chunks.push(chunk);
            }
        })
        .await
        .expect("the output closes");
        chunks
    }

    async fn text_of(run: &mut RunProcess) -> String {
        String::from_utf8_lossy(&output_of(run).await.concat()).replace("\r\n", "\n")
    }

    fn live_in_group(pgid: u32) -> Vec<i32> {
        processes()
            .into_iter()
            .filter(|process| u32::try_from(process.pgrp) == Ok(pgid) && process.state != 'Z')
            .map(|process| process.pid)
            .collect()
    }

    fn live_in_session(sid: u32) -> Vec<i32> {
        processes()
            .into_iter()
            .filter(|process| u32::try_from(process.session) == Ok(sid) && process.state != 'Z')
            .map(|process| process.pid)
            .collect()
    }

    fn terminal_of(pid: u32) -> PathBuf {
        std::fs::read_link(format!("/proc/{pid}/fd/0")).expect("the process's stdin")
    }

    #[tokio::test]
    async fn idle_shell_opens_on_a_terminal_and_is_replaceable() {
        let dir = tempdir();
        let mut shell = IdleShell::open(&argv(&["sh"]), dir.path(), &env()).expect("opens");
        assert!(terminal_of(shell.pid()).starts_with("/dev/pts"));
        shell.check_replaceable().expect("an idle shell is replaceable");
        let sid = shell.pid();
        shell.close().await;
        assert!(process_info(pid_i32(sid)).is_none(), "the shell is reaped");
        assert!(live_in_session(sid).is_empty());
    }

    #[tokio::test]
    async fn busy_shell_is_refused_and_close_ends_its_job() {
        let dir = tempdir();
        let mut shell =
            IdleShell::open(&argv(&["bash", "--norc", "--noprofile", "-i"]), dir.path(), &env()).expect("opens");
        shell.check_replaceable().expect("idle at first");
        shell.type_input("sleep 100\n");
        let pid = shell.pid();
        let foreground = |shell: &IdleShell| shell.terminal.master.process_group_leader();
        wait_until("the sleep is the foreground job", || {
            foreground(&shell).is_some_and(|pgid| u32::try_from(pgid) != Ok(pid))
        })
        .await;
        let error = shell.check_replaceable().expect_err("a busy shell is refused");
        let Some(job) = foreground(&shell) else { panic!("the terminal has a foreground group") };
        assert!(matches!(error, ShellError::Busy { foreground_pgid } if foreground_pgid == job), "{error:?}");
        assert_eq!(error.to_string(), format!("the idle shell has a foreground job (process group {job})"));
        shell.close().await;
        wait_until("the whole session is gone", || live_in_session(pid).is_empty()).await;
    }

    #[tokio::test]
    async fn dead_shell_is_refused() {
        let dir = tempdir();
        let mut shell = IdleShell::open(&argv(&["sh", "-c", "exit 7"]), dir.path(), &env()).expect("opens");
        let mut refusal = None;
        wait_until("the shell is seen dead", || {
            // Until then it is alive, or exiting and already off the terminal.
            if let Err(error @ ShellError::NotAlive { .. }) = shell.check_replaceable() {
                refusal = Some(error);
            }
            refusal.is_some()
        })
        .await;
        let message = refusal.map(|error| error.to_string()).unwrap_or_default();
        assert_eq!(message, "the idle shell is not alive (exit status 7)");
        shell.close().await;
    }

    #[tokio::test]
    async fn open_refuses_a_missing_directory_an_empty_command_and_a_missing_program() {
        let dir = tempdir();
        let missing = dir.path().join("missing");
        let error = IdleShell::open(&argv(&["sh"]), &missing, &env()).expect_err("refused");
        assert!(matches!(error, ShellError::Cwd { .. }), "{error:?}");
        assert!(error.to_string().contains("missing"), "{error}");
        let error = IdleShell::open(&[], dir.path(), &env()).expect_err("refused");
        assert!(matches!(error, ShellError::EmptyCommand), "{error:?}");
        let error = IdleShell::open(&argv(&["no-such-program-standby"]), dir.path(), &env()).expect_err("refused");
        assert!(matches!(error, ShellError::Spawn { .. }), "{error:?}");
        assert!(error.to_string().starts_with("cannot start \"no-such-program-standby\""), "{error}");
    }

    #[tokio::test]
    async fn replace_runs_on_the_same_terminal_without_the_shells_output() {
        let dir = tempdir();
        let printed = dir.path().join("printed");
        let idle_script = format!(
            "i=0; while [ $i -lt 200 ]; do echo idle-noise-$i; i=$((i+1)); done; touch {}; exec sh",
            printed.display()
        );
        let shell = IdleShell::open(&argv(&["sh", "-c", &idle_script]), dir.path(), &env()).expect("opens");
        let tty = terminal_of(shell.pid());
        wait_until("the idle shell has printed", || printed.exists()).await;
        let mut run_env = env();
        run_env.insert("RUN_VAR".into(), "run-value".into());
        let script = "tty; test -t 0 && echo stdin-is-a-terminal; \
                      : </dev/tty && echo has-a-controlling-terminal; \
                      pwd; echo \"var=$RUN_VAR\"; exit 3";
        let mut run = shell.replace(&argv(&["sh", "-c", script]), dir.path(), &run_env).expect("replaces");
        let text = text_of(&mut run).await;
        assert_eq!(run.wait().await, 3);
        let cwd = dir.path().canonicalize().expect("the directory exists");
        assert_eq!(
            text,
            format!(
                "{}\nstdin-is-a-terminal\nhas-a-controlling-terminal\n{}\nvar=run-value\n",
                tty.display(),
                cwd.display()
            )
        );
    }

    #[test]
    fn only_a_relative_program_with_a_slash_is_joined_to_the_cwd() {
        let cwd = Path::new("/workspace/app");
        assert_eq!(in_cwd(".venv/bin/python", cwd), Some(PathBuf::from("/workspace/app/.venv/bin/python")));
        assert_eq!(in_cwd("./run.sh", cwd), Some(PathBuf::from("/workspace/app/./run.sh")));
        assert_eq!(in_cwd("../tool", cwd), Some(PathBuf::from("/workspace/app/../tool")));
        assert_eq!(in_cwd("python3", cwd), None);
        assert_eq!(in_cwd("/usr/bin/env", cwd), None);
    }

    #[tokio::test]
    async fn a_relative_program_path_runs_from_the_working_directory() {
        let dir = tempdir();
        let bin = dir.path().join(".venv/bin");
        std::fs::create_dir_all(&bin).expect("creates the directory");
        // A link, not a script written here: a fork elsewhere in the test
        // process could still hold a script's write descriptor (ETXTBSY).
        std::os::unix::fs::symlink("/bin/sh", bin.join("sh")).expect("links the program");
        let shell = IdleShell::open(&argv(&["sh"]), dir.path(), &env()).expect("opens");
        let run_argv = argv(&[".venv/bin/sh", "-c", "echo \"$0 in $(pwd)\""]);
        let mut run = shell.replace(&run_argv, dir.path(), &env()).expect("replaces");
        let text = text_of(&mut run).await;
        assert_eq!(run.wait().await, 0);
        let cwd = dir.path().canonicalize().expect("the directory exists");
        assert_eq!(text, format!("{}/.venv/bin/sh in {}\n", dir.path().display(), cwd.display()));
    }

    #[tokio::test]
    async fn run_output_arrives_in_order() {
        let dir = tempdir();
        let shell = IdleShell::open(&argv(&["sh"]), dir.path(), &env()).expect("opens");
        let mut run = shell.replace(&argv(&["seq", "1", "30000"]), dir.path(), &env()).expect("replaces");
        let chunks = output_of(&mut run).await;
        assert_eq!(run.wait().await, 0);
        assert!(chunks.iter().all(|chunk| !chunk.is_empty() && chunk.len() <= MAX_CHUNK));
        let text = String::from_utf8_lossy(&chunks.concat()).replace("\r\n", "\n");
        let expected: String = (1..=30000).map(|n| format!("{n}\n")).collect();
        let differs_at = text.bytes().zip(expected.bytes()).position(|(a, b)| a != b);
        assert!(
            text == expected,
            "output differs: {} bytes of {}, first difference at {differs_at:?}, end: {:?}",
            text.len(),
            expected.len(),
            &text[text.len().saturating_sub(40)..]
        );
    }

    #[tokio::test]
    async fn killed_run_exits_with_128_plus_the_signal() {
        let dir = tempdir();
        let shell = IdleShell::open(&argv(&["sh"]), dir.path(), &env()).expect("opens");
        let mut run = shell.replace(&argv(&["sh", "-c", "kill -TERM $$"]), dir.path(), &env()).expect("replaces");
        assert_eq!(run.wait().await, 128 + 15);
        assert_eq!(run.wait().await, 128 + 15, "wait can be called again");
        output_of(&mut run).await;
    }

    #[tokio::test]
    async fn signal_group_ends_the_run_and_its_children() {
        let dir = tempdir();
        let shell = IdleShell::open(&argv(&["sh"]), dir.path(), &env()).expect("opens");
        let mut run =
            shell.replace(&argv(&["sh", "-c", "sleep 300 & sleep 300 & wait"]), dir.path(), &env()).expect("replaces");
        let pgid = run.pid();
        wait_until("the run and its two children run", || live_in_group(pgid).len() == 3).await;
        run.group().signal(Signal::SIGTERM).expect("signalled");
        assert_eq!(run.wait().await, 128 + 15);
        wait_until("the whole group is gone", || live_in_group(pgid).is_empty()).await;
        output_of(&mut run).await;
        run.group().signal(Signal::SIGTERM).expect("a gone group is no error");
    }

    #[tokio::test]
    async fn output_ends_after_the_run_even_if_the_terminal_stays_open() {
        let dir = tempdir();
        let shell = IdleShell::open(&argv(&["sh"]), dir.path(), &env()).expect("opens");
        let mut run = shell
            .replace(&argv(&["sh", "-c", "setsid sleep 300 & echo holder=$!"]), dir.path(), &env())
            .expect("replaces");
        let text = text_of(&mut run).await;
        assert_eq!(run.wait().await, 0);
        let holder: i32 = text
            .trim()
            .strip_prefix("holder=")
            .and_then(|pid| pid.parse().ok())
            .unwrap_or_else(|| panic!("the run prints its holder's pid: {text:?}"));
        assert!(process_info(holder).is_some(), "the holder still runs");
        nix::sys::signal::kill(Pid::from_raw(holder), Signal::SIGKILL).expect("killed");
    }
}
