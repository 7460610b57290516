//! Overhead of a compiled pipeline with every policy enabled around a no-op
//! async call (target: at most 2 µs median per operation, context creation
//! included).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use keel_resilience::{
    AttemptTimeoutRequirement, BackoffMode, Builder, Classifier, CompiledPipeline, JitterMode,
    Ratio, Safety,
};

#[derive(Debug)]
struct NoError;

fn every_policy(requirement: AttemptTimeoutRequirement) -> CompiledPipeline<NoError> {
    Builder::profile("bench", "v1")
        .partition("bench", "local", "noop")
        .attempt_timeout(Duration::from_secs(2), requirement)
        .retry(
            3,
            BackoffMode::Exponential,
            Duration::from_millis(1),
            Duration::from_millis(10),
            JitterMode::Full,
        )
        .retry_budget(10, 10, Duration::from_secs(60), Duration::from_secs(10))
        .rate_limit(Builder::token_bucket(
            1_000_000_000,
            1_000_000_000,
            Duration::from_secs(1),
        ))
        .circuit_breaker(
            Builder::last_calls(100),
            10,
            Ratio::of(1, 2),
            Duration::from_secs(30),
            1,
            1,
            Duration::from_secs(10),
        )
        .bulkhead(1_024, 1_024)
        .fallback()
        .compile_in_memory(Classifier::new().fallback_on_rejection())
        .expect("valid pipeline")
}

fn bench_execute(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    for (name, requirement) in [
        (
            "execute_every_policy_noop/cooperative",
            AttemptTimeoutRequirement::Cooperative,
        ),
        (
            "execute_every_policy_noop/preemptive",
            AttemptTimeoutRequirement::Preemptive,
        ),
    ] {
        let pipeline = every_policy(requirement);
        c.bench_function(name, |b| {
            b.iter_custom(|iters| {
                runtime.block_on(async {
                    let start = Instant::now();
                    for _ in 0..iters {
                        let ctx = pipeline
                            .new_context(Duration::from_secs(30), Safety::NotRepeatable, "op")
                            .expect("context");
                        let value = pipeline
                            .execute_with_fallback(
                                &ctx,
                                |attempt| async move { Ok(attempt.dispatched_attempt_number()) },
                                |_| async { Ok(0) },
                            )
                            .await;
                        black_box(value.expect("no-op succeeds"));
                    }
                    start.elapsed()
                })
            })
        });
    }
}

criterion_group!(benches, bench_execute);
criterion_main!(benches);
