//! The retry budget: a token bucket of retry tokens shared by every operation
//! of a pipeline.
//!
//! A first attempt never touches the budget. Every retry must reserve one
//! token before it is admitted; the reservation is spent when the retry is
//! dispatched, and given back when a later check rejects the retry or the
//! admission is dropped before dispatch, but only within the reservation's
//! time to live. This caps the extra load retries put on a struggling
//! dependency across all operations at `max_tokens` at once and
//! `refill_tokens` per `refill_interval` in the long run.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::bucket::{self, TokenBucket, TokenBucketSpec};
use crate::clock::Instant;

/// Longest reservation time to live, in milliseconds (one day).
pub const BUDGET_RESERVATION_MS_MAX: u64 = 86_400_000;

/// Why a retry budget was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The bucket numbers were invalid.
    #[error("retry budget: {0}")]
    Bucket(#[from] bucket::Error),
    /// The reservation time to live was zero or above
    /// [`BUDGET_RESERVATION_MS_MAX`].
    #[error("retry budget reservation ttl must be in 1ns..={BUDGET_RESERVATION_MS_MAX} ms, found {found:?}")]
    ReservationTtl {
        /// The value given.
        found: Duration,
    },
}

/// The numbers of a retry budget, in the order of `Builder::retry_budget`'s
/// arguments.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct RetryBudgetSpec {
    /// Retry tokens in a full budget; the budget starts full.
    pub max_tokens: u32,
    /// Retry tokens added at each refill, at most `max_tokens`.
    pub refill_tokens: u32,
    /// Time between two refills.
    pub refill_interval: Duration,
    /// How long a reserved token stays returnable. A reservation given back
    /// later than this after it was made is counted as spent: an admission
    /// that sat that long may well have reached the dependency through a path
    /// the pipeline cannot see (for example an engine that lost track of a
    /// dispatch), and spending is the safe side for a budget.
    pub reservation_ttl: Duration,
}

impl RetryBudgetSpec {
    /// Checks every number.
    pub fn validate(&self) -> Result<(), Error> {
        self.bucket().validate()?;
        if self.reservation_ttl.is_zero()
            || self.reservation_ttl > Duration::from_millis(BUDGET_RESERVATION_MS_MAX)
        {
            return Err(Error::ReservationTtl {
                found: self.reservation_ttl,
            });
        }
        Ok(())
    }

    fn bucket(&self) -> TokenBucketSpec {
        TokenBucketSpec {
            capacity: self.max_tokens,
            refill_tokens: self.refill_tokens,
            refill_interval: self.refill_interval,
        }
    }
}

/// A live retry budget.
#[derive(Debug)]
pub(crate) struct RetryBudget {
    spec: RetryBudgetSpec,
    bucket: TokenBucket,
}

impl RetryBudget {
    /// A full budget. The spec must have been validated.
    pub(crate) fn new(spec: RetryBudgetSpec, now: Instant) -> Self {
        RetryBudget {
            spec,
            bucket: TokenBucket::new(spec.bucket(), now),
        }
    }

    /// Reserves one retry token; `false` when the budget is exhausted.
    pub(crate) fn reserve(&self, now: Instant) -> bool {
        self.bucket.try_take(now).is_ok()
    }

    /// Gives back a reservation made at `reserved_at` that was not dispatched,
    /// unless its time to live has passed.
    pub(crate) fn give_back(&self, reserved_at: Instant, now: Instant) {
        if now.saturating_duration_since(reserved_at) < self.spec.reservation_ttl {
            self.bucket.give_back(now);
        }
    }

    /// Retry tokens available at `now`.
    pub(crate) fn available(&self, now: Instant) -> u32 {
        self.bucket.available(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Instant {
        Instant::from_epoch(Duration::from_millis(ms))
    }

    /// The seed's budget: 10 tokens, 10 per 60 s, 10 s reservation ttl.
    fn seed_spec() -> RetryBudgetSpec {
        RetryBudgetSpec {
            max_tokens: 10,
            refill_tokens: 10,
            refill_interval: Duration::from_secs(60),
            reservation_ttl: Duration::from_secs(10),
        }
    }

    #[test]
    fn invalid_numbers_are_refused() {
        // Goal: budget rules have typed errors, bucket rules included.
        // Method: break the ttl and the token count.
        let mut spec = seed_spec();
        spec.reservation_ttl = Duration::ZERO;
        assert!(matches!(spec.validate(), Err(Error::ReservationTtl { .. })));
        let mut spec = seed_spec();
        spec.max_tokens = 0;
        assert_eq!(
            spec.validate(),
            Err(Error::Bucket(bucket::Error::Capacity { found: 0 }))
        );
        assert_eq!(seed_spec().validate(), Ok(()));
    }

    #[test]
    fn budget_exhausts_then_refills() {
        // Goal: ten reservations drain the seed's budget until the next refill.
        // Method: reserve eleven times at t=0, once more at t=60 s.
        let budget = RetryBudget::new(seed_spec(), at(0));
        for _ in 0..10 {
            assert!(budget.reserve(at(0)));
        }
        assert!(!budget.reserve(at(59_999)));
        assert!(budget.reserve(at(60_000)));
        assert_eq!(budget.available(at(60_000)), 9);
    }

    #[test]
    fn reservations_are_returnable_only_within_their_ttl() {
        // Goal: a token given back within the ttl returns; later it stays spent.
        // Method: two reservations given back at 9.999 s and at 10 s.
        let budget = RetryBudget::new(seed_spec(), at(0));
        assert!(budget.reserve(at(0)));
        assert!(budget.reserve(at(0)));
        budget.give_back(at(0), at(9_999));
        assert_eq!(budget.available(at(9_999)), 9);
        budget.give_back(at(0), at(10_000));
        assert_eq!(budget.available(at(10_000)), 9);
    }
}
