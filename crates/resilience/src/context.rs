//! Per-operation and per-attempt contexts, and the declaration of whether a
//! call may be repeated.
//!
//! An [`ExecutionContext`] is created by a pipeline right before an
//! operation: it fixes the overall deadline (which starts counting at
//! creation), the [`Safety`] declaration, the operation id and the partition
//! of the pipeline that created it. The pipeline hands the callable an
//! [`AttemptContext`] for every dispatched attempt.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::clock::{Clock, Instant};
use crate::ids::{self, AttemptId, OperationId};
use crate::partition::Partition;

/// Longest overall deadline of an operation, in milliseconds (30 days).
pub const DEADLINE_MS_MAX: u64 = 30 * 86_400_000;
/// Longest replay window of a replayable read, in milliseconds (30 days).
pub const REPLAY_WINDOW_MS_MAX: u64 = 30 * 86_400_000;

/// Why a context or a safety declaration was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The overall deadline was zero: an expired budget can only fail.
    #[error("the overall deadline must be positive, found zero")]
    ZeroDeadline,
    /// The overall deadline was above [`DEADLINE_MS_MAX`].
    #[error("the overall deadline must be at most {DEADLINE_MS_MAX} ms, found {found:?}")]
    DeadlineTooLong {
        /// The value given.
        found: Duration,
    },
    /// The replay window was zero or above [`REPLAY_WINDOW_MS_MAX`].
    #[error("the replay window must be in 1ns..={REPLAY_WINDOW_MS_MAX} ms, found {found:?}")]
    ReplayWindow {
        /// The value given.
        found: Duration,
    },
    /// An id was empty or too long.
    #[error(transparent)]
    Id(#[from] ids::Error),
}

/// The caller's promise that a read-only callable may be replayed.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct ReplaySafetyContract {
    callable: Arc<str>,
    replay_window: Duration,
}

impl ReplaySafetyContract {
    /// Declares that `callable` only reads, so repeating it is safe as long as
    /// the retry starts within `replay_window` of the operation's start (its
    /// context's creation); after that a retry is refused, because data read
    /// that much later may no longer answer the original question.
    pub fn for_read_only_callable(callable: &str, replay_window: Duration) -> Result<Self, Error> {
        ids::check("callable name", callable)?;
        if replay_window.is_zero() || replay_window > Duration::from_millis(REPLAY_WINDOW_MS_MAX) {
            return Err(Error::ReplayWindow {
                found: replay_window,
            });
        }
        Ok(ReplaySafetyContract {
            callable: callable.into(),
            replay_window,
        })
    }

    /// The name of the read-only callable.
    pub fn callable(&self) -> &str {
        &self.callable
    }

    /// How long after the operation's start a retry may still start.
    pub fn replay_window(&self) -> Duration {
        self.replay_window
    }
}

/// Whether repeating the call is safe. Retries are refused for
/// [`Safety::NotRepeatable`] whatever the retry policy says.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub enum Safety {
    /// Repeating the call may repeat a side effect: never retried.
    NotRepeatable,
    /// A read-only call, repeatable within its contract's replay window.
    ReplayableRead(ReplaySafetyContract),
    /// A write the dependency deduplicates by this idempotency key: always
    /// repeatable.
    Idempotent {
        /// The key the dependency deduplicates on.
        key: Arc<str>,
    },
}

impl Safety {
    /// A replayable read under `contract`.
    pub fn replayable_read(contract: ReplaySafetyContract) -> Self {
        Safety::ReplayableRead(contract)
    }

    /// An idempotent write deduplicated by `key`.
    pub fn idempotent(key: &str) -> Result<Self, Error> {
        ids::check("idempotency key", key)?;
        Ok(Safety::Idempotent { key: key.into() })
    }

    /// Why a retry starting at `now` of an operation started at `started`
    /// must be refused, if it must.
    pub(crate) fn refuses_retry(&self, started: Instant, now: Instant) -> Option<RetryRefusal> {
        match self {
            Safety::NotRepeatable => Some(RetryRefusal::NotRepeatable),
            Safety::ReplayableRead(contract) => (now.saturating_duration_since(started)
                > contract.replay_window)
                .then_some(RetryRefusal::ReplayWindowElapsed),
            Safety::Idempotent { .. } => None,
        }
    }
}

/// Why a retry was refused by the operation's safety declaration.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum RetryRefusal {
    /// The operation was declared [`Safety::NotRepeatable`].
    NotRepeatable,
    /// The replayable read's window had passed when the retry would start.
    ReplayWindowElapsed,
}

impl fmt::Display for RetryRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RetryRefusal::NotRepeatable => "the operation is not declared repeatable",
            RetryRefusal::ReplayWindowElapsed => "the replayable read's window has passed",
        })
    }
}

/// One operation's deadline, safety declaration, id and partition. Create it
/// right before the call with `CompiledPipeline::new_context`, and never share
/// it between two operations.
#[derive(Clone, Debug)]
pub struct ExecutionContext {
    pub(crate) partition: Arc<Partition>,
    pub(crate) operation_id: OperationId,
    pub(crate) safety: Safety,
    pub(crate) started: Instant,
    pub(crate) deadline: Instant,
}

impl ExecutionContext {
    /// The operation id.
    pub fn operation_id(&self) -> &OperationId {
        &self.operation_id
    }

    /// The safety declaration.
    pub fn safety(&self) -> &Safety {
        &self.safety
    }

    /// The partition of the pipeline that created this context.
    pub fn partition(&self) -> &Partition {
        &self.partition
    }

    /// When the operation started (the context's creation), on the pipeline's
    /// clock.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// When the overall deadline passes, on the pipeline's clock. An instant
    /// at or after it is late.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }
}

/// What the callable learns about the attempt it runs.
#[derive(Clone)]
pub struct AttemptContext {
    pub(crate) operation_id: OperationId,
    pub(crate) attempt_id: AttemptId,
    pub(crate) dispatched_attempt_number: u32,
    pub(crate) attempt_deadline: Instant,
    pub(crate) operation_deadline: Instant,
    pub(crate) clock: Arc<dyn Clock>,
}

impl AttemptContext {
    /// The operation id, the same for every attempt of the operation.
    pub fn operation_id(&self) -> &OperationId {
        &self.operation_id
    }

    /// This attempt's unique id.
    pub fn attempt_id(&self) -> AttemptId {
        self.attempt_id
    }

    /// 1 for the first dispatched attempt, 2 for the second, and so on;
    /// rejected admissions are not counted.
    pub fn dispatched_attempt_number(&self) -> u32 {
        self.dispatched_attempt_number
    }

    /// When this attempt must be finished: the earlier of its attempt timeout
    /// and the operation's deadline. A cooperative callable checks it.
    pub fn attempt_deadline(&self) -> Instant {
        self.attempt_deadline
    }

    /// When the whole operation must be finished.
    pub fn operation_deadline(&self) -> Instant {
        self.operation_deadline
    }

    /// Time left until the attempt deadline (zero once it has passed).
    pub fn remaining(&self) -> Duration {
        self.attempt_deadline
            .saturating_duration_since(self.clock.now())
    }

    /// Whether the attempt deadline has passed: a cooperative callable should
    /// stop and return.
    pub fn is_expired(&self) -> bool {
        self.clock.now() >= self.attempt_deadline
    }
}

impl fmt::Debug for AttemptContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AttemptContext")
            .field("operation_id", &self.operation_id)
            .field("attempt_id", &self.attempt_id)
            .field("dispatched_attempt_number", &self.dispatched_attempt_number)
            .field("attempt_deadline", &self.attempt_deadline)
            .field("operation_deadline", &self.operation_deadline)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Instant {
        Instant::from_epoch(Duration::from_millis(ms))
    }

    #[test]
    fn safety_decides_retry_refusals() {
        // Goal: not-repeatable always refuses, a read refuses only after its
        // window, an idempotent write never refuses.
        // Method: ask each declaration at several instants.
        let read = Safety::replayable_read(
            ReplaySafetyContract::for_read_only_callable("list-products", Duration::from_secs(1))
                .unwrap(),
        );
        assert_eq!(
            Safety::NotRepeatable.refuses_retry(at(0), at(0)),
            Some(RetryRefusal::NotRepeatable)
        );
        assert_eq!(read.refuses_retry(at(0), at(1_000)), None);
        assert_eq!(
            read.refuses_retry(at(0), at(1_001)),
            Some(RetryRefusal::ReplayWindowElapsed)
        );
        assert_eq!(
            Safety::idempotent("order-17")
                .unwrap()
                .refuses_retry(at(0), at(u64::MAX / 2)),
            None
        );
        assert!(matches!(
            ReplaySafetyContract::for_read_only_callable("x", Duration::ZERO),
            Err(Error::ReplayWindow { .. })
        ));
    }
}
