//! Goal: a repeated state-changing request gets its first outcome even
//! after the run it changed has closed and the engine restarted (issue
//! "The rest of the workflow surface", item 3): a termination, a signal and
//! a stream message, each with its id, answer as the first time did rather
//! than `RunClosed`; a new id to the closed run is still `RunClosed`.
//!
//! Method: the real engine. A waiting workflow takes a signal and a
//! message, is terminated with a command id, the engine restarts, and every
//! request is sent again with the same ids (and once with new ones).

use keel::storage::EventKind;
use keel::{Engine, EngineError, Workflow, WorkflowContext, WorkflowError};

/// Waits for a signal that never comes.
struct Waiter;
impl Workflow for Waiter {
    const NAME: &'static str = "waiter";
    type Input = ();
    type Output = ();
    async fn run(ctx: WorkflowContext, _: ()) -> Result<(), WorkflowError> {
        let _: () = ctx.wait_signal("never").await?;
        Ok(())
    }
}

fn engine(dir: &std::path::Path) -> anyhow::Result<Engine> {
    Ok(Engine::builder()
        .data_dir(dir)
        .register_workflow::<Waiter>()
        .build()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeats_reaching_a_closed_run_get_their_first_outcome() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("data");
    let run = {
        let e = engine(&data)?;
        let c = e.client();
        let run = c.start::<Waiter>("w", &()).await?.run_id();
        c.signal("w", "note", &1u32, Some("note-1")).await?;
        let sent = c.send_message("w", "inbox", "m-1", &5u32).await?;
        assert_eq!((sent.offset, sent.first), (0, true));
        c.terminate_with("w", "operator", Some("term-1")).await?;
        // At once, with the close just committed.
        c.terminate_with("w", "operator", Some("term-1")).await?;
        e.shutdown().await;
        run
    };
    let e = engine(&data)?;
    let c = e.client();
    c.terminate_with("w", "operator", Some("term-1")).await?;
    c.signal("w", "note", &1u32, Some("note-1")).await?;
    let again = c.send_message("w", "inbox", "m-1", &5u32).await?;
    assert_eq!((again.offset, again.first), (0, false));
    // New ids are refused: the run is closed.
    for r in [
        c.terminate_with("w", "operator", Some("term-2")).await,
        c.signal("w", "note", &1u32, Some("note-2")).await,
        c.send_message("w", "inbox", "m-2", &5u32).await.map(drop),
    ] {
        assert!(
            matches!(r, Err(EngineError::RunClosed { run: r }) if r == run),
            "{r:?}"
        );
    }
    // One termination in the history, with its command id.
    let terminations: Vec<_> = e
        .store()
        .history(run)?
        .into_iter()
        .filter_map(|ev| match ev.kind {
            EventKind::WorkflowTerminated { command_id, .. } => Some(command_id),
            _ => None,
        })
        .collect();
    assert_eq!(terminations, vec![Some(keel::CommandId::new("term-1"))]);
    e.shutdown().await;
    Ok(())
}
