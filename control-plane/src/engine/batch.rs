//! Group commit: a store transaction (an fsync) per command caps the engine
//! at a few hundred commands a second, and a burst of submits, heartbeats
//! and assignment reports queues behind it. So the engine takes every
//! command already queued (up to [`BOUND`]), runs each through the machine,
//! commits all their writes in one transaction, and only then carries out
//! their effects and answers them, in the order they came.
//!
//! Commit-before-tell holds for each command: nothing of a batch (no frame,
//! no provider operation, no reply, not even a read's answer, which may show
//! an earlier command's uncommitted state) leaves the engine before the
//! batch's commit. A failed commit drops the batch: its callers see the
//! engine gone, and the engine stops as before.

use tokio::sync::{mpsc, oneshot};

use super::ConnWriter;
use crate::rules::{ConnId, Effect, Reply, Step, Write};

/// The most commands one transaction carries: enough to fold a burst into a
/// few commits, few enough that the first command of a batch does not wait
/// long behind the others' machine work.
pub const BOUND: usize = 256;

/// What a command leaves to do once its batch is committed.
pub enum After {
    /// Boxed: an effect is many times the size of the other actions.
    Effect(Box<Effect>),
    /// Answer the caller.
    Reply(Box<dyn FnOnce() + Send>),
    /// A control connection's writer, before the effects that may use it.
    Attach(ConnId, ConnWriter),
    Detach(ConnId),
}

impl From<Effect> for After {
    fn from(effect: Effect) -> Self {
        Self::Effect(Box::new(effect))
    }
}

/// Answers `reply` with `value` once the batch is committed.
pub fn reply<T: Send + 'static>(reply: oneshot::Sender<T>, value: T) -> After {
    After::Reply(Box::new(move || {
        // The caller may have given up waiting.
        let _ = reply.send(value);
    }))
}

/// `first`, then every command already waiting in `rx`, up to `bound` in
/// all; never waits for more.
pub fn take_queued<T>(rx: &mut mpsc::Receiver<T>, first: T, bound: usize) -> Vec<T> {
    let mut taken = vec![first];
    while taken.len() < bound {
        match rx.try_recv() {
            Ok(next) => taken.push(next),
            Err(_) => break,
        }
    }
    taken
}

/// The writes of a batch's commands, and what is to be done once they are
/// committed, in order.
#[derive(Debug)]
pub struct Batch<A> {
    writes: Vec<Write>,
    after: Vec<A>,
}

impl<A> Default for Batch<A> {
    fn default() -> Self {
        Self { writes: Vec::new(), after: Vec::new() }
    }
}

impl<A: From<Effect>> Batch<A> {
    /// Adds a step: its writes to the transaction, its effects after the
    /// actions added before. Its reply is the caller's to answer (after
    /// the effects, with [`Self::then`]).
    pub fn stage(&mut self, step: Step) -> Reply {
        let Step { writes, effects, reply } = step;
        self.writes.extend(writes);
        self.after.extend(effects.into_iter().map(A::from));
        reply
    }

    /// Adds an action (a reply, a connection's sender) after those added
    /// before.
    pub fn then(&mut self, action: A) {
        self.after.push(action);
    }

    /// The writes to commit in one transaction, and the actions to carry
    /// out once it succeeded.
    pub fn into_parts(self) -> (Vec<Write>, Vec<A>) {
        (self.writes, self.after)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Millis;

    #[derive(Debug, PartialEq)]
    enum Action {
        Effect(String),
        Reply(u32),
    }

    impl From<Effect> for Action {
        fn from(effect: Effect) -> Self {
            match effect {
                Effect::Close { conn } => Self::Effect(format!("close {conn}")),
                other => Self::Effect(format!("{other:?}")),
            }
        }
    }

    fn write(through: i64) -> Write {
        Write::ForgetIdempotency { through: Millis(through) }
    }

    #[tokio::test]
    async fn takes_what_is_queued_up_to_the_bound_in_order_without_waiting() {
        let (tx, mut rx) = mpsc::channel(16);
        for n in 1..=5 {
            tx.send(n).await.expect("queued");
        }
        assert_eq!(take_queued(&mut rx, 0, 4), vec![0, 1, 2, 3]);
        assert_eq!(take_queued(&mut rx, 10, 4), vec![10, 4, 5]);
        // Nothing queued: the first alone, at once (the sender is alive).
        assert_eq!(take_queued(&mut rx, 20, 4), vec![20]);
    }

    #[test]
    fn steps_and_actions_keep_their_order() {
        let mut batch = Batch::<Action>::default();
        batch.stage(Step { writes: vec![write(1)], effects: vec![Effect::Close { conn: 1 }], ..Step::default() });
        batch.then(Action::Reply(1));
        batch.stage(Step {
            writes: vec![write(2), write(3)],
            effects: vec![Effect::Close { conn: 2 }, Effect::Close { conn: 3 }],
            ..Step::default()
        });
        batch.then(Action::Reply(2));
        let (writes, after) = batch.into_parts();
        let order: Vec<i64> = writes
            .iter()
            .map(|write| match write {
                Write::ForgetIdempotency { through } => through.0,
                _ => 0,
            })
            .collect();
        assert_eq!(order, [1, 2, 3]);
        assert_eq!(
            after,
            [
                Action::Effect("close 1".into()),
                Action::Reply(1),
                Action::Effect("close 2".into()),
                Action::Effect("close 3".into()),
                Action::Reply(2),
            ]
        );
    }
}
