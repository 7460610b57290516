//! Goal: engine processes that share one store split its shards between
//! them and serve each other's clients: a workflow started, signalled and
//! awaited on either process completes once, wherever its shard (and its
//! child's) runs; when one process stops, the other takes its shards over
//! and finishes what it left; a process configured with another shard
//! count is refused at start; an activity attempt is run by whichever
//! process runs its type, wherever its shard is. Method: two engines in this test process,
//! each as a separate engine process would be (its own member name,
//! threads and, on PostgreSQL, its own connections), over an in-memory
//! store opened for sharing and over a sharded PostgreSQL database (the
//! server `.ci/run` starts; skipped without one unless
//! `KEEL_REQUIRE_POSTGRES=1`). Orders are started on one engine, signalled
//! on the other, and awaited on both; only the first process registers
//! the activity, so the second's shards depend on it taking their attempts
//! from the store; the histories are then checked for
//! exactly one start and one completion per run, and the store verified.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel::storage::{EventKind, MemStore, PgStore, Store};
use keel::{
    Activity, ActivityContext, ActivityError, Durability, Engine, EngineConfig, PgOptions,
    Workflow, WorkflowContext, WorkflowError,
};

const SHARDS: usize = 4;

/// Counts the copies it ran (in the engine it was given to).
#[derive(Clone, Default)]
struct Price {
    ran: Arc<AtomicU64>,
}
impl Activity for Price {
    const NAME: &'static str = "price";
    type Input = u64;
    type Output = u64;
    async fn run(&self, _: ActivityContext, n: u64) -> Result<u64, ActivityError> {
        self.ran.fetch_add(1, Ordering::Relaxed);
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

/// An engine process; it runs `price` attempts (its own shards' and the
/// other process's) when given `price`.
fn engine(store: Arc<dyn Store>, price: Option<Price>) -> anyhow::Result<Engine> {
    Ok(engine_with_shards(store, SHARDS, price)?)
}

fn engine_with_shards(
    store: Arc<dyn Store>,
    shards: usize,
    price: Option<Price>,
) -> Result<Engine, keel::EngineError> {
    let config = EngineConfig {
        shards,
        shard_lease_ms: 1_000,
        ..EngineConfig::default()
    };
    let builder = Engine::builder()
        .store(store)
        .config(config)
        .register_workflow::<Order>()
        .register_workflow::<Line>();
    match price {
        Some(p) => builder.activity(p).build(),
        None => builder.build(),
    }
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

/// `a` runs the `price` activity (counting in `a_ran`), `b` does not: every
/// attempt, of `b`'s shards too, is taken from the store by `a`.
async fn orders_across_processes(
    a: Engine,
    a_ran: Arc<AtomicU64>,
    b: Engine,
    store: Arc<dyn Store>,
) -> anyhow::Result<()> {
    wait_for_split(&[&a, &b]);
    // A third process counting shards differently would own runs the
    // others own too: it is refused before it starts, naming both counts.
    match engine_with_shards(store.clone(), SHARDS + 1, None) {
        Err(keel::EngineError::Store(keel::storage::Error::ShardCountDiffers {
            recorded,
            configured,
        })) => assert_eq!((recorded, configured), (SHARDS as u16, SHARDS as u16 + 1)),
        Err(other) => panic!("refused for another reason: {other}"),
        Ok(_) => panic!("an engine with another shard count started"),
    }
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
    // Either process lists every run, whichever shard it is on.
    for c in [&ca, &cb] {
        let page = c.list(&Default::default(), 100, None).await?;
        assert_eq!(
            page.runs.len() as u64,
            2 * ORDERS,
            "one order and one line each"
        );
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
    // Every line was priced, by `a` (at least once each: a copy may run
    // again after a lease ends, never committed twice).
    assert!(a_ran.load(Ordering::Relaxed) > ORDERS, "one price per line");

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
    let price = Price::default();
    let a = engine(store.clone(), Some(price.clone()))?;
    let b = engine(store.clone(), None)?;
    orders_across_processes(a, price.ran, b, store).await
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
        let price = Price::default();
        let a = engine(sa, Some(price.clone()))?;
        let b = engine(sb, None)?;
        orders_across_processes(a, price.ran, b, open()?).await
    }
    .await;
    let _ = PgStore::drop_schema(&options);
    result
}

/// `keel serve` hosted by one of two processes answers for the runs of
/// both: orders started over its HTTP API land on every shard, each is
/// described (its wait read from whichever process runs it), signalled and
/// awaited over HTTP; the list and the counts hold the whole store, and
/// `/metrics` reports the store's open runs and this process's shards.
async fn serve_across_processes(a: Engine, b: Engine, store: Arc<dyn Store>) -> anyhow::Result<()> {
    use actix_web::body::MessageBody;
    use actix_web::test;
    use serde_json::{json, Value};

    wait_for_split(&[&a, &b]);
    let b = Arc::new(b);
    let state = keel_cli::serve::ServeState::new(b.clone(), &Default::default())?;
    let app =
        test::init_service(actix_web::App::new().configure(keel_cli::serve::configure(state)))
            .await;
    let call = |req: test::TestRequest| {
        let app = &app;
        async move {
            let res = test::call_service(app, req.to_request()).await;
            let status = res.status().as_u16();
            let bytes = res.into_body().try_into_bytes().unwrap_or_default();
            (
                status,
                serde_json::from_slice::<Value>(&bytes).unwrap_or(Value::Null),
            )
        }
    };
    // Sixteen runs over four shards split between the two processes:
    // some land on the other process's shards.
    const ORDERS: u64 = 16;
    for i in 0..ORDERS {
        let body = json!({"workflow_type": "order", "instance_id": format!("web-{i}"),
            "input": i, "command_id": format!("start-web-{i}")});
        let (status, started) =
            call(test::TestRequest::post().uri("/api/v1/runs").set_json(body)).await;
        assert_eq!(status, 201, "{started}");
    }
    for i in 0..ORDERS {
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            let (status, d) =
                call(test::TestRequest::get().uri(&format!("/api/v1/runs/web-{i}"))).await;
            assert_eq!(status, 200, "{d}");
            if d["signal_waits"].to_string().contains("approve") {
                break;
            }
            assert!(Instant::now() < until, "web-{i} never waited: {d}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // Every order waits (its line closed): the whole store's open runs.
    let res = test::call_service(&app, test::TestRequest::get().uri("/metrics").to_request()).await;
    let text = String::from_utf8(res.into_body().try_into_bytes().unwrap().to_vec())?;
    let open = format!("keel_runs_open {ORDERS}");
    assert!(text.lines().any(|l| l == open), "{open}: {text}");
    for i in 0..ORDERS {
        let signal =
            json!({"name": "approve", "payload": "web", "command_id": format!("ok-web-{i}")});
        let (status, body) = call(
            test::TestRequest::post()
                .uri(&format!("/api/v1/runs/web-{i}/signal"))
                .set_json(signal),
        )
        .await;
        assert_eq!(status, 200, "{body}");
    }
    for i in 0..ORDERS {
        let (status, done) = call(
            test::TestRequest::get().uri(&format!("/api/v1/runs/web-{i}/result?wait_ms=20000")),
        )
        .await;
        assert_eq!(status, 200, "{done}");
        assert_eq!(done["status"], "completed", "{done}");
        assert_eq!(done["result"], format!("{} approved by web", i * 10 + 1));
    }
    let (_, page) = call(test::TestRequest::get().uri("/api/v1/runs?page_size=100")).await;
    assert_eq!(
        page["runs"].as_array().map(Vec::len),
        Some(2 * ORDERS as usize),
        "one order and one line each: {page}"
    );
    let (_, counts) = call(test::TestRequest::get().uri("/api/v1/counts")).await;
    assert_eq!(counts["counts"]["completed"], 2 * ORDERS, "{counts}");
    let res = test::call_service(&app, test::TestRequest::get().uri("/metrics").to_request()).await;
    let text = String::from_utf8(res.into_body().try_into_bytes().unwrap().to_vec())?;
    assert!(text.lines().any(|l| l == "keel_runs_open 0"), "{text}");
    let owned = format!("keel_shards_owned {}", b.shards_here().len());
    assert!(text.lines().any(|l| l == owned), "{owned}: {text}");
    drop(app);
    a.shutdown().await;
    if let Ok(b) = Arc::try_unwrap(b) {
        b.shutdown().await;
    }
    let report = store.verify()?;
    assert!(report.ok, "{:?}", report.violations);
    Ok(())
}

#[actix_web::test]
async fn keel_serve_on_one_of_two_processes_sharing_a_store() -> anyhow::Result<()> {
    let store: Arc<dyn Store> = Arc::new(MemStore::shared_by_processes(Durability::Sync));
    let a = engine(store.clone(), Some(Price::default()))?;
    let b = engine(store.clone(), None)?;
    serve_across_processes(a, b, store).await
}

#[actix_web::test]
async fn keel_serve_on_one_of_two_processes_sharing_a_postgres_database() -> anyhow::Result<()> {
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
        .schema(format!("served{}", std::process::id()))
        .sharded();
    let open =
        || -> anyhow::Result<Arc<dyn Store>> { Ok(Arc::new(PgStore::open(options.clone())?)) };
    let result = async {
        let a = engine(open()?, Some(Price::default()))?;
        let b = engine(open()?, None)?;
        serve_across_processes(a, b, open()?).await
    }
    .await;
    let _ = PgStore::drop_schema(&options);
    result
}
