//! The non-executing admission API on a manual clock: check order and the
//! release-on-rejection rules.

mod common;

use common::*;
use keel_resilience::{
    BackoffMode, Builder, CircuitState, Classifier, CompiledPipeline, JitterMode, ManualClock,
    Ratio, Rejection, Safety, Verdict,
};

/// Every admission policy, small enough to exhaust by hand: a breaker that
/// opens on one failure (1 probe, 1 success), a 2-token budget, a 2-token
/// rate limit (refill 2 per second), and a single bulkhead slot, no queue.
fn everything() -> (CompiledPipeline<TestError>, ManualClock) {
    on_manual(
        base()
            .retry(5, BackoffMode::Constant, ms(1), ms(1), JitterMode::None)
            .retry_budget(2, 2, secs(60), secs(10))
            .rate_limit(Builder::token_bucket(2, 2, secs(1)))
            .circuit_breaker(
                Builder::last_calls(1),
                1,
                Ratio::of(1, 1),
                secs(30),
                1,
                1,
                secs(10),
            )
            .bulkhead(1, 0),
        retrying_classifier(),
    )
}

fn open_then_half_open(pipeline: &CompiledPipeline<TestError>, clock: &ManualClock) {
    let ctx = pipeline
        .new_context(secs(3600), replayable(), "opener")
        .unwrap();
    pipeline
        .admit(&ctx, false)
        .unwrap()
        .settle(Verdict::Failure);
    assert_eq!(pipeline.circuit_state(), Some(CircuitState::Open));
    clock.advance(secs(30));
    assert_eq!(pipeline.circuit_state(), Some(CircuitState::HalfOpen));
}

#[test]
fn checks_run_in_the_documented_order() {
    // Goal: partition, safety, deadline, breaker, budget, rate limit, bulkhead.
    // Method: make two adjacent checks fail at once and see which one reports.
    let (pipeline, clock) = everything();
    let ctx = pipeline
        .new_context(secs(3600), replayable(), "op")
        .unwrap();

    // Rate limit before bulkhead: no token left and the only slot held.
    pipeline
        .admit(&ctx, false)
        .unwrap()
        .settle(Verdict::Success);
    let held = pipeline.admit(&ctx, false).unwrap();
    assert!(matches!(
        pipeline.admit(&ctx, false),
        Err(Rejection::RateLimited { .. })
    ));
    held.settle(Verdict::Success);

    // Budget before rate limit: both empty.
    clock.advance(secs(1));
    for _ in 0..2 {
        pipeline.admit(&ctx, true).unwrap().settle(Verdict::Success);
    }
    assert_eq!(pipeline.rate_limit_available(), Some(0));
    assert_eq!(
        pipeline.admit(&ctx, true).unwrap_err(),
        Rejection::RetryBudgetExhausted
    );

    // Breaker before budget: open circuit and empty budget.
    clock.advance(secs(1));
    pipeline
        .admit(&ctx, false)
        .unwrap()
        .settle(Verdict::Failure);
    assert_eq!(pipeline.retry_budget_available(), Some(0));
    assert!(matches!(
        pipeline.admit(&ctx, true),
        Err(Rejection::CircuitOpen { .. })
    ));

    // Deadline before breaker: expired context and open circuit.
    let short = pipeline.new_context(ms(1), replayable(), "op").unwrap();
    let not_repeatable = pipeline
        .new_context(ms(1), Safety::NotRepeatable, "op")
        .unwrap();
    let (other, _) = on_manual(
        Builder::profile("tests", "v1")
            .partition("shop", "prod", "orders-api")
            .attempt_timeout(
                secs(2),
                keel_resilience::AttemptTimeoutRequirement::Cooperative,
            ),
        Classifier::new(),
    );
    let foreign = other
        .new_context(ms(1), Safety::NotRepeatable, "op")
        .unwrap();
    clock.advance(ms(1));
    assert_eq!(
        pipeline.admit(&short, false).unwrap_err(),
        Rejection::DeadlineExceeded
    );

    // Safety before deadline: a retry of a non-repeatable, expired operation.
    assert_eq!(
        pipeline.admit(&not_repeatable, true).unwrap_err(),
        Rejection::RetryRefused(keel_resilience::RetryRefusal::NotRepeatable)
    );

    // Partition before everything: a foreign, non-repeatable, expired context.
    assert!(matches!(
        pipeline.admit(&foreign, true),
        Err(Rejection::PartitionMismatch { .. })
    ));
    assert_eq!(pipeline.circuit_state(), Some(CircuitState::Open));
}

#[test]
fn half_open_probe_is_released_uncounted_when_a_later_check_rejects() {
    // Goal: a probe taken by the breaker is given back when the rate limit rejects.
    // Method: a 3-token bucket refilled hourly is drained while the breaker
    // opens; at half-open the rate limit rejects; after the refill a probe is
    // still admitted (were the slot lost, the breaker would say CircuitOpen).
    let (pipeline, clock) = on_manual(
        base()
            .rate_limit(Builder::token_bucket(3, 1, secs(3600)))
            .circuit_breaker(
                Builder::last_calls(1),
                1,
                Ratio::of(1, 1),
                secs(30),
                1,
                1,
                secs(7200),
            ),
        Classifier::new(),
    );
    let ctx = pipeline
        .new_context(secs(7200), Safety::NotRepeatable, "op")
        .unwrap();
    pipeline
        .admit(&ctx, false)
        .unwrap()
        .settle(Verdict::Success);
    pipeline
        .admit(&ctx, false)
        .unwrap()
        .settle(Verdict::Success);
    pipeline
        .admit(&ctx, false)
        .unwrap()
        .settle(Verdict::Failure);
    assert_eq!(pipeline.circuit_state(), Some(CircuitState::Open));
    assert_eq!(pipeline.rate_limit_available(), Some(0));
    clock.advance(secs(30));
    for _ in 0..3 {
        assert!(matches!(
            pipeline.admit(&ctx, false),
            Err(Rejection::RateLimited { .. })
        ));
    }
    assert_eq!(pipeline.circuit_state(), Some(CircuitState::HalfOpen));
    clock.advance(secs(3600));
    let probe = pipeline
        .admit(&ctx, false)
        .expect("the probe slot was released");
    assert!(probe.is_probe());
    probe.settle(Verdict::Success);
    assert_eq!(pipeline.circuit_state(), Some(CircuitState::Closed));
}

#[test]
fn dropping_an_admission_frees_its_slot_and_returns_undispatched_tokens() {
    // Goal: an admission dropped before dispatch frees its slot and returns
    // its rate-limit and retry tokens; one dropped after dispatch keeps
    // its tokens spent but still frees the slot.
    // Method: compare counters around undispatched and dispatched drops.
    let (pipeline, _clock) = everything();
    let ctx = pipeline
        .new_context(secs(3600), replayable(), "op")
        .unwrap();
    let undispatched = pipeline.admit(&ctx, true).unwrap();
    assert_eq!(pipeline.bulkhead_in_use(), Some(1));
    assert_eq!(pipeline.retry_budget_available(), Some(1));
    assert_eq!(pipeline.rate_limit_available(), Some(1));
    drop(undispatched);
    assert_eq!(pipeline.bulkhead_in_use(), Some(0));
    assert_eq!(pipeline.retry_budget_available(), Some(2));
    assert_eq!(pipeline.rate_limit_available(), Some(2));

    let mut dispatched = pipeline.admit(&ctx, true).unwrap();
    dispatched.mark_dispatched();
    drop(dispatched);
    assert_eq!(pipeline.bulkhead_in_use(), Some(0));
    assert_eq!(pipeline.retry_budget_available(), Some(1));
    assert_eq!(pipeline.rate_limit_available(), Some(1));
}

#[test]
fn reserved_retry_token_is_returned_when_a_later_check_rejects() {
    // Goal: the rate limit and the bulkhead rejecting a retry give back its
    // reserved retry token (and the rate-limit token the bulkhead case took).
    // Method: hold the only slot, admit a retry (bulkhead full); empty the rate
    // limit, admit a retry (rate limited); count the budget each time.
    let (pipeline, _clock) = everything();
    let ctx = pipeline
        .new_context(secs(3600), replayable(), "op")
        .unwrap();
    let held = pipeline.admit(&ctx, false).unwrap();
    assert_eq!(pipeline.rate_limit_available(), Some(1));
    assert_eq!(
        pipeline.admit(&ctx, true).unwrap_err(),
        Rejection::BulkheadFull
    );
    assert_eq!(
        pipeline.retry_budget_available(),
        Some(2),
        "retry token returned"
    );
    assert_eq!(
        pipeline.rate_limit_available(),
        Some(1),
        "rate token returned"
    );
    held.settle(Verdict::Success);
    pipeline
        .admit(&ctx, false)
        .unwrap()
        .settle(Verdict::Success);
    assert_eq!(pipeline.rate_limit_available(), Some(0));
    assert!(matches!(
        pipeline.admit(&ctx, true),
        Err(Rejection::RateLimited { .. })
    ));
    assert_eq!(
        pipeline.retry_budget_available(),
        Some(2),
        "retry token returned"
    );
}

#[test]
fn rejections_never_count_as_breaker_failures() {
    // Goal: a breaker that opens on a single failure stays closed through
    // any number of rejections by later checks.
    // Method: hold the only bulkhead slot and collect 100 BulkheadFull rejections.
    let (pipeline, _clock) = everything();
    let ctx = pipeline
        .new_context(secs(3600), replayable(), "op")
        .unwrap();
    let held = pipeline.admit(&ctx, false).unwrap();
    for _ in 0..100 {
        assert_eq!(
            pipeline.admit(&ctx, false).unwrap_err(),
            Rejection::BulkheadFull
        );
    }
    assert_eq!(pipeline.circuit_state(), Some(CircuitState::Closed));
    held.settle(Verdict::Success);
    assert_eq!(pipeline.circuit_state(), Some(CircuitState::Closed));
}

#[test]
fn a_settled_verdict_reaches_the_breaker_and_a_dropped_probe_does_not() {
    // Goal: settle records, drop does not, for a half-open probe.
    // Method: drop a dispatched probe (circuit stays half-open), then settle a failure.
    let (pipeline, clock) = on_manual(
        base().circuit_breaker(
            Builder::last_calls(1),
            1,
            Ratio::of(1, 1),
            secs(30),
            1,
            1,
            secs(10),
        ),
        Classifier::new(),
    );
    open_then_half_open(&pipeline, &clock);
    let ctx = pipeline
        .new_context(secs(3600), Safety::NotRepeatable, "op")
        .unwrap();
    let mut probe = pipeline.admit(&ctx, false).unwrap();
    probe.mark_dispatched();
    assert!(matches!(
        pipeline.admit(&ctx, false),
        Err(Rejection::CircuitOpen { retry_after: None })
    ));
    drop(probe);
    assert_eq!(pipeline.circuit_state(), Some(CircuitState::HalfOpen));
    pipeline
        .admit(&ctx, false)
        .unwrap()
        .settle(Verdict::Failure);
    assert_eq!(pipeline.circuit_state(), Some(CircuitState::Open));
}

#[test]
fn rate_limit_refills_on_the_manual_clock() {
    // Goal: the rate limit refills by whole intervals in virtual time.
    // Method: drain a 2-per-second bucket and advance the manual clock.
    let (pipeline, clock) = on_manual(
        base().rate_limit(Builder::token_bucket(2, 2, secs(1))),
        Classifier::new(),
    );
    let ctx = pipeline
        .new_context(secs(3600), Safety::NotRepeatable, "op")
        .unwrap();
    for _ in 0..2 {
        pipeline
            .admit(&ctx, false)
            .unwrap()
            .settle(Verdict::Success);
    }
    assert_eq!(
        pipeline.admit(&ctx, false).unwrap_err(),
        Rejection::RateLimited {
            retry_after: secs(1)
        }
    );
    clock.advance(ms(999));
    assert!(pipeline.admit(&ctx, false).is_err());
    clock.advance(ms(1));
    assert!(pipeline.admit(&ctx, false).is_ok());
}
