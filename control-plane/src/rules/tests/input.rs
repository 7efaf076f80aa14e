//! The one way in: each input is answered with its kind of reply, and an
//! exit notice counts only for the agent it reports.

use super::*;

/// What `input` answers, taken as the kind `A` its callers ask for.
fn answer<A: Answer>(world: &mut World, input: Input) -> A {
    let step = world.machine.handle(world.now, input);
    A::from_reply(step.reply).expect("the input is answered with its kind")
}

#[test]
fn the_reply_of_each_input_is_its_answer() {
    let mut world = World::new(1);
    world.ready_pool();
    let token = || Secret::new("not-a-credential".to_owned());
    let _: Result<Admission, AdmissionRefusal> = answer(&mut world, Input::Check { token: token(), call: Call::Fetch });
    let _: Result<Admission, AdmissionRefusal> = answer(&mut world, Input::ClaimSocket { conn: 99, token: token() });
    let submit = Input::Submit { run: Box::new(run("true")), request: Box::new(request()), thread_id: None, key: None };
    let submitted: Result<(Submitted, Option<RunRecord>), KeyReused> = answer(&mut world, submit);
    let (submitted, record) = submitted.expect("a new run");
    assert_eq!(record.expect("its record").id, submitted.run_id());
    let run_id = submitted.run_id().to_owned();
    let log = Input::Log { run_id: run_id.clone(), offset: 0, dropped: 0, data: b"x".to_vec() };
    let _: Result<u64, LogError> = answer(&mut world, log);
    let found: Option<RunRecord> = answer(&mut world, Input::Run { run_id: run_id.clone() });
    assert!(found.is_some());
    let _: Option<ThreadRecord> = answer(&mut world, Input::Thread { thread_id: "t".into() });
    let _: Option<SandboxRecord> = answer(&mut world, Input::Sandbox { sandbox_id: "sbx".into() });
    let page = SandboxPage { limit: 10, ..SandboxPage::default() };
    let views: Vec<LiveSandbox> = answer(&mut world, Input::Sandboxes { page });
    assert!(!views.is_empty());
    let _: MetricsSnapshot = answer(&mut world, Input::Metrics);
    let sandbox_id = || "sbx".to_owned();
    let told = [
        Input::Connected { conn: 98, credential_id: "cred".into(), presented: token(), holder: None },
        Input::Heartbeat { conn: 98, state: AgentState::Ready },
        Input::Heard { conns: vec![98] },
        Input::Disconnected { conn: 98 },
        Input::AssignmentSent { run_id: run_id.clone() },
        Input::SpecServed { sandbox_id: sandbox_id() },
        Input::Event { run_id: run_id.clone(), attempt: 1, event: Event::new("e", EventKind::Started) },
        Input::Exited { sandbox_id: sandbox_id(), credential_id: "cred".into(), code: Some(0) },
        Input::LaunchFailed { sandbox_id: sandbox_id(), error: "refused".into() },
        Input::ResumeFailed { sandbox_id: sandbox_id(), failure: ResumeFailure::Failed("refused".into()) },
        Input::Probed { sandbox_id: sandbox_id(), found: Found::Missing },
        Input::Tick,
        Input::Drain,
    ];
    for input in told {
        answer::<()>(&mut world, input);
    }
    let _: Result<RunState, CancelError> = answer(&mut world, Input::Cancel { run_id });
}

#[test]
fn an_exit_notice_of_an_earlier_agent_is_dropped_and_the_current_ones_is_taken() {
    let mut world = World::with(policy(0, 4));
    let sandbox_id = parked_running(&mut world, "t1");
    let first_agent = world
        .writes
        .iter()
        .find_map(|write| match write {
            Write::Sandbox(record) if record.id == sandbox_id => Some(record.standby_credential_id.clone()),
            _ => None,
        })
        .expect("the sandbox was written");
    let before = world.sandbox(&sandbox_id);
    assert_ne!(before.standby_credential_id, first_agent, "the fresh agent has a credential of its own");

    let exited = |credential_id: &str| Input::Exited {
        sandbox_id: sandbox_id.clone(),
        credential_id: credential_id.to_owned(),
        code: Some(0),
    };
    let stale = world.machine.handle(world.now, exited(&first_agent));
    assert!(stale.is_empty(), "a late notice of the first agent changes nothing: {stale:?}");
    assert_eq!(world.sandbox(&sandbox_id), before);

    let current = world.machine.handle(world.now, exited(&before.standby_credential_id));
    assert!(!current.is_empty(), "the fresh agent's end is taken");
    assert_ne!(world.sandbox(&sandbox_id), before);
}
