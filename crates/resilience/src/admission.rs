//! Admission: the checks that run before every attempt, and the guard that
//! holds the permits they took.
//!
//! The checks run in this fixed order; the first refusal wins:
//!
//! 1. the context's partition equals the pipeline's (else
//!    [`Rejection::PartitionMismatch`]);
//! 2. for a retry, the operation's [`Safety`](crate::Safety) allows repeating
//!    it (else [`Rejection::RetryRefused`]);
//! 3. the overall deadline has not passed (else
//!    [`Rejection::DeadlineExceeded`]);
//! 4. the circuit breaker admits the call, taking a probe slot when half-open
//!    (else [`Rejection::CircuitOpen`]);
//! 5. for a retry, the retry budget reserves a retry token (else
//!    [`Rejection::RetryBudgetExhausted`]);
//! 6. the rate limit yields a token (else [`Rejection::RateLimited`]);
//! 7. the bulkhead yields a slot, waiting in its bounded queue when the
//!    waiting form is used (else [`Rejection::BulkheadFull`]); after a wait
//!    the deadline is checked again.
//!
//! Every permit lives in the [`Admission`] guard. When a later check refuses,
//! the guard built so far is dropped, which releases what earlier checks
//! took: the half-open probe slot is freed uncounted, the reserved retry token
//! and the rate-limit token are given back (nothing reached the dependency),
//! the bulkhead slot is freed. A rejection therefore never reaches the
//! callable and never counts as a dependency failure.
//!
//! After admission the owner calls [`Admission::mark_dispatched`] right before
//! handing the call to the dependency, then [`Admission::settle`] with the
//! breaker verdict. Dropping an admission unsettled releases the probe
//! uncounted and frees the slot; tokens are given back only if it was never
//! dispatched.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::bucket::TokenBucket;
use crate::budget::RetryBudget;
use crate::bulkhead::{self, Bulkhead};
use crate::circuit::{CircuitBreaker, Ticket};
use crate::classify::Verdict;
use crate::clock::{Clock, Instant};
use crate::context::{ExecutionContext, RetryRefusal};
use crate::partition::Partition;
use crate::reason::Reason;

/// A refusal before dispatch: the callable was not called and no policy
/// counted a dependency failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    /// The context was created by a pipeline of another partition.
    #[error("The execution context partition must equal every selected policy partition.")]
    PartitionMismatch {
        /// The context's partition.
        context: Box<Partition>,
        /// The pipeline's partition.
        pipeline: Box<Partition>,
    },
    /// A fallback was given to a pipeline built without `Builder::fallback`.
    #[error("a fallback needs the fallback policy, but the pipeline was built without it")]
    FallbackNotEnabled,
    /// The operation's safety declaration refused a retry.
    #[error("retry refused: {0}")]
    RetryRefused(RetryRefusal),
    /// The overall deadline had passed.
    #[error("the overall deadline has passed")]
    DeadlineExceeded,
    /// The circuit was open, or half-open with every probe slot taken.
    #[error("the circuit is {}", match retry_after {
        Some(wait) => format!("open for another {wait:?}"),
        None => "half-open and every probe slot is taken".to_owned(),
    })]
    CircuitOpen {
        /// Time until the open period ends; `None` when half-open and busy.
        retry_after: Option<Duration>,
    },
    /// The retry budget had no token for this retry.
    #[error("the retry budget is exhausted")]
    RetryBudgetExhausted,
    /// The rate limit had no token.
    #[error("rate limited (next token in {retry_after:?})")]
    RateLimited {
        /// Time until the next refill.
        retry_after: Duration,
    },
    /// Every bulkhead slot and queue place was taken.
    #[error("the bulkhead is full")]
    BulkheadFull,
}

impl Rejection {
    /// The stable name of this refusal.
    pub fn reason(&self) -> Reason {
        match self {
            Rejection::PartitionMismatch { .. } | Rejection::FallbackNotEnabled => {
                Reason::InvalidConfiguration
            }
            Rejection::RetryRefused(_) => Reason::RetryRefused,
            Rejection::DeadlineExceeded => Reason::DeadlineExceeded,
            Rejection::CircuitOpen { .. } => Reason::CircuitOpen,
            Rejection::RetryBudgetExhausted => Reason::RetryBudgetExhausted,
            Rejection::RateLimited { .. } => Reason::RateLimited,
            Rejection::BulkheadFull => Reason::BulkheadFull,
        }
    }

    /// Whether this is a capacity refusal by a policy (circuit, budget, rate
    /// limit, bulkhead), the kind a fallback may replace.
    pub fn is_capacity(&self) -> bool {
        matches!(
            self,
            Rejection::CircuitOpen { .. }
                | Rejection::RetryBudgetExhausted
                | Rejection::RateLimited { .. }
                | Rejection::BulkheadFull
        )
    }
}

/// The live policies that admissions go through; shared by every operation
/// of a pipeline.
#[derive(Debug)]
pub(crate) struct Gates {
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) partition: Arc<Partition>,
    pub(crate) circuit: Option<CircuitBreaker>,
    pub(crate) budget: Option<RetryBudget>,
    pub(crate) rate_limit: Option<TokenBucket>,
    pub(crate) bulkhead: Option<Bulkhead>,
}

impl Gates {
    /// Checks 1 to 6. The returned guard holds every permit taken; on a
    /// refusal the partial guard is dropped, releasing them.
    fn admit_front(
        &self,
        ctx: &ExecutionContext,
        is_retry: bool,
    ) -> Result<Admission<'_>, Rejection> {
        if !Arc::ptr_eq(&ctx.partition, &self.partition) && *ctx.partition != *self.partition {
            return Err(Rejection::PartitionMismatch {
                context: Box::new((*ctx.partition).clone()),
                pipeline: Box::new((*self.partition).clone()),
            });
        }
        let now = self.clock.now();
        if is_retry {
            if let Some(refusal) = ctx.safety.refuses_retry(ctx.started, now) {
                return Err(Rejection::RetryRefused(refusal));
            }
        }
        if now >= ctx.deadline {
            return Err(Rejection::DeadlineExceeded);
        }
        let mut admission = Admission {
            gates: self,
            is_retry,
            circuit: None,
            budget_reserved_at: None,
            rate_token: false,
            bulkhead: None,
            dispatched: false,
            settled: false,
        };
        if let Some(circuit) = &self.circuit {
            let ticket = circuit
                .admit(now)
                .map_err(|refusal| Rejection::CircuitOpen {
                    retry_after: refusal.retry_after,
                })?;
            admission.circuit = Some(ticket);
        }
        if is_retry {
            if let Some(budget) = &self.budget {
                if !budget.reserve(now) {
                    return Err(Rejection::RetryBudgetExhausted);
                }
                admission.budget_reserved_at = Some(now);
            }
        }
        if let Some(rate_limit) = &self.rate_limit {
            rate_limit
                .try_take(now)
                .map_err(|retry_after| Rejection::RateLimited { retry_after })?;
            admission.rate_token = true;
        }
        Ok(admission)
    }

    /// All checks, without waiting: a full bulkhead rejects at once.
    pub(crate) fn admit(
        &self,
        ctx: &ExecutionContext,
        is_retry: bool,
    ) -> Result<Admission<'_>, Rejection> {
        let mut admission = self.admit_front(ctx, is_retry)?;
        if let Some(bulkhead) = &self.bulkhead {
            admission.bulkhead = Some(bulkhead.try_acquire().ok_or(Rejection::BulkheadFull)?);
        }
        Ok(admission)
    }

    /// All checks, waiting in the bulkhead queue until the deadline if needed.
    pub(crate) async fn admit_waiting(
        &self,
        ctx: &ExecutionContext,
        is_retry: bool,
    ) -> Result<Admission<'_>, Rejection> {
        let mut admission = self.admit_front(ctx, is_retry)?;
        if let Some(bulkhead) = &self.bulkhead {
            if let Some(permit) = bulkhead.try_acquire() {
                admission.bulkhead = Some(permit);
            } else {
                let permit =
                    bulkhead
                        .acquire(&*self.clock, ctx.deadline)
                        .await
                        .map_err(|refusal| match refusal {
                            bulkhead::Refusal::Full => Rejection::BulkheadFull,
                            bulkhead::Refusal::Deadline => Rejection::DeadlineExceeded,
                        })?;
                admission.bulkhead = Some(permit);
                // Waiting took time: the deadline is checked again before
                // anything is dispatched.
                if self.clock.now() >= ctx.deadline {
                    return Err(Rejection::DeadlineExceeded);
                }
            }
        }
        Ok(admission)
    }
}

/// The permits one admitted attempt holds. See the [module docs](self) for
/// the settle and drop rules.
#[must_use = "dropping an admission releases its permits"]
pub struct Admission<'p> {
    gates: &'p Gates,
    is_retry: bool,
    circuit: Option<Ticket>,
    budget_reserved_at: Option<Instant>,
    rate_token: bool,
    bulkhead: Option<bulkhead::SlotPermit<'p>>,
    dispatched: bool,
    settled: bool,
}

impl Admission<'_> {
    /// Marks the attempt as handed to the dependency: from now on its
    /// rate-limit and retry-budget tokens are spent even if the admission is
    /// dropped (for example because the caller cancelled the call mid-flight).
    pub fn mark_dispatched(&mut self) {
        self.dispatched = true;
    }

    /// Whether [`Admission::mark_dispatched`] was called.
    pub fn is_dispatched(&self) -> bool {
        self.dispatched
    }

    /// Whether this admission was for a retry.
    pub fn is_retry(&self) -> bool {
        self.is_retry
    }

    /// Whether this admission holds a half-open probe slot.
    pub fn is_probe(&self) -> bool {
        self.circuit.is_some_and(|ticket| ticket.is_probe())
    }

    /// Records the dispatched attempt's verdict in the circuit breaker, spends
    /// its tokens and frees its bulkhead slot. Settling implies dispatch.
    /// Accepts a [`Verdict`] or a whole
    /// [`Classification`](crate::Classification).
    pub fn settle(mut self, verdict: impl Into<Verdict>) {
        let verdict = verdict.into();
        self.dispatched = true;
        self.settled = true;
        if let (Some(circuit), Some(ticket)) = (&self.gates.circuit, self.circuit) {
            circuit.settle(ticket, verdict, self.gates.clock.now());
        }
        // Drop frees the bulkhead slot; tokens stay spent.
    }
}

impl Drop for Admission<'_> {
    fn drop(&mut self) {
        if !self.settled {
            if let (Some(circuit), Some(ticket)) = (&self.gates.circuit, self.circuit) {
                circuit.release(ticket);
            }
        }
        if !self.dispatched && (self.rate_token || self.budget_reserved_at.is_some()) {
            let now = self.gates.clock.now();
            if let (Some(budget), Some(reserved_at)) = (&self.gates.budget, self.budget_reserved_at)
            {
                budget.give_back(reserved_at, now);
            }
            if let (Some(rate_limit), true) = (&self.gates.rate_limit, self.rate_token) {
                rate_limit.give_back(now);
            }
        }
        // The bulkhead permit, if any, is freed when its field is dropped.
    }
}

impl fmt::Debug for Admission<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Admission")
            .field("is_retry", &self.is_retry)
            .field("circuit", &self.circuit)
            .field("budget_reserved_at", &self.budget_reserved_at)
            .field("rate_token", &self.rate_token)
            .field("bulkhead_slot", &self.bulkhead.is_some())
            .field("dispatched", &self.dispatched)
            .field("settled", &self.settled)
            .finish()
    }
}
