//! Goal: engine processes that share one store split its shards between
//! them and serve each other's clients: a workflow started, signalled and
//! awaited on either process completes once, wherever its shard (and its
//! child's) runs; when one process stops, the other takes its shards over
//! and finishes what it left. Method: two engines in this test process,
//! each as a separate engine process would be (its own member name,
//! threads and, on PostgreSQL, its own connections), over an in-memory
//! store opened for sharing and over a sharded PostgreSQL database (the
//! server `.ci/run` starts; skipped without one unless
//! `KEEL_REQUIRE_POSTGRES=1`). Orders are started on one engine, signalled
//! on the other, and awaited on both; the histories are then checked for
//! exactly one start and one completion per run, and the store verified.

use std::sync::Arc;
use std::time::{Duration, Instant};

use keel::storage::{EventKind, MemStore, PgStore, Store};
use keel::{
    Activity, ActivityContext, ActivityError, Durability, Engine, EngineConfig, PgOptions,
    Workflow, WorkflowContext, WorkflowError,
};

const SHARDS: usize = 4;

#[derive(Default)]
struct Price;
impl Activity for Price {
    const NAME: &'static str = "price";
    type Input = u64;
    type Output = u64;
    async fn run(&self, _: ActivityContext, n: u64) -> Result<u64, ActivityError> {
        Ok(n * 10)
    }
}

struct Line;
impl Workflow for Line {
    const NAME: &'static str = "line";
    type Input = u64;
    type Output = u64;
    async fn run(ctx: WorkflowContext, n: u64) -> Result<u64, WorkflowError> {
        Ok(ctx.activity::<Price>(n).await? + 1)
    }
}

/// Prices a line in a child (on whatever shard it lands), then waits for
/// an approval signal.
struct Order;
impl Workflow for Order {
    const NAME: &'static str = "order";
    type Input = u64;
    type Output = String;
    async fn run(ctx: WorkflowContext, n: u64) -> Result<String, WorkflowError> {
        let total = ctx.child::<Line>(n).await?;
        let by: String = ctx.wait_signal("approve").await?;
        Ok(format!("{total} approved by {by}"))
    }
}

fn engine(store: Arc<dyn Store>) -> anyhow::Result<Engine> {
    let config = EngineConfig {
        shards: SHARDS,
        shard_lease_ms: 1_000,
        ..EngineConfig::default()
    };
    Ok(Engine::builder()
        .store(store)
        .config(config)
        .register_workflow::<Order>()
        .register_workflow::<Line>()
        .register_activity::<Price>()
        .build()?)
}

/// Waits until `engines` run every shard between them, each some.
fn wait_for_split(engines: &[&Engine]) {
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let held: Vec<usize> = engines.iter().map(|e| e.shards_here().len()).collect();
        if held.iter().sum::<usize>() == SHARDS && held.iter().all(|h| *h > 0) {
            return;
        }
        assert!(
            Instant::now() < until,
            "the shards were never split: {held:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

async fn orders_across_processes(
    a: Engine,
    b: Engine,
    store: Arc<dyn Store>,
) -> anyhow::Result<()> {
    wait_for_split(&[&a, &b]);
    let (ca, cb) = (a.client(), b.client());
    const ORDERS: u64 = 16;
    for i in 0..ORDERS {
        ca.start::<Order>(&format!("order-{i}"), &i).await?;
    }
    for i in 0..ORDERS {
        // Signalled twice with one command id from the other process:
        // committed once.
        for _ in 0..2 {
            cb.signal(
                &format!("order-{i}"),
                "approve",
                &"b".to_string(),
                Some(&format!("ok-{i}")),
            )
            .await?;
        }
    }
    for i in 0..ORDERS {
        let c = if i % 2 == 0 { &ca } else { &cb };
        let got = c.result::<Order>(&format!("order-{i}")).await?;
        assert_eq!(got, format!("{} approved by b", i * 10 + 1));
    }
    // One process stops: the other takes every shard and finishes work
    // started on it.
    b.shutdown().await;
    let until = Instant::now() + Duration::from_secs(20);
    while a.shards_here().len() < SHARDS {
        assert!(Instant::now() < until, "the shards were not taken over");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    ca.start::<Order>("after", &7).await?;
    ca.signal("after", "approve", &"a".to_string(), Some("ok-after"))
        .await?;
    assert_eq!(ca.result::<Order>("after").await?, "71 approved by a");
    a.shutdown().await;

    let runs = store.runs(&Default::default())?;
    assert_eq!(
        runs.len() as u64,
        2 * (ORDERS + 1),
        "one order and one line each"
    );
    for meta in runs {
        let history = store.history(meta.run_id)?;
        let count = |f: fn(&EventKind) -> bool| history.iter().filter(|e| f(&e.kind)).count();
        assert_eq!(count(|k| matches!(k, EventKind::WorkflowStarted { .. })), 1);
        assert_eq!(
            count(|k| matches!(k, EventKind::WorkflowCompleted { .. })),
            1
        );
        assert!(count(|k| matches!(k, EventKind::SignalReceived { .. })) <= 1);
    }
    let report = store.verify()?;
    assert!(report.ok, "{:?}", report.violations);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_engines_share_an_in_memory_store() -> anyhow::Result<()> {
    let store: Arc<dyn Store> = Arc::new(MemStore::shared_by_processes(Durability::Sync));
    let a = engine(store.clone())?;
    let b = engine(store.clone())?;
    orders_across_processes(a, b, store).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_engine_processes_share_a_postgres_database() -> anyhow::Result<()> {
    let url = match std::env::var("KEEL_TEST_POSTGRES_URL") {
        Ok(url) if !url.is_empty() => url,
        _ => {
            assert!(
                std::env::var("KEEL_REQUIRE_POSTGRES").as_deref() != Ok("1"),
                "KEEL_REQUIRE_POSTGRES=1 but KEEL_TEST_POSTGRES_URL is not set"
            );
            eprintln!("KEEL_TEST_POSTGRES_URL is not set: skipping");
            return Ok(());
        }
    };
    let options = PgOptions::new(url)
        .schema(format!("shared{}", std::process::id()))
        .sharded();
    let open =
        || -> anyhow::Result<Arc<dyn Store>> { Ok(Arc::new(PgStore::open(options.clone())?)) };
    let result = async {
        let (sa, sb) = (open()?, open()?);
        let a = engine(sa)?;
        let b = engine(sb)?;
        orders_across_processes(a, b, open()?).await
    }
    .await;
    let _ = PgStore::drop_schema(&options);
    result
}
