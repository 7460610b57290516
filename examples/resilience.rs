//! The concepts page of the resilience pipeline, walked through in order.
//!
//! Prints the profile and enabled policies of a pipeline with a rate limit and
//! a circuit breaker, the capability notes of this async runtime, a retrying
//! operation that succeeds on its third attempt, an overall deadline that
//! replaces a late result, and the refusal of a context from another
//! partition. Time is tokio's paused virtual time, so the run is
//! deterministic and instant: the "slow" call takes 30 ms of virtual time
//! against a 5 ms deadline.
//!
//! `main` prints to stdout; `run` is also called by
//! `crates/resilience/tests/example_output.rs`, which compares its output
//! with `tests/data/resilience_example.out`.

use std::collections::HashSet;
use std::error::Error;
use std::fmt;
use std::io::Write;
use std::time::Duration;

use keel_resilience::{
    AttemptTimeoutRequirement, BackoffMode, Builder, Classifier, JitterMode, Ratio, Reason,
    ReplaySafetyContract, Safety,
};

/// The transient failure of the flaky callable.
#[derive(Debug)]
struct Hiccup;

impl fmt::Display for Hiccup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("try again")
    }
}

impl Error for Hiccup {}

fn main() -> Result<(), Box<dyn Error>> {
    run(&mut std::io::stdout().lock())
}

/// Writes the walkthrough to `out`.
pub fn run(out: &mut impl Write) -> Result<(), Box<dyn Error>> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()?;
    runtime.block_on(concepts(out))
}

async fn concepts(out: &mut impl Write) -> Result<(), Box<dyn Error>> {
    // A pipeline is built once: no defaults, every number explicit.
    let catalog = Builder::profile("concepts", "v1")
        .partition("shop", "prod", "catalog-api")
        .attempt_timeout(
            Duration::from_secs(2),
            AttemptTimeoutRequirement::Cooperative,
        )
        .rate_limit(Builder::token_bucket(5, 5, Duration::from_secs(1)))
        .circuit_breaker(
            Builder::last_calls(10),
            4,
            Ratio::of(1, 2),
            Duration::from_secs(30),
            1,
            1,
            Duration::from_secs(10),
        )
        .compile_in_memory(Classifier::<Hiccup>::new())?;

    let explanation = catalog.explain();
    writeln!(
        out,
        "profile: {} {}",
        explanation.profile_id, explanation.profile_version
    )?;
    writeln!(
        out,
        "enabled policies: {}",
        explanation.enabled_policies.join(", ")
    )?;
    for note in &explanation.capability_notes {
        writeln!(out, "  {note}")?;
    }

    // Each operation has one overall deadline and several attempts.
    let retrying = Builder::profile("concepts", "v1")
        .partition("shop", "prod", "catalog-api")
        .attempt_timeout(
            Duration::from_secs(2),
            AttemptTimeoutRequirement::Cooperative,
        )
        .retry(
            3,
            BackoffMode::Constant,
            Duration::from_millis(5),
            Duration::from_millis(5),
            JitterMode::None,
        )
        .retry_budget(10, 10, Duration::from_secs(60), Duration::from_secs(10))
        .compile_in_memory(Classifier::new().retry_on(|_: &Hiccup| true))?;

    let mut operation_ids = Vec::new();
    let mut attempt_ids = Vec::new();
    let flaky = |attempt: keel_resilience::AttemptContext| {
        operation_ids.push(attempt.operation_id().to_string());
        attempt_ids.push(attempt.attempt_id().lower_hex());
        let number = attempt.dispatched_attempt_number();
        async move {
            if number < 3 {
                Err(Hiccup)
            } else {
                Ok(format!("succeeded on attempt {number}"))
            }
        }
    };
    let safety = Safety::replayable_read(ReplaySafetyContract::for_read_only_callable(
        "list-products",
        Duration::from_secs(3600),
    )?);
    let context = retrying.new_context(Duration::from_secs(30), safety, "concepts-1")?;
    writeln!(out, "{}", retrying.execute(&context, flaky).await?)?;
    let distinct_attempts: HashSet<&String> = attempt_ids.iter().collect();
    writeln!(
        out,
        "attempts: {}, distinct attempt ids: {}",
        attempt_ids.len(),
        distinct_attempts.len()
    )?;
    let distinct_operations: HashSet<&String> = operation_ids.iter().collect();
    writeln!(
        out,
        "distinct operation ids: {} ({})",
        distinct_operations.len(),
        operation_ids[0]
    )?;

    // Overall deadline: one budget for the whole operation.
    writeln!(out, "-- 6. Deadline: one budget for the whole operation")?;
    let pipeline = Builder::profile("choosing", "v1")
        .partition("shop", "prod", "catalog-api")
        .attempt_timeout(
            Duration::from_secs(2),
            AttemptTimeoutRequirement::Cooperative,
        )
        .compile_in_memory(Classifier::<Hiccup>::new())?;
    let slow = |_attempt| async {
        tokio::time::sleep(Duration::from_millis(30)).await;
        Ok("finished late")
    };
    let context = pipeline.new_context(
        Duration::from_millis(5),
        Safety::NotRepeatable,
        "deadline-1",
    )?;
    match pipeline.execute(&context, slow).await {
        Err(error) if error.reason() == Reason::DeadlineExceeded => {
            writeln!(out, "late result replaced by {}", error.reason())?;
        }
        other => return Err(format!("expected deadline_exceeded, got {other:?}").into()),
    }

    // Partition: a context from another partition's pipeline is refused.
    let orders = Builder::profile("concepts", "v1")
        .partition("shop", "prod", "orders-api")
        .attempt_timeout(
            Duration::from_secs(2),
            AttemptTimeoutRequirement::Cooperative,
        )
        .rate_limit(Builder::token_bucket(5, 5, Duration::from_secs(1)))
        .compile_in_memory(Classifier::<Hiccup>::new())?;
    let foreign = orders.new_context(Duration::from_secs(30), Safety::NotRepeatable, "orders-1")?;
    match catalog
        .execute(&foreign, |_attempt| async { Ok("never runs") })
        .await
    {
        Err(error) if error.reason() == Reason::InvalidConfiguration => {
            writeln!(out, "{error}")?;
        }
        other => return Err(format!("expected a partition refusal, got {other:?}").into()),
    }
    Ok(())
}
