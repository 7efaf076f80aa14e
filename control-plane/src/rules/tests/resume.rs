//! A follow-up turn on its thread's parked sandbox: the decision tables
//! row by row, then Tier 2, Tier 1 and the fallbacks end to end.

use std::collections::HashMap;

use super::super::resume::{FollowUp, Parked, ParkedAgent, Preparation, Slot, follow_up};
use super::*;

// ---- the decision tables ----------------------------------------------------------

const MODES: [ParkMode; 2] = [ParkMode::Running, ParkMode::Stopped];
const AGENTS: [ParkedAgent; 3] = [ParkedAgent::Ready, ParkedAgent::Starting, ParkedAgent::Exited];
const SLOTS: [Slot; 2] = [Slot::Free, Slot::Taken];

/// Every situation a follow-up turn can find its parked sandbox in.
fn every_parked() -> Vec<Parked> {
    let mut all = Vec::new();
    for preparation in [Preparation::Same, Preparation::Changed] {
        for mode in MODES {
            for agent in AGENTS {
                for slot in SLOTS {
                    all.push(Parked { preparation, mode, agent, slot });
                }
            }
        }
    }
    all
}

/// Asserts the decision for every situation `row` matches, so a row
/// above it in the table that takes some of them fails the test.
fn row(matches: impl Fn(&Parked) -> bool, expected: FollowUp) {
    let situations: Vec<Parked> = every_parked().into_iter().filter(|parked| matches(parked)).collect();
    assert!(!situations.is_empty(), "the row matches something");
    for parked in situations {
        assert_eq!(follow_up(parked), expected, "{parked:?}");
    }
}

fn same(parked: &Parked) -> bool {
    parked.preparation == Preparation::Same
}

#[test]
fn follow_up_a_changed_workspace_falls_back_whatever_else_holds() {
    row(|p| p.preparation == Preparation::Changed, FollowUp::Fallback);
}

#[test]
fn follow_up_tier_2_with_a_ready_agent_binds_at_once_even_at_the_cap() {
    row(|p| same(p) && p.mode == ParkMode::Running && p.agent == ParkedAgent::Ready, FollowUp::BindNow);
}

#[test]
fn follow_up_with_no_agent_and_no_slot_waits_for_a_slot() {
    row(|p| same(p) && p.agent == ParkedAgent::Exited && p.slot == Slot::Taken, FollowUp::WaitForSlot);
}

#[test]
fn follow_up_with_no_agent_and_a_slot_resumes_at_once() {
    row(|p| same(p) && p.agent == ParkedAgent::Exited && p.slot == Slot::Free, FollowUp::Resume);
}

#[test]
fn follow_up_tier_1_still_being_stopped_resumes_once_it_exited() {
    row(|p| same(p) && p.mode == ParkMode::Stopped && p.agent != ParkedAgent::Exited, FollowUp::ResumeAfterExit);
}

#[test]
fn follow_up_tier_2_with_its_fresh_agent_starting_awaits_it() {
    row(|p| same(p) && p.mode == ParkMode::Running && p.agent == ParkedAgent::Starting, FollowUp::AwaitReady);
}

#[test]
fn resume_start_by_what_the_provider_found() {
    assert_eq!(ResumeStart::for_found(Found::NoAgent), Ok(ResumeStart::Start));
    assert_eq!(ResumeStart::for_found(Found::Archived), Ok(ResumeStart::Start));
    assert_eq!(ResumeStart::for_found(Found::Running), Ok(ResumeStart::StopFirst));
    assert_eq!(ResumeStart::for_found(Found::Missing), Err(ResumeFailure::Gone));
}

// ---- end to end --------------------------------------------------------------------

#[test]
fn tier_2_a_follow_up_in_the_warm_window_takes_the_running_sandbox_at_once() {
    let mut world = World::with(policy(0, 8));
    let Bound { step, assignment, sandbox_id, .. } = bound_turn(&mut world, "t1");
    let old_token = launches(&step).remove(0).token;
    let step = finish(&mut world, &assignment);
    assert_eq!(world.sandbox(&sandbox_id).state, SandboxState::Parked);
    assert_eq!(park_mode(&world, &sandbox_id), Some(ParkMode::Running));
    assert!(retires(&step).is_empty(), "kept, not deleted");
    let pointer = world.machine.thread("t1").expect("a pointer").clone();
    assert_eq!((pointer.sandbox_id.as_deref(), pointer.holder), (Some(sandbox_id.as_str()), None));
    // The turn's agent exits: a fresh one is launched in the same sandbox
    // with a new standby credential.
    let step = exited(&mut world, &sandbox_id);
    let (resumed, token, _) = resumes(&step).remove(0);
    assert_eq!(resumed, sandbox_id);
    assert_ne!(token, old_token);
    let conn = ready_conn(&mut world, &token);
    world.advance(30 * SECOND);
    world.heartbeat(conn, AgentState::Ready);
    let (second, step) = turn(&mut world, "t1");
    let run = world.run(&second);
    assert_eq!(run.state, RunState::Committed, "bound in the submit's own step");
    assert_eq!(run.path(), Some(RunPath::ParkedRunning));
    assert_eq!(run.current().expect("bound").sandbox_id, sandbox_id);
    assert_eq!(assignments(&step).len(), 1);
    assert!(resumes(&step).is_empty() && stops(&step).is_empty(), "no stop, no start");
}

#[test]
fn tier_1_after_the_window_the_sandbox_is_stopped_and_a_follow_up_is_bound_only_once_it_is_ready() {
    let mut world = World::with(policy(0, 8));
    let sandbox_id = parked_running(&mut world, "t1");
    let parked_token = world.sandbox(&sandbox_id).standby_credential_id.clone();
    world.advance(MINUTE.as_millis() as i64);
    let step = world.tick();
    assert_eq!(stops(&step), std::slice::from_ref(&sandbox_id), "the warm idle window ended");
    assert_eq!(park_mode(&world, &sandbox_id), Some(ParkMode::Stopped));
    assert_eq!(world.machine.credentials[&parked_token].state, CredentialState::Revoked);
    exited(&mut world, &sandbox_id);
    assert!(!world.machine.sandbox_views(world.now).iter().any(|v| v.record.id == sandbox_id && v.running));
    world.advance(3_600 * SECOND);
    let (second, step) = turn(&mut world, "t1");
    assert_eq!(world.run(&second).state, RunState::Resuming);
    assert!(assignments(&step).is_empty(), "not told before its agent is ready");
    assert!(world.run(&second).attempts.is_empty(), "not bound either");
    let (resumed, token, _) = resumes(&step).remove(0);
    assert_eq!(resumed, sandbox_id);
    let (_, conn, step) = world.connect(&token);
    assert!(assignments(&step).is_empty());
    world.heartbeat(conn, AgentState::Preparing);
    assert_eq!(world.run(&second).state, RunState::Resuming);
    world.advance(2 * SECOND);
    let step = world.heartbeat(conn, AgentState::Ready);
    let run = world.run(&second);
    assert_eq!(run.path(), Some(RunPath::ParkedStopped));
    assert_eq!(run.current().expect("bound").sandbox_id, sandbox_id);
    assert_eq!(assignments(&step).len(), 1, "told once ready");
    let resume = run.resume.expect("recorded");
    assert_eq!((resume.from, resume.fallback), (ParkMode::Stopped, None));
    assert_eq!(resume.ready_at.map(|at| at.since(resume.began_at)), Some(2_000));
}

#[test]
fn a_follow_up_while_the_fresh_agent_starts_waits_for_it() {
    let mut world = World::with(policy(0, 8));
    let Bound { assignment, sandbox_id, .. } = bound_turn(&mut world, "t1");
    finish(&mut world, &assignment);
    // The turn's agent has not exited yet.
    let (second, step) = turn(&mut world, "t1");
    assert_eq!(world.run(&second).state, RunState::Resuming);
    assert!(resumes(&step).is_empty(), "one agent at a time: after the old one exits");
    let step = exited(&mut world, &sandbox_id);
    let (_, token, _) = resumes(&step).remove(0);
    let step = ready(&mut world, &token);
    assert_eq!(assignments(&step).len(), 1);
    assert_eq!(world.run(&second).path(), Some(RunPath::ParkedRunning));
}

#[test]
fn a_resume_that_fails_falls_back_to_a_fresh_sandbox_and_records_why() {
    for failure in ["deleted", "timeout", "agent exit"] {
        let mut world = World::with(policy(0, 8));
        let sandbox_id = parked_running(&mut world, "t1");
        world.advance(MINUTE.as_millis() as i64);
        world.tick();
        exited(&mut world, &sandbox_id);
        let (second, step) = turn(&mut world, "t1");
        let (_, token, _) = resumes(&step).remove(0);
        let step = match failure {
            "deleted" => {
                let step = world.machine.resume_failed(world.now, &sandbox_id, &ResumeFailure::Gone);
                world.keep(step)
            }
            "timeout" => {
                world.connect(&token);
                world.advance(31 * SECOND);
                world.tick()
            }
            _ => {
                world.connect(&token);
                exited(&mut world, &sandbox_id)
            }
        };
        let run = world.run(&second);
        let fallback = run.resume.as_ref().and_then(|r| r.fallback.clone()).expect("the reason is recorded");
        let expected = match failure {
            "deleted" => "no longer exists",
            "timeout" => "not ready within 30s",
            _ => "ended before it was ready",
        };
        assert!(fallback.contains(expected), "{failure}: {fallback}");
        assert_eq!(run.path(), Some(RunPath::Cold), "{failure}: the run goes on");
        assert_eq!(world.sandbox(&sandbox_id).state, SandboxState::Retired);
        let new_sandbox = run.current().expect("bound").sandbox_id.clone();
        assert_eq!(world.machine.thread("t1").and_then(|t| t.sandbox_id.clone()), Some(new_sandbox));
        assert_eq!(launches(&step).len(), 1, "{failure}: a cold sandbox");
        assert_eq!(world.machine.authenticate(token.expose()), Err(AdmissionRefusal::Unauthorized));
    }
}

#[test]
fn a_changed_workspace_is_not_resumed() {
    let mut world = World::with(policy(0, 8));
    let sandbox_id = parked_running(&mut world, "t1");
    let mut changed = run("turn");
    changed.workspace = Some(Workspace {
        repos: vec![Repo { url: "file:///other".into(), path: "app".into(), git_ref: None, expected_sha: None }],
        setup: Vec::new(),
    });
    let (step, second) = world.machine.submit_turn(world.now, changed, request(), Some("t1".into()));
    let run = world.run(&second);
    let fallback = run.resume.as_ref().and_then(|r| r.fallback.clone()).expect("recorded");
    assert!(fallback.contains("fingerprint"), "{fallback}");
    assert_eq!(run.path(), Some(RunPath::Cold));
    assert!(retires(&step).contains(&sandbox_id));
}

#[test]
fn a_restart_brings_parked_sandboxes_back_stopped_and_resumes_again() {
    let mut world = World::with(policy(0, 8));
    let sandbox_id = parked_running(&mut world, "t1");
    let (second, _) = {
        world.advance(MINUTE.as_millis() as i64);
        world.tick();
        exited(&mut world, &sandbox_id);
        turn(&mut world, "t1")
    };
    assert_eq!(world.run(&second).state, RunState::Resuming);
    let (mut machine, step) =
        Rules::restore(policy(0, 8), Box::new(CountingMint::starting_at(10_000)), world.snapshot(), world.now);
    // The turn claims its sandbox again at once; it is started once the
    // provider said what became of it.
    assert_eq!(machine.sandbox(&sandbox_id).map(|r| r.state), Some(SandboxState::Resuming));
    assert_eq!(machine.run(&second).map(|r| r.state), Some(RunState::Resuming));
    assert!(step.effects.iter().any(|e| matches!(e, Effect::Probe { sandbox_id: id, .. } if *id == sandbox_id)));
    assert!(resumes(&step).is_empty(), "not before the probe");
    let step = machine.probed(world.now, &sandbox_id, Found::NoAgent);
    let resumed: Vec<String> = resumes(&step).into_iter().map(|(id, ..)| id).collect();
    assert_eq!(resumed, std::slice::from_ref(&sandbox_id), "the run resumes its thread's sandbox again");
    assert_eq!(machine.run(&second).map(|r| r.state), Some(RunState::Resuming));
    let counts: HashMap<SandboxState, usize> =
        machine.sandbox_views(world.now).iter().fold(HashMap::new(), |mut m, v| {
            *m.entry(v.record.state).or_default() += 1;
            m
        });
    assert_eq!(counts.get(&SandboxState::Resuming), Some(&1));
}
