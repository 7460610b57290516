//! The engine processes: their start (shards recover their durable work
//! from the store, exactly as the actix engine's do), their crash
//! (everything in memory is lost, the store drops or tears its unsynced
//! tail) and the checks at the end of the liveness phase.
//!
//! With several processes on one store, each takes shards under leases
//! (the driver's `shards_to_take` decides which, the store's lease rules
//! decide whether), and the faults are the ones a cluster meets: a process
//! frozen past its leases that wakes up and carries on with the actions
//! it had decided (its commits must be fenced), a process killed and
//! started again (its shards are taken over once their leases end), and a
//! take whose answer is lost (the process releases the lease it does not
//! know it holds at its next look).

use std::collections::{BTreeMap, BTreeSet};

use keel_core::driver::{
    leases_unheld, shards_taken_since, shards_to_release, shards_to_take, Shard, ShardId,
    ShardInput,
};
use keel_storage::history::pending_steps;
use keel_storage::{CrashMode, Event, EventKind, InstanceId, Outcome, RunFilter, RunId, Timestamp};
use rand::RngExt;

use super::{CopyId, Ev, Process, World, WorldResult, LOOK_MS, PAUSES_MAX};
use crate::check::{self, Violation, ViolationKind};
use crate::fault::FaultKind;

impl World<'_> {
    /// Starts engine process `p` as a new incarnation. Alone on the store,
    /// it runs every shard, each recovering the intents it owns; sharing
    /// it, it looks for shards to take.
    pub(super) fn boot(&mut self, p: usize) {
        self.last_inc += 1;
        let inc = self.last_inc;
        // A restarted process has no async closures bound, and hands out
        // epochs above every earlier one.
        let mut process = Process::down(inc, self.setup.workflows);
        process.up = true;
        process.name = format!("p{p}.{inc}");
        self.processes[p] = process;
        if self.shared() {
            let pname = self.processes[p].name.clone();
            self.log(format_args!("engine process {p} starts as {}", pname));
            self.look(p);
            return;
        }
        let base = u64::from(inc) << 40;
        let n = self.config.shards;
        let now = Timestamp(self.now);
        for i in 0..n {
            let workflows = self.processes[p].workflows.clone();
            let mut s = Shard::new(ShardId(i), workflows, self.config.clone(), base);
            s.recover(now);
            self.processes[p].shards.insert(ShardId(i), s);
        }
        self.log(format_args!("engine process {inc} starts with {n} shards"));
        self.report_store_health();
    }

    /// Process `p` reads the shard leases, takes the free and expired ones
    /// its share allows, and looks again later.
    pub(super) fn look(&mut self, p: usize) {
        let now = Timestamp(self.now);
        let name = self.processes[p].name.clone();
        let ttl = self.config.shard_lease_ms;
        if let Err(e) = self.store.leases().heartbeat_member(&name, now, ttl) {
            self.log(format_args!("{name} cannot say it is alive: {e}"));
        }
        let (leases, members) = match (
            self.store.leases().shard_leases(),
            self.store.leases().members(),
        ) {
            (Ok(l), Ok(m)) => (l, m),
            (Err(e), _) | (_, Err(e)) => {
                self.log(format_args!("{name} cannot read the leases: {e}"));
                (Vec::new(), Vec::new())
            }
        };
        // Shards a new owner took since the last look: this process's
        // shards deliver again, now, what they sent there and still wait
        // to hear of (it may have been lost with the owner before), as the
        // engine's member thread tells its shards.
        let taken = shards_taken_since(&leases, &mut self.processes[p].seen_epochs);
        let inc = self.processes[p].inc;
        let own: Vec<ShardId> = self.processes[p].shards.keys().copied().collect();
        for t in taken {
            for &s in own.iter().filter(|&&s| s != t) {
                self.pinned_at(
                    self.now,
                    inc,
                    s,
                    keel_core::driver::ShardInput::PeerTaken(t),
                );
            }
        }
        // A lease it holds without knowing (a take whose answer was lost):
        // given back, so the shard is taken again without waiting it out.
        let held: Vec<keel_storage::Fence> = self.processes[p]
            .shards
            .values()
            .filter_map(|s| s.lease().map(keel_storage::ShardLease::fence))
            .collect();
        for lease in leases_unheld(&leases, &name, &held, now) {
            self.log(format_args!(
                "{name} releases shard {} (epoch {}): no shard of it holds that lease",
                lease.shard, lease.epoch
            ));
            if let Err(e) = self.store.leases().release_shard_lease(lease, now) {
                self.log(format_args!(
                    "{name} cannot release shard {}: {e}",
                    lease.shard
                ));
            }
        }
        // More than its share while another process has less: give one
        // up (the shard stops, then its lease is released).
        for shard in shards_to_release(&leases, &members, self.config.shards, &name, now) {
            if let Some(s) = self.processes[p].shards.get_mut(&shard) {
                s.release();
                self.log(format_args!("{name} gives up {shard}"));
            }
        }
        for shard in shards_to_take(&leases, &members, self.config.shards, &name, now) {
            if self.processes[p].shards.contains_key(&shard) {
                continue; // a lost shard not dropped yet
            }
            let before = leases.iter().find(|l| l.shard == shard.0).cloned();
            let lease = match self.store.leases().take_shard_lease(
                shard.0,
                &name,
                now,
                self.config.shard_lease_ms,
            ) {
                Ok(l) => l,
                Err(e) => {
                    self.log(format_args!("{name} cannot take {shard}: {e}"));
                    continue;
                }
            };
            if self.fault(FaultKind::LeaseAnswerLost) {
                self.log(format_args!(
                    "{name} took {shard} at epoch {}, but the answer was lost",
                    lease.epoch
                ));
                continue;
            }
            if before.is_some() {
                self.takeovers += 1;
            }
            self.log(format_args!(
                "{name} takes {shard} at epoch {} (from {})",
                lease.epoch,
                before.map_or("nobody".to_string(), |l| l.owner)
            ));
            // Attempt epochs above every earlier owner's of the shard.
            let base = lease.epoch << 40;
            let workflows = self.processes[p].workflows.clone();
            let mut s = Shard::new(shard, workflows, self.config.clone(), base);
            s.hold(lease);
            s.recover(now);
            let health = self.store_health();
            if !health.is_healthy() {
                s.handle(now, keel_core::driver::ShardInput::StoreHealth(health));
            }
            self.processes[p].shards.insert(shard, s);
        }
        let inc = self.processes[p].inc;
        self.at(self.now + LOOK_MS, Ev::Look { p, inc });
    }

    /// Freezes process `p` past its leases: nothing of it runs until it
    /// wakes, then it performs what it had decided before, `action` first.
    pub(super) fn pause(&mut self, p: usize, shard: ShardId, action: keel_core::driver::Action) {
        self.pauses += 1;
        let lease = self.config.shard_lease_ms;
        let until = self.now + lease + self.ms(1, lease);
        self.processes[p].paused_until = Some(until);
        self.processes[p].stash.push_back((shard, action));
        let inc = self.processes[p].inc;
        let pname = self.processes[p].name.clone();
        self.log(format_args!(
            "process {p} ({}) freezes until {until} ms",
            pname
        ));
        self.at(until, Ev::ProcessWake { p, inc });
    }

    pub(super) fn may_pause(&self) -> bool {
        self.shared() && self.pauses < PAUSES_MAX
    }

    pub(super) fn process_wake(&mut self, p: usize, inc: u32) {
        if self.live(inc) != Some(p) {
            return;
        }
        self.processes[p].paused_until = None;
        let pname = self.processes[p].name.clone();
        self.log(format_args!("process {p} ({}) wakes up", pname));
        while let Some((shard, action)) = self.processes[p].stash.pop_front() {
            if !self.running(p) {
                break;
            }
            self.perform(p, shard, action);
        }
        // What the store did while it was frozen.
        self.report_store_health();
    }

    /// One process of several dies; it starts again later.
    pub(super) fn process_kill(&mut self, p: usize) {
        if !self.processes[p].up {
            return;
        }
        self.crashes += 1;
        let inc = self.processes[p].inc;
        let pname = self.processes[p].name.clone();
        self.log(format_args!("process {p} ({}) is killed", pname));
        // Copies it took from other processes' shards die with it; each
        // shard's process sees its membership end and delivers them again.
        let taken: Vec<CopyId> = self.processes[p]
            .copies
            .keys()
            .filter(|c| c.runner == inc && c.inc != inc)
            .copied()
            .collect();
        let lease = self.config.shard_lease_ms;
        for c in taken {
            self.copies_lost += 1;
            let at = self.now + self.ms(lease / 2, lease);
            self.pinned_at(
                at,
                c.inc,
                c.shard,
                ShardInput::CopyLost {
                    key: c.key,
                    epoch: c.epoch,
                },
            );
        }
        self.processes[p] = Process::down(inc, self.setup.workflows);
        let lease = self.config.shard_lease_ms;
        let at = self.now + self.ms(lease / 2, lease * 2);
        self.at(at, Ev::ProcessRestart { p });
    }

    pub(super) fn process_restart(&mut self, p: usize) {
        if !self.processes[p].up {
            self.boot(p);
        }
    }

    /// The whole machine crashes: every process dies, and the store drops
    /// or tears its unsynced tail.
    pub(super) fn engine_crash(&mut self) {
        if !self.processes.iter().any(|p| p.up) {
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
        for p in 0..self.processes.len() {
            let inc = self.processes[p].inc;
            self.processes[p] = Process::down(inc, self.setup.workflows);
        }
        self.checker.after_crash(&self.store, self.now);
        let at = self.now + self.ms(5, 200);
        self.at(at, Ev::EngineRestart);
    }

    pub(super) fn engine_restart(&mut self) {
        for p in 0..self.processes.len() {
            if !self.processes[p].up {
                self.boot(p);
            }
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
            shards: self.config.shards,
            takeovers: self.takeovers,
            fenced: self.fenced,
            released: self.released,
            copies_lost: self.copies_lost,
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
            if matches!(history.first().map(|e| &e.kind),
                Some(EventKind::WorkflowStarted(start))
                    if start.continued_from.is_none() && start.parent.is_none())
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
        // A process forgets the closure of each async child it saw close:
        // one kept is memory that grows with the work done.
        let closed: BTreeSet<RunId> = metas
            .iter()
            .filter(|m| m.status.is_closed())
            .map(|m| m.run_id)
            .collect();
        for p in self.processes.iter().filter(|p| p.up) {
            for child in p.workflows.async_bound_runs() {
                if closed.contains(&child) {
                    let name = self.names.get(&child).cloned();
                    push(
                        ViolationKind::ClosureLeftOver,
                        format!(
                            "process {} still holds the closure of closed async child {}",
                            p.inc,
                            name.unwrap_or_else(|| child.to_string())
                        ),
                    );
                }
            }
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
