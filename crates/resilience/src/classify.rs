//! The classifier: what each attempt outcome means to the policies.
//!
//! For every outcome the classifier answers three questions: may the
//! operation be retried after it, does it count against the dependency in the
//! circuit breaker, and may the fallback replace it. It starts conservative:
//!
//! | outcome | retryable | breaker | fallback |
//! | --- | --- | --- | --- |
//! | success | no | success | no |
//! | error `e` | only if a `retry_on` predicate holds | failure, unless a `breaker_ignores` predicate holds | only if a `fallback_on` predicate holds |
//! | attempt timeout | only after `retry_on_attempt_timeout` | failure | only after `fallback_on_attempt_timeout` |
//! | pipeline rejection | never | never recorded | only after `fallback_on_rejection` |

use std::fmt;

/// What the circuit breaker records for a dispatched attempt.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Verdict {
    /// The dependency answered well.
    Success,
    /// The dependency failed; counts towards opening the circuit.
    Failure,
    /// Neither: the outcome says nothing about the dependency's health (for
    /// example a validation error). A half-open probe settled this way is
    /// released uncounted.
    Ignored,
}

/// The meaning of one attempt outcome.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Classification {
    /// Whether another attempt may follow.
    pub retryable: bool,
    /// What the circuit breaker records.
    pub verdict: Verdict,
    /// Whether the fallback may replace the outcome when it is final.
    pub fallback: bool,
}

impl Classification {
    /// The classification of a successful attempt.
    pub const SUCCESS: Classification = Classification {
        retryable: false,
        verdict: Verdict::Success,
        fallback: false,
    };
}

impl From<Classification> for Verdict {
    fn from(classification: Classification) -> Verdict {
        classification.verdict
    }
}

type Predicate<E> = Box<dyn Fn(&E) -> bool + Send + Sync>;

/// Classifies the outcomes of calls whose error type is `E`.
///
/// ```
/// use keel_resilience::Classifier;
///
/// #[derive(Debug)]
/// enum ApiError { Unavailable, NotFound }
///
/// let classifier = Classifier::new()
///     .retry_on(|e: &ApiError| matches!(e, ApiError::Unavailable))
///     .breaker_ignores(|e: &ApiError| matches!(e, ApiError::NotFound));
/// assert!(classifier.classify(&ApiError::Unavailable).retryable);
/// assert!(!classifier.classify(&ApiError::NotFound).retryable);
/// ```
pub struct Classifier<E> {
    retry: Vec<Predicate<E>>,
    breaker_ignore: Vec<Predicate<E>>,
    fallback: Vec<Predicate<E>>,
    retry_on_attempt_timeout: bool,
    fallback_on_attempt_timeout: bool,
    fallback_on_rejection: bool,
}

impl<E> Classifier<E> {
    /// The conservative classifier: nothing is retryable, every error and
    /// timeout is a breaker failure, nothing may be replaced by the fallback.
    pub fn new() -> Self {
        Classifier {
            retry: Vec::new(),
            breaker_ignore: Vec::new(),
            fallback: Vec::new(),
            retry_on_attempt_timeout: false,
            fallback_on_attempt_timeout: false,
            fallback_on_rejection: false,
        }
    }

    /// Errors for which `predicate` holds are retryable.
    pub fn retry_on(mut self, predicate: impl Fn(&E) -> bool + Send + Sync + 'static) -> Self {
        self.retry.push(Box::new(predicate));
        self
    }

    /// Errors for which `predicate` holds are not the dependency's fault: the
    /// breaker records them as [`Verdict::Ignored`].
    pub fn breaker_ignores(
        mut self,
        predicate: impl Fn(&E) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.breaker_ignore.push(Box::new(predicate));
        self
    }

    /// Final errors for which `predicate` holds may be replaced by the
    /// fallback.
    pub fn fallback_on(mut self, predicate: impl Fn(&E) -> bool + Send + Sync + 'static) -> Self {
        self.fallback.push(Box::new(predicate));
        self
    }

    /// Attempt timeouts are retryable.
    pub fn retry_on_attempt_timeout(mut self) -> Self {
        self.retry_on_attempt_timeout = true;
        self
    }

    /// A final attempt timeout may be replaced by the fallback.
    pub fn fallback_on_attempt_timeout(mut self) -> Self {
        self.fallback_on_attempt_timeout = true;
        self
    }

    /// A pipeline rejection (circuit open, rate limited, bulkhead full, retry
    /// budget exhausted) may be replaced by the fallback.
    pub fn fallback_on_rejection(mut self) -> Self {
        self.fallback_on_rejection = true;
        self
    }

    /// The meaning of an error returned by the callable.
    pub fn classify(&self, error: &E) -> Classification {
        let ignored = self.breaker_ignore.iter().any(|p| p(error));
        Classification {
            retryable: self.retry.iter().any(|p| p(error)),
            verdict: if ignored {
                Verdict::Ignored
            } else {
                Verdict::Failure
            },
            fallback: self.fallback.iter().any(|p| p(error)),
        }
    }

    /// The meaning of an attempt that ran past its attempt timeout.
    pub fn classify_attempt_timeout(&self) -> Classification {
        Classification {
            retryable: self.retry_on_attempt_timeout,
            verdict: Verdict::Failure,
            fallback: self.fallback_on_attempt_timeout,
        }
    }

    /// Whether a pipeline rejection may be replaced by the fallback.
    pub fn fallback_on_rejection_enabled(&self) -> bool {
        self.fallback_on_rejection
    }

    /// Whether any outcome at all may be replaced by the fallback.
    pub(crate) fn allows_any_fallback(&self) -> bool {
        !self.fallback.is_empty() || self.fallback_on_attempt_timeout || self.fallback_on_rejection
    }
}

impl<E> Default for Classifier<E> {
    fn default() -> Self {
        Classifier::new()
    }
}

impl<E> fmt::Debug for Classifier<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Classifier")
            .field("retry_predicates", &self.retry.len())
            .field("breaker_ignore_predicates", &self.breaker_ignore.len())
            .field("fallback_predicates", &self.fallback.len())
            .field("retry_on_attempt_timeout", &self.retry_on_attempt_timeout)
            .field(
                "fallback_on_attempt_timeout",
                &self.fallback_on_attempt_timeout,
            )
            .field("fallback_on_rejection", &self.fallback_on_rejection)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    enum E {
        Hiccup,
        BadInput,
        Down,
    }

    #[test]
    fn new_classifier_is_conservative() {
        // Goal: by default nothing is retryable or replaceable, and errors fail.
        // Method: classify an error and a timeout with an empty classifier.
        let classifier = Classifier::<E>::new();
        let expected = Classification {
            retryable: false,
            verdict: Verdict::Failure,
            fallback: false,
        };
        assert_eq!(classifier.classify(&E::Hiccup), expected);
        assert_eq!(classifier.classify_attempt_timeout(), expected);
        assert!(!classifier.fallback_on_rejection_enabled());
    }

    #[test]
    fn declared_predicates_apply_per_error() {
        // Goal: each predicate changes only its own question for its own errors.
        // Method: one predicate per question, classify three errors.
        let classifier = Classifier::new()
            .retry_on(|e: &E| matches!(e, E::Hiccup))
            .breaker_ignores(|e: &E| matches!(e, E::BadInput))
            .fallback_on(|e: &E| matches!(e, E::Down))
            .retry_on_attempt_timeout()
            .fallback_on_attempt_timeout()
            .fallback_on_rejection();
        assert_eq!(
            classifier.classify(&E::Hiccup),
            Classification {
                retryable: true,
                verdict: Verdict::Failure,
                fallback: false
            }
        );
        assert_eq!(classifier.classify(&E::BadInput).verdict, Verdict::Ignored);
        assert!(!classifier.classify(&E::BadInput).retryable);
        assert!(classifier.classify(&E::Down).fallback);
        assert!(classifier.classify_attempt_timeout().retryable);
        assert!(classifier.classify_attempt_timeout().fallback);
        assert!(classifier.fallback_on_rejection_enabled());
    }
}
