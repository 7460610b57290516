//! `CompiledPipeline::execute` in tokio's paused virtual time: retries,
//! attempt ids, deadline rules, attempt timeouts, safety, fallback, and the
//! policies seen from the caller.

mod common;

use std::cell::Cell;
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use common::*;
use keel_resilience::pipeline::Error;
use keel_resilience::{
    AttemptTimeoutRequirement, BackoffMode, Builder, CircuitState, Classifier, JitterMode, Ratio,
    Reason, Rejection, RetryRefusal, Safety,
};
use tokio::time::{sleep, Instant};

fn constant_retry(builder: Builder, attempts: u32, delay_ms: u64) -> Builder {
    builder.retry(
        attempts,
        BackoffMode::Constant,
        ms(delay_ms),
        ms(delay_ms),
        JitterMode::None,
    )
}

/// Sets its flag when dropped: shows whether a future was dropped unfinished.
struct DropFlag(Arc<AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[tokio::test(start_paused = true)]
async fn retries_until_success_with_one_operation_id_and_distinct_attempt_ids() {
    // Goal: the seed's flaky call succeeds on attempt 3; ids behave as documented.
    // Method: a callable failing twice with a retryable error; record its contexts.
    let pipeline = on_tokio(
        constant_retry(base(), 3, 5).retry_budget(10, 10, secs(60), secs(10)),
        retrying_classifier(),
    );
    let ctx = pipeline
        .new_context(secs(30), replayable(), "concepts-1")
        .unwrap();
    let mut seen = Vec::new();
    let start = Instant::now();
    let result = pipeline
        .execute(&ctx, |attempt| {
            seen.push((
                attempt.operation_id().to_string(),
                attempt.attempt_id(),
                attempt.dispatched_attempt_number(),
            ));
            let n = attempt.dispatched_attempt_number();
            async move {
                if n < 3 {
                    Err(TestError::Transient)
                } else {
                    Ok(n)
                }
            }
        })
        .await;
    assert_eq!(result.unwrap(), 3);
    assert_eq!(start.elapsed(), ms(10), "two 5 ms waits, nothing else");
    assert_eq!(seen.iter().map(|s| s.2).collect::<Vec<_>>(), [1, 2, 3]);
    assert!(seen.iter().all(|s| s.0 == "concepts-1"));
    assert_eq!(seen.iter().map(|s| s.1).collect::<HashSet<_>>().len(), 3);
    assert!(seen.iter().all(|s| s.1.lower_hex().len() == 32));
    assert_eq!(
        pipeline.retry_budget_available(),
        Some(8),
        "two retries spent"
    );
}

#[tokio::test(start_paused = true)]
async fn non_retryable_errors_and_exhausted_attempts_end_with_failed() {
    // Goal: conservative classification and max attempts both end the operation.
    // Method: a fatal error (1 call) and a transient one (3 calls of 3).
    let pipeline = on_tokio(constant_retry(base(), 3, 5), retrying_classifier());
    let ctx = pipeline.new_context(secs(30), replayable(), "op").unwrap();
    let calls = Cell::new(0);
    let fatal = pipeline
        .execute(&ctx, |_| {
            calls.set(calls.get() + 1);
            async { Err::<(), _>(TestError::Fatal) }
        })
        .await
        .unwrap_err();
    assert!(matches!(
        fatal,
        Error::Failed {
            attempts: 1,
            source: TestError::Fatal
        }
    ));
    assert_eq!(fatal.reason(), Reason::OperationFailed);
    assert_eq!(calls.get(), 1);

    let ctx = pipeline.new_context(secs(30), replayable(), "op").unwrap();
    let transient = pipeline
        .execute(&ctx, |_| {
            calls.set(calls.get() + 1);
            async { Err::<(), _>(TestError::Transient) }
        })
        .await
        .unwrap_err();
    assert!(matches!(
        transient,
        Error::Failed {
            attempts: 3,
            source: TestError::Transient
        }
    ));
    assert_eq!(calls.get(), 4);
}

#[tokio::test(start_paused = true)]
async fn nothing_is_retryable_without_a_declaration() {
    // Goal: the default classifier never retries, even with retry configured.
    // Method: a transient error through Classifier::new().
    let pipeline = on_tokio(constant_retry(base(), 5, 1), Classifier::new());
    let ctx = pipeline.new_context(secs(30), replayable(), "op").unwrap();
    let calls = Cell::new(0);
    let error = pipeline
        .execute(&ctx, |_| {
            calls.set(calls.get() + 1);
            async { Err::<(), _>(TestError::Transient) }
        })
        .await
        .unwrap_err();
    assert_eq!(error.attempts(), 1);
    assert_eq!(calls.get(), 1);
}

#[tokio::test(start_paused = true)]
async fn late_result_is_replaced_by_deadline_exceeded() {
    // Goal: the seed's deadline rule: a 30 ms call under a 5 ms deadline.
    // Method: cooperative pipeline, the callable finishes late with Ok.
    let pipeline = on_tokio(base(), Classifier::new());
    let ctx = pipeline
        .new_context(ms(5), Safety::NotRepeatable, "slow")
        .unwrap();
    let finished = Cell::new(false);
    let error = pipeline
        .execute(&ctx, |_| async {
            sleep(ms(30)).await;
            finished.set(true);
            Ok("finished late")
        })
        .await
        .unwrap_err();
    assert!(finished.get(), "cooperative mode ran the call to its end");
    assert_eq!(error.reason(), Reason::DeadlineExceeded);
    assert_eq!(error.reason().to_string(), "deadline_exceeded");
    assert_eq!(error.attempts(), 1);
}

#[tokio::test(start_paused = true)]
async fn no_retry_starts_when_its_delay_does_not_fit() {
    // Goal: a retry whose delay reaches past the deadline never starts.
    // Method: 50 ms backoff, 30 ms deadline; count calls and elapsed time.
    let pipeline = on_tokio(constant_retry(base(), 3, 50), retrying_classifier());
    let ctx = pipeline.new_context(ms(30), replayable(), "op").unwrap();
    let calls = Cell::new(0);
    let start = Instant::now();
    let error = pipeline
        .execute(&ctx, |_| {
            calls.set(calls.get() + 1);
            async { Err::<(), _>(TestError::Transient) }
        })
        .await
        .unwrap_err();
    assert_eq!(calls.get(), 1);
    assert_eq!(start.elapsed(), ms(0), "no pointless wait");
    assert!(matches!(
        error,
        Error::DeadlineExceeded {
            attempts: 1,
            last_error: Some(TestError::Transient)
        }
    ));
}

#[tokio::test(start_paused = true)]
async fn deadline_covers_attempts_and_waits() {
    // Goal: the deadline counts attempts and waits together.
    // Method: 10 ms attempts with 10 ms waits under a 35 ms deadline: the
    // second retry's wait would end at 40 ms, so two attempts run.
    let pipeline = on_tokio(constant_retry(base(), 5, 10), retrying_classifier());
    let ctx = pipeline.new_context(ms(35), replayable(), "op").unwrap();
    let calls = Cell::new(0);
    let error = pipeline
        .execute(&ctx, |_| {
            calls.set(calls.get() + 1);
            async {
                sleep(ms(10)).await;
                Err::<(), _>(TestError::Transient)
            }
        })
        .await
        .unwrap_err();
    assert_eq!(calls.get(), 2);
    assert_eq!(error.reason(), Reason::DeadlineExceeded);
}

#[tokio::test(start_paused = true)]
async fn preemptive_timeout_drops_the_attempt() {
    // Goal: preemptive mode races the future against the timer and drops it.
    // Method: a 100 ms call under a 20 ms preemptive timeout with a drop flag.
    let pipeline = on_tokio(
        base_with(AttemptTimeoutRequirement::Preemptive, 20),
        Classifier::new(),
    );
    let ctx = pipeline
        .new_context(secs(30), Safety::NotRepeatable, "op")
        .unwrap();
    let dropped = Arc::new(AtomicBool::new(false));
    let finished = Cell::new(false);
    let start = Instant::now();
    let error = pipeline
        .execute(&ctx, |_| {
            let flag = DropFlag(Arc::clone(&dropped));
            let finished = &finished;
            async move {
                let _flag = flag;
                sleep(ms(100)).await;
                finished.set(true);
                Ok(())
            }
        })
        .await
        .unwrap_err();
    assert!(matches!(error, Error::AttemptTimeout { attempts: 1, .. }));
    assert_eq!(error.reason(), Reason::AttemptTimeout);
    assert_eq!(start.elapsed(), ms(20));
    assert!(dropped.load(Ordering::SeqCst) && !finished.get());
}

fn base_with(requirement: AttemptTimeoutRequirement, timeout_ms: u64) -> Builder {
    Builder::profile("tests", "v1")
        .partition("shop", "prod", "catalog-api")
        .attempt_timeout(ms(timeout_ms), requirement)
}

#[tokio::test(start_paused = true)]
async fn preemptive_mode_also_preempts_at_the_overall_deadline() {
    // Goal: when the overall deadline comes before the attempt timeout, the
    // attempt is dropped at the deadline and the outcome is deadline_exceeded.
    // Method: 1 s preemptive timeout, 15 ms deadline, a 100 ms call.
    let pipeline = on_tokio(
        base_with(AttemptTimeoutRequirement::Preemptive, 1_000),
        Classifier::new(),
    );
    let ctx = pipeline
        .new_context(ms(15), Safety::NotRepeatable, "op")
        .unwrap();
    let start = Instant::now();
    let error = pipeline
        .execute(&ctx, |_| async {
            sleep(ms(100)).await;
            Ok(())
        })
        .await
        .unwrap_err();
    assert_eq!(error.reason(), Reason::DeadlineExceeded);
    assert_eq!(start.elapsed(), ms(15));
}

#[tokio::test(start_paused = true)]
async fn cooperative_timeout_reports_the_deadline_and_replaces_an_overrun() {
    // Goal: a cooperative callable sees its attempt deadline; a result after
    // the attempt timeout counts as an attempt timeout and may be retried.
    // Method: attempt 1 overruns 20 ms by waiting 25 ms; attempt 2 checks
    // its context and returns in time.
    let pipeline = on_tokio(
        constant_retry(base_with(AttemptTimeoutRequirement::Cooperative, 20), 2, 1),
        Classifier::new().retry_on_attempt_timeout(),
    );
    let ctx = pipeline.new_context(secs(1), replayable(), "op").unwrap();
    let remaining = Cell::new(None);
    let result = pipeline
        .execute(&ctx, |attempt| {
            remaining.set(Some(attempt.remaining()));
            let n = attempt.dispatched_attempt_number();
            async move {
                if n == 1 {
                    sleep(ms(25)).await;
                    assert!(attempt.is_expired());
                }
                Ok::<_, TestError>(n)
            }
        })
        .await;
    assert_eq!(result.unwrap(), 2);
    assert_eq!(remaining.get(), Some(ms(20)));
}

#[tokio::test(start_paused = true)]
async fn context_of_another_partition_is_refused_before_dispatch() {
    // Goal: the exact partition message, with nothing dispatched.
    // Method: a context from an orders-api pipeline given to a catalog-api pipeline.
    let catalog = on_tokio(base(), Classifier::new());
    let orders = on_tokio(
        Builder::profile("tests", "v1")
            .partition("shop", "prod", "orders-api")
            .attempt_timeout(secs(2), AttemptTimeoutRequirement::Cooperative),
        Classifier::new(),
    );
    let foreign = orders
        .new_context(secs(30), Safety::NotRepeatable, "op")
        .unwrap();
    let calls = Cell::new(0);
    let error = catalog
        .execute(&foreign, |_| {
            calls.set(calls.get() + 1);
            async { Ok::<_, TestError>("never runs") }
        })
        .await
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "The execution context partition must equal every selected policy partition."
    );
    assert_eq!(error.reason(), Reason::InvalidConfiguration);
    assert_eq!(calls.get(), 0);
    // A tenant makes a different partition too.
    let tenant = on_tokio(base().tenant("acme"), Classifier::new());
    assert!(matches!(
        tenant.admit(
            &catalog
                .new_context(secs(1), Safety::NotRepeatable, "op")
                .unwrap(),
            false
        ),
        Err(Rejection::PartitionMismatch { .. })
    ));
    // Another pipeline of the same partition accepts the context.
    let twin = on_tokio(base(), Classifier::new());
    let own = catalog
        .new_context(secs(1), Safety::NotRepeatable, "op")
        .unwrap();
    assert!(twin.admit(&own, false).is_ok());
}

#[tokio::test(start_paused = true)]
async fn retry_of_a_non_repeatable_call_is_refused() {
    // Goal: a call not declared repeatable is never retried.
    // Method: a retryable error on a NotRepeatable context; also ask admit directly.
    let pipeline = on_tokio(constant_retry(base(), 3, 5), retrying_classifier());
    let ctx = pipeline
        .new_context(secs(30), Safety::NotRepeatable, "op")
        .unwrap();
    let calls = Cell::new(0);
    let error = pipeline
        .execute(&ctx, |_| {
            calls.set(calls.get() + 1);
            async { Err::<(), _>(TestError::Transient) }
        })
        .await
        .unwrap_err();
    assert_eq!(calls.get(), 1);
    assert_eq!(error.reason(), Reason::RetryRefused);
    assert!(matches!(
        error,
        Error::Rejected {
            rejection: Rejection::RetryRefused(RetryRefusal::NotRepeatable),
            attempts: 1,
            last_error: Some(TestError::Transient),
        }
    ));
    assert!(matches!(
        pipeline.admit(&ctx, true),
        Err(Rejection::RetryRefused(RetryRefusal::NotRepeatable))
    ));
    assert!(
        pipeline.admit(&ctx, false).is_ok(),
        "a first attempt is fine"
    );
}

#[tokio::test(start_paused = true)]
async fn replayable_read_is_not_retried_past_its_window_and_idempotent_writes_are() {
    // Goal: the replay window bounds retries; idempotent writes retry freely.
    // Method: a 10 ms window with 20 ms backoff, then an idempotent context.
    let pipeline = on_tokio(constant_retry(base(), 3, 20), retrying_classifier());
    let short = Safety::replayable_read(
        keel_resilience::ReplaySafetyContract::for_read_only_callable("list", ms(10)).unwrap(),
    );
    let ctx = pipeline.new_context(secs(30), short, "op").unwrap();
    let start = Instant::now();
    let error = pipeline
        .execute(&ctx, |_| async { Err::<(), _>(TestError::Transient) })
        .await
        .unwrap_err();
    assert!(matches!(
        error,
        Error::Rejected {
            rejection: Rejection::RetryRefused(RetryRefusal::ReplayWindowElapsed),
            attempts: 1,
            ..
        }
    ));
    assert_eq!(
        start.elapsed(),
        ms(0),
        "refused when planned, not after a useless wait"
    );

    let ctx = pipeline
        .new_context(secs(30), Safety::idempotent("order-17").unwrap(), "op")
        .unwrap();
    let error = pipeline
        .execute(&ctx, |_| async { Err::<(), _>(TestError::Transient) })
        .await
        .unwrap_err();
    assert!(matches!(error, Error::Failed { attempts: 3, .. }));
}

#[tokio::test(start_paused = true)]
async fn rate_limit_rejects_without_calling_and_refills() {
    // Goal: an empty bucket rejects before dispatch; a refill admits again.
    // Method: a 2-token bucket refilled by 2 per second; three calls, wait, one more.
    let pipeline = on_tokio(
        base().rate_limit(Builder::token_bucket(2, 2, secs(1))),
        Classifier::new(),
    );
    let calls = Cell::new(0);
    let call = || async {
        let ctx = pipeline
            .new_context(secs(30), Safety::NotRepeatable, "op")
            .unwrap();
        pipeline
            .execute(&ctx, |_| {
                calls.set(calls.get() + 1);
                async { Ok::<_, TestError>(()) }
            })
            .await
    };
    assert!(call().await.is_ok());
    assert!(call().await.is_ok());
    let error = call().await.unwrap_err();
    assert_eq!(error.reason(), Reason::RateLimited);
    assert!(matches!(
        error,
        Error::Rejected { rejection: Rejection::RateLimited { retry_after }, attempts: 0, .. }
            if retry_after == secs(1)
    ));
    assert_eq!(calls.get(), 2);
    sleep(secs(1)).await;
    assert!(call().await.is_ok());
    assert_eq!(calls.get(), 3);
}

#[tokio::test(start_paused = true)]
async fn circuit_opens_rejects_and_recovers_through_a_probe() {
    // Goal: the seed's breaker opens after 4 failing calls, rejects without
    // calling, and closes after one successful probe 30 s later.
    // Method: drive it through execute with a fatal error, then succeed.
    let pipeline = on_tokio(
        base().circuit_breaker(
            Builder::last_calls(10),
            4,
            Ratio::of(1, 2),
            secs(30),
            1,
            1,
            secs(10),
        ),
        Classifier::new(),
    );
    let calls = Cell::new(0);
    let run = |fail: bool| {
        let ctx = pipeline
            .new_context(secs(30), Safety::NotRepeatable, "op")
            .unwrap();
        let calls = &calls;
        let pipeline = &pipeline;
        async move {
            pipeline
                .execute(&ctx, |_| {
                    calls.set(calls.get() + 1);
                    async move {
                        if fail {
                            Err(TestError::Fatal)
                        } else {
                            Ok(())
                        }
                    }
                })
                .await
        }
    };
    for _ in 0..4 {
        assert_eq!(
            run(true).await.unwrap_err().reason(),
            Reason::OperationFailed
        );
    }
    assert_eq!(pipeline.circuit_state(), Some(CircuitState::Open));
    assert_eq!(run(false).await.unwrap_err().reason(), Reason::CircuitOpen);
    assert_eq!(calls.get(), 4, "the rejection never reached the callable");
    sleep(secs(30)).await;
    assert!(run(false).await.is_ok());
    assert_eq!(pipeline.circuit_state(), Some(CircuitState::Closed));
}

#[tokio::test(start_paused = true)]
async fn breaker_ignores_declared_errors_and_records_late_results() {
    // Goal: BadInput never opens the circuit; a late failure is still recorded.
    // Method: many BadInput calls, then late Fatal calls under a short deadline.
    let pipeline = on_tokio(
        base().circuit_breaker(
            Builder::last_calls(4),
            2,
            Ratio::of(1, 1),
            secs(30),
            1,
            1,
            secs(10),
        ),
        retrying_classifier(),
    );
    for _ in 0..10 {
        let ctx = pipeline
            .new_context(secs(1), Safety::NotRepeatable, "op")
            .unwrap();
        let _ = pipeline
            .execute(&ctx, |_| async { Err::<(), _>(TestError::BadInput) })
            .await;
    }
    assert_eq!(pipeline.circuit_state(), Some(CircuitState::Closed));
    for _ in 0..2 {
        let ctx = pipeline
            .new_context(ms(5), Safety::NotRepeatable, "op")
            .unwrap();
        let error = pipeline
            .execute(&ctx, |_| async {
                sleep(ms(10)).await;
                Err::<(), _>(TestError::Fatal)
            })
            .await
            .unwrap_err();
        assert_eq!(error.reason(), Reason::DeadlineExceeded);
    }
    assert_eq!(pipeline.circuit_state(), Some(CircuitState::Open));
}

#[tokio::test(start_paused = true)]
async fn retry_budget_caps_retries_across_operations() {
    // Goal: retries stop when the shared budget is empty; first attempts go on.
    // Method: a 1-token budget; an operation that always fails transiently.
    let pipeline = on_tokio(
        constant_retry(base(), 5, 1).retry_budget(1, 1, secs(60), secs(10)),
        retrying_classifier(),
    );
    let ctx = pipeline.new_context(secs(30), replayable(), "op").unwrap();
    let calls = Cell::new(0);
    let error = pipeline
        .execute(&ctx, |_| {
            calls.set(calls.get() + 1);
            async { Err::<(), _>(TestError::Transient) }
        })
        .await
        .unwrap_err();
    assert_eq!(
        calls.get(),
        2,
        "first attempt plus the one retry the budget paid"
    );
    assert!(matches!(
        error,
        Error::Rejected {
            rejection: Rejection::RetryBudgetExhausted,
            attempts: 2,
            last_error: Some(TestError::Transient),
        }
    ));
    assert_eq!(error.reason().to_string(), "retry_budget_exhausted");
    let ctx = pipeline.new_context(secs(30), replayable(), "op2").unwrap();
    assert!(pipeline
        .execute(&ctx, |_| async { Ok::<_, TestError>(()) })
        .await
        .is_ok());
}

#[tokio::test(start_paused = true)]
async fn bulkhead_queues_in_order_and_rejects_beyond_the_queue() {
    // Goal: one slot and one queue place: the second call waits, the third is
    // rejected at once, and the waiter runs when the slot frees.
    // Method: three concurrent operations joined in one task.
    let pipeline = on_tokio(base().bulkhead(1, 1), Classifier::new());
    let start = Instant::now();
    let op = |name: &'static str| {
        let pipeline = &pipeline;
        async move {
            let ctx = pipeline
                .new_context(secs(30), Safety::NotRepeatable, name)
                .unwrap();
            pipeline
                .execute(&ctx, |_| async move {
                    sleep(ms(10)).await;
                    Ok::<_, TestError>(Instant::now())
                })
                .await
        }
    };
    let (first, second, third) = tokio::join!(op("a"), op("b"), op("c"));
    assert_eq!(first.unwrap() - start, ms(10));
    assert_eq!(second.unwrap() - start, ms(20));
    assert_eq!(third.unwrap_err().reason(), Reason::BulkheadFull);
    assert_eq!(pipeline.bulkhead_in_use(), Some(0));
    assert_eq!(pipeline.bulkhead_queued(), Some(0));
}

#[tokio::test(start_paused = true)]
async fn bulkhead_wait_never_outlasts_the_deadline() {
    // Goal: a queued operation gives up at its deadline, uncalled.
    // Method: hold the only slot for 50 ms; queue an operation with a 5 ms deadline.
    let pipeline = on_tokio(base().bulkhead(1, 1), Classifier::new());
    let calls = Cell::new(0);
    let holder = async {
        let ctx = pipeline
            .new_context(secs(30), Safety::NotRepeatable, "holder")
            .unwrap();
        pipeline
            .execute(&ctx, |_| async {
                sleep(ms(50)).await;
                Ok::<_, TestError>(())
            })
            .await
    };
    let waiter = async {
        let ctx = pipeline
            .new_context(ms(5), Safety::NotRepeatable, "waiter")
            .unwrap();
        let start = Instant::now();
        let result = pipeline
            .execute(&ctx, |_| {
                calls.set(calls.get() + 1);
                async { Ok::<_, TestError>(()) }
            })
            .await;
        (result, start.elapsed())
    };
    let (held, (waited, elapsed)) = tokio::join!(holder, waiter);
    assert!(held.is_ok());
    assert_eq!(waited.unwrap_err().reason(), Reason::DeadlineExceeded);
    assert_eq!(elapsed, ms(5));
    assert_eq!(calls.get(), 0);
}

#[tokio::test(start_paused = true)]
async fn cancelling_an_operation_releases_its_permits() {
    // Goal: dropping execute mid-attempt frees the bulkhead slot and the probe.
    // Method: race a long call against a timer with select, then inspect state.
    let pipeline = on_tokio(
        base().bulkhead(1, 0).circuit_breaker(
            Builder::last_calls(1),
            1,
            Ratio::of(1, 1),
            secs(1),
            1,
            1,
            secs(10),
        ),
        Classifier::new(),
    );
    // Open the circuit, then wait for half-open.
    let ctx = pipeline
        .new_context(secs(30), Safety::NotRepeatable, "op")
        .unwrap();
    let _ = pipeline
        .execute(&ctx, |_| async { Err::<(), _>(TestError::Fatal) })
        .await;
    sleep(secs(1)).await;
    let ctx = pipeline
        .new_context(secs(30), Safety::NotRepeatable, "op")
        .unwrap();
    tokio::select! {
        _ = pipeline.execute(&ctx, |_| async { sleep(secs(10)).await; Ok::<_, TestError>(()) }) => {
            panic!("the call should not finish first");
        }
        _ = sleep(ms(10)) => {}
    }
    assert_eq!(pipeline.bulkhead_in_use(), Some(0));
    assert_eq!(pipeline.circuit_state(), Some(CircuitState::HalfOpen));
    // The probe slot was released uncounted: a new probe is admitted.
    let ctx = pipeline
        .new_context(secs(30), Safety::NotRepeatable, "op")
        .unwrap();
    assert!(pipeline
        .execute(&ctx, |_| async { Ok::<_, TestError>(()) })
        .await
        .is_ok());
    assert_eq!(pipeline.circuit_state(), Some(CircuitState::Closed));
}

#[tokio::test(start_paused = true)]
async fn fallback_replaces_eligible_outcomes_only() {
    // Goal: the fallback replaces what the classifier allows, and nothing else.
    // Method: a Fatal error with fallback_on(Fatal), a Transient error not
    // eligible, and a failing fallback.
    let pipeline = on_tokio(
        base().fallback(),
        Classifier::new().fallback_on(|e: &TestError| *e == TestError::Fatal),
    );
    let ctx = pipeline
        .new_context(secs(30), Safety::NotRepeatable, "op")
        .unwrap();
    let value = pipeline
        .execute_with_fallback(
            &ctx,
            |_| async { Err::<&str, _>(TestError::Fatal) },
            |error| async move {
                assert_eq!(error.reason(), Reason::OperationFailed);
                Ok("cached")
            },
        )
        .await;
    assert_eq!(value.unwrap(), "cached");

    let ctx = pipeline
        .new_context(secs(30), Safety::NotRepeatable, "op")
        .unwrap();
    let error = pipeline
        .execute_with_fallback(
            &ctx,
            |_| async { Err::<&str, _>(TestError::Transient) },
            |_| async { Ok("never") },
        )
        .await
        .unwrap_err();
    assert!(matches!(
        error,
        Error::Failed {
            source: TestError::Transient,
            ..
        }
    ));

    let ctx = pipeline
        .new_context(secs(30), Safety::NotRepeatable, "op")
        .unwrap();
    let error = pipeline
        .execute_with_fallback(
            &ctx,
            |_| async { Err::<&str, _>(TestError::Fatal) },
            |_| async { Err(TestError::BadInput) },
        )
        .await
        .unwrap_err();
    assert!(matches!(
        error,
        Error::FallbackFailed {
            attempts: 1,
            source: TestError::BadInput
        }
    ));
    assert_eq!(error.reason().to_string(), "fallback_failed");
}

#[tokio::test(start_paused = true)]
async fn fallback_may_replace_a_rejection_and_stays_under_the_deadline() {
    // Goal: with fallback_on_rejection an open circuit is served by the
    // fallback; a fallback that finishes after the deadline is replaced.
    // Method: exhaust a 1-token rate limit, then a slow fallback on a short deadline.
    let pipeline = on_tokio(
        base()
            .rate_limit(Builder::token_bucket(1, 1, secs(60)))
            .fallback(),
        Classifier::new().fallback_on_rejection(),
    );
    let ctx = pipeline
        .new_context(secs(30), Safety::NotRepeatable, "op")
        .unwrap();
    assert!(pipeline
        .execute_with_fallback(
            &ctx,
            |_| async { Ok::<_, TestError>("live") },
            |_| async { Ok("fallback") }
        )
        .await
        .is_ok());
    let calls = Cell::new(0);
    let value = pipeline
        .execute_with_fallback(
            &ctx,
            |_| {
                calls.set(calls.get() + 1);
                async { Ok::<_, TestError>("live") }
            },
            |error| async move {
                assert_eq!(error.reason(), Reason::RateLimited);
                Ok("fallback")
            },
        )
        .await;
    assert_eq!(value.unwrap(), "fallback");
    assert_eq!(calls.get(), 0);

    let ctx = pipeline
        .new_context(ms(5), Safety::NotRepeatable, "op")
        .unwrap();
    let error = pipeline
        .execute_with_fallback(
            &ctx,
            |_| async { Ok::<_, TestError>("live") },
            |_| async {
                sleep(ms(10)).await;
                Ok("too late")
            },
        )
        .await
        .unwrap_err();
    assert_eq!(error.reason(), Reason::DeadlineExceeded);
}

#[tokio::test(start_paused = true)]
async fn fallback_needs_the_fallback_policy() {
    // Goal: a fallback given to a pipeline without the policy is refused uncalled.
    // Method: execute_with_fallback on a pipeline built without fallback().
    let pipeline = on_tokio(base(), Classifier::new());
    let ctx = pipeline
        .new_context(secs(30), Safety::NotRepeatable, "op")
        .unwrap();
    let calls = Cell::new(0);
    let error = pipeline
        .execute_with_fallback(
            &ctx,
            |_| {
                calls.set(calls.get() + 1);
                async { Ok::<_, TestError>(()) }
            },
            |_| async { Ok(()) },
        )
        .await
        .unwrap_err();
    assert!(matches!(
        error,
        Error::Rejected {
            rejection: Rejection::FallbackNotEnabled,
            ..
        }
    ));
    assert_eq!(calls.get(), 0);
}

#[tokio::test(start_paused = true)]
async fn same_seed_gives_the_same_attempt_ids_and_jittered_delays() {
    // Goal: attempt ids and jitter are deterministic per seed and differ across seeds.
    // Method: run the same failing operation on three pipelines (seeds 7, 7, 8)
    // with full jitter, recording attempt ids and instants.
    async fn record(seed: u64) -> Vec<(String, std::time::Duration)> {
        let pipeline = base()
            .retry(
                4,
                BackoffMode::Exponential,
                ms(10),
                ms(1_000),
                JitterMode::Full,
            )
            .compile_in_memory_with(
                retrying_classifier(),
                Arc::new(keel_resilience::TokioClock::new()),
                seed,
            )
            .unwrap();
        let ctx = pipeline.new_context(secs(30), replayable(), "op").unwrap();
        let start = Instant::now();
        let mut seen = Vec::new();
        let _ = pipeline
            .execute(&ctx, |attempt| {
                seen.push((attempt.attempt_id().lower_hex(), start.elapsed()));
                async { Err::<(), _>(TestError::Transient) }
            })
            .await;
        seen
    }
    let first = record(7).await;
    assert_eq!(first.len(), 4);
    assert_eq!(first, record(7).await);
    let other = record(8).await;
    assert!(first.iter().zip(&other).all(|(a, b)| a.0 != b.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_is_shared_safely_by_concurrent_operations() {
    // Goal: one pipeline shared by many tasks on two threads keeps exact counts.
    // Method: 200 operations race for a 50-token bucket that never refills
    // within the test; exactly 50 succeed. No sleeping: real time is fine.
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<keel_resilience::CompiledPipeline<TestError>>();
    let pipeline = Arc::new(
        base()
            .rate_limit(Builder::token_bucket(50, 1, secs(3600)))
            .bulkhead(8, 1_000)
            .compile_in_memory(Classifier::<TestError>::new())
            .unwrap(),
    );
    let mut tasks = Vec::new();
    for i in 0..200 {
        let pipeline = Arc::clone(&pipeline);
        tasks.push(tokio::spawn(async move {
            let ctx = pipeline
                .new_context(secs(60), Safety::NotRepeatable, &format!("op-{i}"))
                .unwrap();
            pipeline
                .execute(&ctx, |_| async {
                    tokio::task::yield_now().await;
                    Ok::<_, TestError>(())
                })
                .await
        }));
    }
    let mut ok = 0;
    for task in tasks {
        match task.await.unwrap() {
            Ok(()) => ok += 1,
            Err(error) => assert_eq!(error.reason(), Reason::RateLimited),
        }
    }
    assert_eq!(ok, 50);
    assert_eq!(pipeline.bulkhead_in_use(), Some(0));
}

#[tokio::test(start_paused = true)]
async fn nothing_is_held_while_waiting_between_retries() {
    // Goal: during the wait before a retry, neither the bulkhead slot nor the
    // half-open probe slot is held.
    // Method: one slot and one probe (two successes close the circuit).
    // A's first attempt fails with a retryable error the breaker ignores and
    // waits 10 ms; B arrives 5 ms in and must be admitted, as must A's retry.
    let pipeline = on_tokio(
        constant_retry(base(), 2, 10)
            .bulkhead(1, 0)
            .circuit_breaker(
                Builder::last_calls(1),
                1,
                Ratio::of(1, 1),
                secs(1),
                1,
                2,
                secs(10),
            ),
        Classifier::new()
            .retry_on(|_: &TestError| true)
            .breaker_ignores(|e: &TestError| *e == TestError::BadInput),
    );
    let ctx = pipeline
        .new_context(secs(30), Safety::NotRepeatable, "opener")
        .unwrap();
    let _ = pipeline
        .execute(&ctx, |_| async { Err::<(), _>(TestError::Fatal) })
        .await;
    sleep(secs(1)).await;
    assert_eq!(pipeline.circuit_state(), Some(CircuitState::HalfOpen));
    let a = async {
        let ctx = pipeline.new_context(secs(30), replayable(), "a").unwrap();
        pipeline
            .execute(&ctx, |attempt| {
                let n = attempt.dispatched_attempt_number();
                async move {
                    if n == 1 {
                        Err(TestError::BadInput)
                    } else {
                        Ok("a")
                    }
                }
            })
            .await
    };
    let b = async {
        sleep(ms(5)).await;
        let ctx = pipeline
            .new_context(secs(30), Safety::NotRepeatable, "b")
            .unwrap();
        pipeline
            .execute(&ctx, |_| async {
                sleep(ms(1)).await;
                Ok::<_, TestError>("b")
            })
            .await
    };
    let (a, b) = tokio::join!(a, b);
    assert_eq!(
        b.unwrap(),
        "b",
        "B got the slot and the probe while A waited"
    );
    assert_eq!(a.unwrap(), "a");
    assert_eq!(pipeline.circuit_state(), Some(CircuitState::Closed));
}
