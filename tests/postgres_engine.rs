//! Goal: the engine runs on PostgreSQL as it does on RocksDB: concurrent
//! workflows with retried activities, signals and timers complete with one
//! commit per durable id and a clean `verify`; a run waiting on a signal
//! survives an engine restart; a second engine on the same database is
//! refused with a typed error instead of running the same work twice.
//! Method: the order workflow on `Engine::builder().postgres_options(..)`
//! with a fresh schema on the server `.ci/run` starts (scripts/postgres.sh);
//! without the server the tests say so and pass, unless
//! `KEEL_REQUIRE_POSTGRES=1` (set by `.ci/run`) makes that a failure.

use std::sync::Arc;
use std::time::Duration;

use keel::storage::PgStore;
use keel::{
    Activity, ActivityContext, ActivityError, Engine, EngineError, PgOptions, RetryPolicy,
    Workflow, WorkflowContext, WorkflowError,
};
use serde::{Deserialize, Serialize};

fn postgres_url() -> Option<String> {
    match std::env::var("KEEL_TEST_POSTGRES_URL") {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            assert!(
                std::env::var("KEEL_REQUIRE_POSTGRES").as_deref() != Ok("1"),
                "KEEL_REQUIRE_POSTGRES=1 but KEEL_TEST_POSTGRES_URL is not set: run the tests through .ci/run"
            );
            eprintln!("KEEL_TEST_POSTGRES_URL is not set: skipping the PostgreSQL engine tests");
            None
        }
    }
}

/// A schema of the test's own, dropped at the end.
struct Scratch(PgOptions);

impl Scratch {
    fn new(url: &str, name: &str) -> Self {
        Scratch(PgOptions::new(url).schema(format!("e{}_{name}", std::process::id())))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = PgStore::drop_schema(&self.0);
    }
}

#[derive(Default)]
struct Charge;
impl Activity for Charge {
    const NAME: &'static str = "charge";
    type Input = u64;
    type Output = String;
    async fn run(&self, ctx: ActivityContext, cents: u64) -> Result<String, ActivityError> {
        if ctx.attempt().0 == 1 {
            return Err(ActivityError::retryable("gateway hiccup"));
        }
        Ok(format!("charged {cents} on attempt {}", ctx.attempt()))
    }
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Order {
    cents: u64,
    approve: bool,
}

struct OrderWorkflow;
impl Workflow for OrderWorkflow {
    const NAME: &'static str = "order";
    type Input = Order;
    type Output = String;
    async fn run(ctx: WorkflowContext, order: Order) -> Result<String, WorkflowError> {
        let charge = ctx
            .activity::<Charge>(order.cents)
            .retry(RetryPolicy::constant(3, Duration::from_millis(5)))
            .await?;
        let by = if order.approve {
            ctx.wait_signal::<String>("approve").await?
        } else {
            "nobody".to_string()
        };
        ctx.timer(Duration::from_millis(10)).await;
        Ok(format!("{charge}, approved by {by}"))
    }
}

fn engine_on(options: &PgOptions) -> Result<Engine, EngineError> {
    Engine::builder()
        .postgres_options(options.clone())
        .register_workflow::<OrderWorkflow>()
        .register_activity::<Charge>()
        .build()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_orders_complete_once_each() -> anyhow::Result<()> {
    let Some(url) = postgres_url() else {
        return Ok(());
    };
    let scratch = Scratch::new(&url, "bulk");
    let engine = engine_on(&scratch.0)?;
    let client = Arc::new(engine.client());
    let mut handles = Vec::new();
    for i in 0..40u64 {
        let c = client.clone();
        handles.push(tokio::spawn(async move {
            let id = format!("pg-{i}");
            c.start::<OrderWorkflow>(
                &id,
                &Order {
                    cents: i,
                    approve: false,
                },
            )
            .await?;
            c.result::<OrderWorkflow>(&id).await
        }));
    }
    for (i, h) in handles.into_iter().enumerate() {
        assert_eq!(
            h.await??,
            format!("charged {i} on attempt 2, approved by nobody")
        );
    }
    let report = engine.store().verify()?;
    assert!(report.ok, "{:?}", report.violations);
    assert_eq!(report.runs, 40);
    // The metrics count what happened: 40 starts, each charge failing
    // once then completing, and the PostgreSQL writer timed each group
    // it wrote.
    let stats = engine.stats().await;
    let s = &stats.shards;
    assert_eq!(s.inputs.get("start"), Some(&40), "{s:?}");
    assert_eq!(s.attempts.get("failed"), Some(&40), "{s:?}");
    assert_eq!(s.attempts.get("completed"), Some(&40), "{s:?}");
    let w = stats.writer.clone().expect("the PostgreSQL writer counts");
    assert!(w.commits >= s.commits - s.commits_failed, "{w:?} {s:?}");
    assert!(w.group_commits.count >= 1, "{w:?}");
    assert!(w.group_commits.count <= w.commits + w.refused, "{w:?}");
    assert_eq!(w.group_commits.count, w.write_seconds.count, "{w:?}");
    assert_eq!(stats.commit_seconds.count, s.commits, "{stats:?}");
    engine.shutdown_blocking();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_run_survives_a_restart_and_a_second_engine_is_refused() -> anyhow::Result<()> {
    let Some(url) = postgres_url() else {
        return Ok(());
    };
    let scratch = Scratch::new(&url, "restart");
    {
        let engine = engine_on(&scratch.0)?;
        let client = engine.client();
        client
            .start::<OrderWorkflow>(
                "big",
                &Order {
                    cents: 9_000,
                    approve: true,
                },
            )
            .await?;
        let mut waiting = false;
        for _ in 0..500 {
            let d = client.describe("big").await?;
            if d.signal_waits.iter().any(|(n, _)| n == "approve") {
                waiting = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(waiting, "the run never waited for its approval");

        // A second engine on the same database would run the same work
        // twice: it is refused while the first holds the database.
        let err = engine_on(&scratch.0.clone().lease_wait_ms(300)).expect_err("second engine");
        assert!(
            matches!(
                err,
                EngineError::Store(keel::storage::Error::DatabaseLocked { .. })
            ),
            "{err}"
        );
        engine.shutdown_blocking();
    }
    let engine = engine_on(&scratch.0)?;
    let client = engine.client();
    client
        .signal("big", "approve", &"ops".to_string(), Some("approve-1"))
        .await?;
    client
        .signal("big", "approve", &"ops".to_string(), Some("approve-1"))
        .await?;
    let receipt = client.result::<OrderWorkflow>("big").await?;
    assert_eq!(receipt, "charged 9000 on attempt 2, approved by ops");
    let run = client.describe("big").await?;
    let signals = engine
        .store()
        .history(run.run_id)?
        .iter()
        .filter(|e| e.kind.name() == "SignalReceived")
        .count();
    assert_eq!(signals, 1, "the duplicate signal was not committed");
    assert!(engine.store().verify()?.ok);
    engine.shutdown_blocking();
    Ok(())
}
