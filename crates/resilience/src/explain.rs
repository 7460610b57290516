//! `explain()`'s output: what a compiled pipeline enables and what this
//! runtime can and cannot do.
//!
//! This module owns the capability notes and the reasoning behind each value.
//! They describe the async Rust runtime of this crate, not the PHP library the
//! concepts come from, so several values differ from the seed on purpose.

use std::fmt;

use crate::builder::AttemptTimeoutRequirement;
use crate::ids::{ProfileId, ProfileVersion};
use crate::partition::Partition;

/// One `key=value` statement about the runtime.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct CapabilityNote {
    /// The capability, e.g. `attempt_timeout`.
    pub key: &'static str,
    /// What this runtime does for it, e.g. `cooperative`.
    pub value: &'static str,
}

impl fmt::Display for CapabilityNote {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.key, self.value)
    }
}

/// What a compiled pipeline is, computed without I/O or state change.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Explanation {
    /// The profile id.
    pub profile_id: ProfileId,
    /// The profile version.
    pub profile_version: ProfileVersion,
    /// The partition whose state the pipeline keeps.
    pub partition: Partition,
    /// The enabled policies, in the order `attempt`, `retry(maxAttempts=N)`
    /// (always present; `N = 1` means no retry), `retry_budget`,
    /// `rate_limit`, `circuit`, `bulkhead`, `fallback`. This is the listing
    /// order of the seed; the order in which checks run per attempt is the
    /// admission order documented in [`crate::admission`], which
    /// [`Explanation::check_order`] states.
    pub enabled_policies: Vec<String>,
    /// The checks an attempt goes through, in the order they run (the
    /// first refusal wins): `partition`, `retry_safety` (retries only),
    /// `deadline`, then the enabled ones of `circuit`, `retry_budget`
    /// (retries only), `rate_limit`, `bulkhead`, and last `attempt_timeout`
    /// around the dispatched call.
    pub check_order: Vec<String>,
    /// What this runtime can do, one note per capability.
    pub capability_notes: Vec<CapabilityNote>,
}

/// The capability notes of this runtime, in the seed's key order.
///
/// * `invocation=asynchronous`: the callable returns a future; the pipeline
///   awaits it.
/// * `settlement=future_output`: an attempt settles with the future's
///   `Result` output, not by return-or-throw.
/// * `attempt_timeout`: `cooperative` when so configured (the callable reads
///   its attempt deadline from `AttemptContext`, the pipeline never interrupts
///   it and replaces a late result by a timeout); `preemptive_drop` when
///   configured preemptive (the attempt future races the timer and is dropped
///   when the timer wins).
/// * `cancellation=drop_at_await`: dropping the future of `execute` cancels
///   the operation at its current await point; permits are released by drop
///   guards.
/// * `scheduling=async_sleep`: retry delays and queue waits are clock sleeps
///   that yield the task; no thread is blocked.
/// * `queue_ownership`: `bulkhead_fifo` when a bulkhead with a queue is
///   enabled (the pipeline owns a bounded FIFO of waiting admissions), else
///   `none`.
/// * `detached_completion=unsupported`: an attempt never keeps running as a
///   detached task whose late result is collected; a dropped attempt is gone.
/// * `nonblocking=claimed`: the pipeline itself never blocks a thread (its
///   locks are held for a few instructions and never across an await);
///   whether the callable blocks is up to the callable.
/// * `physical_stop`: `not_guaranteed` in cooperative mode (the pipeline
///   cannot stop the callable); `future_dropped` in preemptive mode (the
///   future is dropped at its pending await point, but code running inside a
///   poll, blocking threads and tasks the callable spawned are not stopped).
/// * `require_finite_backend_io=false`: policy state lives in this process's
///   memory; there is no backend I/O to bound.
pub(crate) fn capability_notes(
    requirement: AttemptTimeoutRequirement,
    bulkhead_queue: Option<u32>,
) -> Vec<CapabilityNote> {
    let note = |key, value| CapabilityNote { key, value };
    let (attempt_timeout, physical_stop) = match requirement {
        AttemptTimeoutRequirement::Cooperative => ("cooperative", "not_guaranteed"),
        AttemptTimeoutRequirement::Preemptive => ("preemptive_drop", "future_dropped"),
    };
    let queue_ownership = match bulkhead_queue {
        Some(queue) if queue > 0 => "bulkhead_fifo",
        _ => "none",
    };
    vec![
        note("invocation", "asynchronous"),
        note("settlement", "future_output"),
        note("attempt_timeout", attempt_timeout),
        note("cancellation", "drop_at_await"),
        note("scheduling", "async_sleep"),
        note("queue_ownership", queue_ownership),
        note("detached_completion", "unsupported"),
        note("nonblocking", "claimed"),
        note("physical_stop", physical_stop),
        note("require_finite_backend_io", "false"),
    ]
}
