//! Goal: an activity that declares itself `NON_BLOCKING` starts on the
//! thread of the shard that dispatched it, inside the activity pool's
//! runtime context, and moves to the pool at its first wait; one without
//! the declaration starts on the pool; either way each execution commits
//! exactly one result. A panic in that first poll is not the shard's end:
//! in the body it is an attempt's retryable failure, and around the body
//! (a profile's classifier) it drops the copy, which its lease's end
//! redelivers.
//! Method: activities note the thread they run on (its name) and the
//! runtime their code sees (the pool is multi-threaded, a shard's arbiter is
//! not) before and after a short sleep; a workflow calls each, and the
//! history is counted. A profile whose classifier panics once, with a short
//! attempt timeout (the copy's lease). The RocksDB store, as users run it.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use keel::resilience::{AttemptTimeoutRequirement, BackoffMode, Builder, Classifier, JitterMode};
use keel::storage::EventKind;
use keel::{
    Activity, ActivityContext, ActivityError, Engine, Failure, FailureKind, RetryPolicy, Workflow,
    WorkflowContext, WorkflowError,
};
use tokio::runtime::{Handle, RuntimeFlavor};

/// Where a piece of activity code ran.
#[derive(Clone, Debug, PartialEq)]
struct Place {
    thread: String,
    pool_context: bool,
}

fn here() -> Place {
    Place {
        thread: std::thread::current().name().unwrap_or("").to_string(),
        pool_context: Handle::current().runtime_flavor() == RuntimeFlavor::MultiThread,
    }
}

fn on_pool(p: &Place) -> bool {
    p.thread == "keel-activity" && p.pool_context
}

fn on_shard_in_pool_context(p: &Place) -> bool {
    p.thread.contains("arbiter") && p.pool_context
}

static PLACES: Mutex<Vec<(&'static str, Place)>> = Mutex::new(Vec::new());

fn note(what: &'static str) {
    PLACES.lock().unwrap().push((what, here()));
}

/// Finishes in its first poll.
#[derive(Default)]
struct Quick;
impl Activity for Quick {
    const NAME: &'static str = "nb.quick";
    type Input = u32;
    type Output = u32;
    const NON_BLOCKING: bool = true;
    async fn run(&self, _ctx: ActivityContext, i: u32) -> Result<u32, ActivityError> {
        note("quick");
        Ok(i + 1)
    }
}

/// Waits once: starts on the shard, finishes on the pool.
#[derive(Default)]
struct Waits;
impl Activity for Waits {
    const NAME: &'static str = "nb.waits";
    type Input = u32;
    type Output = u32;
    const NON_BLOCKING: bool = true;
    async fn run(&self, _ctx: ActivityContext, i: u32) -> Result<u32, ActivityError> {
        note("waits before");
        tokio::time::sleep(Duration::from_millis(5)).await;
        note("waits after");
        Ok(i * 10)
    }
}

/// No declaration: starts on the pool.
#[derive(Default)]
struct Plain;
impl Activity for Plain {
    const NAME: &'static str = "nb.plain";
    type Input = u32;
    type Output = u32;
    async fn run(&self, _ctx: ActivityContext, i: u32) -> Result<u32, ActivityError> {
        note("plain");
        Ok(i + 100)
    }
}

static PANICS_LEFT: AtomicU32 = AtomicU32::new(1);

/// Panics in its first attempt's first poll, then succeeds.
#[derive(Default)]
struct PanicsOnce;
impl Activity for PanicsOnce {
    const NAME: &'static str = "nb.panics-once";
    type Input = u32;
    type Output = u32;
    const NON_BLOCKING: bool = true;
    async fn run(&self, _ctx: ActivityContext, i: u32) -> Result<u32, ActivityError> {
        if PANICS_LEFT
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            panic!("first poll panics");
        }
        Ok(i + 1000)
    }
}

struct Mixed;
impl Workflow for Mixed {
    const NAME: &'static str = "nb.mixed";
    type Input = u32;
    type Output = (u32, u32, u32, u32);
    async fn run(ctx: WorkflowContext, i: u32) -> Result<Self::Output, WorkflowError> {
        let a = ctx.activity::<Quick>(i).await?;
        let b = ctx.activity::<Waits>(a).await?;
        let c = ctx.activity::<Plain>(b).await?;
        let d = ctx
            .activity::<PanicsOnce>(c)
            .retry(RetryPolicy::constant(3, Duration::from_millis(10)))
            .await?;
        Ok((a, b, c, d))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_blocking_activities_start_on_their_shard_and_wait_on_the_pool() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let engine = Engine::builder()
        .data_dir(dir.path())
        .register_workflow::<Mixed>()
        .register_activity::<Quick>()
        .register_activity::<Waits>()
        .register_activity::<Plain>()
        .register_activity::<PanicsOnce>()
        .build()?;
    let client = engine.client();
    let run = client.start::<Mixed>("mixed", &1).await?.run_id();
    let out =
        tokio::time::timeout(Duration::from_secs(30), client.result::<Mixed>("mixed")).await??;
    assert_eq!(out, (2, 20, 120, 1120));

    let places = PLACES.lock().unwrap().clone();
    let of = |what: &str| -> Vec<Place> {
        places
            .iter()
            .filter(|(w, _)| *w == what)
            .map(|(_, p)| p.clone())
            .collect()
    };
    let (quick, before, after, plain) = (
        of("quick"),
        of("waits before"),
        of("waits after"),
        of("plain"),
    );
    assert_eq!(quick.len(), 1, "{places:?}");
    assert_eq!(before.len(), 1, "{places:?}");
    assert_eq!(after.len(), 1, "{places:?}");
    assert_eq!(plain.len(), 1, "{places:?}");
    assert!(on_shard_in_pool_context(&quick[0]), "{quick:?}");
    assert!(on_shard_in_pool_context(&before[0]), "{before:?}");
    assert!(on_pool(&after[0]), "{after:?}");
    assert!(on_pool(&plain[0]), "{plain:?}");

    // One result per execution; the panic was one retried attempt.
    let history = engine.store().history(run)?;
    let completed = history
        .iter()
        .filter(|e| matches!(e.kind, EventKind::ActivityCompleted { .. }))
        .count();
    let failed: Vec<_> = history
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::ActivityAttemptFailed {
                failure, retry_at, ..
            } => Some((failure.message.clone(), retry_at.is_some())),
            _ => None,
        })
        .collect();
    assert_eq!(completed, 4);
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert!(failed[0].0.contains("first poll panics"), "{failed:?}");
    assert!(failed[0].1, "the panic is retried");
    engine.shutdown().await;
    Ok(())
}

static FAILS_LEFT: AtomicU32 = AtomicU32::new(1);
static CLASSIFIER_PANICS_LEFT: AtomicU32 = AtomicU32::new(1);
static GUARDED_CALLS: AtomicU32 = AtomicU32::new(0);

/// Fails its first call (which the profile's classifier then sees), and
/// succeeds after.
#[derive(Default)]
struct FailsOnce;
impl Activity for FailsOnce {
    const NAME: &'static str = "nb.fails-once";
    type Input = ();
    type Output = String;
    const NON_BLOCKING: bool = true;
    async fn run(&self, _ctx: ActivityContext, _: ()) -> Result<String, ActivityError> {
        GUARDED_CALLS.fetch_add(1, Ordering::SeqCst);
        if FAILS_LEFT
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(ActivityError::retryable("dependency down"));
        }
        Ok("done".into())
    }
}

struct Classified;
impl Workflow for Classified {
    const NAME: &'static str = "nb.classified";
    type Input = ();
    type Output = String;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<String, WorkflowError> {
        Ok(ctx.activity::<FailsOnce>(()).profile("panicky").await?)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_around_the_body_in_the_first_poll_is_redelivered_not_fatal() -> anyhow::Result<()>
{
    // The classifier runs in the attempt's first poll, on the shard's
    // thread, after the body failed and outside the body's own guard.
    let classifier = Classifier::<Failure>::new()
        .retry_on(|f: &Failure| {
            if CLASSIFIER_PANICS_LEFT
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                panic!("the classifier panics");
            }
            f.retryable
        })
        .retry_on_attempt_timeout();
    let pipeline = Builder::profile("panicky", "v1")
        .partition("tests", "local", "panicky")
        .attempt_timeout(
            Duration::from_millis(300),
            AttemptTimeoutRequirement::Cooperative,
        )
        .retry(
            3,
            BackoffMode::Constant,
            Duration::from_millis(10),
            Duration::from_millis(10),
            JitterMode::None,
        )
        .compile_in_memory(classifier)?;
    let dir = tempfile::tempdir()?;
    let engine = Engine::builder()
        .data_dir(dir.path())
        .resilience_profile("panicky", pipeline)
        .register_workflow::<Classified>()
        .register_activity::<FailsOnce>()
        .build()?;
    let client = engine.client();
    let run = client
        .start::<Classified>("classified", &())
        .await?
        .run_id();
    let out = tokio::time::timeout(
        Duration::from_secs(30),
        client.result::<Classified>("classified"),
    )
    .await??;
    assert_eq!(out, "done");
    assert_eq!(CLASSIFIER_PANICS_LEFT.load(Ordering::SeqCst), 0);
    // The panicked copy never reported: its lease (the attempt timeout)
    // ended, which is that attempt's timeout, and the profile's retry ran
    // the next attempt. One timeout and one result, nothing from the
    // copy that panicked.
    assert_eq!(GUARDED_CALLS.load(Ordering::SeqCst), 2);
    let history = engine.store().history(run)?;
    let failures: Vec<_> = history
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::ActivityAttemptFailed { failure, .. } => Some(failure.kind),
            _ => None,
        })
        .collect();
    assert_eq!(failures, vec![FailureKind::Timeout]);
    let completed = history
        .iter()
        .filter(|e| matches!(e.kind, EventKind::ActivityCompleted { .. }))
        .count();
    assert_eq!(completed, 1);
    engine.shutdown().await;
    Ok(())
}
