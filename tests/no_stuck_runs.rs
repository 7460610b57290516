//! Goal: every input ends committed, dropped as a duplicate, or with its
//! run parked and the reason in `describe`; nothing waits forever. Each
//! test is a case an earlier build got stuck on: an activity result over
//! the payload limit (retried forever), a parked run that only a later
//! input or a restart could move (now `resume`), code that issues a
//! command past the end of its history (looped on a seq gap), a shutdown
//! that left `result()` waiting and the data directory locked while a
//! `Client` lived.
//! Method: the real engine, RocksDB in a temp dir where the directory
//! matters; the resume tests flip what the code does between activations.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use keel::storage::{RocksStore, Store};
use keel::{
    Activity, ActivityContext, ActivityError, Durability, Engine, EngineError, FailureKind,
    RetryPolicy, RunStatus, Workflow, WorkflowContext, WorkflowError,
};

static BIG_ATTEMPTS: AtomicU32 = AtomicU32::new(0);

/// Returns a result over the 1 MiB payload limit.
#[derive(Default)]
struct Huge;
impl Activity for Huge {
    const NAME: &'static str = "huge";
    type Input = ();
    type Output = String;
    async fn run(&self, _ctx: ActivityContext, _: ()) -> Result<String, ActivityError> {
        BIG_ATTEMPTS.fetch_add(1, Ordering::SeqCst);
        Ok("x".repeat(2 << 20))
    }
}

struct WantsHuge;
impl Workflow for WantsHuge {
    const NAME: &'static str = "wants-huge";
    type Input = ();
    type Output = String;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<String, WorkflowError> {
        match ctx
            .activity::<Huge>(())
            .retry(RetryPolicy::constant(5, Duration::from_millis(5)))
            .await
        {
            Ok(s) => Ok(format!("{} bytes", s.len())),
            Err(f) => Ok(format!("{:?}: {}", f.kind, f.retryable)),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_activity_result_fails_the_attempt_for_good() -> anyhow::Result<()> {
    let engine = Engine::builder()
        .in_memory()
        .register_workflow::<WantsHuge>()
        .register_activity::<Huge>()
        .build()?;
    let c = engine.client();
    BIG_ATTEMPTS.store(0, Ordering::SeqCst);
    c.start::<WantsHuge>("h", &()).await?;
    assert_eq!(c.result::<WantsHuge>("h").await?, "PayloadTooLarge: false");
    assert_eq!(BIG_ATTEMPTS.load(Ordering::SeqCst), 1, "not retried");
    let _ = FailureKind::PayloadTooLarge;
    Ok(())
}

/// Whether [`Flip`]'s code is broken: it panics on its first signal.
static BROKEN: AtomicBool = AtomicBool::new(false);

struct Flip;
impl Workflow for Flip {
    const NAME: &'static str = "flip";
    type Input = ();
    type Output = String;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<String, WorkflowError> {
        let a: u32 = ctx.wait_signal("go").await?;
        if BROKEN.load(Ordering::SeqCst) {
            panic!("a bug in step two");
        }
        let b: u32 = ctx.wait_signal("go").await?;
        Ok(format!("went {a} and {b}"))
    }
}

fn flip_engine(dir: &std::path::Path) -> Engine {
    Engine::builder()
        .data_dir(dir)
        .register_workflow::<Flip>()
        .build()
        .expect("engine starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_run_is_resumed_on_request_once_the_code_fits() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    BROKEN.store(false, Ordering::SeqCst);
    {
        let engine = flip_engine(dir.path());
        let c = engine.client();
        c.start::<Flip>("f", &()).await?;
        c.signal("f", "go", &7u32, Some("go-1")).await?;
        engine.shutdown().await;
    }
    // A build whose code panics where the history has a signal: the
    // replay parks the run.
    BROKEN.store(true, Ordering::SeqCst);
    let engine = flip_engine(dir.path());
    let c = engine.client();
    let err = c.signal("f", "go", &8u32, Some("go-2")).await.unwrap_err();
    assert!(matches!(err, EngineError::Parked { .. }), "{err}");
    let d = c.describe("f").await?;
    assert_eq!(d.status, RunStatus::Running);
    assert_eq!(d.parked.as_ref().map(|p| p.kind.as_str()), Some("panic"));
    // Still broken: resume says so, and the run stays parked.
    let r = c.resume("f").await?;
    assert!(r.was_parked && !r.fits, "{r:?}");
    assert!(
        r.reason
            .as_deref()
            .unwrap_or("")
            .contains("a bug in step two"),
        "{r:?}"
    );
    // Fixed (in this process): resume replays it, clears the marker; the
    // next signal goes in.
    BROKEN.store(false, Ordering::SeqCst);
    let r = c.resume("f").await?;
    assert!(r.was_parked && r.fits, "{r:?}");
    assert!(c.describe("f").await?.parked.is_none());
    c.signal("f", "go", &8u32, Some("go-2")).await?;
    assert_eq!(c.result::<Flip>("f").await?, "went 7 and 8");
    // Resuming a run that is not parked is a no-op that says so.
    let r = c.resume("f").await?;
    assert!(!r.was_parked && r.fits, "{r:?}");
    Ok(())
}

/// Version 1 waits for a signal, then completes.
struct OneStep;
impl Workflow for OneStep {
    const NAME: &'static str = "one-step";
    type Input = ();
    type Output = u32;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<u32, WorkflowError> {
        Ok(ctx.wait_signal::<u32>("n").await?)
    }
}

/// Version 2 of the same type starts a timer first: a command its
/// history, which ends at the start, never recorded.
struct OneStepV2;
impl Workflow for OneStepV2 {
    const NAME: &'static str = "one-step";
    type Input = ();
    type Output = u32;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<u32, WorkflowError> {
        ctx.timer(Duration::from_millis(1)).await;
        Ok(ctx.wait_signal::<u32>("n").await?)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn code_that_issues_past_the_end_of_its_history_parks_then_resumes() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    {
        let engine = Engine::builder()
            .data_dir(dir.path())
            .register_workflow::<OneStep>()
            .build()?;
        engine.client().start::<OneStep>("o", &()).await?;
        engine.shutdown().await;
    }
    {
        let engine = Engine::builder()
            .data_dir(dir.path())
            .register_workflow::<OneStepV2>()
            .build()?;
        let c = engine.client();
        let err = c.signal("o", "n", &5u32, Some("n-1")).await.unwrap_err();
        let EngineError::Parked { reason, .. } = err else {
            panic!("expected parked, got {err}")
        };
        assert!(reason.contains("end of the history"), "{reason}");
        assert!(reason.contains("start timer"), "{reason}");
        engine.shutdown().await;
    }
    let engine = Engine::builder()
        .data_dir(dir.path())
        .register_workflow::<OneStep>()
        .build()?;
    let c = engine.client();
    let r = c.resume("o").await?;
    assert!(r.was_parked && r.fits, "{r:?}");
    c.signal("o", "n", &5u32, Some("n-2")).await?;
    assert_eq!(c.result::<OneStep>("o").await?, 5);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_waiting_results_and_frees_the_directory() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let engine = Engine::builder()
        .data_dir(dir.path())
        .register_workflow::<OneStep>()
        .build()?;
    let client = engine.client();
    client.start::<OneStep>("w", &()).await?;
    let waiting = {
        let c = client.clone();
        tokio::spawn(async move { c.result::<OneStep>("w").await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    engine.shutdown().await;
    let err = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("result() returns once the engine stops")?
        .unwrap_err();
    assert!(matches!(err, EngineError::Shutdown), "{err}");
    // A client still alive holds nothing: the directory opens again.
    let again = client.signal("w", "n", &1u32, None).await.unwrap_err();
    assert!(matches!(again, EngineError::Shutdown), "{again}");
    let store = RocksStore::open(dir.path(), Durability::Sync)?;
    assert!(store.verify()?.ok);
    drop(client);
    Ok(())
}

static BROKEN_LIVE: AtomicBool = AtomicBool::new(false);

/// [`Flip`] with its own flag, so this file's tests do not share one.
struct FlipLive;
impl Workflow for FlipLive {
    const NAME: &'static str = "flip-live";
    type Input = ();
    type Output = String;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<String, WorkflowError> {
        let a: u32 = ctx.wait_signal("go").await?;
        if BROKEN_LIVE.load(Ordering::SeqCst) {
            panic!("a bug in step two");
        }
        let b: u32 = ctx.wait_signal("go").await?;
        Ok(format!("went {a} and {b}"))
    }
}

/// Goal: a run parked by a panic while the engine runs it (not at a
/// replay after a restart) refuses the input that hit the bug, writing
/// nothing; resumed in the same engine once the code is fixed, it takes
/// that input again (the client's retry, same command id) and the next,
/// and completes. Method: the flag breaks the code before the first
/// signal; that signal must be refused as parked and absent from the
/// history; `resume` with the flag cleared must report a fit; the retried
/// and the second signal must complete the run with both values.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_parked_live_refuses_the_input_that_hit_the_bug_and_takes_it_once_resumed(
) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let engine = Engine::builder()
        .data_dir(dir.path())
        .register_workflow::<FlipLive>()
        .build()?;
    let c = engine.client();
    c.start::<FlipLive>("fl", &()).await?;
    BROKEN_LIVE.store(true, Ordering::SeqCst);
    let err = c.signal("fl", "go", &1u32, Some("go-1")).await.unwrap_err();
    assert!(matches!(err, EngineError::Parked { .. }), "{err}");
    let d = c.describe("fl").await?;
    assert_eq!(d.parked.as_ref().map(|p| p.kind.as_str()), Some("panic"));
    assert_eq!(d.history_len, 1, "the refused signal wrote nothing: {d:?}");
    BROKEN_LIVE.store(false, Ordering::SeqCst);
    let r = c.resume("fl").await?;
    assert!(r.was_parked && r.fits, "{r:?}");
    c.signal("fl", "go", &1u32, Some("go-1")).await?;
    c.signal("fl", "go", &2u32, Some("go-2")).await?;
    let out = tokio::time::timeout(Duration::from_secs(20), c.result::<FlipLive>("fl")).await;
    let d = c.describe("fl").await?;
    assert_eq!(
        out.ok().and_then(Result::ok).as_deref(),
        Some("went 1 and 2"),
        "{d:?}"
    );
    engine.shutdown().await;
    Ok(())
}
