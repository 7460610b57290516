//! Goal: when the store stops accepting writes the engine neither hangs nor
//! loses anything: calls that need a commit fail fast with a typed error
//! naming the cause, a client waiting for a result is answered, `health()`
//! and `describe` say the store is stopped, reads still work, and once the
//! cause is gone the same workflows finish with nothing acknowledged lost.
//! A store that gives up for good stops the engine: every call then ends
//! with that error.
//! Method: the real engine on an in-memory store whose writes are stopped
//! and resumed by the test (the injected error; the RocksDB store's own
//! no-space handling is tested on a real full file system in
//! crates/storage/tests/disk_full.rs).

use std::sync::Arc;
use std::time::{Duration, Instant};

use keel::storage::MemStore;
use keel::{
    Durability, Engine, EngineError, RunStatus, StoreHealth, Workflow, WorkflowContext,
    WorkflowError, WriteFault,
};

/// Waits for one signal and returns it.
struct Waits;
impl Workflow for Waits {
    const NAME: &'static str = "waits";
    type Input = ();
    type Output = u32;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<u32, WorkflowError> {
        let n: u32 = ctx.wait_signal("go").await?;
        Ok(n)
    }
}

/// Longest a call may take to be answered while the store is stopped.
const ANSWER_WAIT: Duration = Duration::from_secs(5);

fn unavailable(e: &EngineError) -> bool {
    matches!(e, EngineError::StoreUnavailable(why) if why.contains("no space"))
}

async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + ANSWER_WAIT;
    while !done() {
        assert!(Instant::now() < deadline, "{what} did not happen in time");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// An engine on an in-memory store whose writes the test stops.
fn engine_on_mem_store() -> anyhow::Result<(Arc<MemStore>, Engine)> {
    let store = Arc::new(MemStore::new(Durability::Sync));
    let engine = Engine::builder()
        .store(store.clone())
        .register_workflow::<Waits>()
        .build()?;
    Ok((store, engine))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_store_answers_clients_at_once_and_work_resumes_with_it() -> anyhow::Result<()> {
    let (store, engine) = engine_on_mem_store()?;
    let c = engine.client();
    for i in 0..4 {
        c.start::<Waits>(&format!("w{i}"), &()).await?;
    }
    // One signal goes through before the disk fills: it must survive.
    c.signal("w0", "go", &10u32, None).await?;
    assert_eq!(c.result::<Waits>("w0").await?, 10);

    let waiting = {
        let c = c.clone();
        tokio::spawn(async move { c.result::<Waits>("w1").await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    store.stop_writes(WriteFault::NoSpace, "No space left on device", false);
    wait_for("the engine reporting the stop", || {
        matches!(engine.health(), StoreHealth::Stopped { .. })
    })
    .await;

    // The waiting result call is answered, not left hanging.
    let answered = tokio::time::timeout(ANSWER_WAIT, waiting).await??;
    match answered {
        Err(e) => assert!(unavailable(&e), "{e}"),
        Ok(v) => panic!("w1 finished without its signal: {v}"),
    }
    // Calls that need a commit fail fast with the cause.
    let t = Instant::now();
    let e = c.signal("w1", "go", &1u32, None).await.unwrap_err();
    assert!(unavailable(&e), "{e}");
    let e = c.start::<Waits>("w9", &()).await.unwrap_err();
    assert!(unavailable(&e), "{e}");
    let e = c.cancel("w2", "stop").await.unwrap_err();
    assert!(unavailable(&e), "{e}");
    assert!(t.elapsed() < ANSWER_WAIT, "refusals took {:?}", t.elapsed());
    // Reads still work and say why nothing moves.
    let d = c.describe("w2").await?;
    assert_eq!(d.status, RunStatus::Running);
    assert!(!d.store_health.is_healthy(), "{:?}", d.store_health);
    assert_eq!(c.result::<Waits>("w0").await?, 10, "a closed run's result");

    // Space is freed: the engine goes on by itself.
    store.resume_writes();
    wait_for("the engine reporting the resume", || {
        engine.health().is_healthy()
    })
    .await;
    let mut ok = false;
    for _ in 0..50 {
        match c.signal("w1", "go", &11u32, None).await {
            Ok(()) => {
                ok = true;
                break;
            }
            Err(e) if unavailable(&e) => tokio::time::sleep(Duration::from_millis(20)).await,
            Err(e) => return Err(e.into()),
        }
    }
    assert!(ok, "signals were refused after the store resumed");
    for (i, n) in [(2, 12u32), (3, 13)] {
        c.signal(&format!("w{i}"), "go", &n, None).await?;
    }
    for (i, n) in [(0, 10u32), (1, 11), (2, 12), (3, 13)] {
        assert_eq!(c.result::<Waits>(&format!("w{i}")).await?, n, "w{i}");
    }
    engine.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_fails_for_good_stops_the_engine_with_its_cause() -> anyhow::Result<()> {
    let (store, engine) = engine_on_mem_store()?;
    let c = engine.client();
    c.start::<Waits>("x", &()).await?;
    let waiting = {
        let c = c.clone();
        tokio::spawn(async move { c.result::<Waits>("x").await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    store.stop_writes(
        WriteFault::Corruption,
        "Corruption: block checksum mismatch in 000042.sst",
        true,
    );
    wait_for("the engine reporting the failure", || {
        engine.health().is_failed()
    })
    .await;
    let answered = tokio::time::timeout(ANSWER_WAIT, waiting).await??;
    let e = answered.unwrap_err();
    assert!(
        matches!(&e, EngineError::StoreUnavailable(why) if why.contains("000042.sst")),
        "{e}"
    );
    let e = c.describe("x").await.unwrap_err();
    assert!(matches!(e, EngineError::StoreUnavailable(_)), "{e}");
    engine.shutdown().await;
    Ok(())
}
