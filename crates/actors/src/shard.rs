//! The shard actor: hosts one `keel_core::driver::Shard` on an arbiter
//! thread and performs its actions. It decides nothing: each input goes to
//! the driver with the current time, and each action the driver asks for is
//! performed as it says, off this thread whenever it may block (store reads
//! on the blocking pool, activity code on the activity runtime, except
//! the first poll of a `NON_BLOCKING` activity's attempt; a commit is
//! queued to the store's writer, and its answer left for this actor, which
//! is called once to take every answer of a group the store answered).

use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use keel_core::driver::{Action, Answer, DriverConfig, Shard, ShardId, ShardInput};
use keel_core::WorkflowRegistry;
use keel_storage::Timestamp;

use crate::client::Asked;
use crate::engine::{now, Host};
use crate::routes::Local;

/// Most messages waiting in one shard actor's mailbox before a sender
/// waits (client requests; internal hand-offs are never refused).
pub const SHARD_MAILBOX_MAX: usize = 4096;

/// How often a shard compares its driver's view of the store's health with
/// the store's and reports a change.
pub const STORE_HEALTH_POLL_MS: u64 = 100;

/// Most restarts of one shard after a panic within
/// [`SHARD_RESTART_WINDOW_MS`]: past them the shard stays down until the
/// engine restarts (a panic its recovery repeats would otherwise loop).
pub const SHARD_RESTARTS_MAX: usize = 5;

/// The window [`SHARD_RESTARTS_MAX`] counts restarts in.
pub const SHARD_RESTART_WINDOW_MS: u64 = 60_000;

/// The wait before a shard that panicked starts again, doubled for each
/// earlier restart in the window.
pub const SHARD_RESTART_DELAY_MS: u64 = 100;

/// An input for the shard's driver.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Feed(pub(crate) ShardInput);

/// A client's request (see [`Asked`]).
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Ask(pub(crate) Asked);

/// The engine stops: the driver answers every waiting client.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Stop;

/// Give the shard up for another process to take (a rebalance).
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Release;

/// A commit's answer, left in the shard's [`Answers`] by whichever thread
/// has it.
struct Answered {
    token: keel_core::driver::Token,
    result: Result<keel_storage::CommitAck, keel_storage::Error>,
    /// When the commit was asked for.
    asked: std::time::Instant,
}

/// Commit answers waiting for the shard: the store's answering thread adds
/// each, and wakes the shard once per group it answers
/// ([`keel_storage::store::after_answers`]) with a [`TakeAnswers`], rather
/// than once per answer (each such wake-up could preempt the answering
/// thread on a busy machine). Holds no part of the host: the store keeps
/// the functions that fill it.
#[derive(Default)]
struct Answers {
    waiting: parking_lot::Mutex<Vec<Answered>>,
    /// Whether a [`TakeAnswers`] is sent or about to be, not yet handled.
    called: std::sync::atomic::AtomicBool,
}

impl Answers {
    /// Adds `answer`; calls the shard with `me` at the end of the group
    /// being answered unless a call is already on its way.
    fn add(&self, answer: Answered, me: Addr<ShardActor>) {
        self.waiting.lock().push(answer);
        if !self.called.swap(true, std::sync::atomic::Ordering::AcqRel) {
            keel_storage::store::after_answers(move || me.do_send(TakeAnswers));
        }
    }

    /// Every answer waiting. The flag is cleared first: an answer added
    /// meanwhile is either taken here or calls the shard again.
    fn take(&self) -> Vec<Answered> {
        self.called
            .store(false, std::sync::atomic::Ordering::Release);
        std::mem::take(&mut *self.waiting.lock())
    }
}

/// Commit answers wait in the shard's [`Answers`].
#[derive(Message)]
#[rtype(result = "()")]
struct TakeAnswers;

/// What the shard's driver counted and holds (for `/metrics`).
#[derive(Message)]
#[rtype(result = "keel_core::driver::ShardStats")]
pub(crate) struct Stats;

pub(crate) struct ShardActor {
    driver: Shard,
    host: Arc<Host>,
    /// The wake-up queued for the driver: when, and its handle.
    wake: Option<(Timestamp, SpawnHandle)>,
    /// Tells this actor of the shard from the next one in this process.
    generation: u64,
    /// Commit answers not yet fed to the driver.
    answers: Arc<Answers>,
    /// In the middle of a turn: an input handed to the driver and the
    /// actions it asked for being performed. Still set when the actor is
    /// dropped means a panic ended the turn (actix runs the `stopped` hook
    /// of an actor whose handler panicked too, so that cannot tell).
    in_turn: bool,
    /// The driver's stall as last told to the host (`Host::stalled`).
    stalled: Option<Timestamp>,
}

impl ShardActor {
    pub(crate) fn new(driver: Shard, host: Arc<Host>, generation: u64) -> Self {
        ShardActor {
            driver,
            host,
            wake: None,
            generation,
            answers: Arc::default(),
            in_turn: false,
            stalled: None,
        }
    }

    fn feed(&mut self, input: ShardInput, ctx: &mut Context<Self>) {
        self.feed_all(std::iter::once(input), ctx);
    }

    /// Feeds every input before performing any action, so the commits they
    /// lead to reach the writer together.
    fn feed_all(&mut self, inputs: impl IntoIterator<Item = ShardInput>, ctx: &mut Context<Self>) {
        let at = now();
        let mut handled = false;
        self.in_turn = true;
        for input in inputs {
            if self.driver.lost() {
                // Stopping: a client waiting here asks again, and finds the
                // shard's next owner; the rest is sent again by its sender.
                if let ShardInput::Request { id, .. } = input {
                    let why = format!("{} moved to another engine process", self.driver.id());
                    self.host.client.answer(id, Answer::Retry(why));
                }
                continue;
            }
            self.driver.handle(at, input);
            handled = true;
        }
        // Also when an input lost the shard: what the loss asks for is
        // performed here.
        if handled {
            self.drain(ctx);
        }
        self.in_turn = false;
    }

    /// Performs every action the driver asks for, tells the host whether
    /// the driver found a commit stalled, then queues its next wake-up.
    fn drain(&mut self, ctx: &mut Context<Self>) {
        while let Some(action) = self.driver.poll_action() {
            self.perform(action, ctx);
        }
        let stalled = self.driver.stalled_since();
        if stalled != self.stalled {
            self.stalled = stalled;
            let shard = self.driver.id();
            let mut all = self.host.stalled.lock();
            match stalled {
                Some(_) => {
                    all.insert(shard, self.driver.acting_store_health().clone());
                }
                None => {
                    all.remove(&shard);
                }
            }
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
            act.in_turn = true;
            act.driver.handle_timeout(now());
            act.drain(ctx);
            act.in_turn = false;
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
            Action::Commit {
                token,
                batch,
                alone,
            } => {
                let asked = std::time::Instant::now();
                // Written on this thread when the store's writer is idle.
                // Either way the answer is fed from a later message
                // (`TakeAnswers`), never within this turn, so the driver
                // still counts the commit in flight until then (see
                // `Shard::poll_action`). A message, not a spawned future:
                // actix polls every future an actor spawned each time it
                // wakes, and a shard has dozens of commits in flight.
                let answer = if alone {
                    self.host.store.commit_alone(batch)
                } else {
                    self.host.store.commit(batch)
                };
                // Only the actor's address goes into the store: a store
                // that held the host (and so itself) could be dropped on
                // its own answering thread at shutdown.
                let (me, answers) = (ctx.address(), self.answers.clone());
                answer.then(move |result| {
                    answers.add(
                        Answered {
                            token,
                            result,
                            asked,
                        },
                        me,
                    );
                });
            }
            Action::RunAttempt { order, .. } => {
                Host::run_attempt(&self.host, self.driver.id(), ctx.address(), order);
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
            Action::RenewLease { lease } => {
                let store = self.host.store.clone();
                let ttl = self.host.shard_lease_ms;
                let me = ctx.address();
                self.host.reads.submit(Box::new(move || {
                    let result = match store.shared() {
                        Some(shared) => shared.renew_shard_lease(&lease, now(), ttl),
                        None => Err(keel_storage::Error::Fenced {
                            shard: lease.shard,
                            epoch: lease.epoch,
                            current: None,
                        }),
                    };
                    me.do_send(Feed(ShardInput::LeaseRenewed { result }));
                }));
            }
            Action::ReleaseLease { lease } => {
                let store = self.host.store.clone();
                self.host.reads.submit(Box::new(move || {
                    if let Some(shared) = store.shared() {
                        if let Err(e) = shared.release_shard_lease(&lease, now()) {
                            tracing::warn!(shard = lease.shard, error = %e, "releasing the shard's lease failed; it ends by itself");
                        }
                    }
                }));
            }
            Action::ShardLost { shard, reason } => {
                tracing::info!(%shard, %reason, "the shard leaves this engine process");
                self.host.routes.remove(shard, self.generation);
                // Nothing here answers what still waits on this shard.
                self.host.client.shard_stopped(shard, self.generation);
                ctx.stop();
            }
        }
    }
}

impl Actor for ShardActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.set_mailbox_capacity(SHARD_MAILBOX_MAX);
        // Recovery: the driver reads back every intent row it owns.
        self.in_turn = true;
        self.driver.recover(now());
        self.drain(ctx);
        self.in_turn = false;
        ctx.run_interval(Duration::from_millis(STORE_HEALTH_POLL_MS), |act, ctx| {
            let health = act.host.store.health();
            if &health != act.driver.reported_store_health() {
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

impl Handler<Ask> for ShardActor {
    type Result = ();

    fn handle(&mut self, msg: Ask, ctx: &mut Self::Context) {
        let (id, request) = msg.0.take();
        self.feed(ShardInput::Request { id, request }, ctx);
    }
}

impl Handler<TakeAnswers> for ShardActor {
    type Result = ();

    fn handle(&mut self, _: TakeAnswers, ctx: &mut Self::Context) {
        let commit_seconds = &self.host.commit_seconds;
        let answers: Vec<ShardInput> = self
            .answers
            .take()
            .into_iter()
            .map(|a| {
                commit_seconds.observe_duration(a.asked.elapsed());
                ShardInput::Committed {
                    token: a.token,
                    result: a.result,
                }
            })
            .collect();
        self.feed_all(answers, ctx);
    }
}

impl Handler<Stop> for ShardActor {
    type Result = ();

    fn handle(&mut self, _: Stop, ctx: &mut Self::Context) {
        self.in_turn = true;
        self.driver.shutdown();
        self.drain(ctx);
        self.in_turn = false;
        // Given back at once, so that another process takes the shard
        // without waiting for the lease to end (a commit still in flight
        // carries the old fence, and is refused once it is taken).
        if let (Some(lease), Some(shared)) = (self.driver.lease(), self.host.store.shared()) {
            if !self.driver.lost() {
                if let Err(e) = shared.release_shard_lease(lease, now()) {
                    tracing::warn!(shard = lease.shard, error = %e, "releasing the shard's lease at shutdown failed; it ends by itself");
                }
            }
        }
    }
}

impl Drop for ShardActor {
    /// However the actor ends, nothing keeps waiting on it. A panic in its
    /// handling (a broken invariant in the driver, a store that panicked)
    /// is caught by the runtime, which stops and drops the actor in the
    /// middle of its turn (`in_turn`): the calls it had taken would
    /// otherwise wait for answers that never come. Each is told to ask
    /// again, and the route to it goes. An engine alone on its store
    /// starts the shard again ([`restart_after_panic`]); on a shared store
    /// another process, or this one, takes it once its lease, no longer
    /// renewed, runs out.
    fn drop(&mut self) {
        let shard = self.driver.id();
        let panicked = self.in_turn;
        if panicked {
            tracing::error!(%shard, "the shard's actor panicked in the middle of a turn; its waiting calls are told to ask again");
        }
        self.host.routes.remove(shard, self.generation);
        self.host.client.shard_stopped(shard, self.generation);
        if self.stalled.is_some() {
            self.host.stalled.lock().remove(&shard);
        }
        if panicked && self.host.store.shared().is_none() {
            // Its async children's closures go with it, as when a shard
            // leaves a process: the next instance's parents bind them
            // again (some were bound ahead of commits never answered).
            let (id, shards) = (shard, self.driver.config().shards);
            self.driver
                .workflows()
                .unbind_async_where(|child| keel_core::driver::shard_of(child, shards) == id);
            let again = Again {
                shard,
                generation: self.generation + 1,
                workflows: self.driver.workflows().clone(),
                config: self.driver.config().clone(),
                epoch_base: self.driver.next_epoch_base(),
            };
            restart_after_panic(&self.host, again);
        }
    }
}

impl Handler<Release> for ShardActor {
    type Result = ();

    fn handle(&mut self, _: Release, ctx: &mut Self::Context) {
        self.in_turn = true;
        self.driver.release();
        self.drain(ctx);
        self.in_turn = false;
    }
}

impl Handler<Stats> for ShardActor {
    type Result = MessageResult<Stats>;

    fn handle(&mut self, _: Stats, _: &mut Self::Context) -> Self::Result {
        MessageResult(self.driver.stats())
    }
}

/// What a shard that panicked needs to start again.
struct Again {
    shard: ShardId,
    generation: u64,
    workflows: WorkflowRegistry,
    config: DriverConfig,
    /// Above every epoch and token the instance that panicked handed out.
    epoch_base: u64,
}

/// Starts a shard whose actor panicked again on its arbiter, as a
/// supervisor would: after [`SHARD_RESTART_DELAY_MS`] (doubled per
/// earlier restart in [`SHARD_RESTART_WINDOW_MS`]), and once every commit
/// it had queued is written, so that the new instance's recovery reads
/// what they wrote (they are answered to no one). The new instance
/// recovers the shard's durable work as at start-up. Past
/// [`SHARD_RESTARTS_MAX`] in the window the shard stays down (listed by
/// [`crate::Engine::shards_down`]) until the engine restarts. Called on the
/// shard's arbiter thread.
fn restart_after_panic(host: &Arc<Host>, again: Again) {
    if host.client.is_shut_down() {
        return;
    }
    let shard = again.shard;
    let at = std::time::Instant::now();
    let window = Duration::from_millis(SHARD_RESTART_WINDOW_MS);
    let restarts = {
        let mut all = host.shard_restarts.lock();
        let recent = all.entry(shard).or_default();
        recent.retain(|t| at.duration_since(*t) < window);
        if recent.len() >= SHARD_RESTARTS_MAX {
            None
        } else {
            recent.push(at);
            Some(recent.len())
        }
    };
    let Some(restarts) = restarts else {
        tracing::error!(%shard, restarts = SHARD_RESTARTS_MAX, window_ms = SHARD_RESTART_WINDOW_MS,
            "the shard panicked again after its last restart in the window; it stays down until the engine restarts");
        host.shards_down.lock().insert(shard);
        return;
    };
    if restarts + 1 == SHARD_RESTARTS_MAX {
        tracing::warn!(%shard, restarts, limit = SHARD_RESTARTS_MAX, "one more panic and the shard stays down");
    }
    let delay = Duration::from_millis(SHARD_RESTART_DELAY_MS << (restarts - 1).min(16));
    tracing::warn!(%shard, restarts, delay_ms = delay.as_millis() as u64, "the shard starts again after a panic");
    let arbiter = actix::Arbiter::current();
    let host = host.clone();
    host.activity_rt.clone().spawn(async move {
        tokio::time::sleep(delay).await;
        // Queued behind every commit the shard asked for: once answered,
        // they are all written (or refused). A store that panics here too
        // leaves the shard down.
        let barrier = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            host.store.commit(keel_storage::CommitBatch::default())
        }));
        let barrier = match barrier {
            Ok(barrier) => barrier.await,
            Err(_) => Err(keel_storage::Error::Closed),
        };
        if let Err(e @ keel_storage::Error::Closed) = barrier {
            tracing::error!(shard = %again.shard, error = %e, "the store cannot write any more; the shard stays down until the engine restarts");
            host.shards_down.lock().insert(again.shard);
            return;
        }
        if host.client.is_shut_down() {
            return;
        }
        let Again {
            shard,
            generation,
            workflows,
            config,
            epoch_base,
        } = again;
        // Epochs only grow, across restarts of the engine too.
        let base = epoch_base.max(now().0.saturating_mul(1000));
        let h = host.clone();
        let addr = ShardActor::start_in_arbiter(&arbiter, move |_| {
            ShardActor::new(Shard::new(shard, workflows, config, base), h, generation)
        });
        let local = Local {
            addr,
            fence: None,
            generation,
        };
        host.routes.set(shard, local.clone());
        if host.client.is_shut_down() {
            // The engine began to stop meanwhile, and may have listed its
            // shards before this one was set.
            local.addr.do_send(Stop);
            return;
        }
        tracing::info!(%shard, generation, "the shard started again");
    });
}
