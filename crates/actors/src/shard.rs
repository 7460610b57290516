//! The shard actor: hosts one `keel_core::driver::Shard` on an arbiter
//! thread and performs its actions. It decides nothing: each input goes to
//! the driver with the current time, and each action the driver asks for is
//! performed as it says, off this thread whenever it may block (store reads
//! on the blocking pool, activity code on the activity runtime; a commit
//! is queued to the store's writer and answered to this actor).

use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use keel_core::driver::{Action, Shard, ShardInput};
use keel_storage::Timestamp;

use crate::engine::{now, Host};

/// Most messages waiting in one shard actor's mailbox before a sender
/// waits (client requests; internal hand-offs are never refused).
pub const SHARD_MAILBOX_MAX: usize = 4096;

/// How often a shard compares its driver's view of the store's health with
/// the store's and reports a change.
pub const STORE_HEALTH_POLL_MS: u64 = 100;

/// An input for the shard's driver.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Feed(pub(crate) ShardInput);

/// The engine stops: the driver answers every waiting client.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Stop;

/// What the shard holds in memory, for tests and benches.
#[derive(Message)]
#[rtype(result = "(usize, usize)")]
pub(crate) struct Counts;

pub(crate) struct ShardActor {
    driver: Shard,
    host: Arc<Host>,
    /// The wake-up queued for the driver: when, and its handle.
    wake: Option<(Timestamp, SpawnHandle)>,
}

impl ShardActor {
    pub(crate) fn new(driver: Shard, host: Arc<Host>) -> Self {
        ShardActor {
            driver,
            host,
            wake: None,
        }
    }

    fn feed(&mut self, input: ShardInput, ctx: &mut Context<Self>) {
        self.driver.handle(now(), input);
        self.drain(ctx);
    }

    /// Performs every action the driver asks for, then queues its next
    /// wake-up.
    fn drain(&mut self, ctx: &mut Context<Self>) {
        while let Some(action) = self.driver.poll_action() {
            self.perform(action, ctx);
        }
        let Some(at) = self.driver.poll_timeout() else {
            return;
        };
        if let Some((queued, handle)) = self.wake {
            if queued <= at {
                return;
            }
            ctx.cancel_future(handle);
        }
        let delay = Duration::from_millis(at.0.saturating_sub(now().0));
        let handle = ctx.run_later(delay, |act, ctx| {
            act.wake = None;
            act.driver.handle_timeout(now());
            act.drain(ctx);
        });
        self.wake = Some((at, handle));
    }

    fn perform(&mut self, action: Action, ctx: &mut Context<Self>) {
        match action {
            Action::Read { token, query } => {
                let store = self.host.store.clone();
                let me = ctx.address();
                self.host.reads.submit(Box::new(move || {
                    let result = query.perform(&*store);
                    me.do_send(Feed(ShardInput::Read { token, result }));
                }));
            }
            Action::Commit { token, batch } => {
                let answer = self.host.store.commit(batch);
                ctx.spawn(answer.into_actor(self).map(move |result, act, ctx| {
                    act.feed(ShardInput::Committed { token, result }, ctx);
                }));
            }
            Action::RunAttempt { order, .. } => {
                crate::attempts::run(&self.host, ctx.address(), order);
            }
            Action::StopAttempt { key, epoch } => self.host.stop_copy(key, epoch),
            Action::RunFallback {
                key,
                attempt,
                activity_type,
                input,
                failure,
            } => crate::attempts::fallback(
                &self.host,
                ctx.address(),
                key,
                attempt,
                activity_type,
                input,
                failure,
            ),
            Action::Send { to, message, .. } => self.host.send(to, message),
            Action::Reply { id, answer, .. } => self.host.client.answer(id, answer),
            Action::RenewLease { .. } | Action::ReleaseLease { .. } | Action::ShardLost { .. } => {
                // Only a shard given a lease (`Shard::hold`) asks for these.
                unreachable!("the actix host holds no shard leases: its store has one writer")
            }
        }
    }
}

impl Actor for ShardActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(SHARD_MAILBOX_MAX);
        // Recovery: the driver reads back every intent row it owns.
        self.driver.recover(now());
        self.drain(ctx);
        ctx.run_interval(Duration::from_millis(STORE_HEALTH_POLL_MS), |act, ctx| {
            let health = act.host.store.health();
            if &health != act.driver.store_health() {
                let failed = health.is_failed().then(|| health.to_string());
                act.feed(ShardInput::StoreHealth(health), ctx);
                if let Some(why) = failed {
                    act.host.client.fail(why);
                }
            }
        });
    }
}

impl Handler<Feed> for ShardActor {
    type Result = ();

    fn handle(&mut self, msg: Feed, ctx: &mut Self::Context) {
        self.feed(msg.0, ctx);
    }
}

impl Handler<Stop> for ShardActor {
    type Result = ();

    fn handle(&mut self, _: Stop, ctx: &mut Self::Context) {
        self.driver.shutdown();
        self.drain(ctx);
    }
}

impl Handler<Counts> for ShardActor {
    type Result = MessageResult<Counts>;

    fn handle(&mut self, _: Counts, _: &mut Self::Context) -> Self::Result {
        MessageResult((
            self.driver.runs_in_memory(),
            self.driver.attempts_supervised(),
        ))
    }
}
