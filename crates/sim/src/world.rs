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
//! with a `due`, start children through the outbox, answer clients). A
//! failed commit throws the machine away. A crash drops every in-memory
//! structure; restart re-arms timers, tasks, the outbox and continue-as-new
//! hand-offs from the store exactly as `Engine::recover` does, and runs are
//! replayed when next needed.
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

    // ----- clients ----------------------------------------------------

    fn client_done(&self, plan: usize, op: OpRef) -> bool {
        let c = &self.clients[plan];
        match op {
            None => c.started,
            Some(i) => c.done[i],
        }
    }

    fn client_send(&mut self, plan: usize, op: OpRef, try_no: u32) {
        if self.client_done(plan, op) {
            return;
        }
        if try_no >= CLIENT_TRIES_MAX {
            self.log(format_args!("client {plan} {op:?} gives up"));
            return;
        }
        self.clients[plan].tries.insert(op, try_no);
        let delay = self.latency();
        self.at(
            self.now + delay,
            Ev::Arrive {
                inc: None,
                req: Request::Client { plan, op, try_no },
            },
        );
        let timeout = self.ms(50, CLIENT_TIMEOUT_MS_MAX);
        self.at(self.now + timeout, Ev::ClientTimeout { plan, op, try_no });
    }

    fn client_reply(&mut self, plan: usize, op: OpRef, try_no: u32, answer: Answer) {
        if self.client_done(plan, op) {
            return;
        }
        let (ok, retry) = match &answer {
            Answer::Committed
            | Answer::Started(_)
            | Answer::Existing(_)
            | Answer::AlreadyClosed
            | Answer::Dropped(_) => (true, false),
            Answer::Failed(_) => (false, true),
            Answer::Refused(_) | Answer::Parked => (false, false),
        };
        self.log(format_args!(
            "client {plan} {op:?} try {try_no} answered {answer:?}"
        ));
        if ok {
            match op {
                None => {
                    self.clients[plan].started = true;
                    self.schedule_ops(plan);
                }
                Some(i) => self.clients[plan].done[i] = true,
            }
        } else if retry && self.clients[plan].tries.get(&op) == Some(&try_no) {
            self.at(
                self.now + 20,
                Ev::ClientSend {
                    plan,
                    op,
                    try_no: try_no + 1,
                },
            );
        }
    }

    fn schedule_ops(&mut self, plan: usize) {
        let times: Vec<u64> = self.setup.workload.plans()[plan]
            .ops
            .iter()
            .map(|o| o.at_ms)
            .collect();
        for (i, at) in times.into_iter().enumerate() {
            self.at(
                at,
                Ev::ClientSend {
                    plan,
                    op: Some(i),
                    try_no: 0,
                },
            );
        }
        // Signals and cancels the workflow ignores, at arbitrary points.
        if self.fault(FaultKind::StrayCommand) {
            let cancel =
                self.setup.workload.plans()[plan].ignores_cancel && self.rng.random_bool(0.5);
            let at = self.now + self.ms(0, 2_000);
            self.fired(FaultKind::StrayCommand);
            self.at(
                at,
                Ev::Arrive {
                    inc: None,
                    req: Request::Stray { plan, cancel },
                },
            );
        }
    }

    /// A client request reaches the engine: mirrors `Client::start_raw`,
    /// `Client::signal` and `Client::cancel`.
    fn client_request(&mut self, plan: usize, op: OpRef, try_no: u32) {
        let p = &self.setup.workload.plans()[plan];
        let instance = InstanceId::new(p.instance.clone());
        let origin = Origin::Client { plan, op, try_no };
        match op {
            None => {
                let store = self.store.store();
                let current = store
                    .instance(&instance)
                    .ok()
                    .flatten()
                    .and_then(|i| store.run_meta(i.current_run).ok().flatten());
                if let Some(meta) = current {
                    // The reuse policy the simulated client uses is
                    // `RejectDuplicate`: a start retried after its run
                    // closed finds it closed, and is answered as done.
                    let answer = if meta.status.is_closed() {
                        Answer::AlreadyClosed
                    } else {
                        Answer::Existing(meta.run_id)
                    };
                    self.respond(origin, answer);
                    return;
                }
                let h = self.plan_hash(plan);
                let run = RunId::from_u64_pair(h, u64::from(try_no) + 1);
                self.names.insert(run, format!("{}#{try_no}", p.instance));
                let spec = StartSpec {
                    run_id: run,
                    instance_id: instance,
                    workflow_type: p.workflow_type.clone(),
                    input: p.input.clone(),
                    command_id: Some(CommandId::new(format!("{}/start", p.instance))),
                    parent: None,
                    continued_from: None,
                    random_seed: h.rotate_left(17),
                };
                self.create(spec, origin);
            }
            Some(i) => {
                let input = match &p.ops[i].kind {
                    ClientOpKind::Signal {
                        name,
                        payload,
                        command_id,
                    } => Input::Signal {
                        name: name.clone(),
                        payload: payload.clone(),
                        command_id: command_id.clone(),
                    },
                    ClientOpKind::Cancel { reason, command_id } => Input::CancelRequested {
                        reason: reason.clone(),
                        command_id: command_id.clone(),
                    },
                };
                match self.store.store().resolve(instance.as_str()) {
                    Ok(Some(run)) => self.deliver(run, input, origin),
                    _ => self.respond(
                        origin,
                        Answer::Failed(format!("unknown instance {instance}")),
                    ),
                }
            }
        }
    }

    fn stray(&mut self, plan: usize, cancel: bool) {
        let instance = self.setup.workload.plans()[plan].instance.clone();
        let Ok(Some(run)) = self.store.store().resolve(&instance) else {
            return;
        };
        let input = if cancel {
            Input::CancelRequested {
                reason: "stray cancel".into(),
                command_id: None,
            }
        } else {
            Input::Signal {
                name: "keel.sim.noise".into(),
                payload: Payload::default(),
                command_id: None,
            }
        };
        self.log(format_args!("stray {input:?} to {}", self.name(run)));
        self.deliver(run, input, Origin::Ghost);
    }

    // ----- the run actor ----------------------------------------------

    fn arrive(&mut self, req: Request) {
        match req {
            Request::Client { plan, op, try_no } => self.client_request(plan, op, try_no),
            Request::Stray { plan, cancel } => self.stray(plan, cancel),
            Request::Deliver { run, input, origin } => self.deliver(run, input, origin),
        }
    }

    /// The answer to a delivery reaches whoever waits for it.
    fn respond(&mut self, origin: Origin, answer: Answer) {
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
    fn activate(&mut self, run: RunId) -> Result<(), Answer> {
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

    fn park(&mut self, run: RunId, err: &MachineError) {
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
    fn deliver(&mut self, run: RunId, input: Input, origin: Origin) {
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
    fn create(&mut self, spec: StartSpec, origin: Origin) {
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
    fn commit(&mut self, run: RunId, events: Vec<Event>, origin: Origin, start: bool) {
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
    fn flush(&mut self) {
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
    fn ack(&mut self, p: Pending) {
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
    fn run_closed(&mut self, run: RunId, close: &Event) {
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
    fn apply_close_policies(&mut self, run: RunId) {
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
    fn effects(&mut self, run: RunId, events: &[Event]) {
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

    fn arm(&mut self, run: RunId, step: Step, fire_at: Timestamp) {
        let mut at = fire_at.0;
        if self.fault(FaultKind::TimerSkew) {
            at += self.ms(1, 800);
            self.fired(FaultKind::TimerSkew);
        }
        let inc = self.engine.inc;
        self.at(at, Ev::TimerFire { inc, run, step });
    }

    /// Mirrors `Shared::continue_run`: starts the next run of a chain.
    fn continue_run(&mut self, old: RunId, new: RunId) {
        let Ok(history) = self.store.store().history(old) else {
            return;
        };
        let (Some(first), Some(last)) = (history.first(), history.last()) else {
            return;
        };
        let (
            EventKind::WorkflowStarted {
                instance_id,
                workflow_type,
                random_seed,
                ..
            },
            EventKind::WorkflowContinuedAsNew { input, .. },
        ) = (&first.kind, &last.kind)
        else {
            return;
        };
        self.names
            .entry(new)
            .or_insert_with(|| format!("{}+", instance_id.as_str()));
        let spec = StartSpec {
            run_id: new,
            instance_id: instance_id.clone(),
            workflow_type: workflow_type.clone(),
            input: input.clone(),
            command_id: None,
            parent: None,
            continued_from: Some(old),
            // The shell draws a fresh seed here; deriving it from the chain
            // keeps the outcome comparable with the fault-free run.
            random_seed: random_seed.rotate_left(1) ^ 0x9E37_79B9_7F4A_7C15,
        };
        self.create(spec, Origin::Continue { old, new });
    }

    // ----- the outbox -------------------------------------------------

    /// Delivers an outbox message at least once (mirrors
    /// `Shared::start_child` and `Shared::deliver_child_result`).
    fn outbox(&mut self, msg: OutboxMessage, redelivery: bool) {
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

    fn outbox_answered(&mut self, msg: OutboxMessage, answer: Answer) {
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

    // ----- activity workers and their supervisor ----------------------

    fn lease_ms(o: &ActivityOptions) -> u64 {
        [o.heartbeat_ms, o.start_to_close_ms, o.schedule_to_close_ms]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(LEASE_MS)
    }

    fn attempt_key(task: &Task) -> (RunId, Step, AttemptNo) {
        (task.run, task.step, task.attempt)
    }

    fn may_fault_attempt(&self, task: &Task) -> bool {
        self.attempt_faults
            .get(&Self::attempt_key(task))
            .copied()
            .unwrap_or(0)
            < ATTEMPT_FAULTS_MAX
    }

    /// Mirrors `Workers`' `Dispatch` handler.
    fn dispatch(&mut self, task: Task) {
        if let Some(l) = self.engine.leases.get(&(task.run, task.step)) {
            if l.task.attempt >= task.attempt {
                return;
            }
        }
        self.launch(task, 1);
    }

    /// Mirrors `Workers::launch`: hands the attempt to a worker under a new
    /// lease epoch.
    fn launch(&mut self, task: Task, deliveries: u32) {
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

    fn worker_crash(&mut self, worker: usize) {
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

    fn worker_done(&mut self, worker: usize, life: u32, inc: u32, task: Task, epoch: u64) {
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
    fn maybe_late(&mut self, task: &Task, result: Result<Payload, Failure>) {
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

    fn result_input(&mut self, task: &Task, result: Result<Payload, Failure>) -> Input {
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
    fn attempt_done(&mut self, task: Task, epoch: u64, result: Result<Payload, Failure>) {
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
    fn lease_check(&mut self, run: RunId, step: Step, epoch: u64) {
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
    fn report(&mut self, task: &Task, result: Result<Payload, Failure>) {
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

    fn send_report(&mut self, run: RunId, input: Input, tries: u32) {
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

    // ----- crash and recovery -----------------------------------------

    fn engine_crash(&mut self) {
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
    fn engine_restart(&mut self) {
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

    fn finish(mut self, steps: u64) -> WorldResult {
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
                    .map(|p| format!("{} {} at step {}", p.kind, p.name, p.step))
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
            let outcome = store
                .instance(&instance)
                .ok()
                .flatten()
                .and_then(|i| store.run_meta(i.current_run).ok().flatten())
                .and_then(|m| m.outcome);
            match outcome {
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
                    format!("{}: never started or never finished", p.instance),
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
