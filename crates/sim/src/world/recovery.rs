//! Engine crash and restart (mirrors `Engine::recover`), and the checks at
//! the end of the liveness phase.

use super::*;

impl World<'_> {
    pub(super) fn engine_crash(&mut self) {
        if !self.engine.up {
            return;
        }
        let keep = self.rng.random_range(0..=3usize);
        let mode = if self.rng.random_bool(0.5) {
            CrashMode::DropUnsynced
        } else {
            CrashMode::KeepUnsynced(keep)
        };
        self.crashes += 1;
        self.fired(FaultKind::EngineCrash);
        self.log(format_args!("engine crash ({mode:?})"));
        if let Err(e) = self.store.crash(mode) {
            self.checker.violations.push(Violation {
                kind: ViolationKind::AckedCommitLost,
                at_ms: self.now,
                detail: format!("the store did not reopen after the crash: {e}"),
            });
            return;
        }
        let inc = self.engine.inc + 1;
        self.engine = Engine {
            up: false,
            inc,
            ..Engine::default()
        };
        self.checker.after_crash(&self.store, self.now);
        let at = self.now + self.ms(5, 200);
        self.at(at, Ev::EngineRestart);
    }

    /// Mirrors `Engine::recover`.
    pub(super) fn engine_restart(&mut self) {
        self.engine.up = true;
        let store = self.store.store();
        let timers = store
            .due_timers(Timestamp(u64::MAX), usize::MAX)
            .unwrap_or_default();
        let tasks = store.tasks(usize::MAX).unwrap_or_default();
        let outbox = store.outbox(usize::MAX).unwrap_or_default();
        let continued: Vec<(RunId, RunId)> = store
            .runs(&RunFilter {
                status: Some(RunStatus::ContinuedAsNew),
                ..RunFilter::default()
            })
            .unwrap_or_default()
            .into_iter()
            .filter_map(|m| match m.outcome {
                Some(Outcome::ContinuedAsNew(new)) => Some((m.run_id, new)),
                _ => None,
            })
            .filter(|(_, new)| matches!(store.run_meta(*new), Ok(None)))
            .collect();
        self.log(format_args!(
            "engine restart: {} timers, {} tasks, {} outbox, {} continuations",
            timers.len(),
            tasks.len(),
            outbox.len(),
            continued.len()
        ));
        for t in timers {
            self.arm(t.run_id, t.step, t.fire_at);
        }
        let inc = self.engine.inc;
        for t in tasks {
            let task = Task::from_entry(&t);
            if t.due.0 > self.now {
                self.at(t.due.0, Ev::TaskDue { inc, task });
            } else {
                self.dispatch(task);
            }
        }
        for msg in outbox {
            self.outbox(msg, false);
        }
        for (old, new) in continued {
            self.continue_run(old, new);
        }
    }

    // ----- the end ----------------------------------------------------

    pub(super) fn finish(mut self, steps: u64) -> WorldResult {
        let now = self.now;
        let mut outcomes = BTreeMap::new();
        let mut histories = BTreeMap::new();
        if !self.checker.failed() {
            self.checker.check_all(&self.store, now);
            self.final_checks(&mut outcomes, &mut histories);
        }
        let faults_fired = self.fired.clone();
        let violations = std::mem::take(&mut self.checker.violations);
        WorldResult {
            violations,
            outcomes,
            histories,
            trace_hash: self.trace.hash(),
            trace: self.trace.take_lines(),
            faults_fired,
            virtual_ms: now,
            steps,
            commits: self.commits,
            events: self.events,
            crashes: self.crashes,
            outbox_messages: self.outbox_messages,
        }
    }

    /// The liveness phase is over: every workflow finished, every final
    /// history replays to itself, nothing is parked, the store verifies.
    pub(super) fn final_checks(
        &mut self,
        outcomes: &mut BTreeMap<String, Outcome>,
        histories: &mut BTreeMap<RunId, Vec<Event>>,
    ) {
        let now = self.now;
        let mut found: Vec<Violation> = Vec::new();
        let mut push = |kind, detail: String| {
            found.push(Violation {
                kind,
                at_ms: now,
                detail,
            })
        };
        let store = self.store.store();
        let metas = match store.runs(&RunFilter::default()) {
            Ok(m) => m,
            Err(e) => {
                push(ViolationKind::VerifyFailed, format!("runs unreadable: {e}"));
                Vec::new()
            }
        };
        let mut chains: BTreeMap<String, u32> = BTreeMap::new();
        for meta in &metas {
            let run = meta.run_id;
            let name = self
                .names
                .get(&run)
                .cloned()
                .unwrap_or_else(|| run.to_string());
            let history = match store.history(run) {
                Ok(h) => h,
                Err(e) => {
                    push(
                        ViolationKind::VerifyFailed,
                        format!("{name}: history unreadable: {e}"),
                    );
                    continue;
                }
            };
            if let Some(EventKind::WorkflowStarted {
                continued_from: None,
                parent: None,
                ..
            }) = history.first().map(|e| &e.kind)
            {
                *chains.entry(meta.instance_id.to_string()).or_default() += 1;
            }
            if !meta.status.is_closed() {
                let pending: Vec<String> = pending_steps(&history)
                    .iter()
                    .map(|p| {
                        let sep = if p.name.is_empty() { "" } else { " " };
                        format!("{}{sep}{} at step {}", p.kind, p.name, p.step)
                    })
                    .collect();
                push(
                    ViolationKind::NotFinished,
                    format!(
                        "{name} is still running after the faults stopped; open: [{}]",
                        pending.join(", ")
                    ),
                );
            } else if let Err(e) = check::replay_check(self.setup.workflows, &history) {
                push(ViolationKind::ReplayMismatch, format!("{name}: {e}"));
            }
            if let Ok(Some(info)) = store.parked(run) {
                push(
                    ViolationKind::Parked,
                    format!("{name} is parked: {}", info.reason),
                );
            }
            histories.insert(run, history);
        }
        for (instance, n) in chains {
            if n > 1 {
                push(
                    ViolationKind::DuplicateRun,
                    format!("instance {instance} ran {n} independent runs"),
                );
            }
        }
        for p in self.setup.workload.plans() {
            let instance = InstanceId::new(p.instance.clone());
            let meta = store
                .instance(&instance)
                .ok()
                .flatten()
                .and_then(|i| store.run_meta(i.current_run).ok().flatten());
            let running = meta.as_ref().is_some_and(|m| !m.status.is_closed());
            match meta.and_then(|m| m.outcome) {
                // Reported above, with its open steps.
                None if running => {}
                Some(Outcome::ContinuedAsNew(next)) => push(
                    ViolationKind::NotFinished,
                    format!(
                        "{}: continued as new run {next}, which never started",
                        p.instance
                    ),
                ),
                Some(o) => {
                    outcomes.insert(p.instance.clone(), o);
                }
                None => push(
                    ViolationKind::NotFinished,
                    format!("{}: never started", p.instance),
                ),
            }
        }
        match store.verify() {
            Ok(r) if r.ok => {}
            Ok(r) => push(
                ViolationKind::VerifyFailed,
                format!(
                    "verify: {:?}",
                    r.violations.iter().take(3).collect::<Vec<_>>()
                ),
            ),
            Err(e) => push(ViolationKind::VerifyFailed, format!("verify failed: {e}")),
        }
        self.checker.violations.extend(found);
        self.checker.check_winners(histories, now);
    }
}
