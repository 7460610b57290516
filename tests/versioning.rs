//! Goal: new workflow code ships while runs of the old code are open
//! (issue "The rest of the workflow surface", item 5). A run that started
//! on the old code replays its old branch after the upgrade; a run started
//! on the new code takes the new branch and records a version marker, so it
//! keeps it on every replay; code that drops a branch an open run still
//! needs parks that run (never fails or rewrites it); `deprecate_patch`
//! and then removing the call replay histories that recorded the marker.
//!
//! Method: the real engine on RocksDB, stopped and reopened with another
//! build of the same workflow type (the same `NAME`) between every phase,
//! so each run is rebuilt from its committed history by the new code. The
//! workflow calls an activity, waits for a signal, and returns which
//! activities ran; the upgrade switches the first activity.

use std::path::Path;
use std::time::Duration;

use keel::{Activity, ActivityContext, ActivityError, Engine, EngineError, Workflow};
use keel::{WorkflowContext, WorkflowError};

/// The first step before the change.
#[derive(Default)]
struct Old;
impl Activity for Old {
    const NAME: &'static str = "old-step";
    type Input = ();
    type Output = String;
    async fn run(&self, _: ActivityContext, _: ()) -> Result<String, ActivityError> {
        Ok("old".into())
    }
}

/// The first step after the change.
#[derive(Default)]
struct New;
impl Activity for New {
    const NAME: &'static str = "new-step";
    type Input = ();
    type Output = String;
    async fn run(&self, _: ActivityContext, _: ()) -> Result<String, ActivityError> {
        Ok("new".into())
    }
}

async fn finish(ctx: &WorkflowContext, first: String) -> Result<String, WorkflowError> {
    let n: u32 = ctx.wait_signal("go").await?;
    Ok(format!("{first}+{n}"))
}

/// Version 1: only the old step.
struct V1;
impl Workflow for V1 {
    const NAME: &'static str = "upgraded";
    type Input = ();
    type Output = String;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<String, WorkflowError> {
        let first = ctx.activity::<Old>(()).await?;
        finish(&ctx, first).await
    }
}

/// Version 2: the change behind `patched`.
struct V2;
impl Workflow for V2 {
    const NAME: &'static str = "upgraded";
    type Input = ();
    type Output = String;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<String, WorkflowError> {
        let first = if ctx.patched("new-first-step") {
            ctx.activity::<New>(()).await?
        } else {
            ctx.activity::<Old>(()).await?
        };
        finish(&ctx, first).await
    }
}

/// Version 3: the old branch dropped while runs needing it may be open;
/// `version` says which versions this code supports.
struct V3;
impl Workflow for V3 {
    const NAME: &'static str = "upgraded";
    type Input = ();
    type Output = String;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<String, WorkflowError> {
        let v = ctx.version("new-first-step", 1, 1);
        assert_eq!(v, 1, "versions outside 1..=1 park before this");
        let first = ctx.activity::<New>(()).await?;
        finish(&ctx, first).await
    }
}

/// Version 4: the clean-up step.
struct V4;
impl Workflow for V4 {
    const NAME: &'static str = "upgraded";
    type Input = ();
    type Output = String;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<String, WorkflowError> {
        ctx.deprecate_patch("new-first-step");
        let first = ctx.activity::<New>(()).await?;
        finish(&ctx, first).await
    }
}

/// Version 5: the call removed.
struct V5;
impl Workflow for V5 {
    const NAME: &'static str = "upgraded";
    type Input = ();
    type Output = String;
    async fn run(ctx: WorkflowContext, _: ()) -> Result<String, WorkflowError> {
        let first = ctx.activity::<New>(()).await?;
        finish(&ctx, first).await
    }
}

fn engine<W: Workflow>(dir: &Path) -> anyhow::Result<Engine> {
    Ok(Engine::builder()
        .data_dir(dir)
        .register_workflow::<W>()
        .register_activity::<Old>()
        .register_activity::<New>()
        .build()?)
}

const WAIT: Duration = Duration::from_secs(10);

/// Waits until the run of `id` has recorded its first activity's result
/// and waits for the signal.
async fn waiting_for_go(engine: &Engine, id: &str) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let d = engine.client().describe(id).await?;
        if d.signal_waits.iter().any(|(name, _)| name == "go") {
            return Ok(());
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "{id} never reached its signal wait: {d:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn parked_reason(engine: &Engine, id: &str) -> anyhow::Result<String> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let d = engine.client().describe(id).await?;
        if let Some(p) = d.parked {
            return Ok(p.reason);
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "{id} was never parked: {d:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn go(engine: &Engine, id: &str, n: u32) -> anyhow::Result<String> {
    let c = engine.client();
    c.signal(id, "go", &n, Some(&format!("{id}-go"))).await?;
    Ok(tokio::time::timeout(WAIT, c.result::<V2>(id)).await??)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_of_old_code_keep_their_branch_and_new_runs_take_the_new_one() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    // v1: two runs reach their signal wait with the old step done.
    {
        let e = engine::<V1>(&data)?;
        for id in ["old-a", "old-b"] {
            e.client().start::<V1>(id, &()).await?;
            waiting_for_go(&e, id).await?;
        }
        e.shutdown().await;
    }
    // v2: the old runs replay their old branch; a new run takes the new
    // one (and records the marker).
    {
        let e = engine::<V2>(&data)?;
        assert_eq!(go(&e, "old-a", 1).await?, "old+1");
        for id in ["new-a", "new-b"] {
            e.client().start::<V2>(id, &()).await?;
            waiting_for_go(&e, id).await?;
        }
        e.shutdown().await;
    }
    // v2 again after a restart: the new run replays its marker.
    {
        let e = engine::<V2>(&data)?;
        assert_eq!(go(&e, "new-a", 2).await?, "new+2");
        e.shutdown().await;
    }
    // v3 dropped the old branch while `old-b` still needs it: that run is
    // parked, naming the change; the new run is unaffected.
    {
        let e = engine::<V3>(&data)?;
        let c = e.client();
        // The run parks when it is rebuilt to take the signal; the signal
        // is either refused for that or committed before the park marker.
        match c.signal("old-b", "go", &3u32, Some("old-b-go")).await {
            Ok(()) | Err(EngineError::Parked { .. }) => {}
            Err(other) => panic!("signal to old-b: {other}"),
        }
        // Waiting for its result goes on (a parked run is not closed);
        // `describe` names the change and the versions this code supports.
        let reason = parked_reason(&e, "old-b").await?;
        assert!(reason.contains("new-first-step"), "{reason}");
        assert!(reason.contains("1..=1"), "{reason}");
        e.client().start::<V3>("new-c", &()).await?;
        waiting_for_go(&e, "new-c").await?;
        e.shutdown().await;
    }
    // v2 back in place: `old-b` resumes and takes its old branch.
    {
        let e = engine::<V2>(&data)?;
        e.client().resume("old-b").await?;
        e.client()
            .signal("old-b", "go", &3u32, Some("old-b-go"))
            .await?;
        let v = tokio::time::timeout(WAIT, e.client().result::<V2>("old-b")).await??;
        assert_eq!(v, "old+3");
        e.shutdown().await;
    }
    // v4 (`deprecate_patch`) and v5 (call removed) replay runs that
    // recorded the marker.
    {
        let e = engine::<V4>(&data)?;
        assert_eq!(go(&e, "new-b", 4).await?, "new+4");
        e.shutdown().await;
    }
    {
        let e = engine::<V5>(&data)?;
        assert_eq!(go(&e, "new-c", 5).await?, "new+5");
        e.shutdown().await;
    }
    Ok(())
}

/// Goal: the history length workflow code sees, and the suggestion to
/// continue as new, follow the committed history across a restart.
/// Method: a run reads `history_len` before and after a signal, with the
/// engine restarted in between (so the second read comes from a replayed
/// run).
struct Length;
impl Workflow for Length {
    const NAME: &'static str = "length";
    type Input = ();
    type Output = (u64, u64, bool);
    async fn run(ctx: WorkflowContext, _: ()) -> Result<(u64, u64, bool), WorkflowError> {
        let before = ctx.history_len();
        let _: u32 = ctx.wait_signal("go").await?;
        Ok((before, ctx.history_len(), ctx.continue_as_new_suggested()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_len_counts_committed_events_across_a_restart() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    {
        let e = Engine::builder()
            .data_dir(&data)
            .register_workflow::<Length>()
            .build()?;
        e.client().start::<Length>("len", &()).await?;
        e.shutdown().await;
    }
    let e = Engine::builder()
        .data_dir(&data)
        .register_workflow::<Length>()
        .build()?;
    let c = e.client();
    c.signal("len", "go", &1u32, None).await?;
    let (before, after, suggested) =
        tokio::time::timeout(WAIT, c.result::<Length>("len")).await??;
    // Started; then the signal.
    assert_eq!((before, after, suggested), (1, 2, false));
    e.shutdown().await;
    Ok(())
}
