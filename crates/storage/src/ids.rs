//! Durable identities and the small numbers that cross the API.
//!
//! Every id of the glossary has its own newtype so that a step can never be
//! passed where a seq is expected. Ids that derive from others (an execution
//! from its run and step, an attempt from its execution and number, a child
//! instance from its parent run and step) are derived here and nowhere else,
//! so the engine, the simulator and offline replay compute the same values.

use std::fmt;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Identity of one run (`workflow_run_id`).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RunId(pub Uuid);

impl RunId {
    /// A fresh random run id.
    pub fn new_random() -> Self {
        RunId(Uuid::new_v4())
    }

    /// A run id built from two 64-bit halves, for deterministic sources such
    /// as the simulator's seeded generator.
    pub fn from_u64_pair(high: u64, low: u64) -> Self {
        RunId(Uuid::from_u64_pair(high, low))
    }

    /// The 16 bytes used in keys.
    pub fn as_bytes(&self) -> &[u8; 16] {
        self.0.as_bytes()
    }

    /// Parses a run id from its hyphenated text form.
    pub fn parse(text: &str) -> Option<Self> {
        Uuid::parse_str(text).ok().map(RunId)
    }
}

impl fmt::Display for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl fmt::Debug for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RunId({})", self.0)
    }
}

/// The public, user-chosen identity of one workflow (`workflow_instance_id`).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct InstanceId(pub String);

impl InstanceId {
    /// Wraps a user-chosen instance id.
    pub fn new(id: impl Into<String>) -> Self {
        InstanceId(id.into())
    }

    /// The instance id of the child started by `parent` at `step`: stable, so
    /// a redelivered start creates the same child once.
    pub fn for_child(parent: RunId, step: Step) -> Self {
        InstanceId(format!("{parent}/child-{}", step.0))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "InstanceId({:?})", self.0)
    }
}

/// Position of an event in its run's history; contiguous from 1.
#[derive(
    Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default, Serialize, Deserialize,
)]
pub struct Seq(pub u64);

impl Seq {
    /// The seq of the first event of every run.
    pub const FIRST: Seq = Seq(1);

    /// The seq after this one.
    pub fn next(self) -> Seq {
        Seq(self.0 + 1)
    }
}

impl fmt::Display for Seq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A durable position in workflow code: each command gets the next step in
/// the order the code issues it.
#[derive(
    Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default, Serialize, Deserialize,
)]
pub struct Step(pub u32);

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// One logical activity call across all its attempts
/// (`activity_execution_id`): the default idempotency key for external
/// systems. Derived from the run and the step that scheduled it.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ExecutionId {
    /// The run that scheduled the execution.
    pub run_id: RunId,
    /// The step of the scheduling command.
    pub step: Step,
}

impl fmt::Display for ExecutionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/act-{}", self.run_id, self.step.0)
    }
}

impl fmt::Debug for ExecutionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ExecutionId({self})")
    }
}

/// Attempt number of an execution, from 1.
#[derive(
    Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default, Serialize, Deserialize,
)]
pub struct AttemptNo(pub u32);

impl AttemptNo {
    /// The first attempt of every execution.
    pub const FIRST: AttemptNo = AttemptNo(1);

    /// The attempt after this one.
    pub fn next(self) -> AttemptNo {
        AttemptNo(self.0 + 1)
    }
}

impl fmt::Display for AttemptNo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// One try of an execution (`activity_attempt_id`); a retry is a new
/// attempt, a redelivery is the same attempt again.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct AttemptId {
    /// The execution this attempt belongs to.
    pub execution: ExecutionId,
    /// Its number within the execution, from 1.
    pub attempt: AttemptNo,
}

impl fmt::Display for AttemptId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/try-{}", self.execution, self.attempt.0)
    }
}

impl fmt::Debug for AttemptId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AttemptId({self})")
    }
}

/// Fencing epoch of a lease: only grows, so a stale holder can be refused.
#[derive(
    Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default, Serialize, Deserialize,
)]
pub struct LeaseEpoch(pub u64);

impl fmt::Display for LeaseEpoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Client-chosen id that deduplicates a state-changing request
/// (`workflow_command_id`).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
pub struct CommandId(pub String);

impl CommandId {
    /// Wraps a client-chosen command id.
    pub fn new(id: impl Into<String>) -> Self {
        CommandId(id.into())
    }
}

impl fmt::Display for CommandId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Milliseconds since the Unix epoch, as the engine's clock (or the
/// simulator's virtual clock) reported it. Never read by the pure core.
#[derive(
    Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default, Serialize, Deserialize,
)]
pub struct Timestamp(pub u64);

impl Timestamp {
    /// Milliseconds since the epoch.
    pub fn as_millis(self) -> u64 {
        self.0
    }

    /// This time plus `ms` milliseconds, saturating.
    pub fn plus_ms(self, ms: u64) -> Timestamp {
        Timestamp(self.0.saturating_add(ms))
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}
