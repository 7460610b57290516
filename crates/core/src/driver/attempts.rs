//! Activity attempts under leases: dispatch, heartbeats, timeouts,
//! redelivery, results, cancellation, durable retries and fallbacks.
//!
//! An attempt is driven from its task row (the intent the commit of its
//! `ActivityScheduled` or of its predecessor's failure wrote). Each delivery
//! to a worker gets a lease with a fresh epoch. When the lease ends without
//! a result (a missed heartbeat, a worker gone) the same attempt is
//! delivered again, up to [`LEASE_REDELIVERIES_MAX`] times, and the copy
//! still holding the old lease is asked to stop; past its start-to-close or
//! schedule-to-close limit the attempt fails as a timeout. The first result
//! of the attempt, from whichever copy, is reported to the run; later ones
//! are late. A failure is classified (by the call's resilience profile, if
//! it names one), and the retry decision (the durable backoff) travels with
//! it into history. Cancellation stops the running copy; once it stops or
//! its lease ends, the execution is committed as cancelled.

use std::collections::{BTreeMap, VecDeque};

use keel_storage::{
    AttemptId, AttemptNo, Failure, FailureKind, LeaseEpoch, Payload, TaskEntry, Timestamp,
    PAYLOAD_BYTES_MAX,
};

use super::{
    Action, Answer, AttemptKey, AttemptOrder, AttemptView, BreakMode, Cause, Due, Origin, RunOp,
    Shard, LEASE_REDELIVERIES_MAX, PROFILE_REJECTION_RETRY_MS,
};
use crate::machine::Input;

/// Overall deadline of an attempt admitted through a resilience profile when
/// the call has no schedule-to-close limit.
pub const PROFILE_DEADLINE_MS_DEFAULT: u64 = 3_600_000;
/// Longest failure message committed; a longer one is cut.
pub const FAILURE_MESSAGE_BYTES_MAX: usize = 16 << 10;

#[derive(Clone, Debug)]
enum State {
    /// Waiting for its due time (a retry's backoff, or not yet looked at).
    Waiting,
    /// Due, behind the shard's limit of attempts running at once.
    Queued,
    /// Delivered to a worker under a lease.
    Running {
        epoch: LeaseEpoch,
        started_at: Timestamp,
        expires_at: Timestamp,
    },
    /// Its resilience profile refused it in this process; offered again at
    /// its next due time.
    Refused { policy: String, at: Timestamp },
    /// Its result was handed to the run; waiting for the answer.
    Reporting { input: Box<Input>, tries: u32 },
    /// Waiting for the activity's fallback value.
    Fallback { failure: Failure },
}

#[derive(Debug)]
struct Attempt {
    task: TaskEntry,
    state: State,
    deliveries: u32,
    details: Option<Payload>,
    last_epoch: Option<LeaseEpoch>,
    /// Copies asked to stop whose lease ended: a failure they report is
    /// the stop itself, not the attempt's outcome.
    stopped: Vec<LeaseEpoch>,
    cause: Cause,
    start_deadline_armed: bool,
    /// A window of the shard's backlog brought its row in (see
    /// `backlog.rs`): it counts against the room for the next window.
    windowed: bool,
}

/// The attempts one shard supervises.
#[derive(Debug, Default)]
pub(super) struct Attempts {
    map: BTreeMap<AttemptKey, Attempt>,
    /// Attempts handed to the host and not yet reported.
    pub(super) running: usize,
    queue: VecDeque<(AttemptKey, AttemptNo)>,
    /// Attempts in `map` a backlog window brought in.
    windowed: usize,
    /// When one of them was last done (left memory).
    windowed_done_at: Timestamp,
}

impl Attempts {
    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    /// Attempts held that a backlog window brought in, and when one of
    /// them was last done.
    pub(super) fn windowed(&self) -> (usize, Timestamp) {
        (self.windowed, self.windowed_done_at)
    }

    /// Holds `attempt`. One that takes the place of an attempt a window
    /// brought in (its retry) still counts against the window.
    fn insert(&mut self, key: AttemptKey, mut attempt: Attempt) {
        let was = self.map.get(&key).is_some_and(|a| a.windowed);
        attempt.windowed |= was;
        if attempt.windowed && !was {
            self.windowed += 1;
        }
        self.map.insert(key, attempt);
    }

    fn remove(&mut self, key: &AttemptKey, now: Timestamp) -> Option<Attempt> {
        let a = self.map.remove(key)?;
        if a.windowed {
            self.windowed -= 1;
            self.windowed_done_at = now;
        }
        Some(a)
    }

    /// Every copy delivered under a lease that has not reported yet.
    pub(super) fn running_copies(&self) -> Vec<(AttemptKey, LeaseEpoch)> {
        self.map
            .iter()
            .filter_map(|(key, a)| match a.state {
                State::Running { epoch, .. } => Some((*key, epoch)),
                _ => None,
            })
            .collect()
    }
}

/// Why an attempt failed, for its classification.
#[derive(Clone, Copy, PartialEq, Eq)]
enum FailedBy {
    /// The activity returned an error (or panicked).
    Error,
    /// It ran past its start-to-close limit.
    AttemptTimeout,
}

fn key_of(task: &TaskEntry) -> AttemptKey {
    AttemptKey {
        run: task.execution_id.run_id,
        step: task.execution_id.step,
    }
}

pub(super) fn attempt_id(task: &TaskEntry) -> AttemptId {
    AttemptId {
        execution: task.execution_id,
        attempt: task.attempt,
    }
}

/// A failure fit for history: its message cut to the limit, oversized
/// details dropped.
fn bounded(mut failure: Failure) -> Failure {
    if failure.message.len() > FAILURE_MESSAGE_BYTES_MAX {
        let mut cut = FAILURE_MESSAGE_BYTES_MAX;
        while !failure.message.is_char_boundary(cut) {
            cut -= 1;
        }
        failure.message.truncate(cut);
        failure.message.push_str(" [cut]");
    }
    if failure
        .details
        .as_ref()
        .is_some_and(|d| d.len() > PAYLOAD_BYTES_MAX)
    {
        failure.details = None;
    }
    failure
}

impl Shard {
    /// A task row was written (or read back; `windowed` when a backlog
    /// window brought it): drive its attempt.
    pub(super) fn task_intent(&mut self, task: TaskEntry, cause: Cause, windowed: bool) {
        let key = key_of(&task);
        if let Some(a) = self.attempts.map.get_mut(&key) {
            if a.task.attempt == task.attempt {
                if task.cancel_requested && !a.task.cancel_requested {
                    a.task.cancel_requested = true;
                    self.cancel_attempt(key);
                }
                return;
            }
            if a.task.attempt > task.attempt {
                return; // an older row read back after a newer one arrived
            }
            if let State::Running { epoch, .. } = a.state {
                self.actions.push_back(Action::StopAttempt { key, epoch });
                self.leave_running(key);
            }
        }
        let attempt = task.attempt;
        let due = task.due;
        let cancel = task.cancel_requested;
        self.attempts.insert(
            key,
            Attempt {
                details: task.heartbeat.clone(),
                task,
                state: State::Waiting,
                deliveries: 0,
                last_epoch: None,
                stopped: Vec::new(),
                cause,
                start_deadline_armed: false,
                windowed,
            },
        );
        if cancel {
            // Asked to cancel before a copy runs here (or before a restart):
            // nothing to stop.
            self.cancel_attempt(key);
        } else if due <= self.now {
            self.task_due(key, attempt);
        } else {
            self.due.push(due, Due::Task(key, attempt));
        }
        self.fill();
    }

    /// The task row is gone: the execution finished, or its run closed. A
    /// copy still running is asked to stop.
    pub(super) fn task_removed(&mut self, key: AttemptKey) {
        if let Some(a) = self.attempts.map.get(&key) {
            if matches!(a.state, State::Reporting { .. } | State::Fallback { .. }) {
                return; // its own report; removed when answered
            }
        }
        if let Some(a) = self.attempts.remove(&key, self.now) {
            if let State::Running { epoch, .. } = a.state {
                self.actions.push_back(Action::StopAttempt { key, epoch });
                self.attempts.running -= 1;
            }
        }
        self.fill();
    }

    pub(super) fn task_due(&mut self, key: AttemptKey, attempt: AttemptNo) {
        let now = self.now;
        let Some(a) = self.attempts.map.get_mut(&key) else {
            return;
        };
        if a.task.attempt != attempt || !matches!(a.state, State::Waiting | State::Refused { .. }) {
            return;
        }
        if let (Some(limit), false) = (a.task.options.schedule_to_start_ms, a.start_deadline_armed)
        {
            a.start_deadline_armed = true;
            self.due
                .push(now.plus_ms(limit), Due::StartDeadline(key, attempt));
        }
        self.dispatch(key);
    }

    /// Hands the attempt to a worker under a new lease, or queues it behind
    /// the shard's limit.
    fn dispatch(&mut self, key: AttemptKey) {
        let now = self.now;
        let same_epoch = self.breaks(BreakMode::RedeliverSameEpoch);
        let limit = self.config.worker_concurrency_max.max(1);
        let lease_default = self.config.lease_ms_default;
        let Some(a) = self.attempts.map.get(&key) else {
            return;
        };
        if let Some(name) = &a.task.options.profile {
            if !self.config.profiles.contains_key(name) {
                let failure = Failure::new(
                    FailureKind::Application,
                    format!("unknown resilience profile {name:?}"),
                    false,
                );
                return self.report_failure(key, failure, None);
            }
        }
        if self.attempts.running >= limit {
            let attempt = a.task.attempt;
            self.attempts.map.get_mut(&key).expect("found").state = State::Queued;
            self.attempts.queue.push_back((key, attempt));
            return;
        }
        let epoch = match (same_epoch, a.last_epoch) {
            // Broken on purpose: the old copy keeps a valid lease.
            (true, Some(e)) => e,
            _ => {
                self.next_epoch += 1;
                LeaseEpoch(self.next_epoch)
            }
        };
        let a = self.attempts.map.get(&key).expect("found");
        let profile = a
            .task
            .options
            .profile
            .as_ref()
            .and_then(|p| self.config.profiles.get(p));
        let start_to_close = self.attempt_limit_ms(&a.task);
        let attempts_max = match (&a.task.options.retry, profile) {
            (Some(r), _) => r.attempts_max,
            (None, Some(p)) => p.retry_policy().max_attempts(),
            (None, None) => 1,
        };
        let final_attempt = a.task.attempt.0 >= attempts_max;
        let o = &a.task.options;
        let to_deadline = o.schedule_to_close_ms.map(|ms| {
            a.task
                .scheduled_at
                .0
                .saturating_add(ms)
                .saturating_sub(now.0)
                .max(1)
        });
        let lease_ms = [o.heartbeat_ms, start_to_close, to_deadline]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(lease_default)
            .max(1);
        let expires_at = now.plus_ms(lease_ms);
        let order = AttemptOrder {
            key,
            attempt: a.task.attempt,
            epoch,
            activity_type: a.task.activity_type.clone(),
            input: a.task.input.clone(),
            profile: profile.and(a.task.options.profile.clone()),
            is_retry: a.task.attempt.0 > 1,
            deadline_ms: to_deadline.unwrap_or(PROFILE_DEADLINE_MS_DEFAULT),
            heartbeat: a.details.clone(),
            lease_until: expires_at,
            heartbeat_ms: a.task.options.heartbeat_ms,
            start_to_close_ms: start_to_close,
            final_attempt,
        };
        let cause = a.cause;
        let a = self.attempts.map.get_mut(&key).expect("found");
        a.deliveries += 1;
        a.last_epoch = Some(epoch);
        a.state = State::Running {
            epoch,
            started_at: now,
            expires_at,
        };
        self.attempts.running += 1;
        self.actions.push_back(Action::RunAttempt { order, cause });
        self.due.push(expires_at, Due::Lease(key, epoch));
    }

    /// The limit of one attempt from start to result: the call's, or its
    /// profile's attempt timeout, whichever is shorter.
    fn attempt_limit_ms(&self, task: &TaskEntry) -> Option<u64> {
        let profile = task
            .options
            .profile
            .as_ref()
            .and_then(|p| self.config.profiles.get(p))
            .map(|p| u64::try_from(p.attempt_timeout().0.as_millis()).unwrap_or(u64::MAX));
        match (task.options.start_to_close_ms, profile) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Starts queued attempts while the shard is below its limit.
    fn fill(&mut self) {
        let limit = self.config.worker_concurrency_max.max(1);
        while self.attempts.running < limit {
            let Some((key, attempt)) = self.attempts.queue.pop_front() else {
                break;
            };
            let queued = self
                .attempts
                .map
                .get(&key)
                .is_some_and(|a| a.task.attempt == attempt && matches!(a.state, State::Queued));
            if queued {
                self.dispatch(key);
            }
        }
    }

    /// The attempt's copy no longer counts against the shard's limit.
    fn leave_running(&mut self, key: AttemptKey) {
        if let Some(a) = self.attempts.map.get_mut(&key) {
            if matches!(a.state, State::Running { .. }) {
                self.attempts.running -= 1;
                a.state = State::Waiting;
            }
        }
    }

    pub(super) fn heartbeat(
        &mut self,
        key: AttemptKey,
        epoch: LeaseEpoch,
        details: Option<Payload>,
    ) {
        let now = self.now;
        let lease_default = self.config.lease_ms_default;
        let Some(a) = self.attempts.map.get_mut(&key) else {
            return;
        };
        let State::Running {
            epoch: current,
            expires_at,
            ..
        } = &mut a.state
        else {
            return;
        };
        // A stale epoch cannot extend the lease.
        if *current != epoch {
            return;
        }
        let ms = a.task.options.heartbeat_ms.unwrap_or(lease_default);
        let until = now.plus_ms(ms);
        if until > *expires_at {
            *expires_at = until;
            self.due.push(until, Due::Lease(key, epoch));
        }
        if details.is_some() {
            a.details = details;
        }
    }

    /// Drops from the due queue what can never apply again: lease checks
    /// of copies no longer running, and dispatches and start deadlines of
    /// attempts superseded by a later one (attempt numbers only grow). An
    /// entry whose attempt is not here is kept when the attempt may come
    /// back (its run activated again); a lease check is not, since a copy
    /// delivered again gets a check of its own under a new epoch. (Under
    /// the simulator's `RedeliverSameEpoch` break mode an epoch comes back,
    /// and an old check could act early: lease checks are then kept.)
    pub(super) fn sweep_due(&mut self) {
        let before = self.due.len();
        let same_epoch = self.breaks(BreakMode::RedeliverSameEpoch);
        let attempts = &self.attempts.map;
        self.due.sweep(|due| match due {
            Due::Lease(key, epoch) => {
                same_epoch
                    || attempts.get(key).is_some_and(
                        |a| matches!(a.state, State::Running { epoch: e, .. } if e == *epoch),
                    )
            }
            Due::Task(key, attempt) | Due::StartDeadline(key, attempt) => {
                attempts.get(key).is_none_or(|a| a.task.attempt == *attempt)
            }
            _ => true,
        });
        tracing::trace!(before, after = self.due.len(), "due queue swept");
    }

    /// A lease may have ended: redeliver the same attempt, or fail it.
    pub(super) fn lease_check(&mut self, key: AttemptKey, epoch: LeaseEpoch) {
        let now = self.now;
        let Some(a) = self.attempts.map.get(&key) else {
            return;
        };
        let State::Running {
            epoch: current,
            started_at,
            expires_at,
        } = a.state
        else {
            return;
        };
        if current != epoch || expires_at > now {
            return;
        }
        let o = &a.task.options;
        let over_schedule = o
            .schedule_to_close_ms
            .is_some_and(|ms| now.0 >= a.task.scheduled_at.0.saturating_add(ms));
        let over_attempt = self
            .attempt_limit_ms(&a.task)
            .is_some_and(|ms| now.0 >= started_at.0.saturating_add(ms));
        let cancel = a.task.cancel_requested;
        let deliveries = a.deliveries;
        self.stats.lease_expiries += 1;
        self.actions.push_back(Action::StopAttempt { key, epoch });
        self.leave_running(key);
        if cancel {
            self.report_cancelled(key);
        } else if over_schedule {
            let f = Failure::new(FailureKind::Timeout, "schedule-to-close timeout", false);
            self.report_failure(key, f, None);
        } else if over_attempt {
            let f = Failure::new(FailureKind::Timeout, "start-to-close timeout", true);
            self.report_failure(key, f, Some(FailedBy::AttemptTimeout));
        } else if deliveries <= LEASE_REDELIVERIES_MAX {
            tracing::debug!(run_id = %key.run, step = key.step.0, epoch = epoch.0,
                "lease ended; delivering the same attempt again");
            self.stats.redeliveries += 1;
            self.attempts
                .map
                .get_mut(&key)
                .expect("found")
                .stopped
                .push(epoch);
            self.dispatch(key);
        } else {
            let f = Failure::new(
                FailureKind::LeaseExpired,
                format!("lease ended {deliveries} times without a result"),
                true,
            );
            self.report_failure(key, f, Some(FailedBy::Error));
        }
        self.fill();
    }

    /// The attempt did not start within its schedule-to-start limit.
    pub(super) fn start_deadline(&mut self, key: AttemptKey, attempt: AttemptNo) {
        let Some(a) = self.attempts.map.get(&key) else {
            return;
        };
        if a.task.attempt != attempt
            || !matches!(
                a.state,
                State::Waiting | State::Queued | State::Refused { .. }
            )
        {
            return;
        }
        let f = Failure::new(FailureKind::Timeout, "schedule-to-start timeout", false);
        self.report_failure(key, f, None);
    }

    pub(super) fn attempt_finished(
        &mut self,
        key: AttemptKey,
        attempt: AttemptNo,
        epoch: LeaseEpoch,
        result: Result<Payload, keel_storage::Failure>,
    ) {
        let Some(a) = self.attempts.map.get(&key) else {
            tracing::debug!(run_id = %key.run, step = key.step.0, attempt = attempt.0, "late result dropped");
            return;
        };
        let State::Running { epoch: current, .. } = a.state else {
            tracing::debug!(run_id = %key.run, step = key.step.0, attempt = attempt.0, "late result dropped");
            return;
        };
        if a.task.attempt != attempt || epoch > current {
            tracing::debug!(run_id = %key.run, step = key.step.0, attempt = attempt.0, "late result dropped");
            return;
        }
        if result.is_err() && a.stopped.contains(&epoch) {
            // A copy that was asked to stop gave up: the delivery that
            // replaced it decides.
            return;
        }
        if result.is_err() && epoch.0 <= self.epoch_base {
            // A copy an earlier owner of the shard dispatched (another
            // process, or this one before it lost the shard and took it
            // again): it may have been asked to stop when that owner lost
            // the shard, so its failure is not the attempt's. The delivery
            // made here decides. (Its success is a result like any other.)
            tracing::debug!(run_id = %key.run, step = key.step.0, attempt = attempt.0, "a failure from an earlier owner's copy dropped");
            return;
        }
        if epoch != current {
            // An earlier holder of this attempt finished first: its result
            // is the attempt's; the current copy is asked to stop.
            self.actions.push_back(Action::StopAttempt {
                key,
                epoch: current,
            });
        }
        let cancel = a.task.cancel_requested;
        self.leave_running(key);
        match result {
            // A result wins over a cancellation that came too late.
            Ok(payload) => self.report_success(key, payload),
            Err(_) if cancel => self.report_cancelled(key),
            Err(f) => self.report_failure(key, f, Some(FailedBy::Error)),
        }
        self.fill();
    }

    /// The process running copy `epoch` is gone: what its lease's end
    /// would do, now (deliver again, or fail past the limits).
    pub(super) fn copy_lost(&mut self, key: AttemptKey, epoch: LeaseEpoch) {
        let now = self.now;
        let Some(a) = self.attempts.map.get_mut(&key) else {
            return;
        };
        if let State::Running {
            epoch: current,
            ref mut expires_at,
            ..
        } = a.state
        {
            if current == epoch && *expires_at > now {
                *expires_at = now;
            }
        }
        self.lease_check(key, epoch);
    }

    pub(super) fn attempt_refused(&mut self, key: AttemptKey, epoch: LeaseEpoch, policy: String) {
        let now = self.now;
        let Some(a) = self.attempts.map.get(&key) else {
            return;
        };
        let State::Running { epoch: current, .. } = a.state else {
            return;
        };
        if current != epoch {
            return;
        }
        tracing::debug!(run_id = %key.run, step = key.step.0, %policy, "attempt delayed by a resilience policy");
        self.stats.rejected(&policy);
        self.leave_running(key);
        let a = self.attempts.map.get_mut(&key).expect("found");
        // The copy never ran: it does not count as a delivery.
        a.deliveries = a.deliveries.saturating_sub(1);
        a.state = State::Refused { policy, at: now };
        let attempt = a.task.attempt;
        self.due.push(
            now.plus_ms(PROFILE_REJECTION_RETRY_MS),
            Due::Task(key, attempt),
        );
        self.fill();
    }

    pub(super) fn fallback_done(
        &mut self,
        key: AttemptKey,
        attempt: AttemptNo,
        result: Option<Result<Payload, Failure>>,
    ) {
        let Some(a) = self.attempts.map.get(&key) else {
            return;
        };
        let State::Fallback { failure } = &a.state else {
            return;
        };
        if a.task.attempt != attempt {
            return;
        }
        let failure = failure.clone();
        match result {
            Some(Ok(p)) => self.report_success(key, p),
            Some(Err(f)) => self.report(key, |t, d| Input::ActivityFailed {
                step: t.execution_id.step,
                attempt: t.attempt,
                failure: bounded(f),
                retry_at: None,
                heartbeat: d,
            }),
            None => self.report(key, |t, d| Input::ActivityFailed {
                step: t.execution_id.step,
                attempt: t.attempt,
                failure,
                retry_at: None,
                heartbeat: d,
            }),
        }
    }

    /// The execution is cancelled: a copy running is asked to stop (its
    /// result or the end of its lease settles it); otherwise it is
    /// committed as cancelled at once.
    fn cancel_attempt(&mut self, key: AttemptKey) {
        let Some(a) = self.attempts.map.get(&key) else {
            return;
        };
        match a.state {
            State::Running { epoch, .. } => {
                self.actions.push_back(Action::StopAttempt { key, epoch })
            }
            State::Waiting | State::Queued | State::Refused { .. } => self.report_cancelled(key),
            State::Reporting { .. } | State::Fallback { .. } => {}
        }
    }

    fn report_success(&mut self, key: AttemptKey, payload: Payload) {
        if payload.len() > PAYLOAD_BYTES_MAX {
            let f = Failure::new(
                FailureKind::PayloadTooLarge,
                format!(
                    "the activity's result of {} bytes exceeds the limit of {PAYLOAD_BYTES_MAX} bytes",
                    payload.len()
                ),
                false,
            );
            return self.report_failure(key, f, None);
        }
        self.report(key, |t, _| Input::ActivityCompleted {
            step: t.execution_id.step,
            attempt: t.attempt,
            result: payload,
        });
    }

    fn report_cancelled(&mut self, key: AttemptKey) {
        self.report(key, |t, _| Input::ActivityCancelled {
            step: t.execution_id.step,
        });
    }

    /// Classifies a failure, decides the durable retry (the call's policy,
    /// else its profile's), runs a fallback for a final failure when the
    /// profile allows it, and reports.
    fn report_failure(&mut self, key: AttemptKey, failure: Failure, by: Option<FailedBy>) {
        let now = self.now;
        let failure = bounded(failure);
        let Some(a) = self.attempts.map.get(&key) else {
            return;
        };
        let profile = a
            .task
            .options
            .profile
            .as_ref()
            .and_then(|p| self.config.profiles.get(p))
            .cloned();
        let classification = profile.as_ref().map(|p| match by {
            Some(FailedBy::AttemptTimeout) => p.classifier().classify_attempt_timeout(),
            _ => p.classifier().classify(&failure),
        });
        // A failure the engine decided is final whatever a classifier says
        // (schedule-to-close, schedule-to-start, an unknown profile, a result
        // over the limit): `by` is `None` for those.
        let retryable = match (by, &classification) {
            (None, _) => false,
            (Some(_), Some(c)) => c.retryable,
            (Some(_), None) => failure.retryable,
        };
        let profile_retry = profile
            .as_ref()
            .map(|p| *p.retry_policy())
            .filter(|r| r.max_attempts() > 1);
        let retry_at = crate::retry::retry_at(
            &a.task.options,
            profile_retry.as_ref(),
            a.task.scheduled_at,
            attempt_id(&a.task),
            retryable,
            now,
        );
        let fallback = retry_at.is_none()
            && profile.as_ref().is_some_and(|p| p.fallback_enabled())
            && classification.is_some_and(|c| c.fallback);
        if fallback {
            let a = self.attempts.map.get_mut(&key).expect("found");
            a.state = State::Fallback {
                failure: failure.clone(),
            };
            self.actions.push_back(Action::RunFallback {
                key,
                attempt: a.task.attempt,
                activity_type: a.task.activity_type.clone(),
                input: a.task.input.clone(),
                failure,
            });
            return;
        }
        self.report(key, |t, d| Input::ActivityFailed {
            step: t.execution_id.step,
            attempt: t.attempt,
            failure,
            retry_at,
            heartbeat: d,
        });
    }

    /// Hands the attempt's outcome to its run, retried until the run
    /// answers for good.
    fn report(
        &mut self,
        key: AttemptKey,
        input: impl FnOnce(&TaskEntry, Option<Payload>) -> Input,
    ) {
        let Some(a) = self.attempts.map.get_mut(&key) else {
            return;
        };
        let input = input(&a.task, a.details.clone());
        let attempt = a.task.attempt;
        self.stats.attempt_ended(match &input {
            Input::ActivityCompleted { .. } => "completed",
            Input::ActivityCancelled { .. } => "cancelled",
            Input::ActivityFailed { failure, .. } => match failure.kind {
                FailureKind::Timeout => "timed_out",
                FailureKind::LeaseExpired => "lease_expired",
                _ => "failed",
            },
            _ => "other",
        });
        if matches!(a.state, State::Running { .. }) {
            self.attempts.running -= 1;
        }
        a.state = State::Reporting {
            input: Box::new(input.clone()),
            tries: 0,
        };
        self.run_op(key.run, RunOp::Input(input), Origin::Attempt(key, attempt));
    }

    pub(super) fn report_again(&mut self, key: AttemptKey, attempt: AttemptNo) {
        let Some(a) = self.attempts.map.get(&key) else {
            return;
        };
        let State::Reporting { input, .. } = &a.state else {
            return;
        };
        if a.task.attempt != attempt {
            return;
        }
        let input = (**input).clone();
        self.run_op(key.run, RunOp::Input(input), Origin::Attempt(key, attempt));
    }

    /// The run answered a report.
    pub(super) fn report_answered(&mut self, key: AttemptKey, attempt: AttemptNo, answer: Answer) {
        let now = self.now;
        let Some(a) = self.attempts.map.get_mut(&key) else {
            return;
        };
        if a.task.attempt != attempt {
            return; // the next attempt took its place already
        }
        let State::Reporting { tries, .. } = &mut a.state else {
            return;
        };
        match answer {
            Answer::Retry(_) => {
                *tries += 1;
                let at = now.plus_ms(Self::backoff(*tries));
                self.due.push(at, Due::Report(key, attempt));
            }
            // Committed, a duplicate, the run closed, parked (a resume
            // drives the task row again), nothing open at the step.
            _ => {
                self.attempts.remove(&key, now);
            }
        }
    }

    /// The attempts of `run` as `describe` shows them.
    pub(super) fn attempt_views(&self, run: keel_storage::RunId) -> Vec<AttemptView> {
        let from = AttemptKey {
            run,
            step: keel_storage::Step(0),
        };
        self.attempts
            .map
            .range(from..)
            .take_while(|(k, _)| k.run == run)
            .map(|(k, a)| {
                let id = attempt_id(&a.task).to_string();
                let (epoch, expires_at, delayed_by) = match &a.state {
                    State::Running {
                        epoch, expires_at, ..
                    } => (epoch.0, *expires_at, None),
                    State::Refused { policy, at } => (0, *at, Some(policy.clone())),
                    _ => (0, a.task.due, None),
                };
                AttemptView {
                    step: k.step,
                    attempt_id: id,
                    lease_owner: format!("{}", self.id),
                    epoch,
                    expires_at,
                    deliveries: a.deliveries,
                    delayed_by,
                    state: match a.state {
                        State::Waiting => "waiting",
                        State::Queued => "queued",
                        State::Running { .. } => "running",
                        State::Refused { .. } => "refused",
                        State::Reporting { .. } => "reporting",
                        State::Fallback { .. } => "fallback",
                    },
                    cancel_requested: a.task.cancel_requested,
                }
            })
            .collect()
    }
}
