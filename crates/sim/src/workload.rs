//! Workloads: which workflows a simulation starts, when, and which signals
//! and cancels their clients send; plus the default mix `keel sim` runs.
//!
//! The default mix is a table of shapes ([`SHAPES`]), one entry per
//! feature. A new feature (parallel `all`, `select` with a deadline, nested
//! barriers, children, scopes) is one more entry: a workflow type, its mock
//! activities in [`register_default`], and a builder that plans instances
//! whose outcome does not depend on timing (the simulator compares every
//! outcome with a fault-free run).

use std::time::Duration;

use std::future::Future;

use keel_core::{
    Activity, ActivityContext, ActivityError, RetryPolicy, Workflow, WorkflowContext, WorkflowError,
};
use keel_storage::{CommandId, Payload};
use rand::RngExt;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::sim::{SimError, Simulation};

/// What a client sends to a started workflow.
#[derive(Clone, Debug, PartialEq)]
pub enum ClientOpKind {
    /// A signal; with a command id the client retries it until it is
    /// acknowledged (and the engine must deduplicate the retries).
    Signal {
        /// Signal name.
        name: String,
        /// Encoded payload.
        payload: Payload,
        /// Deduplication id.
        command_id: Option<CommandId>,
    },
    /// A cancellation request.
    Cancel {
        /// Why.
        reason: String,
        /// Deduplication id.
        command_id: Option<CommandId>,
    },
    /// An update, retried with the same id until answered; every answer
    /// must be the outcome durable for that id.
    Update {
        /// Handler name.
        name: String,
        /// Encoded arguments.
        payload: Payload,
        /// The update's id.
        update_id: CommandId,
    },
    /// A query of a `u64` value that only grows as updates complete: the
    /// answer must never exceed what the durable history supports
    /// ([`UPDATE_SUM_QUERY`]).
    Query {
        /// Handler name.
        name: String,
    },
    /// A message to a stream, retried with the same key until answered;
    /// every `Sent` answer must name the offset durable for that key.
    Send {
        /// The stream's name.
        stream: String,
        /// The idempotency key.
        key: String,
        /// Encoded payload.
        payload: Payload,
    },
    /// A list of the runs a filter matches: the page must hold exactly the
    /// runs whose durable histories match it when it is read.
    List {
        /// The filter, as `keel list --where` takes it.
        filter: String,
    },
}

/// The query of the `updates` shape: the sum of its completed updates.
pub const UPDATE_SUM_QUERY: &str = "sum";

/// One client request, sent at `at_ms` of virtual time (or once the start is
/// acknowledged, if that is later).
#[derive(Clone, Debug, PartialEq)]
pub struct ClientOp {
    /// When the client sends it, in virtual milliseconds.
    pub at_ms: u64,
    /// What it sends.
    pub kind: ClientOpKind,
}

/// One workflow instance to start and drive.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkflowPlan {
    /// The instance id.
    pub instance: String,
    /// The registered workflow type.
    pub workflow_type: String,
    /// Encoded input.
    pub input: Payload,
    /// When the client starts it.
    pub start_at_ms: u64,
    /// What the client sends after the start.
    pub ops: Vec<ClientOp>,
    /// Whether the workflow ignores cancellation (so a stray cancel cannot
    /// change its outcome and the simulator may send one).
    pub ignores_cancel: bool,
    /// A signal sent with the start (signal-with-start): committed with
    /// the run's start, or to the open run.
    pub start_signal: Option<ClientOpKind>,
    /// Search attributes the run starts with (each a `SearchValue`
    /// payload).
    pub search_attributes: Vec<(String, Payload)>,
    /// The run and execution timeouts it starts with.
    pub timeouts: keel_storage::StartTimeouts,
}

/// The instances a simulation runs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Workload {
    pub(crate) plans: Vec<WorkflowPlan>,
    pub(crate) error: Option<String>,
}

impl Workload {
    /// An empty workload.
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts workflow `W` as `instance` at time 0.
    pub fn start<W: Workflow>(self, instance: &str, input: &W::Input) -> Self {
        self.start_at::<W>(instance, input, 0)
    }

    /// Starts workflow `W` as `instance` at `at_ms`.
    pub fn start_at<W: Workflow>(mut self, instance: &str, input: &W::Input, at_ms: u64) -> Self {
        match Payload::encode(input) {
            Ok(input) => self.plans.push(WorkflowPlan {
                instance: instance.to_string(),
                workflow_type: W::NAME.to_string(),
                input,
                start_at_ms: at_ms,
                ops: Vec::new(),
                ignores_cancel: false,
                start_signal: None,
                search_attributes: Vec::new(),
                timeouts: Default::default(),
            }),
            Err(e) => self.fail(format!("input of {instance} does not encode: {e}")),
        }
        self
    }

    /// Sends signal `name` to `instance` at `at_ms`, with `command_id` as
    /// its deduplication id (the client retries it until acknowledged).
    pub fn signal<T: Serialize>(
        mut self,
        instance: &str,
        name: &str,
        payload: &T,
        at_ms: u64,
        command_id: &str,
    ) -> Self {
        match Payload::encode(payload) {
            Ok(payload) => self.push_op(
                instance,
                ClientOp {
                    at_ms,
                    kind: ClientOpKind::Signal {
                        name: name.to_string(),
                        payload,
                        command_id: Some(CommandId::new(command_id)),
                    },
                },
            ),
            Err(e) => self.fail(format!("signal {name} payload does not encode: {e}")),
        }
        self
    }

    /// Requests cancellation of `instance` at `at_ms`.
    pub fn cancel(mut self, instance: &str, reason: &str, at_ms: u64, command_id: &str) -> Self {
        self.push_op(
            instance,
            ClientOp {
                at_ms,
                kind: ClientOpKind::Cancel {
                    reason: reason.to_string(),
                    command_id: Some(CommandId::new(command_id)),
                },
            },
        );
        self
    }

    /// Marks `instance` as ignoring cancellation, so the `stray-command`
    /// fault may also send it cancels.
    pub fn ignores_cancel(mut self, instance: &str) -> Self {
        if let Some(p) = self.plans.iter_mut().find(|p| p.instance == instance) {
            p.ignores_cancel = true;
        }
        self
    }

    /// Adds a whole plan.
    pub fn plan(mut self, plan: WorkflowPlan) -> Self {
        if self.plans.iter().any(|p| p.instance == plan.instance) {
            self.fail(format!("instance {} is planned twice", plan.instance));
        }
        self.plans.push(plan);
        self
    }

    /// The planned instances.
    pub fn plans(&self) -> &[WorkflowPlan] {
        &self.plans
    }

    /// Only the instances at `indices` (out-of-range ones are ignored).
    pub fn subset(&self, indices: &[usize]) -> Workload {
        Workload {
            plans: indices
                .iter()
                .filter_map(|i| self.plans.get(*i).cloned())
                .collect(),
            error: self.error.clone(),
        }
    }

    fn push_op(&mut self, instance: &str, op: ClientOp) {
        match self.plans.iter_mut().find(|p| p.instance == instance) {
            Some(p) => p.ops.push(op),
            None => self.fail(format!(
                "{instance} is not started by this workload (start it first)"
            )),
        }
    }

    fn fail(&mut self, msg: String) {
        self.error.get_or_insert(msg);
    }

    pub(crate) fn check(&self) -> Result<(), SimError> {
        match &self.error {
            Some(e) => Err(SimError::Workload(e.clone())),
            None => Ok(()),
        }
    }

    /// The default mix: `workflows` instances, every shape at least once
    /// when there are enough, the rest drawn by weight.
    pub fn default_mix(rng: &mut ChaCha8Rng, workflows: usize) -> Workload {
        let mut w = Workload::new();
        let total: u32 = SHAPES.iter().map(|s| s.weight).sum();
        for i in 0..workflows {
            let shape = if let Some(shape) = SHAPES.get(i) {
                shape
            } else {
                let mut pick = rng.random_range(0..total);
                SHAPES
                    .iter()
                    .find(|s| {
                        if pick < s.weight {
                            true
                        } else {
                            pick -= s.weight;
                            false
                        }
                    })
                    .expect("the pick is below the total weight")
            };
            let plan = (shape.build)(rng, &format!("{}-{i}", shape.name));
            w.plans.push(plan);
        }
        w
    }
}

/// One entry of the default mix.
#[derive(Debug)]
pub struct Shape {
    /// Name, used as the instance id prefix.
    pub name: &'static str,
    /// Relative frequency.
    pub weight: u32,
    /// Plans one instance.
    pub build: fn(&mut ChaCha8Rng, &str) -> WorkflowPlan,
}

/// The default mix, one entry per feature.
pub const SHAPES: &[Shape] = &[
    Shape {
        name: "sequential",
        weight: 3,
        build: plan_sequential,
    },
    Shape {
        name: "signals",
        weight: 2,
        build: plan_signals,
    },
    Shape {
        name: "timers",
        weight: 2,
        build: plan_timers,
    },
    Shape {
        name: "retries",
        weight: 2,
        build: plan_retries,
    },
    Shape {
        name: "cancel",
        weight: 1,
        build: plan_cancel,
    },
    Shape {
        name: "continue",
        weight: 1,
        build: plan_continue,
    },
    Shape {
        name: "all",
        weight: 2,
        build: plan_all,
    },
    Shape {
        name: "select-deadline",
        weight: 2,
        build: plan_select,
    },
    Shape {
        name: "nested-barriers",
        weight: 1,
        build: plan_nested,
    },
    Shape {
        name: "children",
        weight: 2,
        build: plan_children,
    },
    Shape {
        name: "scopes",
        weight: 2,
        build: plan_scopes,
    },
    Shape {
        name: "close-policy",
        weight: 2,
        build: plan_close_policy,
    },
    Shape {
        name: "scope-children",
        weight: 2,
        build: plan_scope_children,
    },
    Shape {
        name: "select-cancel",
        weight: 2,
        build: plan_select_cancel,
    },
    Shape {
        name: "conditions",
        weight: 2,
        build: plan_conditions,
    },
    Shape {
        name: "async-closure",
        weight: 1,
        build: plan_async,
    },
    Shape {
        name: "heartbeats",
        weight: 2,
        build: plan_heartbeats,
    },
    Shape {
        name: "timeouts",
        weight: 2,
        build: plan_timeouts,
    },
    Shape {
        name: "guarded",
        weight: 2,
        build: plan_guarded,
    },
    Shape {
        name: "updates",
        weight: 2,
        build: plan_updates,
    },
    Shape {
        name: "search",
        weight: 2,
        build: plan_search,
    },
    Shape {
        name: "stream",
        weight: 2,
        build: plan_stream,
    },
    Shape {
        name: "relay",
        weight: 2,
        build: plan_relay,
    },
    Shape {
        name: "schedule",
        weight: 2,
        build: plan_schedule,
    },
    Shape {
        name: "deadline",
        weight: 2,
        build: plan_deadline,
    },
    Shape {
        name: "cancel-types",
        weight: 2,
        build: plan_cancel_types,
    },
];

/// The resilience profile of the `guarded` shape: a retry policy of its
/// own, an attempt timeout, a circuit breaker, a rate limit and a bulkhead,
/// and a fallback, on the simulator's virtual clock.
pub const GUARDED_PROFILE: &str = "sim.guarded";

fn guarded_profile(
    clock: std::sync::Arc<keel_resilience::ManualClock>,
) -> keel_resilience::CompiledPipeline<keel_storage::Failure> {
    use keel_resilience::{
        AttemptTimeoutRequirement, BackoffMode, Builder, Classifier, JitterMode,
    };
    let classifier = Classifier::<keel_storage::Failure>::new()
        .retry_on(|f: &keel_storage::Failure| f.retryable)
        .retry_on_attempt_timeout()
        .fallback_on(|f: &keel_storage::Failure| !f.retryable);
    Builder::profile("sim-guarded", "v1")
        .partition("sim", "test", "guarded")
        .attempt_timeout(
            Duration::from_millis(500),
            AttemptTimeoutRequirement::Cooperative,
        )
        .retry(
            6,
            BackoffMode::Exponential,
            Duration::from_millis(10),
            Duration::from_millis(200),
            JitterMode::Full,
        )
        .rate_limit(Builder::token_bucket(20, 20, Duration::from_millis(100)))
        .circuit_breaker(
            Builder::last_calls(20),
            10,
            keel_resilience::Ratio::of(19, 20),
            Duration::from_millis(50),
            1,
            1,
            Duration::from_millis(200),
        )
        .bulkhead(4, 0)
        .fallback()
        .compile_in_memory_with(classifier, clock, 7)
        .expect("the sim profile is valid")
}

/// Registers the default mix's workflows and mock activities.
pub fn register_default(sim: Simulation) -> Simulation {
    sim.register_workflow::<SequentialWf>()
        .register_workflow::<SignalsWf>()
        .register_workflow::<TimersWf>()
        .register_workflow::<RetriesWf>()
        .register_workflow::<CancelWf>()
        .register_workflow::<LoopWf>()
        .register_workflow::<ParallelWf>()
        .register_workflow::<SelectWf>()
        .register_workflow::<NestedWf>()
        .register_workflow::<ChildrenWf>()
        .register_workflow::<ScopesWf>()
        .register_workflow::<ClosePolicyWf>()
        .register_workflow::<WaitForeverWf>()
        .register_workflow::<ScopeChildrenWf>()
        .register_workflow::<SelectCancelWf>()
        .register_workflow::<ConditionsWf>()
        .register_workflow::<AsyncWf>()
        .register_workflow::<HeartbeatsWf>()
        .register_workflow::<TimeoutsWf>()
        .register_workflow::<GuardedWf>()
        .register_workflow::<UpdatesWf>()
        .register_workflow::<SearchWf>()
        .register_workflow::<StreamWf>()
        .register_workflow::<RelayWf>()
        .register_workflow::<DeadlineWf>()
        .register_workflow::<CancelTypesWf>()
        .mock_activity::<Transform, _>(|x, _| Ok(transform(x)))
        .mock_activity::<Flaky, _>(|input, attempt| flaky(&input, attempt))
        .mock_fallback::<Flaky, _>(|input| input.value + 100)
        .mock_activity_taking::<Long, _>(60..=240, |x, _| Ok(transform(x)))
        .resilience_profile(GUARDED_PROFILE, guarded_profile)
}

fn plan(rng: &mut ChaCha8Rng, instance: &str, workflow_type: &str, input: Payload) -> WorkflowPlan {
    WorkflowPlan {
        instance: instance.to_string(),
        workflow_type: workflow_type.to_string(),
        input,
        start_at_ms: rng.random_range(0..500),
        ops: Vec::new(),
        ignores_cancel: true,
        start_signal: None,
        search_attributes: Vec::new(),
        timeouts: Default::default(),
    }
}

fn encode<T: Serialize>(v: &T) -> Payload {
    Payload::encode(v).expect("the default workload's inputs always encode")
}

fn plan_sequential(rng: &mut ChaCha8Rng, instance: &str) -> WorkflowPlan {
    let input = SeqIn {
        value: rng.random_range(0..1000),
        steps: rng.random_range(1..=4),
    };
    plan(rng, instance, SequentialWf::NAME, encode(&input))
}

fn plan_signals(rng: &mut ChaCha8Rng, instance: &str) -> WorkflowPlan {
    let count: u32 = rng.random_range(1..=3);
    let mut p = plan(rng, instance, SignalsWf::NAME, encode(&count));
    for k in 0..count {
        let command_id = Some(CommandId::new(format!("{instance}/sig-{k}")));
        let payload = encode(&rng.random_range(1u64..100));
        let at_ms = p.start_at_ms + rng.random_range(0..1500);
        let sends = if rng.random_bool(0.5) { 2 } else { 1 };
        if k == 0 && rng.random_bool(0.5) {
            // Signal-with-start: the first signal rides on the start (and
            // its retries).
            p.start_signal = Some(ClientOpKind::Signal {
                name: "add".into(),
                payload: payload.clone(),
                command_id: command_id.clone(),
            });
            continue;
        }
        for extra in 0..sends {
            // A second send with the same command id: a client retry that
            // the engine must deduplicate.
            p.ops.push(ClientOp {
                at_ms: at_ms + extra * rng.random_range(0..400),
                kind: ClientOpKind::Signal {
                    name: "add".into(),
                    payload: payload.clone(),
                    command_id: command_id.clone(),
                },
            });
        }
    }
    p
}

fn plan_timers(rng: &mut ChaCha8Rng, instance: &str) -> WorkflowPlan {
    let n = rng.random_range(1..=3);
    let input = TimersIn {
        value: rng.random_range(0..1000),
        delays_ms: (0..n).map(|_| rng.random_range(1..2000)).collect(),
    };
    plan(rng, instance, TimersWf::NAME, encode(&input))
}

fn plan_retries(rng: &mut ChaCha8Rng, instance: &str) -> WorkflowPlan {
    let value = rng.random_range(0..1000);
    let input = match rng.random_range(0..4) {
        // Fails its first attempts, then succeeds; one attempt is kept
        // spare so that injected failures cannot exhaust the policy.
        0 | 1 => {
            let fail_first = rng.random_range(1..=3);
            RetriesIn {
                value,
                fail_first,
                attempts_max: fail_first + 2,
            }
        }
        // Never succeeds: the policy runs out and the workflow fails.
        2 => RetriesIn {
            value,
            fail_first: u32::MAX,
            attempts_max: rng.random_range(1..=3),
        },
        // A failure no retry helps: fails at once.
        _ => RetriesIn {
            value,
            fail_first: FATAL,
            attempts_max: 3,
        },
    };
    plan(rng, instance, RetriesWf::NAME, encode(&input))
}

fn plan_cancel(rng: &mut ChaCha8Rng, instance: &str) -> WorkflowPlan {
    let steps = rng.random_range(1..=4);
    let mut p = plan(rng, instance, CancelWf::NAME, encode(&steps));
    p.ignores_cancel = false;
    let at_ms = p.start_at_ms + rng.random_range(0..800);
    let command_id = Some(CommandId::new(format!("{instance}/cancel")));
    for extra in 0..2 {
        p.ops.push(ClientOp {
            at_ms: at_ms + extra * rng.random_range(0..300),
            kind: ClientOpKind::Cancel {
                reason: "client cancelled".into(),
                command_id: command_id.clone(),
            },
        });
    }
    p
}

fn plan_continue(rng: &mut ChaCha8Rng, instance: &str) -> WorkflowPlan {
    let input = LoopIn {
        iteration: 0,
        iterations: rng.random_range(2..=3),
        value: rng.random_range(0..1000),
    };
    plan(rng, instance, LoopWf::NAME, encode(&input))
}

fn plan_all(rng: &mut ChaCha8Rng, instance: &str) -> WorkflowPlan {
    let n = rng.random_range(2..=5);
    let values: Vec<u64> = (0..n).map(|_| rng.random_range(0..1000)).collect();
    plan(rng, instance, ParallelWf::NAME, encode(&values))
}

fn plan_select(rng: &mut ChaCha8Rng, instance: &str) -> WorkflowPlan {
    let input = SelectIn {
        value: rng.random_range(0..1000),
        timer_wins: rng.random_bool(0.5),
        deadline_ms: rng.random_range(10..1500),
    };
    plan(rng, instance, SelectWf::NAME, encode(&input))
}

fn plan_nested(rng: &mut ChaCha8Rng, instance: &str) -> WorkflowPlan {
    let input = NestedIn {
        value: rng.random_range(0..1000),
        fail_first: rng.random_range(0..=2),
    };
    plan(rng, instance, NestedWf::NAME, encode(&input))
}

fn plan_children(rng: &mut ChaCha8Rng, instance: &str) -> WorkflowPlan {
    let n = rng.random_range(1..=3);
    let values: Vec<u64> = (0..n).map(|_| rng.random_range(0..1000)).collect();
    plan(rng, instance, ChildrenWf::NAME, encode(&values))
}

fn plan_scopes(rng: &mut ChaCha8Rng, instance: &str) -> WorkflowPlan {
    let n = rng.random_range(2..=6);
    let input = ScopesIn {
        values: (0..n).map(|_| rng.random_range(0..1000)).collect(),
        workers: rng.random_range(1..=3),
        capacity: rng.random_range(0..=2),
        bad: rng.random_bool(0.3).then(|| rng.random_range(0..n as u32)),
    };
    plan(rng, instance, ScopesWf::NAME, encode(&input))
}

fn plan_close_policy(rng: &mut ChaCha8Rng, instance: &str) -> WorkflowPlan {
    let input = ClosePolicyIn {
        value: rng.random_range(0..1000),
        terminate: rng.random_bool(0.7),
        request_cancel: rng.random_bool(0.5),
        abandon: rng.random_bool(0.3),
    };
    plan(rng, instance, ClosePolicyWf::NAME, encode(&input))
}

fn plan_scope_children(rng: &mut ChaCha8Rng, instance: &str) -> WorkflowPlan {
    let input = ScopeChildrenIn {
        value: rng.random_range(0..1000),
        children: rng.random_range(1..=3),
        wait_ms: rng.random_range(1..=50),
    };
    plan(rng, instance, ScopeChildrenWf::NAME, encode(&input))
}

fn plan_select_cancel(rng: &mut ChaCha8Rng, instance: &str) -> WorkflowPlan {
    let input = SelectCancelIn {
        value: rng.random_range(0..1000),
        barrier: rng.random_bool(0.5),
    };
    plan(rng, instance, SelectCancelWf::NAME, encode(&input))
}

fn plan_conditions(rng: &mut ChaCha8Rng, instance: &str) -> WorkflowPlan {
    let count = rng.random_range(1..=4u32);
    let mut p = plan(rng, instance, ConditionsWf::NAME, encode(&count));
    let start = p.start_at_ms;
    for i in 0..count {
        let at = start + rng.random_range(1..=800);
        p.ops.push(ClientOp {
            at_ms: at,
            kind: ClientOpKind::Signal {
                name: "bump".into(),
                payload: encode(&(u64::from(i) + 1)),
                command_id: Some(CommandId::new(format!("{instance}/bump/{i}"))),
            },
        });
    }
    p
}

fn plan_updates(rng: &mut ChaCha8Rng, instance: &str) -> WorkflowPlan {
    let count = rng.random_range(1..=3u32);
    let mut p = plan(rng, instance, UpdatesWf::NAME, encode(&count));
    let start = p.start_at_ms;
    let update = |p: &mut WorkflowPlan, at_ms: u64, amount: u64, id: String| {
        p.ops.push(ClientOp {
            at_ms,
            kind: ClientOpKind::Update {
                name: "add".into(),
                payload: encode(&amount),
                update_id: CommandId::new(id),
            },
        })
    };
    for i in 0..count {
        let at = start + rng.random_range(1..=800);
        let amount = rng.random_range(1..100u64);
        let id = format!("{instance}/add/{i}");
        update(&mut p, at, amount, id.clone());
        if rng.random_bool(0.5) {
            // The same update again: the first outcome, committed once.
            update(&mut p, at + rng.random_range(0..400), amount, id);
        }
    }
    // Refused by the validator: nothing is written.
    let at = start + rng.random_range(1..=800);
    update(&mut p, at, 0, format!("{instance}/add/zero"));
    for _ in 0..2 {
        p.ops.push(ClientOp {
            at_ms: start + rng.random_range(1..=1200),
            kind: ClientOpKind::Query {
                name: UPDATE_SUM_QUERY.into(),
            },
        });
    }
    p
}

fn plan_search(rng: &mut ChaCha8Rng, instance: &str) -> WorkflowPlan {
    let input = SearchIn {
        value: rng.random_range(0..1000),
        stages: rng.random_range(1..=3),
        continue_once: rng.random_bool(0.5),
    };
    let mut p = plan(rng, instance, SearchWf::NAME, encode(&input));
    p.search_attributes = vec![(
        "customer".into(),
        keel_storage::SearchValue::from(instance).to_payload(),
    )];
    let start = p.start_at_ms;
    let filters = [
        format!("customer = {instance:?}"),
        format!("customer = {instance:?} and status = running"),
        "stage >= 1 and type = sim.search".to_string(),
        format!("done = true and customer != {instance:?}"),
        "status = completed and type = sim.search".to_string(),
        // Every open run of every shape, mid-way through its history:
        // each listed run's progress is checked against its events.
        "status = running".to_string(),
    ];
    for _ in 0..2 {
        p.ops.push(ClientOp {
            at_ms: start + rng.random_range(0..=1500),
            kind: ClientOpKind::List {
                filter: filters[rng.random_range(0..filters.len())].clone(),
            },
        });
    }
    p
}

/// The stream the `stream` shape reads.
pub const STREAM_SHAPE_STREAM: &str = "items";

fn plan_stream(rng: &mut ChaCha8Rng, instance: &str) -> WorkflowPlan {
    let count = rng.random_range(2..=6u32);
    let input = StreamIn {
        count,
        continue_after: rng.random_bool(0.5).then(|| rng.random_range(1..count)),
        read: 0,
        sum: 0,
    };
    let mut p = plan(rng, instance, StreamWf::NAME, encode(&input));
    let start = p.start_at_ms;
    for i in 0..count {
        let value = rng.random_range(1..1000u64);
        let at = start + rng.random_range(1..=1000);
        let send = ClientOpKind::Send {
            stream: STREAM_SHAPE_STREAM.into(),
            key: format!("{instance}/item/{i}"),
            payload: encode(&value),
        };
        p.ops.push(ClientOp {
            at_ms: at,
            kind: send.clone(),
        });
        if rng.random_bool(0.4) {
            // The same message again (a client that lost the answer):
            // committed once, answered with the first offset.
            p.ops.push(ClientOp {
                at_ms: at + rng.random_range(0..600),
                kind: send,
            });
        }
    }
    p
}

fn plan_relay(rng: &mut ChaCha8Rng, instance: &str) -> WorkflowPlan {
    let input = RelayIn {
        values: (0..rng.random_range(1..=4))
            .map(|_| rng.random_range(1..1000))
            .collect(),
        to_nobody: rng.random_bool(0.3),
    };
    plan(rng, instance, RelayWf::NAME, encode(&input))
}

/// A schedule (keel's own `keel.schedule` workflow) triggering
/// [`SequentialWf`] every second for two to four seconds after its planned
/// start. Its calendar window is fixed when planned (the cursor starts at
/// the planned start, and a late start catches up), and its policy starts
/// every trigger (`AllowAll`, or `BufferAll` one after another), so its
/// outcome (the counters) does not depend on timing. The checker holds
/// each trigger time to one start.
fn plan_schedule(rng: &mut ChaCha8Rng, instance: &str) -> WorkflowPlan {
    use keel_core::schedule::{
        schedule_instance, OverlapPolicy, ScheduleAction, ScheduleInput, SchedulePolicies,
        ScheduleSpec,
    };
    // Not 0: a cursor of 0 means "from the schedule's creation".
    let start = rng.random_range(1..500u64);
    let triggers = rng.random_range(2..=4u64);
    let seq = SeqIn {
        value: rng.random_range(0..1000),
        steps: rng.random_range(1..=3),
    };
    let overlap = match rng.random_bool(0.5) {
        true => OverlapPolicy::AllowAll,
        false => OverlapPolicy::BufferAll,
    };
    let input = ScheduleInput {
        id: instance.to_string(),
        spec: ScheduleSpec::every(Duration::from_secs(1))
            .ending_at(keel_storage::Timestamp(start + triggers * 1000)),
        action: ScheduleAction {
            workflow_type: SequentialWf::NAME.to_string(),
            input: encode(&seq),
            ..ScheduleAction::default()
        },
        policies: SchedulePolicies {
            overlap,
            catchup_window_ms: 3_600_000,
        },
        cursor: keel_storage::Timestamp(start),
        ..ScheduleInput::default()
    };
    let mut p = plan(
        rng,
        schedule_instance(instance).as_str(),
        keel_core::schedule::SCHEDULE_WORKFLOW_TYPE,
        encode(&input),
    );
    p.start_at_ms = start;
    p
}

/// A workflow that can only end by a timeout: a run that waits for a
/// signal nobody sends (run timeout), a chain that continues as new every
/// 300 ms (execution timeout), or a parent whose child waits forever under
/// a run timeout (the parent returns the failure's kind). The outcome does
/// not depend on timing; the checker holds each close to its deadline.
fn plan_deadline(rng: &mut ChaCha8Rng, instance: &str) -> WorkflowPlan {
    let input = match rng.random_range(0..3) {
        0 => DeadlineIn::Wait,
        1 => DeadlineIn::Chain(0),
        _ => DeadlineIn::Parent(rng.random_range(200..2_000)),
    };
    let mut p = plan(rng, instance, DeadlineWf::NAME, encode(&input));
    match input {
        DeadlineIn::Wait => p.timeouts.run_ms = Some(rng.random_range(200..3_000)),
        DeadlineIn::Chain(_) => p.timeouts.execution_ms = Some(rng.random_range(500..3_000)),
        DeadlineIn::Parent(_) => {}
    }
    p
}

fn plan_cancel_types(rng: &mut ChaCha8Rng, instance: &str) -> WorkflowPlan {
    let value: u64 = rng.random_range(0..1000);
    plan(rng, instance, CancelTypesWf::NAME, encode(&value))
}

fn plan_async(rng: &mut ChaCha8Rng, instance: &str) -> WorkflowPlan {
    let values: Vec<u64> = (0..rng.random_range(1..=3))
        .map(|_| rng.random_range(0..1000))
        .collect();
    plan(rng, instance, AsyncWf::NAME, encode(&values))
}

fn plan_heartbeats(rng: &mut ChaCha8Rng, instance: &str) -> WorkflowPlan {
    let value: u64 = rng.random_range(0..1000);
    plan(rng, instance, HeartbeatsWf::NAME, encode(&value))
}

fn plan_timeouts(rng: &mut ChaCha8Rng, instance: &str) -> WorkflowPlan {
    let value: u64 = rng.random_range(0..1000);
    plan(rng, instance, TimeoutsWf::NAME, encode(&value))
}

fn plan_guarded(rng: &mut ChaCha8Rng, instance: &str) -> WorkflowPlan {
    let input = FlakyIn {
        value: rng.random_range(0..1000),
        fail_first: if rng.random_bool(0.2) {
            FATAL
        } else {
            rng.random_range(0..=3)
        },
    };
    plan(rng, instance, GuardedWf::NAME, encode(&input))
}

/// `fail_first` value that makes [`Flaky`] fail with a non-retryable error.
pub const FATAL: u32 = u32::MAX - 1;

fn transform(x: u64) -> u64 {
    x.wrapping_mul(3).wrapping_add(1) % 1_000_003
}

fn flaky(input: &FlakyIn, attempt: u32) -> Result<u64, ActivityError> {
    if input.fail_first == FATAL {
        Err(ActivityError::fatal("flaky: broken by design"))
    } else if attempt <= input.fail_first {
        Err(ActivityError::retryable("flaky: attempt failed"))
    } else {
        Ok(input.value + 100)
    }
}

/// Activity `sim.transform`: a pure function of its input.
#[derive(Debug, Default)]
pub struct Transform;

impl Activity for Transform {
    const NAME: &'static str = "sim.transform";
    type Input = u64;
    type Output = u64;

    async fn run(&self, _ctx: ActivityContext, x: u64) -> Result<u64, ActivityError> {
        Ok(transform(x))
    }
}

/// Input of [`Flaky`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct FlakyIn {
    /// The value.
    pub value: u64,
    /// Attempts that fail before one succeeds ([`FATAL`]: fail fatally).
    pub fail_first: u32,
}

/// Activity `sim.flaky`: fails its first attempts.
#[derive(Debug, Default)]
pub struct Flaky;

impl Activity for Flaky {
    const NAME: &'static str = "sim.flaky";
    type Input = FlakyIn;
    type Output = u64;

    async fn run(&self, ctx: ActivityContext, input: FlakyIn) -> Result<u64, ActivityError> {
        flaky(&input, ctx.attempt().0)
    }
}

/// Input of [`SequentialWf`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SeqIn {
    /// Start value.
    pub value: u64,
    /// Activities in sequence.
    pub steps: u32,
}

/// `sim.sequential`: activities one after another.
#[derive(Debug)]
pub struct SequentialWf;

impl Workflow for SequentialWf {
    const NAME: &'static str = "sim.sequential";
    type Input = SeqIn;
    type Output = u64;

    async fn run(ctx: WorkflowContext, input: SeqIn) -> Result<u64, WorkflowError> {
        let mut v = input.value;
        for _ in 0..input.steps {
            v = ctx.activity::<Transform>(v).await?;
        }
        Ok(v)
    }
}

/// `sim.updates`: accepts `count` updates named `add` (validated: the
/// amount is not 0), each of which transforms its amount in an activity
/// and adds it to a sum the query `sum` reads; returns the sum.
#[derive(Debug)]
pub struct UpdatesWf;

impl Workflow for UpdatesWf {
    const NAME: &'static str = "sim.updates";
    type Input = u32;
    type Output = u64;

    async fn run(ctx: WorkflowContext, count: u32) -> Result<u64, WorkflowError> {
        use std::cell::Cell;
        use std::rc::Rc;
        let sum = Rc::new(Cell::new(0u64));
        let done = Rc::new(Cell::new(0u32));
        let view = sum.clone();
        ctx.on_query(UPDATE_SUM_QUERY, move |_: ()| view.get());
        let (handler_ctx, add, counted) = (ctx.clone(), sum.clone(), done.clone());
        ctx.on_update(
            "add",
            |amount: &u64| match amount {
                0 => Err("zero is not an amount".to_string()),
                _ => Ok(()),
            },
            move |amount: u64| {
                let (ctx, add, counted) = (handler_ctx.clone(), add.clone(), counted.clone());
                async move {
                    let y = ctx.activity::<Transform>(amount).await?;
                    add.set(add.get() + y);
                    counted.set(counted.get() + 1);
                    Ok(y)
                }
            },
        );
        let finished = done.clone();
        ctx.condition(move || finished.get() >= count).await;
        Ok(sum.get())
    }
}

/// Input of [`SearchWf`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SearchIn {
    /// The value transformed at each stage.
    pub value: u64,
    /// Stages, each an activity.
    pub stages: u32,
    /// Continue as new once after the first stage (the next run must have
    /// the search attributes and memo carried).
    pub continue_once: bool,
}

/// `sim.search`: started with the search attribute `customer`; sets
/// `stage` and a memo before each stage's activity, `done = true` at the
/// end; may continue as new once, and then checks that what it set was
/// carried.
#[derive(Debug)]
pub struct SearchWf;

impl Workflow for SearchWf {
    const NAME: &'static str = "sim.search";
    type Input = SearchIn;
    type Output = u64;

    async fn run(ctx: WorkflowContext, input: SearchIn) -> Result<u64, WorkflowError> {
        let carried = ctx.search_attributes();
        // A bug, not a failure: the run parks, which the simulator reports.
        assert!(
            carried.iter().any(|(n, _)| n == "customer"),
            "the customer attribute was lost"
        );
        let first = ctx.memo::<u32>("stage").unwrap_or(0);
        let mut v = input.value;
        for stage in first..input.stages {
            ctx.upsert_search_attribute("stage", i64::from(stage) + 1)?;
            ctx.upsert_memo("stage", &(stage + 1))?;
            v = ctx.activity::<Transform>(v).await?;
            if input.continue_once && stage == first && first == 0 && stage + 1 < input.stages {
                return Err(WorkflowError::continue_as_new(&SearchIn {
                    value: v,
                    stages: input.stages,
                    continue_once: false,
                }));
            }
        }
        ctx.upsert_search_attribute("done", true)?;
        Ok(v)
    }
}

/// Input of [`StreamWf`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StreamIn {
    /// Messages to read in all (across continue-as-new).
    pub count: u32,
    /// Continue as new once after reading this many.
    pub continue_after: Option<u32>,
    /// Read by earlier runs.
    pub read: u32,
    /// Their sum so far.
    pub sum: u64,
}

/// `sim.stream`: reads `count` messages of stream `items` in offset order,
/// continuing as new once part-way if told to; its result is their sum
/// (the same whatever order they were committed in). It parks (a bug, which
/// the simulator reports) if an offset is skipped or repeated, or if the
/// cursor did not survive continue-as-new.
#[derive(Debug)]
pub struct StreamWf;

impl Workflow for StreamWf {
    const NAME: &'static str = "sim.stream";
    type Input = StreamIn;
    type Output = u64;

    async fn run(ctx: WorkflowContext, input: StreamIn) -> Result<u64, WorkflowError> {
        let items = ctx.stream::<u64>(STREAM_SHAPE_STREAM);
        assert_eq!(
            items.cursor(),
            u64::from(input.read),
            "the stream cursor was not carried"
        );
        let mut sum = input.sum;
        for read in input.read..input.count {
            if input.continue_after == Some(read) {
                return Err(WorkflowError::continue_as_new(&StreamIn {
                    continue_after: None,
                    read,
                    sum,
                    ..input
                }));
            }
            let m = items.next().await?;
            assert_eq!(m.offset, u64::from(read), "messages read out of order");
            sum += m.value;
        }
        Ok(ctx.activity::<Transform>(sum).await?)
    }
}

/// Input of [`RelayWf`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RelayIn {
    /// Values to send as messages.
    pub values: Vec<u64>,
    /// Also send to an instance that never exists (the send fails).
    pub to_nobody: bool,
}

/// `sim.relay`: sends its values as stream messages to its own instance
/// through the outbox (the first one twice, same key), then a signal to
/// itself; waits for the signal, reads the messages in offset order and
/// returns their sum, plus 1000 if a send to an instance that does not
/// exist failed as it must. Parks (a bug) if an answered offset or a read
/// is out of order, or a repeated key is answered with a new offset.
#[derive(Debug)]
pub struct RelayWf;

impl Workflow for RelayWf {
    const NAME: &'static str = "sim.relay";
    type Input = RelayIn;
    type Output = u64;

    async fn run(ctx: WorkflowContext, input: RelayIn) -> Result<u64, WorkflowError> {
        let me = ctx.instance_id().to_string();
        for (i, v) in input.values.iter().enumerate() {
            let offset = ctx.send_message(&me, "relay", &format!("r{i}"), v).await?;
            assert_eq!(offset, Some(i as u64), "a send answered out of order");
        }
        let again = ctx
            .send_message(&me, "relay", "r0", &input.values[0])
            .await?;
        assert_eq!(again, Some(0), "a repeated key is the first message");
        ctx.signal_workflow(&me, "go", &()).await?;
        let _: () = ctx.wait_signal("go").await?;
        let relay = ctx.stream::<u64>("relay");
        let mut sum = 0;
        for i in 0..input.values.len() {
            let m = relay.next().await?;
            assert_eq!(m.offset, i as u64, "messages read out of order");
            sum += m.value;
        }
        if input.to_nobody {
            let nobody = format!("{me}/nobody");
            match ctx.send_message(&nobody, "relay", "x", &0u64).await {
                Err(_) => sum += 1000,
                Ok(o) => panic!("a send to an unknown instance was delivered at {o:?}"),
            }
        }
        Ok(sum)
    }
}

/// `sim.signals`: sums `count` signals named `add`, then transforms the sum.
#[derive(Debug)]
pub struct SignalsWf;

impl Workflow for SignalsWf {
    const NAME: &'static str = "sim.signals";
    type Input = u32;
    type Output = u64;

    async fn run(ctx: WorkflowContext, count: u32) -> Result<u64, WorkflowError> {
        let mut sum = 0u64;
        for _ in 0..count {
            sum += ctx.wait_signal::<u64>("add").await?;
        }
        Ok(ctx.activity::<Transform>(sum).await?)
    }
}

/// Input of [`TimersWf`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TimersIn {
    /// Start value.
    pub value: u64,
    /// A timer of each length, each followed by an activity.
    pub delays_ms: Vec<u64>,
}

/// Input of [`DeadlineWf`].
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub enum DeadlineIn {
    /// Wait for a signal nobody sends.
    Wait,
    /// Continue as new every 300 ms, forever.
    Chain(u32),
    /// Call a `Wait` child with this run timeout in milliseconds.
    Parent(u64),
}

/// `sim.deadline`: workflows only a run or execution timeout ends.
#[derive(Debug)]
pub struct DeadlineWf;

impl Workflow for DeadlineWf {
    const NAME: &'static str = "sim.deadline";
    type Input = DeadlineIn;
    type Output = String;

    async fn run(ctx: WorkflowContext, input: DeadlineIn) -> Result<String, WorkflowError> {
        match input {
            DeadlineIn::Wait => {
                let _: () = ctx.wait_signal("keel.sim.never").await?;
                Ok("signalled".into())
            }
            DeadlineIn::Chain(n) => {
                ctx.timer(Duration::from_millis(300)).await;
                Err(WorkflowError::continue_as_new(&DeadlineIn::Chain(n + 1)))
            }
            DeadlineIn::Parent(ms) => {
                let child = ctx
                    .child::<DeadlineWf>(DeadlineIn::Wait)
                    .run_timeout(Duration::from_millis(ms))
                    .await;
                Ok(match child {
                    Ok(s) => s,
                    Err(f) => format!("{:?}", f.kind),
                })
            }
        }
    }
}

/// `sim.cancel-types`: a scope runs two long activities, one that asks
/// to be waited for when cancelled and one that asks to be abandoned; the
/// scope is cancelled, its completion awaited, and one more activity
/// runs. The checker holds the history to the cancellation types: no
/// cancel request for the abandoned one, and the waited-for one closed
/// before the last activity was scheduled.
#[derive(Debug)]
pub struct CancelTypesWf;

/// The workflow type of [`CancelTypesWf`], for the checker.
pub const CANCEL_TYPES_WORKFLOW: &str = "sim.cancel-types";

impl Workflow for CancelTypesWf {
    const NAME: &'static str = CANCEL_TYPES_WORKFLOW;
    type Input = u64;
    type Output = u64;

    async fn run(ctx: WorkflowContext, value: u64) -> Result<u64, WorkflowError> {
        use keel_core::CancellationType;
        let scope = ctx.scope();
        let waited = ctx.clone();
        scope.spawn(async move {
            let call = waited
                .activity::<Long>(value)
                .cancellation(CancellationType::WaitCancellationCompleted);
            let _ = call.await;
            Ok(())
        });
        let abandoned = ctx.clone();
        scope.spawn(async move {
            let call = abandoned
                .activity::<Long>(value + 1)
                .cancellation(CancellationType::Abandon);
            let _ = call.await;
            Ok(())
        });
        ctx.timer(Duration::from_millis(10)).await;
        scope.cancel();
        let _ = scope.await_completion(std::future::pending()).await;
        Ok(ctx.activity::<Transform>(value).await?)
    }
}

/// `sim.timers`: durable timers between activities.
#[derive(Debug)]
pub struct TimersWf;

impl Workflow for TimersWf {
    const NAME: &'static str = "sim.timers";
    type Input = TimersIn;
    type Output = u64;

    async fn run(ctx: WorkflowContext, input: TimersIn) -> Result<u64, WorkflowError> {
        let mut v = input.value;
        for d in input.delays_ms {
            ctx.timer(Duration::from_millis(d)).await;
            v = ctx.activity::<Transform>(v).await?;
        }
        Ok(v)
    }
}

/// Input of [`RetriesWf`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RetriesIn {
    /// The value.
    pub value: u64,
    /// Attempts that fail first.
    pub fail_first: u32,
    /// The retry policy's attempts.
    pub attempts_max: u32,
}

/// `sim.retries`: one flaky activity under an exponential retry policy.
#[derive(Debug)]
pub struct RetriesWf;

impl Workflow for RetriesWf {
    const NAME: &'static str = "sim.retries";
    type Input = RetriesIn;
    type Output = u64;

    async fn run(ctx: WorkflowContext, input: RetriesIn) -> Result<u64, WorkflowError> {
        let policy = RetryPolicy::exponential(
            input.attempts_max,
            Duration::from_millis(20),
            Duration::from_millis(400),
        );
        let v = ctx
            .activity::<Flaky>(FlakyIn {
                value: input.value,
                fail_first: input.fail_first,
            })
            .retry(policy)
            .await?;
        Ok(v)
    }
}

/// `sim.cancel`: activities until cancellation is requested, then waits for
/// it; always ends cancelled, with the client's reason.
#[derive(Debug)]
pub struct CancelWf;

impl Workflow for CancelWf {
    const NAME: &'static str = "sim.cancel";
    type Input = u32;
    type Output = u64;

    async fn run(ctx: WorkflowContext, steps: u32) -> Result<u64, WorkflowError> {
        let mut v = u64::from(steps);
        for _ in 0..steps {
            if ctx.is_cancel_requested() {
                break;
            }
            v = ctx.activity::<Transform>(v).await?;
        }
        let _ = v;
        let reason = ctx.cancelled().await;
        Err(WorkflowError::Cancelled(reason))
    }
}

/// Input of [`LoopWf`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LoopIn {
    /// This run's iteration.
    pub iteration: u32,
    /// Runs in the chain.
    pub iterations: u32,
    /// The carried value.
    pub value: u64,
}

/// `sim.loop`: one activity per run, continuing as new until done.
#[derive(Debug)]
pub struct LoopWf;

impl Workflow for LoopWf {
    const NAME: &'static str = "sim.loop";
    type Input = LoopIn;
    type Output = u64;

    async fn run(ctx: WorkflowContext, input: LoopIn) -> Result<u64, WorkflowError> {
        let v = ctx.activity::<Transform>(input.value).await?;
        if input.iteration + 1 < input.iterations {
            return Err(WorkflowError::continue_as_new(&LoopIn {
                iteration: input.iteration + 1,
                iterations: input.iterations,
                value: v,
            }));
        }
        Ok(v)
    }
}

/// `sim.all`: one barrier over a transform of every value; returns the sum.
#[derive(Debug)]
pub struct ParallelWf;

impl Workflow for ParallelWf {
    const NAME: &'static str = "sim.all";
    type Input = Vec<u64>;
    type Output = u64;

    async fn run(ctx: WorkflowContext, values: Vec<u64>) -> Result<u64, WorkflowError> {
        let calls: Vec<_> = values
            .iter()
            .map(|v| ctx.activity::<Transform>(*v))
            .collect();
        let out = ctx.all(calls).await?;
        Ok(out.iter().sum())
    }
}

/// Input of [`SelectWf`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SelectIn {
    /// The value.
    pub value: u64,
    /// Race a signal that never comes against a short deadline (the
    /// deadline wins); otherwise race an activity against an hour-long
    /// deadline (the activity wins, and the deadline is cancelled).
    pub timer_wins: bool,
    /// The short deadline.
    pub deadline_ms: u64,
}

/// `sim.select`: a keyed select with a deadline whose winner does not
/// depend on timing, so outcomes stay comparable under faults.
#[derive(Debug)]
pub struct SelectWf;

impl Workflow for SelectWf {
    const NAME: &'static str = "sim.select";
    type Input = SelectIn;
    type Output = u64;

    async fn run(ctx: WorkflowContext, input: SelectIn) -> Result<u64, WorkflowError> {
        if input.timer_wins {
            let s = ctx
                .select()
                .signal("never", "keel.sim.never")
                .timer("deadline", Duration::from_millis(input.deadline_ms))
                .await?;
            return Ok(if s.key == "deadline".into() { 0 } else { 1 });
        }
        let s = ctx
            .select()
            .branch("work", ctx.activity::<Transform>(input.value))
            .timer("deadline", Duration::from_secs(3_600))
            .await?;
        if let Some(h) = s.handle("deadline") {
            h.cancel();
        }
        Ok(s.result::<u64>()?)
    }
}

/// Input of [`NestedWf`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NestedIn {
    /// The value.
    pub value: u64,
    /// Failures of the flaky leaf before it succeeds.
    pub fail_first: u32,
}

/// `sim.nested`: a barrier with a nested barrier, one leaf flaky under a
/// retry policy.
#[derive(Debug)]
pub struct NestedWf;

impl Workflow for NestedWf {
    const NAME: &'static str = "sim.nested";
    type Input = NestedIn;
    type Output = u64;

    async fn run(ctx: WorkflowContext, input: NestedIn) -> Result<u64, WorkflowError> {
        let policy = RetryPolicy::constant(input.fail_first + 2, Duration::from_millis(30));
        let flaky = ctx
            .activity::<Flaky>(FlakyIn {
                value: input.value,
                fail_first: input.fail_first,
            })
            .retry(policy);
        let (a, (b, c)) = ctx
            .all((
                ctx.activity::<Transform>(input.value),
                ctx.all((ctx.activity::<Transform>(input.value + 1), flaky)),
            ))
            .await?;
        Ok(a + b + c)
    }
}

/// `sim.children`: a barrier of child workflows, then one more child.
#[derive(Debug)]
pub struct ChildrenWf;

impl Workflow for ChildrenWf {
    const NAME: &'static str = "sim.children";
    type Input = Vec<u64>;
    type Output = u64;

    async fn run(ctx: WorkflowContext, values: Vec<u64>) -> Result<u64, WorkflowError> {
        let children: Vec<_> = values
            .iter()
            .map(|v| {
                ctx.child::<SequentialWf>(SeqIn {
                    value: *v,
                    steps: 2,
                })
            })
            .collect();
        let sum: u64 = ctx.all(children).await?.iter().sum();
        let last = ctx
            .child::<SequentialWf>(SeqIn {
                value: sum,
                steps: 1,
            })
            .await?;
        Ok(last)
    }
}

/// Input of [`ScopesWf`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ScopesIn {
    /// Values the producer sends.
    pub values: Vec<u64>,
    /// Worker coroutines.
    pub workers: u32,
    /// Channel capacity (0 is a rendezvous).
    pub capacity: usize,
    /// Index of a value whose check fails for good (fail-together).
    pub bad: Option<u32>,
}

/// Scopes and channels: a producer coroutine feeds a bounded channel,
/// worker coroutines call an activity per value; a bad value fails the
/// group together (cancelling the rest at their durable waits).
#[derive(Debug)]
pub struct ScopesWf;

impl Workflow for ScopesWf {
    const NAME: &'static str = "sim.scopes";
    type Input = ScopesIn;
    type Output = String;

    async fn run(ctx: WorkflowContext, input: ScopesIn) -> Result<String, WorkflowError> {
        use std::cell::Cell;
        use std::rc::Rc;
        let scope = ctx.scope();
        let (tx, rx) = ctx.channel::<(u32, u64)>(input.capacity);
        let sum = Rc::new(Cell::new(0u64));
        for _ in 0..input.workers {
            let (ctx, rx, sum, bad) = (ctx.clone(), rx.clone(), sum.clone(), input.bad);
            scope.spawn(async move {
                while let Some((i, v)) = rx.recv().await {
                    let out = if Some(i) == bad {
                        ctx.activity::<Flaky>(FlakyIn {
                            value: v,
                            fail_first: FATAL,
                        })
                        .await?
                    } else {
                        ctx.activity::<Transform>(v).await?
                    };
                    sum.set(sum.get().wrapping_add(out));
                }
                Ok(())
            });
        }
        drop(rx);
        let values = input.values.clone();
        scope.spawn(async move {
            for (i, v) in values.into_iter().enumerate() {
                if tx.send((i as u32, v)).await.is_err() {
                    return Ok(());
                }
            }
            tx.close();
            Ok(())
        });
        match scope
            .await_completion(ctx.timer(Duration::from_secs(3600)))
            .await
        {
            Ok(()) => Ok(format!("sum {}", sum.get())),
            Err(e) => Ok(format!("aborted: {e}")),
        }
    }
}

/// Activity `sim.long`: like [`Transform`], but an attempt takes long
/// enough to heartbeat (60 to 240 ms in the simulator).
#[derive(Debug, Default)]
pub struct Long;

impl Activity for Long {
    const NAME: &'static str = "sim.long";
    type Input = u64;
    type Output = u64;

    async fn run(&self, ctx: ActivityContext, x: u64) -> Result<u64, ActivityError> {
        ctx.heartbeat();
        Ok(transform(x))
    }
}

/// `sim.wait-forever`: waits for a signal nobody sends (or for its
/// cancellation, which it honours): only a cancellation or a termination
/// ends it.
#[derive(Debug)]
pub struct WaitForeverWf;

impl Workflow for WaitForeverWf {
    const NAME: &'static str = "sim.wait-forever";
    type Input = u64;
    type Output = u64;

    async fn run(ctx: WorkflowContext, _x: u64) -> Result<u64, WorkflowError> {
        let s = ctx
            .select()
            .signal("never", "keel.sim.never")
            .branch("cancel", CancelBranch(ctx.clone()))
            .await?;
        if s.key == "cancel".into() {
            return Err(WorkflowError::Cancelled(s.result::<String>()?));
        }
        Ok(0)
    }
}

/// A select member that resolves with the cancellation reason.
struct CancelBranch(WorkflowContext);

impl keel_core::Branch for CancelBranch {
    type Output = String;
    fn leaf_count(&self) -> u32 {
        0
    }
    fn poll_branch(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<String, keel_storage::Failure>> {
        let mut f = self.0.cancelled();
        std::pin::Pin::new(&mut f).poll(cx).map(Ok)
    }
    fn operation(&self) -> keel_storage::OperationKind {
        keel_storage::OperationKind::Condition
    }
}

/// Input of [`ClosePolicyWf`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ClosePolicyIn {
    /// The value.
    pub value: u64,
    /// Leave a child with the terminate policy open.
    pub terminate: bool,
    /// Leave a child with the request-cancel policy open.
    pub request_cancel: bool,
    /// Leave a child with the abandon policy (it ends on its own).
    pub abandon: bool,
}

/// `sim.close-policy`: starts children that wait forever and closes
/// without awaiting them: its close policy must terminate or cancel them
/// (an abandoned child ends on its own).
#[derive(Debug)]
pub struct ClosePolicyWf;

impl Workflow for ClosePolicyWf {
    const NAME: &'static str = "sim.close-policy";
    type Input = ClosePolicyIn;
    type Output = u64;

    async fn run(ctx: WorkflowContext, input: ClosePolicyIn) -> Result<u64, WorkflowError> {
        use keel_storage::ParentClosePolicy as P;
        let mut sel = ctx.select();
        if input.terminate {
            sel = sel.branch(
                "t",
                ctx.child::<WaitForeverWf>(1).close_policy(P::Terminate),
            );
        }
        if input.request_cancel {
            sel = sel.branch(
                "c",
                ctx.child::<WaitForeverWf>(2).close_policy(P::RequestCancel),
            );
        }
        if input.abandon {
            sel = sel.branch(
                "a",
                ctx.child::<SequentialWf>(SeqIn {
                    value: input.value,
                    steps: 1,
                })
                .close_policy(P::Abandon),
            );
        }
        // Every child is issued; a short timer wins and the run closes with
        // its children open.
        let s = sel.timer("done", Duration::from_millis(1)).await?;
        let _ = s;
        Ok(ctx.activity::<Transform>(input.value).await?)
    }
}

/// Input of [`ScopeChildrenWf`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ScopeChildrenIn {
    /// The value.
    pub value: u64,
    /// Children started inside the scope (each waits forever).
    pub children: u32,
    /// How long the scope is waited for before it is cancelled.
    pub wait_ms: u64,
}

/// `sim.scope-children`: a scope whose coroutines each start a child that
/// waits forever; the scope is cancelled after a deadline, which must
/// cancel the children (terminate them, per their close policy), even one
/// whose start is still in the outbox.
#[derive(Debug)]
pub struct ScopeChildrenWf;

impl Workflow for ScopeChildrenWf {
    const NAME: &'static str = "sim.scope-children";
    type Input = ScopeChildrenIn;
    type Output = u64;

    async fn run(ctx: WorkflowContext, input: ScopeChildrenIn) -> Result<u64, WorkflowError> {
        let scope = ctx.scope();
        for i in 0..input.children {
            let ctx2 = ctx.clone();
            scope.spawn(async move {
                ctx2.child::<WaitForeverWf>(u64::from(i)).await?;
                Ok(())
            });
        }
        let waited = scope
            .await_completion(ctx.timer(Duration::from_millis(input.wait_ms)))
            .await;
        if waited.is_err() {
            scope.cancel();
        }
        Ok(ctx.activity::<Transform>(input.value).await?)
    }
}

/// Input of [`SelectCancelWf`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SelectCancelIn {
    /// The value.
    pub value: u64,
    /// The losing member is a barrier (a child and an hour-long timer)
    /// rather than a lone child.
    pub barrier: bool,
}

/// `sim.select-cancel`: a select whose deadline beats a member that can
/// never finish (a child waiting forever, or a barrier holding one); the
/// loser's handle is cancelled, which must cancel the child.
#[derive(Debug)]
pub struct SelectCancelWf;

impl Workflow for SelectCancelWf {
    const NAME: &'static str = "sim.select-cancel";
    type Input = SelectCancelIn;
    type Output = u64;

    async fn run(ctx: WorkflowContext, input: SelectCancelIn) -> Result<u64, WorkflowError> {
        let s = if input.barrier {
            ctx.select()
                .branch(
                    "work",
                    ctx.all((
                        ctx.child::<WaitForeverWf>(input.value),
                        ctx.activity::<Transform>(input.value),
                    )),
                )
                .timer("deadline", Duration::from_millis(20))
                .await?
        } else {
            ctx.select()
                .branch("work", ctx.child::<WaitForeverWf>(input.value))
                .timer("deadline", Duration::from_millis(20))
                .await?
        };
        let deadline_won = s.key == "deadline".into();
        if let Some(h) = s.handle("work") {
            h.cancel();
        }
        // The deadline's own result decodes as `()`.
        s.winner().result::<()>().await?;
        Ok(if deadline_won { input.value } else { 0 })
    }
}

/// `sim.conditions`: a coroutine takes `bump` signals and adds them to a
/// total; the main coroutine waits on a condition over that total, and
/// records a side effect computed from it.
#[derive(Debug)]
pub struct ConditionsWf;

impl Workflow for ConditionsWf {
    const NAME: &'static str = "sim.conditions";
    type Input = u32;
    type Output = u64;

    async fn run(ctx: WorkflowContext, count: u32) -> Result<u64, WorkflowError> {
        use std::cell::Cell;
        use std::rc::Rc;
        let total = Rc::new(Cell::new(0u64));
        let seen = Rc::new(Cell::new(0u32));
        {
            let (ctx, total, seen) = (ctx.clone(), total.clone(), seen.clone());
            ctx.clone().spawn_local(async move {
                for _ in 0..count {
                    if let Ok(v) = ctx.wait_signal::<u64>("bump").await {
                        total.set(total.get() + v);
                        seen.set(seen.get() + 1);
                    }
                }
            });
        }
        let s = seen.clone();
        ctx.condition(move || s.get() >= count).await;
        let doubled: u64 = ctx.side_effect(|| total.get() * 2)?;
        Ok(ctx.activity::<Transform>(doubled).await?)
    }
}

/// `sim.async`: each value goes through an async closure run as a child;
/// then one more child is left behind, open when the parent closes.
#[derive(Debug)]
pub struct AsyncWf;

impl Workflow for AsyncWf {
    const NAME: &'static str = "sim.async";
    type Input = Vec<u64>;
    type Output = u64;

    async fn run(ctx: WorkflowContext, values: Vec<u64>) -> Result<u64, WorkflowError> {
        let mut sum = 0u64;
        for v in values {
            let out = ctx
                .run_async(v, |ctx: WorkflowContext, x: u64| async move {
                    let y = ctx.activity::<Transform>(x).await?;
                    Ok(ctx.activity::<Transform>(y).await?)
                })
                .await?;
            sum = sum.wrapping_add(out);
        }
        // One more the parent leaves behind: it loses a select to a short
        // timer and is still open when the parent closes (its cancellation,
        // then the close policy, close it).
        let left = ctx.run_async(sum, |ctx: WorkflowContext, x: u64| async move {
            let more: u64 = ctx.wait_signal("keel.sim.never").await?;
            Ok(x.wrapping_add(more))
        });
        let s = ctx
            .select()
            .branch("left", left)
            .timer("deadline", Duration::from_millis(5))
            .await?;
        if s.key != "deadline".into() {
            return Err(WorkflowError::msg("the left-behind child won a select"));
        }
        Ok(sum)
    }
}

/// `sim.heartbeats`: a long activity that must heartbeat within 40 ms and
/// finish within 400 ms, retried; silent workers and slow attempts are
/// redelivered or retried.
#[derive(Debug)]
pub struct HeartbeatsWf;

impl Workflow for HeartbeatsWf {
    const NAME: &'static str = "sim.heartbeats";
    type Input = u64;
    type Output = u64;

    async fn run(ctx: WorkflowContext, x: u64) -> Result<u64, WorkflowError> {
        Ok(ctx
            .activity::<Long>(x)
            .heartbeat_timeout(Duration::from_millis(40))
            .start_to_close(Duration::from_millis(400))
            .retry(RetryPolicy::constant(6, Duration::from_millis(10)))
            .await?)
    }
}

/// `sim.timeouts`: activities under schedule-to-start and start-to-close
/// limits without retries; the workflow computes the same value itself when
/// one times out, so its outcome does not depend on which did.
#[derive(Debug)]
pub struct TimeoutsWf;

impl Workflow for TimeoutsWf {
    const NAME: &'static str = "sim.timeouts";
    type Input = u64;
    type Output = u64;

    async fn run(ctx: WorkflowContext, x: u64) -> Result<u64, WorkflowError> {
        let timed_out = |f: &keel_storage::Failure| f.kind == keel_storage::FailureKind::Timeout;
        let a = match ctx
            .activity::<Transform>(x)
            .schedule_to_start(Duration::from_millis(5))
            .await
        {
            Ok(v) => v,
            Err(f) if timed_out(&f) => transform(x),
            Err(f) => return Err(f.into()),
        };
        let b = match ctx
            .activity::<Long>(a)
            .start_to_close(Duration::from_millis(150))
            .await
        {
            Ok(v) => v,
            Err(f) if timed_out(&f) => transform(a),
            Err(f) => return Err(f.into()),
        };
        Ok(b)
    }
}

/// `sim.guarded`: a flaky activity admitted through the `sim.guarded`
/// resilience profile, whose retry policy (the call sets none), attempt
/// timeout, breaker, rate limit, bulkhead and fallback all apply. The
/// fallback gives the value a success gives, so the outcome is the same
/// whichever ends it.
#[derive(Debug)]
pub struct GuardedWf;

impl Workflow for GuardedWf {
    const NAME: &'static str = "sim.guarded";
    type Input = FlakyIn;
    type Output = u64;

    async fn run(ctx: WorkflowContext, input: FlakyIn) -> Result<u64, WorkflowError> {
        Ok(ctx
            .activity::<Flaky>(input)
            .profile(GUARDED_PROFILE)
            .await?)
    }
}
