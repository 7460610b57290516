//! The activity runtime: runs the attempts a shard dispatches on a tokio
//! pool off the arbiter threads (the first poll of an activity that
//! declares itself non-blocking runs on the shard's thread, see [`run`]),
//! admits each through its resilience profile
//! in this process, turns a panic into a retryable failure, and reports
//! results and heartbeats (with the lease epoch) to the shard (through the
//! relay when the attempt was taken from it, and its shard runs in another
//! process). A copy the shard asks to stop sees its
//! [`keel_core::CancelSignal`] raised.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Context;
use std::time::Duration;

use actix::Addr;
use futures::FutureExt;
use keel_core::driver::{AttemptKey, AttemptOrder, ShardInput};
use keel_core::{ActivityContext, CancelSignal, HeartbeatFn};
use keel_storage::{AttemptId, AttemptNo, ExecutionId, Failure, FailureKind, Payload};
use tracing::{info_span, Instrument};

use crate::engine::{Host, ReportTo};
use crate::shard::{Feed, ShardActor};

/// A first poll on a shard's thread that runs longer than this is warned
/// about, once per activity type: the activity declared itself
/// `NON_BLOCKING`, yet held its shard's other runs this long.
pub(crate) const FIRST_POLL_WARN_MS: u64 = 20;

/// Where [`run`] is called from.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Caller {
    /// The thread of the shard that dispatched the attempt: a non-blocking
    /// activity's first poll may run here.
    ShardThread,
    /// Any other thread (the relay's): the attempt starts on the pool.
    Elsewhere,
}

/// Runs one copy of an attempt, reporting to `shard`.
///
/// An activity that declares itself [`keel_core::Activity::NON_BLOCKING`],
/// dispatched from its shard's thread, is polled once right here, inside the
/// pool's runtime context (so what it spawns, its timers and its IO belong
/// to the pool), and goes to the pool only if that poll did not finish it.
/// A no-op or in-memory activity then costs no wake-up of a pool thread and
/// its result no wake-up of the shard's: the result is queued to the shard
/// actor the poll runs in, after the dispatching action.
pub(crate) fn run(host: &Arc<Host>, shard: ReportTo, order: AttemptOrder, caller: Caller) {
    let (key, epoch, attempt) = (order.key, order.epoch, order.attempt);
    let cancel = CancelSignal::new();
    let copy = CopyEntry::hold(host, (key, epoch), cancel.clone());
    let (beats, beat_host) = (shard.clone(), host.clone());
    let heartbeat: HeartbeatFn = Arc::new(move |details| {
        beats.send(
            &beat_host,
            ShardInput::Heartbeat {
                key,
                epoch,
                details,
            },
        );
    });
    let id = AttemptId {
        execution: ExecutionId {
            run_id: key.run,
            step: key.step,
        },
        attempt,
    };
    let ctx = ActivityContext::new(id, heartbeat, cancel, order.heartbeat.clone());
    let activity = host.activities.get(&order.activity_type).cloned();
    let profile = order
        .profile
        .as_ref()
        .and_then(|p| host.profiles.get(p).cloned());
    let span = info_span!("attempt", run_id = %key.run, step = key.step.0, attempt = attempt.0, epoch = epoch.0);
    let host = host.clone();
    let activity_type = order.activity_type;
    let input = order.input;
    let (deadline_ms, is_retry) = (order.deadline_ms, order.is_retry);
    let pool = host.activity_rt.clone();
    let first_poll_here = match &activity {
        Some(a) if caller == Caller::ShardThread && a.non_blocking() => {
            Some((a.name(), host.clone()))
        }
        _ => None,
    };
    let attempt_run = async move {
        // Per-process admission (breaker, rate limit, bulkhead) in the
        // pipeline's fixed order. A refusal never reaches the activity
        // and is not a dependency failure; the shard offers it again.
        let mut admission = None;
        if let Some(p) = &profile {
            // The execution's name keys the pipeline's per-execution state;
            // an activity without a profile has none to key.
            let execution = id.execution.to_string();
            let admitted = keel_resilience::Safety::idempotent(&execution)
                .map_err(|e| e.to_string())
                .and_then(|safety| {
                    p.new_context(Duration::from_millis(deadline_ms), safety, &execution)
                        .map_err(|e| e.to_string())
                })
                .and_then(|c| p.admit(&c, is_retry).map_err(|r| r.reason().to_string()));
            match admitted {
                Ok(mut a) => {
                    a.mark_dispatched();
                    admission = Some(a);
                }
                Err(policy) => {
                    drop(copy);
                    shard.send(&host, ShardInput::AttemptRefused { key, epoch, policy });
                    return;
                }
            }
        }
        let result = match activity {
            None => Err(Failure::new(
                FailureKind::Application,
                format!("unknown activity type {activity_type:?}"),
                false,
            )),
            Some(a) => match AssertUnwindSafe(a.start(ctx, input)).catch_unwind().await {
                Ok(r) => r,
                Err(p) => Err(Failure::new(
                    FailureKind::Panic,
                    format!(
                        "activity panicked: {}",
                        keel_core::panic_message(p.as_ref())
                    ),
                    true,
                )),
            },
        };
        if let (Some(a), Some(p)) = (admission, &profile) {
            let verdict = match &result {
                Ok(_) => keel_resilience::Verdict::Success,
                Err(f) => p.classifier().classify(f).verdict,
            };
            a.settle(verdict);
        }
        drop(copy);
        shard.send(
            &host,
            ShardInput::AttemptFinished {
                key,
                attempt,
                epoch,
                result,
            },
        );
    }
    .instrument(span);
    if let Some((activity_type, warn_host)) = first_poll_here {
        let started = std::time::Instant::now();
        poll_here_then_pool(&pool, Box::pin(attempt_run));
        let took = started.elapsed();
        if took >= Duration::from_millis(FIRST_POLL_WARN_MS)
            && warn_host.slow_first_polls.lock().insert(activity_type)
        {
            tracing::warn!(
                activity_type,
                took_ms = took.as_millis() as u64,
                warn_ms = FIRST_POLL_WARN_MS,
                "a NON_BLOCKING activity's first poll held its shard's thread: \
                 drop the declaration, or move the blocking part behind an await"
            );
        }
    } else {
        pool.spawn(attempt_run);
    }
}

/// A copy's place in `Host::copies`, given back when the copy reports or
/// when its future is dropped without reporting (a panic outside the
/// body's own guard, in a profile's classifier say): a lost copy must not
/// keep a place under `worker_concurrency_max`.
struct CopyEntry {
    host: Arc<Host>,
    key: (AttemptKey, keel_storage::LeaseEpoch),
}

impl CopyEntry {
    /// Records the copy (its stop signal) and holds its place.
    fn hold(
        host: &Arc<Host>,
        key: (AttemptKey, keel_storage::LeaseEpoch),
        cancel: CancelSignal,
    ) -> Self {
        host.copies.lock().insert(key, cancel);
        CopyEntry {
            host: host.clone(),
            key,
        }
    }
}

impl Drop for CopyEntry {
    fn drop(&mut self) {
        self.host.copies.lock().remove(&self.key);
    }
}

/// Polls `attempt` once on this thread within `pool`'s runtime context and
/// spawns it on `pool` if it is not finished. No wake-up is lost by the
/// move: a task spawned on the pool is polled at once, and a future must
/// tolerate a poll with a new waker. A panic here that the body's own
/// guard did not catch (the engine's code, or user code run around the
/// body such as a profile's classifier) drops the copy, as the pool would:
/// its lease's end redelivers the attempt.
fn poll_here_then_pool(
    pool: &tokio::runtime::Handle,
    mut attempt: Pin<Box<dyn Future<Output = ()> + Send>>,
) {
    let finished = {
        let _context = pool.enter();
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        std::panic::catch_unwind(AssertUnwindSafe(|| {
            attempt.as_mut().poll(&mut cx).is_ready()
        }))
        .unwrap_or(true)
    };
    if !finished {
        pool.spawn(attempt);
    }
}

/// Calls an activity's fallback for a final failure.
pub(crate) fn fallback(
    host: &Arc<Host>,
    shard: Addr<ShardActor>,
    key: AttemptKey,
    attempt: AttemptNo,
    activity_type: String,
    input: Payload,
    failure: Failure,
) {
    let activity = host.activities.get(&activity_type).cloned();
    host.activity_rt.spawn_blocking(move || {
        let result = activity.and_then(|a| {
            std::panic::catch_unwind(AssertUnwindSafe(|| a.fallback(input, &failure)))
                .unwrap_or_else(|_| {
                    Some(Err(Failure::new(
                        FailureKind::Panic,
                        "the activity's fallback panicked",
                        false,
                    )))
                })
        });
        shard.do_send(Feed(ShardInput::FallbackDone {
            key,
            attempt,
            result,
        }));
    });
}
