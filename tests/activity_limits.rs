//! Goal: an activity's limits hold on the real engine: start-to-close,
//! schedule-to-start and heartbeat timeouts; a missed heartbeat redelivers
//! the same attempt a bounded number of times while the stale copy is asked
//! to stop; heartbeat details reach the next delivery and the next attempt,
//! across a restart; a resilience profile named on a call applies all of
//! its policies (attempt timeout, retry, classifier, fallback), with the
//! retry still durable.
//! Method: activities that sleep, go silent or fail on purpose and count
//! what they see, with limits of tens of milliseconds.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use keel::resilience::{AttemptTimeoutRequirement, BackoffMode, Builder, Classifier, JitterMode};
use keel::storage::EventKind;
use keel::{
    Activity, ActivityContext, ActivityError, Engine, EngineConfig, Failure, FailureKind,
    RetryPolicy, Workflow, WorkflowContext, WorkflowError,
};

fn kind_of(r: Result<u32, Failure>) -> String {
    match r {
        Ok(v) => format!("ok {v}"),
        Err(f) => format!("{:?}", f.kind),
    }
}

static SLEEPER_STOPS: AtomicU32 = AtomicU32::new(0);
static SLEEPER_STARTS: AtomicU32 = AtomicU32::new(0);

/// Runs until asked to stop, and counts that it was.
#[derive(Default)]
struct Sleeper;
impl Activity for Sleeper {
    const NAME: &'static str = "sleeper";
    type Input = ();
    type Output = u32;
    async fn run(&self, ctx: ActivityContext, _: ()) -> Result<u32, ActivityError> {
        SLEEPER_STARTS.fetch_add(1, Ordering::SeqCst);
        ctx.cancelled().await;
        SLEEPER_STOPS.fetch_add(1, Ordering::SeqCst);
        Err(ActivityError::retryable("stopped"))
    }
}

struct SlowCall;
impl Workflow for SlowCall {
    const NAME: &'static str = "slow-call";
    type Input = ();
    type Output = String;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<String, WorkflowError> {
        let r = ctx
            .activity::<Sleeper>(())
            .start_to_close(Duration::from_millis(100))
            .retry(RetryPolicy::constant(2, Duration::from_millis(10)))
            .await;
        Ok(kind_of(r))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_to_close_fails_the_attempt_and_stops_its_copy() -> anyhow::Result<()> {
    SLEEPER_STOPS.store(0, Ordering::SeqCst);
    SLEEPER_STARTS.store(0, Ordering::SeqCst);
    let engine = Engine::builder()
        .in_memory()
        .register_workflow::<SlowCall>()
        .register_activity::<Sleeper>()
        .build()?;
    let c = engine.client();
    c.start::<SlowCall>("s", &()).await?;
    assert_eq!(c.result::<SlowCall>("s").await?, "Timeout");
    assert_eq!(SLEEPER_STARTS.load(Ordering::SeqCst), 2, "two attempts");
    for _ in 0..100 {
        if SLEEPER_STOPS.load(Ordering::SeqCst) == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        SLEEPER_STOPS.load(Ordering::SeqCst),
        2,
        "each copy was asked to stop"
    );
    Ok(())
}

static SILENT_LIVE: AtomicU32 = AtomicU32::new(0);
static SILENT_LIVE_MAX: AtomicU32 = AtomicU32::new(0);
static SILENT_DELIVERIES: AtomicU32 = AtomicU32::new(0);
static SILENT_ATTEMPTS_SEEN: AtomicU32 = AtomicU32::new(0);

/// Heartbeats once, then goes silent until asked to stop. Counts the
/// copies alive at once (a stopped copy ends at once).
#[derive(Default)]
struct Silent;
impl Activity for Silent {
    const NAME: &'static str = "silent";
    type Input = ();
    type Output = u32;
    async fn run(&self, ctx: ActivityContext, _: ()) -> Result<u32, ActivityError> {
        SILENT_DELIVERIES.fetch_add(1, Ordering::SeqCst);
        SILENT_ATTEMPTS_SEEN.fetch_max(ctx.attempt().0, Ordering::SeqCst);
        let live = SILENT_LIVE.fetch_add(1, Ordering::SeqCst) + 1;
        SILENT_LIVE_MAX.fetch_max(live, Ordering::SeqCst);
        ctx.heartbeat();
        ctx.cancelled().await;
        SILENT_LIVE.fetch_sub(1, Ordering::SeqCst);
        Err(ActivityError::retryable("stopped"))
    }
}

struct SilentCall;
impl Workflow for SilentCall {
    const NAME: &'static str = "silent-call";
    type Input = ();
    type Output = String;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<String, WorkflowError> {
        let r = ctx
            .activity::<Silent>(())
            .heartbeat_timeout(Duration::from_millis(60))
            .await;
        Ok(kind_of(r))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missed_heartbeat_redelivers_the_same_attempt_a_bounded_number_of_times(
) -> anyhow::Result<()> {
    let engine = Engine::builder()
        .in_memory()
        .register_workflow::<SilentCall>()
        .register_activity::<Silent>()
        .build()?;
    let c = engine.client();
    c.start::<SilentCall>("q", &()).await?;
    assert_eq!(c.result::<SilentCall>("q").await?, "LeaseExpired");
    assert_eq!(
        SILENT_DELIVERIES.load(Ordering::SeqCst),
        1 + keel::driver::LEASE_REDELIVERIES_MAX,
        "the first delivery and the bounded redeliveries"
    );
    assert_eq!(
        SILENT_ATTEMPTS_SEEN.load(Ordering::SeqCst),
        1,
        "all of the same attempt"
    );
    assert!(
        SILENT_LIVE_MAX.load(Ordering::SeqCst) <= 2,
        "a stale copy is stopped as its replacement starts, not left running: {} at once",
        SILENT_LIVE_MAX.load(Ordering::SeqCst)
    );
    Ok(())
}

static PROGRESS_SEEN: AtomicU32 = AtomicU32::new(0);

/// Attempt 1 reports progress 41 and fails; later attempts start from the
/// progress they are handed.
#[derive(Default)]
struct Resumable;
impl Activity for Resumable {
    const NAME: &'static str = "resumable";
    type Input = ();
    type Output = u32;
    async fn run(&self, ctx: ActivityContext, _: ()) -> Result<u32, ActivityError> {
        if ctx.attempt().0 == 1 {
            ctx.heartbeat_with(&41u32);
            return Err(ActivityError::retryable("interrupted at row 41"));
        }
        let from: u32 = ctx.heartbeat_details().unwrap_or(0);
        PROGRESS_SEEN.store(from, Ordering::SeqCst);
        Ok(from + 1)
    }
}

struct ResumableCall;
impl Workflow for ResumableCall {
    const NAME: &'static str = "resumable-call";
    type Input = ();
    type Output = u32;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<u32, WorkflowError> {
        Ok(ctx
            .activity::<Resumable>(())
            .retry(RetryPolicy::constant(3, Duration::from_millis(400)))
            .await?)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_details_reach_the_next_attempt_across_a_restart() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let build = || {
        Engine::builder()
            .data_dir(dir.path())
            .register_workflow::<ResumableCall>()
            .register_activity::<Resumable>()
            .build()
    };
    {
        let engine = build()?;
        let run = engine
            .client()
            .start::<ResumableCall>("r", &())
            .await?
            .run_id();
        let store = engine.store();
        // Stop once the failed attempt (with its details) is committed,
        // inside its 400 ms backoff.
        for _ in 0..200 {
            if store.history(run)?.iter().any(|e| {
                matches!(
                    e.kind,
                    EventKind::ActivityAttemptFailed {
                        heartbeat: Some(_),
                        ..
                    }
                )
            }) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        engine.shutdown().await;
    }
    let engine = build()?;
    assert_eq!(engine.client().result::<ResumableCall>("r").await?, 42);
    assert_eq!(PROGRESS_SEEN.load(Ordering::SeqCst), 41);
    Ok(())
}

/// Holds a worker slot for half a second.
#[derive(Default)]
struct Hog;
impl Activity for Hog {
    const NAME: &'static str = "hog";
    type Input = ();
    type Output = u32;
    async fn run(&self, _ctx: ActivityContext, _: ()) -> Result<u32, ActivityError> {
        tokio::time::sleep(Duration::from_millis(500)).await;
        Ok(1)
    }
}

#[derive(Default)]
struct Quick;
impl Activity for Quick {
    const NAME: &'static str = "quick";
    type Input = ();
    type Output = u32;
    async fn run(&self, _ctx: ActivityContext, _: ()) -> Result<u32, ActivityError> {
        Ok(2)
    }
}

struct Crowded;
impl Workflow for Crowded {
    const NAME: &'static str = "crowded";
    type Input = ();
    type Output = String;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<String, WorkflowError> {
        let hog = ctx.activity::<Hog>(());
        let late = ctx
            .activity::<Quick>(())
            .schedule_to_start(Duration::from_millis(50));
        let (a, b) = (hog, late);
        let s = ctx.select().branch("hog", a).branch("late", b).await?;
        Ok(format!("{}: {}", s.key, kind_of(s.result::<u32>())))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schedule_to_start_fails_an_attempt_left_waiting_for_a_worker() -> anyhow::Result<()> {
    let engine = Engine::builder()
        .in_memory()
        .config(EngineConfig {
            shards: 1,
            worker_concurrency_max: 1,
            ..EngineConfig::default()
        })
        .register_workflow::<Crowded>()
        .register_activity::<Hog>()
        .register_activity::<Quick>()
        .build()?;
    let c = engine.client();
    c.start::<Crowded>("c", &()).await?;
    assert_eq!(c.result::<Crowded>("c").await?, "late: Timeout");
    Ok(())
}

static FLAKY_ATTEMPTS: AtomicU32 = AtomicU32::new(0);

/// Attempt 1 hangs past the profile's attempt timeout; the others fail
/// with a retryable error. Its fallback gives "fallback".
#[derive(Default)]
struct Dependency;
impl Activity for Dependency {
    const NAME: &'static str = "dependency";
    type Input = ();
    type Output = String;
    async fn run(&self, ctx: ActivityContext, _: ()) -> Result<String, ActivityError> {
        FLAKY_ATTEMPTS.fetch_add(1, Ordering::SeqCst);
        if ctx.attempt().0 == 1 {
            ctx.cancelled().await;
        }
        Err(ActivityError::retryable("dependency down"))
    }

    fn fallback(&self, _: (), failure: &Failure) -> Option<Result<String, ActivityError>> {
        Some(Ok(format!("fallback after {:?}", failure.kind)))
    }
}

struct Guarded;
impl Workflow for Guarded {
    const NAME: &'static str = "guarded";
    type Input = ();
    type Output = String;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<String, WorkflowError> {
        Ok(ctx.activity::<Dependency>(()).profile("dep").await?)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_profile_applies_its_timeout_retry_classifier_and_fallback() -> anyhow::Result<()> {
    let classifier = Classifier::<Failure>::new()
        .retry_on(|f: &Failure| f.retryable)
        .retry_on_attempt_timeout()
        .fallback_on(|f: &Failure| f.kind == FailureKind::Application);
    let pipeline = Builder::profile("dep", "v1")
        .partition("tests", "local", "dependency")
        .attempt_timeout(
            Duration::from_millis(100),
            AttemptTimeoutRequirement::Cooperative,
        )
        .retry(
            3,
            BackoffMode::Constant,
            Duration::from_millis(10),
            Duration::from_millis(10),
            JitterMode::None,
        )
        .fallback()
        .compile_in_memory(classifier)?;
    let engine = Engine::builder()
        .in_memory()
        .resilience_profile("dep", pipeline)
        .register_workflow::<Guarded>()
        .register_activity::<Dependency>()
        .build()?;
    let c = engine.client();
    let run = c.start::<Guarded>("g", &()).await?.run_id();
    assert_eq!(
        c.result::<Guarded>("g").await?,
        "fallback after Application"
    );
    assert_eq!(
        FLAKY_ATTEMPTS.load(Ordering::SeqCst),
        3,
        "the profile's three attempts"
    );
    let history = engine.store().history(run)?;
    let failures: Vec<_> = history
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::ActivityAttemptFailed {
                failure, retry_at, ..
            } => Some((failure.kind, retry_at.is_some())),
            _ => None,
        })
        .collect();
    // The first attempt timed out (the profile's attempt timeout), the
    // second failed; both were retried durably (a retry time in history).
    assert_eq!(
        failures,
        vec![
            (FailureKind::Timeout, true),
            (FailureKind::Application, true)
        ]
    );
    Ok(())
}

/// Returns its input.
#[derive(Default)]
struct Echo;
impl Activity for Echo {
    const NAME: &'static str = "echo";
    type Input = u32;
    type Output = u32;
    async fn run(&self, _: ActivityContext, i: u32) -> Result<u32, ActivityError> {
        Ok(i)
    }
}

/// Calls `Echo` n times, 100 at a time.
struct ManyCalls;
impl Workflow for ManyCalls {
    const NAME: &'static str = "many-calls";
    type Input = u32;
    type Output = u32;
    async fn run(ctx: WorkflowContext, n: u32) -> Result<u32, WorkflowError> {
        ctx.for_each_limited(100, (0..n).map(|i| ctx.activity::<Echo>(i)))
            .await?;
        Ok(n)
    }
}

// Goal: attempts that finished leave nothing behind in their shard's
// queue of later checks: its size follows what is live, not the attempts
// finished within the last lease's length (60 s by default), which at
// thousands of attempts a second grew memory by tens of MiB.
// Method: three times `DUE_SWEEP_ENTRIES_MIN` attempts finish well within
// one lease; afterwards the engine's count of due entries is at most one
// sweep's threshold (the run's shard) plus a few per shard, where keeping
// every lease check until it came due would hold one per attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_attempts_leave_no_lease_checks_behind() -> anyhow::Result<()> {
    let n = 3 * keel::driver::DUE_SWEEP_ENTRIES_MIN as u32;
    let engine = Engine::builder()
        .in_memory()
        .register_workflow::<ManyCalls>()
        .register_activity::<Echo>()
        .build()?;
    let c = engine.client();
    c.start::<ManyCalls>("many", &n).await?;
    assert_eq!(c.result::<ManyCalls>("many").await?, n);
    let stats = engine.stats().await;
    let bound = keel::driver::DUE_SWEEP_ENTRIES_MIN as u64 + 16 * stats.shards_owned;
    assert!(
        stats.shards.due_entries <= bound,
        "{} due entries after {n} attempts (bound {bound})",
        stats.shards.due_entries
    );
    Ok(())
}
