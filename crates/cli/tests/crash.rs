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

/// Waits until the engine process has created its data directory (a busy
/// disk can take longer than the test's working time to create it), at
/// most 30 s.
fn wait_for_directory(data: &std::path::Path) {
    for _ in 0..300 {
        if data.join("CURRENT").exists() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!(
        "the engine process did not create {} within 30 s",
        data.display()
    );
}

fn worker(data: &std::path::Path) -> Command {
    worker_of(data, WORKFLOWS)
}

/// A worker with `workflows` to run.
fn worker_of(data: &std::path::Path, workflows: u64) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_keel"));
    c.args(["demo-worker", "--prefix", "crash", "--workflows"])
        .arg(workflows.to_string())
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

/// Goal: a process killed while it creates its data directory (or during
/// its first commits) never leaves one that later opens refuse.
/// Method: start `keel demo-worker` on a new directory and SIGKILL it after
/// 0 to 57 ms (20 points across the directory's creation and the first
/// commits, which the issue reproduced with `timeout -s KILL 0.03`); each
/// time, open the directory read-write as the next engine would, verify
/// it, and check that no unfinished creation is left beside it.
#[test]
fn killed_while_creating_its_directory_it_opens_next_time() {
    let dir = tempfile::tempdir().unwrap();
    for point in 0..20u64 {
        let data = dir.path().join(format!("data-{point}"));
        let mut child = worker(&data).spawn().unwrap();
        std::thread::sleep(Duration::from_millis(point * 3));
        let _ = child.kill();
        child.wait().unwrap();
        let store = RocksStore::open(&data, keel_storage::Durability::Sync)
            .unwrap_or_else(|e| panic!("killed after {} ms: {e}", point * 3));
        let report = store.verify().unwrap();
        assert!(
            report.ok,
            "killed after {} ms: {:?}",
            point * 3,
            report.violations
        );
        drop(store);
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".keel-creating."))
            .collect();
        assert!(left.is_empty(), "killed after {} ms: {left:?}", point * 3);
    }
}

/// Goal: damage in the middle of the write-ahead log is refused when the
/// directory is opened, instead of recovery keeping the records before it
/// and dropping acknowledged commits after it; a torn tail, what a crash
/// leaves, still opens.
/// Method: SIGKILL `keel demo-worker` once its newest log holds 128 KiB of
/// commits (read with keel's log scanner: the engine primes its logs, so
/// the file is longer than what this use wrote), well before it would
/// finish its 20,000 orders (a clean shutdown moves the log into tables),
/// so that log holds commits no table has yet (a fixed delay could fall
/// just after a flush started a new, nearly empty log); flip one byte
/// halfway through those commits in one copy of the directory, append a
/// torn record to the file in another, and open each. (A torn write over
/// a recycled log's earlier use is tested on crafted logs in
/// crates/storage/tests/lost_commits.rs.)
#[test]
fn damage_inside_the_log_is_refused_and_a_torn_tail_is_not() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut child = worker_of(&data, 20_000).spawn().unwrap();
    wait_for_directory(&data);
    let newest_log = || {
        std::fs::read_dir(&data)
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "log"))
            .max()
    };
    // How far the newest log's own commits reach: the engine primes its
    // logs, so the file is an earlier log's, as long as that one was, and
    // its commits are written over it from the start.
    let commits_end = |log: &std::path::Path| {
        keel_storage::wal::scan_file(log)
            .ok()
            .and_then(|scan| last_commit(&scan).map(|b| b.end as usize))
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while std::time::Instant::now() < deadline {
        if newest_log()
            .and_then(|p| commits_end(&p))
            .is_some_and(|end| end >= 128 * 1024)
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    child.wait().unwrap();
    let wal = newest_log().expect("a write-ahead log");
    let wal_name = wal.file_name().unwrap().to_owned();
    let len = commits_end(&wal).unwrap_or(0);
    assert!(
        len > 64 * 1024,
        "the log holds commits: {len} bytes of them"
    );
    let copy = |name: &str| {
        let to = dir.path().join(name);
        std::fs::create_dir(&to).unwrap();
        for e in std::fs::read_dir(&data).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
        to
    };

    let damaged = copy("damaged");
    let mut bytes = std::fs::read(damaged.join(&wal_name)).unwrap();
    bytes[len / 2] ^= 0x40;
    std::fs::write(damaged.join(&wal_name), bytes).unwrap();
    for err in [
        RocksStore::open(&damaged, keel_storage::Durability::Sync).unwrap_err(),
        RocksStore::open_read_only(&damaged).unwrap_err(),
    ] {
        assert!(
            matches!(err, keel_storage::Error::Damaged { .. }),
            "expected Damaged, got: {err}"
        );
        // The message names the file and the offset of the damage.
        let text = err.to_string();
        let name = wal_name.to_string_lossy();
        assert!(
            text.contains(&*name) && text.contains("damaged at byte"),
            "{text}"
        );
    }

    // `keel recover` refuses without the flag, and with it opens the
    // prefix and names what the damage hid, run by run.
    let keel = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_keel"))
            .args(args)
            .arg("--data")
            .arg(&damaged)
            .output()
            .unwrap()
    };
    let refused = keel(&["recover"]);
    assert_eq!(refused.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--accept-loss"));
    let recovered = keel(&["recover", "--accept-loss", "--json"]);
    assert_eq!(
        recovered.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&recovered.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&recovered.stdout).unwrap();
    assert!(report["lost_events"].as_u64().unwrap() > 0, "{report}");
    assert!(
        !report["lost_runs"].as_array().unwrap().is_empty(),
        "{report}"
    );
    assert!(report["damage"]
        .as_str()
        .unwrap()
        .contains("damaged at byte"));
    assert_eq!(keel(&["verify"]).status.code(), Some(0));

    // A crash tears the record being written: part of its header is on
    // disk. (Cutting bytes off instead may remove a commit that was
    // acknowledged; the acknowledged-commit record refuses that open,
    // which crates/storage/tests/lost_commits.rs tests.)
    let torn = copy("torn");
    let mut bytes = std::fs::read(torn.join(&wal_name)).unwrap();
    // Where the next record would have gone: right after the last commit
    // (past a block's zero trailer), over what the file held before (the
    // log is a recycled one).
    const BLOCK_BYTES: usize = 32 * 1024;
    let next = match BLOCK_BYTES - len % BLOCK_BYTES {
        trailer if trailer < 11 => len + trailer,
        _ => len,
    };
    let torn_header = [0x5a, 0x13, 0x77, 0x01, 0x20];
    if next + torn_header.len() > bytes.len() {
        bytes.resize(next + torn_header.len(), 0);
    }
    bytes[next..next + torn_header.len()].copy_from_slice(&torn_header);
    std::fs::write(torn.join(&wal_name), bytes).unwrap();
    let store = RocksStore::open(&torn, keel_storage::Durability::Sync).unwrap();
    let report = store.verify().unwrap();
    assert!(report.ok, "{:?}", report.violations);
    assert!(
        report.runs > 0,
        "the commits before the torn record are kept"
    );
}

/// Goal: `keel checkpoint` beside an engine that is writing takes a copy
/// that opens, verifies, and holds everything committed before it started.
/// Method: run `keel demo-worker` on many workflows and take checkpoints
/// while it commits; each must succeed, verify clean, and hold at least
/// the runs a read-only open saw just before it.
#[test]
fn checkpoints_beside_a_writing_engine_are_complete_copies() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let mut child = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(["demo-worker", "--prefix", "cp", "--workflows", "4000"])
        .args(["--concurrency", "50", "--data"])
        .arg(&data)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_directory(&data);
    std::thread::sleep(Duration::from_millis(400));
    for i in 0..5 {
        let seen = if data.join("CURRENT").exists() {
            RocksStore::open_read_only(&data)
                .unwrap_or_else(|e| panic!("a read-only open beside the engine: {e}"))
                .runs(&Default::default())
                .unwrap()
                .len()
        } else {
            0
        };
        let copy = dir.path().join(format!("copy-{i}"));
        let o = Command::new(env!("CARGO_BIN_EXE_keel"))
            .arg("checkpoint")
            .arg(&copy)
            .arg("--data")
            .arg(&data)
            .output()
            .unwrap();
        assert_eq!(
            o.status.code(),
            Some(0),
            "checkpoint {i}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let store = RocksStore::open_read_only(&copy).unwrap();
        let report = store.verify().unwrap();
        assert!(report.ok, "copy {i}: {:?}", report.violations);
        assert!(
            report.runs >= seen as u64,
            "copy {i}: {} < {seen}",
            report.runs
        );
        std::thread::sleep(Duration::from_millis(150));
    }
    let _ = child.kill();
    child.wait().unwrap();
}

/// Goal: an engine killed while RocksDB writes over a recycled log (an
/// older log's file, renamed, whose earlier records follow the new ones)
/// opens again with every acknowledged commit and a history that
/// verifies: the earlier use is where the log ends, not damage.
/// Method: run `keel demo-worker` until a log appears under a new name
/// with the inode of a log seen before and holding an earlier use past its
/// new records (a recycled one: RocksDB renames the old file), SIGKILL it
/// at once, and check that the log still holds its earlier use (RocksDB
/// cuts a log it switches away from to what it wrote, so a switch just
/// before the kill sends the test round again, on the same directory);
/// then open and verify.
#[test]
fn killed_while_writing_over_a_recycled_log_it_opens_whole() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let recycled = (0..ROUNDS_OVER_A_RECYCLED_LOG_MAX)
        .find_map(|_| kill_while_writing_over_a_recycled_log(&data))
        .expect("a kill landed while RocksDB wrote over a recycled log");
    let scan = keel_storage::wal::scan_file(&recycled).unwrap();
    assert_eq!(scan.damage, None, "{scan:?}");
    let store = RocksStore::open(&data, keel_storage::Durability::Sync).unwrap();
    let report = store.verify().unwrap();
    assert!(report.ok, "{:?}", report.violations);
    assert!(report.runs > 0);
}

/// Rounds of [`killed_while_writing_over_a_recycled_log_it_opens_whole`].
const ROUNDS_OVER_A_RECYCLED_LOG_MAX: usize = 5;

/// Runs the demo's engine on `data` until it writes over a recycled log,
/// kills it, and returns that log if it still holds its earlier use.
fn kill_while_writing_over_a_recycled_log(data: &std::path::Path) -> Option<std::path::PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let mut child = worker_of(data, 50_000).spawn().unwrap();
    wait_for_directory(data);
    let logs = || -> Vec<(std::path::PathBuf, u64)> {
        std::fs::read_dir(data)
            .map(|d| {
                d.filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| p.extension().is_some_and(|x| x == "log"))
                    .filter_map(|p| std::fs::metadata(&p).ok().map(|m| (p, m.ino())))
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut seen: std::collections::BTreeMap<u64, std::path::PathBuf> =
        std::collections::BTreeMap::new();
    let mut recycled = None;
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while recycled.is_none() && std::time::Instant::now() < deadline {
        for (path, inode) in logs() {
            match seen.insert(inode, path.clone()) {
                // Confirmed by what it holds (a freed inode can also come
                // back as a new file): the earlier use past the new writing.
                Some(before) if before != path && holds_an_earlier_use(&path) => {
                    recycled = Some(path)
                }
                _ => {}
            }
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let _ = child.kill();
    child.wait().unwrap();
    let recycled = recycled.expect("RocksDB recycled a log within 120 s");
    holds_an_earlier_use(&recycled).then_some(recycled)
}

/// The last batch of a scanned log that holds entries (priming's
/// log-only batches hold none).
fn last_commit(scan: &keel_storage::wal::WalScan) -> Option<&keel_storage::wal::WalBatch> {
    scan.batches.iter().rev().find(|b| b.count > 0)
}

/// Whether a log holds commits of its own and more than 64 KiB past the
/// last of them: the records of its earlier use, which only a recycled log
/// has. (Right after an engine's open, priming leaves a recycled log
/// holding no commit yet.)
fn holds_an_earlier_use(log: &std::path::Path) -> bool {
    keel_storage::wal::scan_file(log).is_ok_and(|scan| {
        last_commit(&scan).is_some_and(|last| scan.bytes > last.offset + 64 * 1024)
    })
}
