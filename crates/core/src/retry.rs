//! Durable retries: the one backoff (the resilience crate's
//! [`keel_resilience::RetryPolicy`]) applied to an activity's recorded
//! [`RetrySettings`] or its resilience profile.
//!
//! Everything here is a pure function of the recorded settings, the attempt
//! number and a jitter word derived from the attempt's id, so a retry
//! decision never depends on which host or process made it.

use std::time::Duration;

use keel_resilience::retry::{BackoffMode, Error as RetryError, JitterMode};
use keel_resilience::RetryPolicy as Backoffs;
use keel_storage::{
    ActivityOptions, AttemptId, AttemptNo, Backoff, Jitter, RetrySettings, Timestamp,
};

/// The resilience crate's policy for recorded settings. Records of the
/// first schema may hold a zero initial delay; it is read as 1 ms.
pub fn policy_of(s: &RetrySettings) -> Result<Backoffs, RetryError> {
    let backoff = match s.backoff() {
        Backoff::Constant => BackoffMode::Constant,
        Backoff::Linear => BackoffMode::Linear,
        Backoff::Exponential => BackoffMode::Exponential,
    };
    let jitter = match s.jitter {
        Jitter::None => JitterMode::None,
        Jitter::Full => JitterMode::Full,
        Jitter::Equal => JitterMode::Equal,
        Jitter::Decorrelated => JitterMode::Decorrelated,
    };
    Backoffs::new(
        s.attempts_max,
        backoff,
        Duration::from_millis(s.initial_delay_ms.max(1)),
        Duration::from_millis(s.delay_max_ms.max(s.initial_delay_ms.max(1))),
        jitter,
    )
}

/// The jitter word of an attempt: a hash of its id. Deterministic (the same
/// attempt always draws the same word, on every host) and spread evenly
/// across executions, which is what jitter is for.
pub fn jitter_word(attempt: AttemptId) -> u64 {
    let b = attempt.execution.run_id.as_bytes();
    let mut z = u64::from_le_bytes(b[..8].try_into().expect("8 bytes"))
        ^ u64::from_le_bytes(b[8..].try_into().expect("8 bytes")).rotate_left(17)
        ^ (u64::from(attempt.execution.step.0) << 32)
        ^ u64::from(attempt.attempt.0);
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The delay after `failed` failed, per `policy`: the decorrelated mode
/// needs the previous delay, recomputed from the earlier attempts' words.
fn delay_after(policy: &Backoffs, failed: AttemptId) -> Option<Duration> {
    let mut previous = None;
    for n in 1..failed.attempt.0 {
        let id = AttemptId {
            execution: failed.execution,
            attempt: AttemptNo(n),
        };
        previous = policy.next_delay(n, previous, jitter_word(id));
    }
    policy.next_delay(failed.attempt.0, previous, jitter_word(failed))
}

/// When the attempt after `failed` is due, or `None` when the execution has
/// failed for good: the failure is not retryable, the attempts are used up,
/// or the backoff would pass the schedule-to-close deadline. `retry` is the
/// call's own policy, else its profile's.
pub fn retry_at(
    options: &ActivityOptions,
    profile_retry: Option<&Backoffs>,
    scheduled_at: Timestamp,
    failed: AttemptId,
    retryable: bool,
    now: Timestamp,
) -> Option<Timestamp> {
    if !retryable {
        return None;
    }
    let own = options.retry.as_ref().and_then(|s| policy_of(s).ok());
    let policy = own.as_ref().or(profile_retry)?;
    let delay = delay_after(policy, failed)?;
    let due = now.plus_ms(u64::try_from(delay.as_millis()).unwrap_or(u64::MAX));
    if let Some(limit) = options.schedule_to_close_ms {
        if due.0 > scheduled_at.0.saturating_add(limit) {
            return None;
        }
    }
    Some(due)
}

#[cfg(test)]
mod tests {
    // Goal: recorded settings map onto the resilience crate's backoff, the
    // delays are deterministic per attempt, and the deadline and the
    // attempt count end retries.
    // Method: compute due times for a few attempts by hand.
    use super::*;
    use keel_storage::{ExecutionId, RunId, Step};

    fn attempt(n: u32) -> AttemptId {
        AttemptId {
            execution: ExecutionId {
                run_id: RunId::from_u64_pair(1, 2),
                step: Step(3),
            },
            attempt: AttemptNo(n),
        }
    }

    fn settings(jitter: Jitter) -> RetrySettings {
        RetrySettings {
            attempts_max: 3,
            initial_delay_ms: 100,
            backoff_factor: 2.0,
            delay_max_ms: 1_000,
            jitter,
            backoff_mode: None,
        }
    }

    #[test]
    fn exponential_without_jitter_doubles_and_stops_after_the_last_attempt() {
        let options = ActivityOptions {
            retry: Some(settings(Jitter::None)),
            ..Default::default()
        };
        let at = |n| {
            retry_at(
                &options,
                None,
                Timestamp(0),
                attempt(n),
                true,
                Timestamp(10),
            )
        };
        assert_eq!(at(1), Some(Timestamp(110)));
        assert_eq!(at(2), Some(Timestamp(210)));
        assert_eq!(at(3), None);
    }

    #[test]
    fn full_jitter_is_deterministic_per_attempt_and_bounded() {
        let options = ActivityOptions {
            retry: Some(settings(Jitter::Full)),
            ..Default::default()
        };
        let a = retry_at(&options, None, Timestamp(0), attempt(2), true, Timestamp(0));
        let b = retry_at(&options, None, Timestamp(0), attempt(2), true, Timestamp(0));
        assert_eq!(a, b);
        assert!(a.expect("retries").0 <= 200);
    }

    #[test]
    fn the_deadline_and_non_retryable_failures_end_retries() {
        let options = ActivityOptions {
            retry: Some(settings(Jitter::None)),
            schedule_to_close_ms: Some(50),
            ..Default::default()
        };
        assert_eq!(
            retry_at(&options, None, Timestamp(0), attempt(1), true, Timestamp(0)),
            None
        );
        let options = ActivityOptions {
            retry: Some(settings(Jitter::None)),
            ..Default::default()
        };
        assert_eq!(
            retry_at(
                &options,
                None,
                Timestamp(0),
                attempt(1),
                false,
                Timestamp(0)
            ),
            None
        );
    }

    #[test]
    fn first_schema_records_map_onto_a_backoff_mode() {
        let mut s = settings(Jitter::None);
        s.backoff_factor = 1.0;
        assert_eq!(s.backoff(), Backoff::Constant);
        s.backoff_factor = 2.5;
        assert_eq!(s.backoff(), Backoff::Exponential);
        s.initial_delay_ms = 0;
        assert!(
            policy_of(&s).is_ok(),
            "a zero delay of an old record is read as 1 ms"
        );
    }
}
