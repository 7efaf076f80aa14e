//! The machine's one way in: every input the server's rules react to is an
//! [`Input`], taken by [`Rules::handle`], which returns one [`Step`]: the
//! writes to commit, the effects to carry out once they are, and the
//! [`Reply`] for whoever asked. The driver forwards inputs without knowing
//! them, so a new input is a variant here and a rule in its own file, as in
//! the agent's `Lifecycle::handle`.
//!
//! A reply is typed at the asker through [`Answer`]: each input answers one
//! kind of [`Reply`] (`the_reply_of_each_input_is_its_answer` checks every
//! input), and a caller names the answer it expects.

use standby_protocol::{AgentState, Event, Fingerprint, Run, Secret};

use super::{
    Admission, AdmissionRefusal, Call, CancelError, ConnId, IdempotencyKey, KeyReused, LiveSandbox, LogError,
    MetricsSnapshot, ResumeFailure, Rules, SandboxPage, Step, Submitted,
};
use crate::model::{Holder, Millis, RunRecord, RunRequest, RunState, SandboxRecord, ThreadRecord};
use crate::provider::Found;

/// Something that happened, or a question, for the machine.
#[derive(Debug)]
pub enum Input {
    /// Who `token` is for an agent's HTTP `call` ([`Reply::Admission`]).
    /// Tokens are [`Secret`]s: an input printed never shows one.
    Check {
        token: Secret,
        call: Call,
    },
    /// The upgrade of control connection `conn` with `token`, claiming the
    /// credential's one socket ([`Reply::Admission`]); a
    /// [`Input::Disconnected`] frees the claim.
    ClaimSocket {
        conn: ConnId,
        token: Secret,
    },
    /// A control connection of `credential_id` is open (the agent presented
    /// `presented`, whose hash was checked at the claim).
    Connected {
        conn: ConnId,
        credential_id: String,
        presented: Secret,
        /// The replica that holds the socket (a replicated deployment).
        holder: Option<Holder>,
    },
    Disconnected {
        conn: ConnId,
    },
    Heartbeat {
        conn: ConnId,
        state: AgentState,
    },
    /// Routine heartbeats of `conns` (their state unchanged), gathered by
    /// the replica that holds their sockets: each counts as a heartbeat of
    /// the state its sandbox reported last.
    Heard {
        conns: Vec<ConnId>,
    },
    /// The socket task wrote a run's assignment frame.
    AssignmentSent {
        run_id: String,
    },
    /// A sandbox's agent was served its spec.
    SpecServed {
        sandbox_id: String,
    },
    /// An event of a run's attempt ([`Reply::None`] once recorded).
    Event {
        run_id: String,
        attempt: u32,
        event: Event,
    },
    /// A chunk of a run's log ([`Reply::Logged`]).
    Log {
        run_id: String,
        offset: u64,
        dropped: u64,
        data: Vec<u8>,
    },
    /// A run submitted, as a turn of `thread_id` when given, under an
    /// `Idempotency-Key` when given ([`Reply::Submitted`]).
    Submit {
        run: Box<Run>,
        request: Box<RunRequest>,
        thread_id: Option<String>,
        key: Option<IdempotencyKey>,
    },
    Cancel {
        run_id: String,
    },
    /// The agent started with standby credential `credential_id` ended. A
    /// notice of an earlier agent of the sandbox (another credential) is
    /// stale and changes nothing.
    Exited {
        sandbox_id: String,
        credential_id: String,
        code: Option<i32>,
    },
    LaunchFailed {
        sandbox_id: String,
        error: String,
    },
    ResumeFailed {
        sandbox_id: String,
        failure: ResumeFailure,
    },
    /// The provider's answer to [`Effect::Snapshot`](super::Effect::Snapshot)
    /// (the error as its message).
    SnapshotTaken {
        sandbox_id: String,
        fingerprint: Fingerprint,
        outcome: Result<(), String>,
    },
    /// What the provider found of a sandbox the machine asked about.
    Probed {
        sandbox_id: String,
        found: Found,
    },
    /// Time passed: silence, the pool, deadlines.
    Tick,
    /// The server is stopping: no more dispatching or launching, and exits
    /// no longer change state.
    Drain,
    Run {
        run_id: String,
    },
    Thread {
        thread_id: String,
    },
    Sandbox {
        sandbox_id: String,
    },
    Sandboxes {
        page: SandboxPage,
    },
    Metrics,
}

/// An answer the asker can take out of a [`Reply`].
pub trait Answer: Sized {
    /// The answer, if `reply` is of its kind.
    fn from_reply(reply: Reply) -> Option<Self>;
}

/// Declares [`Reply`] with one variant per kind of answer, and each
/// answer's [`Answer`] impl.
macro_rules! replies {
    ($($(#[$doc:meta])* $variant:ident($answer:ty),)*) => {
        /// What the machine answers to an input.
        #[derive(Debug, Default)]
        pub enum Reply {
            /// Nothing to answer but that the input was taken (and its
            /// writes committed, once the driver answers).
            #[default]
            None,
            $($(#[$doc])* $variant($answer),)*
        }

        $(impl Answer for $answer {
            fn from_reply(reply: Reply) -> Option<Self> {
                match reply {
                    Reply::$variant(answer) => Some(answer),
                    _ => None,
                }
            }
        })*
    };
}

replies! {
    Admission(Result<Admission, AdmissionRefusal>),
    Submitted(Result<(Submitted, Option<RunRecord>), KeyReused>),
    /// The state the run is in after the cancel.
    Cancelled(Result<RunState, CancelError>),
    /// The bytes of the log accounted for, to acknowledge.
    Logged(Result<u64, LogError>),
    Run(Option<RunRecord>),
    Thread(Option<ThreadRecord>),
    Sandbox(Option<SandboxRecord>),
    Sandboxes(Vec<LiveSandbox>),
    Metrics(MetricsSnapshot),
}

impl Answer for () {
    fn from_reply(reply: Reply) -> Option<Self> {
        matches!(reply, Reply::None).then_some(())
    }
}

impl Step {
    fn replying(reply: Reply) -> Self {
        Self { reply, ..Self::default() }
    }

    fn with_reply(self, reply: Reply) -> Self {
        Self { reply, ..self }
    }
}

impl Rules {
    /// Takes one input at `now`: its writes, effects and reply.
    pub fn handle(&mut self, now: Millis, input: Input) -> Step {
        match input {
            Input::Check { token, call } => Step::replying(Reply::Admission(self.check(token.expose(), call))),
            Input::ClaimSocket { conn, token } => match self.claim_socket(now, conn, token.expose()) {
                Ok((admission, step)) => step.with_reply(Reply::Admission(Ok(admission))),
                Err(refusal) => Step::replying(Reply::Admission(Err(refusal))),
            },
            Input::Connected { conn, credential_id, presented, holder } => {
                self.connected(now, conn, (&credential_id, &presented), holder)
            }
            Input::Disconnected { conn } => {
                self.disconnected(conn);
                Step::default()
            }
            Input::Heartbeat { conn, state } => self.heartbeat(now, conn, state),
            Input::Heard { conns } => self.heard(now, &conns),
            Input::AssignmentSent { run_id } => self.assignment_sent(now, &run_id),
            Input::SpecServed { sandbox_id } => self.spec_served(&sandbox_id),
            Input::Event { run_id, attempt, event } => self.event(now, &run_id, attempt, event),
            Input::Log { run_id, offset, dropped, data } => match self.log(&run_id, offset, dropped, &data) {
                Ok((step, received)) => step.with_reply(Reply::Logged(Ok(received))),
                Err(error) => Step::replying(Reply::Logged(Err(error))),
            },
            Input::Submit { run, request, thread_id, key } => {
                match self.submit_keyed(now, *run, *request, thread_id, key) {
                    Ok((step, submitted)) => {
                        let record = self.run(submitted.run_id()).cloned();
                        step.with_reply(Reply::Submitted(Ok((submitted, record))))
                    }
                    Err(reused) => Step::replying(Reply::Submitted(Err(reused))),
                }
            }
            Input::Cancel { run_id } => match self.cancel(now, &run_id) {
                Ok((step, state)) => step.with_reply(Reply::Cancelled(Ok(state))),
                Err(error) => Step::replying(Reply::Cancelled(Err(error))),
            },
            Input::Exited { sandbox_id, credential_id, code } => {
                let current = self.sandboxes.get(&sandbox_id).map(|live| live.record.standby_credential_id.as_str());
                if current == Some(credential_id.as_str()) {
                    self.sandbox_exited(now, &sandbox_id, code)
                } else {
                    tracing::debug!(sandbox_id, credential_id, "a stale exit notice (an earlier agent) dropped");
                    Step::default()
                }
            }
            Input::LaunchFailed { sandbox_id, error } => self.launch_failed(now, &sandbox_id, &error),
            Input::ResumeFailed { sandbox_id, failure } => self.resume_failed(now, &sandbox_id, &failure),
            Input::Probed { sandbox_id, found } => self.probed(now, &sandbox_id, found),
            Input::SnapshotTaken { sandbox_id, fingerprint, outcome } => {
                self.snapshot_taken(now, &sandbox_id, fingerprint, outcome)
            }
            Input::Tick => self.tick(now),
            Input::Drain => {
                self.shutdown();
                Step::default()
            }
            Input::Run { run_id } => Step::replying(Reply::Run(self.run(&run_id).cloned())),
            Input::Thread { thread_id } => Step::replying(Reply::Thread(self.thread(&thread_id).cloned())),
            Input::Sandbox { sandbox_id } => Step::replying(Reply::Sandbox(self.sandbox(&sandbox_id).cloned())),
            Input::Sandboxes { page } => Step::replying(Reply::Sandboxes(self.sandbox_page(now, &page))),
            Input::Metrics => Step::replying(Reply::Metrics(self.metrics(now))),
        }
    }
}
