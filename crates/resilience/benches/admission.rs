//! Admissions per second through one token bucket from two threads (target:
//! at least 1,000,000/s). Each admission is admit + settle on a pipeline whose
//! only admission policy is the rate limit.

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use keel_resilience::{
    AttemptTimeoutRequirement, Builder, Classifier, CompiledPipeline, Safety, Verdict,
};

#[derive(Debug)]
struct NoError;

fn rate_limited() -> CompiledPipeline<NoError> {
    Builder::profile("bench", "v1")
        .partition("bench", "local", "bucket")
        .attempt_timeout(
            Duration::from_secs(2),
            AttemptTimeoutRequirement::Cooperative,
        )
        .rate_limit(Builder::token_bucket(
            1_000_000_000,
            1_000_000_000,
            Duration::from_secs(1),
        ))
        .compile_in_memory(Classifier::new())
        .expect("valid pipeline")
}

fn admit_many(pipeline: &CompiledPipeline<NoError>, count: u64) {
    let ctx = pipeline
        .new_context(Duration::from_secs(3_600), Safety::NotRepeatable, "bench")
        .expect("context");
    for _ in 0..count {
        pipeline
            .admit(&ctx, false)
            .expect("a token is always available")
            .settle(Verdict::Success);
    }
}

fn bench_admissions(c: &mut Criterion) {
    let mut group = c.benchmark_group("token_bucket_admissions");
    group.throughput(Throughput::Elements(1));
    let pipeline = rate_limited();
    group.bench_function("one_thread", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            admit_many(&pipeline, iters);
            start.elapsed()
        })
    });
    group.bench_function("two_threads", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            std::thread::scope(|scope| {
                let half = iters / 2;
                let shared = &pipeline;
                scope.spawn(move || admit_many(shared, half));
                admit_many(shared, iters - half);
            });
            start.elapsed()
        })
    });
    group.finish();
}

criterion_group!(benches, bench_admissions);
criterion_main!(benches);
