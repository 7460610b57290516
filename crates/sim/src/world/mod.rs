//! One simulated execution: the engine shell rebuilt on virtual time around
//! the real run machine and the real store validation.
//!
//! It mirrors `keel_actors::shell` step by step (DESIGN section 3): an input
//! reaches a run; the run is activated by replay if it is not in memory;
//! the input is checked against durable ids (`RunMachine::check`) and
//! dropped if it is a duplicate; the machine handles it and returns events;
//! the events are written to the store (`Store::commit`, the shared
//! validation in `keel_storage::derive`); the group commit syncs and only
//! then acknowledges, and only after the acknowledgement do effects run
//! (dispatch attempts under leases, arm timers, schedule retries as tasks
//! with a `due`, start children through the outbox, answer clients; on a
//! close, apply parent close policies and hand the outcome to the parent
//! or the continuation). A failed commit throws the machine away. A crash
//! drops every in-memory structure; restart re-arms timers, tasks, the
//! outbox and continue-as-new hand-offs from the store exactly as
//! `Engine::recover` does, and runs are replayed when next needed. Where
//! the model departs from the shell, the crate docs say so and a
//! `BreakMode` runs the shell's behavior.
//!
//! Everything runs on one thread, in virtual time: an event queue ordered by
//! (time, insertion), one `ChaCha8Rng` for every decision, `BTreeMap`s for
//! everything iterated.

use std::collections::BTreeMap;
use std::sync::Arc;

use keel_actors::shell::LEASE_REDELIVERIES_MAX;
use keel_actors::{Input, MachineError, RunMachine, StartSpec, Verdict, WorkflowRegistry};
use keel_storage::history::pending_steps;
use keel_storage::{
    ActivityOptions, AttemptNo, CommandId, CommitBatch, CrashMode, Error as StoreError, Event,
    EventKind, Failure, FailureKind, InstanceId, OutboxMessage, Outcome, ParentClosePolicy,
    ParkInfo, Payload, RunFilter, RunId, RunStatus, Step, TaskEntry, Timestamp,
};
use rand::{Rng, RngExt};
use rand_chacha::ChaCha8Rng;

use crate::check::{self, Checker, Violation, ViolationKind};
use crate::fault::{FaultKind, FaultPlan};
use crate::sim::BreakMode;
use crate::store::SimStore;
use crate::trace::{fnv1a, Trace};
use crate::workload::{ClientOpKind, Workload};

/// A mock activity body: input and attempt number in, result out.
pub(crate) type Mock = Arc<dyn Fn(&Payload, AttemptNo) -> Result<Payload, Failure> + Send + Sync>;

/// Simulated activity workers.
const WORKERS: usize = 4;
/// The lease of an attempt without a timeout of its own (the shell's
/// default is a minute; a second keeps simulated expiries cheap).
const LEASE_MS: u64 = 1_000;
/// How long an activity normally takes.
const ACTIVITY_MS_MAX: u64 = 40;
/// How long a client waits for an answer before it sends again.
const CLIENT_TIMEOUT_MS_MAX: u64 = 300;
/// The group commit's sync normally takes up to this long...
const SYNC_MS_MAX: u64 = 2;
/// ...and now and then (a slow disk) up to this long, which widens the
/// window in which the machines are ahead of what is durable.
const SLOW_SYNC_MS_MAX: u64 = 100;
/// Sends of one client request before the client gives up.
const CLIENT_TRIES_MAX: u32 = 200;
/// Engine crashes per seed at most (each restart replays everything).
const CRASHES_MAX: u32 = 8;
/// Faults stop this long after the workload's last planned request.
const FAULT_TAIL_MS: u64 = 1_500;
/// Virtual time the liveness phase may take after faults stop.
const LIVENESS_MS: u64 = 600_000;
/// A jump in virtual time at least this long makes the loop check whether
/// everything is done.
const QUIET_GAP_MS: u64 = 10_000;
/// Steps one seed may take at most.
const STEPS_MAX: u64 = 2_000_000;
/// Lease-affecting faults (expiry, worker crash) one attempt may suffer:
/// below the redelivery bound, so faults never turn into a lease failure
/// that would change the workflow's outcome.
const ATTEMPT_FAULTS_MAX: u32 = LEASE_REDELIVERIES_MAX - 1;

/// Which client request: the start, or planned op `i`.
type OpRef = Option<usize>;

#[derive(Clone, Debug)]
struct Task {
    run: RunId,
    step: Step,
    attempt: AttemptNo,
    activity_type: String,
    input: Payload,
    options: ActivityOptions,
    scheduled_at: Timestamp,
}

impl Task {
    fn from_entry(t: &TaskEntry) -> Self {
        Task {
            run: t.execution_id.run_id,
            step: t.execution_id.step,
            attempt: t.attempt,
            activity_type: t.activity_type.clone(),
            input: t.input.clone(),
            options: t.options.clone(),
            scheduled_at: t.scheduled_at,
        }
    }
}

/// Who waits for the answer to a delivery, and what it does with it.
#[derive(Clone, Debug)]
enum Origin {
    Client {
        plan: usize,
        op: OpRef,
        try_no: u32,
    },
    Timer {
        run: RunId,
        step: Step,
    },
    Report {
        run: RunId,
        input: Box<Input>,
        tries: u32,
    },
    /// A delivery nobody retries (a duplicate, a stale holder, a stray).
    Ghost,
    Continue {
        old: RunId,
        new: RunId,
    },
    Outbox(Box<OutboxMessage>),
}

#[derive(Clone, Debug)]
enum Request {
    Client {
        plan: usize,
        op: OpRef,
        try_no: u32,
    },
    Stray {
        plan: usize,
        cancel: bool,
    },
    Deliver {
        run: RunId,
        input: Input,
        origin: Origin,
    },
}

/// The answer to a delivery. The payloads are read through `Debug`, in the
/// trace.
#[allow(dead_code)]
#[derive(Clone, Debug)]
enum Answer {
    Committed,
    Started(RunId),
    Existing(RunId),
    AlreadyClosed,
    Dropped(Verdict),
    /// Nothing was written; trying again may succeed.
    Failed(String),
    /// The machine refused the start (unknown type, bad input): final.
    Refused(String),
    Parked,
}

#[derive(Debug)]
enum Ev {
    ClientSend {
        plan: usize,
        op: OpRef,
        try_no: u32,
    },
    ClientTimeout {
        plan: usize,
        op: OpRef,
        try_no: u32,
    },
    ClientReply {
        plan: usize,
        op: OpRef,
        try_no: u32,
        answer: Answer,
    },
    /// A request reaches the engine; `inc` is the incarnation that sent it
    /// from inside the engine process (`None`: from outside, such as a
    /// client or a stale worker).
    Arrive {
        inc: Option<u32>,
        req: Request,
    },
    Flush {
        inc: u32,
    },
    TimerFire {
        inc: u32,
        run: RunId,
        step: Step,
    },
    TaskDue {
        inc: u32,
        task: Task,
    },
    Dispatch {
        inc: u32,
        task: Task,
    },
    WorkerDone {
        worker: usize,
        life: u32,
        inc: u32,
        task: Task,
        epoch: u64,
    },
    WorkerCrash {
        worker: usize,
    },
    LeaseCheck {
        inc: u32,
        run: RunId,
        step: Step,
        epoch: u64,
    },
    AttemptDone {
        inc: u32,
        task: Task,
        epoch: u64,
        result: Result<Payload, Failure>,
    },
    Continue {
        inc: u32,
        old: RunId,
        new: RunId,
    },
    Outbox {
        inc: u32,
        msg: Box<OutboxMessage>,
    },
    EngineCrash,
    EngineRestart,
}

/// A run actor: the machine (absent until activated by replay, and thrown
/// away after a failed commit).
#[derive(Default)]
struct Slot {
    machine: Option<RunMachine>,
    parked: Option<String>,
    restarts: u32,
}

/// One in-flight attempt under a lease, as the worker supervisor tracks it.
struct Lease {
    task: Task,
    epoch: u64,
    worker: usize,
    expires_at: u64,
    started_at: u64,
    deliveries: u32,
}

/// A commit written to the store and waiting for the group sync.
struct Pending {
    run: RunId,
    events: Vec<Event>,
    origin: Origin,
    start: bool,
    effects_ran: bool,
}

/// Everything the engine process holds in memory; a crash loses all of it.
#[derive(Default)]
struct Engine {
    up: bool,
    inc: u32,
    runs: BTreeMap<RunId, Slot>,
    leases: BTreeMap<(RunId, Step), Lease>,
    group: Vec<Pending>,
    flush_scheduled: bool,
    /// Client answers read from state that may not be durable yet (a
    /// duplicate verdict against a commit still in the group), sent after
    /// the next group sync.
    deferred: Vec<(Origin, Answer)>,
}

#[derive(Default)]
struct Client {
    started: bool,
    done: Vec<bool>,
    tries: BTreeMap<OpRef, u32>,
}

/// What a finished simulation hands back.
pub(crate) struct WorldResult {
    pub(crate) violations: Vec<Violation>,
    pub(crate) outcomes: BTreeMap<String, Outcome>,
    pub(crate) histories: BTreeMap<RunId, Vec<Event>>,
    pub(crate) trace_hash: u64,
    pub(crate) trace: Vec<String>,
    pub(crate) faults_fired: BTreeMap<FaultKind, u64>,
    pub(crate) virtual_ms: u64,
    pub(crate) steps: u64,
    pub(crate) commits: u64,
    pub(crate) events: u64,
    pub(crate) crashes: u32,
    pub(crate) outbox_messages: u64,
}

pub(crate) struct Setup<'a> {
    pub(crate) seed: u64,
    pub(crate) workflows: &'a WorkflowRegistry,
    pub(crate) mocks: &'a BTreeMap<String, Mock>,
    pub(crate) plan: FaultPlan,
    pub(crate) breaks: Option<BreakMode>,
    pub(crate) workload: &'a Workload,
    pub(crate) keep_trace: bool,
}

pub(crate) struct World<'a> {
    setup: Setup<'a>,
    now: u64,
    queue: BTreeMap<(u64, u64), Ev>,
    next_ev: u64,
    rng: ChaCha8Rng,
    store: SimStore,
    engine: Engine,
    workers: Vec<u32>,
    clients: Vec<Client>,
    checker: Checker,
    trace: Trace,
    fault_until: u64,
    next_epoch: u64,
    attempt_faults: BTreeMap<(RunId, Step, AttemptNo), u32>,
    names: BTreeMap<RunId, String>,
    fired: BTreeMap<FaultKind, u64>,
    commits: u64,
    events: u64,
    crashes: u32,
    outbox_messages: u64,
}

impl<'a> World<'a> {
    pub(crate) fn new(setup: Setup<'a>, rng: ChaCha8Rng, store: SimStore) -> Self {
        let plans = setup.workload.plans();
        let last = plans
            .iter()
            .flat_map(|p| std::iter::once(p.start_at_ms).chain(p.ops.iter().map(|o| o.at_ms)))
            .max()
            .unwrap_or(0);
        let clients = plans
            .iter()
            .map(|p| Client {
                done: vec![false; p.ops.len()],
                ..Client::default()
            })
            .collect();
        let keep = setup.keep_trace;
        if setup.breaks == Some(BreakMode::NoAttemptDedupe) {
            store.set_duplicate_terminal_check(false);
        }
        World {
            setup,
            now: 0,
            queue: BTreeMap::new(),
            next_ev: 0,
            rng,
            store,
            engine: Engine {
                up: true,
                ..Engine::default()
            },
            workers: vec![0; WORKERS],
            clients,
            checker: Checker::default(),
            trace: Trace::new(keep),
            fault_until: last + FAULT_TAIL_MS,
            next_epoch: 0,
            attempt_faults: BTreeMap::new(),
            names: BTreeMap::new(),
            fired: BTreeMap::new(),
            commits: 0,
            events: 0,
            crashes: 0,
            outbox_messages: 0,
        }
    }

    // ----- plumbing ---------------------------------------------------

    fn at(&mut self, at: u64, ev: Ev) {
        self.next_ev += 1;
        self.queue.insert((at.max(self.now), self.next_ev), ev);
    }

    fn log(&mut self, args: std::fmt::Arguments<'_>) {
        self.trace.line(self.now, args);
    }

    fn breaks(&self, mode: BreakMode) -> bool {
        self.setup.breaks == Some(mode)
    }

    /// Draws whether a fault of `kind` fires now (always draws, so that the
    /// random stream does not depend on which faults are on).
    fn fault(&mut self, kind: FaultKind) -> bool {
        let p = self.setup.plan.p(kind);
        let roll: f64 = self.rng.random();
        self.now < self.fault_until && roll < p
    }

    fn fired(&mut self, kind: FaultKind) {
        *self.fired.entry(kind).or_default() += 1;
        self.log(format_args!("fault {kind}"));
    }

    fn ms(&mut self, lo: u64, hi: u64) -> u64 {
        self.rng.random_range(lo..=hi)
    }

    /// Latency of a message to a run; `reorder` holds some back.
    fn latency(&mut self) -> u64 {
        let base = self.ms(0, 2);
        if self.fault(FaultKind::Reorder) {
            let extra = self.ms(5, 600);
            self.fired(FaultKind::Reorder);
            base + extra
        } else {
            base
        }
    }

    fn name(&self, run: RunId) -> String {
        self.names
            .get(&run)
            .cloned()
            .unwrap_or_else(|| run.to_string())
    }

    fn plan_hash(&self, plan: usize) -> u64 {
        let instance = &self.setup.workload.plans()[plan].instance;
        fnv1a(
            fnv1a(0xcbf2_9ce4_8422_2325, &self.setup.seed.to_le_bytes()),
            instance.as_bytes(),
        )
    }

    // ----- the main loop ----------------------------------------------

    pub(crate) fn run(mut self) -> WorldResult {
        for (i, p) in self.setup.workload.plans().iter().enumerate() {
            let at = p.start_at_ms;
            self.at(
                at,
                Ev::ClientSend {
                    plan: i,
                    op: None,
                    try_no: 0,
                },
            );
        }
        let deadline = self.fault_until + LIVENESS_MS;
        let mut steps = 0u64;
        while let Some(((t, _), ev)) = self.queue.pop_first() {
            if t > self.now + QUIET_GAP_MS && self.quiescent() {
                // Only stale wake-ups (a cancelled hour-long deadline) are
                // left: they could only be dropped as duplicates.
                let left = self.queue.len() + 1;
                self.log(format_args!("quiescent; {left} queued events left"));
                break;
            }
            if t > deadline {
                // The liveness phase is over; the end checks report whatever
                // has not finished.
                self.log(format_args!(
                    "liveness phase over; {} queued events left",
                    self.queue.len() + 1
                ));
                break;
            }
            if steps >= STEPS_MAX {
                let detail = format!("still busy after {steps} steps at {t} ms of virtual time");
                self.checker.violations.push(Violation {
                    kind: ViolationKind::NoQuiescence,
                    at_ms: t,
                    detail,
                });
                break;
            }
            self.now = t;
            steps += 1;
            self.step(ev);
            self.checker.check_touched(&self.store, self.now);
            if self.checker.failed() {
                break;
            }
        }
        self.finish(steps)
    }

    /// Nothing left to do: the engine is up with nothing waiting to be
    /// acknowledged, every client request is answered, and no run is open.
    fn quiescent(&self) -> bool {
        self.engine.up
            && self.engine.group.is_empty()
            && self
                .clients
                .iter()
                .all(|c| c.started && c.done.iter().all(|d| *d))
            && self
                .store
                .store()
                .runs(&RunFilter {
                    status: Some(RunStatus::Running),
                    limit: Some(1),
                    ..RunFilter::default()
                })
                .is_ok_and(|r| r.is_empty())
    }

    fn step(&mut self, ev: Ev) {
        match ev {
            Ev::ClientSend { plan, op, try_no } => self.client_send(plan, op, try_no),
            Ev::ClientTimeout { plan, op, try_no } => {
                if !self.client_done(plan, op) && self.clients[plan].tries.get(&op) == Some(&try_no)
                {
                    self.log(format_args!(
                        "client {plan} {op:?} timed out (try {try_no})"
                    ));
                    self.client_send(plan, op, try_no + 1);
                }
            }
            Ev::ClientReply {
                plan,
                op,
                try_no,
                answer,
            } => self.client_reply(plan, op, try_no, answer),
            Ev::Arrive { inc, req } => {
                if !self.engine.up || inc.is_some_and(|i| i != self.engine.inc) {
                    self.log(format_args!("lost with the engine: {req:?}"));
                    return;
                }
                self.arrive(req);
            }
            Ev::Flush { inc } if inc == self.engine.inc && self.engine.up => self.flush(),
            Ev::TimerFire { inc, run, step } if inc == self.engine.inc && self.engine.up => {
                self.log(format_args!("timer {} step {step} fires", self.name(run)));
                self.deliver(run, Input::TimerFired { step }, Origin::Timer { run, step });
            }
            Ev::TaskDue { inc, task } | Ev::Dispatch { inc, task }
                if inc == self.engine.inc && self.engine.up =>
            {
                self.dispatch(task)
            }
            Ev::WorkerDone {
                worker,
                life,
                inc,
                task,
                epoch,
            } => self.worker_done(worker, life, inc, task, epoch),
            Ev::WorkerCrash { worker } => self.worker_crash(worker),
            Ev::LeaseCheck {
                inc,
                run,
                step,
                epoch,
            } if inc == self.engine.inc && self.engine.up => self.lease_check(run, step, epoch),
            Ev::AttemptDone {
                inc,
                task,
                epoch,
                result,
            } if inc == self.engine.inc && self.engine.up => self.attempt_done(task, epoch, result),
            Ev::Continue { inc, old, new } if inc == self.engine.inc && self.engine.up => {
                self.continue_run(old, new)
            }
            Ev::Outbox { inc, msg } if inc == self.engine.inc && self.engine.up => {
                self.outbox(*msg, false)
            }
            Ev::EngineCrash => self.engine_crash(),
            Ev::EngineRestart => self.engine_restart(),
            other => self.log(format_args!("dropped (engine restarted): {other:?}")),
        }
    }
}

mod clients;
mod recovery;
mod runs;
mod workers;
