//! Goal: the concurrency seed's examples run as keel workflows, give the
//! same result when the engine restarts mid-run, and leave the histories the
//! seed describes (one step per barrier with full group paths, a recorded
//! select winner, children with lineage).
//! Method: each example runs once uninterrupted; then again on RocksDB with
//! the engine shut down as soon as the run has made progress (its first
//! commit landed) and a new engine started on the same directory.

use keel::storage::EventKind;
use keel::{Engine, Workflow};
use keel_e2e::seeds::{self, *};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Runs `W` straight through, then with a restart after the first commit;
/// returns both results and the restarted run's engine for inspection.
fn with_restart<W: Workflow>(
    instance: &str,
    input: W::Input,
) -> (W::Output, W::Output, Engine, tempfile::TempDir)
where
    W::Input: Clone,
{
    let rt = rt();
    let plain_dir = tempfile::tempdir().unwrap();
    let plain = {
        let engine = seeds::engine(plain_dir.path()).unwrap();
        let c = engine.client();
        rt.block_on(async {
            c.start::<W>(instance, &input).await.unwrap();
            c.result::<W>(instance).await.unwrap()
        })
    };
    let dir = tempfile::tempdir().unwrap();
    {
        let engine = seeds::engine(dir.path()).unwrap();
        let c = engine.client();
        rt.block_on(async { c.start::<W>(instance, &input).await.unwrap() });
        // Shut down while activities are still running (each takes
        // ACTIVITY_MS); the new engine must finish the run.
        engine.shutdown_blocking();
    }
    let engine = seeds::engine(dir.path()).unwrap();
    let c = engine.client();
    let restarted = rt.block_on(async { c.result::<W>(instance).await.unwrap() });
    (plain, restarted, engine, dir)
}

#[test]
fn sequential_survives_a_restart() {
    let (a, b, engine, _d) = with_restart::<SequentialWorkflow>("seq", ());
    assert_eq!(a, vec!["result 1", "result 2", "result 3"]);
    assert_eq!(a, b);
    assert!(engine.store().verify().unwrap().ok);
}

#[test]
fn parallel_issues_all_leaves_in_one_step() {
    let (a, b, engine, _d) = with_restart::<ParallelWorkflow>("par", ());
    assert_eq!(a, ("result 1".into(), "result 2".into(), "result 3".into()));
    assert_eq!(a, b);
    let store = engine.store();
    let run = store.resolve("par").unwrap().unwrap();
    let history = store.history(run).unwrap();
    // WorkflowStarted then the three schedules, committed together.
    let kinds: Vec<&str> = history.iter().take(4).map(|e| e.kind.name()).collect();
    assert_eq!(
        kinds,
        [
            "WorkflowStarted",
            "ActivityScheduled",
            "ActivityScheduled",
            "ActivityScheduled"
        ]
    );
    let groups: Vec<_> = history[1..4]
        .iter()
        .map(|e| e.kind.group().unwrap().clone())
        .collect();
    for (i, g) in groups.iter().enumerate() {
        assert_eq!(g.len(), 1);
        assert_eq!((g[0].size, g[0].index), (3, i as u32));
        assert_eq!(g[0].step, groups[0][0].step, "one barrier step");
    }
}

#[test]
fn nested_barrier_records_full_group_paths_and_shows_three_leaf_waits() {
    let rt = rt();
    let dir = tempfile::tempdir().unwrap();
    let engine = seeds::engine(dir.path()).unwrap();
    let c = engine.client();
    let d = rt.block_on(async {
        c.start::<NestedWorkflow>("nested", &()).await.unwrap();
        c.describe("nested").await.unwrap()
    });
    // Three open leaf waits, not one synthetic nested wait.
    assert_eq!(d.pending.len(), 3, "{:?}", d.pending);
    let paths: Vec<Vec<(u32, u32)>> = d
        .pending
        .iter()
        .map(|p| p.group.iter().map(|g| (g.size, g.index)).collect())
        .collect();
    // The outer group counts leaves (3); the inner group has 2.
    assert_eq!(
        paths,
        vec![vec![(3, 0)], vec![(3, 1), (2, 0)], vec![(3, 2), (2, 1)]]
    );
    let out = rt.block_on(c.result::<NestedWorkflow>("nested")).unwrap();
    assert_eq!(
        out,
        ("summary".into(), ("invoice".into(), "shipment".into()))
    );
    drop(engine);
    let (a, b, _e, _d) = with_restart::<NestedWorkflow>("nested-restart", ());
    assert_eq!(a, b);
}

#[test]
fn select_records_its_winner_and_cancels_the_loser() {
    let (a, b, engine, _d) =
        with_restart::<ResolveInRealTime>("resolve-fast", "fast-1".to_string());
    assert_eq!(a.status, "resolved");
    assert_eq!(a.source.as_deref(), Some("resolved"));
    assert_eq!(a, b);
    let store = engine.store();
    let run = store.resolve("resolve-fast").unwrap().unwrap();
    let history = store.history(run).unwrap();
    let winners: Vec<_> = history
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::SelectionWinnerRecorded {
                key, member_index, ..
            } => Some((key.to_string(), *member_index)),
            _ => None,
        })
        .collect();
    assert_eq!(winners, vec![("resolved".to_string(), 0)]);
    // The deadline timer lost and was cancelled: a recorded cancellation.
    assert!(history.iter().any(|e| matches!(
        e.kind,
        EventKind::SelectionOperationCancelled {
            member_index: 2,
            ..
        }
    )));
    assert!(history
        .iter()
        .any(|e| matches!(e.kind, EventKind::TimerCancelled { .. })));
}

#[test]
fn select_deadline_path_times_out() {
    let rt = rt();
    let dir = tempfile::tempdir().unwrap();
    let engine = seeds::engine(dir.path()).unwrap();
    let c = engine.client();
    let out = rt.block_on(async {
        c.start::<ResolveInRealTime>("resolve-slow", &"slow-1".to_string())
            .await
            .unwrap();
        c.result::<ResolveInRealTime>("resolve-slow").await.unwrap()
    });
    assert_eq!(out.status, "timed_out");
    let store = engine.store();
    let run = store.resolve("resolve-slow").unwrap().unwrap();
    let history = store.history(run).unwrap();
    assert!(history
        .iter()
        .any(|e| matches!(e.kind, EventKind::ActivityCancelRequested { .. })));
}

#[test]
fn manual_signal_can_win_the_select() {
    let rt = rt();
    let dir = tempfile::tempdir().unwrap();
    let engine = seeds::engine(dir.path()).unwrap();
    let c = engine.client();
    let out = rt.block_on(async {
        c.start::<ResolveInRealTime>("resolve-manual", &"slow-2".to_string())
            .await
            .unwrap();
        c.signal(
            "resolve-manual",
            "resolution.received",
            &"by hand".to_string(),
            Some("m1"),
        )
        .await
        .unwrap();
        c.result::<ResolveInRealTime>("resolve-manual")
            .await
            .unwrap()
    });
    assert_eq!(out.source.as_deref(), Some("manual"));
    assert_eq!(out.value.as_deref(), Some("by hand"));
}

#[test]
fn async_closure_runs_as_a_child_and_survives_a_restart() {
    let (a, b, engine, _d) = with_restart::<CustomerWorkflow>("customer", "c-7".to_string());
    assert_eq!(a.customer.id, "c-7");
    assert_eq!(a, b);
    let store = engine.store();
    let run = store.resolve("customer").unwrap().unwrap();
    let d = futures::executor::block_on(engine.client().describe("customer")).unwrap();
    assert_eq!(d.children.len(), 1);
    assert_eq!(d.children[0].workflow_type, "keel.async");
    let child = store.run_meta(d.children[0].run_id).unwrap().unwrap();
    assert_eq!(child.parent.map(|p| p.run_id), Some(run), "lineage");
}

#[test]
fn mixed_barrier_and_parallel_children() {
    let (a, b, _e, _d) = with_restart::<MixedOrderWorkflow>("mixed", ());
    assert_eq!(a, ("charged".into(), "shipped".into()));
    assert_eq!(a, b);
    let (a, b, engine, _d) = with_restart::<ParentWorkflow>("parent", ());
    assert_eq!(a, ("result 1".into(), "result 2".into(), "result 3".into()));
    assert_eq!(a, b);
    let report = engine.store().verify().unwrap();
    assert!(report.ok, "{:?}", report.violations);
    assert_eq!(report.runs, 4, "the parent and its three children");
}
