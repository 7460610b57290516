//! Goal: activities go through a resilience profile: per-process policies
//! (here a token-bucket rate limit) delay attempts without ever reaching the
//! activity or committing a failure, `describe` says which policy delayed an
//! attempt, and the durable retry policy still retries real failures.
//! Method: a profile with a one-token bucket refilled every 300 ms; a
//! workflow runs three calls in parallel through it; while it runs we read
//! `describe`, then check the history has no failed attempts.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use keel::resilience::{AttemptTimeoutRequirement, Builder, Classifier};
use keel::storage::EventKind;
use keel::{
    Activity, ActivityContext, ActivityError, Engine, Failure, Workflow, WorkflowContext,
    WorkflowError,
};

static CALLS: AtomicU32 = AtomicU32::new(0);

#[derive(Default)]
struct Lookup;
impl Activity for Lookup {
    const NAME: &'static str = "lookup";
    type Input = u32;
    type Output = u32;
    async fn run(&self, _ctx: ActivityContext, i: u32) -> Result<u32, ActivityError> {
        CALLS.fetch_add(1, Ordering::SeqCst);
        Ok(i * 10)
    }
}

struct ThreeLookups;
impl Workflow for ThreeLookups {
    const NAME: &'static str = "three-lookups";
    type Input = ();
    type Output = (u32, u32, u32);
    async fn run(ctx: WorkflowContext, _: ()) -> Result<Self::Output, WorkflowError> {
        Ok(ctx
            .all((
                ctx.activity::<Lookup>(1).profile("catalog"),
                ctx.activity::<Lookup>(2).profile("catalog"),
                ctx.activity::<Lookup>(3).profile("catalog"),
            ))
            .await?)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limited_profile_delays_attempts_durably_and_visibly() -> anyhow::Result<()> {
    let pipeline = Builder::profile("catalog", "v1")
        .partition("shop", "test", "catalog-api")
        // The attempt timeout is also each copy's lease. It is long so that
        // a CI machine stalled for a few seconds cannot end a lease and
        // redeliver a copy (a legitimate second call, which the exact count
        // below would take for a rejection reaching the activity: it did
        // once with a 2 s timeout).
        .attempt_timeout(
            Duration::from_secs(60),
            AttemptTimeoutRequirement::Cooperative,
        )
        .rate_limit(Builder::token_bucket(1, 1, Duration::from_millis(300)))
        .compile_in_memory(Classifier::<Failure>::new())?;
    let engine = Engine::builder()
        .in_memory()
        .register_workflow::<ThreeLookups>()
        .register_activity::<Lookup>()
        .resilience_profile("catalog", pipeline)
        .build()?;
    let client = engine.client();
    client.start::<ThreeLookups>("lookups", &()).await?;
    let mut seen_delay = None;
    for _ in 0..100 {
        let d = client.describe("lookups").await?;
        if let Some(a) = d.attempts.iter().find(|a| a.delayed_by.is_some()) {
            seen_delay = a.delayed_by.clone();
            break;
        }
        if d.status != keel::RunStatus::Running {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(seen_delay.as_deref(), Some("rate_limited"));
    let out = client.result::<ThreeLookups>("lookups").await?;
    assert_eq!(out, (10, 20, 30));
    // Rejections never reached the activity and never became failures.
    assert_eq!(CALLS.load(Ordering::SeqCst), 3);
    let run = engine.store().resolve("lookups")?.expect("run");
    let history = engine.store().history(run)?;
    assert!(!history
        .iter()
        .any(|e| matches!(e.kind, EventKind::ActivityAttemptFailed { .. })));
    Ok(())
}
