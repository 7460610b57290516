//! The pure run machine: inputs in, events out.
//!
//! A run's history is a sequence of inputs (start, results, timers fired,
//! signals, cancel requests), each followed by the commands workflow code
//! issued while processing it. The machine processes one input at a time
//! and runs the code until no coroutine can progress, live and on replay
//! alike, so replay sees exactly what live execution saw. It does no IO,
//! reads no clock (time comes with each input) and draws no randomness
//! (the run's seed is recorded in `WorkflowStarted`; retry jitter comes with
//! the failure input).

use std::cell::RefCell;
use std::rc::Rc;

use keel_storage::search;
use keel_storage::{
    AttemptNo, Carried, CommandId, Event, EventKind, Failure, FailureKind, InstanceId, MessageKey,
    ParentRef, Payload, RunId, RunTimeouts, Seq, Step, StreamMessage, Timestamp, WorkflowStart,
    WorkflowTimeout,
};

use crate::context::{Spawn, WorkflowContext};
use crate::core::{describe_recorded, Core, Issued, OpenWait, Resolution};
use crate::executor::{CoroutineId, Executor};
use crate::handlers::{call_read_only, classify, is_bad_arguments, HandlerError};
use crate::workflow::{WorkflowError, WorkflowRegistry};

/// Rounds of re-checking conditions after one input at most (a guard
/// against coroutines that keep changing each other's state forever).
pub const CONDITION_ROUNDS_MAX: usize = 10_000;

/// Why a run cannot proceed: it is parked (kept, visible in `describe`,
/// resumable after a code fix), never failed or rewritten.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MachineError {
    /// Workflow code issued a different command than history recorded.
    #[error("non-determinism at step {step}: history recorded {recorded}, workflow code issued {issued}")]
    NonDeterminism {
        /// The step.
        step: Step,
        /// What history holds.
        recorded: String,
        /// What the code issued.
        issued: String,
    },
    /// History from an older version that cannot be placed (a leaf without
    /// its group path).
    #[error("incompatible history at step {step}: {detail}")]
    IncompatibleHistory {
        /// The step.
        step: Step,
        /// Why.
        detail: String,
    },
    /// Workflow code panicked.
    #[error("workflow code panicked: {message}")]
    Panic {
        /// The panic message.
        message: String,
    },
    /// No workflow of this type is registered.
    #[error("unknown workflow type {0:?}")]
    UnknownWorkflowType(String),
    /// The input does not decode into the workflow's input type.
    #[error("workflow input does not decode: {0}")]
    InputDecode(String),
    /// The history is malformed (not a divergence of code).
    #[error("invalid history: {0}")]
    InvalidHistory(String),
}

impl MachineError {
    /// Short kind, as stored in the park marker.
    pub fn kind(&self) -> &'static str {
        match self {
            MachineError::NonDeterminism { .. } => "non_determinism",
            MachineError::IncompatibleHistory { .. } => "incompatible_history",
            MachineError::Panic { .. } => "panic",
            MachineError::UnknownWorkflowType(_) => "unknown_workflow_type",
            MachineError::InputDecode(_) => "input_decode",
            MachineError::InvalidHistory(_) => "invalid_history",
        }
    }

    /// The step it happened at, where known.
    pub fn step(&self) -> Option<Step> {
        match self {
            MachineError::NonDeterminism { step, .. }
            | MachineError::IncompatibleHistory { step, .. } => Some(*step),
            _ => None,
        }
    }
}

/// Everything needed to start a run.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct StartSpec {
    /// The new run.
    pub run_id: RunId,
    /// Its instance.
    pub instance_id: InstanceId,
    /// The registered workflow type.
    pub workflow_type: String,
    /// Serialized input.
    pub input: Payload,
    /// The client's command id.
    pub command_id: Option<CommandId>,
    /// The parent, for a child.
    pub parent: Option<ParentRef>,
    /// The run continued from.
    pub continued_from: Option<RunId>,
    /// Seed for `random` and `uuid`.
    pub random_seed: u64,
    /// The instance's run this one follows (see
    /// `EventKind::WorkflowStarted::previous_run`).
    pub previous_run: Option<RunId>,
    /// What the run this one continues handed over.
    pub carried: Carried,
    /// Memo fields given at start (see `EventKind::WorkflowStarted`).
    pub memo: Vec<(String, Payload)>,
    /// Search attributes given at start.
    pub search_attributes: Vec<(String, Payload)>,
    /// The run's timeouts.
    pub timeouts: RunTimeouts,
}

impl StartSpec {
    /// The `WorkflowStarted` event that records this start.
    pub fn into_event_kind(self) -> EventKind {
        EventKind::WorkflowStarted(Box::new(WorkflowStart {
            instance_id: self.instance_id,
            run_id: self.run_id,
            workflow_type: self.workflow_type,
            input: self.input,
            command_id: self.command_id,
            parent: self.parent,
            continued_from: self.continued_from,
            random_seed: self.random_seed,
            previous_run: self.previous_run,
            carried: self.carried,
            memo: self.memo,
            search_attributes: self.search_attributes,
            timeouts: self.timeouts,
        }))
    }

    /// The seed of a run whose id was itself drawn deterministically (a
    /// child, a continuation): derived from the id, so every host and every
    /// redelivery starts it the same way without drawing randomness.
    pub fn seed_for(run: RunId) -> u64 {
        let b = run.as_bytes();
        let (hi, lo) = b.split_at(8);
        let hi = u64::from_le_bytes(hi.try_into().expect("8 bytes"));
        let lo = u64::from_le_bytes(lo.try_into().expect("8 bytes"));
        let mut z = hi ^ lo.rotate_left(29) ^ 0x6b65_656c_5345_4544;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// The start of `new_run_id`, continuing run `from` of `instance_id`
    /// after continue-as-new (a child's continuation keeps its parent, and
    /// every continuation the timeouts `carried` hands on).
    pub fn continuation(
        from: RunId,
        instance_id: InstanceId,
        workflow_type: String,
        new_run_id: RunId,
        input: Payload,
        parent: Option<ParentRef>,
        carried: Carried,
    ) -> StartSpec {
        StartSpec {
            run_id: new_run_id,
            instance_id,
            workflow_type,
            input,
            command_id: None,
            parent,
            continued_from: Some(from),
            random_seed: Self::seed_for(new_run_id),
            previous_run: Some(from),
            timeouts: carried.timeouts,
            carried,
            memo: Vec::new(),
            search_attributes: Vec::new(),
        }
    }

    /// The start of a child scheduled by `parent`.
    pub fn child(
        parent: ParentRef,
        child_instance_id: InstanceId,
        child_run_id: RunId,
        workflow_type: String,
        input: Payload,
    ) -> StartSpec {
        StartSpec {
            run_id: child_run_id,
            instance_id: child_instance_id,
            workflow_type,
            input,
            command_id: None,
            parent: Some(parent),
            continued_from: None,
            random_seed: Self::seed_for(child_run_id),
            previous_run: None,
            carried: Carried::default(),
            memo: Vec::new(),
            search_attributes: Vec::new(),
            timeouts: RunTimeouts::default(),
        }
    }

    /// The start recorded in a `WorkflowStarted` event.
    pub fn of_started(kind: &EventKind) -> Option<StartSpec> {
        match kind {
            EventKind::WorkflowStarted(start) => {
                let WorkflowStart {
                    instance_id,
                    run_id,
                    workflow_type,
                    input,
                    command_id,
                    parent,
                    continued_from,
                    random_seed,
                    previous_run,
                    carried,
                    memo,
                    search_attributes,
                    timeouts,
                } = (**start).clone();
                Some(StartSpec {
                    run_id,
                    instance_id,
                    workflow_type,
                    input,
                    command_id,
                    parent,
                    continued_from,
                    random_seed,
                    previous_run,
                    carried,
                    memo,
                    search_attributes,
                    timeouts,
                })
            }
            _ => None,
        }
    }
}

/// An input to a live run.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Input {
    /// An attempt completed.
    ActivityCompleted {
        /// The schedule's step.
        step: Step,
        /// The attempt.
        attempt: AttemptNo,
        /// Its result.
        result: Payload,
    },
    /// An attempt failed. The driver decided whether a retry follows (from
    /// the recorded policy and the call's resilience profile); the machine
    /// records the decision.
    ActivityFailed {
        /// The schedule's step.
        step: Step,
        /// The attempt.
        attempt: AttemptNo,
        /// The failure.
        failure: Failure,
        /// When the next attempt is due, or `None`: the execution failed.
        retry_at: Option<Timestamp>,
        /// The attempt's last heartbeat details, for the next attempt.
        heartbeat: Option<Payload>,
    },
    /// A requested cancellation took effect.
    ActivityCancelled {
        /// The schedule's step.
        step: Step,
    },
    /// A timer fired.
    TimerFired {
        /// The timer's step.
        step: Step,
    },
    /// A child started.
    ChildStarted {
        /// The scheduling step.
        step: Step,
        /// The child's run.
        child_run_id: RunId,
    },
    /// A child completed.
    ChildCompleted {
        /// The scheduling step.
        step: Step,
        /// The child's run.
        child_run_id: RunId,
        /// Its result.
        result: Payload,
    },
    /// A child failed, was cancelled or terminated.
    ChildFailed {
        /// The scheduling step.
        step: Step,
        /// The child's run.
        child_run_id: RunId,
        /// The failure.
        failure: Failure,
    },
    /// A signal.
    Signal {
        /// Its name.
        name: String,
        /// Its payload.
        payload: Payload,
        /// The client's command id, for deduplication.
        command_id: Option<CommandId>,
    },
    /// A message on a stream, deduplicated by its key.
    Message {
        /// The stream's name.
        stream: String,
        /// The sender's idempotency key.
        key: MessageKey,
        /// Its payload.
        payload: Payload,
    },
    /// The target of a send from workflow code answered for good.
    SendCompleted {
        /// The sending step.
        step: Step,
        /// The offset a message was committed at.
        offset: Option<u64>,
        /// Why it was not delivered.
        failure: Option<Failure>,
    },
    /// Cooperative cancellation request.
    CancelRequested {
        /// Why.
        reason: String,
        /// The client's command id.
        command_id: Option<CommandId>,
    },
    /// A deadline of the run passed: closes it without running workflow
    /// code, like a termination.
    TimedOut {
        /// Which timeout.
        timeout: WorkflowTimeout,
        /// The deadline that passed.
        deadline: Timestamp,
    },
    /// Termination: closes the run without running workflow code.
    Terminate {
        /// Why.
        reason: String,
        /// The client's command id, for deduplication.
        command_id: Option<CommandId>,
    },
    /// An update the run's validator accepted (the driver asks
    /// [`RunMachine::validate_update`] first).
    Update {
        /// The update's id: its deduplication key.
        update_id: CommandId,
        /// The handler's name.
        name: String,
        /// Its arguments.
        payload: Payload,
    },
}

impl Input {
    /// Its kind, as metrics label it.
    pub fn kind(&self) -> &'static str {
        match self {
            Input::ActivityCompleted { .. } => "activity_completed",
            Input::ActivityFailed { .. } => "activity_failed",
            Input::ActivityCancelled { .. } => "activity_cancelled",
            Input::TimerFired { .. } => "timer_fired",
            Input::ChildStarted { .. } => "child_started",
            Input::ChildCompleted { .. } => "child_completed",
            Input::ChildFailed { .. } => "child_failed",
            Input::Signal { .. } => "signal",
            Input::Message { .. } => "message",
            Input::SendCompleted { .. } => "send_completed",
            Input::CancelRequested { .. } => "cancel_requested",
            Input::TimedOut { .. } => "timed_out",
            Input::Terminate { .. } => "terminate",
            Input::Update { .. } => "update",
        }
    }
}

/// A message stream of a run, as `describe` shows it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StreamPosition {
    /// The stream's name.
    pub name: String,
    /// Messages committed on it so far (across the instance's runs): the
    /// offset the next one gets.
    pub next_offset: u64,
    /// The offset workflow code reads next.
    pub cursor: u64,
    /// Coroutines waiting on it.
    pub waiting: usize,
}

/// Where an update stands in a run (deduplication by update id).
#[derive(Clone, Debug, PartialEq)]
pub enum UpdateStatus {
    /// Not seen.
    New,
    /// Accepted; its handler has not completed.
    Accepted,
    /// Completed with this value or failure.
    Completed(Result<Payload, Failure>),
    /// Accepted by an earlier run of the instance, which continued as new:
    /// its outcome is in that run's history.
    EarlierRun,
}

impl Input {
    /// The input that tells a parent how its child at `step` closed, or
    /// `None` for a continue-as-new (the child lives on in its next run).
    pub fn child_closed(
        step: Step,
        child_run_id: RunId,
        outcome: keel_storage::Outcome,
    ) -> Option<Input> {
        use keel_storage::Outcome;
        Some(match outcome {
            Outcome::Completed(result) => Input::ChildCompleted {
                step,
                child_run_id,
                result,
            },
            Outcome::Failed(failure) => Input::ChildFailed {
                step,
                child_run_id,
                failure,
            },
            Outcome::Cancelled(r) => Input::ChildFailed {
                step,
                child_run_id,
                failure: Failure::new(FailureKind::Cancelled, r, false),
            },
            Outcome::Terminated(r) => Input::ChildFailed {
                step,
                child_run_id,
                failure: Failure::new(FailureKind::Terminated, r, false),
            },
            Outcome::TimedOut(r) => Input::ChildFailed {
                step,
                child_run_id,
                failure: Failure::new(FailureKind::Timeout, format!("child timed out: {r}"), false),
            },
            Outcome::ContinuedAsNew(_) => return None,
        })
    }
}

/// What the shell should do with an input before handing it to the machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// New: process it.
    Accept,
    /// Already committed (a redelivery, a duplicate or a late result): drop.
    Duplicate,
    /// Refers to nothing open in this run: drop and log.
    Unknown(String),
    /// The run is closed.
    Closed,
    /// Refused for now: the stream holds as many unread messages as it
    /// may (or the run as many streams); the sender tries again later.
    Full(String),
}

/// A run's workflow code, its executor and its state.
pub struct RunMachine {
    core: Rc<RefCell<Core>>,
    spawns: Rc<RefCell<Vec<Spawn>>>,
    exec: Executor,
    root: Option<CoroutineId>,
    outcome: Rc<RefCell<Option<Result<Payload, WorkflowError>>>>,
    registry: WorkflowRegistry,
    started: Option<EventKind>,
    scopes: crate::scope::ScopeRegistry,
    handlers: crate::handlers::SharedHandlers,
}

impl std::fmt::Debug for RunMachine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let core = self.core.borrow();
        f.debug_struct("RunMachine")
            .field("run_id", &core.run_id)
            .field("next_seq", &core.next_seq)
            .field("closed", &core.closed)
            .finish()
    }
}

impl Drop for RunMachine {
    fn drop(&mut self) {
        // Coroutines are dropped with the executor; scopes they own must not
        // issue cancellation commands into a machine that is going away.
        if let Ok(mut core) = self.core.try_borrow_mut() {
            core.tearing_down = true;
        }
        // Handlers hold what workflow code gave them, commonly a clone of
        // its context (an update handler runs activities), and the context
        // holds the handlers: a cycle that would keep the run's whole state
        // alive after the machine is gone, once per activation. Dropped
        // outside the borrow (a handler's captures may reach the handlers).
        let handlers = self
            .handlers
            .try_borrow_mut()
            .map(|mut h| std::mem::take(&mut *h));
        drop(handlers);
    }
}

/// What a query or validator broke by writing.
const READ_ONLY_BROKEN: &str =
    "it tried to change workflow state (issue a command or draw a random number); \
     queries and validators are read-only";

/// Commits an update handler's outcome (`UpdateCompleted`, matched by
/// update id on replay).
fn complete_update(core: &Rc<RefCell<Core>>, update_id: CommandId, r: Result<Payload, Failure>) {
    let mut core = core.borrow_mut();
    if core.tearing_down {
        return;
    }
    let (result, failure) = match r {
        Ok(v) => (v, None),
        Err(f) => (Payload::default(), Some(f)),
    };
    let issued = core.issue(EventKind::UpdateCompleted {
        update_id: update_id.clone(),
        result,
        failure,
    });
    let outcome = match issued {
        Issued::Live(e) | Issued::Replayed(e) => match e.kind {
            EventKind::UpdateCompleted {
                failure: Some(f), ..
            } => Err(f),
            EventKind::UpdateCompleted { result, .. } => Ok(result),
            _ => unreachable!("issue returns the matching kind"),
        },
        Issued::Diverged => return,
    };
    core.updates.insert(update_id, Some(outcome));
}

impl RunMachine {
    fn empty(registry: &WorkflowRegistry, started: &EventKind) -> Result<Self, MachineError> {
        let EventKind::WorkflowStarted(start) = started else {
            return Err(MachineError::InvalidHistory(
                "the first event is not WorkflowStarted".into(),
            ));
        };
        let WorkflowStart {
            instance_id,
            run_id,
            workflow_type,
            input,
            random_seed,
            ..
        } = &**start;
        let w = registry
            .get(workflow_type)
            .ok_or_else(|| MachineError::UnknownWorkflowType(workflow_type.clone()))?;
        w.check_input(input).map_err(MachineError::InputDecode)?;
        Ok(RunMachine {
            core: Rc::new(RefCell::new(Core::new(
                *run_id,
                instance_id.clone(),
                workflow_type.clone(),
                *random_seed,
            ))),
            spawns: Rc::new(RefCell::new(Vec::new())),
            exec: Executor::new(),
            root: None,
            outcome: Rc::new(RefCell::new(None)),
            registry: registry.clone(),
            started: Some(started.clone()),
            scopes: Default::default(),
            handlers: Default::default(),
        })
    }

    /// Starts a new run: returns the machine and the first batch of events
    /// (`WorkflowStarted` plus the commands the code issued at once).
    pub fn start(
        registry: &WorkflowRegistry,
        spec: StartSpec,
        now: Timestamp,
    ) -> Result<(Self, Vec<Event>), MachineError> {
        let kind = spec.into_event_kind();
        let mut m = Self::empty(registry, &kind)?;
        let event = {
            let mut core = m.core.borrow_mut();
            core.now = now;
            core.push_event(kind)
        };
        m.apply_live(event)?;
        let events = m.take_pending();
        Ok((m, events))
    }

    /// Rebuilds a run from its committed history, without running effects.
    /// Every command the code issues must match the recorded one.
    pub fn replay(registry: &WorkflowRegistry, history: Vec<Event>) -> Result<Self, MachineError> {
        let mut closed = Vec::new();
        let m = Self::replay_taking_closed(registry, history, &mut closed)?;
        m.core.borrow_mut().async_closed = closed;
        Ok(m)
    }

    /// [`replay`](Self::replay), which also hands `closed` the async
    /// children whose outcome the replay applied, whether or not it got to
    /// the end (a replay that diverges has applied some, and its machine
    /// is thrown away with the list; see
    /// [`take_closed_async_children`](Self::take_closed_async_children)).
    pub fn replay_taking_closed(
        registry: &WorkflowRegistry,
        history: Vec<Event>,
        closed: &mut Vec<RunId>,
    ) -> Result<Self, MachineError> {
        let first = history
            .first()
            .ok_or_else(|| MachineError::InvalidHistory("empty history".into()))?;
        if first.seq != Seq::FIRST {
            return Err(MachineError::InvalidHistory(format!(
                "history starts at seq {}",
                first.seq
            )));
        }
        let mut m = Self::empty(registry, &first.kind)?;
        {
            let mut core = m.core.borrow_mut();
            core.replay = history.into();
            core.historical = true;
        }
        let replayed = m.replay_history();
        closed.extend(m.take_closed_async_children());
        replayed.map(|()| m)
    }

    /// Applies the history [`replay_taking_closed`](Self::replay_taking_closed)
    /// queued, to its end.
    fn replay_history(&mut self) -> Result<(), MachineError> {
        let m = self;
        loop {
            let next = m.core.borrow_mut().replay.pop_front();
            let Some(event) = next else { break };
            {
                let mut core = m.core.borrow_mut();
                if event.seq != core.next_seq {
                    return Err(MachineError::InvalidHistory(format!(
                        "expected seq {}, found seq {}",
                        core.next_seq, event.seq
                    )));
                }
                if let EventKind::VersionMarker { .. } = event.kind {
                    // A marker of a change this code no longer asks about.
                    core.next_seq = event.seq.next();
                    continue;
                }
                if event.kind.is_command() {
                    return Err(MachineError::NonDeterminism {
                        step: event.kind.step().unwrap_or_default(),
                        recorded: describe_recorded(&event),
                        issued: "nothing (workflow code did not issue it)".into(),
                    });
                }
                if core.closed {
                    return Err(MachineError::InvalidHistory(format!(
                        "{} at seq {} after the run closed",
                        event.kind.name(),
                        event.seq
                    )));
                }
                core.next_seq = event.seq.next();
                core.now = event.at;
            }
            m.apply_input(event)?;
        }
        m.core.borrow_mut().historical = false;
        // A committed history holds every command its code issued after
        // its last input. Code that issues one more diverged from it: park
        // (committing it would overwrite nothing, but its seq would collide
        // with the next input's and the run would never move again).
        let extra = m.core.borrow_mut().pending.first().cloned();
        if let Some(extra) = extra {
            return Err(MachineError::NonDeterminism {
                step: extra.kind.step().unwrap_or_default(),
                recorded: "the end of the history (nothing more was recorded)".into(),
                issued: crate::core::describe_command(&extra.kind),
            });
        }
        Ok(())
    }

    /// Checks an input against the run's durable state (commit path step 2).
    pub fn check(&self, input: &Input) -> Verdict {
        let core = self.core.borrow();
        if core.closed {
            return Verdict::Closed;
        }
        let open_at = |step: &Step| core.open.get(step);
        match input {
            Input::ActivityCompleted { step, attempt, .. }
            | Input::ActivityFailed { step, attempt, .. } => match open_at(step) {
                Some(w) if w.kind == crate::core::WaitKind::Activity && w.attempt == *attempt => {
                    Verdict::Accept
                }
                Some(w) if w.kind == crate::core::WaitKind::Activity => Verdict::Duplicate,
                Some(_) => Verdict::Unknown(format!("step {step} is not an activity")),
                None if step.0 < core.next_step => Verdict::Duplicate,
                None => Verdict::Unknown(format!("no activity at step {step}")),
            },
            Input::ActivityCancelled { step }
            | Input::SendCompleted { step, .. }
            | Input::TimerFired { step }
            | Input::ChildStarted { step, .. }
            | Input::ChildCompleted { step, .. }
            | Input::ChildFailed { step, .. } => match open_at(step) {
                Some(w) => {
                    if matches!(input, Input::ChildStarted { .. }) && w.child_started {
                        Verdict::Duplicate
                    } else {
                        Verdict::Accept
                    }
                }
                None if step.0 < core.next_step => Verdict::Duplicate,
                None => Verdict::Unknown(format!("nothing open at step {step}")),
            },
            Input::Signal { command_id, .. } => match command_id {
                Some(c) if core.seen_commands.contains(c) => Verdict::Duplicate,
                _ => Verdict::Accept,
            },
            Input::Message { stream, key, .. } => match core.streams.get(stream) {
                Some(s) if s.keys.contains_key(key) => Verdict::Duplicate,
                Some(s) if s.unread.len() >= keel_storage::STREAM_BACKLOG_MAX => {
                    Verdict::Full(format!(
                        "stream {stream:?} holds {} unread messages, its limit \
                         (STREAM_BACKLOG_MAX); send again once the workflow reads",
                        s.unread.len()
                    ))
                }
                Some(s) if !s.unread.is_empty() => Verdict::Accept,
                _ => {
                    // A new stream, or one read to its end: it takes a place
                    // among the streams holding unread messages.
                    let holding = core
                        .streams
                        .values()
                        .filter(|s| !s.unread.is_empty())
                        .count();
                    match holding >= keel_storage::STREAMS_PER_RUN_MAX {
                        true => Verdict::Full(format!(
                            "{holding} streams of the run hold unread messages, its limit \
                             (STREAMS_PER_RUN_MAX); send again once the workflow reads"
                        )),
                        false => Verdict::Accept,
                    }
                }
            },
            Input::CancelRequested { command_id, .. } => match command_id {
                Some(c) if core.seen_commands.contains(c) => Verdict::Duplicate,
                _ if core.cancel_requested.is_some() => Verdict::Duplicate,
                _ => Verdict::Accept,
            },
            Input::Terminate { command_id, .. } => match command_id {
                Some(c) if core.seen_commands.contains(c) => Verdict::Duplicate,
                _ => Verdict::Accept,
            },
            Input::TimedOut { .. } => Verdict::Accept,
            Input::Update { update_id, .. } => {
                match core.updates.contains_key(update_id)
                    || core.carried_commands.contains(update_id)
                {
                    true => Verdict::Duplicate,
                    false => Verdict::Accept,
                }
            }
        }
    }

    /// The offset the message `key` was committed at on `stream`, in this
    /// run or (within the carried window) an earlier run of the instance.
    pub fn message_offset(&self, stream: &str, key: &MessageKey) -> Option<u64> {
        let core = self.core.borrow();
        core.streams.get(stream)?.keys.get(key).copied()
    }

    /// Per stream: its name, messages committed (its next offset), the
    /// reader's cursor and how many coroutines wait on it.
    pub fn streams(&self) -> Vec<StreamPosition> {
        let core = self.core.borrow();
        core.streams
            .iter()
            .map(|(name, s)| StreamPosition {
                name: name.clone(),
                next_offset: s.next_offset,
                cursor: s.cursor(),
                waiting: core.stream_waits.get(name).copied().unwrap_or(0),
            })
            .collect()
    }

    /// Where the update `update_id` stands in this run.
    pub fn update_status(&self, update_id: &CommandId) -> UpdateStatus {
        let core = self.core.borrow();
        match core.updates.get(update_id) {
            None if core.carried_commands.contains(update_id) => UpdateStatus::EarlierRun,
            None => UpdateStatus::New,
            Some(None) => UpdateStatus::Accepted,
            Some(Some(r)) => UpdateStatus::Completed(r.clone()),
        }
    }

    /// Runs the validator of update `name` against the run's state: `Ok`
    /// means the update may be accepted. Writes nothing.
    pub fn validate_update(&mut self, name: &str, args: &Payload) -> Result<(), HandlerError> {
        let (validate, _) = self.handlers.borrow().update(name)?;
        match self.read_only("update validator", name, || validate(args))? {
            Ok(()) => Ok(()),
            Err(detail) if is_bad_arguments(&detail) => {
                Err(classify("update validator", name, detail))
            }
            Err(reason) => Err(HandlerError::Rejected {
                name: name.into(),
                reason,
            }),
        }
    }

    /// Answers the query `name` from the run's state. Writes nothing: a
    /// handler that issues a command or draws a random number fails and
    /// what it changed is undone.
    pub fn query(&mut self, name: &str, args: &Payload) -> Result<Payload, HandlerError> {
        let handler = self.handlers.borrow().query(name)?;
        self.read_only("query", name, || handler(args))?
            .map_err(|detail| classify("query", name, detail))
    }

    /// Calls a handler that must not change workflow state: a panic, or a
    /// change (undone), is `HandlerError::Failed`; otherwise its own
    /// result.
    fn read_only<T>(
        &mut self,
        kind: &'static str,
        name: &str,
        f: impl FnOnce() -> Result<T, String>,
    ) -> Result<Result<T, String>, HandlerError> {
        let before = self.core.borrow().untouched();
        self.core.borrow_mut().in_read_only = true;
        let r = call_read_only(kind, name, f);
        self.core.borrow_mut().in_read_only = false;
        let changed = self.core.borrow_mut().restore(before);
        let failed = |detail: String| HandlerError::Failed {
            kind,
            name: name.into(),
            detail,
        };
        match r {
            Err(panicked) => Err(failed(panicked)),
            Ok(_) if changed => Err(failed(READ_ONLY_BROKEN.into())),
            Ok(r) => Ok(r),
        }
    }

    /// Processes one live input and returns the events to commit. On error
    /// the machine must be dropped (and the run parked).
    pub fn handle(&mut self, input: Input, now: Timestamp) -> Result<Vec<Event>, MachineError> {
        debug_assert!(
            !self.core.borrow().replaying(),
            "handle() after a partial replay"
        );
        let kind = {
            let mut core = self.core.borrow_mut();
            core.now = now;
            match input {
                Input::ActivityCompleted {
                    step,
                    attempt,
                    result,
                } => EventKind::ActivityCompleted {
                    step,
                    attempt_id: keel_storage::event::attempt_of(core.run_id, step, attempt),
                    result,
                },
                Input::ActivityFailed {
                    step,
                    attempt,
                    failure,
                    retry_at,
                    heartbeat,
                } => EventKind::ActivityAttemptFailed {
                    step,
                    attempt_id: keel_storage::event::attempt_of(core.run_id, step, attempt),
                    failure: Box::new(failure),
                    retry_at,
                    heartbeat,
                },
                Input::ActivityCancelled { step } => EventKind::ActivityCancelled {
                    step,
                    execution_id: keel_storage::event::execution_of(core.run_id, step),
                },
                Input::TimerFired { step } => {
                    let fire_at = core.open.get(&step).and_then(|w| w.fire_at).unwrap_or(now);
                    EventKind::TimerFired { step, fire_at }
                }
                Input::ChildStarted { step, child_run_id } => {
                    EventKind::ChildStarted { step, child_run_id }
                }
                Input::ChildCompleted {
                    step,
                    child_run_id,
                    result,
                } => EventKind::ChildCompleted {
                    step,
                    child_run_id,
                    result,
                },
                Input::ChildFailed {
                    step,
                    child_run_id,
                    failure,
                } => EventKind::ChildFailed {
                    step,
                    child_run_id,
                    failure,
                },
                Input::Signal {
                    name,
                    payload,
                    command_id,
                } => EventKind::SignalReceived {
                    name,
                    payload,
                    command_id,
                },
                Input::Message {
                    stream,
                    key,
                    payload,
                } => {
                    let offset = core.streams.get(&stream).map_or(0, |s| s.next_offset);
                    EventKind::MessageReceived {
                        stream,
                        offset,
                        key,
                        payload,
                    }
                }
                Input::SendCompleted {
                    step,
                    offset,
                    failure,
                } => EventKind::ExternalSendCompleted {
                    step,
                    offset,
                    failure,
                },
                Input::CancelRequested { reason, command_id } => {
                    EventKind::WorkflowCancelRequested { command_id, reason }
                }
                Input::Terminate { reason, command_id } => {
                    EventKind::WorkflowTerminated { reason, command_id }
                }
                Input::TimedOut { timeout, deadline } => {
                    EventKind::WorkflowTimedOut { timeout, deadline }
                }
                Input::Update {
                    update_id,
                    name,
                    payload,
                } => EventKind::UpdateAccepted {
                    update_id,
                    name,
                    payload,
                },
            }
        };
        let event = self.core.borrow_mut().push_event(kind);
        self.apply_live(event)?;
        Ok(self.take_pending())
    }

    /// Applies an input live. If the code fails (it panicked, diverged),
    /// nothing it issued is committed, so the closures it bound for async
    /// children of its own are forgotten (the machine is thrown away).
    fn apply_live(&mut self, event: Event) -> Result<(), MachineError> {
        let applied = self.apply_input(event);
        if applied.is_err() {
            for child in self.take_unsettled_async_children() {
                self.registry.closures.unbind(child);
            }
        }
        applied
    }

    fn take_pending(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.core.borrow_mut().pending)
    }

    /// Applies one input event, taken by value: replay owns its history,
    /// so results and payloads move into the run instead of being copied.
    fn apply_input(&mut self, event: Event) -> Result<(), MachineError> {
        let Event { seq, kind, .. } = event;
        let mut started = None;
        {
            let mut core = self.core.borrow_mut();
            match kind {
                EventKind::WorkflowStarted(start) => {
                    let WorkflowStart {
                        carried,
                        memo,
                        search_attributes,
                        timeouts,
                        ..
                    } = &*start;
                    core.timeouts = *timeouts;
                    // What the store derives for the run, from the same
                    // function; the commit refuses what does not check.
                    (core.search_attributes, core.memo) =
                        search::start_metadata(Some(carried), search_attributes, memo).map_err(
                            |e| {
                                MachineError::InputDecode(format!(
                                    "memo or search attributes at start: {e}"
                                ))
                            },
                        )?;
                    for s in &carried.signals {
                        core.signals
                            .entry(s.name.clone())
                            .or_default()
                            .push_back(s.payload.clone());
                    }
                    for c in &carried.commands {
                        core.see_command(c.clone());
                        core.carried_commands.insert(c.clone());
                    }
                    for s in &carried.streams {
                        core.streams
                            .insert(s.name.clone(), crate::core::StreamState::carried(s));
                    }
                    started = Some(start);
                }
                EventKind::ActivityCompleted { step, result, .. } => {
                    core.resolve(step, Resolution::Value(result))
                }
                EventKind::ActivityAttemptFailed {
                    step,
                    failure,
                    retry_at,
                    ..
                } => match retry_at {
                    Some(_) => {
                        if let Some(w) = core.open.get_mut(&step) {
                            w.attempt = w.attempt.next();
                        }
                    }
                    None => core.resolve(step, Resolution::Failed(*failure)),
                },
                EventKind::ActivityCancelled { step, .. } => core.resolve(
                    step,
                    Resolution::Failed(Failure::new(
                        FailureKind::Cancelled,
                        "activity cancelled",
                        false,
                    )),
                ),
                EventKind::TimerFired { step, .. } => {
                    core.resolve(step, Resolution::Value(Payload::default()))
                }
                EventKind::ExternalSendCompleted {
                    step,
                    offset,
                    failure,
                } => {
                    let r =
                        match failure {
                            Some(f) => Resolution::Failed(f),
                            None => Resolution::Value(Payload::encode(&offset).map_err(|e| {
                                MachineError::InvalidHistory(format!("offset: {e}"))
                            })?),
                        };
                    core.resolve(step, r)
                }
                EventKind::ChildStarted { step, child_run_id } => {
                    if let Some(w) = core.open.get_mut(&step) {
                        w.child_run = Some(child_run_id);
                        w.child_started = true;
                    }
                }
                EventKind::ChildCompleted { step, result, .. } => {
                    core.child_closed(step);
                    core.resolve(step, Resolution::Value(result))
                }
                EventKind::ChildFailed { step, failure, .. } => {
                    core.child_closed(step);
                    core.resolve(step, Resolution::Failed(failure))
                }
                EventKind::SignalReceived {
                    name,
                    payload,
                    command_id,
                } => {
                    core.signals.entry(name).or_default().push_back(payload);
                    if let Some(c) = command_id {
                        core.see_command(c);
                    }
                }
                EventKind::MessageReceived {
                    stream,
                    offset,
                    key,
                    payload,
                } => {
                    let state = core.streams.entry(stream.clone()).or_default();
                    if offset != state.next_offset {
                        return Err(MachineError::InvalidHistory(format!(
                            "message {key} on stream {stream:?} at offset {offset}, \
                             expected offset {}",
                            state.next_offset
                        )));
                    }
                    state.commit(StreamMessage {
                        offset,
                        key,
                        payload,
                    });
                }
                EventKind::WorkflowCancelRequested { reason, command_id } => {
                    core.cancel_requested = Some(reason);
                    if let Some(c) = command_id {
                        core.see_command(c);
                    }
                }
                EventKind::WorkflowTerminated { .. } | EventKind::WorkflowTimedOut { .. } => {
                    core.closed = true;
                    return Ok(());
                }
                EventKind::UpdateAccepted {
                    update_id,
                    name,
                    payload,
                } => {
                    core.updates.insert(update_id.clone(), None);
                    core.see_command(update_id.clone());
                    let handler = self.handlers.borrow().update(&name);
                    match handler {
                        Ok((_, run)) => {
                            let fut = run(payload);
                            let (core_rc, id) = (self.core.clone(), update_id);
                            self.spawns.borrow_mut().push(Box::pin(async move {
                                let r = fut.await;
                                complete_update(&core_rc, id, r);
                            }));
                        }
                        Err(e) => {
                            return Err(MachineError::NonDeterminism {
                                step: Step(core.next_step),
                                recorded: format!("update {name:?} accepted at seq {seq}"),
                                issued: format!("code without that update handler here ({e})"),
                            })
                        }
                    }
                }
                other => {
                    return Err(MachineError::InvalidHistory(format!(
                        "{} is not an input",
                        other.name()
                    )))
                }
            }
            core.wake_general();
        }
        if let Some(start) = started {
            let WorkflowStart {
                workflow_type,
                input,
                ..
            } = &*start;
            let ctx = WorkflowContext {
                core: self.core.clone(),
                spawns: self.spawns.clone(),
                scope_registry: self.scopes.clone(),
                closures: self.registry.closures.clone(),
                handlers: self.handlers.clone(),
            };
            let body = self
                .registry
                .get(workflow_type)
                .ok_or_else(|| MachineError::UnknownWorkflowType(workflow_type.clone()))?
                .start(ctx, input)
                .map_err(MachineError::InputDecode)?;
            let outcome = self.outcome.clone();
            self.root = Some(self.exec.spawn(async move {
                let r = body.await;
                *outcome.borrow_mut() = Some(r);
            }));
        }
        self.run()
    }

    /// Runs the code until no coroutine can progress. A coroutine that
    /// changed workflow state (a signal handler updating a counter) may have
    /// made a condition true: whenever a pass polled more than the general
    /// waiters it woke, they are woken once more to re-check, until a pass
    /// changes nothing. Live and replay run the same rounds.
    fn run(&mut self) -> Result<(), MachineError> {
        let spawns = self.spawns.clone();
        let mut woken = 0usize;
        for _ in 0..CONDITION_ROUNDS_MAX {
            let polls = self
                .exec
                .run_until_stalled(|ex| {
                    for fut in spawns.borrow_mut().drain(..) {
                        ex.spawn(fut);
                    }
                })
                .map_err(|p| MachineError::Panic { message: p.message })?;
            if self.core.borrow().error.is_some() || polls <= woken {
                break;
            }
            let mut core = self.core.borrow_mut();
            woken = core.general_waiting();
            if woken == 0 {
                break;
            }
            core.wake_general();
        }
        if let Some(err) = self.core.borrow_mut().error.take() {
            return Err(err);
        }
        // A run closes only once every send its code made is answered (the
        // outbox row that delivers it is consumed by that answer) and every
        // cancellation it asked to wait for has completed.
        // Looked for only once the code has finished: the open waits are
        // as many as a fan-out's members.
        let sending = self.outcome.borrow().is_some() && {
            let core = self.core.borrow();
            !core.draining.is_empty()
                || core
                    .open
                    .values()
                    .any(|w| w.kind == crate::core::WaitKind::Send)
        };
        let finished = match sending {
            true => None,
            false => self.outcome.borrow_mut().take(),
        };
        if let Some(result) = finished {
            let mut core = self.core.borrow_mut();
            let kind = match result {
                Ok(result) => EventKind::WorkflowCompleted { result },
                Err(WorkflowError::Failed(failure)) => EventKind::WorkflowFailed { failure },
                Err(WorkflowError::Cancelled(reason)) => EventKind::WorkflowCancelled { reason },
                Err(WorkflowError::ContinueAsNew(input)) => {
                    let (a, b) = (core.next_random(), core.next_random());
                    // Time first, as every other run id the engine makes.
                    let high = crate::driver::run_id_high(core.now.0, a);
                    EventKind::WorkflowContinuedAsNew {
                        new_run_id: RunId::from_u64_pair(high, b),
                        input,
                        carried: Box::new(core.carried()),
                    }
                }
            };
            if let Issued::Diverged = core.issue(kind) {
                return Err(core.error.take().expect("diverged sets the error"));
            }
            core.closed = true;
        }
        Ok(())
    }

    /// The async children whose outcome this run applied since the last
    /// call, live or in replay. Each is closed, so its closure is needed no
    /// more: the engine forgets it (a parent replayed after its children
    /// closed binds their closures again as it re-issues the calls). An
    /// offline replayer that replays the children after their parent keeps
    /// them instead.
    pub fn take_closed_async_children(&mut self) -> Vec<RunId> {
        std::mem::take(&mut self.core.borrow_mut().async_closed)
    }

    /// The async children whose calls the code issued live since the last
    /// call. Their closures are bound before the events that schedule them
    /// are durable: if that commit fails, the engine forgets them (the
    /// machine is thrown away, and the replay binds again what is durable).
    pub fn take_unsettled_async_children(&mut self) -> Vec<RunId> {
        std::mem::take(&mut self.core.borrow_mut().async_unsettled)
    }

    /// The run.
    pub fn run_id(&self) -> RunId {
        self.core.borrow().run_id
    }

    /// The run's instance.
    pub fn instance_id(&self) -> InstanceId {
        self.core.borrow().instance_id.clone()
    }

    /// The workflow type.
    pub fn workflow_type(&self) -> String {
        self.core.borrow().workflow_type.clone()
    }

    /// The seq the next event gets.
    pub fn next_seq(&self) -> Seq {
        self.core.borrow().next_seq
    }

    /// True once the run has closed.
    pub fn is_closed(&self) -> bool {
        self.core.borrow().closed
    }

    /// Open durable waits (activities, timers, children), by step.
    pub fn open_waits(&self) -> Vec<OpenWait> {
        let mut waits: Vec<OpenWait> = self.core.borrow().open.values().cloned().collect();
        waits.sort_unstable_by_key(|w| w.step);
        waits
    }

    /// Signal names coroutines are waiting for, with how many wait.
    pub fn signal_waits(&self) -> Vec<(String, usize)> {
        self.core
            .borrow()
            .signal_waits
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect()
    }

    /// The cancellation reason, if cancellation was requested.
    pub fn cancel_requested(&self) -> Option<String> {
        self.core.borrow().cancel_requested.clone()
    }

    /// The run's live scopes, in step order (the tree via `parent`).
    pub fn scopes(&self) -> Vec<crate::scope::ScopeView> {
        crate::scope::views(&self.scopes)
    }

    /// Live coroutines.
    pub fn coroutines(&self) -> usize {
        self.exec.live()
    }

    /// The `WorkflowStarted` event kind this run began with.
    pub fn started(&self) -> Option<&EventKind> {
        self.started.as_ref()
    }
}
