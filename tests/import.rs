//! Goal: the durable import (scopes, a bounded channel, worker coroutines,
//! a progress coroutine, a deadline) completes in both failure modes across
//! an engine restart mid-import, without re-running committed activities.
//! Method: a 3,000-row CSV with one bad address; start the import, wait
//! until at least 1,000 rows are done (from the progress memo in
//! `describe`), shut the engine down, start a new one on the same
//! directory, await the result; then count activity calls and completions.

use std::time::Duration;

use keel::storage::EventKind;
use keel::Engine;
use keel_e2e::import::{
    check_calls, write_csv, CheckAddress, ImportInput, ImportWorkflow, ReadRows,
};

const ROWS: u64 = 3000;
const BAD: u64 = 2100;

fn engine(dir: &std::path::Path) -> Engine {
    Engine::builder()
        .data_dir(dir)
        .register_workflow::<ImportWorkflow>()
        .register_activity::<ReadRows>()
        .register_activity::<CheckAddress>()
        .build()
        .unwrap()
}

fn progress(engine: &Engine, id: &str) -> u64 {
    let d = futures::executor::block_on(engine.client().describe(id)).unwrap();
    d.memo
        .iter()
        .find(|(k, _)| k == "progress")
        .and_then(|(_, v)| serde_json::from_str::<(u64, u64)>(v).ok())
        .map_or(0, |(done, _)| done)
}

#[test]
fn both_modes_survive_a_restart_mid_import() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("users.csv");
    write_csv(&csv, ROWS, &[BAD]).unwrap();
    // The second import gets its own addresses, so calls count per import
    // (the bad one too: shared, it counted as "ran twice" whenever both
    // imports reached it, one more than the in-flight bound below).
    let csv2 = dir.path().join("users2.csv");
    let text = std::fs::read_to_string(&csv)
        .unwrap()
        .replace("Main Street", "Oak Avenue")
        .replace("INVALID ", "INVALID oak ");
    std::fs::write(&csv2, text).unwrap();
    let data = dir.path().join("data");
    keel_e2e::import::CHECK_DELAY_MS.store(2, std::sync::atomic::Ordering::Relaxed);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let modes = [("fail-together", false), ("log-errors", true)];
    {
        let e = engine(&data);
        for (id, log_errors) in modes {
            let input = ImportInput {
                path: if log_errors { &csv2 } else { &csv }.display().to_string(),
                total: ROWS,
                workers: 10,
                log_errors,
                deadline_s: 600,
            };
            rt.block_on(e.client().start::<ImportWorkflow>(id, &input))
                .unwrap();
        }
        // Let the log-errors import get well past a third, then "crash".
        let mut waited = 0;
        while progress(&e, "log-errors") < 1000 && waited < 2000 {
            std::thread::sleep(Duration::from_millis(5));
            waited += 1;
        }
        assert!(
            progress(&e, "log-errors") < ROWS,
            "the restart lands mid-import"
        );
        e.shutdown_blocking();
    }
    let e = engine(&data);
    let c = e.client();
    let fail = rt
        .block_on(c.result::<ImportWorkflow>("fail-together"))
        .unwrap();
    assert!(
        fail.aborted
            .as_deref()
            .unwrap_or("")
            .contains("INVALID 2100"),
        "{fail:?}"
    );
    assert!(fail.checked < ROWS);
    let logged = rt
        .block_on(c.result::<ImportWorkflow>("log-errors"))
        .unwrap();
    assert_eq!(
        logged,
        keel_e2e::import::ImportReport {
            checked: ROWS - 1,
            bad: 1,
            aborted: None
        }
    );

    // Committed activities were not re-run: every execution has one
    // completion, and an address was called at most twice (once more only
    // if its attempt was in flight at the shutdown; 10 workers at most).
    let store = e.store();
    for id in ["fail-together", "log-errors"] {
        let run = store.resolve(id).unwrap().unwrap();
        let history = store.history(run).unwrap();
        let mut done = std::collections::BTreeMap::new();
        for ev in &history {
            if let EventKind::ActivityCompleted { step, .. } = ev.kind {
                *done.entry(step).or_insert(0) += 1;
            }
        }
        assert!(done.values().all(|n| *n == 1));
        let cancels = history
            .iter()
            .filter(|e| matches!(e.kind, EventKind::ScopeCancelled { .. }))
            .count();
        assert_eq!(
            cancels,
            usize::from(id == "fail-together"),
            "{id}: one committed scope cancellation"
        );
    }
    let calls = check_calls().lock().unwrap();
    let twice = calls.values().filter(|n| **n > 1).count();
    assert!(
        calls.values().all(|n| *n <= 2),
        "no address ran three times"
    );
    assert!(
        twice <= 20,
        "{twice} addresses ran twice: only attempts in flight at the shutdown may"
    );
    assert!(e.store().verify().unwrap().ok);
}
