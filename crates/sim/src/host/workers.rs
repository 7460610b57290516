//! Simulated activity workers: they run the attempts the shards dispatch
//! (mock bodies with a simulated duration), admit them through their
//! resilience profile on virtual time, heartbeat, honour stop requests at
//! their next heartbeat (or not at all), and report. Faults: a copy that
//! runs past its lease, stops heartbeating or runs past its start-to-close
//! limit, a worker that crashes, the transport handing a copy to a second
//! worker, a result reported twice, and a stale holder's result reaching
//! the run itself, late. With several processes, another process may take
//! a copy from the store and run it (attempts anywhere): its reports are
//! relayed to the shard wherever it runs, a stop follows it, and its loss
//! with that process is reported to the shard (or reported while the copy
//! still runs).

use keel_core::driver::{AttemptKey, AttemptOrder, Message, ReplyTo, RunOp, ShardId, ShardInput};
use keel_core::Input;
use keel_storage::{AttemptNo, Failure, FailureKind, LeaseEpoch, Payload};
use rand::RngExt;

use super::{Copy, CopyId, Ev, World, ATTEMPT_FAULTS_MAX, WORKERS};
use crate::check::{Violation, ViolationKind};
use crate::fault::FaultKind;

impl World<'_> {
    fn may_fault(&self, key: AttemptKey, attempt: AttemptNo) -> bool {
        self.attempt_faults
            .get(&(key.run, key.step, attempt))
            .copied()
            .unwrap_or(0)
            < ATTEMPT_FAULTS_MAX
    }

    fn spend_fault(&mut self, key: AttemptKey, attempt: AttemptNo) {
        *self
            .attempt_faults
            .entry((key.run, key.step, attempt))
            .or_default() += 1;
    }

    /// A shard dispatched an attempt.
    pub(super) fn run_attempt(&mut self, p: usize, shard: ShardId, order: AttemptOrder) {
        let key = order.key;
        // Epochs only grow: a delivery reusing one cannot fence the copy
        // it replaces. (A process that lost the shard's lease while this
        // dispatch was on its way runs a copy nobody will take the result
        // of: its shard is fenced, so its epochs are not compared.)
        if self.stale_owner(p, shard) {
            self.log(format_args!(
                "a fenced owner of {shard} dispatches {} step {} anyway",
                self.name(key.run),
                key.step
            ));
        } else if let Some(seen) = self.epochs.get(&key) {
            if order.epoch <= *seen {
                let detail = format!(
                    "{} step {} attempt {} delivered under epoch {} after epoch {} was handed out",
                    self.name(key.run),
                    key.step,
                    order.attempt,
                    order.epoch.0,
                    seen.0
                );
                self.checker.violations.push(Violation {
                    kind: ViolationKind::EpochReused,
                    at_ms: self.now,
                    detail,
                });
            }
        }
        if !self.stale_owner(p, shard) {
            let seen = self.epochs.entry(key).or_insert(order.epoch);
            *seen = (*seen).max(order.epoch);
        }
        let inc = self.processes[p].inc;
        let mock = self.setup.mocks.get(&order.activity_type).cloned();
        let injected = self.fault(FaultKind::ActivityFailure) && !order.final_attempt;
        let result = if injected {
            Err(Failure::new(
                FailureKind::Application,
                "injected transient failure",
                true,
            ))
        } else {
            match &mock {
                Some(m) => (m.body)(&order.input, order.attempt),
                None => Err(Failure::new(
                    FailureKind::Application,
                    format!("unknown activity type {:?}", order.activity_type),
                    false,
                )),
            }
        };
        // Admission through the call's resilience profile, in this process;
        // the outcome is settled into it at once (the mock's result is
        // known now).
        if let Some(p) = order
            .profile
            .as_ref()
            .and_then(|name| self.config.profiles.get(name).cloned())
        {
            let id = keel_storage::ExecutionId {
                run_id: key.run,
                step: key.step,
            }
            .to_string();
            let refused = match keel_resilience::Safety::idempotent(&id) {
                Err(e) => Some(e.to_string()),
                Ok(safety) => match p.new_context(
                    std::time::Duration::from_millis(order.deadline_ms),
                    safety,
                    &id,
                ) {
                    Err(e) => Some(e.to_string()),
                    Ok(ctx) => match p.admit(&ctx, order.is_retry) {
                        Err(r) => Some(r.reason().to_string()),
                        Ok(mut admission) => {
                            admission.mark_dispatched();
                            let verdict = match &result {
                                Ok(_) => keel_resilience::Verdict::Success,
                                Err(f) => p.classifier().classify(f).verdict,
                            };
                            admission.settle(verdict);
                            None
                        }
                    },
                },
            };
            if let Some(policy) = refused {
                self.log(format_args!(
                    "{} step {} refused by {policy}",
                    self.name(key.run),
                    key.step
                ));
                let at = self.now + self.ms(0, 1);
                self.pinned_at(
                    at,
                    inc,
                    shard,
                    ShardInput::AttemptRefused {
                        key,
                        epoch: order.epoch,
                        policy,
                    },
                );
                return;
            }
        }
        let (lo, hi) = mock.as_ref().map_or((1, 40), |m| m.duration_ms);
        let mut duration = self.ms(lo, hi);
        let lease = order.lease_until.0.saturating_sub(self.now).max(1);
        let may_fault = self.may_fault(key, order.attempt);
        // A fault that ends the attempt as a timeout must leave a retry to
        // follow, so that the outcome stays the fault-free one.
        let may_time_out = !order.final_attempt;
        let mut silent = false;
        if self.fault(FaultKind::LeaseExpiry)
            && may_fault
            && (may_time_out || order.start_to_close_ms.is_none())
        {
            // Past its lease, and silent so no heartbeat saves it.
            duration = lease + self.ms(1, lease);
            silent = true;
            self.spend_fault(key, order.attempt);
        }
        if order.heartbeat_ms.is_some() && self.fault(FaultKind::SilentWorker) && may_fault {
            silent = true;
            self.spend_fault(key, order.attempt);
        }
        if let Some(limit) = order.start_to_close_ms {
            if self.fault(FaultKind::SlowAttempt) && may_fault && may_time_out {
                duration = limit + self.ms(1, 200);
                self.spend_fault(key, order.attempt);
            }
        }
        let runner = self.taker(p, key, order.attempt, may_time_out);
        let worker = self.rng.random_range(0..WORKERS);
        let copy = CopyId {
            inc,
            runner: self.processes[runner].inc,
            shard,
            key,
            attempt: order.attempt,
            epoch: order.epoch,
        };
        let elsewhere = if runner == p {
            String::new()
        } else {
            format!(" of process {runner}")
        };
        self.log(format_args!(
            "{shard} dispatches {} step {} attempt {} epoch {} to worker {worker}{elsewhere}",
            self.name(key.run),
            key.step,
            order.attempt,
            order.epoch.0
        ));
        if runner != p && self.crashes < super::CRASHES_MAX && self.fault(FaultKind::TakerKill) {
            // The process that took the copy dies while it runs.
            let at = self.now + self.ms(0, duration);
            let inc = self.processes[runner].inc;
            self.at(at, Ev::ProcessKill { p: runner, inc });
        }
        if runner != p && self.may_fault(key, order.attempt) && self.fault(FaultKind::CopyLostAlive)
        {
            // The shard hears the taker is gone while the copy runs on.
            self.spend_fault(key, order.attempt);
            let at = self.now + self.ms(0, duration);
            self.pinned_at(
                at,
                inc,
                shard,
                ShardInput::CopyLost {
                    key,
                    epoch: order.epoch,
                },
            );
        }
        let life = self.workers[worker];
        let twin = self.fault(FaultKind::Redelivery);
        if twin {
            // The transport hands the same attempt to a second worker.
            let other = (worker + 1 + self.rng.random_range(0..WORKERS - 1)) % WORKERS;
            let d = self.ms(lo, hi * 2);
            let life = self.workers[other];
            self.at(
                self.now + d,
                Ev::WorkerDone {
                    worker: other,
                    life,
                    copy,
                },
            );
        }
        if self.fault(FaultKind::WorkerCrash) {
            let at = self.now + self.ms(0, duration);
            self.at(at, Ev::WorkerCrash { worker });
        }
        self.processes[runner].copies.insert(
            copy,
            Copy {
                result,
                stop: false,
                silent,
                heartbeat_ms: order.heartbeat_ms,
                twin,
                worker,
                fragile: !may_time_out && order.start_to_close_ms.is_some(),
            },
        );
        self.at(self.now + duration, Ev::WorkerDone { worker, life, copy });
        if let Some(hb) = order.heartbeat_ms {
            let at = self.now + (hb / 2).max(1);
            self.at(at, Ev::WorkerBeat { worker, life, copy });
        }
    }

    /// Which process runs a copy shard process `p` dispatched: `p`, or
    /// (with several processes) another one up that takes it from the
    /// store. A copy run elsewhere may be lost with that process, a
    /// delivery the attempt's fault budget pays for; a final attempt is
    /// never placed so, since losing it would fail it with no retry left.
    fn taker(
        &mut self,
        p: usize,
        key: AttemptKey,
        attempt: AttemptNo,
        may_time_out: bool,
    ) -> usize {
        // Rolled before the conditions, like the other faults, so that a
        // replay of some firings (`--firings`) keeps the random stream.
        if !self.shared() || !self.fault(FaultKind::RemoteCopy) {
            return p;
        }
        if !may_time_out || !self.may_fault(key, attempt) {
            return p;
        }
        let others: Vec<usize> = (0..self.processes.len())
            .filter(|&q| q != p && self.running(q))
            .collect();
        if others.is_empty() {
            return p;
        }
        self.spend_fault(key, attempt);
        others[self.rng.random_range(0..others.len())]
    }

    /// When `copy` runs in process `p` for another process's shard and `p`
    /// is frozen: when it wakes (its copies report nothing meanwhile; a
    /// copy of the shard's own process is held at delivery instead).
    fn frozen_taker(&self, p: usize, copy: CopyId) -> Option<u64> {
        if copy.runner == copy.inc {
            return None;
        }
        self.processes[p].paused_until
    }

    /// The shard asked a copy to stop; the stop follows the copy to the
    /// process running it.
    pub(super) fn stop_attempt(
        &mut self,
        p: usize,
        shard: ShardId,
        key: AttemptKey,
        epoch: LeaseEpoch,
    ) {
        let inc = self.processes[p].inc;
        let found = self.processes.iter().enumerate().find_map(|(q, proc)| {
            proc.copies
                .keys()
                .find(|c| c.inc == inc && c.shard == shard && c.key == key && c.epoch == epoch)
                .map(|c| (q, *c))
        });
        let Some((p, copy)) = found else {
            return;
        };
        let cooperative = self.rng.random_bool(0.5);
        let c = self.processes[p].copies.get_mut(&copy).expect("found");
        c.stop = true;
        if c.heartbeat_ms.is_none() && cooperative {
            // It notices at once and gives up.
            c.result = Err(Failure::new(FailureKind::Cancelled, "stopped", false));
            let worker = c.worker;
            let life = self.workers[worker];
            let at = self.now + self.ms(0, 2);
            self.at(at, Ev::WorkerDone { worker, life, copy });
        }
    }

    pub(super) fn worker_beat(&mut self, worker: usize, life: u32, copy: CopyId) {
        if self.workers[worker] != life {
            return; // died with its worker
        }
        let Some(p) = self.live(copy.runner) else {
            return; // died with its process
        };
        if let Some(until) = self.frozen_taker(p, copy) {
            return self.at(until, Ev::WorkerBeat { worker, life, copy });
        }
        let Some(c) = self.processes[p].copies.get_mut(&copy) else {
            return; // finished
        };
        if c.stop {
            // It sees the stop at its heartbeat.
            c.result = Err(Failure::new(FailureKind::Cancelled, "stopped", false));
            self.at(self.now, Ev::WorkerDone { worker, life, copy });
            return;
        }
        let Some(hb) = c.heartbeat_ms else {
            return;
        };
        if c.silent {
            return;
        }
        let details = Payload::encode(&self.now).ok();
        let at = self.now + self.ms(0, 1);
        self.report_at(
            at,
            copy,
            ShardInput::Heartbeat {
                key: copy.key,
                epoch: copy.epoch,
                details,
            },
        );
        let at = self.now + (hb / 2).max(1);
        self.at(at, Ev::WorkerBeat { worker, life, copy });
    }

    pub(super) fn worker_crash(&mut self, worker: usize) {
        let victims: Vec<CopyId> = self
            .processes
            .iter()
            .flat_map(|p| p.copies.iter())
            .filter(|(_, c)| c.worker == worker)
            .map(|(id, _)| *id)
            .collect();
        let spared = |w: &Self, v: &CopyId| {
            !w.may_fault(v.key, v.attempt)
                || w.processes
                    .iter()
                    .any(|p| p.copies.get(v).is_some_and(|c| c.fragile))
        };
        if victims.iter().any(|v| spared(self, v)) {
            self.log(format_args!(
                "worker {worker} crash suppressed (attempt fault budget, or a final attempt a lost lease would fail)"
            ));
            return;
        }
        for v in &victims {
            self.spend_fault(v.key, v.attempt);
            for p in &mut self.processes {
                p.copies.remove(v);
            }
        }
        self.workers[worker] += 1;
        self.log(format_args!(
            "worker {worker} crashed with {} copies",
            victims.len()
        ));
    }

    pub(super) fn worker_done(&mut self, worker: usize, life: u32, copy: CopyId) {
        if self.workers[worker] != life {
            return; // the worker died with the copy
        }
        let Some(p) = self.live(copy.runner) else {
            return; // the engine running it is gone, and its copies
        };
        if let Some(until) = self.frozen_taker(p, copy) {
            return self.at(until, Ev::WorkerDone { worker, life, copy });
        }
        let result = match self.processes[p].copies.get(&copy) {
            Some(c) if c.worker == worker => {
                let r = c.result.clone();
                self.processes[p].copies.remove(&copy);
                r
            }
            // The transport's second copy (the first may have reported).
            Some(c) if c.twin => c.result.clone(),
            _ => return,
        };
        self.log(format_args!(
            "worker {worker} finishes {} step {} attempt {} epoch {}: {}",
            self.name(copy.key.run),
            copy.key.step,
            copy.attempt,
            copy.epoch.0,
            if result.is_ok() { "ok" } else { "failed" }
        ));
        let input = ShardInput::AttemptFinished {
            key: copy.key,
            attempt: copy.attempt,
            epoch: copy.epoch,
            result: result.clone(),
        };
        let at = self.now + self.ms(0, 1);
        self.report_at(at, copy, input);
        if self.fault(FaultKind::DuplicateResult) {
            let at = self.now + self.ms(0, 50);
            self.report_at(
                at,
                copy,
                ShardInput::AttemptFinished {
                    key: copy.key,
                    attempt: copy.attempt,
                    epoch: copy.epoch,
                    result: result.clone(),
                },
            );
        }
        self.maybe_late(copy, result);
    }

    /// With `late-result`, a holder's success reaches the run itself, late
    /// (as from a worker in another process that lost its lease): the run
    /// must take it once at most.
    fn maybe_late(&mut self, copy: CopyId, result: Result<Payload, Failure>) {
        let Ok(result) = result else {
            return;
        };
        if !self.fault(FaultKind::LateResult) {
            return;
        }
        let run = copy.key.run;
        let shard = keel_core::driver::shard_of(run, self.config.shards);
        let input = Input::ActivityCompleted {
            step: copy.key.step,
            attempt: copy.attempt,
            result,
        };
        let at = self.now + self.ms(50, 1_500);
        self.input_at(
            at,
            None,
            shard,
            ShardInput::Message(Message::ToRun {
                run,
                op: RunOp::Input(input),
                reply: ReplyTo::Nobody,
            }),
        );
    }
}
