//! Goal: a history of every workflow shape recorded by an earlier build
//! keeps replaying with the current code (issue "The rest of the workflow
//! surface", item 10): barrier, nested barrier, select, children, scope,
//! update with query, version markers, search attributes and memo, a
//! message stream read across continue-as-new, sends from workflow code,
//! a schedule's loop (calendar and manual triggers, pause), a scope that
//! waits for a cancelled activity to stop, a run closed by its run
//! timeout, and a run still open (a child started, a timer set). A change to the engine or to these
//! workflows that would park such runs fails CI.
//!
//! Method: the bundles in `tests/data/histories/shapes/` were written by a
//! real engine running `keel_e2e::shapes` (`KEEL_BLESS=1` writes the
//! bundles that are missing; delete one to record it again after an
//! intended change). Each is replayed with the
//! current registry and must replay to its recorded end; each must also
//! still hold the events of the shape it is named after, so a bundle
//! cannot silently stop covering its shape.

use std::path::PathBuf;
use std::time::Duration;

use keel::replay::{Bundle, Replayer};
use keel::storage::EventKind;
use keel::Engine;
use keel_e2e::{seeds, shapes};

/// Bundle name, and the event every bundle of that shape must hold.
const SHAPES: &[(&str, &str)] = &[
    ("barrier", "ActivityScheduled"),
    ("nested-barrier", "ActivityScheduled"),
    ("select", "SelectionWinnerRecorded"),
    ("children", "ChildCompleted"),
    ("child", "ActivityCompleted"),
    ("scope", "ActivityCompleted"),
    ("update", "UpdateCompleted"),
    ("version-marker", "VersionMarker"),
    ("search", "SearchAttributesUpserted"),
    ("stream", "MessageReceived"),
    ("send", "ExternalSendCompleted"),
    ("schedule", "ChildCompleted"),
    ("cancel-wait", "ActivityCancelRequested"),
    ("timed-out", "WorkflowTimedOut"),
    ("open", "TimerStarted"),
];

/// The shapes recorded while their run was still open (every other one
/// must have finished): an open run's timers and children are rows that a
/// finished run no longer has.
const OPEN_SHAPES: &[&str] = &["open"];

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/histories/shapes")
}

fn blessing() -> bool {
    std::env::var("KEEL_BLESS").is_ok_and(|v| v == "1")
}

const WAIT: Duration = Duration::from_secs(20);

/// Runs every shape on a real engine and writes its bundle.
async fn bless() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let engine = Engine::builder()
        .data_dir(tmp.path().join("data"))
        .workflows(&shapes::workflows())
        .activities(seeds::activities())
        .build()?;
    let c = engine.client();
    c.start::<seeds::ParallelWorkflow>("barrier", &()).await?;
    c.start::<seeds::NestedWorkflow>("nested-barrier", &())
        .await?;
    c.start::<seeds::ResolveInRealTime>("select", &"fast-1".to_string())
        .await?;
    c.start::<seeds::ParentWorkflow>("children", &()).await?;
    c.start::<shapes::ScopeShape>("scope", &()).await?;
    c.start::<shapes::VersionShape>("version-marker", &())
        .await?;
    c.start::<shapes::UpdateShape>("update", &()).await?;
    let options = keel::StartOptions::new().search_attribute("customer", "c-42");
    c.start_with::<shapes::SearchShape>("search", &(), options)
        .await?;
    // The first message makes the run continue as new; the rest go to the
    // next run (the recorded one), which reads on from the carried cursor.
    let first = c.start::<shapes::StreamShape>("stream", &(0, 0)).await?;
    c.send_message("stream", "items", "item-0", &5u64).await?;
    while c.describe("stream").await?.run_id == first.run_id() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for (i, v) in [(1u64, 7u64), (1, 7), (2, 11)] {
        c.send_message("stream", "items", &format!("item-{i}"), &v)
            .await?;
    }
    c.start::<shapes::SendShape>("send", &()).await?;
    c.start::<shapes::CancelWaitShape>("cancel-wait", &())
        .await?;
    let options = keel::StartOptions::new().run_timeout(Duration::from_millis(300));
    c.start_with::<shapes::DeadlineShape>("timed-out", &(), options)
        .await?;
    c.start::<shapes::OpenShape>("open", &()).await?;
    // A schedule of two calendar triggers and one manual one, paused and
    // unpaused on the way; it closes once its calendar has ended.
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?;
    let end = keel::Timestamp(now.as_millis() as u64 + 2_500);
    let spec = keel::ScheduleSpec::every(Duration::from_secs(1)).ending_at(end);
    let action =
        keel::ScheduleAction::start::<shapes::TickShape>(&1).map_err(anyhow::Error::msg)?;
    let schedules = c.schedules();
    schedules
        .create(
            "schedule",
            keel::NewSchedule::new(spec, action).overlap(keel::OverlapPolicy::AllowAll),
        )
        .await?;
    schedules.trigger("schedule").await?;
    schedules.pause("schedule", "a moment").await?;
    schedules.unpause("schedule", "go on").await?;
    let n: u64 = c.update("update", "add", &2u64, Some("add-2")).await?;
    assert_eq!(n, 2);
    let n: u64 = c.update("update", "add", &3u64, Some("add-3")).await?;
    assert_eq!(n, 5);
    c.signal("update", "done", &(), None).await?;
    for id in [
        "barrier",
        "nested-barrier",
        "select",
        "children",
        "scope",
        "version-marker",
        "update",
        "search",
        "stream",
        "send",
        "cancel-wait",
        "timed-out",
        "keel.schedule/schedule",
    ] {
        tokio::time::timeout(WAIT, c.outcome(id)).await??;
    }
    std::fs::create_dir_all(dir())?;
    let store = engine.store();
    // The open shape is exported once its child has started and its timer
    // is set.
    tokio::time::timeout(WAIT, async {
        loop {
            let open = Bundle::from_store(store.as_ref(), "open")?;
            if open.events.iter().any(|e| e.kind.name() == "TimerStarted") {
                return anyhow::Ok(());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await??;
    for (name, _) in SHAPES {
        let path = dir().join(format!("{name}.bundle"));
        if path.exists() {
            // A bundle an earlier build recorded stays: it is what proves
            // that this build still replays what that one wrote.
            continue;
        }
        let bundle = if *name == "child" {
            // The first child of `children`: a run started by a parent.
            let parent = Bundle::from_store(store.as_ref(), "children")?;
            let child = parent
                .events
                .iter()
                .find_map(|e| match &e.kind {
                    EventKind::ChildScheduled(child) => Some(child.child_run_id),
                    _ => None,
                })
                .expect("children schedules children");
            Bundle::from_store(store.as_ref(), &child.to_string())?
        } else if *name == "schedule" {
            Bundle::from_store(store.as_ref(), "keel.schedule/schedule")?
        } else {
            Bundle::from_store(store.as_ref(), name)?
        };
        bundle.write(path)?;
    }
    engine.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_shape_history_replays_and_still_holds_its_shape() -> anyhow::Result<()> {
    if blessing() {
        bless().await?;
    }
    let replayer = Replayer::new(shapes::workflows());
    let mut failures = Vec::new();
    for (name, must_hold) in SHAPES {
        let path = dir().join(format!("{name}.bundle"));
        let bundle = match Bundle::read(&path) {
            Ok(b) => b,
            Err(e) => {
                failures.push(format!("{name}: {e} (KEEL_BLESS=1 writes it)"));
                continue;
            }
        };
        if !bundle.events.iter().any(|e| e.kind.name() == *must_hold) {
            failures.push(format!("{name}: holds no {must_hold} event"));
        }
        let closed = bundle.events.last().is_some_and(|e| e.kind.closes_run());
        match (closed, OPEN_SHAPES.contains(name)) {
            (false, false) => failures.push(format!("{name}: the recorded run did not finish")),
            (true, true) => failures.push(format!("{name}: the recorded run is not open")),
            _ => {}
        }
        let report = replayer.replay_bundle(&bundle);
        if !report.outcome.is_ok() {
            failures.push(format!("{name}: {}", report.outcome));
        }
    }
    assert!(
        failures.is_empty(),
        "shape histories:\n{}",
        failures.join("\n")
    );
    Ok(())
}
