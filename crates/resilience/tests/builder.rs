//! The builder's validation and `explain()`.

mod common;

use common::*;
use keel_resilience::builder::Error;
use keel_resilience::{
    AttemptTimeoutRequirement, BackoffMode, Builder, Classifier, JitterMode, Ratio, Safety,
};

fn compile(builder: Builder) -> Result<(), Error> {
    builder
        .compile_in_memory(Classifier::<TestError>::new())
        .map(drop)
}

fn full() -> Builder {
    Builder::profile("checkout", "v7")
        .partition("shop", "prod", "payments-api")
        .tenant("acme")
        .attempt_timeout(secs(2), AttemptTimeoutRequirement::Preemptive)
        .retry(
            4,
            BackoffMode::Exponential,
            ms(10),
            secs(1),
            JitterMode::Decorrelated,
        )
        .retry_budget(10, 10, secs(60), secs(10))
        .rate_limit(Builder::token_bucket(5, 5, secs(1)))
        .circuit_breaker(
            Builder::last_calls(10),
            4,
            Ratio::of(1, 2),
            secs(30),
            1,
            1,
            secs(10),
        )
        .bulkhead(4, 16)
        .fallback()
}

#[test]
fn required_options_and_duplicates_are_reported() {
    // Goal: the two required options are required and no method runs twice.
    // Method: leave each out, call one twice.
    let no_partition = Builder::profile("p", "v1")
        .attempt_timeout(secs(1), AttemptTimeoutRequirement::Cooperative);
    assert_eq!(compile(no_partition), Err(Error::MissingPartition));
    let no_timeout = Builder::profile("p", "v1").partition("a", "b", "c");
    assert_eq!(compile(no_timeout), Err(Error::MissingAttemptTimeout));
    assert_eq!(
        compile(
            base()
                .rate_limit(Builder::token_bucket(1, 1, secs(1)))
                .rate_limit(Builder::token_bucket(2, 2, secs(1)))
        ),
        Err(Error::Duplicate {
            method: "rate_limit"
        })
    );
    assert_eq!(
        compile(base().fallback().fallback()),
        Err(Error::Duplicate { method: "fallback" })
    );
    assert!(matches!(
        compile(
            Builder::profile("", "v1")
                .partition("a", "b", "c")
                .attempt_timeout(secs(1), AttemptTimeoutRequirement::Cooperative)
        ),
        Err(Error::Id(_))
    ));
}

#[test]
fn invalid_numbers_and_combinations_are_refused_with_typed_errors() {
    // Goal: each policy's numbers are checked when compiling.
    // Method: one broken number per policy, plus the cross-policy rules.
    assert!(matches!(
        compile(base().retry(0, BackoffMode::Constant, ms(5), ms(5), JitterMode::None)),
        Err(Error::Retry(keel_resilience::retry::Error::MaxAttempts {
            found: 0
        }))
    ));
    assert!(matches!(
        compile(base().retry(3, BackoffMode::Linear, ms(50), ms(5), JitterMode::Full)),
        Err(Error::Retry(
            keel_resilience::retry::Error::MaxBelowBase { .. }
        ))
    ));
    assert!(matches!(
        compile(base().circuit_breaker(
            Builder::last_calls(10),
            4,
            Ratio::of(3, 2),
            secs(30),
            1,
            1,
            secs(10)
        )),
        Err(Error::Circuit(
            keel_resilience::circuit::Error::Ratio { .. }
        ))
    ));
    assert!(matches!(
        compile(base().rate_limit(Builder::token_bucket(0, 0, secs(1)))),
        Err(Error::RateLimit(_))
    ));
    assert!(matches!(
        compile(base().bulkhead(0, 1)),
        Err(Error::Bulkhead(_))
    ));
    assert!(matches!(
        compile(base().attempt_timeout(ms(0), AttemptTimeoutRequirement::Cooperative)),
        Err(Error::Duplicate { .. })
    ));
    assert!(matches!(
        compile(
            Builder::profile("p", "v1")
                .partition("a", "b", "c")
                .attempt_timeout(ms(0), AttemptTimeoutRequirement::Cooperative)
        ),
        Err(Error::AttemptTimeout { .. })
    ));
    assert_eq!(
        compile(base().retry_budget(10, 10, secs(60), secs(10))),
        Err(Error::BudgetWithoutRetry)
    );
    assert_eq!(
        compile(base().fallback()),
        Err(Error::FallbackNeverEligible)
    );
    assert!(compile(full())
        .map_err(|e| e.to_string())
        .unwrap_err()
        .contains("fallback"));
    assert!(full()
        .compile_in_memory(Classifier::<TestError>::new().fallback_on_rejection())
        .is_ok());
}

#[test]
fn context_deadline_must_be_positive() {
    // Goal: an already expired budget is refused when creating the context.
    // Method: zero deadline and an empty operation id.
    let pipeline = on_tokio(base(), Classifier::new());
    assert_eq!(
        pipeline
            .new_context(ms(0), Safety::NotRepeatable, "op")
            .unwrap_err(),
        keel_resilience::context::Error::ZeroDeadline
    );
    assert!(pipeline
        .new_context(ms(1), Safety::NotRepeatable, "")
        .is_err());
}

#[test]
fn explain_lists_the_seed_policies_and_this_runtimes_capabilities() {
    // Goal: the seed's explain output, with this runtime's truthful notes.
    // Method: the seed's catalog pipeline, formatted as in the seed.
    let pipeline = on_tokio(
        base()
            .rate_limit(Builder::token_bucket(5, 5, secs(1)))
            .circuit_breaker(
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
    let explanation = pipeline.explain();
    assert_eq!(explanation.profile_id.as_str(), "tests");
    assert_eq!(explanation.profile_version.as_str(), "v1");
    assert_eq!(
        explanation.enabled_policies,
        ["attempt", "retry(maxAttempts=1)", "rate_limit", "circuit"]
    );
    // The listing order is the seed's; the checks run circuit first.
    assert_eq!(
        explanation.check_order,
        [
            "partition",
            "retry_safety",
            "deadline",
            "circuit",
            "rate_limit",
            "attempt_timeout"
        ]
    );
    let notes: Vec<String> = explanation
        .capability_notes
        .iter()
        .map(|n| n.to_string())
        .collect();
    assert_eq!(
        notes,
        [
            "invocation=asynchronous",
            "settlement=future_output",
            "attempt_timeout=cooperative",
            "cancellation=drop_at_await",
            "scheduling=async_sleep",
            "queue_ownership=none",
            "detached_completion=unsupported",
            "nonblocking=claimed",
            "physical_stop=not_guaranteed",
            "require_finite_backend_io=false",
        ]
    );
}

#[test]
fn explain_of_every_policy_in_preemptive_mode() {
    // Goal: all policies in the documented order; notes follow the configuration.
    // Method: the full builder, preemptive with a bulkhead queue.
    let pipeline = full()
        .compile_in_memory(Classifier::<TestError>::new().fallback_on_rejection())
        .unwrap();
    let explanation = pipeline.explain();
    assert_eq!(
        explanation.enabled_policies,
        [
            "attempt",
            "retry(maxAttempts=4)",
            "retry_budget",
            "rate_limit",
            "circuit",
            "bulkhead",
            "fallback"
        ]
    );
    assert_eq!(
        explanation.check_order,
        [
            "partition",
            "retry_safety",
            "deadline",
            "circuit",
            "retry_budget",
            "rate_limit",
            "bulkhead",
            "attempt_timeout"
        ]
    );
    assert_eq!(
        explanation.partition.to_string(),
        "shop/prod/payments-api/acme"
    );
    let note = |key: &str| {
        explanation
            .capability_notes
            .iter()
            .find(|n| n.key == key)
            .map(|n| n.value)
    };
    assert_eq!(note("attempt_timeout"), Some("preemptive_drop"));
    assert_eq!(note("physical_stop"), Some("future_dropped"));
    assert_eq!(note("queue_ownership"), Some("bulkhead_fifo"));
    // explain changes nothing: the rate limit still holds every token.
    assert_eq!(pipeline.rate_limit_available(), Some(5));
}
