//! Helpers shared by the integration tests: an error type, builders for the
//! seed's pipelines, and shorthands for durations.

#![allow(dead_code)] // Each test file uses its own subset.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use keel_resilience::{
    AttemptTimeoutRequirement, Builder, Classifier, CompiledPipeline, ManualClock,
    ReplaySafetyContract, Safety, TokioClock,
};

/// The error type of the test callables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TestError {
    /// Declared retryable by `retrying_classifier`.
    Transient,
    /// Never retryable.
    Fatal,
    /// Ignored by the breaker in `retrying_classifier`.
    BadInput,
}

impl fmt::Display for TestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self:?}")
    }
}

impl std::error::Error for TestError {}

pub(crate) fn ms(value: u64) -> Duration {
    Duration::from_millis(value)
}

pub(crate) fn secs(value: u64) -> Duration {
    Duration::from_secs(value)
}

/// Retries `Transient`, ignores `BadInput` in the breaker.
pub(crate) fn retrying_classifier() -> Classifier<TestError> {
    Classifier::new()
        .retry_on(|e: &TestError| *e == TestError::Transient)
        .breaker_ignores(|e: &TestError| *e == TestError::BadInput)
}

/// The seed's two required options with a cooperative 2 s attempt timeout.
pub(crate) fn base() -> Builder {
    Builder::profile("tests", "v1")
        .partition("shop", "prod", "catalog-api")
        .attempt_timeout(secs(2), AttemptTimeoutRequirement::Cooperative)
}

/// Compiles on tokio's clock (paused in the tests) with a fixed seed.
pub(crate) fn on_tokio(
    builder: Builder,
    classifier: Classifier<TestError>,
) -> CompiledPipeline<TestError> {
    builder
        .compile_in_memory_with(classifier, Arc::new(TokioClock::new()), 7)
        .expect("valid pipeline")
}

/// Compiles on a manual clock with a fixed seed.
pub(crate) fn on_manual(
    builder: Builder,
    classifier: Classifier<TestError>,
) -> (CompiledPipeline<TestError>, ManualClock) {
    let clock = ManualClock::new();
    let pipeline = builder
        .compile_in_memory_with(classifier, Arc::new(clock.clone()), 7)
        .expect("valid pipeline");
    (pipeline, clock)
}

/// A read that may be replayed for an hour.
pub(crate) fn replayable() -> Safety {
    Safety::replayable_read(
        ReplaySafetyContract::for_read_only_callable("list-products", secs(3600)).unwrap(),
    )
}
