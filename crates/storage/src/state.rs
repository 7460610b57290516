//! Derived state: the records that `commit` writes next to the events and
//! that `verify` rebuilds from them.

use serde::{Deserialize, Serialize};

use crate::event::{ActivityOptions, GroupPath, Outcome, ParentRef, Payload};
use crate::ids::{AttemptNo, ExecutionId, InstanceId, RunId, Seq, Step, Timestamp};

/// Lifecycle status of a run. The legal transitions are `Running` to any
/// closed status, and nothing out of a closed one.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
pub enum RunStatus {
    /// Open: workflow code still runs.
    Running,
    /// Returned a value.
    Completed,
    /// Returned an error.
    Failed,
    /// Honoured a cancellation.
    Cancelled,
    /// Terminated from outside.
    Terminated,
    /// Closed and continued in a new run.
    ContinuedAsNew,
    /// Closed by its run or execution timeout.
    TimedOut,
}

impl RunStatus {
    /// Every status, in a fixed order.
    pub const ALL: [RunStatus; 7] = [
        RunStatus::Running,
        RunStatus::Completed,
        RunStatus::Failed,
        RunStatus::Cancelled,
        RunStatus::Terminated,
        RunStatus::ContinuedAsNew,
        RunStatus::TimedOut,
    ];

    /// True for every status but `Running`.
    pub fn is_closed(self) -> bool {
        self != RunStatus::Running
    }

    /// The byte used in index keys.
    pub fn code(self) -> u8 {
        match self {
            RunStatus::Running => 1,
            RunStatus::Completed => 2,
            RunStatus::Failed => 3,
            RunStatus::Cancelled => 4,
            RunStatus::Terminated => 5,
            RunStatus::ContinuedAsNew => 6,
            RunStatus::TimedOut => 7,
        }
    }

    /// Lowercase name, as the CLI prints and parses it.
    pub fn name(self) -> &'static str {
        match self {
            RunStatus::Running => "running",
            RunStatus::Completed => "completed",
            RunStatus::Failed => "failed",
            RunStatus::Cancelled => "cancelled",
            RunStatus::Terminated => "terminated",
            RunStatus::ContinuedAsNew => "continued-as-new",
            RunStatus::TimedOut => "timed-out",
        }
    }

    /// Parses a name printed by [`RunStatus::name`].
    pub fn parse(name: &str) -> Option<Self> {
        RunStatus::ALL.into_iter().find(|s| s.name() == name)
    }
}

/// A run's derived metadata.
#[derive(Clone, PartialEq, Debug, Serialize, Deserialize)]
pub struct RunMeta {
    /// The run.
    pub run_id: RunId,
    /// Its instance.
    pub instance_id: InstanceId,
    /// Its workflow type.
    pub workflow_type: String,
    /// Its status.
    pub status: RunStatus,
    /// The seq the next event gets.
    pub next_seq: Seq,
    /// Its parent, for a child run.
    pub parent: Option<ParentRef>,
    /// When it started.
    pub started_at: Timestamp,
    /// When its last event was committed.
    pub updated_at: Timestamp,
    /// When it closed.
    pub closed_at: Option<Timestamp>,
    /// How it closed.
    pub outcome: Option<Outcome>,
    /// Whether cancellation was requested.
    pub cancel_requested: bool,
    /// Its search attributes, sorted by name (indexed: see
    /// [`crate::search`]).
    #[serde(default)]
    pub search_attributes: Vec<(String, crate::search::SearchValue)>,
    /// Its memo fields, sorted by name.
    #[serde(default)]
    pub memo: Vec<(String, Payload)>,
}

impl RunMeta {
    /// Whether `other` differs from this record at most in its progress
    /// (`next_seq`, `updated_at`), which the run's events also say.
    pub fn same_but_progress(&self, other: &RunMeta) -> bool {
        // Whole, so that a field added later is compared too.
        let RunMeta {
            run_id,
            instance_id,
            workflow_type,
            status,
            next_seq: _,
            parent,
            started_at,
            updated_at: _,
            closed_at,
            outcome,
            cancel_requested,
            search_attributes,
            memo,
        } = self;
        *run_id == other.run_id
            && *instance_id == other.instance_id
            && *workflow_type == other.workflow_type
            && *status == other.status
            && *parent == other.parent
            && *started_at == other.started_at
            && *closed_at == other.closed_at
            && *outcome == other.outcome
            && *cancel_requested == other.cancel_requested
            && *search_attributes == other.search_attributes
            && *memo == other.memo
    }
}

/// An instance's current run.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct InstanceMeta {
    /// The newest run of the instance.
    pub current_run: RunId,
    /// When that run started.
    pub started_at: Timestamp,
}

/// A committed durable id: where its terminal event is.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct DedupeEntry {
    /// The seq of the terminal event.
    pub seq: Seq,
}

/// A durable timer waiting to fire.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct TimerEntry {
    /// The run to fire into.
    pub run_id: RunId,
    /// The timer's step.
    pub step: Step,
    /// When it is due.
    pub fire_at: Timestamp,
}

/// A message the outbox delivers at least once.
#[derive(Clone, PartialEq, Debug, Serialize, Deserialize)]
pub enum OutboxMessage {
    /// Start a child run scheduled by a parent.
    StartChild {
        /// The parent and its scheduling step.
        parent: ParentRef,
        /// The child's instance.
        child_instance_id: InstanceId,
        /// The child's run.
        child_run_id: RunId,
        /// The child's workflow type.
        workflow_type: String,
        /// The child's input.
        input: Payload,
        /// Memo fields it starts with.
        #[serde(default)]
        memo: Vec<(String, Payload)>,
        /// Search attributes it starts with.
        #[serde(default)]
        search_attributes: Vec<(String, Payload)>,
        /// Its run and execution timeouts, counted from its start.
        #[serde(default)]
        timeouts: crate::event::StartTimeouts,
    },
    /// Deliver a closed child's outcome to its parent.
    ChildResult {
        /// The parent and its scheduling step.
        parent: ParentRef,
        /// The child's run.
        child_run_id: RunId,
        /// How the child closed.
        outcome: Outcome,
    },
    /// Terminate a child or ask it to cancel: its parent closed (its close
    /// policy), or workflow code cancelled it. Stays until the child closes.
    CancelChild {
        /// The parent and the child's scheduling step.
        parent: ParentRef,
        /// The child's run.
        child_run_id: RunId,
        /// `Terminate` or `RequestCancel`.
        policy: crate::event::ParentClosePolicy,
        /// Why.
        reason: String,
    },
    /// Start the run that continues a run closed by continue-as-new.
    Continue {
        /// The closed run.
        from: RunId,
        /// Its instance.
        instance_id: InstanceId,
        /// The workflow type.
        workflow_type: String,
        /// The new run.
        new_run_id: RunId,
        /// Its input.
        input: Payload,
        /// The parent of a child that continued as new: the chain's last
        /// run reports to it.
        #[serde(default)]
        parent: Option<ParentRef>,
        /// What the closed run hands over.
        #[serde(default)]
        carried: crate::event::Carried,
    },
    /// Deliver a signal or a stream message workflow code sent to an
    /// instance; its answer goes back to the sender's step.
    Deliver {
        /// The sending run.
        sender: RunId,
        /// Its sending step.
        step: crate::ids::Step,
        /// The receiving instance (or run id).
        target: String,
        /// What is sent.
        delivery: crate::event::Delivery,
    },
}

impl OutboxMessage {
    /// The run this message is delivered to.
    pub fn target(&self) -> RunId {
        match self {
            OutboxMessage::StartChild { child_run_id, .. }
            | OutboxMessage::CancelChild { child_run_id, .. } => *child_run_id,
            OutboxMessage::ChildResult { parent, .. } => parent.run_id,
            OutboxMessage::Continue { new_run_id, .. } => *new_run_id,
            // Its target is an instance, resolved when delivered; the
            // sender hears the answer.
            OutboxMessage::Deliver { sender, .. } => *sender,
        }
    }

    /// The run whose commit wrote it: its shard delivers it.
    pub fn owner(&self) -> RunId {
        match self {
            OutboxMessage::StartChild { parent, .. }
            | OutboxMessage::CancelChild { parent, .. } => parent.run_id,
            OutboxMessage::ChildResult { child_run_id, .. } => *child_run_id,
            OutboxMessage::Continue { from, .. } => *from,
            OutboxMessage::Deliver { sender, .. } => *sender,
        }
    }

    /// Its key in the outbox family.
    pub fn key(&self) -> Vec<u8> {
        match self {
            OutboxMessage::StartChild { parent, .. } => {
                crate::keys::outbox_start_key(parent.run_id, parent.step)
            }
            OutboxMessage::ChildResult { child_run_id, .. } => {
                crate::keys::outbox_result_key(*child_run_id)
            }
            OutboxMessage::CancelChild { child_run_id, .. } => {
                crate::keys::outbox_cancel_key(*child_run_id)
            }
            OutboxMessage::Continue { new_run_id, .. } => {
                crate::keys::outbox_continue_key(*new_run_id)
            }
            OutboxMessage::Deliver { sender, step, .. } => {
                crate::keys::outbox_deliver_key(*sender, *step)
            }
        }
    }
}

/// A child its parent started and has not heard back from (the `children`
/// family): what the parent's close policy applies to.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct ChildEntry {
    /// The child's run.
    pub child_run_id: RunId,
    /// What happens to it when the parent closes.
    pub close_policy: crate::event::ParentClosePolicy,
}

/// The pending attempt of an activity execution: what the dispatcher hands
/// to workers. `due` is the durable backoff of a retry.
#[derive(Clone, PartialEq, Debug, Serialize, Deserialize)]
pub struct TaskEntry {
    /// The execution.
    pub execution_id: ExecutionId,
    /// The attempt to run next.
    pub attempt: AttemptNo,
    /// The activity type.
    pub activity_type: String,
    /// The serialized input.
    pub input: Payload,
    /// Timeouts and retry policy.
    pub options: ActivityOptions,
    /// The group path of the scheduling command.
    pub group: GroupPath,
    /// When the execution was scheduled.
    pub scheduled_at: Timestamp,
    /// Not to be dispatched before this time.
    pub due: Timestamp,
    /// Whether workflow code asked to cancel it.
    pub cancel_requested: bool,
    /// The last heartbeat details of an earlier attempt, for the next one.
    #[serde(default)]
    pub heartbeat: Option<Payload>,
}

impl TaskEntry {
    /// The attempt a stored task row waits for, read without building the
    /// rest of the row: checking an activity's result needs only this, and
    /// decoding the whole entry (its type name, input, options and group)
    /// was most of what that check cost the store's writer.
    pub fn attempt_of(bytes: &[u8]) -> Result<AttemptNo, crate::codec::Error> {
        crate::codec::decode::<TaskAttempt>(crate::codec::RecordKind::Task, bytes)
            .map(|t| t.attempt)
    }
}

/// A [`TaskEntry`] read for its attempt alone: every other field is skipped
/// over, not built. The fields mirror `TaskEntry`'s, in its order and with
/// its names, so every row that decodes as a `TaskEntry`, positional or
/// written as a map by an older version, decodes here to the same attempt.
/// The converse is looser: a skipped field is not checked for its type, so
/// a row whose other fields are malformed but whose checksum holds is read
/// here where the whole entry would be `Corrupt`. A field added to
/// `TaskEntry` must be added here too; the tests below fail until it is.
#[derive(Deserialize)]
#[allow(dead_code)]
struct TaskAttempt {
    execution_id: serde::de::IgnoredAny,
    attempt: AttemptNo,
    activity_type: serde::de::IgnoredAny,
    input: serde::de::IgnoredAny,
    options: serde::de::IgnoredAny,
    group: serde::de::IgnoredAny,
    scheduled_at: serde::de::IgnoredAny,
    due: serde::de::IgnoredAny,
    cancel_requested: serde::de::IgnoredAny,
    #[serde(default)]
    heartbeat: serde::de::IgnoredAny,
}

/// Why a run is parked (not an event: an operational state that replay
/// would reach again). Written by the engine, shown by `describe`.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct ParkInfo {
    /// When it was parked.
    pub at: Timestamp,
    /// Short kind: `non_determinism`, `panic`, `crash_loop`, `corrupt`.
    pub kind: String,
    /// The full reason.
    pub reason: String,
}

/// The store's own metadata record.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct StoreMeta {
    /// Always `"keel"`.
    pub format: String,
    /// The schema version of the directory.
    pub schema_version: u32,
    /// The build that created it.
    pub created_by: String,
}

#[cfg(test)]
mod tests {
    // Goal: a task row's attempt is read by keel's fast slice reader
    // without building the row, for a row with every field filled in, so
    // a field added to `TaskEntry` and not to `TaskAttempt` fails here
    // (both readers refuse an array with an element left over, so in the
    // engine every completion would fail as `Corrupt`).
    // Method: encode a full entry both ways (positional, and as an older
    // version's map) and read it through the slice reader directly.
    use super::*;
    use crate::codec::{self, RecordKind, HEADER_BYTES};
    use crate::event::{Backoff, GroupEntry, Jitter, RetrySettings};

    fn full_task() -> TaskEntry {
        TaskEntry {
            execution_id: ExecutionId {
                run_id: RunId::from_u64_pair(7, 9),
                step: Step(3),
            },
            attempt: AttemptNo(5),
            activity_type: "charge".into(),
            input: Payload(vec![0x92, 1, 2]),
            options: ActivityOptions {
                start_to_close_ms: Some(1_000),
                schedule_to_close_ms: Some(60_000),
                heartbeat_ms: Some(500),
                retry: Some(RetrySettings {
                    attempts_max: 9,
                    initial_delay_ms: 10,
                    backoff_factor: 2.0,
                    delay_max_ms: 1_000,
                    jitter: Jitter::Full,
                    backoff_mode: Some(Backoff::Exponential),
                }),
                profile: Some("payments".into()),
                schedule_to_start_ms: Some(30_000),
            },
            group: vec![GroupEntry {
                step: Step(2),
                size: 4,
                index: 1,
            }],
            scheduled_at: Timestamp(11),
            due: Timestamp(12),
            cancel_requested: true,
            heartbeat: Some(Payload(vec![0xc0])),
        }
    }

    #[test]
    fn a_task_rows_attempt_is_read_by_the_fast_reader_in_both_layouts() {
        let task = full_task();
        let positional = codec::encode(RecordKind::Task, &task).unwrap();
        let named = rmp_serde::to_vec_named(&task).unwrap();
        for body in [&positional[HEADER_BYTES..], &named[..]] {
            let read: TaskAttempt = crate::slice_de::from_record_slice(body)
                .expect("the slice reader reads a whole task row as TaskAttempt");
            assert_eq!(read.attempt, task.attempt);
        }
        assert_eq!(TaskEntry::attempt_of(&positional), Ok(task.attempt));
    }

    #[test]
    fn a_damaged_task_row_is_an_error_not_an_attempt() {
        let mut bytes = codec::encode(RecordKind::Task, &full_task()).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0x40;
        assert!(matches!(
            TaskEntry::attempt_of(&bytes),
            Err(codec::Error::Checksum { .. })
        ));
    }
}
