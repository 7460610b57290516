//! The compiled pipeline: the policies' live state, and the `execute` loop
//! that runs an operation through them.
//!
//! One attempt of [`CompiledPipeline::execute`] goes:
//!
//! 1. admission (see [`crate::admission`] for the check order), waiting in
//!    the bulkhead queue if there is one, never past the overall deadline;
//! 2. dispatch under the attempt timeout: the callable gets an
//!    [`AttemptContext`]; a preemptive timeout races the future against the
//!    earlier of the attempt deadline and the overall deadline and drops it
//!    when the timer wins;
//! 3. classification of the outcome and settlement of the admission (the
//!    circuit breaker records the verdict, the bulkhead slot is freed);
//! 4. the overall deadline: a result that arrives at or after it is replaced
//!    by [`Error::DeadlineExceeded`];
//! 5. on a retryable failure with attempts left: the safety declaration must
//!    allow a retry, the delay from [`RetryPolicy::next_delay`] must fit in
//!    the time left, and the pipeline sleeps holding nothing before going
//!    back to 1 as a retry.
//!
//! `execute` is built on the same admission API that the engine uses
//! ([`CompiledPipeline::admit`]), not on a copy of it.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::admission::{Admission, Gates, Rejection};
use crate::bucket::TokenBucket;
use crate::budget::RetryBudget;
use crate::builder::{AttemptTimeoutRequirement, Config};
use crate::bulkhead::Bulkhead;
use crate::circuit::{CircuitBreaker, CircuitState};
use crate::classify::{Classification, Classifier};
use crate::clock::{until_deadline, Clock};
use crate::context::{self, AttemptContext, ExecutionContext, Safety};
use crate::explain::{capability_notes, Explanation};
use crate::ids::{mix64, AttemptId, OperationId, ProfileId, ProfileVersion};
use crate::partition::Partition;
use crate::reason::Reason;
use crate::retry::RetryPolicy;

/// Salt that separates the jitter stream from the attempt-id stream.
const JITTER_SALT: u64 = 0x6a69_7474_6572_2121;
/// Salt for the high half of attempt ids.
const ID_SALT: u64 = 0x6174_7465_6d70_7421;

/// How an operation ended without the callable's success.
///
/// Every variant names the dispatched attempts so far, and [`Error::reason`]
/// gives its stable snake_case name.
#[derive(Debug, thiserror::Error)]
pub enum Error<E> {
    /// Refused before dispatch; the callable was not called for this attempt.
    #[error("{rejection}")]
    Rejected {
        /// What refused.
        rejection: Rejection,
        /// Attempts dispatched before the refusal.
        attempts: u32,
        /// The previous attempt's error, when the refusal was of a retry.
        last_error: Option<E>,
    },
    /// The overall deadline passed: before an admission, while waiting, or
    /// with a result that arrived late and was replaced.
    #[error("the overall deadline passed after {attempts} dispatched attempt(s)")]
    DeadlineExceeded {
        /// Attempts dispatched.
        attempts: u32,
        /// The last attempt's error, if it failed.
        last_error: Option<E>,
    },
    /// The last attempt ran past its attempt timeout.
    #[error("attempt {attempts} ran past its attempt timeout of {timeout:?}")]
    AttemptTimeout {
        /// Attempts dispatched.
        attempts: u32,
        /// The attempt timeout.
        timeout: Duration,
    },
    /// The callable's error ended the operation (not retryable, or no
    /// attempt left).
    #[error("the operation failed after {attempts} dispatched attempt(s)")]
    Failed {
        /// Attempts dispatched.
        attempts: u32,
        /// The last attempt's error.
        #[source]
        source: E,
    },
    /// The fallback ran and failed.
    #[error("the fallback failed after {attempts} dispatched attempt(s)")]
    FallbackFailed {
        /// Attempts dispatched before the fallback.
        attempts: u32,
        /// The fallback's error.
        #[source]
        source: E,
    },
}

impl<E> Error<E> {
    /// The stable name of this ending.
    pub fn reason(&self) -> Reason {
        match self {
            Error::Rejected { rejection, .. } => rejection.reason(),
            Error::DeadlineExceeded { .. } => Reason::DeadlineExceeded,
            Error::AttemptTimeout { .. } => Reason::AttemptTimeout,
            Error::Failed { .. } => Reason::OperationFailed,
            Error::FallbackFailed { .. } => Reason::FallbackFailed,
        }
    }

    /// Attempts dispatched to the callable.
    pub fn attempts(&self) -> u32 {
        match self {
            Error::Rejected { attempts, .. }
            | Error::DeadlineExceeded { attempts, .. }
            | Error::AttemptTimeout { attempts, .. }
            | Error::Failed { attempts, .. }
            | Error::FallbackFailed { attempts, .. } => *attempts,
        }
    }

    /// The most recent error returned by the callable or the fallback, if
    /// any.
    pub fn last_error(&self) -> Option<&E> {
        match self {
            Error::Rejected { last_error, .. } | Error::DeadlineExceeded { last_error, .. } => {
                last_error.as_ref()
            }
            Error::AttemptTimeout { .. } => None,
            Error::Failed { source, .. } | Error::FallbackFailed { source, .. } => Some(source),
        }
    }

    /// The most recent error returned by the callable or the fallback, if
    /// any, by value.
    pub fn into_last_error(self) -> Option<E> {
        match self {
            Error::Rejected { last_error, .. } | Error::DeadlineExceeded { last_error, .. } => {
                last_error
            }
            Error::AttemptTimeout { .. } => None,
            Error::Failed { source, .. } | Error::FallbackFailed { source, .. } => Some(source),
        }
    }

    fn from_rejection(rejection: Rejection, attempts: u32, last_error: Option<E>) -> Self {
        match rejection {
            Rejection::DeadlineExceeded => Error::DeadlineExceeded {
                attempts,
                last_error,
            },
            rejection => Error::Rejected {
                rejection,
                attempts,
                last_error,
            },
        }
    }
}

/// An operation's ending before the fallback, and whether the fallback may
/// replace it.
struct Ended<E> {
    error: Error<E>,
    fallback: bool,
}

/// What one dispatched attempt produced.
enum Outcome<T, E> {
    Value(T),
    Failed(E),
    TimedOut,
}

/// The compiled pipeline of one profile and partition: its configuration,
/// its classifier for errors of type `E`, and the live state of its
/// policies.
///
/// Build it once at startup and share it (it is `Send + Sync`; wrap it in an
/// `Arc`): a pipeline rebuilt per request forgets every limit. It keeps no
/// per-operation state, so any number of operations may run through it at
/// once.
pub struct CompiledPipeline<E> {
    profile_id: ProfileId,
    profile_version: ProfileVersion,
    gates: Gates,
    attempt_timeout: Duration,
    requirement: AttemptTimeoutRequirement,
    retry: RetryPolicy,
    bulkhead_queue: Option<u32>,
    fallback: bool,
    seed: u64,
    id_high: u64,
    attempts_issued: AtomicU64,
    classifier: Classifier<E>,
}

impl<E> CompiledPipeline<E> {
    pub(crate) fn new(
        config: Config,
        classifier: Classifier<E>,
        clock: Arc<dyn Clock>,
        seed: u64,
    ) -> Self {
        let now = clock.now();
        let gates = Gates {
            partition: Arc::new(config.partition),
            circuit: config.circuit.map(CircuitBreaker::new),
            budget: config.retry_budget.map(|spec| RetryBudget::new(spec, now)),
            rate_limit: config.rate_limit.map(|spec| TokenBucket::new(spec, now)),
            bulkhead: config.bulkhead.map(Bulkhead::new),
            clock,
        };
        CompiledPipeline {
            profile_id: config.profile_id,
            profile_version: config.profile_version,
            gates,
            attempt_timeout: config.attempt_timeout,
            requirement: config.requirement,
            retry: config.retry,
            bulkhead_queue: config.bulkhead.map(|spec| spec.queue),
            fallback: config.fallback,
            seed,
            id_high: mix64(seed ^ ID_SALT),
            attempts_issued: AtomicU64::new(0),
            classifier,
        }
    }

    /// Creates the context of one operation, right before it runs: the
    /// overall `deadline` (positive; it starts now and covers attempts, waits
    /// and fallback), the `safety` declaration and the `operation_id`.
    pub fn new_context(
        &self,
        deadline: Duration,
        safety: Safety,
        operation_id: &str,
    ) -> Result<ExecutionContext, context::Error> {
        if deadline.is_zero() {
            return Err(context::Error::ZeroDeadline);
        }
        if deadline > Duration::from_millis(context::DEADLINE_MS_MAX) {
            return Err(context::Error::DeadlineTooLong { found: deadline });
        }
        let operation_id = OperationId::new(operation_id)?;
        let started = self.gates.clock.now();
        Ok(ExecutionContext {
            partition: Arc::clone(&self.gates.partition),
            operation_id,
            safety,
            started,
            deadline: started + deadline,
        })
    }

    /// Runs the admission checks for one attempt without dispatching
    /// anything and without waiting: a full bulkhead rejects at once. The
    /// returned guard holds the permits; see [`crate::admission`].
    pub fn admit(
        &self,
        ctx: &ExecutionContext,
        is_retry: bool,
    ) -> Result<Admission<'_>, Rejection> {
        self.gates.admit(ctx, is_retry)
    }

    /// Like [`CompiledPipeline::admit`], but waits in the bulkhead queue (in
    /// FIFO order, never past the overall deadline) when every slot is taken.
    pub async fn admit_waiting(
        &self,
        ctx: &ExecutionContext,
        is_retry: bool,
    ) -> Result<Admission<'_>, Rejection> {
        self.gates.admit_waiting(ctx, is_retry).await
    }

    /// Runs `operation` through the pipeline: one call per dispatched
    /// attempt, each with its own [`AttemptContext`]. See the
    /// [module docs](self) for the steps.
    pub async fn execute<T, F, Fut>(
        &self,
        ctx: &ExecutionContext,
        operation: F,
    ) -> Result<T, Error<E>>
    where
        F: FnMut(AttemptContext) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.run_attempts(ctx, operation)
            .await
            .map_err(|ended| ended.error)
    }

    /// Like [`CompiledPipeline::execute`], but when the final outcome is
    /// fallback-eligible by the classifier and time is left before the
    /// overall deadline, `fallback` gets the error and may replace it. The
    /// fallback runs under the overall deadline (raced against it in
    /// preemptive mode, checked after it in cooperative mode). Refused with
    /// [`Rejection::FallbackNotEnabled`] when the pipeline was built without
    /// the fallback policy.
    pub async fn execute_with_fallback<T, F, Fut, G, GFut>(
        &self,
        ctx: &ExecutionContext,
        operation: F,
        fallback: G,
    ) -> Result<T, Error<E>>
    where
        F: FnMut(AttemptContext) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        G: FnOnce(Error<E>) -> GFut,
        GFut: Future<Output = Result<T, E>>,
    {
        if !self.fallback {
            // A partition mismatch is still reported first, as for execute.
            let rejection = match self.partition_mismatch(ctx) {
                Some(mismatch) => mismatch,
                None => Rejection::FallbackNotEnabled,
            };
            return Err(Error::from_rejection(rejection, 0, None));
        }
        let ended = match self.run_attempts(ctx, operation).await {
            Ok(value) => return Ok(value),
            Err(ended) => ended,
        };
        if !ended.fallback {
            return Err(ended.error);
        }
        let clock = &*self.gates.clock;
        let attempts = ended.error.attempts();
        if clock.now() >= ctx.deadline {
            return Err(Error::DeadlineExceeded {
                attempts,
                last_error: ended.error.into_last_error(),
            });
        }
        tracing::debug!(
            operation_id = %ctx.operation_id,
            reason = %ended.error.reason(),
            "fallback replaces the outcome"
        );
        let call = fallback(ended.error);
        let returned = match self.requirement {
            AttemptTimeoutRequirement::Cooperative => Some(call.await),
            AttemptTimeoutRequirement::Preemptive => {
                until_deadline(clock, ctx.deadline, call).await
            }
        };
        match returned {
            Some(result) if clock.now() < ctx.deadline => {
                result.map_err(|source| Error::FallbackFailed { attempts, source })
            }
            Some(result) => Err(Error::DeadlineExceeded {
                attempts,
                last_error: result.err(),
            }),
            None => Err(Error::DeadlineExceeded {
                attempts,
                last_error: None,
            }),
        }
    }

    fn partition_mismatch(&self, ctx: &ExecutionContext) -> Option<Rejection> {
        (*ctx.partition != *self.gates.partition).then(|| Rejection::PartitionMismatch {
            context: Box::new((*ctx.partition).clone()),
            pipeline: Box::new((*self.gates.partition).clone()),
        })
    }

    async fn run_attempts<T, F, Fut>(
        &self,
        ctx: &ExecutionContext,
        mut operation: F,
    ) -> Result<T, Ended<E>>
    where
        F: FnMut(AttemptContext) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let clock = &*self.gates.clock;
        let mut dispatched: u32 = 0;
        let mut previous_delay: Option<Duration> = None;
        let mut last_error: Option<E> = None;
        loop {
            let mut admission = match self.admit_waiting(ctx, dispatched > 0).await {
                Ok(admission) => admission,
                Err(rejection) => {
                    tracing::debug!(
                        operation_id = %ctx.operation_id,
                        reason = %rejection.reason(),
                        attempts = dispatched,
                        "attempt rejected before dispatch"
                    );
                    let fallback =
                        rejection.is_capacity() && self.classifier.fallback_on_rejection_enabled();
                    return Err(Ended {
                        error: Error::from_rejection(rejection, dispatched, last_error),
                        fallback,
                    });
                }
            };
            dispatched += 1;
            let attempt_id = self.next_attempt_id();
            let started = clock.now();
            let timeout_at = started + self.attempt_timeout;
            let attempt_deadline = timeout_at.min(ctx.deadline);
            let attempt = AttemptContext {
                operation_id: ctx.operation_id.clone(),
                attempt_id,
                dispatched_attempt_number: dispatched,
                attempt_deadline,
                operation_deadline: ctx.deadline,
                clock: Arc::clone(&self.gates.clock),
            };
            admission.mark_dispatched();
            let call = operation(attempt);
            let returned = match self.requirement {
                AttemptTimeoutRequirement::Cooperative => Some(call.await),
                AttemptTimeoutRequirement::Preemptive => {
                    until_deadline(clock, attempt_deadline, call).await
                }
            };
            let ended = clock.now();
            let outcome = match returned {
                // The timer won because the overall deadline came first: the
                // attempt was dropped with no outcome, so nothing is recorded.
                None if ctx.deadline <= timeout_at => {
                    drop(admission);
                    return Err(Ended {
                        error: Error::DeadlineExceeded {
                            attempts: dispatched,
                            last_error,
                        },
                        fallback: false,
                    });
                }
                None => Outcome::TimedOut,
                Some(_) if ended >= timeout_at => Outcome::TimedOut,
                Some(Ok(value)) => Outcome::Value(value),
                Some(Err(error)) => Outcome::Failed(error),
            };
            let classification = match &outcome {
                Outcome::Value(_) => Classification::SUCCESS,
                Outcome::Failed(error) => self.classifier.classify(error),
                Outcome::TimedOut => self.classifier.classify_attempt_timeout(),
            };
            admission.settle(classification.verdict);
            let current_error = match outcome {
                Outcome::Value(value) if ended < ctx.deadline => return Ok(value),
                Outcome::Value(_) | Outcome::TimedOut => None,
                Outcome::Failed(error) => Some(error),
            };
            if ended >= ctx.deadline {
                // A late result is replaced, whatever it was.
                return Err(Ended {
                    error: Error::DeadlineExceeded {
                        attempts: dispatched,
                        last_error: current_error,
                    },
                    fallback: false,
                });
            }
            let final_error = |error: Option<E>| match error {
                Some(source) => Error::Failed {
                    attempts: dispatched,
                    source,
                },
                None => Error::AttemptTimeout {
                    attempts: dispatched,
                    timeout: self.attempt_timeout,
                },
            };
            if !classification.retryable {
                return Err(Ended {
                    error: final_error(current_error),
                    fallback: classification.fallback,
                });
            }
            let random = mix64(attempt_id.as_u128() as u64 ^ JITTER_SALT);
            let Some(delay) = self.retry.next_delay(dispatched, previous_delay, random) else {
                return Err(Ended {
                    error: final_error(current_error),
                    fallback: classification.fallback,
                });
            };
            let retry_at = ended + delay;
            if let Some(refusal) = ctx.safety.refuses_retry(ctx.started, retry_at) {
                return Err(Ended {
                    error: Error::Rejected {
                        rejection: Rejection::RetryRefused(refusal),
                        attempts: dispatched,
                        last_error: current_error,
                    },
                    fallback: classification.fallback,
                });
            }
            if retry_at >= ctx.deadline {
                // The delay does not fit in the time left: no retry starts.
                return Err(Ended {
                    error: Error::DeadlineExceeded {
                        attempts: dispatched,
                        last_error: current_error,
                    },
                    fallback: false,
                });
            }
            tracing::debug!(
                operation_id = %ctx.operation_id,
                attempt = dispatched,
                delay_ms = delay.as_millis() as u64,
                "retry scheduled"
            );
            // Nothing is held here: the admission was settled above.
            clock.sleep(delay).await;
            previous_delay = Some(delay);
            last_error = current_error;
        }
    }

    fn next_attempt_id(&self) -> AttemptId {
        let counter = self.attempts_issued.fetch_add(1, Ordering::Relaxed);
        // mix64 is a bijection, so distinct counters give distinct low halves.
        let low = mix64(counter.wrapping_add(self.seed));
        AttemptId::from_u128((u128::from(self.id_high) << 64) | u128::from(low))
    }

    /// What the pipeline is: profile, partition, enabled policies and
    /// capability notes. Calls nothing, changes nothing, performs no I/O.
    pub fn explain(&self) -> Explanation {
        let mut enabled_policies = vec![
            "attempt".to_owned(),
            format!("retry(maxAttempts={})", self.retry.max_attempts()),
        ];
        let optional = [
            ("retry_budget", self.gates.budget.is_some()),
            ("rate_limit", self.gates.rate_limit.is_some()),
            ("circuit", self.gates.circuit.is_some()),
            ("bulkhead", self.gates.bulkhead.is_some()),
            ("fallback", self.fallback),
        ];
        enabled_policies.extend(
            optional
                .into_iter()
                .filter(|(_, enabled)| *enabled)
                .map(|(name, _)| name.to_owned()),
        );
        let mut check_order: Vec<String> = ["partition", "retry_safety", "deadline"]
            .into_iter()
            .map(str::to_owned)
            .collect();
        check_order.extend(
            [
                ("circuit", self.gates.circuit.is_some()),
                ("retry_budget", self.gates.budget.is_some()),
                ("rate_limit", self.gates.rate_limit.is_some()),
                ("bulkhead", self.gates.bulkhead.is_some()),
                ("attempt_timeout", true),
            ]
            .into_iter()
            .filter(|(_, enabled)| *enabled)
            .map(|(name, _)| name.to_owned()),
        );
        Explanation {
            profile_id: self.profile_id.clone(),
            profile_version: self.profile_version.clone(),
            partition: (*self.gates.partition).clone(),
            enabled_policies,
            check_order,
            capability_notes: capability_notes(self.requirement, self.bulkhead_queue),
        }
    }

    /// Whether the fallback policy is on (the classifier then says which
    /// final outcomes the fallback may replace).
    pub fn fallback_enabled(&self) -> bool {
        self.fallback
    }

    /// The retry schedule (single attempt when `retry` was not called).
    pub fn retry_policy(&self) -> &RetryPolicy {
        &self.retry
    }

    /// The classifier.
    pub fn classifier(&self) -> &Classifier<E> {
        &self.classifier
    }

    /// The partition whose state the pipeline keeps.
    pub fn partition(&self) -> &Partition {
        &self.gates.partition
    }

    /// The pipeline's clock.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.gates.clock
    }

    /// The attempt timeout and how it is enforced.
    pub fn attempt_timeout(&self) -> (Duration, AttemptTimeoutRequirement) {
        (self.attempt_timeout, self.requirement)
    }

    /// The circuit breaker's state now, if there is a breaker.
    pub fn circuit_state(&self) -> Option<CircuitState> {
        let now = self.gates.clock.now();
        self.gates
            .circuit
            .as_ref()
            .map(|circuit| circuit.state(now))
    }

    /// Rate-limit tokens available now, if there is a rate limit.
    pub fn rate_limit_available(&self) -> Option<u32> {
        let now = self.gates.clock.now();
        self.gates
            .rate_limit
            .as_ref()
            .map(|bucket| bucket.available(now))
    }

    /// Retry tokens available now, if there is a retry budget.
    pub fn retry_budget_available(&self) -> Option<u32> {
        let now = self.gates.clock.now();
        self.gates
            .budget
            .as_ref()
            .map(|budget| budget.available(now))
    }

    /// Bulkhead slots in use now, if there is a bulkhead.
    pub fn bulkhead_in_use(&self) -> Option<u32> {
        self.gates.bulkhead.as_ref().map(Bulkhead::in_use)
    }

    /// Admissions waiting in the bulkhead queue now, if there is a bulkhead.
    pub fn bulkhead_queued(&self) -> Option<u32> {
        self.gates.bulkhead.as_ref().map(Bulkhead::queued)
    }
}

impl<E> std::fmt::Debug for CompiledPipeline<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompiledPipeline")
            .field("profile_id", &self.profile_id)
            .field("profile_version", &self.profile_version)
            .field("gates", &self.gates)
            .field("attempt_timeout", &self.attempt_timeout)
            .field("requirement", &self.requirement)
            .field("retry", &self.retry)
            .field("fallback", &self.fallback)
            .field("classifier", &self.classifier)
            .finish_non_exhaustive()
    }
}
