//! Goal: a full disk stops the store's writes loudly and recoverably: the
//! failing commit and every later one get a typed `Unwritable { NoSpace }`
//! error at once (no hang), `health()` says so, nothing acknowledged is
//! lost, and once space is freed the store accepts commits again by
//! itself. Method: a real small file system (a tmpfs mounted by the test;
//! it needs root, and is skipped with a printed reason otherwise) is
//! filled with a ballast file and then with commits until one fails; the
//! ballast is removed (RocksDB resumes once a memtable's worth, 64 MiB, is
//! free, checking every 5 s), the store is polled until healthy, and the
//! directory is reopened and compared with every acknowledged commit.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::*;
use keel_storage::{Durability, Error, RocksStore, Store, StoreHealth, WriteFault};

/// Size of the file system the test fills.
const TMPFS_MIB: u64 = 160;

/// Longest wait for the store to notice the freed space.
const RESUME_WAIT_S_MAX: u64 = 30;

struct Mount(PathBuf);

impl Mount {
    fn new(name: &str) -> Result<Mount, String> {
        if !is_root() {
            return Err("not running as root, cannot mount a tmpfs".into());
        }
        let dir =
            std::env::temp_dir().join(format!("keel-disk-full-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={TMPFS_MIB}m"), "tmpfs"])
            .arg(&dir)
            .output()
            .map_err(|e| format!("mount: {e}"))?;
        if !out.status.success() {
            let _ = std::fs::remove_dir(&dir);
            return Err(format!(
                "mount -t tmpfs failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(Mount(dir))
    }
}

impl Mount {
    /// The mount, or `None` after printing why the test skips.
    fn or_skip(name: &str) -> Option<Mount> {
        Mount::new(name)
            .map_err(|why| eprintln!("skipped: {why}"))
            .ok()
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// Writes `path` until the file system is full.
fn fill(path: &Path) {
    use std::io::Write;
    let mut f = std::fs::File::create(path).unwrap();
    let chunk = vec![0xa5u8; 256 << 10];
    while f.write_all(&chunk).is_ok() {}
    let _ = f.sync_all();
}

#[test]
fn a_full_disk_stops_commits_with_a_typed_error_and_they_resume_when_space_is_freed() {
    fill_then_free("commits", true);
}

/// The same with nothing committed after the failure: the failing commit
/// was written in place by its committer (`commit_alone`, the writer
/// thread idle), so only the writer thread's own timed probe can notice
/// the freed space.
#[test]
fn a_store_stopped_by_a_commit_written_in_place_resumes_without_more_commits() {
    fill_then_free("in-place", false);
}

/// Fills the disk under a store until a commit fails, checks the typed
/// error and the health, frees the space, waits for the store to resume
/// by itself and checks that everything acknowledged is there. With
/// `queued`, every commit goes through the writer thread and one more is
/// made while stopped; otherwise every commit is made alone (written in
/// place) and none follows the failure.
fn fill_then_free(name: &str, queued: bool) {
    let Some(mount) = Mount::or_skip(name) else {
        return;
    };
    let commit = |run: &mut RunBuilder, store: &RocksStore, kinds| match queued {
        true => run.commit(store, kinds),
        false => run.commit_alone(store, kinds),
    };
    let dir = mount.0.join("data");
    let store = RocksStore::open(&dir, Durability::Sync).unwrap();
    let mut run = RunBuilder::new(run_id(1), 100);
    let first = started(run.run, "order-1", "wf");
    commit(&mut run, &store, vec![first]).unwrap();
    let ballast = mount.0.join("ballast");
    fill(&ballast);

    // Commit until the disk refuses; count what was acknowledged.
    let payload = vec![7u8; 32 << 10];
    let mut acked = 0u64;
    let failure = loop {
        match commit(&mut run, &store, vec![signal("s", &payload)]) {
            Ok(_) => acked += 1,
            Err(e) => break e,
        }
        assert!(acked < 4 * TMPFS_MIB * 32, "the disk never filled");
    };
    assert!(
        matches!(
            failure,
            Error::Unwritable {
                fault: WriteFault::NoSpace,
                ..
            }
        ),
        "expected a typed no-space error, got: {failure}"
    );
    assert!(failure.to_string().contains("free space"), "{failure}");
    assert!(
        matches!(
            store.health(),
            StoreHealth::Stopped {
                fault: WriteFault::NoSpace,
                ..
            }
        ),
        "{}",
        store.health()
    );
    if queued {
        // Later commits fail at once with the same cause, not a hang.
        let again = run.commit(&store, vec![signal("s", b"x")]).unwrap_err();
        assert!(matches!(again, Error::Unwritable { .. }), "{again}");
    }

    // Free the space: the store notices by itself.
    std::fs::remove_file(&ballast).unwrap();
    let deadline = Instant::now() + Duration::from_secs(RESUME_WAIT_S_MAX);
    while !store.health().is_healthy() {
        if Instant::now() >= deadline {
            let log = std::fs::read_to_string(dir.join("LOG")).unwrap_or_default();
            for line in log.lines().filter(|l| {
                let l = l.to_ascii_lowercase();
                l.contains("error") || l.contains("recover") || l.contains("space")
            }) {
                eprintln!("LOG: {line}");
            }
        }
        assert!(
            Instant::now() < deadline,
            "the store did not resume within {RESUME_WAIT_S_MAX} s: {}",
            store.health()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    commit(&mut run, &store, vec![signal("after", b"y")]).expect("a commit after space was freed");
    store.close().unwrap();

    // Everything acknowledged is there, in order, and nothing else.
    let store = RocksStore::open(&dir, Durability::Sync).unwrap();
    let history = store.history(run.run).unwrap();
    assert_eq!(history.len() as u64, 1 + acked + 1);
    assert!(store.verify().unwrap().ok);
}

/// Goal: opening on a full disk, a new directory or an existing one, is a
/// typed error naming the path and what to do (or, for an existing one
/// that needs no new space, a working open), never a panic, a hang or a
/// half-made directory. Method: fill a tmpfs, then open both.
#[test]
fn opening_on_a_full_disk_is_a_typed_error_with_the_path() {
    let Some(mount) = Mount::or_skip("open") else {
        return;
    };
    let existing = mount.0.join("existing");
    drop(RocksStore::open(&existing, Durability::Sync).unwrap());
    fill(&mount.0.join("ballast"));
    let fresh = mount.0.join("fresh");
    match RocksStore::open(&fresh, Durability::Sync) {
        Err(
            e @ Error::Unwritable {
                fault: WriteFault::NoSpace,
                ..
            },
        ) => {
            let text = e.to_string();
            assert!(
                text.contains("fresh") && text.contains("free space"),
                "{text}"
            );
        }
        Err(other) => panic!("expected a typed no-space error, got: {other}"),
        Ok(_) => panic!("a new directory opened on a full disk"),
    }
    assert!(
        !fresh.join("CURRENT").exists(),
        "no half-made directory is left at the path"
    );
    match RocksStore::open(&existing, Durability::Sync) {
        Ok(store) => assert!(store.verify().unwrap().ok),
        Err(Error::Unwritable {
            fault: WriteFault::NoSpace,
            ..
        }) => {}
        Err(other) => panic!("expected a typed no-space error, got: {other}"),
    }
    // Space freed: both open.
    std::fs::remove_file(mount.0.join("ballast")).unwrap();
    drop(RocksStore::open(&fresh, Durability::Sync).unwrap());
    drop(RocksStore::open(&existing, Durability::Sync).unwrap());
}
