//! The simulated host: the engine's shard drivers (`keel_core::driver`,
//! the code that ships) on virtual time, with a simulated store, workers,
//! clients and network around them.
//!
//! The host decides nothing the engine decides: it performs the drivers'
//! actions (reads, commits, attempts, messages, replies), and injects the
//! faults real hosts meet: a slow or failing store, a crash that drops the
//! unsynced tail, workers that crash, stall, stop heartbeating or run past
//! their limits, results reported twice or late, messages delayed,
//! reordered or delivered twice, stray client requests. Everything runs on
//! one thread, in an event queue ordered by (time, insertion), with one
//! `ChaCha8Rng` for every decision and `BTreeMap`s for everything iterated.
//!
//! What it cannot run, and why: the actix host's threads and mailboxes (a
//! simulated process has no threads; messages between shards are its
//! events, delivered in the order the queue gives them), and real activity
//! code (activities are mocks: a function of input and attempt number, with
//! a simulated duration).

mod clients;
mod io;
mod process;
mod workers;

use std::collections::BTreeMap;
use std::sync::Arc;

use keel_core::driver::{
    AttemptKey, BreakMode, DriverConfig, RequestId, Shard, ShardId, ShardInput,
};
use keel_core::WorkflowRegistry;
use keel_resilience::{Clock, CompiledPipeline, ManualClock};
use keel_storage::{AttemptNo, Event, Failure, LeaseEpoch, Outcome, Payload, RunId};
use rand::{Rng, RngExt};
use rand_chacha::ChaCha8Rng;

use crate::check::{Checker, Violation, ViolationKind};
use crate::fault::{FaultKind, FaultPlan, Firings};
use crate::store::SimStore;
use crate::trace::{fnv1a, Trace};
use crate::workload::Workload;

/// A mock activity body: input and attempt number in, result out.
pub(crate) type MockBody =
    Arc<dyn Fn(&Payload, AttemptNo) -> Result<Payload, Failure> + Send + Sync>;
/// A mock activity's fallback for a final failure.
pub(crate) type MockFallback =
    Arc<dyn Fn(&Payload, &Failure) -> Option<Result<Payload, Failure>> + Send + Sync>;

/// A mock activity: its body, how long an attempt normally takes, and its
/// fallback, if it has one.
#[derive(Clone)]
pub(crate) struct Mock {
    pub(crate) body: MockBody,
    pub(crate) duration_ms: (u64, u64),
    pub(crate) fallback: Option<MockFallback>,
}

/// Simulated activity workers.
const WORKERS: usize = 4;
/// How long a client waits for an answer before it sends again.
const CLIENT_TIMEOUT_MS_MAX: u64 = 300;
/// The group commit's sync normally takes up to this long...
const SYNC_MS_MAX: u64 = 2;
/// ...and now and then (a slow disk) up to this long, which widens the
/// window in which the machines are ahead of what is durable.
const SLOW_SYNC_MS_MAX: u64 = 100;

/// Longest simulated stop of the store's writes (a full disk until an
/// operator frees space).
const STORE_STOP_MS_MAX: u64 = 2_000;
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
/// Lease-affecting faults (expiry, worker crash, silence, slowness) one
/// attempt may suffer: below the redelivery bound, so faults never turn
/// into a lease failure that would change the workflow's outcome.
const ATTEMPT_FAULTS_MAX: u32 = keel_core::driver::LEASE_REDELIVERIES_MAX - 1;
/// The lease of an attempt without a timeout of its own (the engine's
/// default is a minute; a second keeps simulated expiries cheap).
const LEASE_MS: u64 = 1_000;

/// A client's `result` request waits this long for the run to close
/// before it asks again (the wait is lost when the engine crashes).
const RESULT_WAIT_MS: u64 = 5_000;
/// A client describes its instance once, at most this long after its start
/// was answered.
const DESCRIBE_AFTER_MS_MAX: u64 = 3_000;

/// Which client request.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum OpRef {
    /// The start.
    Start,
    /// Planned signal or cancel `i`.
    Planned(usize),
    /// Waiting for the outcome (following continue-as-new).
    Result,
    /// One describe, at a random point of the run.
    Describe,
}

/// Everything that happens at a point of virtual time.
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
        answer: keel_core::driver::Answer,
    },
    /// An input reaches a shard; `inc` is the process incarnation it was
    /// sent from, if it came from inside the engine process (it is lost
    /// with that process), `None` from outside (clients, stray workers).
    Input {
        inc: Option<u32>,
        shard: ShardId,
        input: Box<ShardInput>,
    },
    /// A shard's wake-up time came.
    Wake {
        inc: u32,
        shard: ShardId,
    },
    /// The group commit syncs.
    Flush {
        inc: u32,
    },
    /// A copy of an attempt finishes on a worker.
    WorkerDone {
        worker: usize,
        life: u32,
        copy: CopyId,
    },
    /// A copy of an attempt heartbeats.
    WorkerBeat {
        worker: usize,
        life: u32,
        copy: CopyId,
    },
    WorkerCrash {
        worker: usize,
    },
    EngineCrash,
    EngineRestart,
    /// Space is freed: the stopped store accepts writes again.
    StoreResume,
}

/// One copy of an attempt on a simulated worker.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
struct CopyId {
    inc: u32,
    shard: ShardId,
    key: AttemptKey,
    attempt: AttemptNo,
    epoch: LeaseEpoch,
}

/// A copy running on a worker, until it reports.
#[derive(Debug)]
struct Copy {
    result: Result<Payload, Failure>,
    /// Asked to stop: the copy gives up at its next heartbeat.
    stop: bool,
    /// Stopped heartbeating (a silent worker).
    silent: bool,
    heartbeat_ms: Option<u64>,
    /// Sent twice by the transport: a second worker also runs it.
    twin: bool,
    /// The worker it runs on.
    worker: usize,
    /// A final attempt whose lease is its start-to-close limit: losing the
    /// worker would fail it as a timeout with no retry left, changing the
    /// outcome, so worker crashes spare it.
    fragile: bool,
}

/// A commit written to the store and waiting for the group sync.
struct Pending {
    shard: ShardId,
    token: keel_core::driver::Token,
    ack: keel_storage::CommitAck,
    events: Vec<(RunId, Vec<Event>)>,
}

/// The engine process: its shards and what it holds in memory. A crash
/// loses all of it.
struct Process {
    up: bool,
    inc: u32,
    shards: Vec<Shard>,
    /// The wake-up each shard has asked for and the host has queued.
    wakes: Vec<Option<u64>>,
    group: Vec<Pending>,
    flush_scheduled: bool,
    copies: BTreeMap<CopyId, Copy>,
}

#[derive(Default)]
struct Client {
    started: bool,
    done: Vec<bool>,
    /// The outcome the client was answered (after following every
    /// continue-as-new).
    result: Option<Outcome>,
    /// The run or instance its `result` request asks about now.
    result_target: String,
    described: bool,
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
    pub(crate) shards: u16,
    pub(crate) firings: Vec<(FaultKind, u32)>,
}

/// How one simulated execution is set up.
pub(crate) struct Setup<'a> {
    pub(crate) seed: u64,
    pub(crate) workflows: &'a WorkflowRegistry,
    pub(crate) mocks: &'a BTreeMap<String, Mock>,
    pub(crate) profiles: &'a BTreeMap<String, ProfileSpec>,
    pub(crate) plan: FaultPlan,
    pub(crate) breaks: Option<BreakMode>,
    pub(crate) workload: &'a Workload,
    pub(crate) keep_trace: bool,
    /// Only these fault firings happen (shrinking), when given.
    pub(crate) firings: Option<&'a Firings>,
}

/// A resilience profile as the simulator builds it for each execution (on
/// a manual clock that follows virtual time).
pub(crate) type ProfileSpec =
    Arc<dyn Fn(Arc<ManualClock>) -> CompiledPipeline<Failure> + Send + Sync>;

/// One simulated execution.
pub(crate) struct World<'a> {
    setup: Setup<'a>,
    now: u64,
    queue: BTreeMap<(u64, u64), Ev>,
    next_ev: u64,
    rng: ChaCha8Rng,
    store: SimStore,
    process: Process,
    config: DriverConfig,
    clock: Arc<ManualClock>,
    workers: Vec<u32>,
    clients: Vec<Client>,
    /// Client requests in flight, by id.
    requests: BTreeMap<RequestId, (usize, OpRef, u32)>,
    next_request: u64,
    checker: Checker,
    trace: Trace,
    fault_until: u64,
    attempt_faults: BTreeMap<(RunId, keel_storage::Step, AttemptNo), u32>,
    names: BTreeMap<RunId, String>,
    fired: BTreeMap<FaultKind, u64>,
    /// Every firing in order, as (kind, occurrence index of that kind).
    firings: Vec<(FaultKind, u32)>,
    /// How many times each kind's dice came up so far.
    rolls_won: BTreeMap<FaultKind, u32>,
    commits: u64,
    events: u64,
    crashes: u32,
    outbox_messages: u64,
    /// The highest lease epoch seen per execution (epochs only grow).
    epochs: BTreeMap<AttemptKey, LeaseEpoch>,
    /// Until when the store refuses writes (a simulated full disk).
    store_stopped_until: Option<u64>,
    /// How many times the store stopped.
    store_stops: u32,
}

impl<'a> World<'a> {
    pub(crate) fn new(setup: Setup<'a>, mut rng: ChaCha8Rng, store: SimStore) -> Self {
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
                result_target: p.instance.clone(),
                ..Client::default()
            })
            .collect();
        let keep = setup.keep_trace;
        if setup.breaks == Some(BreakMode::NoAttemptDedupe) {
            store.set_duplicate_terminal_check(false);
        }
        // The engine's shape for this seed: shards, cache and worker
        // limits small enough that passivation and queueing happen.
        let mut shape = rng.clone();
        shape.set_stream(4);
        let shards = shape.random_range(1..=3u16);
        let clock = Arc::new(ManualClock::new());
        let profiles = setup
            .profiles
            .iter()
            .map(|(name, build)| (name.clone(), Arc::new(build(clock.clone()))))
            .collect();
        let config = DriverConfig {
            shards,
            run_cache_max: if shape.random_bool(0.5) {
                shape.random_range(2..=8)
            } else {
                10_000
            },
            lease_ms_default: LEASE_MS,
            worker_concurrency_max: shape.random_range(2..=16),
            profiles,
            breaks: setup.breaks,
        };
        let _ = rng.next_u64();
        let mut w = World {
            process: Process {
                up: true,
                inc: 0,
                shards: Vec::new(),
                wakes: Vec::new(),
                group: Vec::new(),
                flush_scheduled: false,
                copies: BTreeMap::new(),
            },
            setup,
            now: 0,
            queue: BTreeMap::new(),
            next_ev: 0,
            rng,
            store,
            config,
            clock,
            workers: vec![0; WORKERS],
            clients,
            requests: BTreeMap::new(),
            next_request: 0,
            checker: Checker::default(),
            trace: Trace::new(keep),
            fault_until: last + FAULT_TAIL_MS,
            attempt_faults: BTreeMap::new(),
            names: BTreeMap::new(),
            fired: BTreeMap::new(),
            firings: Vec::new(),
            rolls_won: BTreeMap::new(),
            commits: 0,
            events: 0,
            crashes: 0,
            outbox_messages: 0,
            epochs: BTreeMap::new(),
            store_stopped_until: None,
            store_stops: 0,
        };
        w.boot();
        w
    }

    // ----- plumbing ---------------------------------------------------

    fn at(&mut self, at: u64, ev: Ev) {
        self.next_ev += 1;
        self.queue.insert((at.max(self.now), self.next_ev), ev);
    }

    /// Queues an input for a shard at `at`.
    fn input_at(&mut self, at: u64, inc: Option<u32>, shard: ShardId, input: ShardInput) {
        self.at(
            at,
            Ev::Input {
                inc,
                shard,
                input: Box::new(input),
            },
        );
    }

    fn log(&mut self, args: std::fmt::Arguments<'_>) {
        self.trace.line(self.now, args);
    }

    /// Draws whether a fault of `kind` fires now (always draws, so that the
    /// random stream does not depend on which faults are on), and records
    /// the firing.
    fn fault(&mut self, kind: FaultKind) -> bool {
        let p = self.setup.plan.p(kind);
        let roll: f64 = self.rng.random();
        if !(self.now < self.fault_until && roll < p) {
            return false;
        }
        let n = self.rolls_won.entry(kind).or_default();
        let index = *n;
        *n += 1;
        if let Some(allowed) = self.setup.firings {
            if !allowed.contains(kind, index) {
                return false;
            }
        }
        self.firings.push((kind, index));
        *self.fired.entry(kind).or_default() += 1;
        self.log(format_args!("fault {kind} #{index}"));
        true
    }

    fn ms(&mut self, lo: u64, hi: u64) -> u64 {
        self.rng.random_range(lo..=hi)
    }

    /// Latency of a message; `reorder` holds some back.
    fn latency(&mut self) -> u64 {
        let base = self.ms(0, 2);
        if self.fault(FaultKind::Reorder) {
            base + self.ms(5, 600)
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

    fn shard_index(shard: ShardId) -> usize {
        usize::from(shard.0)
    }

    // ----- the main loop ----------------------------------------------

    pub(crate) fn run(mut self) -> WorldResult {
        for (i, p) in self.setup.workload.plans().iter().enumerate() {
            let at = p.start_at_ms;
            self.at(
                at,
                Ev::ClientSend {
                    plan: i,
                    op: OpRef::Start,
                    try_no: 0,
                },
            );
        }
        let deadline = self.fault_until + LIVENESS_MS;
        let mut steps = 0u64;
        while let Some(((t, _), ev)) = self.queue.pop_first() {
            if t > self.now + QUIET_GAP_MS && self.quiescent() {
                let left = self.queue.len() + 1;
                self.log(format_args!("quiescent; {left} queued events left"));
                break;
            }
            if t > deadline {
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
            self.clock_to_now();
            steps += 1;
            self.step(ev);
            self.pump();
            self.checker.check_touched(&self.store, self.now);
            if self.checker.failed() {
                break;
            }
        }
        self.finish(steps)
    }

    /// Keeps the profiles' manual clock at virtual time.
    fn clock_to_now(&mut self) {
        let now = std::time::Duration::from_millis(self.now);
        let behind = now.saturating_sub(self.clock.now().since_epoch());
        if !behind.is_zero() {
            self.clock.advance(behind);
        }
    }

    /// Nothing left to do: the engine is up with nothing waiting to be
    /// acknowledged, every client request is answered, and no run is open.
    fn quiescent(&self) -> bool {
        self.process.up
            && self.process.group.is_empty()
            && self.clients.iter().all(|c| {
                c.started && c.done.iter().all(|d| *d) && c.result.is_some() && c.described
            })
            && self
                .store
                .store()
                .runs(
                    &keel_storage::RunFilter::all()
                        .status(keel_storage::RunStatus::Running)
                        .limit(1),
                )
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
            Ev::Input { inc, shard, input } => {
                if !self.process.up || inc.is_some_and(|i| i != self.process.inc) {
                    self.log(format_args!("lost with the engine: {input:?}"));
                    return;
                }
                self.feed(shard, *input);
            }
            Ev::Wake { inc, shard } => {
                if inc == self.process.inc && self.process.up {
                    let i = Self::shard_index(shard);
                    self.process.wakes[i] = None;
                    let now = keel_storage::Timestamp(self.now);
                    self.process.shards[i].handle_timeout(now);
                }
            }
            Ev::Flush { inc } => {
                if inc == self.process.inc && self.process.up {
                    self.flush();
                }
            }
            Ev::WorkerDone { worker, life, copy } => self.worker_done(worker, life, copy),
            Ev::WorkerBeat { worker, life, copy } => self.worker_beat(worker, life, copy),
            Ev::WorkerCrash { worker } => self.worker_crash(worker),
            Ev::EngineCrash => self.engine_crash(),
            Ev::EngineRestart => self.engine_restart(),
            Ev::StoreResume => {
                self.store_stopped_until = None;
                self.log(format_args!("store accepts writes again"));
                self.report_store_health();
            }
        }
    }

    /// The store's health as the host observes it.
    fn store_health(&self) -> keel_storage::StoreHealth {
        match self.store_stopped_until {
            Some(_) => keel_storage::StoreHealth::Stopped {
                fault: keel_storage::WriteFault::NoSpace,
                detail: "simulated full disk".into(),
            },
            None => keel_storage::StoreHealth::Healthy,
        }
    }

    /// Reports the store's health to every shard whose view differs, as the
    /// actix host's poll does.
    pub(super) fn report_store_health(&mut self) {
        if !self.process.up {
            return;
        }
        let health = self.store_health();
        let shards = self.process.shards.len();
        for i in 0..shards {
            if *self.process.shards[i].store_health() != health {
                let shard = self.process.shards[i].id();
                self.feed(shard, ShardInput::StoreHealth(health.clone()));
            }
        }
    }

    /// Hands an input to a shard of the running process.
    fn feed(&mut self, shard: ShardId, input: ShardInput) {
        let i = Self::shard_index(shard);
        let now = keel_storage::Timestamp(self.now);
        self.process.shards[i].handle(now, input);
    }

    /// Performs every action the shards asked for, until none is left, and
    /// queues the wake-ups they want.
    fn pump(&mut self) {
        if !self.process.up {
            return;
        }
        loop {
            let mut any = false;
            for i in 0..self.process.shards.len() {
                while let Some(action) = self.process.shards[i].poll_action() {
                    any = true;
                    self.perform(ShardId(i as u16), action);
                    if !self.process.up {
                        return;
                    }
                }
            }
            if !any {
                break;
            }
        }
        for i in 0..self.process.shards.len() {
            let Some(t) = self.process.shards[i].poll_timeout() else {
                continue;
            };
            let t = t.0.max(self.now);
            if self.process.wakes[i].is_none_or(|w| t < w) {
                self.process.wakes[i] = Some(t);
                let inc = self.process.inc;
                // A host wakes late now and then (a busy thread, a coarse
                // timer): the shard sees a later `now`.
                let late = if self.fault(FaultKind::TimerSkew) {
                    self.ms(1, 800)
                } else {
                    0
                };
                self.at(
                    t + late,
                    Ev::Wake {
                        inc,
                        shard: ShardId(i as u16),
                    },
                );
            }
        }
    }
}
