//! The token bucket shared by the rate limit and the retry budget.
//!
//! A bucket starts full with `capacity` tokens. Each time a whole
//! `refill_interval` has elapsed since the last refill, `refill_tokens` tokens
//! are added, never beyond `capacity`; refills keep their phase, so a bucket
//! read rarely still refills exactly as if read every interval. Taking a token
//! never waits: it succeeds or says when the next refill is due. The state is
//! one `parking_lot::Mutex` around two words, held for a few instructions.

use std::time::Duration;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::clock::Instant;

/// Largest bucket capacity, in tokens.
pub const BUCKET_TOKENS_MAX: u32 = 1_000_000_000;
/// Longest refill interval, in milliseconds (one day).
pub const BUCKET_REFILL_MS_MAX: u64 = 86_400_000;

/// Why a token bucket was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The capacity was zero or above [`BUCKET_TOKENS_MAX`].
    #[error("token bucket capacity must be in 1..={BUCKET_TOKENS_MAX}, found {found}")]
    Capacity {
        /// The value given.
        found: u32,
    },
    /// The refill amount was zero or above the capacity.
    #[error("token bucket refill tokens must be in 1..=capacity ({capacity}), found {found}")]
    RefillTokens {
        /// The capacity given.
        capacity: u32,
        /// The refill amount given.
        found: u32,
    },
    /// The refill interval was zero or above [`BUCKET_REFILL_MS_MAX`].
    #[error(
        "token bucket refill interval must be in 1ns..={BUCKET_REFILL_MS_MAX} ms, found {found:?}"
    )]
    RefillInterval {
        /// The interval given.
        found: Duration,
    },
}

/// The numbers of a token bucket: `capacity` tokens, `refill_tokens` added
/// every `refill_interval`. Checked when the pipeline is compiled.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct TokenBucketSpec {
    /// Tokens in a full bucket; the bucket starts full.
    pub capacity: u32,
    /// Tokens added at each refill.
    pub refill_tokens: u32,
    /// Time between two refills.
    pub refill_interval: Duration,
}

impl TokenBucketSpec {
    /// Checks the numbers: `1 <= refill_tokens <= capacity <=
    /// BUCKET_TOKENS_MAX` and `0 < refill_interval <= BUCKET_REFILL_MS_MAX`.
    pub fn validate(&self) -> Result<(), Error> {
        if self.capacity == 0 || self.capacity > BUCKET_TOKENS_MAX {
            return Err(Error::Capacity {
                found: self.capacity,
            });
        }
        if self.refill_tokens == 0 || self.refill_tokens > self.capacity {
            return Err(Error::RefillTokens {
                capacity: self.capacity,
                found: self.refill_tokens,
            });
        }
        if self.refill_interval.is_zero()
            || self.refill_interval > Duration::from_millis(BUCKET_REFILL_MS_MAX)
        {
            return Err(Error::RefillInterval {
                found: self.refill_interval,
            });
        }
        Ok(())
    }
}

/// A live token bucket.
#[derive(Debug)]
pub(crate) struct TokenBucket {
    spec: TokenBucketSpec,
    state: Mutex<BucketState>,
}

#[derive(Debug)]
struct BucketState {
    tokens: u32,
    last_refill: Instant,
}

impl TokenBucket {
    /// A full bucket whose refill phase starts at `now`. The spec must have
    /// been validated.
    pub(crate) fn new(spec: TokenBucketSpec, now: Instant) -> Self {
        debug_assert_eq!(spec.validate(), Ok(()));
        TokenBucket {
            spec,
            state: Mutex::new(BucketState {
                tokens: spec.capacity,
                last_refill: now,
            }),
        }
    }

    /// Takes one token, or returns the time until the next refill.
    pub(crate) fn try_take(&self, now: Instant) -> Result<(), Duration> {
        let mut state = self.state.lock();
        self.refill(&mut state, now);
        if state.tokens > 0 {
            state.tokens -= 1;
            Ok(())
        } else {
            let next = state.last_refill + self.spec.refill_interval;
            Err(next.saturating_duration_since(now))
        }
    }

    /// Gives back one token that was taken but not used, never beyond capacity.
    pub(crate) fn give_back(&self, now: Instant) {
        let mut state = self.state.lock();
        self.refill(&mut state, now);
        state.tokens = (state.tokens + 1).min(self.spec.capacity);
    }

    /// Tokens available at `now`.
    pub(crate) fn available(&self, now: Instant) -> u32 {
        let mut state = self.state.lock();
        self.refill(&mut state, now);
        state.tokens
    }

    fn refill(&self, state: &mut BucketState, now: Instant) {
        let elapsed = now.saturating_duration_since(state.last_refill);
        if elapsed < self.spec.refill_interval {
            return;
        }
        let interval = self.spec.refill_interval.as_nanos();
        let refills = elapsed.as_nanos() / interval;
        let added = refills.saturating_mul(u128::from(self.spec.refill_tokens));
        let tokens = (u128::from(state.tokens) + added).min(u128::from(self.spec.capacity));
        state.tokens = u32::try_from(tokens).unwrap_or(self.spec.capacity);
        // Keep the phase: advance by whole intervals only. `refills * interval`
        // is at most `elapsed`, which fits a Duration.
        let advanced = refills * interval;
        state.last_refill =
            state.last_refill + Duration::from_nanos(u64::try_from(advanced).unwrap_or(u64::MAX));
        debug_assert!(state.tokens <= self.spec.capacity);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Instant {
        Instant::from_epoch(Duration::from_millis(ms))
    }

    fn spec(capacity: u32, refill: u32, interval_ms: u64) -> TokenBucketSpec {
        TokenBucketSpec {
            capacity,
            refill_tokens: refill,
            refill_interval: Duration::from_millis(interval_ms),
        }
    }

    #[test]
    fn invalid_numbers_are_refused() {
        // Goal: each bucket rule has its typed error.
        // Method: validate one spec per broken rule.
        assert_eq!(spec(0, 1, 1).validate(), Err(Error::Capacity { found: 0 }));
        assert_eq!(
            spec(2, 3, 1).validate(),
            Err(Error::RefillTokens {
                capacity: 2,
                found: 3
            })
        );
        assert_eq!(
            spec(2, 0, 1).validate(),
            Err(Error::RefillTokens {
                capacity: 2,
                found: 0
            })
        );
        assert!(matches!(
            spec(2, 1, 0).validate(),
            Err(Error::RefillInterval { .. })
        ));
        assert_eq!(spec(5, 5, 1000).validate(), Ok(()));
    }

    #[test]
    fn bucket_drains_and_refills_by_whole_intervals() {
        // Goal: a bucket starts full, empties, and refills in steps keeping phase.
        // Method: a 3-token bucket refilled by 2 every 100 ms on a virtual timeline.
        let bucket = TokenBucket::new(spec(3, 2, 100), at(0));
        for _ in 0..3 {
            assert_eq!(bucket.try_take(at(10)), Ok(()));
        }
        assert_eq!(bucket.try_take(at(10)), Err(Duration::from_millis(90)));
        assert_eq!(bucket.available(at(99)), 0);
        assert_eq!(bucket.available(at(150)), 2);
        assert_eq!(bucket.try_take(at(150)), Ok(()));
        // The next refill is at 200 ms, not 250 ms: the phase is kept.
        assert_eq!(bucket.available(at(200)), 3);
        assert_eq!(bucket.available(at(10_000)), 3);
    }

    #[test]
    fn given_back_tokens_never_exceed_capacity() {
        // Goal: returning a token is capped at capacity.
        // Method: take one, return two, count.
        let bucket = TokenBucket::new(spec(2, 1, 100), at(0));
        bucket.try_take(at(0)).unwrap();
        bucket.give_back(at(0));
        bucket.give_back(at(0));
        assert_eq!(bucket.available(at(0)), 2);
    }
}
