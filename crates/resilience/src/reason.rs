//! [`Reason`]: the stable, machine-readable name of every way an operation
//! can end without the callable's own success.
//!
//! Reasons print in snake_case (`deadline_exceeded`, `circuit_open`, ...) and
//! serialize the same way, so they can go into log fields and metrics labels
//! unchanged.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Why an operation did not return the callable's success.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// The overall deadline passed (before admission, while waiting, or with
    /// a late result that was replaced).
    DeadlineExceeded,
    /// The circuit breaker was open or had no free half-open probe slot.
    CircuitOpen,
    /// The rate limit had no token.
    RateLimited,
    /// The bulkhead had no free slot and no free queue place.
    BulkheadFull,
    /// The retry budget had no token for a retry.
    RetryBudgetExhausted,
    /// The operation's safety declaration refused a retry.
    RetryRefused,
    /// The last attempt ran past its attempt timeout.
    AttemptTimeout,
    /// The context does not fit the pipeline (another partition, or a
    /// fallback on a pipeline without the fallback policy).
    InvalidConfiguration,
    /// The callable's error ended the operation.
    OperationFailed,
    /// The fallback itself failed.
    FallbackFailed,
}

impl Reason {
    /// The snake_case name.
    pub const fn as_str(self) -> &'static str {
        match self {
            Reason::DeadlineExceeded => "deadline_exceeded",
            Reason::CircuitOpen => "circuit_open",
            Reason::RateLimited => "rate_limited",
            Reason::BulkheadFull => "bulkhead_full",
            Reason::RetryBudgetExhausted => "retry_budget_exhausted",
            Reason::RetryRefused => "retry_refused",
            Reason::AttemptTimeout => "attempt_timeout",
            Reason::InvalidConfiguration => "invalid_configuration",
            Reason::OperationFailed => "operation_failed",
            Reason::FallbackFailed => "fallback_failed",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_print_in_snake_case() {
        // Goal: every reason prints as its documented snake_case name.
        // Method: compare Display with hand-written names.
        let expected = [
            (Reason::DeadlineExceeded, "deadline_exceeded"),
            (Reason::CircuitOpen, "circuit_open"),
            (Reason::RateLimited, "rate_limited"),
            (Reason::BulkheadFull, "bulkhead_full"),
            (Reason::RetryBudgetExhausted, "retry_budget_exhausted"),
            (Reason::RetryRefused, "retry_refused"),
            (Reason::AttemptTimeout, "attempt_timeout"),
            (Reason::InvalidConfiguration, "invalid_configuration"),
            (Reason::OperationFailed, "operation_failed"),
            (Reason::FallbackFailed, "fallback_failed"),
        ];
        for (reason, name) in expected {
            assert_eq!(reason.to_string(), name);
        }
    }
}
