//! The retry policy and its backoff, as a pure function.
//!
//! [`RetryPolicy::next_delay`] owns the whole retry schedule: given the number
//! of the attempt that just failed, the previous delay and a random `u64`
//! drawn by the caller, it returns the delay before the next attempt or `None`
//! when no attempt is left. It reads no clock and draws no randomness, so the
//! durable engine can draw the random word deterministically, record it, and
//! turn the delay into a durable timer; the in-process pipeline feeds it from
//! its own seeded counter.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Most attempts (first attempt included) a retry policy may allow.
pub const RETRY_ATTEMPTS_MAX: u32 = 100;
/// Longest configurable backoff delay, in milliseconds (one day).
pub const RETRY_DELAY_MS_MAX: u64 = 86_400_000;

/// How the raw delay grows with the number of failed attempts `n` (1-based).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum BackoffMode {
    /// `base` before every retry.
    Constant,
    /// `base * n`.
    Linear,
    /// `base * 2^(n-1)`.
    Exponential,
}

/// How randomness spreads the raw delay `d` (already capped at `max`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum JitterMode {
    /// Exactly `d`.
    None,
    /// Uniform in `0..=d`.
    Full,
    /// Uniform in `d/2..=d`.
    Equal,
    /// Uniform in `base..=min(max, 3 * previous)`, where `previous` is the
    /// previous delay (`base` before the first retry). This is its own growth
    /// rule, so it is only accepted together with [`BackoffMode::Exponential`].
    Decorrelated,
}

/// Why a retry policy was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// `max_attempts` was zero or above [`RETRY_ATTEMPTS_MAX`].
    #[error("retry max attempts must be in 1..={RETRY_ATTEMPTS_MAX}, found {found}")]
    MaxAttempts {
        /// The value given.
        found: u32,
    },
    /// The base delay was zero.
    #[error("retry base delay must be positive, found zero")]
    ZeroBaseDelay,
    /// The max delay was below the base delay.
    #[error("retry max delay must be at least the base delay {base:?}, found {max:?}")]
    MaxBelowBase {
        /// The base delay given.
        base: Duration,
        /// The max delay given.
        max: Duration,
    },
    /// The max delay was above [`RETRY_DELAY_MS_MAX`].
    #[error("retry max delay must be at most {RETRY_DELAY_MS_MAX} ms, found {found:?}")]
    MaxDelayTooLong {
        /// The max delay given.
        found: Duration,
    },
    /// Decorrelated jitter with a backoff mode other than exponential.
    #[error("decorrelated jitter needs exponential backoff, found {backoff:?}")]
    DecorrelatedNeedsExponential {
        /// The backoff mode given.
        backoff: BackoffMode,
    },
}

/// Attempts, backoff and jitter: a validated, immutable retry schedule.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct RetryPolicy {
    max_attempts: u32,
    backoff: BackoffMode,
    base: Duration,
    max: Duration,
    jitter: JitterMode,
}

impl RetryPolicy {
    /// Checks and builds a retry schedule.
    ///
    /// * `max_attempts`: attempts in total, first attempt included (1 means
    ///   no retry), in `1..=RETRY_ATTEMPTS_MAX`.
    /// * `backoff`: how the raw delay grows.
    /// * `base`: the first raw delay; positive.
    /// * `max`: the cap on every delay; `base <= max <= RETRY_DELAY_MS_MAX`.
    /// * `jitter`: how randomness spreads the delay.
    pub fn new(
        max_attempts: u32,
        backoff: BackoffMode,
        base: Duration,
        max: Duration,
        jitter: JitterMode,
    ) -> Result<Self, Error> {
        if max_attempts == 0 || max_attempts > RETRY_ATTEMPTS_MAX {
            return Err(Error::MaxAttempts {
                found: max_attempts,
            });
        }
        if base.is_zero() {
            return Err(Error::ZeroBaseDelay);
        }
        if max < base {
            return Err(Error::MaxBelowBase { base, max });
        }
        if max > Duration::from_millis(RETRY_DELAY_MS_MAX) {
            return Err(Error::MaxDelayTooLong { found: max });
        }
        if jitter == JitterMode::Decorrelated && backoff != BackoffMode::Exponential {
            return Err(Error::DecorrelatedNeedsExponential { backoff });
        }
        Ok(RetryPolicy {
            max_attempts,
            backoff,
            base,
            max,
            jitter,
        })
    }

    /// The policy of a pipeline whose `retry` was never called: one attempt,
    /// no retry.
    pub(crate) fn single_attempt() -> Self {
        RetryPolicy {
            max_attempts: 1,
            backoff: BackoffMode::Constant,
            base: Duration::from_millis(1),
            max: Duration::from_millis(1),
            jitter: JitterMode::None,
        }
    }

    /// Attempts in total, first attempt included.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The backoff mode.
    pub fn backoff(&self) -> BackoffMode {
        self.backoff
    }

    /// The base delay.
    pub fn base(&self) -> Duration {
        self.base
    }

    /// The cap on every delay.
    pub fn max(&self) -> Duration {
        self.max
    }

    /// The jitter mode.
    pub fn jitter(&self) -> JitterMode {
        self.jitter
    }

    /// The delay before the attempt after `failed_attempt`, or `None` when
    /// `failed_attempt` was the last attempt allowed.
    ///
    /// * `failed_attempt`: the 1-based number of the dispatched attempt that
    ///   just failed.
    /// * `previous_delay`: the delay returned for the previous retry of this
    ///   operation (`None` before the first retry); only decorrelated jitter
    ///   reads it.
    /// * `random`: a uniformly distributed word; the same inputs always give
    ///   the same delay.
    ///
    /// Every returned delay is at most `max`.
    ///
    /// # Panics
    /// When `failed_attempt` is zero: attempt numbers start at 1.
    pub fn next_delay(
        &self,
        failed_attempt: u32,
        previous_delay: Option<Duration>,
        random: u64,
    ) -> Option<Duration> {
        assert!(failed_attempt >= 1, "attempt numbers start at 1");
        if failed_attempt >= self.max_attempts {
            return None;
        }
        let base = nanos(self.base);
        let max = nanos(self.max);
        let delay = match self.jitter {
            JitterMode::None => self.raw_nanos(failed_attempt),
            JitterMode::Full => uniform(0, self.raw_nanos(failed_attempt), random),
            JitterMode::Equal => {
                let raw = self.raw_nanos(failed_attempt);
                uniform(raw / 2, raw, random)
            }
            JitterMode::Decorrelated => {
                let previous = previous_delay.map_or(base, nanos).max(base);
                let upper = previous.saturating_mul(3).min(max);
                uniform(base, upper, random)
            }
        };
        debug_assert!(delay <= max);
        Some(Duration::from_nanos(delay))
    }

    /// The raw (unjittered) delay after `n` failed attempts, capped at `max`.
    fn raw_nanos(&self, n: u32) -> u64 {
        let base = nanos(self.base);
        let raw = match self.backoff {
            BackoffMode::Constant => base,
            BackoffMode::Linear => base.saturating_mul(u64::from(n)),
            BackoffMode::Exponential => {
                let shift = n - 1;
                if shift >= 63 {
                    u64::MAX
                } else {
                    base.saturating_mul(1u64 << shift)
                }
            }
        };
        raw.min(nanos(self.max))
    }
}

/// A duration in nanoseconds; every configurable delay fits in `u64`.
fn nanos(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

/// A value in `low..=high` from a uniform random word (multiply-high, so the
/// bias is below 2^-64 per value).
fn uniform(low: u64, high: u64, random: u64) -> u64 {
    debug_assert!(low <= high);
    let span = u128::from(high - low) + 1;
    let offset = (u128::from(random) * span) >> 64;
    low + u64::try_from(offset).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ms(value: u64) -> Duration {
        Duration::from_millis(value)
    }

    #[test]
    fn invalid_numbers_are_refused() {
        // Goal: every invalid number or combination yields its typed error.
        // Method: build one policy per rule broken.
        let ok = |m| RetryPolicy::new(m, BackoffMode::Constant, ms(5), ms(5), JitterMode::None);
        assert_eq!(ok(0), Err(Error::MaxAttempts { found: 0 }));
        assert_eq!(
            ok(RETRY_ATTEMPTS_MAX + 1),
            Err(Error::MaxAttempts {
                found: RETRY_ATTEMPTS_MAX + 1
            })
        );
        assert!(ok(RETRY_ATTEMPTS_MAX).is_ok());
        assert_eq!(
            RetryPolicy::new(3, BackoffMode::Linear, ms(10), ms(5), JitterMode::None),
            Err(Error::MaxBelowBase {
                base: ms(10),
                max: ms(5)
            })
        );
        assert_eq!(
            RetryPolicy::new(3, BackoffMode::Linear, ms(0), ms(5), JitterMode::None),
            Err(Error::ZeroBaseDelay)
        );
        assert!(matches!(
            RetryPolicy::new(
                3,
                BackoffMode::Linear,
                ms(1),
                ms(RETRY_DELAY_MS_MAX + 1),
                JitterMode::None
            ),
            Err(Error::MaxDelayTooLong { .. })
        ));
        assert_eq!(
            RetryPolicy::new(
                3,
                BackoffMode::Linear,
                ms(1),
                ms(5),
                JitterMode::Decorrelated
            ),
            Err(Error::DecorrelatedNeedsExponential {
                backoff: BackoffMode::Linear
            })
        );
    }

    #[test]
    fn raw_schedules_grow_as_documented() {
        // Goal: constant, linear and exponential schedules without jitter.
        // Method: list the delays after attempts 1..=5 against hand values.
        let schedule = |backoff| {
            let policy = RetryPolicy::new(6, backoff, ms(10), ms(100), JitterMode::None).unwrap();
            (1..=5)
                .map(|n| policy.next_delay(n, None, 0).unwrap().as_millis())
                .collect::<Vec<_>>()
        };
        assert_eq!(schedule(BackoffMode::Constant), [10, 10, 10, 10, 10]);
        assert_eq!(schedule(BackoffMode::Linear), [10, 20, 30, 40, 50]);
        assert_eq!(schedule(BackoffMode::Exponential), [10, 20, 40, 80, 100]);
    }

    #[test]
    fn no_delay_after_the_last_attempt() {
        // Goal: the schedule ends after max_attempts attempts.
        // Method: ask for the delay after attempts 2 and 3 of a 3-attempt policy.
        let policy =
            RetryPolicy::new(3, BackoffMode::Constant, ms(5), ms(5), JitterMode::None).unwrap();
        assert_eq!(policy.next_delay(2, None, 7), Some(ms(5)));
        assert_eq!(policy.next_delay(3, None, 7), None);
        assert_eq!(policy.next_delay(50, None, 7), None);
        assert_eq!(RetryPolicy::single_attempt().next_delay(1, None, 0), None);
    }

    #[test]
    fn random_word_extremes_reach_the_bounds() {
        // Goal: the random word maps onto the whole documented range.
        // Method: draw with 0 and u64::MAX for full and equal jitter.
        let full =
            RetryPolicy::new(3, BackoffMode::Constant, ms(8), ms(8), JitterMode::Full).unwrap();
        assert_eq!(full.next_delay(1, None, 0), Some(Duration::ZERO));
        assert_eq!(full.next_delay(1, None, u64::MAX), Some(ms(8)));
        let equal =
            RetryPolicy::new(3, BackoffMode::Constant, ms(8), ms(8), JitterMode::Equal).unwrap();
        assert_eq!(equal.next_delay(1, None, 0), Some(ms(4)));
        assert_eq!(equal.next_delay(1, None, u64::MAX), Some(ms(8)));
    }

    fn backoff_strategy() -> impl Strategy<Value = BackoffMode> {
        prop_oneof![
            Just(BackoffMode::Constant),
            Just(BackoffMode::Linear),
            Just(BackoffMode::Exponential)
        ]
    }

    proptest! {
        #[test]
        fn no_jitter_is_the_capped_raw_delay(
            backoff in backoff_strategy(),
            base_ms in 1u64..1_000, extra_ms in 0u64..10_000,
            attempt in 1u32..RETRY_ATTEMPTS_MAX, random: u64,
        ) {
            // Goal: without jitter the delay ignores randomness and respects max.
            // Method: compare two random words and the cap for arbitrary inputs.
            let policy = RetryPolicy::new(RETRY_ATTEMPTS_MAX, backoff, ms(base_ms),
                ms(base_ms + extra_ms), JitterMode::None).unwrap();
            let delay = policy.next_delay(attempt, None, random).unwrap();
            prop_assert_eq!(Some(delay), policy.next_delay(attempt, None, !random));
            prop_assert!(delay >= ms(base_ms) && delay <= ms(base_ms + extra_ms));
        }

        #[test]
        fn full_jitter_stays_within_zero_and_raw(
            backoff in backoff_strategy(),
            base_ms in 1u64..1_000, extra_ms in 0u64..10_000,
            attempt in 1u32..RETRY_ATTEMPTS_MAX, random: u64,
        ) {
            // Goal: full jitter lies in 0..=raw.
            // Method: compare with the unjittered delay of the same schedule.
            let raw = RetryPolicy::new(RETRY_ATTEMPTS_MAX, backoff, ms(base_ms),
                ms(base_ms + extra_ms), JitterMode::None).unwrap()
                .next_delay(attempt, None, 0).unwrap();
            let policy = RetryPolicy::new(RETRY_ATTEMPTS_MAX, backoff, ms(base_ms),
                ms(base_ms + extra_ms), JitterMode::Full).unwrap();
            let delay = policy.next_delay(attempt, None, random).unwrap();
            prop_assert!(delay <= raw);
        }

        #[test]
        fn equal_jitter_stays_within_half_and_raw(
            backoff in backoff_strategy(),
            base_ms in 1u64..1_000, extra_ms in 0u64..10_000,
            attempt in 1u32..RETRY_ATTEMPTS_MAX, random: u64,
        ) {
            // Goal: equal jitter lies in raw/2..=raw.
            // Method: compare with the unjittered delay of the same schedule.
            let raw = RetryPolicy::new(RETRY_ATTEMPTS_MAX, backoff, ms(base_ms),
                ms(base_ms + extra_ms), JitterMode::None).unwrap()
                .next_delay(attempt, None, 0).unwrap();
            let policy = RetryPolicy::new(RETRY_ATTEMPTS_MAX, backoff, ms(base_ms),
                ms(base_ms + extra_ms), JitterMode::Equal).unwrap();
            let delay = policy.next_delay(attempt, None, random).unwrap();
            prop_assert!(delay <= raw && delay >= raw / 2);
        }

        #[test]
        fn decorrelated_jitter_stays_within_base_and_three_times_previous(
            base_ms in 1u64..1_000, extra_ms in 0u64..10_000,
            previous_ms in proptest::option::of(0u64..20_000),
            attempt in 1u32..RETRY_ATTEMPTS_MAX, random: u64,
        ) {
            // Goal: decorrelated jitter lies in base..=min(max, 3*previous).
            // Method: arbitrary previous delays, including none and below base.
            let (base, max) = (ms(base_ms), ms(base_ms + extra_ms));
            let policy = RetryPolicy::new(RETRY_ATTEMPTS_MAX, BackoffMode::Exponential,
                base, max, JitterMode::Decorrelated).unwrap();
            let previous = previous_ms.map(ms);
            let delay = policy.next_delay(attempt, previous, random).unwrap();
            let upper = (previous.unwrap_or(base).max(base) * 3).min(max);
            prop_assert!(delay >= base && delay <= upper);
        }
    }
}
