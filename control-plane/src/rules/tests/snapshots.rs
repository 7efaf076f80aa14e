//! Prepared snapshots: the first ready standby of a fingerprint is
//! snapshotted, and placed nowhere until the provider answers.

use super::*;

fn snapshotting() -> RulesConfig {
    RulesConfig { snapshots: true, ..config(2) }
}

fn snapshot_effects(step: &Step) -> Vec<(String, Fingerprint)> {
    step.effects
        .iter()
        .filter_map(|effect| match effect {
            Effect::Snapshot { sandbox_id, fingerprint } => Some((sandbox_id.clone(), fingerprint.clone())),
            _ => None,
        })
        .collect()
}

/// Brings each launched standby to `ready`, one after another: the steps
/// of their first `ready`.
fn ready_each(world: &mut World) -> Vec<(Launched, ConnId, Step)> {
    let step = world.tick();
    launches(&step)
        .into_iter()
        .map(|launched| {
            let (_, conn, _) = world.connect(&launched.token);
            let step = world.heartbeat(conn, AgentState::Ready);
            (launched, conn, step)
        })
        .collect()
}

#[test]
fn the_first_ready_standby_of_a_fingerprint_is_snapshotted_once() {
    let mut world = World::with(snapshotting());
    let pool = ready_each(&mut world);
    let asked: Vec<_> = pool.iter().flat_map(|(_, _, step)| snapshot_effects(step)).collect();
    assert_eq!(asked, vec![(pool[0].0.sandbox_id.clone(), fingerprint(&Workspace::default()))]);
    // Its routine heartbeats ask for nothing more.
    let again = world.heartbeat(pool[0].1, AgentState::Ready);
    assert!(snapshot_effects(&again).is_empty());
}

#[test]
fn a_standby_being_snapshotted_takes_no_run_until_the_provider_answers() {
    let mut world = World::with(RulesConfig { snapshots: true, ..config(1) });
    let pool = ready_each(&mut world);
    let (launched, conn, step) = &pool[0];
    assert_eq!(snapshot_effects(step).len(), 1);

    let (cold_run, step) = world.submit(run("make test"));
    assert!(sends(&step, *conn).is_empty(), "no assignment while its filesystem is copied");
    let cold = world.run(&cold_run).current().map(|attempt| attempt.sandbox_id.clone());
    assert_ne!(cold.as_deref(), Some(launched.sandbox_id.as_str()), "the run went elsewhere (cold)");

    let fingerprint = fingerprint(&Workspace::default());
    let step = world.machine.handle(
        world.now,
        Input::SnapshotTaken { sandbox_id: launched.sandbox_id.clone(), fingerprint, outcome: Ok(()) },
    );
    world.keep(step);
    let (warm_run, step) = world.submit(run("make lint"));
    let sent = assignments(&step);
    assert_eq!(sent.len(), 1, "placed on the standby once its snapshot is kept: {:?}", step.effects);
    assert_eq!(sent[0].0, *conn);
    assert_eq!(sent[0].1.execution_id, warm_run);
}

/// The provider pauses a standby for its snapshot's commit, which can take
/// longer than the silence limit: it is not retired meanwhile, and its
/// silence counts from the commit's end.
#[test]
fn a_standby_paused_for_a_long_snapshot_is_not_retired_as_silent() {
    let mut world = World::with(RulesConfig { snapshots: true, ..config(1) });
    let pool = ready_each(&mut world);
    let (launched, conn, _) = &pool[0];
    let silence = i64::try_from(world.machine.config.silence().as_millis()).expect("fits");

    world.advance(silence * 10);
    assert!(retires(&world.tick()).is_empty(), "retired while paused for its commit");
    let fingerprint = fingerprint(&Workspace::default());
    let taken = Input::SnapshotTaken { sandbox_id: launched.sandbox_id.clone(), fingerprint, outcome: Ok(()) };
    let step = world.machine.handle(world.now, taken);
    world.keep(step);
    world.advance(silence);
    assert!(retires(&world.tick()).is_empty(), "its silence counts from the commit's end");
    let live = world.machine.sandboxes.get(&launched.sandbox_id).expect("live");
    assert!(!world.machine.is_candidate(world.now, live), "no run for it until it is heard again");

    world.heartbeat(*conn, AgentState::Ready);
    let live = world.machine.sandboxes.get(&launched.sandbox_id).expect("live");
    assert!(world.machine.is_candidate(world.now, live), "a candidate once heard after the commit");

    world.advance(silence + 1);
    assert_eq!(retires(&world.tick()), vec![launched.sandbox_id.clone()], "silent after that: retired");
}

#[test]
fn a_failed_snapshot_is_tried_again_only_after_a_while() {
    let mut world = World::with(RulesConfig { snapshots: true, ..config(1) });
    let pool = ready_each(&mut world);
    let fingerprint = fingerprint(&Workspace::default());
    let failed = Input::SnapshotTaken {
        sandbox_id: pool[0].0.sandbox_id.clone(),
        fingerprint: fingerprint.clone(),
        outcome: Err("no space left on device".into()),
    };
    let step = world.machine.handle(world.now, failed);
    world.keep(step);
    assert!(world.machine.is_candidate(world.now, world.machine.sandboxes.get(&pool[0].0.sandbox_id).expect("live")));

    // Another standby of the fingerprint becomes ready soon after: not asked.
    let (_, step) = world.submit(run("first"));
    world.keep(step);
    let next = ready_each(&mut world);
    assert!(next.iter().all(|(_, _, step)| snapshot_effects(step).is_empty()));

    world.advance(i64::try_from(crate::rules::snapshots::RETRY_AFTER.as_millis()).expect("fits"));
    let (_, step) = world.submit(run("second"));
    world.keep(step);
    let later = ready_each(&mut world);
    let asked: Vec<_> = later.iter().flat_map(|(_, _, step)| snapshot_effects(step)).collect();
    assert_eq!(asked.len(), 1, "tried again after the wait");
}

#[test]
fn cold_sandboxes_and_credentialed_workspaces_are_never_snapshotted() {
    let secret_url = Workspace {
        repos: vec![Repo {
            url: "https://x:ghs_token@git.example/app.git".into(),
            path: "app".into(),
            git_ref: None,
            expected_sha: None,
        }],
        setup: vec![],
    };
    let credentialed =
        RulesConfig { pool_fingerprint: fingerprint(&secret_url), pool_workspace: secret_url, ..snapshotting() };
    let mut world = World::with(credentialed);
    assert!(ready_each(&mut world).iter().all(|(_, _, step)| snapshot_effects(step).is_empty()));

    let mut world = World::with(RulesConfig { snapshots: true, ..config(0) });
    let (_, step) = world.submit(run("cold"));
    let cold = launches(&step);
    assert_eq!(cold.len(), 1);
    let (_, conn, _) = world.connect(&cold[0].token);
    assert!(snapshot_effects(&world.heartbeat(conn, AgentState::Ready)).is_empty());
}

#[test]
fn without_snapshots_nothing_is_asked() {
    let mut world = World::new(2);
    assert!(ready_each(&mut world).iter().all(|(_, _, step)| snapshot_effects(step).is_empty()));
}
