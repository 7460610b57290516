//! The engine: builds the store and the actor system, recovers durable work
//! on start, and serves the [`Client`].

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use actix::{Actor, Addr, Arbiter, ArbiterHandle, MailboxError};
use futures::channel::oneshot;
use keel_storage::history::{children, pending_steps, PendingStep};
use keel_storage::{
    CommandId, Durability, EventKind, Failure, InstanceId, LeaseEpoch, MemStore, OutboxMessage,
    Outcome, ParentRef, ParkInfo, Payload, RocksStore, RunFilter, RunId, RunStatus, Step, Store,
    Timestamp, PAYLOAD_BYTES_MAX,
};
use parking_lot::Mutex;
use serde::Serialize;
use tracing::{debug, info, warn};

use super::run::{Create, Deliver, Delivery, Describe, MachineView, Passivate, RunActor};
use super::timers::{Arm, ScheduleTask, TimerService};
use super::workers::{AttemptTask, Dispatch, Leases, Workers};
use super::{
    DELIVERY_ATTEMPTS_MAX, DELIVERY_BACKOFF_MS_MAX, LEASE_MS_DEFAULT, RUN_CACHE_MAX_DEFAULT,
    WORKER_CONCURRENCY_MAX,
};
use crate::activity::{Activity, ActivityRegistry};
use crate::machine::{Input, StartSpec};
use crate::workflow::{Workflow, WorkflowRegistry};

/// Errors the engine and client return. Bad input is refused with a typed
/// error before anything is written.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// No workflow of this type is registered.
    #[error("unknown workflow type {0:?}")]
    UnknownWorkflowType(String),
    /// The input does not decode into the workflow's input type.
    #[error("input for workflow {workflow_type:?} does not decode: {detail}")]
    InvalidInput {
        /// The workflow type.
        workflow_type: String,
        /// The decoder's message.
        detail: String,
    },
    /// A value could not be encoded.
    #[error("value does not encode: {0}")]
    Encode(String),
    /// A payload over the limit.
    #[error("payload of {bytes} bytes exceeds the limit of {max} bytes")]
    PayloadTooLarge {
        /// Its size.
        bytes: usize,
        /// The limit.
        max: usize,
    },
    /// No instance or run by that id.
    #[error("unknown instance or run {0:?}")]
    UnknownInstance(String),
    /// The run is closed.
    #[error("run {run} is closed")]
    RunClosed {
        /// The run.
        run: RunId,
    },
    /// The instance's last run is closed and the reuse policy refuses a new one.
    #[error(
        "instance {instance} already ran (run {run}, {status}); the reuse policy refuses a new run"
    )]
    AlreadyClosed {
        /// The instance.
        instance: InstanceId,
        /// Its last run.
        run: RunId,
        /// That run's status.
        status: &'static str,
    },
    /// The run is parked.
    #[error("run {run} is parked: {reason}")]
    Parked {
        /// The run.
        run: RunId,
        /// Why.
        reason: String,
    },
    /// The workflow failed.
    #[error("workflow failed: {0}")]
    WorkflowFailed(Failure),
    /// The workflow was cancelled.
    #[error("workflow cancelled: {0}")]
    WorkflowCancelled(String),
    /// The workflow was terminated.
    #[error("workflow terminated: {0}")]
    WorkflowTerminated(String),
    /// The result does not decode into the expected type.
    #[error("result does not decode: {0}")]
    ResultDecode(String),
    /// A storage error.
    #[error(transparent)]
    Store(#[from] keel_storage::Error),
    /// The engine is shutting down.
    #[error("the engine is shut down")]
    Shutdown,
}

/// What `start` did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StartOutcome {
    /// A new run started.
    Started(RunId),
    /// The instance already had an open run; it is returned.
    Existing(RunId),
}

impl StartOutcome {
    /// The run, new or existing.
    pub fn run_id(self) -> RunId {
        match self {
            StartOutcome::Started(r) | StartOutcome::Existing(r) => r,
        }
    }
}

/// What `start` does when the instance's last run is closed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReusePolicy {
    /// Start a new run.
    #[default]
    AllowDuplicate,
    /// Start a new run only if the last one did not complete.
    AllowDuplicateFailedOnly,
    /// Refuse: the instance ran once.
    RejectDuplicate,
}

/// Tunables of an engine, each with its unit in the name.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Run actors kept in memory.
    pub run_cache_max: usize,
    /// Arbiters (threads) run actors are sharded over.
    pub arbiters: usize,
    /// Threads activity code runs on.
    pub activity_threads: usize,
    /// Lease of an attempt without heartbeat or start-to-close timeout.
    pub lease_ms_default: u64,
    /// Attempts running at once.
    pub worker_concurrency_max: usize,
    /// How commits are made durable.
    pub durability: Durability,
}

impl Default for EngineConfig {
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        EngineConfig {
            run_cache_max: RUN_CACHE_MAX_DEFAULT,
            arbiters: cores.max(1),
            activity_threads: cores.max(1),
            lease_ms_default: LEASE_MS_DEFAULT,
            worker_concurrency_max: WORKER_CONCURRENCY_MAX,
            durability: Durability::Sync,
        }
    }
}

/// Builds an [`Engine`].
pub struct EngineBuilder {
    data_dir: Option<PathBuf>,
    store: Option<Arc<dyn Store>>,
    workflows: WorkflowRegistry,
    activities: ActivityRegistry,
    config: EngineConfig,
    profiles: HashMap<String, Arc<keel_resilience::CompiledPipeline<Failure>>>,
}

impl std::fmt::Debug for EngineBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineBuilder")
            .field("data_dir", &self.data_dir)
            .field("workflows", &self.workflows)
            .field("activities", &self.activities)
            .finish()
    }
}

impl EngineBuilder {
    /// Keeps the log in RocksDB in `dir` (the default is `./keel-data`).
    pub fn data_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.data_dir = Some(dir.into());
        self
    }

    /// Keeps the log in memory (tests).
    pub fn in_memory(mut self) -> Self {
        self.store = Some(Arc::new(MemStore::new(Durability::Sync)));
        self
    }

    /// Uses the given store.
    pub fn store(mut self, store: Arc<dyn Store>) -> Self {
        self.store = Some(store);
        self
    }

    /// Durability of commits (`Sync` by default).
    pub fn durability(mut self, d: Durability) -> Self {
        self.config.durability = d;
        self
    }

    /// Replaces the configuration.
    pub fn config(mut self, config: EngineConfig) -> Self {
        self.config = config;
        self
    }

    /// Registers workflow `W`.
    pub fn register_workflow<W: Workflow>(mut self) -> Self {
        self.workflows.register::<W>();
        self
    }

    /// Registers activity `A`, built with `Default`.
    pub fn register_activity<A: Activity + Default>(mut self) -> Self {
        self.activities.register(A::default());
        self
    }

    /// Registers an activity instance (one carrying its dependencies).
    pub fn activity<A: Activity>(mut self, activity: A) -> Self {
        self.activities.register(activity);
        self
    }

    /// Registers a compiled resilience pipeline as profile `name`.
    /// Activity calls that name it (`.profile(name)`) are admitted through
    /// its circuit breaker, rate limit and bulkhead in this engine process;
    /// their retries, backoff and deadline stay durable (the call's own
    /// retry policy and timeouts).
    pub fn resilience_profile(
        mut self,
        name: &str,
        pipeline: keel_resilience::CompiledPipeline<Failure>,
    ) -> Self {
        self.profiles.insert(name.to_string(), Arc::new(pipeline));
        self
    }

    /// Registers every workflow of `registry`.
    pub fn workflows(mut self, registry: &WorkflowRegistry) -> Self {
        for name in registry.names() {
            if let Some(w) = registry.get(name) {
                self.workflows.register_erased(w.clone());
            }
        }
        self
    }

    /// Registers every activity of `registry`.
    pub fn activities(mut self, registry: ActivityRegistry) -> Self {
        self.activities = registry;
        self
    }

    /// Opens the store, starts the actor system and recovers durable work
    /// (timers, pending attempts, outbox). Works inside or outside a tokio
    /// runtime: the engine runs on its own threads.
    pub fn build(self) -> Result<Engine, EngineError> {
        let store: Arc<dyn Store> = match self.store {
            Some(s) => s,
            None => {
                let dir = self.data_dir.unwrap_or_else(|| PathBuf::from("keel-data"));
                Arc::new(RocksStore::open(dir, self.config.durability)?)
            }
        };
        Engine::start(
            store,
            self.workflows,
            self.activities,
            self.config,
            self.profiles,
        )
    }
}

#[derive(Default)]
struct RunTable {
    map: HashMap<RunId, (Addr<RunActor>, u64)>,
    lru: BTreeMap<u64, RunId>,
    tick: u64,
}

pub(crate) struct Shared {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) workflows: WorkflowRegistry,
    pub(crate) activities: ActivityRegistry,
    pub(crate) config: EngineConfig,
    arbiters: Vec<ArbiterHandle>,
    runs: Mutex<RunTable>,
    waiters: Mutex<HashMap<RunId, Vec<oneshot::Sender<Outcome>>>>,
    pub(crate) timers: OnceLock<Addr<TimerService>>,
    pub(crate) workers: OnceLock<Addr<Workers>>,
    pub(crate) activity_rt: tokio::runtime::Handle,
    pub(crate) profiles: HashMap<String, Arc<keel_resilience::CompiledPipeline<Failure>>>,
    rng: Mutex<u64>,
    pub(crate) next_epoch: AtomicU64,
    in_flight: AtomicUsize,
    shutting_down: AtomicBool,
}

impl Shared {
    pub(crate) fn now(&self) -> Timestamp {
        Timestamp(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
        )
    }

    /// Randomness for the shell (seeds, jitter): drawn here, recorded in
    /// events, never drawn by the pure core.
    pub(crate) fn random(&self) -> u64 {
        let mut s = self.rng.lock();
        *s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub(crate) fn epoch(&self) -> LeaseEpoch {
        LeaseEpoch(self.next_epoch.fetch_add(1, Ordering::Relaxed) + 1)
    }

    fn arbiter_for(&self, run: RunId) -> &ArbiterHandle {
        let b = run.as_bytes();
        let h = u64::from_le_bytes(b[8..16].try_into().expect("16-byte id"));
        &self.arbiters[(h % self.arbiters.len() as u64) as usize]
    }

    /// The actor of `run`, started (not yet activated) if it has none.
    pub(crate) fn actor_for(self: &Arc<Self>, run: RunId) -> Addr<RunActor> {
        let mut evict = Vec::new();
        let addr = {
            let mut t = self.runs.lock();
            t.tick += 1;
            let tick = t.tick;
            let addr = match t.map.get_mut(&run) {
                Some((addr, last)) => {
                    let old = std::mem::replace(last, tick);
                    let addr = addr.clone();
                    t.lru.remove(&old);
                    addr
                }
                None => {
                    let shared = self.clone();
                    let addr = RunActor::start_in_arbiter(self.arbiter_for(run), move |_| {
                        RunActor::new(run, shared)
                    });
                    t.map.insert(run, (addr.clone(), tick));
                    addr
                }
            };
            t.lru.insert(tick, run);
            while t.map.len() > self.config.run_cache_max {
                let Some((&oldest, &victim)) = t.lru.iter().next() else {
                    break;
                };
                t.lru.remove(&oldest);
                if let Some((a, _)) = t.map.remove(&victim) {
                    evict.push(a);
                }
            }
            addr
        };
        for a in evict {
            a.do_send(Passivate);
        }
        addr
    }

    /// Forgets `run`'s actor if it is still `addr`.
    pub(crate) fn forget(&self, run: RunId, addr: &Addr<RunActor>) {
        let mut t = self.runs.lock();
        if let Some((a, tick)) = t.map.get(&run) {
            if a == addr {
                let tick = *tick;
                t.map.remove(&run);
                t.lru.remove(&tick);
            }
        }
    }

    /// Hands an input to a run, activating it if needed. Retries when the
    /// run's actor stopped between lookup and delivery.
    pub(crate) async fn deliver(
        self: &Arc<Self>,
        run: RunId,
        input: Input,
    ) -> Result<Delivery, EngineError> {
        if self.shutting_down.load(Ordering::Acquire) {
            return Err(EngineError::Shutdown);
        }
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        let result = async {
            for _ in 0..DELIVERY_ATTEMPTS_MAX {
                let addr = self.actor_for(run);
                match addr.send(Deliver(input.clone())).await {
                    // Another actor of the same run committed first (after a
                    // passivation): the machine was thrown away; try again on
                    // a fresh replay.
                    Ok(Err(EngineError::Store(
                        keel_storage::Error::SeqGap { .. } | keel_storage::Error::CommitFailed(_),
                    ))) => continue,
                    Ok(r) => return r,
                    Err(MailboxError::Closed) | Err(MailboxError::Timeout) => {
                        self.forget(run, &addr)
                    }
                }
            }
            Err(EngineError::Shutdown)
        }
        .await;
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
        result
    }

    /// Delivers an input that must not be lost (an activity result, a timer
    /// fire, a child's outcome): retries with capped backoff until the run
    /// gives a final answer (committed, a duplicate, closed, parked, unknown)
    /// or the engine shuts down. The store still holds the work, so a restart
    /// recovers it either way.
    pub(crate) async fn deliver_until_final(self: &Arc<Self>, run: RunId, input: Input) {
        let mut delay_ms = 5u64;
        loop {
            match self.deliver(run, input.clone()).await {
                Ok(_)
                | Err(EngineError::Shutdown)
                | Err(EngineError::Parked { .. })
                | Err(EngineError::UnknownInstance(_))
                | Err(EngineError::RunClosed { .. }) => return,
                Err(e) => {
                    debug!(run_id = %run, error = %e, delay_ms, "delivery failed; retrying");
                    actix::clock::sleep(std::time::Duration::from_millis(delay_ms)).await;
                    delay_ms = (delay_ms * 2).min(DELIVERY_BACKOFF_MS_MAX);
                }
            }
        }
    }

    /// Creates a run from `spec` in a fresh actor.
    pub(crate) async fn create(
        self: &Arc<Self>,
        spec: StartSpec,
    ) -> Result<StartOutcome, EngineError> {
        if self.shutting_down.load(Ordering::Acquire) {
            return Err(EngineError::Shutdown);
        }
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        let run = spec.run_id;
        let addr = self.actor_for(run);
        let r = addr
            .send(Create(spec))
            .await
            .unwrap_or(Err(EngineError::Shutdown));
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
        r
    }

    pub(crate) fn wait_for(&self, run: RunId) -> oneshot::Receiver<Outcome> {
        let (tx, rx) = oneshot::channel();
        self.waiters.lock().entry(run).or_default().push(tx);
        rx
    }

    /// Effects of a closed run: answer waiters, deliver the outcome to a
    /// parent, start the continuation of a continue-as-new.
    pub(crate) fn run_closed(
        self: &Arc<Self>,
        run: RunId,
        outcome: Outcome,
        parent: Option<ParentRef>,
    ) {
        if let Some(ws) = self.waiters.lock().remove(&run) {
            for w in ws {
                let _ = w.send(outcome.clone());
            }
        }
        crate::concurrency::unbind_async(run);
        let this = self.clone();
        actix::spawn(async move { this.apply_close_policies(run).await });
        if let Some(p) = parent {
            let this = self.clone();
            actix::spawn(async move { this.deliver_child_result(p, run, outcome).await });
        } else if let Outcome::ContinuedAsNew(new_run) = &outcome {
            let this = self.clone();
            let new_run = *new_run;
            actix::spawn(async move { this.continue_run(run, new_run).await });
        }
    }

    /// Cancels an open child per its policy: terminate it, ask it to
    /// cancel, or leave it running.
    pub(crate) fn cancel_child(
        self: &Arc<Self>,
        parent: RunId,
        child: RunId,
        policy: keel_storage::ParentClosePolicy,
        why: &str,
    ) {
        let input = match policy {
            keel_storage::ParentClosePolicy::Terminate => Input::Terminate {
                reason: format!("{why} (parent {parent})"),
            },
            keel_storage::ParentClosePolicy::RequestCancel => Input::CancelRequested {
                reason: format!("{why} (parent {parent})"),
                command_id: None,
            },
            keel_storage::ParentClosePolicy::Abandon => return,
        };
        let this = self.clone();
        actix::spawn(async move {
            if let Err(e) = this.deliver(child, input).await {
                debug!(child = %child, error = %e, "child cancellation not delivered");
            }
        });
    }

    /// Applies each open child's parent close policy: terminate it, ask it
    /// to cancel, or leave it running.
    async fn apply_close_policies(self: Arc<Self>, run: RunId) {
        let Ok(history) = self.store.history(run) else {
            return;
        };
        for step in pending_steps(&history)
            .into_iter()
            .filter(|p| p.kind == "child")
        {
            let policy = history.iter().find_map(|e| match &e.kind {
                EventKind::ChildScheduled {
                    step: s,
                    close_policy,
                    ..
                } if *s == step.step => Some(*close_policy),
                _ => None,
            });
            let Some(child) = step.child_run else {
                continue;
            };
            let input = match policy {
                Some(keel_storage::ParentClosePolicy::Terminate) => Input::Terminate {
                    reason: format!("parent {run} closed"),
                },
                Some(keel_storage::ParentClosePolicy::RequestCancel) => Input::CancelRequested {
                    reason: format!("parent {run} closed"),
                    command_id: None,
                },
                _ => continue,
            };
            if let Err(e) = self.deliver(child, input).await {
                debug!(child = %child, error = %e, "close policy not applied");
            }
        }
    }

    async fn deliver_child_result(
        self: Arc<Self>,
        parent: ParentRef,
        child: RunId,
        outcome: Outcome,
    ) {
        let Some(input) = Input::child_closed(parent.step, child, outcome) else {
            return;
        };
        self.deliver_until_final(parent.run_id, input).await;
    }

    async fn continue_run(self: Arc<Self>, old: RunId, new_run: RunId) {
        let Ok(history) = self.store.history(old) else {
            return;
        };
        let Some(spec) = StartSpec::continuation(&history, new_run, self.random()) else {
            return;
        };
        if let Err(e) = self.create(spec).await {
            warn!(run = %new_run, error = %e, "continue-as-new run not started");
        }
    }

    /// Starts a child from an outbox message and tells the parent.
    pub(crate) async fn start_child(self: Arc<Self>, msg: OutboxMessage) {
        let OutboxMessage::StartChild {
            parent,
            child_instance_id,
            child_run_id,
            workflow_type,
            input,
        } = msg
        else {
            return;
        };
        let spec = StartSpec {
            run_id: child_run_id,
            instance_id: child_instance_id,
            workflow_type,
            input,
            command_id: None,
            parent: Some(parent.clone()),
            continued_from: None,
            random_seed: self.random(),
        };
        let mut delay_ms = 5u64;
        let input = loop {
            // A redelivered start of a child that already exists is a start.
            if let Ok(Some(_)) = self.store.run_meta(child_run_id) {
                break Input::ChildStarted {
                    step: parent.step,
                    child_run_id,
                };
            }
            match self.create(spec.clone()).await {
                Ok(_) => {
                    break Input::ChildStarted {
                        step: parent.step,
                        child_run_id,
                    }
                }
                // Only a child that can never start fails the parent's wait.
                Err(
                    e @ (EngineError::UnknownWorkflowType(_)
                    | EngineError::InvalidInput { .. }
                    | EngineError::WorkflowFailed(_)),
                ) => {
                    warn!(child = %child_run_id, error = %e, "child cannot start");
                    break Input::ChildFailed {
                        step: parent.step,
                        child_run_id,
                        failure: Failure::new(
                            keel_storage::FailureKind::Application,
                            format!("child did not start: {e}"),
                            false,
                        ),
                    };
                }
                Err(EngineError::Shutdown) => return,
                Err(e) => {
                    debug!(child = %child_run_id, error = %e, delay_ms, "child start failed; retrying");
                    actix::clock::sleep(std::time::Duration::from_millis(delay_ms)).await;
                    delay_ms = (delay_ms * 2).min(DELIVERY_BACKOFF_MS_MAX);
                }
            }
        };
        self.deliver_until_final(parent.run_id, input).await;
    }

    pub(crate) fn timers(&self) -> &Addr<TimerService> {
        self.timers
            .get()
            .expect("timer service starts with the engine")
    }

    pub(crate) fn workers(&self) -> &Addr<Workers> {
        self.workers.get().expect("workers start with the engine")
    }

    /// Effects of committed events (commit path step 5).
    pub(crate) fn effects(self: &Arc<Self>, run: RunId, events: &[keel_storage::Event]) {
        for e in events {
            match &e.kind {
                EventKind::ActivityScheduled {
                    step,
                    execution_id,
                    activity_type,
                    input,
                    options,
                    ..
                } => self.workers().do_send(Dispatch(AttemptTask {
                    run_id: run,
                    step: *step,
                    execution_id: *execution_id,
                    attempt: keel_storage::AttemptNo::FIRST,
                    activity_type: activity_type.clone(),
                    input: input.clone(),
                    options: options.clone(),
                    scheduled_at: e.at,
                })),
                EventKind::ActivityAttemptFailed {
                    step,
                    retry_at: Some(due),
                    ..
                } => match self.store.task(run, *step) {
                    Ok(Some(t)) => self.timers().do_send(ScheduleTask {
                        task: AttemptTask::from_entry(run, *step, &t),
                        due: *due,
                    }),
                    Ok(None) => {}
                    Err(err) => {
                        warn!(run_id = %run, step = step.0, error = %err, "retry not scheduled; restart recovers it")
                    }
                },
                EventKind::ActivityCancelRequested { step, .. } => {
                    self.workers().do_send(super::workers::CancelAttempt {
                        run_id: run,
                        step: *step,
                    })
                }
                EventKind::TimerStarted { step, fire_at, .. } => self.timers().do_send(Arm {
                    run_id: run,
                    step: *step,
                    fire_at: *fire_at,
                }),
                EventKind::ChildScheduled { .. } => {
                    if let Ok(Some(msg)) = self
                        .store
                        .run_meta(run)
                        .map(|m| m.map(|m| m.instance_id))
                        .map(|i| i.map(|instance_id| outbox_start(run, instance_id, &e.kind)))
                    {
                        let this = self.clone();
                        actix::spawn(async move { this.start_child(msg).await });
                    }
                }
                _ => {}
            }
        }
    }
}

fn outbox_start(run: RunId, instance_id: InstanceId, kind: &EventKind) -> OutboxMessage {
    match kind {
        EventKind::ChildScheduled {
            step,
            child_instance_id,
            child_run_id,
            workflow_type,
            input,
            close_policy,
            ..
        } => OutboxMessage::StartChild {
            parent: ParentRef {
                instance_id,
                run_id: run,
                step: *step,
                close_policy: *close_policy,
            },
            child_instance_id: child_instance_id.clone(),
            child_run_id: *child_run_id,
            workflow_type: workflow_type.clone(),
            input: input.clone(),
        },
        _ => unreachable!("called for ChildScheduled only"),
    }
}

/// A running engine. Dropping it shuts it down.
pub struct Engine {
    shared: Arc<Shared>,
    system: Option<actix::System>,
    thread: Option<std::thread::JoinHandle<()>>,
    activity_rt: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("workflows", &self.shared.workflows)
            .field("activities", &self.shared.activities)
            .finish()
    }
}

impl Engine {
    /// A builder with nothing registered.
    pub fn builder() -> EngineBuilder {
        EngineBuilder {
            data_dir: None,
            store: None,
            workflows: WorkflowRegistry::new(),
            activities: ActivityRegistry::new(),
            config: EngineConfig::default(),
            profiles: HashMap::new(),
        }
    }

    fn start(
        store: Arc<dyn Store>,
        workflows: WorkflowRegistry,
        activities: ActivityRegistry,
        config: EngineConfig,
        profiles: HashMap<String, Arc<keel_resilience::CompiledPipeline<Failure>>>,
    ) -> Result<Self, EngineError> {
        let activity_rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.activity_threads.max(1))
            .thread_name("keel-activity")
            .enable_all()
            .build()
            .map_err(keel_storage::Error::from)?;
        let rt_handle = activity_rt.handle().clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let seed_epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        let seed = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(7, |d| d.as_nanos() as u64)
            ^ (std::process::id() as u64) << 32;
        let thread = std::thread::Builder::new()
            .name("keel-engine".into())
            .spawn(move || {
                let sys = actix::System::new();
                let arbiters: Vec<Arbiter> = (0..config.arbiters.max(1))
                    .map(|_| Arbiter::new())
                    .collect();
                let handles = arbiters.iter().map(|a| a.handle()).collect();
                let shared = Arc::new(Shared {
                    store,
                    workflows,
                    activities,
                    config,
                    arbiters: handles,
                    runs: Mutex::new(RunTable::default()),
                    waiters: Mutex::new(HashMap::new()),
                    timers: OnceLock::new(),
                    workers: OnceLock::new(),
                    activity_rt: rt_handle,
                    profiles,
                    rng: Mutex::new(seed),
                    // Epochs stay increasing across restarts: start from the clock.
                    next_epoch: AtomicU64::new(seed_epoch),
                    in_flight: AtomicUsize::new(0),
                    shutting_down: AtomicBool::new(false),
                });
                let s2 = shared.clone();
                sys.block_on(async move {
                    let _ = s2.timers.set(TimerService::new(s2.clone()).start());
                    let _ = s2.workers.set(Workers::new(s2.clone()).start());
                });
                let _ = tx.send((shared, actix::System::current()));
                sys.run().ok();
                for a in arbiters {
                    a.stop();
                    let _ = a.join();
                }
            })
            .map_err(keel_storage::Error::from)?;
        let (shared, system) = rx.recv().map_err(|_| EngineError::Shutdown)?;
        let engine = Engine {
            shared,
            system: Some(system),
            thread: Some(thread),
            activity_rt: Some(activity_rt),
        };
        engine.recover()?;
        Ok(engine)
    }

    /// Re-arms durable work after a start: timers, pending attempts (with
    /// their backoff), outbox messages and continue-as-new hand-offs.
    fn recover(&self) -> Result<(), EngineError> {
        let s = &self.shared;
        let now = s.now();
        // Async children run closures their parents bind when they replay:
        // activate those parents before anything can reach the children.
        let async_children = s.store.runs(&RunFilter {
            status: Some(RunStatus::Running),
            workflow_type: Some(crate::concurrency::ASYNC_WORKFLOW_TYPE.to_string()),
            limit: None,
        })?;
        for child in async_children {
            if let Some(p) = child.parent {
                let addr = s.actor_for(p.run_id);
                if let Ok(Err(e)) = futures::executor::block_on(addr.send(Describe)) {
                    warn!(parent = %p.run_id, error = %e, "parent of an async child did not activate");
                }
            }
        }
        let timers = s.store.due_timers(Timestamp(u64::MAX), usize::MAX)?;
        let tasks = s.store.tasks(usize::MAX)?;
        let outbox = s.store.outbox(usize::MAX)?;
        info!(
            timers = timers.len(),
            tasks = tasks.len(),
            outbox = outbox.len(),
            "recovering durable work"
        );
        for t in timers {
            s.timers().do_send(Arm {
                run_id: t.run_id,
                step: t.step,
                fire_at: t.fire_at,
            });
        }
        for t in tasks {
            let task = AttemptTask::from_entry(t.execution_id.run_id, t.execution_id.step, &t);
            if t.due > now {
                s.timers().do_send(ScheduleTask { task, due: t.due });
            } else {
                s.workers().do_send(Dispatch(task));
            }
        }
        let system = self.system.as_ref().expect("running");
        for msg in outbox {
            let s2 = s.clone();
            match msg {
                OutboxMessage::StartChild { .. } => {
                    system
                        .arbiter()
                        .spawn(async move { s2.start_child(msg).await });
                }
                OutboxMessage::ChildResult {
                    parent,
                    child_run_id,
                    outcome,
                } => {
                    system.arbiter().spawn(async move {
                        s2.deliver_child_result(parent, child_run_id, outcome).await
                    });
                }
            }
        }
        let continued = s.store.runs(&RunFilter {
            status: Some(RunStatus::ContinuedAsNew),
            ..Default::default()
        })?;
        for m in continued {
            if let Some(Outcome::ContinuedAsNew(new_run)) = m.outcome {
                if s.store.run_meta(new_run)?.is_none() {
                    let s2 = s.clone();
                    system
                        .arbiter()
                        .spawn(async move { s2.continue_run(m.run_id, new_run).await });
                }
            }
        }
        Ok(())
    }

    /// A client for this engine.
    pub fn client(&self) -> Client {
        Client {
            shared: self.shared.clone(),
        }
    }

    /// The store (for inspection and tests).
    pub fn store(&self) -> Arc<dyn Store> {
        self.shared.store.clone()
    }

    /// Stops taking work, lets in-flight commits finish (up to `grace`),
    /// stops the actors and closes the store.
    pub fn shutdown(mut self, grace: Duration) {
        self.stop(grace);
    }

    fn stop(&mut self, grace: Duration) {
        self.shared.shutting_down.store(true, Ordering::Release);
        let deadline = std::time::Instant::now() + grace;
        while self.shared.in_flight.load(Ordering::Acquire) > 0
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(2));
        }
        if let Some(sys) = self.system.take() {
            sys.stop();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let Some(rt) = self.activity_rt.take() {
            rt.shutdown_background();
        }
        let _ = self.shared.store.sync();
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(5));
    }
}

/// A child run as its parent's history records it.
#[derive(Clone, Debug, Serialize)]
pub struct ChildView {
    /// The parent's step.
    pub step: Step,
    /// The child's run.
    pub run_id: RunId,
    /// The child's instance.
    pub instance_id: String,
    /// The child's workflow type.
    pub workflow_type: String,
    /// The child's status in the store.
    pub status: String,
}

/// One in-flight attempt and its lease.
#[derive(Clone, Debug, Serialize)]
pub struct AttemptView {
    /// The execution's step.
    pub step: Step,
    /// The attempt id.
    pub attempt_id: String,
    /// The lease owner.
    pub lease_owner: String,
    /// The lease's fencing epoch.
    pub epoch: u64,
    /// When the lease expires.
    pub expires_at: Timestamp,
    /// Deliveries of this attempt so far (1 + redeliveries).
    pub deliveries: u32,
    /// The resilience policy that refused or delayed the attempt, while it
    /// waits to be offered again (`expires_at` is then when it was refused).
    pub delayed_by: Option<String>,
}

/// What `describe` reports about a run.
#[derive(Clone, Debug, Serialize)]
pub struct RunDescription {
    /// The run.
    pub run_id: RunId,
    /// Its instance.
    pub instance_id: String,
    /// Its workflow type.
    pub workflow_type: String,
    /// Its status.
    pub status: String,
    /// Events in its history.
    pub history_len: u64,
    /// When it started.
    pub started_at: Timestamp,
    /// When it closed.
    pub closed_at: Option<Timestamp>,
    /// Its parent (run and step), for a child.
    pub parent: Option<(RunId, Step)>,
    /// Open durable waits with their group paths.
    pub pending: Vec<PendingStep>,
    /// Signals coroutines wait for (when the run is in memory).
    pub signal_waits: Vec<(String, usize)>,
    /// Live coroutines (when the run is in memory).
    pub coroutines: Option<usize>,
    /// Live scopes, in step order; `parent` gives the tree.
    pub scopes: Vec<crate::scope::ScopeView>,
    /// In-flight attempts and leases.
    pub attempts: Vec<AttemptView>,
    /// Children.
    pub children: Vec<ChildView>,
    /// Whether cancellation was requested.
    pub cancel_requested: bool,
    /// Why it is parked, if it is.
    pub parked: Option<ParkInfo>,
    /// Memo fields (latest value of each, as JSON text), e.g. progress.
    pub memo: Vec<(String, String)>,
}

fn memo_of(history: &[keel_storage::Event]) -> Vec<(String, String)> {
    let mut memo: BTreeMap<String, String> = BTreeMap::new();
    for e in history {
        if let EventKind::MemoUpserted { fields } = &e.kind {
            for (k, v) in fields {
                memo.insert(k.clone(), v.preview(200));
            }
        }
    }
    memo.into_iter().collect()
}

/// A cloneable handle for starting, signalling, awaiting and inspecting
/// workflows.
#[derive(Clone)]
pub struct Client {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Client")
    }
}

fn check_size(p: &Payload) -> Result<(), EngineError> {
    if p.len() > PAYLOAD_BYTES_MAX {
        return Err(EngineError::PayloadTooLarge {
            bytes: p.len(),
            max: PAYLOAD_BYTES_MAX,
        });
    }
    Ok(())
}

impl Client {
    fn resolve(&self, id: &str) -> Result<RunId, EngineError> {
        self.shared
            .store
            .resolve(id)?
            .ok_or_else(|| EngineError::UnknownInstance(id.to_string()))
    }

    /// Starts workflow `W` as `instance`. A second start of an instance
    /// with an open run returns that run.
    pub async fn start<W: Workflow>(
        &self,
        instance: &str,
        input: &W::Input,
    ) -> Result<StartOutcome, EngineError> {
        let payload = Payload::encode(input).map_err(|e| EngineError::Encode(e.to_string()))?;
        self.start_raw(W::NAME, instance, payload, None, ReusePolicy::default())
            .await
    }

    /// Starts a workflow by type name with a serialized input.
    pub async fn start_raw(
        &self,
        workflow_type: &str,
        instance: &str,
        input: Payload,
        command_id: Option<CommandId>,
        reuse: ReusePolicy,
    ) -> Result<StartOutcome, EngineError> {
        let w = self
            .shared
            .workflows
            .get(workflow_type)
            .ok_or_else(|| EngineError::UnknownWorkflowType(workflow_type.to_string()))?;
        check_size(&input)?;
        w.check_input(&input)
            .map_err(|detail| EngineError::InvalidInput {
                workflow_type: workflow_type.to_string(),
                detail,
            })?;
        let instance_id = InstanceId::new(instance);
        if let Some(cur) = self.shared.store.instance(&instance_id)? {
            if let Some(meta) = self.shared.store.run_meta(cur.current_run)? {
                // A retried start (same command id) of a run that has since
                // closed is the same start, whatever the reuse policy.
                if let Some(cmd) = &command_id {
                    let mut same = false;
                    self.shared
                        .store
                        .for_each_event(meta.run_id, keel_storage::Seq::FIRST, &mut |e| {
                            same = matches!(&e.kind, EventKind::WorkflowStarted { command_id: Some(c), .. } if c == cmd);
                            false
                        })?;
                    if same {
                        return Ok(StartOutcome::Existing(meta.run_id));
                    }
                }
                let refuse = match reuse {
                    _ if !meta.status.is_closed() => {
                        return Ok(StartOutcome::Existing(meta.run_id))
                    }
                    ReusePolicy::AllowDuplicate => false,
                    ReusePolicy::AllowDuplicateFailedOnly => meta.status == RunStatus::Completed,
                    ReusePolicy::RejectDuplicate => true,
                };
                if refuse {
                    return Err(EngineError::AlreadyClosed {
                        instance: instance_id,
                        run: meta.run_id,
                        status: meta.status.name(),
                    });
                }
            }
        }
        let spec = StartSpec {
            run_id: RunId::from_u64_pair(self.shared.random(), self.shared.random()),
            instance_id,
            workflow_type: workflow_type.to_string(),
            input,
            command_id,
            parent: None,
            continued_from: None,
            random_seed: self.shared.random(),
        };
        self.shared.create(spec).await
    }

    /// Sends a signal to the instance's current run; `command_id`
    /// deduplicates retries of the same signal.
    pub async fn signal<T: Serialize>(
        &self,
        instance: &str,
        name: &str,
        payload: &T,
        command_id: Option<&str>,
    ) -> Result<(), EngineError> {
        let payload = Payload::encode(payload).map_err(|e| EngineError::Encode(e.to_string()))?;
        check_size(&payload)?;
        let run = self.resolve(instance)?;
        let input = Input::Signal {
            name: name.to_string(),
            payload,
            command_id: command_id.map(CommandId::new),
        };
        match self.shared.deliver(run, input).await? {
            Delivery::Committed | Delivery::Dropped(crate::machine::Verdict::Duplicate) => Ok(()),
            Delivery::Dropped(crate::machine::Verdict::Closed) => {
                Err(EngineError::RunClosed { run })
            }
            Delivery::Dropped(_) => Ok(()),
        }
    }

    /// Requests cooperative cancellation; workflow code observes it.
    pub async fn cancel(&self, instance: &str, reason: &str) -> Result<(), EngineError> {
        let run = self.resolve(instance)?;
        self.shared
            .deliver(
                run,
                Input::CancelRequested {
                    reason: reason.to_string(),
                    command_id: None,
                },
            )
            .await
            .map(|_| ())
    }

    /// Terminates the current run without running workflow code.
    pub async fn terminate(&self, instance: &str, reason: &str) -> Result<(), EngineError> {
        let run = self.resolve(instance)?;
        match self
            .shared
            .deliver(
                run,
                Input::Terminate {
                    reason: reason.to_string(),
                },
            )
            .await?
        {
            Delivery::Dropped(crate::machine::Verdict::Closed) => {
                Err(EngineError::RunClosed { run })
            }
            _ => Ok(()),
        }
    }

    /// Waits for the instance's outcome, following continue-as-new.
    pub async fn outcome(&self, instance: &str) -> Result<Outcome, EngineError> {
        let mut run = self.resolve(instance)?;
        loop {
            let rx = self.shared.wait_for(run);
            let outcome = match self.shared.store.run_meta(run)? {
                Some(m) if m.status.is_closed() => {
                    m.outcome.unwrap_or(Outcome::Terminated("unknown".into()))
                }
                _ => rx.await.map_err(|_| EngineError::Shutdown)?,
            };
            match outcome {
                Outcome::ContinuedAsNew(next) => run = next,
                other => return Ok(other),
            }
        }
    }

    /// Waits for workflow `W`'s result.
    pub async fn result<W: Workflow>(&self, instance: &str) -> Result<W::Output, EngineError> {
        match self.outcome(instance).await? {
            Outcome::Completed(p) => p
                .decode()
                .map_err(|e| EngineError::ResultDecode(e.to_string())),
            Outcome::Failed(f) => Err(EngineError::WorkflowFailed(f)),
            Outcome::Cancelled(r) => Err(EngineError::WorkflowCancelled(r)),
            Outcome::Terminated(r) => Err(EngineError::WorkflowTerminated(r)),
            Outcome::ContinuedAsNew(_) => unreachable!("outcome() follows continue-as-new"),
        }
    }

    /// Status, pending steps with group paths, attempts and leases,
    /// children and parked reason of the instance's current run (or of a
    /// run given by id).
    pub async fn describe(&self, id: &str) -> Result<RunDescription, EngineError> {
        let run = self.resolve(id)?;
        let store = &self.shared.store;
        let meta = store
            .run_meta(run)?
            .ok_or_else(|| EngineError::UnknownInstance(id.to_string()))?;
        let history = store.history(run)?;
        let view: Option<MachineView> = if meta.status.is_closed() {
            None
        } else {
            let addr = self.shared.actor_for(run);
            addr.send(Describe).await.ok().and_then(Result::ok)
        };
        let attempts = if meta.status.is_closed() {
            Vec::new()
        } else {
            self.shared
                .workers()
                .send(Leases { run_id: run })
                .await
                .unwrap_or_default()
        };
        let mut kids = Vec::new();
        for c in children(&history) {
            let status = store
                .run_meta(c.run_id)?
                .map_or("not started".to_string(), |m| m.status.name().to_string());
            kids.push(ChildView {
                step: c.step,
                run_id: c.run_id,
                instance_id: c.instance_id,
                workflow_type: c.workflow_type,
                status,
            });
        }
        Ok(RunDescription {
            run_id: run,
            instance_id: meta.instance_id.to_string(),
            workflow_type: meta.workflow_type.clone(),
            status: meta.status.name().to_string(),
            history_len: meta.next_seq.0 - 1,
            started_at: meta.started_at,
            closed_at: meta.closed_at,
            parent: meta.parent.as_ref().map(|p| (p.run_id, p.step)),
            pending: pending_steps(&history),
            signal_waits: view
                .as_ref()
                .map(|v| v.signal_waits.clone())
                .unwrap_or_default(),
            coroutines: view.as_ref().map(|v| v.coroutines),
            scopes: view.as_ref().map(|v| v.scopes.clone()).unwrap_or_default(),
            attempts,
            children: kids,
            cancel_requested: meta.cancel_requested,
            parked: store.parked(run)?,
            memo: memo_of(&history),
        })
    }

    /// The store behind this client.
    pub fn store(&self) -> Arc<dyn Store> {
        self.shared.store.clone()
    }
}
