//! Goal: a restarted engine reads the pending attempts it must drive in
//! bounded windows, not all at once, and still drives every one of them:
//! queued attempts come in a window at a time as the ones before finish,
//! and an attempt waiting out a long retry backoff stays in the store
//! until shortly before it is due, then runs.
//! Method: the real engine on RocksDB in a temp dir. A first engine leaves
//! attempts pending (it runs one at a time and that one never ends, or the
//! first attempt fails into a long backoff) and stops; a second one, with
//! a window of two rows, reopens the directory while we sample how many
//! attempts it holds in memory, and every run must complete.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use keel::storage::EventKind;
use keel::{
    Activity, ActivityContext, ActivityError, Engine, EngineConfig, RetryPolicy, Workflow,
    WorkflowContext, WorkflowError,
};

/// The window of the reopened engine, rows.
const WINDOW_ROWS: usize = 2;

/// Runs whose attempts are left queued.
const QUEUED_RUNS: u32 = 40;

/// Whether `Work` stalls (the first engine) or takes a moment (the
/// reopened one).
static STALL: AtomicBool = AtomicBool::new(true);

/// Calls `Work` once (retried once, after `Input` ms when the first
/// attempt fails).
struct CallsWork;
impl Workflow for CallsWork {
    const NAME: &'static str = "calls-work";
    type Input = u64;
    type Output = u32;
    async fn run(ctx: WorkflowContext, backoff_ms: u64) -> Result<u32, WorkflowError> {
        let backoff = Duration::from_millis(backoff_ms);
        Ok(ctx
            .activity::<Work>(())
            .retry(RetryPolicy::exponential(2, backoff, backoff))
            .await?)
    }
}

/// Stalls forever while `STALL` is set; otherwise takes 30 ms (so that
/// attempts held at once are visible to sampling) and returns its attempt.
/// Its first attempt fails when it is not stalling in a run that asked for
/// a backoff (see the second test).
#[derive(Default)]
struct Work;
impl Activity for Work {
    const NAME: &'static str = "work";
    type Input = ();
    type Output = u32;
    async fn run(&self, ctx: ActivityContext, _: ()) -> Result<u32, ActivityError> {
        if STALL.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        if FAIL_FIRST.load(Ordering::SeqCst) && ctx.attempt().0 == 1 {
            return Err(ActivityError::retryable("the first attempt fails"));
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
        Ok(ctx.attempt().0)
    }
}

/// Whether first attempts fail (the second test).
static FAIL_FIRST: AtomicBool = AtomicBool::new(false);

fn engine(dir: &std::path::Path, worker_concurrency_max: usize) -> anyhow::Result<Engine> {
    Ok(Engine::builder()
        .data_dir(dir)
        .config(EngineConfig {
            shards: 1,
            worker_concurrency_max,
            intents_in_memory_max: WINDOW_ROWS,
            ..EngineConfig::default()
        })
        .register_workflow::<CallsWork>()
        .register_activity::<Work>()
        .build()?)
}

// The two cases share the activity's switches, so they run in sequence in
// one test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_attempts_come_back_in_windows() -> anyhow::Result<()> {
    queued_attempts_come_back_a_window_at_a_time().await?;
    an_attempt_in_a_long_backoff_waits_in_the_store_until_near_due().await
}

async fn queued_attempts_come_back_a_window_at_a_time() -> anyhow::Result<()> {
    STALL.store(true, Ordering::SeqCst);
    FAIL_FIRST.store(false, Ordering::SeqCst);
    let dir = tempfile::tempdir()?;
    {
        let engine = engine(dir.path(), 1)?;
        let c = engine.client();
        for i in 0..QUEUED_RUNS {
            c.start::<CallsWork>(&format!("q-{i}"), &1_000).await?;
        }
        // Every run's ActivityScheduled is committed (its task row is
        // durable) before the engine stops.
        let store = engine.store();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let scheduled = store.tasks(usize::MAX)?.len();
            if scheduled == QUEUED_RUNS as usize {
                break;
            }
            anyhow::ensure!(Instant::now() < deadline, "only {scheduled} tasks written");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        engine.shutdown().await;
    }

    STALL.store(false, Ordering::SeqCst);
    let engine = engine(dir.path(), 1024)?;
    let c = engine.client();
    // Describe shows every run's pending attempt, also those no window
    // has brought in yet (`stored`): a window of two cannot have reached
    // most of the forty while we ask.
    let mut stored = 0;
    for i in 0..QUEUED_RUNS {
        let d = c.describe(&format!("q-{i}")).await?;
        assert!(
            d.attempts.len() <= 1,
            "q-{i}: one execution, {:?}",
            d.attempts
        );
        if d.status.is_closed() {
            continue;
        }
        assert_eq!(d.attempts.len(), 1, "q-{i}: its attempt is shown");
        stored += usize::from(d.attempts[0].state == "stored");
    }
    assert!(stored > 0, "no attempt was shown as still in the store");
    let mut held_max = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let stats = engine.stats().await.shards;
        held_max = held_max.max(stats.attempts_supervised);
        if stats.attempts.get("completed").copied().unwrap_or(0) >= u64::from(QUEUED_RUNS) {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the queued attempts did not finish"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    for i in 0..QUEUED_RUNS {
        assert_eq!(c.result::<CallsWork>(&format!("q-{i}")).await?, 1);
    }
    assert!(held_max >= 1, "the sampling saw the attempts run");
    // A read is asked for only while fewer than a window of the rows
    // windows brought in are held, and brings at most a window.
    assert!(
        held_max <= (2 * WINDOW_ROWS) as u64,
        "held {held_max} attempts at once; a window is {WINDOW_ROWS}"
    );
    assert!(engine.store().tasks(usize::MAX)?.is_empty());
    engine.shutdown().await;
    Ok(())
}

async fn an_attempt_in_a_long_backoff_waits_in_the_store_until_near_due() -> anyhow::Result<()> {
    STALL.store(false, Ordering::SeqCst);
    FAIL_FIRST.store(true, Ordering::SeqCst);
    // Well past the lead with which windows take attempts (2 s), so the
    // reopened engine, open within a second or two, reads it past.
    let backoff_ms = 8_000;
    let dir = tempfile::tempdir()?;
    let failed_at = {
        let engine = engine(dir.path(), 8)?;
        let c = engine.client();
        let run = c.start::<CallsWork>("late", &backoff_ms).await?.run_id();
        let store = engine.store();
        let deadline = Instant::now() + Duration::from_secs(20);
        while !store
            .history(run)?
            .iter()
            .any(|e| matches!(e.kind, EventKind::ActivityAttemptFailed { .. }))
        {
            anyhow::ensure!(Instant::now() < deadline, "the first attempt never failed");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let failed_at = Instant::now();
        engine.shutdown().await;
        failed_at
    };
    let engine = engine(dir.path(), 8)?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let held = engine.stats().await.shards.attempts_supervised;
    // Only meaningful while the retry is still well beyond the lead (due
    // 8 s after the failure, taken 2 s before).
    if failed_at.elapsed() < Duration::from_millis(5_000) {
        assert_eq!(held, 0, "an attempt due in seconds is not read yet");
    }
    let c = engine.client();
    let result = tokio::time::timeout(Duration::from_secs(60), c.result::<CallsWork>("late"))
        .await
        .map_err(|_| anyhow::anyhow!("the retry never ran"))??;
    assert_eq!(result, 2, "the retry ran");
    assert!(engine.store().tasks(usize::MAX)?.is_empty());
    engine.shutdown().await;
    FAIL_FIRST.store(false, Ordering::SeqCst);
    Ok(())
}

/// How often `Count` ran.
static COUNTED: AtomicU32 = AtomicU32::new(0);
/// Whether `Count` stalls after counting (the first engine).
static COUNT_STALLS: AtomicBool = AtomicBool::new(true);

/// Counts its runs; stalls while `COUNT_STALLS` is set.
#[derive(Default)]
struct Count;
impl Activity for Count {
    const NAME: &'static str = "count";
    type Input = ();
    type Output = ();
    async fn run(&self, _ctx: ActivityContext, _: ()) -> Result<(), ActivityError> {
        COUNTED.fetch_add(1, Ordering::SeqCst);
        if COUNT_STALLS.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        Ok(())
    }
}

/// Calls `Count`, then waits for a signal.
struct CountsV1;
impl Workflow for CountsV1 {
    const NAME: &'static str = "counts";
    type Input = ();
    type Output = ();
    async fn run(ctx: WorkflowContext, _: ()) -> Result<(), WorkflowError> {
        ctx.activity::<Count>(()).await?;
        ctx.wait_signal::<()>("go").await?;
        Ok(())
    }
}

/// The same workflow changed incompatibly: a timer where `Count` was.
struct CountsV2;
impl Workflow for CountsV2 {
    const NAME: &'static str = "counts";
    type Input = ();
    type Output = ();
    async fn run(ctx: WorkflowContext, _: ()) -> Result<(), WorkflowError> {
        ctx.timer(Duration::from_millis(10)).await;
        ctx.wait_signal::<()>("go").await?;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_runs_attempt_is_not_dispatched_by_a_restart() -> anyhow::Result<()> {
    // Goal: the attempt a parked run left pending waits for the run's
    // resume; a restart's backlog does not run it again and again. Method:
    // v1 leaves its attempt pending; v2's restart runs it, its report
    // replays the run, which parks (the code changed); a second v2 restart
    // must not run it again.
    let dir = tempfile::tempdir()?;
    let build = |v2: bool| {
        let b = Engine::builder()
            .data_dir(dir.path())
            .register_activity::<Count>();
        if v2 {
            b.register_workflow::<CountsV2>().build()
        } else {
            b.register_workflow::<CountsV1>().build()
        }
    };
    let run = {
        let engine = build(false)?;
        let run = engine.client().start::<CountsV1>("p", &()).await?.run_id();
        let deadline = Instant::now() + Duration::from_secs(20);
        while COUNTED.load(Ordering::SeqCst) < 1 {
            anyhow::ensure!(Instant::now() < deadline, "the attempt never ran");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        engine.shutdown().await;
        run
    };
    COUNT_STALLS.store(false, Ordering::SeqCst);
    {
        let engine = build(true)?;
        let store = engine.store();
        let deadline = Instant::now() + Duration::from_secs(20);
        while store.parked(run)?.is_none() {
            anyhow::ensure!(Instant::now() < deadline, "the run never parked");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(
            COUNTED.load(Ordering::SeqCst),
            2,
            "run once more, then parked"
        );
        assert_eq!(store.tasks(usize::MAX)?.len(), 1, "its task row waits");
        engine.shutdown().await;
    }
    let engine = build(true)?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        COUNTED.load(Ordering::SeqCst),
        2,
        "a parked run's attempt is not dispatched at a restart"
    );
    assert!(engine.store().parked(run)?.is_some(), "still parked");
    // Describe still shows the attempt the parked run waits with.
    let d = engine.client().describe("p").await?;
    assert!(d.parked.is_some());
    assert_eq!(
        d.attempts.iter().map(|a| a.state).collect::<Vec<_>>(),
        ["stored"],
        "the parked run's attempt is shown from the store"
    );
    engine.shutdown().await;
    Ok(())
}
