//! Goal: after the engine process is killed at any moment (SIGKILL) and
//! restarted on the same directory, every started workflow completes, each
//! activity execution's result is committed once, and no completed workflow
//! runs again.
//! Method: run the demo's engine process (`keel demo-worker`) over the same
//! data directory 20 times, killing it after a pseudo-random delay each time
//! (fixed seed, so the test is repeatable), then once more to completion;
//! then check the log with `verify` and count results per execution.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::Duration;

use keel_storage::{EventKind, RocksStore, RunStatus, Store};

const KILLS: u32 = 20;
const WORKFLOWS: u64 = 300;

fn worker(data: &std::path::Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_keel"));
    c.args(["demo-worker", "--prefix", "crash", "--workflows"])
        .arg(WORKFLOWS.to_string())
        .args(["--concurrency", "50", "--data"])
        .arg(data)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    c
}

#[test]
fn killed_twenty_times_then_everything_completes_once() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    for _ in 0..KILLS {
        let mut child = worker(&data).spawn().unwrap();
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        // Between 5 and 250 ms: before the engine opened, mid-start,
        // mid-commit, mid-activity, or after some workflows finished.
        let delay = 5 + state % 245;
        std::thread::sleep(Duration::from_millis(delay));
        let _ = child.kill();
        child.wait().unwrap();
    }
    let status = worker(&data).status().unwrap();
    assert!(status.success(), "the final run finishes: {status}");

    let store = RocksStore::open_read_only(&data).unwrap();
    let report = store.verify().unwrap();
    assert!(report.ok, "verify: {:?}", report.violations);
    let mut completed = 0;
    for i in 0..WORKFLOWS {
        let run = store
            .resolve(&format!("crash-{i}"))
            .unwrap()
            .expect("started");
        let meta = store.run_meta(run).unwrap().unwrap();
        assert_eq!(meta.status, RunStatus::Completed, "crash-{i}");
        completed += 1;
        // One completion per execution, and exactly one run per instance:
        // a completed workflow never ran again.
        let mut results: BTreeMap<u32, u32> = BTreeMap::new();
        for e in store.history(run).unwrap() {
            if let EventKind::ActivityCompleted { step, .. } = e.kind {
                *results.entry(step.0).or_default() += 1;
            }
        }
        assert!(results.values().all(|n| *n == 1), "crash-{i}: {results:?}");
        assert_eq!(results.len(), 4, "charge, reserve, ship, notify");
    }
    assert_eq!(completed, WORKFLOWS);
    assert_eq!(report.runs, WORKFLOWS, "no instance got a second run");
}
