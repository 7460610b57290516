//! Activity workers and their supervisor: dispatch under leases, lease
//! expiry and redelivery, results and reports (mirrors
//! `keel_actors::shell::workers`).

use super::*;

impl World<'_> {
    pub(super) fn lease_ms(o: &ActivityOptions) -> u64 {
        [o.heartbeat_ms, o.start_to_close_ms, o.schedule_to_close_ms]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(LEASE_MS)
    }

    pub(super) fn attempt_key(task: &Task) -> (RunId, Step, AttemptNo) {
        (task.run, task.step, task.attempt)
    }

    pub(super) fn may_fault_attempt(&self, task: &Task) -> bool {
        self.attempt_faults
            .get(&Self::attempt_key(task))
            .copied()
            .unwrap_or(0)
            < ATTEMPT_FAULTS_MAX
    }

    /// Mirrors `Workers`' `Dispatch` handler.
    pub(super) fn dispatch(&mut self, task: Task) {
        if let Some(l) = self.engine.leases.get(&(task.run, task.step)) {
            if l.task.attempt >= task.attempt {
                return;
            }
        }
        self.launch(task, 1);
    }

    /// Mirrors `Workers::launch`: hands the attempt to a worker under a new
    /// lease epoch.
    pub(super) fn launch(&mut self, task: Task, deliveries: u32) {
        if let Some(name) = &task.options.profile {
            // The simulated engine registers no resilience profiles.
            let f = Failure::new(
                FailureKind::Application,
                format!("unknown resilience profile {name:?}"),
                false,
            );
            self.report(&task, Err(f));
            return;
        }
        self.next_epoch += 1;
        let epoch = self.next_epoch;
        let worker = self.rng.random_range(0..WORKERS);
        let lease_ms = Self::lease_ms(&task.options);
        let mut duration = self.ms(1, ACTIVITY_MS_MAX);
        let may_fault = self.may_fault_attempt(&task);
        if self.fault(FaultKind::LeaseExpiry) && may_fault {
            duration = lease_ms + self.ms(1, lease_ms);
            *self
                .attempt_faults
                .entry(Self::attempt_key(&task))
                .or_default() += 1;
            self.fired(FaultKind::LeaseExpiry);
        }
        self.log(format_args!(
            "dispatch {} step {} attempt {} epoch {epoch} to worker {worker} (delivery {deliveries})",
            self.name(task.run),
            task.step,
            task.attempt
        ));
        let inc = self.engine.inc;
        let life = self.workers[worker];
        self.at(
            self.now + duration,
            Ev::WorkerDone {
                worker,
                life,
                inc,
                task: task.clone(),
                epoch,
            },
        );
        self.at(
            self.now + lease_ms,
            Ev::LeaseCheck {
                inc,
                run: task.run,
                step: task.step,
                epoch,
            },
        );
        if self.fault(FaultKind::Redelivery) {
            // The transport hands the same attempt to a second worker the
            // supervisor does not track.
            let other = (worker + 1 + self.rng.random_range(0..WORKERS - 1)) % WORKERS;
            let d = self.ms(1, ACTIVITY_MS_MAX * 2);
            self.fired(FaultKind::Redelivery);
            let life = self.workers[other];
            self.at(
                self.now + d,
                Ev::WorkerDone {
                    worker: other,
                    life,
                    inc,
                    task: task.clone(),
                    epoch,
                },
            );
        }
        if self.fault(FaultKind::WorkerCrash) {
            let at = self.now + self.ms(0, duration);
            self.at(at, Ev::WorkerCrash { worker });
        }
        self.engine.leases.insert(
            (task.run, task.step),
            Lease {
                task,
                epoch,
                worker,
                expires_at: self.now + lease_ms,
                started_at: self.now,
                deliveries,
            },
        );
    }

    pub(super) fn worker_crash(&mut self, worker: usize) {
        let victims: Vec<Task> = self
            .engine
            .leases
            .values()
            .filter(|l| l.worker == worker)
            .map(|l| l.task.clone())
            .collect();
        if victims.iter().any(|t| !self.may_fault_attempt(t)) {
            self.log(format_args!(
                "worker {worker} crash suppressed (attempt fault budget)"
            ));
            return;
        }
        for t in &victims {
            *self.attempt_faults.entry(Self::attempt_key(t)).or_default() += 1;
        }
        self.workers[worker] += 1;
        self.fired(FaultKind::WorkerCrash);
    }

    pub(super) fn worker_done(
        &mut self,
        worker: usize,
        life: u32,
        inc: u32,
        task: Task,
        epoch: u64,
    ) {
        if self.workers[worker] != life {
            return; // the worker died with the attempt
        }
        let last_attempt = task
            .options
            .retry
            .as_ref()
            .is_none_or(|r| task.attempt.0 >= r.attempts_max);
        let injected = self.fault(FaultKind::ActivityFailure) && !last_attempt;
        let result = if injected {
            self.fired(FaultKind::ActivityFailure);
            Err(Failure::new(
                FailureKind::Application,
                "injected transient failure",
                true,
            ))
        } else {
            match self.setup.mocks.get(task.activity_type.as_str()) {
                Some(mock) => mock(&task.input, task.attempt),
                None => Err(Failure::new(
                    FailureKind::Application,
                    format!("unknown activity type {:?}", task.activity_type),
                    false,
                )),
            }
        };
        self.log(format_args!(
            "worker {worker} finishes {} step {} attempt {} epoch {epoch}: {}",
            self.name(task.run),
            task.step,
            task.attempt,
            if result.is_ok() { "ok" } else { "failed" }
        ));
        if inc != self.engine.inc || !self.engine.up {
            // The engine that leased it is gone; an out-of-process worker
            // may still report to whichever engine runs now.
            self.maybe_late(&task, result);
            return;
        }
        let at = self.now + self.ms(0, 1);
        self.at(
            at,
            Ev::AttemptDone {
                inc,
                task,
                epoch,
                result,
            },
        );
    }

    /// A result the supervisor will not report: with `late-result`, the
    /// stale holder reaches the run itself, late.
    pub(super) fn maybe_late(&mut self, task: &Task, result: Result<Payload, Failure>) {
        if !self.fault(FaultKind::LateResult) {
            return;
        }
        self.fired(FaultKind::LateResult);
        let input = self.result_input(task, result);
        let at = self.now + self.ms(50, 1_500);
        self.at(
            at,
            Ev::Arrive {
                inc: None,
                req: Request::Deliver {
                    run: task.run,
                    input,
                    origin: Origin::Ghost,
                },
            },
        );
    }

    pub(super) fn result_input(&mut self, task: &Task, result: Result<Payload, Failure>) -> Input {
        match result {
            Ok(result) => Input::ActivityCompleted {
                step: task.step,
                attempt: task.attempt,
                result,
            },
            Err(failure) => Input::ActivityFailed {
                step: task.step,
                attempt: task.attempt,
                failure,
                jitter: self.rng.next_u64(),
            },
        }
    }

    /// Mirrors `Workers`' `AttemptDone` handler: the first result of the
    /// current attempt wins, whichever epoch produced it.
    pub(super) fn attempt_done(
        &mut self,
        task: Task,
        epoch: u64,
        result: Result<Payload, Failure>,
    ) {
        let key = (task.run, task.step);
        match self.engine.leases.get(&key) {
            Some(l) if l.task.attempt == task.attempt => {
                self.engine.leases.remove(&key);
                self.report(&task, result);
            }
            _ => {
                self.log(format_args!(
                    "late result of {} step {} attempt {} epoch {epoch} dropped",
                    self.name(task.run),
                    task.step,
                    task.attempt
                ));
                self.maybe_late(&task, result);
            }
        }
    }

    /// Mirrors `Workers::sweep` for one lease.
    pub(super) fn lease_check(&mut self, run: RunId, step: Step, epoch: u64) {
        let key = (run, step);
        match self.engine.leases.get(&key) {
            Some(l) if l.epoch == epoch && l.expires_at <= self.now => {}
            _ => return,
        }
        let l = self.engine.leases.remove(&key).expect("checked above");
        let over_schedule = l
            .task
            .options
            .schedule_to_close_ms
            .is_some_and(|ms| self.now >= l.task.scheduled_at.0.saturating_add(ms));
        let over_time = l
            .task
            .options
            .start_to_close_ms
            .is_some_and(|ms| self.now >= l.started_at.saturating_add(ms));
        if over_schedule {
            let f = Failure::new(FailureKind::Timeout, "schedule-to-close timeout", false);
            self.report(&l.task, Err(f));
        } else if over_time {
            let f = Failure::new(FailureKind::Timeout, "start-to-close timeout", true);
            self.report(&l.task, Err(f));
        } else if l.deliveries <= LEASE_REDELIVERIES_MAX {
            self.log(format_args!(
                "lease of {} step {step} epoch {epoch} expired; redelivering",
                self.name(run)
            ));
            self.launch(l.task, l.deliveries + 1);
        } else {
            let f = Failure::new(
                FailureKind::LeaseExpired,
                format!("lease expired {} times", l.deliveries),
                true,
            );
            self.report(&l.task, Err(f));
        }
    }

    /// Mirrors `Workers::report`: the result goes to its run, retried until
    /// the run answers (the shell gives up after five tries; see the crate
    /// docs).
    pub(super) fn report(&mut self, task: &Task, result: Result<Payload, Failure>) {
        let input = self.result_input(task, result);
        if self.fault(FaultKind::DuplicateResult) {
            self.fired(FaultKind::DuplicateResult);
            let at = self.now + self.ms(0, 50);
            self.at(
                at,
                Ev::Arrive {
                    inc: None,
                    req: Request::Deliver {
                        run: task.run,
                        input: input.clone(),
                        origin: Origin::Ghost,
                    },
                },
            );
        }
        self.send_report(task.run, input, 0);
    }

    pub(super) fn send_report(&mut self, run: RunId, input: Input, tries: u32) {
        let delay = if tries == 0 {
            self.latency()
        } else {
            [10u64, 50, 200, 1_000][(tries as usize - 1).min(3)]
        };
        let inc = self.engine.inc;
        self.at(
            self.now + delay,
            Ev::Arrive {
                inc: Some(inc),
                req: Request::Deliver {
                    run,
                    input: input.clone(),
                    origin: Origin::Report {
                        run,
                        input: Box::new(input),
                        tries,
                    },
                },
            },
        );
    }
}
