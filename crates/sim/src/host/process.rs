//! The engine process: its start (shards recover their durable work from
//! the store, exactly as the actix engine's do), its crash (everything in
//! memory is lost, the store drops or tears its unsynced tail) and the
//! checks at the end of the liveness phase.

use std::collections::BTreeMap;

use keel_core::driver::{Shard, ShardId};
use keel_storage::history::pending_steps;
use keel_storage::{CrashMode, Event, EventKind, InstanceId, Outcome, RunFilter, RunId, Timestamp};
use rand::RngExt;

use super::{Ev, Process, World, WorldResult};
use crate::check::{self, Violation, ViolationKind};

impl World<'_> {
    /// Starts the engine process: shards with nothing in memory, each
    /// recovering the intents it owns.
    pub(super) fn boot(&mut self) {
        let inc = self.process.inc;
        // A restarted process has no async closures bound, and hands out
        // epochs above every earlier one.
        let workflows = self.setup.workflows.with_fresh_closures();
        let base = (u64::from(inc) + 1) << 40;
        let n = self.config.shards;
        self.process.shards = (0..n)
            .map(|i| Shard::new(ShardId(i), workflows.clone(), self.config.clone(), base))
            .collect();
        self.process.wakes = vec![None; usize::from(n)];
        let now = Timestamp(self.now);
        for s in &mut self.process.shards {
            s.recover(now);
        }
        self.log(format_args!("engine process {inc} starts with {n} shards"));
        self.report_store_health();
    }

    pub(super) fn engine_crash(&mut self) {
        if !self.process.up {
            return;
        }
        let keep = self.rng.random_range(0..=3usize);
        let mode = if self.rng.random_bool(0.5) {
            CrashMode::DropUnsynced
        } else {
            CrashMode::KeepUnsynced(keep)
        };
        self.crashes += 1;
        self.log(format_args!("engine crash ({mode:?})"));
        if let Err(e) = self.store.crash(mode) {
            self.checker.violations.push(Violation {
                kind: ViolationKind::AckedCommitLost,
                at_ms: self.now,
                detail: format!("the store did not reopen after the crash: {e}"),
            });
            return;
        }
        let inc = self.process.inc + 1;
        self.process = Process {
            up: false,
            inc,
            shards: Vec::new(),
            wakes: Vec::new(),
            group: Vec::new(),
            flush_scheduled: false,
            copies: BTreeMap::new(),
        };
        self.checker.after_crash(&self.store, self.now);
        let at = self.now + self.ms(5, 200);
        self.at(at, Ev::EngineRestart);
    }

    pub(super) fn engine_restart(&mut self) {
        self.process.up = true;
        self.boot();
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
            shards: self.config.shards,
            firings: std::mem::take(&mut self.firings),
        }
    }

    /// The liveness phase is over: every workflow finished, every final
    /// history replays to itself, nothing is parked, no work is left
    /// behind, the store verifies.
    fn final_checks(
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
        let mut all_closed = true;
        // Async children replay with the closures their parents bind when
        // they replay: parents first.
        let mut metas = metas;
        metas.sort_by_key(|m| m.workflow_type == keel_core::concurrency::ASYNC_WORKFLOW_TYPE);
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
                all_closed = false;
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
                        "{name} ({}) is still running after the faults stopped; open: [{}]",
                        meta.workflow_type,
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
        if all_closed {
            // Every run closed: every intent must have been consumed.
            let tasks = store.tasks(16).unwrap_or_default();
            let timers = store
                .due_timers(Timestamp(u64::MAX), 16)
                .unwrap_or_default();
            let outbox = store.outbox(16).unwrap_or_default();
            for t in tasks {
                push(
                    ViolationKind::IntentLeftOver,
                    format!("a pending attempt of a closed run: {:?}", t.execution_id),
                );
            }
            for t in timers {
                push(
                    ViolationKind::IntentLeftOver,
                    format!("a timer of a closed run: {} step {}", t.run_id, t.step),
                );
            }
            for m in outbox {
                push(
                    ViolationKind::IntentLeftOver,
                    format!("an outbox message nothing consumes: {m:?}"),
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
        self.checker.check_streams(histories, now);
        self.checker.check_schedules(histories, now);
        self.checker.check_timeouts(histories, now);
        self.checker.check_cancellation_types(histories, now);
    }
}
