//! Goal: continue-as-new on the real engine, with restarts (issue "The
//! rest of the workflow surface", items 3 and 6): the next run takes over
//! the signals the closing run had not read (in order), and the command
//! ids the chain committed, so a signal retried after the hand-off is
//! still a duplicate and an update repeated after it is not applied again.
//!
//! Method: a batcher reads two "item" signals per run, each run only after
//! its own "next" signal, and continues as new until it has read six. All
//! six items are sent before the first "next", so the first run closes
//! with four unread. The engine is restarted between runs; a retry of the
//! first item (same command id) is sent to the second run; an update
//! applied by the first run is repeated to the second. The chain's
//! histories, read from the store, must hold each item exactly once.

use std::time::Duration;

use keel::storage::EventKind;
use keel::{Engine, EngineError, Workflow, WorkflowContext, WorkflowError};

struct Batcher;
impl Workflow for Batcher {
    const NAME: &'static str = "batcher";
    /// (sum so far, items read so far)
    type Input = (u64, u32);
    type Output = u64;
    async fn run(
        ctx: WorkflowContext,
        (mut sum, mut read): (u64, u32),
    ) -> Result<u64, WorkflowError> {
        ctx.on_update(
            "note",
            |_: &String| Ok(()),
            |s: String| async move { Ok(s.len()) },
        );
        let _: () = ctx.wait_signal("next").await?;
        for _ in 0..2 {
            sum += ctx.wait_signal::<u64>("item").await?;
            read += 1;
        }
        if read >= 6 {
            return Ok(sum);
        }
        Err(WorkflowError::continue_as_new(&(sum, read)))
    }
}

fn engine(dir: &std::path::Path) -> anyhow::Result<Engine> {
    Ok(Engine::builder()
        .data_dir(dir)
        .register_workflow::<Batcher>()
        .build()?)
}

const WAIT: Duration = Duration::from_secs(10);

/// Waits until the instance's current run is generation `g` (its input's
/// read count is `2 * g`) and waits for "next".
async fn at_generation(e: &Engine, g: u32) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let d = e.client().describe("batch").await?;
        let store = e.store();
        let started = store.history(d.run_id)?.into_iter().next();
        let generation = match started.map(|s| s.kind) {
            Some(EventKind::WorkflowStarted(start)) => start.input.decode::<(u64, u32)>()?.1 / 2,
            _ => u32::MAX,
        };
        if generation == g && d.signal_waits.iter().any(|(n, _)| n == "next") {
            return Ok(());
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "never reached generation {g}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_run_takes_over_unread_signals_and_command_ids() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    {
        let e = engine(&data)?;
        let c = e.client();
        c.start::<Batcher>("batch", &(0, 0)).await?;
        for i in 1..=6u64 {
            c.signal("batch", "item", &i, Some(&format!("item-{i}")))
                .await?;
        }
        let n: usize = c
            .update("batch", "note", &"hello".to_string(), Some("note-1"))
            .await?;
        assert_eq!(n, 5);
        c.signal("batch", "next", &(), Some("next-0")).await?;
        at_generation(&e, 1).await?;
        e.shutdown().await;
    }
    {
        let e = engine(&data)?;
        let c = e.client();
        // Retries of what the first run committed reach the second run.
        c.signal("batch", "item", &1u64, Some("item-1")).await?;
        c.signal("batch", "next", &(), Some("next-0")).await?;
        match c
            .update::<_, usize>("batch", "note", &"hello".to_string(), Some("note-1"))
            .await
        {
            Err(EngineError::Refused(why)) => assert!(why.contains("earlier run"), "{why}"),
            other => panic!("an update applied by the first run must not apply again: {other:?}"),
        }
        c.signal("batch", "next", &(), Some("next-1")).await?;
        at_generation(&e, 2).await?;
        e.shutdown().await;
    }
    let e = engine(&data)?;
    let c = e.client();
    c.signal("batch", "next", &(), Some("next-2")).await?;
    let sum = tokio::time::timeout(WAIT, c.result::<Batcher>("batch")).await??;
    assert_eq!(sum, 21, "every item read once, in order of arrival");

    // Each item and each "next" is in the chain's histories once.
    let store = e.store();
    let mut run = store.resolve("batch")?;
    let (mut items, mut nexts, mut runs) = (Vec::new(), 0, 0);
    while let Some(r) = run {
        runs += 1;
        run = None;
        for ev in store.history(r)? {
            match ev.kind {
                EventKind::SignalReceived {
                    name, command_id, ..
                } if name == "item" => items.push(command_id.expect("sent with ids").to_string()),
                EventKind::SignalReceived { name, .. } if name == "next" => nexts += 1,
                EventKind::WorkflowStarted(start) => run = start.continued_from,
                _ => {}
            }
        }
    }
    items.sort();
    assert_eq!(runs, 3);
    assert_eq!(
        items,
        (1..=6).map(|i| format!("item-{i}")).collect::<Vec<_>>()
    );
    assert_eq!(nexts, 3);
    e.shutdown().await;
    Ok(())
}

/// Returns at once; continues as new once when its input is true.
struct Quick;
impl Workflow for Quick {
    const NAME: &'static str = "quick";
    type Input = bool;
    type Output = ();
    async fn run(_: WorkflowContext, again: bool) -> Result<(), WorkflowError> {
        if again {
            return Err(WorkflowError::continue_as_new(&false));
        }
        Ok(())
    }
}

/// Goal: a start retried with its command id is answered with the run it
/// started, even after that run continued as new, closed, and the
/// instance was started again by another command (item 3); before, only
/// the instance's current run was compared. Method: the real engine with
/// the reuse policy that allows duplicates (so a wrongly deduplicated
/// start would make a new run), restarted before the retries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_start_finds_its_run_behind_later_runs() -> anyhow::Result<()> {
    use keel::{CommandId, Payload, ReusePolicy, StartOutcome};
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    let start = |e: &Engine, command: &str, again: bool| {
        let c = e.client();
        let command = CommandId::new(command);
        async move {
            let input = Payload::encode(&again)?;
            let reuse = ReusePolicy::AllowDuplicate;
            anyhow::Ok(
                c.start_raw(Quick::NAME, "q", input, Some(command), reuse)
                    .await?,
            )
        }
    };
    let quick = |dir: &std::path::Path| -> anyhow::Result<Engine> {
        Ok(Engine::builder()
            .data_dir(dir)
            .register_workflow::<Quick>()
            .build()?)
    };
    let (first, second) = {
        let e = quick(&data)?;
        let StartOutcome::Started(first) = start(&e, "start-1", true).await? else {
            panic!("a new instance starts");
        };
        e.client().outcome("q").await?;
        let StartOutcome::Started(second) = start(&e, "start-2", false).await? else {
            panic!("a closed instance starts again under AllowDuplicate");
        };
        e.client().outcome("q").await?;
        e.shutdown().await;
        (first, second)
    };
    let e = quick(&data)?;
    assert_eq!(
        start(&e, "start-1", true).await?,
        StartOutcome::Existing(first)
    );
    assert_eq!(
        start(&e, "start-2", false).await?,
        StartOutcome::Existing(second)
    );
    // first, its continuation, second: no fourth run.
    let runs = e.store().runs(&keel::storage::RunFilter::default())?;
    assert_eq!(runs.len(), 3, "{runs:?}");
    e.shutdown().await;
    Ok(())
}
