//! Activity workers and their supervisor.
//!
//! The supervisor actor owns every in-flight attempt: it hands the attempt
//! to the activity thread pool under a lease (owner, epoch, expiry), extends
//! the lease on heartbeats from the current epoch, redelivers the same
//! attempt when a lease expires (up to [`LEASE_REDELIVERIES_MAX`]), turns a
//! panic into a retryable attempt failure, and reports every result to the
//! attempt's run. The first result of an attempt wins; later ones (a stale
//! holder finishing after a redelivery) are dropped as late.

use std::collections::{HashMap, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use futures::FutureExt;
use keel_storage::{
    ActivityOptions, AttemptNo, ExecutionId, Failure, FailureKind, LeaseEpoch, Payload, RunId,
    Step, TaskEntry, Timestamp,
};
use tokio::sync::watch;
use tracing::{debug, info_span, Instrument};

use super::engine::{AttemptView, Shared};
use super::{
    LEASE_REDELIVERIES_MAX, LEASE_SWEEP_MS, PROFILE_DEADLINE_MS_DEFAULT, PROFILE_REJECTION_RETRY_MS,
};
use crate::activity::ActivityContext;
use crate::machine::Input;

/// One attempt to run.
#[derive(Clone, Debug)]
pub(crate) struct AttemptTask {
    pub(crate) run_id: RunId,
    pub(crate) step: Step,
    pub(crate) execution_id: ExecutionId,
    pub(crate) attempt: AttemptNo,
    pub(crate) activity_type: String,
    pub(crate) input: Payload,
    pub(crate) options: ActivityOptions,
    pub(crate) scheduled_at: Timestamp,
}

impl AttemptTask {
    pub(crate) fn from_entry(run_id: RunId, step: Step, t: &TaskEntry) -> Self {
        AttemptTask {
            run_id,
            step,
            execution_id: t.execution_id,
            attempt: t.attempt,
            activity_type: t.activity_type.clone(),
            input: t.input.clone(),
            options: t.options.clone(),
            scheduled_at: t.scheduled_at,
        }
    }
}

#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Dispatch(pub(crate) AttemptTask);

#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct CancelAttempt {
    pub(crate) run_id: RunId,
    pub(crate) step: Step,
}

#[derive(Message)]
#[rtype(result = "()")]
struct Heartbeat {
    run_id: RunId,
    step: Step,
    epoch: LeaseEpoch,
}

#[derive(Message)]
#[rtype(result = "()")]
struct AttemptDone {
    run_id: RunId,
    step: Step,
    attempt: AttemptNo,
    epoch: LeaseEpoch,
    result: Result<Payload, Failure>,
}

#[derive(Message)]
#[rtype(result = "()")]
struct AttemptRejected {
    run_id: RunId,
    step: Step,
    attempt: AttemptNo,
    epoch: LeaseEpoch,
    policy: String,
}

#[derive(Message)]
#[rtype(result = "Vec<AttemptView>")]
pub(crate) struct Leases {
    pub(crate) run_id: RunId,
}

struct InFlight {
    task: AttemptTask,
    epoch: LeaseEpoch,
    owner: String,
    expires_at: Timestamp,
    started_at: Timestamp,
    deliveries: u32,
    cancel: watch::Sender<bool>,
}

pub(crate) struct Workers {
    shared: Arc<Shared>,
    inflight: HashMap<(RunId, Step), InFlight>,
    queue: VecDeque<AttemptTask>,
    launched: u64,
    /// Attempts a resilience policy refused, waiting to be offered again:
    /// the policy and when.
    delayed: HashMap<(RunId, Step), (AttemptTask, String, Timestamp)>,
}

impl Workers {
    pub(crate) fn new(shared: Arc<Shared>) -> Self {
        Workers {
            shared,
            inflight: HashMap::new(),
            queue: VecDeque::new(),
            launched: 0,
            delayed: HashMap::new(),
        }
    }

    fn lease_ms(&self, o: &ActivityOptions) -> u64 {
        [o.heartbeat_ms, o.start_to_close_ms, o.schedule_to_close_ms]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(self.shared.config.lease_ms_default)
    }

    /// Hands `task` to the pool under a new lease epoch.
    fn launch(&mut self, task: AttemptTask, deliveries: u32, ctx: &mut Context<Self>) {
        let now = self.shared.now();
        let epoch = self.shared.epoch();
        self.launched += 1;
        let owner = format!(
            "worker-{}",
            self.launched % self.shared.config.activity_threads.max(1) as u64
        );
        let (cancel_tx, cancel_rx) = watch::channel(false);
        let addr = ctx.address();
        let (run_id, step, attempt) = (task.run_id, task.step, task.attempt);
        let hb_addr = addr.clone();
        let heartbeat = Arc::new(move |_: Option<Payload>| {
            hb_addr.do_send(Heartbeat {
                run_id,
                step,
                epoch,
            });
        });
        let attempt_id = keel_storage::AttemptId {
            execution: task.execution_id,
            attempt,
        };
        let actx = ActivityContext::new(attempt_id, heartbeat, cancel_rx);
        let body = match self.shared.activities.get(&task.activity_type) {
            Some(a) => a.start(actx, task.input.clone()),
            None => {
                let name = task.activity_type.clone();
                Box::pin(async move {
                    Err(Failure::new(
                        FailureKind::Application,
                        format!("unknown activity type {name:?}"),
                        false,
                    ))
                })
            }
        };
        let span = info_span!("attempt", run_id = %run_id, step = step.0, attempt = attempt.0, epoch = epoch.0);
        let profile = match task.options.profile.as_deref() {
            None => None,
            Some(name) => match self.shared.profiles.get(name) {
                Some(p) => Some(p.clone()),
                None => {
                    let name = name.to_string();
                    let failure = Failure::new(
                        FailureKind::Application,
                        format!("unknown resilience profile {name:?}"),
                        false,
                    );
                    self.report(run_id, step, attempt, Err(failure));
                    return;
                }
            },
        };
        let execution = task.execution_id.to_string();
        let deadline_ms = task
            .options
            .schedule_to_close_ms
            .map(|ms| {
                task.scheduled_at
                    .0
                    .saturating_add(ms)
                    .saturating_sub(now.0)
                    .max(1)
            })
            .unwrap_or(PROFILE_DEADLINE_MS_DEFAULT);
        self.shared.activity_rt.spawn(
            async move {
                // Per-process admission (breaker, rate limit, bulkhead) in
                // the pipeline's fixed order. A rejection never reaches the
                // activity and never counts as a dependency failure; the
                // attempt is offered again later.
                let mut admission = None;
                if let Some(p) = &profile {
                    let admitted = keel_resilience::Safety::idempotent(&execution)
                        .map_err(|e| e.to_string())
                        .and_then(|safety| {
                            p.new_context(Duration::from_millis(deadline_ms), safety, &execution)
                                .map_err(|e| e.to_string())
                        })
                        .and_then(|ctx| {
                            p.admit(&ctx, attempt.0 > 1)
                                .map_err(|r| r.reason().to_string())
                        });
                    match admitted {
                        Ok(mut a) => {
                            a.mark_dispatched();
                            admission = Some(a);
                        }
                        Err(policy) => {
                            addr.do_send(AttemptRejected {
                                run_id,
                                step,
                                attempt,
                                epoch,
                                policy,
                            });
                            return;
                        }
                    }
                }
                let result = match AssertUnwindSafe(body).catch_unwind().await {
                    Ok(r) => r,
                    Err(p) => {
                        let msg = p
                            .downcast_ref::<&str>()
                            .map(|s| s.to_string())
                            .or_else(|| p.downcast_ref::<String>().cloned())
                            .unwrap_or_else(|| "activity panicked".into());
                        Err(Failure::new(
                            FailureKind::Panic,
                            format!("activity panicked: {msg}"),
                            true,
                        ))
                    }
                };
                if let (Some(a), Some(p)) = (admission, &profile) {
                    let verdict = match &result {
                        Ok(_) => keel_resilience::Verdict::Success,
                        Err(f) => p.classifier().classify(f).verdict,
                    };
                    a.settle(verdict);
                }
                addr.do_send(AttemptDone {
                    run_id,
                    step,
                    attempt,
                    epoch,
                    result,
                });
            }
            .instrument(span),
        );
        let expires_at = now.plus_ms(self.lease_ms(&task.options));
        self.inflight.insert(
            (run_id, step),
            InFlight {
                task,
                epoch,
                owner,
                expires_at,
                started_at: now,
                deliveries,
                cancel: cancel_tx,
            },
        );
    }

    fn report(
        &self,
        run_id: RunId,
        step: Step,
        attempt: AttemptNo,
        result: Result<Payload, Failure>,
    ) {
        let input = match result {
            Ok(result) => Input::ActivityCompleted {
                step,
                attempt,
                result,
            },
            Err(failure) => Input::ActivityFailed {
                step,
                attempt,
                failure,
                jitter: self.shared.random(),
            },
        };
        let shared = self.shared.clone();
        // The result is committed once; while the engine runs it is
        // delivered until the run answers, and after a restart the pending
        // attempt is dispatched again.
        actix::spawn(async move { shared.deliver_until_final(run_id, input).await });
    }

    fn fill(&mut self, ctx: &mut Context<Self>) {
        while self.inflight.len() < self.shared.config.worker_concurrency_max {
            let Some(task) = self.queue.pop_front() else {
                break;
            };
            self.launch(task, 1, ctx);
        }
    }

    fn sweep(&mut self, ctx: &mut Context<Self>) {
        let now = self.shared.now();
        let expired: Vec<(RunId, Step)> = self
            .inflight
            .iter()
            .filter(|(_, f)| f.expires_at <= now)
            .map(|(k, _)| *k)
            .collect();
        for key in expired {
            let Some(f) = self.inflight.remove(&key) else {
                continue;
            };
            let over_schedule = f
                .task
                .options
                .schedule_to_close_ms
                .is_some_and(|ms| now.0 >= f.task.scheduled_at.0.saturating_add(ms));
            let over_time = f
                .task
                .options
                .start_to_close_ms
                .is_some_and(|ms| now.0 >= f.started_at.0.saturating_add(ms));
            if over_schedule {
                // The whole execution is out of time: no retry can help.
                let _ = f.cancel.send(true);
                let failure =
                    Failure::new(FailureKind::Timeout, "schedule-to-close timeout", false);
                self.report(key.0, key.1, f.task.attempt, Err(failure));
            } else if over_time {
                let _ = f.cancel.send(true);
                let failure = Failure::new(FailureKind::Timeout, "start-to-close timeout", true);
                self.report(key.0, key.1, f.task.attempt, Err(failure));
            } else if f.deliveries <= LEASE_REDELIVERIES_MAX {
                debug!(run_id = %key.0, step = key.1 .0, epoch = f.epoch.0, "lease expired; redelivering the same attempt");
                self.launch(f.task, f.deliveries + 1, ctx);
            } else {
                let _ = f.cancel.send(true);
                let failure = Failure::new(
                    FailureKind::LeaseExpired,
                    format!("lease expired {} times", f.deliveries),
                    true,
                );
                self.report(key.0, key.1, f.task.attempt, Err(failure));
            }
        }
        self.fill(ctx);
    }
}

impl Actor for Workers {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        ctx.run_interval(Duration::from_millis(LEASE_SWEEP_MS), |act, ctx| {
            act.sweep(ctx)
        });
    }
}

impl Handler<Dispatch> for Workers {
    type Result = ();

    fn handle(&mut self, msg: Dispatch, ctx: &mut Self::Context) {
        let key = (msg.0.run_id, msg.0.step);
        if let Some(f) = self.inflight.get(&key) {
            if f.task.attempt >= msg.0.attempt {
                return; // already running this (or a later) attempt
            }
        }
        if self.inflight.len() >= self.shared.config.worker_concurrency_max {
            self.queue.push_back(msg.0);
        } else {
            self.launch(msg.0, 1, ctx);
        }
    }
}

impl Handler<CancelAttempt> for Workers {
    type Result = ();

    fn handle(&mut self, msg: CancelAttempt, _: &mut Self::Context) {
        if let Some(f) = self.inflight.get(&(msg.run_id, msg.step)) {
            let _ = f.cancel.send(true);
        }
    }
}

impl Handler<Heartbeat> for Workers {
    type Result = ();

    fn handle(&mut self, msg: Heartbeat, _: &mut Self::Context) {
        let now = self.shared.now();
        let lease_default = self.shared.config.lease_ms_default;
        if let Some(f) = self.inflight.get_mut(&(msg.run_id, msg.step)) {
            // A stale epoch cannot extend the lease.
            if f.epoch == msg.epoch {
                let ms = f.task.options.heartbeat_ms.unwrap_or(lease_default);
                f.expires_at = now.plus_ms(ms);
            }
        }
    }
}

impl Handler<AttemptDone> for Workers {
    type Result = ();

    fn handle(&mut self, msg: AttemptDone, ctx: &mut Self::Context) {
        let key = (msg.run_id, msg.step);
        match self.inflight.get(&key) {
            Some(f) if f.task.attempt == msg.attempt => {
                self.delayed.remove(&key);
                if f.epoch != msg.epoch {
                    debug!(run_id = %msg.run_id, step = msg.step.0, "result from an earlier lease holder wins");
                }
                self.inflight.remove(&key);
                self.report(msg.run_id, msg.step, msg.attempt, msg.result);
            }
            _ => {
                debug!(run_id = %msg.run_id, step = msg.step.0, attempt = msg.attempt.0, "late result dropped")
            }
        }
        self.fill(ctx);
    }
}

impl Handler<AttemptRejected> for Workers {
    type Result = ();

    fn handle(&mut self, msg: AttemptRejected, ctx: &mut Self::Context) {
        let key = (msg.run_id, msg.step);
        let Some(f) = self.inflight.get(&key) else {
            return;
        };
        if f.task.attempt != msg.attempt || f.epoch != msg.epoch {
            return;
        }
        let f = self.inflight.remove(&key).expect("checked above");
        let now = self.shared.now();
        debug!(run_id = %msg.run_id, step = msg.step.0, policy = %msg.policy, "attempt delayed by a resilience policy");
        self.delayed.insert(key, (f.task.clone(), msg.policy, now));
        self.shared.timers().do_send(super::timers::ScheduleTask {
            task: f.task,
            due: now.plus_ms(PROFILE_REJECTION_RETRY_MS),
        });
        self.fill(ctx);
    }
}

impl Handler<Leases> for Workers {
    type Result = MessageResult<Leases>;

    fn handle(&mut self, msg: Leases, _: &mut Self::Context) -> Self::Result {
        let mut out: Vec<AttemptView> = self
            .inflight
            .iter()
            .filter(|((run, _), _)| *run == msg.run_id)
            .map(|((_, step), f)| AttemptView {
                step: *step,
                attempt_id: keel_storage::AttemptId {
                    execution: f.task.execution_id,
                    attempt: f.task.attempt,
                }
                .to_string(),
                lease_owner: f.owner.clone(),
                epoch: f.epoch.0,
                expires_at: f.expires_at,
                deliveries: f.deliveries,
                delayed_by: None,
            })
            .collect();
        for ((run, step), (task, policy, at)) in &self.delayed {
            if *run == msg.run_id && !self.inflight.contains_key(&(*run, *step)) {
                out.push(AttemptView {
                    step: *step,
                    attempt_id: keel_storage::AttemptId {
                        execution: task.execution_id,
                        attempt: task.attempt,
                    }
                    .to_string(),
                    lease_owner: String::new(),
                    epoch: 0,
                    expires_at: *at,
                    deliveries: 0,
                    delayed_by: Some(policy.clone()),
                });
            }
        }
        out.sort_by_key(|a| a.step);
        MessageResult(out)
    }
}
