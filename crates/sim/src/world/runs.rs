//! The run actor and the commit path: activation by replay, the duplicate
//! check, the machine, the commit, the group sync, and the effects after
//! it; closes, continuations and the outbox.

use super::*;

impl World<'_> {
    pub(super) fn arrive(&mut self, req: Request) {
        match req {
            Request::Client { plan, op, try_no } => self.client_request(plan, op, try_no),
            Request::Stray { plan, cancel } => self.stray(plan, cancel),
            Request::Deliver { run, input, origin } => self.deliver(run, input, origin),
        }
    }

    /// The answer to a delivery reaches whoever waits for it.
    pub(super) fn respond(&mut self, origin: Origin, answer: Answer) {
        match origin {
            Origin::Client { .. }
                if !self.engine.group.is_empty()
                    && match answer {
                        // A verdict of the run's machine, which runs ahead
                        // of the log while its commits are in flight. The
                        // shell answers it at once (`--break
                        // early-duplicate-answer`).
                        Answer::Dropped(_) => !self.breaks(BreakMode::EarlyDuplicateAnswer),
                        // Read from the store, which on RocksDB shows only
                        // synced data; the in-memory store shows its
                        // unsynced tail too, so wait for the sync.
                        Answer::Existing(_) | Answer::AlreadyClosed => true,
                        _ => false,
                    } =>
            {
                // Answer after the sync, so that a crash before it cannot
                // leave the client told "done" about something lost.
                self.engine.deferred.push((origin, answer));
            }
            Origin::Client { plan, op, try_no } => {
                let at = self.now + self.ms(0, 2);
                self.at(
                    at,
                    Ev::ClientReply {
                        plan,
                        op,
                        try_no,
                        answer,
                    },
                );
            }
            Origin::Timer { run, step } => {
                if let Answer::Failed(why) = answer {
                    if self.breaks(BreakMode::DropFailedTimer) {
                        // What the shell's timer service does today: the
                        // fire is gone until the next engine start.
                        self.log(format_args!(
                            "timer {} step {step} dropped: {why}",
                            self.name(run)
                        ));
                    } else {
                        let inc = self.engine.inc;
                        self.at(self.now + 10, Ev::TimerFire { inc, run, step });
                    }
                }
            }
            Origin::Report { run, input, tries } => {
                if let Answer::Failed(_) = answer {
                    self.send_report(run, *input, tries + 1);
                }
            }
            Origin::Ghost => {}
            Origin::Continue { old, new } => {
                if let Answer::Failed(_) = answer {
                    if !matches!(self.store.store().run_meta(new), Ok(Some(_))) {
                        let inc = self.engine.inc;
                        self.at(self.now + 10, Ev::Continue { inc, old, new });
                    }
                }
            }
            Origin::Outbox(msg) => self.outbox_answered(*msg, answer),
        }
    }

    /// Mirrors `RunActor::activate`: rebuilds the machine by replay.
    pub(super) fn activate(&mut self, run: RunId) -> Result<(), Answer> {
        let slot = self.engine.runs.entry(run).or_default();
        if slot.machine.is_some() {
            return Ok(());
        }
        if slot.parked.is_some() {
            return Err(Answer::Parked);
        }
        let history = match self.store.store().history(run) {
            Ok(h) => h,
            Err(e) => return Err(Answer::Failed(e.to_string())),
        };
        if history.is_empty() {
            return Err(Answer::Dropped(Verdict::Unknown(format!("no run {run}"))));
        }
        let n = history.len();
        match RunMachine::replay(self.setup.workflows, history) {
            Ok(m) => {
                self.log(format_args!("replay {} ({n} events)", self.name(run)));
                let slot = self.engine.runs.entry(run).or_default();
                slot.restarts = 0;
                slot.machine = Some(m);
                Ok(())
            }
            Err(e) => {
                self.park(run, &e);
                Err(Answer::Parked)
            }
        }
    }

    pub(super) fn park(&mut self, run: RunId, err: &MachineError) {
        let reason = err.to_string();
        self.log(format_args!("park {}: {reason}", self.name(run)));
        self.checker.violations.push(Violation {
            kind: ViolationKind::Parked,
            at_ms: self.now,
            detail: format!("run {} ({}) parked: {reason}", self.name(run), run),
        });
        let info = ParkInfo {
            at: Timestamp(self.now),
            kind: err.kind().to_string(),
            reason: reason.clone(),
        };
        let _ = self.store.commit(CommitBatch {
            appends: Vec::new(),
            parked: vec![(run, Some(info))],
        });
        let slot = self.engine.runs.entry(run).or_default();
        slot.machine = None;
        slot.parked = Some(reason);
    }

    /// Mirrors `RunActor`'s `Deliver` handler (commit path steps 1 to 4).
    pub(super) fn deliver(&mut self, run: RunId, input: Input, origin: Origin) {
        if let Err(answer) = self.activate(run) {
            self.respond(origin, answer);
            return;
        }
        let now = Timestamp(self.now);
        let skip_check = self.breaks(BreakMode::NoAttemptDedupe);
        let name = self.name(run);
        let what = input_name(&input);
        let machine = self
            .engine
            .runs
            .get_mut(&run)
            .and_then(|s| s.machine.as_mut())
            .expect("activated");
        let verdict = if skip_check {
            Verdict::Accept
        } else {
            machine.check(&input)
        };
        if verdict != Verdict::Accept {
            let attempt = check::attempt_of(&input);
            self.log(format_args!(
                "{name} drops {what} (attempt {attempt:?}): {verdict:?}"
            ));
            let unsynced = !self.engine.group.is_empty();
            self.respond(origin, Answer::Dropped(verdict));
            // A crash right after a verdict that rests on commits still in
            // flight: the window in which "already done" may be untrue.
            if unsynced && self.fault(FaultKind::EngineCrash) && self.crashes < CRASHES_MAX {
                self.at(self.now, Ev::EngineCrash);
            }
            return;
        }
        match machine.handle(input, now) {
            Ok(events) => {
                self.log(format_args!(
                    "{name} handles {what} -> {} events",
                    events.len()
                ));
                self.commit(run, events, origin, false);
            }
            Err(e) => {
                self.park(run, &e);
                self.respond(origin, Answer::Parked);
            }
        }
    }

    /// Mirrors `RunActor`'s `Create` handler: start a run and commit its
    /// first batch.
    pub(super) fn create(&mut self, spec: StartSpec, origin: Origin) {
        let run = spec.run_id;
        match RunMachine::start(self.setup.workflows, spec, Timestamp(self.now)) {
            Ok((machine, events)) => {
                self.log(format_args!(
                    "create {} -> {} events",
                    self.name(run),
                    events.len()
                ));
                self.engine.runs.entry(run).or_default().machine = Some(machine);
                self.commit(run, events, origin, true);
            }
            Err(e) => {
                self.log(format_args!("create {} refused: {e}", self.name(run)));
                self.respond(origin, Answer::Refused(e.to_string()));
            }
        }
    }

    /// Commit path step 4: write the batch; the group commit acknowledges
    /// it once synced.
    pub(super) fn commit(&mut self, run: RunId, events: Vec<Event>, origin: Origin, start: bool) {
        let effects_ran = self.breaks(BreakMode::EffectBeforeCommit);
        if effects_ran {
            self.effects(run, &events);
        }
        if self.fault(FaultKind::CommitFailure) {
            let n = self.rng.random_range(1..=3);
            self.fired(FaultKind::CommitFailure);
            self.store.fail_next_commits(n);
        }
        match self.store.commit(CommitBatch::append(run, events.clone())) {
            Ok(_) => {
                self.commits += 1;
                self.events += events.len() as u64;
                self.checker.touch(run);
                let (first, last) = (events[0].seq, events[events.len() - 1].seq);
                self.log(format_args!(
                    "commit {} seq {first}..{last} written",
                    self.name(run)
                ));
                let pending = Pending {
                    run,
                    events,
                    origin,
                    start,
                    effects_ran,
                };
                if self.breaks(BreakMode::LoseUnsyncedAck) {
                    // Acknowledged before the sync that makes it durable.
                    self.ack(pending);
                } else {
                    self.engine.group.push(pending);
                }
                if !self.engine.flush_scheduled {
                    self.engine.flush_scheduled = true;
                    let sync_ms = if self.rng.random_bool(0.1) {
                        self.ms(5, SLOW_SYNC_MS_MAX)
                    } else {
                        self.ms(0, SYNC_MS_MAX)
                    };
                    let at = self.now + sync_ms;
                    let inc = self.engine.inc;
                    self.at(at, Ev::Flush { inc });
                }
                if self.fault(FaultKind::EngineCrash) && self.crashes < CRASHES_MAX {
                    let at = self.now + self.ms(0, SYNC_MS_MAX + 1);
                    self.at(at, Ev::EngineCrash);
                }
            }
            Err(e) => {
                // Thrown away: the next input replays from the log.
                if let Some(slot) = self.engine.runs.get_mut(&run) {
                    slot.machine = None;
                }
                if start {
                    self.engine.runs.remove(&run);
                }
                self.log(format_args!("commit {} failed: {e}", self.name(run)));
                let answer = match e {
                    StoreError::InstanceRunning { run: existing, .. } => Answer::Existing(existing),
                    StoreError::CommitFailed(why) => Answer::Failed(why),
                    // A start of a run that exists already (a redelivered
                    // child start): nothing was written.
                    StoreError::SeqGap { .. } | StoreError::RunClosed { .. } if start => {
                        Answer::Failed(format!("run exists already: {e}"))
                    }
                    other => {
                        if self.setup.breaks.is_none() {
                            self.checker.violations.push(Violation {
                                kind: ViolationKind::CommitRefused,
                                at_ms: self.now,
                                detail: format!(
                                    "the store refused a commit of {} the engine believed valid: {other}",
                                    self.name(run)
                                ),
                            });
                        }
                        Answer::Failed(other.to_string())
                    }
                };
                self.respond(origin, answer);
            }
        }
    }

    /// The group commit: one sync, then every waiting commit is
    /// acknowledged in order.
    pub(super) fn flush(&mut self) {
        self.engine.flush_scheduled = false;
        if let Err(e) = self.store.sync() {
            self.log(format_args!("sync failed: {e}"));
            return;
        }
        let group = std::mem::take(&mut self.engine.group);
        if !group.is_empty() {
            self.log(format_args!(
                "group sync acknowledges {} commits",
                group.len()
            ));
        }
        for p in group {
            self.ack(p);
        }
        for (origin, answer) in std::mem::take(&mut self.engine.deferred) {
            self.respond(origin, answer);
        }
    }

    /// Commit path step 5, after the commit returned: effects, the answer,
    /// and the close of a finished run (mirrors `RunActor::after_commit`).
    pub(super) fn ack(&mut self, p: Pending) {
        self.checker.durable(p.run, &p.events, self.now);
        if !p.effects_ran {
            self.effects(p.run, &p.events);
        }
        if let Origin::Client { .. } = p.origin {
            self.checker.effect(
                &self.store,
                p.run,
                &p.events[0],
                "answer to the client",
                self.now,
            );
        }
        let closing = p.events.iter().find(|e| e.kind.closes_run()).cloned();
        let answer = if p.start {
            Answer::Started(p.run)
        } else {
            Answer::Committed
        };
        self.respond(p.origin, answer);
        if let Some(close) = closing {
            self.log(format_args!(
                "{} closed: {}",
                self.name(p.run),
                close.kind.name()
            ));
            self.engine.runs.remove(&p.run);
            self.run_closed(p.run, &close);
        }
    }

    /// Mirrors `Shared::run_closed`: close policies for open children, the
    /// outcome to a parent (through the outbox record the close wrote), or
    /// the start of a continuation.
    pub(super) fn run_closed(&mut self, run: RunId, close: &Event) {
        self.checker
            .effect(&self.store, run, close, "close effects", self.now);
        self.apply_close_policies(run);
        let meta = self.store.store().run_meta(run).ok().flatten();
        if let Some((parent, outcome)) = meta.and_then(|m| m.parent.zip(m.outcome)) {
            let msg = OutboxMessage::ChildResult {
                parent,
                child_run_id: run,
                outcome,
            };
            self.outbox(msg, false);
        } else if let EventKind::WorkflowContinuedAsNew { new_run_id, .. } = close.kind {
            let name = format!("{}+", self.name(run));
            self.names.insert(new_run_id, name);
            self.continue_run(run, new_run_id);
        }
    }

    /// Mirrors `Shared::apply_close_policies`.
    pub(super) fn apply_close_policies(&mut self, run: RunId) {
        let Ok(history) = self.store.store().history(run) else {
            return;
        };
        for pending in pending_steps(&history)
            .into_iter()
            .filter(|p| p.kind == "child")
        {
            let policy = history.iter().find_map(|e| match &e.kind {
                EventKind::ChildScheduled {
                    step, close_policy, ..
                } if *step == pending.step => Some(*close_policy),
                _ => None,
            });
            let Some(child) = pending.child_run else {
                continue;
            };
            let reason = format!("parent {run} closed");
            let input = match policy {
                Some(ParentClosePolicy::Terminate) => Input::Terminate { reason },
                Some(ParentClosePolicy::RequestCancel) => Input::CancelRequested {
                    reason,
                    command_id: None,
                },
                _ => continue,
            };
            self.deliver(child, input, Origin::Ghost);
        }
    }

    /// Mirrors `Shared::effects`.
    pub(super) fn effects(&mut self, run: RunId, events: &[Event]) {
        for e in events {
            match &e.kind {
                EventKind::ActivityScheduled {
                    step,
                    activity_type,
                    input,
                    options,
                    ..
                } => {
                    self.checker
                        .effect(&self.store, run, e, "dispatch", self.now);
                    let task = Task {
                        run,
                        step: *step,
                        attempt: AttemptNo::FIRST,
                        activity_type: activity_type.clone(),
                        input: input.clone(),
                        options: options.clone(),
                        scheduled_at: e.at,
                    };
                    let inc = self.engine.inc;
                    let at = self.now + self.ms(0, 1);
                    self.at(at, Ev::Dispatch { inc, task });
                }
                EventKind::ActivityAttemptFailed {
                    step,
                    retry_at: Some(due),
                    ..
                } => {
                    self.checker
                        .effect(&self.store, run, e, "schedule a retry", self.now);
                    if let Ok(Some(t)) = self.store.store().task(run, *step) {
                        let inc = self.engine.inc;
                        self.at(
                            due.0,
                            Ev::TaskDue {
                                inc,
                                task: Task::from_entry(&t),
                            },
                        );
                    }
                }
                EventKind::ActivityCancelRequested { step, .. } => {
                    self.checker
                        .effect(&self.store, run, e, "cancel an attempt", self.now);
                    self.log(format_args!(
                        "cancel attempt {} step {step}",
                        self.name(run)
                    ));
                }
                EventKind::TimerStarted { step, fire_at, .. } => {
                    self.checker
                        .effect(&self.store, run, e, "arm a timer", self.now);
                    self.arm(run, *step, *fire_at);
                }
                EventKind::ChildScheduled {
                    step,
                    child_instance_id,
                    child_run_id,
                    workflow_type,
                    input,
                    close_policy,
                    ..
                } => {
                    self.checker
                        .effect(&self.store, run, e, "start a child", self.now);
                    if let Ok(Some(meta)) = self.store.store().run_meta(run) {
                        let msg = OutboxMessage::StartChild {
                            parent: keel_storage::ParentRef {
                                instance_id: meta.instance_id,
                                run_id: run,
                                step: *step,
                                close_policy: *close_policy,
                            },
                            child_instance_id: child_instance_id.clone(),
                            child_run_id: *child_run_id,
                            workflow_type: workflow_type.clone(),
                            input: input.clone(),
                        };
                        self.outbox(msg, false);
                    }
                }
                _ => {}
            }
        }
    }

    pub(super) fn arm(&mut self, run: RunId, step: Step, fire_at: Timestamp) {
        let mut at = fire_at.0;
        if self.fault(FaultKind::TimerSkew) {
            at += self.ms(1, 800);
            self.fired(FaultKind::TimerSkew);
        }
        let inc = self.engine.inc;
        self.at(at, Ev::TimerFire { inc, run, step });
    }

    /// Mirrors `Shared::continue_run`: starts the next run of a chain.
    pub(super) fn continue_run(&mut self, old: RunId, new: RunId) {
        let Ok(history) = self.store.store().history(old) else {
            return;
        };
        let Some(EventKind::WorkflowStarted {
            instance_id,
            random_seed,
            ..
        }) = history.first().map(|e| &e.kind)
        else {
            return;
        };
        // The shell draws a fresh seed here; deriving it from the chain
        // keeps the outcome comparable with the fault-free run.
        let seed = random_seed.rotate_left(1) ^ 0x9E37_79B9_7F4A_7C15;
        let name = format!("{}+", instance_id.as_str());
        let Some(spec) = StartSpec::continuation(&history, new, seed) else {
            return;
        };
        self.names.entry(new).or_insert(name);
        self.create(spec, Origin::Continue { old, new });
    }

    // ----- the outbox -------------------------------------------------

    /// Delivers an outbox message at least once (mirrors
    /// `Shared::start_child` and `Shared::deliver_child_result`).
    pub(super) fn outbox(&mut self, msg: OutboxMessage, redelivery: bool) {
        self.outbox_messages += 1;
        if !redelivery && self.fault(FaultKind::OutboxRedelivery) {
            self.fired(FaultKind::OutboxRedelivery);
            let at = self.now + self.ms(1, 500);
            let inc = self.engine.inc;
            self.at(
                at,
                Ev::Outbox {
                    inc,
                    msg: Box::new(msg.clone()),
                },
            );
        }
        match &msg {
            OutboxMessage::StartChild {
                parent,
                child_instance_id,
                child_run_id,
                workflow_type,
                input,
            } => {
                let name = format!("{}/c{}", self.name(parent.run_id), parent.step);
                self.names.entry(*child_run_id).or_insert(name);
                let spec = StartSpec {
                    run_id: *child_run_id,
                    instance_id: child_instance_id.clone(),
                    workflow_type: workflow_type.clone(),
                    input: input.clone(),
                    command_id: None,
                    parent: Some(parent.clone()),
                    continued_from: None,
                    random_seed: fnv1a(0, child_run_id.as_bytes()),
                };
                self.create(spec, Origin::Outbox(Box::new(msg)));
            }
            OutboxMessage::ChildResult {
                parent,
                child_run_id,
                outcome,
            } => {
                let Some(input) = child_input(parent.step, *child_run_id, outcome.clone()) else {
                    return;
                };
                let run = parent.run_id;
                self.deliver(run, input, Origin::Outbox(Box::new(msg)));
            }
        }
    }

    pub(super) fn outbox_answered(&mut self, msg: OutboxMessage, answer: Answer) {
        match (&msg, answer) {
            (
                OutboxMessage::StartChild {
                    parent,
                    child_run_id,
                    ..
                },
                answer,
            ) => {
                let started = Input::ChildStarted {
                    step: parent.step,
                    child_run_id: *child_run_id,
                };
                let input = match answer {
                    Answer::Started(_) | Answer::Existing(_) => started,
                    // The start is idempotent: a child that exists has
                    // started (a redelivery), and a start whose commit
                    // failed is tried again. The shell instead reports any
                    // failed start to the parent as a failed child
                    // (`--break fail-child-on-start-error`).
                    Answer::Failed(_) if !self.breaks(BreakMode::FailChildOnStartError) => {
                        if matches!(self.store.store().run_meta(*child_run_id), Ok(Some(_))) {
                            started
                        } else {
                            let inc = self.engine.inc;
                            self.at(
                                self.now + 10,
                                Ev::Outbox {
                                    inc,
                                    msg: Box::new(msg),
                                },
                            );
                            return;
                        }
                    }
                    other => Input::ChildFailed {
                        step: parent.step,
                        child_run_id: *child_run_id,
                        failure: Failure::new(
                            FailureKind::Application,
                            format!("child did not start: {other:?}"),
                            false,
                        ),
                    },
                };
                let run = parent.run_id;
                self.deliver(run, input, Origin::Ghost);
            }
            (OutboxMessage::ChildResult { .. }, Answer::Failed(_)) => {
                let inc = self.engine.inc;
                self.at(
                    self.now + 10,
                    Ev::Outbox {
                        inc,
                        msg: Box::new(msg),
                    },
                );
            }
            (OutboxMessage::ChildResult { .. }, _) => {}
        }
    }
}

fn input_name(input: &Input) -> &'static str {
    match input {
        Input::ActivityCompleted { .. } => "ActivityCompleted",
        Input::ActivityFailed { .. } => "ActivityFailed",
        Input::ActivityCancelled { .. } => "ActivityCancelled",
        Input::TimerFired { .. } => "TimerFired",
        Input::ChildStarted { .. } => "ChildStarted",
        Input::ChildCompleted { .. } => "ChildCompleted",
        Input::ChildFailed { .. } => "ChildFailed",
        Input::Signal { .. } => "Signal",
        Input::CancelRequested { .. } => "CancelRequested",
        Input::Terminate { .. } => "Terminate",
    }
}

/// The parent's input for a child's outcome (mirrors
/// `Shared::deliver_child_result`).
fn child_input(step: Step, child: RunId, outcome: Outcome) -> Option<Input> {
    Some(match outcome {
        Outcome::Completed(result) => Input::ChildCompleted {
            step,
            child_run_id: child,
            result,
        },
        Outcome::Failed(failure) => Input::ChildFailed {
            step,
            child_run_id: child,
            failure,
        },
        Outcome::Cancelled(r) => Input::ChildFailed {
            step,
            child_run_id: child,
            failure: Failure::new(FailureKind::Cancelled, r, false),
        },
        Outcome::Terminated(r) => Input::ChildFailed {
            step,
            child_run_id: child,
            failure: Failure::new(FailureKind::Terminated, r, false),
        },
        Outcome::ContinuedAsNew(_) => return None,
    })
}
