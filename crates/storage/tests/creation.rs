// Goal: creating a data directory is atomic. A new directory is complete
// and private when it appears; what a killed creation left behind is
// removed by the next read-write open; a directory an older build left
// half-made (RocksDB files, some of keel's families, no data) is completed
// instead of refused, while one holding data stays refused.
// Method: real stores in tempdirs; the leftovers are made by hand the way a
// killed process leaves them (the kill itself is tested end to end in
// crates/cli/tests/crash.rs), and so are the directories older builds'
// secondaries left when their process was killed.

use crate::common::*;
use keel_storage::{Durability, Error, RocksStore, Store};

fn leftovers(parent: &std::path::Path) -> Vec<String> {
    std::fs::read_dir(parent)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".keel-creating."))
        .collect()
}

#[test]
fn a_new_directory_appears_complete_and_private() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("nested").join("data");
    let store = RocksStore::open(&data, Durability::Sync).unwrap();
    let mut run = RunBuilder::new(run_id(1), 1_000);
    run.commit(&store, vec![started(run.run, "i-1", "wf")])
        .unwrap();
    store.close().unwrap();
    assert!(leftovers(data.parent().unwrap()).is_empty());
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&data).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700, "only its owner may read workflow data");
    }
    let store = RocksStore::open(&data, Durability::Sync).unwrap();
    assert_eq!(store.history(run.run).unwrap().len(), 1);
    // Every file there is, once a read-write open is done, is its owner's
    // only (the test's umask would make new ones 0644).
    #[cfg(unix)]
    for entry in std::fs::read_dir(&data).unwrap() {
        use std::os::unix::fs::PermissionsExt;
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            let mode = entry.metadata().unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{:?}", entry.file_name());
        }
    }
}

#[test]
fn what_a_killed_creation_left_is_removed() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    // A process id that cannot be running (above the kernel's limit).
    let leftover = dir.path().join(".data.keel-creating.4294967294");
    std::fs::create_dir(&leftover).unwrap();
    std::fs::write(leftover.join("CURRENT"), b"MANIFEST-000001\n").unwrap();
    let store = RocksStore::open(&data, Durability::Sync).unwrap();
    assert!(
        leftovers(dir.path()).is_empty(),
        "{:?}",
        leftovers(dir.path())
    );
    drop(store);
    RocksStore::open(&data, Durability::Sync).unwrap();
}

#[test]
fn a_half_made_directory_without_data_is_completed() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    {
        // What an older build's killed creation left: RocksDB's files and
        // some of keel's families, no store metadata, no keys.
        let mut opts = rocksdb::Options::default();
        opts.create_if_missing(true);
        opts.create_missing_column_families(true);
        rocksdb::DB::open_cf(&opts, &data, ["events", "runs"]).unwrap();
    }
    let err = RocksStore::open_read_only(&data).unwrap_err();
    assert!(matches!(err, Error::NotKeel { .. }), "{err}");
    let store = RocksStore::open(&data, Durability::Sync).unwrap();
    let mut run = RunBuilder::new(run_id(1), 1_000);
    run.commit(&store, vec![started(run.run, "i-1", "wf")])
        .unwrap();
    assert!(store.verify().unwrap().ok);
    drop(store);
    RocksStore::open_read_only(&data).unwrap();

    // With data in it, it is not keel's to complete.
    let other = dir.path().join("other");
    {
        let mut opts = rocksdb::Options::default();
        opts.create_if_missing(true);
        opts.create_missing_column_families(true);
        let db = rocksdb::DB::open_cf(&opts, &other, ["events"]).unwrap();
        db.put(b"someone's", b"data").unwrap();
    }
    let err = RocksStore::open(&other, Durability::Sync).unwrap_err();
    assert!(matches!(err, Error::NotKeel { .. }), "{err}");
}

#[test]
fn a_killed_secondary_s_directory_from_an_older_build_is_removed_by_the_next_start() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    drop(RocksStore::open(&data, Durability::Sync).unwrap());
    // What an older build's inspection command, killed while it followed
    // the writer as a secondary, left (its process id cannot be running):
    // in the per-user scratch dir, and where still older builds put them.
    let uid = {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata("/proc/self").unwrap().uid()
    };
    let private_dir = |d: &std::path::Path| {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new().mode(0o700).create(d).is_ok()
    };
    let scratch = std::env::temp_dir().join(format!("keel-scratch-{uid}"));
    let made_scratch = private_dir(&scratch);
    let dead = scratch.join("secondary-4294967294-left");
    let old = std::env::temp_dir().join("keel-secondary-4294967294-left");
    for d in [&dead, &old] {
        std::fs::create_dir_all(d.join("inside")).unwrap();
    }
    // And in the scratch directory of older builds, when it is one private
    // to this user.
    let old_scratch = std::env::temp_dir().join(format!("keel-{uid}"));
    let made_old_scratch = private_dir(&old_scratch);
    let in_old_scratch = {
        // As the store decides it: a directory itself (not a link), ours,
        // and closed to others.
        let private = std::fs::symlink_metadata(&old_scratch).is_ok_and(|m| {
            use std::os::unix::fs::MetadataExt;
            m.is_dir() && m.uid() == uid && m.mode() & 0o077 == 0
        });
        private.then(|| old_scratch.join("secondary-4294967294-older"))
    };
    if let Some(d) = &in_old_scratch {
        std::fs::create_dir_all(d.join("inside")).unwrap();
    }
    let _writer = RocksStore::open(&data, Durability::Sync).unwrap();
    if scratch_is_private(&scratch, uid) {
        assert!(!dead.exists(), "the dead secondary's directory is removed");
    }
    assert!(!old.exists(), "an older build's leftover is removed");
    if let Some(d) = &in_old_scratch {
        assert!(
            !d.exists(),
            "a leftover in the old scratch directory is removed"
        );
    }
    // Made here only for the check: not left behind.
    if made_old_scratch {
        let _ = std::fs::remove_dir(&old_scratch);
    }
    if made_scratch {
        let _ = std::fs::remove_dir(&scratch);
    }
}

fn scratch_is_private(dir: &std::path::Path, uid: u32) -> bool {
    std::fs::symlink_metadata(dir).is_ok_and(|m| {
        use std::os::unix::fs::MetadataExt;
        m.is_dir() && m.uid() == uid && m.mode() & 0o077 == 0
    })
}
