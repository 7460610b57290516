// Goal: every way of opening a RocksDB data directory behaves as documented:
// one exclusive writer (a second gets `Error::Locked`, even in the same
// process), read-only beside a live writer (a snapshot as of its open, also
// over a recycled log), checkpoints, reopen after
// close, and typed refusals for a missing directory, a foreign directory and
// another schema version.
// Method: real stores in tempdirs; the schema-version case writes the store
// metadata record directly through the `rocksdb` crate after closing.

use std::path::Path;

use crate::common::*;
use keel_storage::codec::{self, RecordKind};
use keel_storage::keys::{Cf, STORE_META_KEY};
use keel_storage::{
    CommitBatch, Durability, DurableKey, Error, OpenMode, RocksStore, Store, StoreMeta,
    SCHEMA_VERSION, SCHEMA_VERSION_READ_AS_IS,
};

/// A writer holding two runs: one closed, one open.
fn populated(path: &Path) -> (RocksStore, RunBuilder, RunBuilder) {
    let store = RocksStore::open(path, Durability::Sync).unwrap();
    let mut a = RunBuilder::new(run_id(1), 100);
    a.commit(&store, vec![started(a.run, "a", "wf"), scheduled(a.run, 1)])
        .unwrap();
    a.commit(&store, vec![completed(a.run, 1, 1), workflow_completed()])
        .unwrap();
    let mut b = RunBuilder::new(run_id(2), 200);
    b.commit(
        &store,
        vec![started(b.run, "b", "wf"), timer_started(1, 9_000)],
    )
    .unwrap();
    (store, a, b)
}

#[test]
fn second_writer_is_locked_out_even_in_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _, _) = populated(dir.path());
    let err = RocksStore::open(dir.path(), Durability::Sync).unwrap_err();
    assert!(
        matches!(&err, Error::Locked { path } if path == dir.path()),
        "{err}"
    );
    assert!(
        err.to_string().contains("read-only"),
        "the message says what to do: {err}"
    );
    // Read-only opens are still allowed beside it.
    RocksStore::open_read_only(dir.path()).unwrap();
    // Once the writer closes, a new writer may open.
    store.close().unwrap();
    let again = RocksStore::open(dir.path(), Durability::Sync).unwrap();
    assert_eq!(again.mode(), OpenMode::ReadWrite);
}

#[test]
fn read_only_sees_what_was_committed_before_it_opened() {
    let dir = tempfile::tempdir().unwrap();
    let (writer, a, mut b) = populated(dir.path());
    let reader = RocksStore::open_read_only(dir.path()).unwrap();
    assert_eq!(reader.mode(), OpenMode::ReadOnly);
    assert_eq!(
        reader.history(a.run).unwrap(),
        writer.history(a.run).unwrap()
    );
    assert_eq!(reader.history(b.run).unwrap().len(), 2);
    assert_eq!(
        reader
            .due_timers(keel_storage::Timestamp(u64::MAX), 10)
            .unwrap()
            .len(),
        1
    );
    // Later commits are not in its snapshot.
    b.commit(&writer, vec![signal("later", b"x")]).unwrap();
    assert_eq!(reader.history(b.run).unwrap().len(), 2);
    // It refuses writes with a typed error.
    let err = reader
        .commit(CommitBatch::append(
            b.run,
            vec![ev(4, 1, signal("s", b"x"))],
        ))
        .wait()
        .unwrap_err();
    assert!(matches!(err, Error::ReadOnly), "{err}");
    reader.sync().unwrap();
    let report = reader.verify().unwrap();
    assert!(report.ok, "{:?}", report.violations);
    assert_eq!((report.runs, report.events), (2, 6));
}

/// Each open beside the writer is a fresh look: it sees everything
/// committed before it, also after flushes, when the writer's current log
/// is a recycled one (an older log's file written again, whose earlier
/// records follow the new ones: RocksDB's secondary instances loop forever
/// there, which is why inspection opens read-only).
#[test]
fn read_only_opens_beside_the_writer_see_what_it_committed_before_them() {
    let dir = tempfile::tempdir().unwrap();
    let (writer, _, mut b) = populated(dir.path());
    b.commit(&writer, vec![signal("one", b"1"), signal("two", b"2")])
        .unwrap();
    let c = run_id(3);
    commit(&writer, c, vec![ev(1, 300, started(c, "c", "wf"))]).unwrap();
    let reader = RocksStore::open_read_only(dir.path()).unwrap();
    assert_eq!(
        reader.history(b.run).unwrap(),
        writer.history(b.run).unwrap()
    );
    assert_eq!(reader.run_meta(c).unwrap(), writer.run_meta(c).unwrap());
    drop(reader);
    // Across two flushes: the log now written is the first one's file.
    for round in 0..3u32 {
        for i in 0..200u32 {
            b.commit(
                &writer,
                vec![signal("more", &(round * 1_000 + i).to_le_bytes())],
            )
            .unwrap();
        }
        if round < 2 {
            writer.flush().unwrap();
        }
    }
    let reader = RocksStore::open_read_only(dir.path()).unwrap();
    assert_eq!(reader.history(b.run).unwrap().len(), 4 + 600);
    assert_eq!(
        reader.history(b.run).unwrap(),
        writer.history(b.run).unwrap()
    );
    let err = reader
        .commit(CommitBatch::append(c, vec![ev(2, 1, signal("s", b"x"))]))
        .wait()
        .unwrap_err();
    assert!(matches!(err, Error::ReadOnly), "{err}");
    assert!(reader.verify().unwrap().ok);
}

#[test]
fn checkpoint_opens_and_holds_the_same_histories() {
    let dir = tempfile::tempdir().unwrap();
    let (writer, a, mut b) = populated(dir.path());
    let cp_dir = tempfile::tempdir().unwrap();
    let cp = cp_dir.path().join("checkpoint");
    writer.checkpoint(&cp).unwrap();
    // Commits after the checkpoint are not in it.
    b.commit(&writer, vec![signal("after", b"x")]).unwrap();
    let copy = RocksStore::open_read_only(&cp).unwrap();
    assert_eq!(copy.history(a.run).unwrap(), writer.history(a.run).unwrap());
    assert_eq!(copy.history(b.run).unwrap().len(), 2);
    assert!(copy.verify().unwrap().ok);
    drop(copy);
    // A checkpoint is a full store: it opens read-write and takes commits.
    let rw = RocksStore::open(&cp, Durability::Sync).unwrap();
    let mut b2 = b.clone();
    b2.next = 3;
    b2.commit(&rw, vec![signal("fork", b"y")]).unwrap();
    assert_eq!(rw.history(b.run).unwrap().len(), 3);
    // An existing target directory is refused.
    assert!(writer.checkpoint(&cp).is_err());
}

#[test]
fn reopen_after_close_keeps_everything() {
    for durability in [Durability::Sync, Durability::Buffered] {
        let dir = tempfile::tempdir().unwrap();
        let (store, a, b) = populated(dir.path());
        let before = dump(&store);
        let histories = (store.history(a.run).unwrap(), store.history(b.run).unwrap());
        store.close().unwrap();
        let store = RocksStore::open(dir.path(), durability).unwrap();
        assert_eq!(store.durability(), durability);
        assert_eq!(dump(&store), before);
        assert_eq!(
            (store.history(a.run).unwrap(), store.history(b.run).unwrap()),
            histories
        );
        // The reopened store continues the open run's seqs.
        let mut b = b.clone();
        b.commit(&store, vec![signal("after-reopen", b"x")])
            .unwrap();
        store.sync().unwrap();
        drop(store);
        let store = RocksStore::open_read_only(dir.path()).unwrap();
        assert_eq!(store.history(b.run).unwrap().len(), 3);
        assert!(store.verify().unwrap().ok);
    }
}

#[test]
fn missing_and_foreign_directories_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope");
    let err = RocksStore::open_read_only(&missing).unwrap_err();
    assert!(
        matches!(&err, Error::NotFound { path } if path == &missing),
        "{err}"
    );
    assert!(
        !missing.exists(),
        "a read-only open must not create the directory"
    );

    let foreign = dir.path().join("foreign");
    std::fs::create_dir(&foreign).unwrap();
    std::fs::write(foreign.join("notes.txt"), b"hello").unwrap();
    let err = RocksStore::open_read_only(&foreign).unwrap_err();
    assert!(
        matches!(&err, Error::NotKeel { path, .. } if path == &foreign),
        "{err}"
    );
    let err = RocksStore::open(&foreign, Durability::Sync).unwrap_err();
    assert!(matches!(err, Error::NotKeel { .. }), "{err}");
    assert_eq!(
        std::fs::read_dir(&foreign).unwrap().count(),
        1,
        "nothing created"
    );

    // A file where a directory should be.
    let err = RocksStore::open_read_only(foreign.join("notes.txt")).unwrap_err();
    assert!(matches!(err, Error::NotKeel { .. }), "{err}");

    // A RocksDB directory that is not keel's.
    let other = dir.path().join("other-rocks");
    {
        let mut opts = rocksdb::Options::default();
        opts.create_if_missing(true);
        let db = rocksdb::DB::open(&opts, &other).unwrap();
        db.put(b"k", b"v").unwrap();
    }
    let err = RocksStore::open_read_only(&other).unwrap_err();
    assert!(matches!(err, Error::NotKeel { .. }), "{err}");
    let err = RocksStore::open(&other, Durability::Sync).unwrap_err();
    assert!(matches!(err, Error::NotKeel { .. }), "{err}");

    // An empty directory opens read-write as a new store.
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    RocksStore::open(&empty, Durability::Sync).unwrap();
}

/// Overwrites the store metadata record of a closed store.
fn write_store_meta(path: &Path, bytes: Vec<u8>) {
    let opts = rocksdb::Options::default();
    let names = rocksdb::DB::list_cf(&opts, path).unwrap();
    let db = rocksdb::DB::open_cf(&opts, path, &names).unwrap();
    let cf = db.cf_handle(Cf::Meta.name()).unwrap();
    db.put_cf(&cf, STORE_META_KEY, bytes).unwrap();
}

/// Records an older schema version in a closed directory's metadata, and
/// checks that inspection then refuses it, naming both versions and
/// saying that an engine's open migrates it.
fn mark_older_schema(path: &Path, version: u32) {
    let old = StoreMeta {
        format: "keel".into(),
        schema_version: version,
        created_by: format!("keel 0.1.0 (schema {version})"),
    };
    write_store_meta(path, codec::encode(RecordKind::StoreMeta, &old).unwrap());
    let err = RocksStore::open_read_only(path).unwrap_err();
    assert!(
        matches!(err, Error::SchemaVersion { found, expected }
            if found == version && expected == SCHEMA_VERSION),
        "{err}"
    );
    assert!(err.to_string().contains("migrates"), "{err}");
}

#[test]
fn another_schema_version_is_refused_naming_both() {
    let dir = tempfile::tempdir().unwrap();
    let (store, _, _) = populated(dir.path());
    store.close().unwrap();
    let meta = StoreMeta {
        format: "keel".into(),
        schema_version: 99,
        created_by: "keel from the future".into(),
    };
    write_store_meta(
        dir.path(),
        codec::encode(RecordKind::StoreMeta, &meta).unwrap(),
    );
    let opens: [fn(&Path) -> keel_storage::Result<RocksStore>; 2] = [
        |p| RocksStore::open(p, Durability::Sync),
        |p| RocksStore::open_read_only(p),
    ];
    for open in opens {
        let err = open(dir.path()).unwrap_err();
        assert!(
            matches!(err, Error::SchemaVersion { found: 99, expected } if expected == SCHEMA_VERSION),
            "{err}"
        );
        let text = err.to_string();
        assert!(
            text.contains("99") && text.contains(&SCHEMA_VERSION.to_string()),
            "{text}"
        );
    }

    // Another format name, and undecodable metadata: not keel.
    let foreign = StoreMeta {
        format: "other".into(),
        schema_version: SCHEMA_VERSION,
        created_by: "x".into(),
    };
    write_store_meta(
        dir.path(),
        codec::encode(RecordKind::StoreMeta, &foreign).unwrap(),
    );
    let err = RocksStore::open_read_only(dir.path()).unwrap_err();
    assert!(matches!(err, Error::NotKeel { .. }), "{err}");
    write_store_meta(dir.path(), b"garbage".to_vec());
    let err = RocksStore::open(dir.path(), Durability::Sync).unwrap_err();
    assert!(matches!(err, Error::NotKeel { .. }), "{err}");
}

#[test]
fn commits_queued_before_close_are_answered() {
    let dir = tempfile::tempdir().unwrap();
    let store = RocksStore::open(dir.path(), Durability::Buffered).unwrap();
    let run = run_id(1);
    commit(&store, run, vec![ev(1, 1, started(run, "q", "wf"))]).unwrap();
    let handles: Vec<_> = (2..50u64)
        .map(|seq| {
            store.commit(CommitBatch::append(
                run,
                vec![ev(seq, seq, signal("s", b"x"))],
            ))
        })
        .collect();
    store.close().unwrap();
    for h in handles {
        h.wait().unwrap();
    }
    let store = RocksStore::open_read_only(dir.path()).unwrap();
    assert_eq!(store.history(run).unwrap().len(), 49);
}

/// Finds `needle` in the `.sst` files of `dir`: (file, offset) of each hit.
pub(crate) fn find_in_ssts(dir: &Path, needle: &[u8]) -> Vec<(std::path::PathBuf, usize)> {
    let mut hits = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "sst") {
            let bytes = std::fs::read(&path).unwrap();
            for (i, w) in bytes.windows(needle.len()).enumerate() {
                if w == needle {
                    hits.push((path.clone(), i));
                }
            }
        }
    }
    hits
}

#[test]
fn damaged_table_at_open_is_not_reported_as_locked() {
    // RocksDB reads each table's properties block when it opens; a damaged
    // one fails the open with "block checksum mismatch". That is corruption,
    // not another writer holding the lock.
    let dir = tempfile::tempdir().unwrap();
    let (store, _, _) = populated(dir.path());
    store.flush().unwrap();
    store.close().unwrap();
    let hits = find_in_ssts(dir.path(), b"leveldb.BytewiseComparator");
    assert!(!hits.is_empty(), "no table properties found");
    let (file, at) = &hits[0];
    let mut bytes = std::fs::read(file).unwrap();
    bytes[at + 10] ^= 0x20;
    std::fs::write(file, bytes).unwrap();
    for err in [
        RocksStore::open(dir.path(), Durability::Sync).unwrap_err(),
        RocksStore::open_read_only(dir.path()).unwrap_err(),
    ] {
        assert!(
            !matches!(err, Error::Locked { .. }),
            "damage reported as a lock: {err}"
        );
        assert!(err.to_string().contains("checksum"), "{err}");
    }
}

const HOLD_DIR_VAR: &str = "KEEL_TEST_HOLD_DIR";
const READY_LINE: &str = "keel-test-writer-ready";

/// Not a test on its own: the child process of
/// `second_writer_in_another_process_is_locked_out`. It opens the store
/// named by `KEEL_TEST_HOLD_DIR`, says so on stdout and holds it until its
/// stdin closes.
#[test]
#[ignore = "helper process for second_writer_in_another_process_is_locked_out"]
fn helper_hold_writer_open() {
    let dir = std::env::var(HOLD_DIR_VAR).expect("run by the parent test only");
    let store = RocksStore::open(dir, Durability::Sync).unwrap();
    println!("{READY_LINE}");
    std::io::Write::flush(&mut std::io::stdout()).unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut std::io::stdin(), &mut rest).unwrap();
    store.close().unwrap();
}

#[test]
fn second_writer_in_another_process_is_locked_out() {
    use std::io::BufRead;
    use std::process::{Command, Stdio};
    let dir = tempfile::tempdir().unwrap();
    populated(dir.path()).0.close().unwrap();
    // The helper's name as the test harness knows it: its module path
    // without the crate's name.
    let module = module_path!().split_once("::").map_or("", |(_, m)| m);
    let helper = format!("{module}::helper_hold_writer_open");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", &helper, "--ignored", "--nocapture"])
        .env(HOLD_DIR_VAR, dir.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = lines.by_ref().any(|l| l.unwrap().trim() == READY_LINE);
    assert!(ready, "helper process did not open the store");
    let err = RocksStore::open(dir.path(), Durability::Sync).unwrap_err();
    let read_only = RocksStore::open_read_only(dir.path()).map(|s| s.history(run_id(1)));
    drop(child.stdin.take());
    // Keep reading so the helper can print its own test summary.
    lines.for_each(drop);
    assert!(child.wait().unwrap().success());
    assert!(matches!(err, Error::Locked { .. }), "{err}");
    assert_eq!(read_only.unwrap().unwrap().len(), 4);
    // After the other process exits, the lock is free.
    RocksStore::open(dir.path(), Durability::Sync).unwrap();
}

#[test]
fn an_older_schema_is_refused_read_only_and_migrated_by_a_read_write_open() {
    // Goal: a directory written by a release whose records this build does
    // not read as they are (schema 3) still opens: inspection is refused
    // with a typed error saying an engine's open migrates it, and a
    // read-write open re-derives its state and records the current schema,
    // losing nothing. Method: a populated directory whose store metadata
    // is rewritten to schema 3.
    let dir = tempfile::tempdir().unwrap();
    let (store, a, b) = populated(dir.path());
    let before = (
        store.run_meta(a.run).unwrap(),
        store.run_meta(b.run).unwrap(),
        store.history(b.run).unwrap(),
    );
    store.close().unwrap();
    mark_older_schema(dir.path(), SCHEMA_VERSION_READ_AS_IS - 1);

    let store = RocksStore::open(dir.path(), Durability::Sync).unwrap();
    let after = (
        store.run_meta(a.run).unwrap(),
        store.run_meta(b.run).unwrap(),
        store.history(b.run).unwrap(),
    );
    assert_eq!(after, before);
    store.close().unwrap();
    // Migrated: inspection opens it now.
    let store = RocksStore::open_read_only(dir.path()).unwrap();
    assert_eq!(store.history(b.run).unwrap(), before.2);
}

#[test]
fn a_schema_4_directory_is_read_as_it_is_and_migrated_in_place() {
    // Goal: schema 5 changed only how records are written (positionally,
    // without field names), so a directory of schema 4, whose derived
    // records are maps, is migrated without rewriting a record: every
    // record reads back as before, `verify` finds the stored maps equal to
    // what it rebuilds, and later commits of its runs work. Schema 6 wrote
    // no attempt row beside its execution's: the map-encoded one a schema
    // 4 build wrote for run a's completed activity is deleted. A schema 4
    // build cannot read what this one writes, so inspection of the old
    // directory is refused until an engine's open migrates it.
    // Method: a populated directory whose derived records and store
    // metadata are rewritten as a schema 4 build wrote them.
    let dir = tempfile::tempdir().unwrap();
    let (store, a, mut b) = populated(dir.path());
    let before = (
        store.run_meta(a.run).unwrap(),
        store.run_meta(b.run).unwrap(),
        store.run_timers(b.run).unwrap(),
        store
            .instance(&keel_storage::InstanceId("b".into()))
            .unwrap(),
    );
    assert!(before.1.is_some() && !before.2.is_empty() && before.3.is_some());
    store.close().unwrap();
    {
        let opts = rocksdb::Options::default();
        let names = rocksdb::DB::list_cf(&opts, dir.path()).unwrap();
        let db = rocksdb::DB::open_cf(&opts, dir.path(), &names).unwrap();
        let mut rewritten = 0;
        for cf in [
            Cf::Runs,
            Cf::Instances,
            Cf::Dedupe,
            Cf::Timers,
            Cf::RunTimers,
        ] {
            let h = db.cf_handle(cf.name()).unwrap();
            let rows: Vec<_> = db
                .iterator_cf(&h, rocksdb::IteratorMode::Start)
                .map(Result::unwrap)
                .collect();
            for (k, v) in rows {
                assert!(
                    !body_is_map(&v),
                    "this build writes {} positionally",
                    cf.name()
                );
                let old = match cf {
                    Cf::Runs => as_schema_4(
                        RecordKind::Run,
                        &codec::decode::<keel_storage::RunMeta>(RecordKind::Run, &v).unwrap(),
                    ),
                    Cf::Instances => as_schema_4(
                        RecordKind::Instance,
                        &codec::decode::<keel_storage::InstanceMeta>(RecordKind::Instance, &v)
                            .unwrap(),
                    ),
                    Cf::Dedupe => as_schema_4(
                        RecordKind::Dedupe,
                        &codec::decode::<keel_storage::state::DedupeEntry>(RecordKind::Dedupe, &v)
                            .unwrap(),
                    ),
                    _ => as_schema_4(
                        RecordKind::Timer,
                        &codec::decode::<keel_storage::TimerEntry>(RecordKind::Timer, &v).unwrap(),
                    ),
                };
                assert!(body_is_map(&old));
                db.put_cf(&h, k, old).unwrap();
                rewritten += 1;
            }
        }
        assert!(rewritten >= 6, "{rewritten} records rewritten");
        let h = db.cf_handle(Cf::Dedupe.name()).unwrap();
        let step = keel_storage::Step(1);
        let execution = keel_storage::keys::dedupe_key(a.run, &DurableKey::Execution(step));
        let map = db
            .get_cf(&h, execution)
            .unwrap()
            .expect("the execution's row");
        assert!(body_is_map(&map));
        let attempt = DurableKey::Attempt(step, keel_storage::AttemptNo(1));
        db.put_cf(&h, keel_storage::keys::dedupe_key(a.run, &attempt), map)
            .unwrap();
    }
    mark_older_schema(dir.path(), SCHEMA_VERSION_READ_AS_IS);

    let store = RocksStore::open(dir.path(), Durability::Sync).unwrap();
    let after = (
        store.run_meta(a.run).unwrap(),
        store.run_meta(b.run).unwrap(),
        store.run_timers(b.run).unwrap(),
        store
            .instance(&keel_storage::InstanceId("b".into()))
            .unwrap(),
    );
    assert_eq!(after, before);
    let report = store.verify().unwrap();
    assert!(
        report.ok,
        "stored maps equal the rebuilt records: {report:?}"
    );
    // The open run carries on: its next commit reads and rewrites its map.
    b.commit(&store, vec![workflow_completed()]).unwrap();
    assert!(store.verify().unwrap().ok);
    store.close().unwrap();
    let store = RocksStore::open_read_only(dir.path()).unwrap();
    assert_eq!(
        store.run_meta(b.run).unwrap().unwrap().status,
        keel_storage::RunStatus::Completed
    );
    drop(store);
    // The migration rewrote nothing (a rebuild would have re-encoded every
    // record, and verify would then never have compared a map): run a's
    // record is still the map written above; run b's, written again by its
    // commit, is positional.
    let opts = rocksdb::Options::default();
    let names = rocksdb::DB::list_cf(&opts, dir.path()).unwrap();
    let db = rocksdb::DB::open_cf_for_read_only(&opts, dir.path(), &names, false).unwrap();
    let runs = db.cf_handle(Cf::Runs.name()).unwrap();
    let record = |run: keel_storage::RunId| db.get_cf(&runs, run.as_bytes()).unwrap().unwrap();
    assert!(body_is_map(&record(a.run)), "untouched by the migration");
    assert!(!body_is_map(&record(b.run)), "written again by this build");
}

/// The index keys a schema 6 build wrote beside the ones this build
/// writes, for a run of type "wf": its key by type alone and its key among
/// every run.
fn schema_6_index_keys(meta: &keel_storage::RunMeta) -> [Vec<u8>; 2] {
    let mut tail = (u64::MAX - meta.started_at.0).to_be_bytes().to_vec();
    tail.extend_from_slice(meta.run_id.as_bytes());
    assert_eq!(meta.workflow_type.as_str(), "wf");
    [
        [&b"Twf\0\x01"[..], &tail].concat(),
        [&b"R"[..], &tail].concat(),
    ]
}

#[test]
fn a_schema_6_directory_loses_its_index_keys_by_type_and_of_every_run() {
    // Goal: schema 7 lists runs of a type, and every run, by reading the
    // status indexes across every status, so the keys a schema 6 build
    // wrote for those two lists are deleted by an engine's open: `verify`
    // (which compares the index with what it rebuilds) finds the directory
    // clean, no such key is left, and both lists still find every run,
    // newest first. Method: a populated directory given the two extra keys
    // per run a schema 6 build wrote, and its metadata set to schema 6.
    let dir = tempfile::tempdir().unwrap();
    let (store, a, b) = populated(dir.path());
    let metas = [
        store.run_meta(a.run).unwrap().unwrap(),
        store.run_meta(b.run).unwrap().unwrap(),
    ];
    store.close().unwrap();
    let index_keys = |path: &Path| -> Vec<Vec<u8>> {
        let opts = rocksdb::Options::default();
        let names = rocksdb::DB::list_cf(&opts, path).unwrap();
        let db = rocksdb::DB::open_cf_for_read_only(&opts, path, &names, false).unwrap();
        let h = db.cf_handle(Cf::Index.name()).unwrap();
        db.iterator_cf(&h, rocksdb::IteratorMode::Start)
            .map(|kv| kv.unwrap().0.to_vec())
            .collect()
    };
    let current = index_keys(dir.path());
    {
        let opts = rocksdb::Options::default();
        let names = rocksdb::DB::list_cf(&opts, dir.path()).unwrap();
        let db = rocksdb::DB::open_cf(&opts, dir.path(), &names).unwrap();
        let h = db.cf_handle(Cf::Index.name()).unwrap();
        for meta in &metas {
            for k in schema_6_index_keys(meta) {
                assert!(!current.contains(&k), "this build does not write it");
                db.put_cf(&h, k, b"").unwrap();
            }
        }
    }
    assert_eq!(index_keys(dir.path()).len(), current.len() + 4);
    mark_older_schema(dir.path(), 6);

    let store = RocksStore::open(dir.path(), Durability::Sync).unwrap();
    let report = store.verify().unwrap();
    assert!(report.ok, "the old keys are gone: {report:?}");
    let newest_first = vec![b.run, a.run];
    let ids = |runs: Vec<keel_storage::RunMeta>| -> Vec<keel_storage::RunId> {
        runs.into_iter().map(|m| m.run_id).collect()
    };
    let of_type = keel_storage::search::RunFilter::all().workflow_type("wf");
    assert_eq!(ids(store.runs(&of_type).unwrap()), newest_first);
    let every = keel_storage::search::RunFilter::all();
    assert_eq!(ids(store.runs(&every).unwrap()), newest_first);
    store.close().unwrap();
    assert_eq!(index_keys(dir.path()), current);
}

/// Goal: a history read once (how `describe` streams a run's whole history)
/// leaves the block cache as it found it, so a long history neither evicts
/// the engine's working set nor grows the process up to the cache's bound;
/// an ordinary read of the same history does fill it.
/// Method: a run of 4,001 events flushed to a table file, read with
/// `for_each_event_once` and then `for_each_event`, the block cache's usage
/// taken from `Store::memory` before and after each.
#[test]
fn a_history_read_once_leaves_the_block_cache_alone() {
    let dir = tempfile::tempdir().unwrap();
    let store = RocksStore::open(dir.path(), Durability::Sync).unwrap();
    let mut r = RunBuilder::new(run_id(7), 100);
    r.commit(&store, vec![started(r.run, "long", "wf")])
        .unwrap();
    for chunk in 0..40u32 {
        let kinds = (0..100u32)
            .map(|i| signal("tick", &[(chunk * 100 + i) as u8; 64]))
            .collect();
        r.commit(&store, kinds).unwrap();
    }
    store.flush().unwrap();
    let cached = |s: &RocksStore| s.memory().unwrap().block_cache_bytes;
    let before = cached(&store);
    let mut once = 0u64;
    store
        .for_each_event_once(r.run, keel_storage::Seq::FIRST, &mut |_| {
            once += 1;
            true
        })
        .unwrap();
    assert_eq!(once, 4_001, "every event is read");
    assert_eq!(cached(&store), before, "nothing read once is kept");
    let mut again = 0u64;
    store
        .for_each_event(r.run, keel_storage::Seq::FIRST, &mut |_| {
            again += 1;
            true
        })
        .unwrap();
    assert_eq!(again, 4_001);
    assert!(
        cached(&store) > before + 64 * 1024,
        "an ordinary read caches the blocks it read: {} -> {}",
        before,
        cached(&store)
    );
}

#[test]
fn a_schema_5_directory_loses_only_the_attempt_rows_its_executions_stand_for() {
    // Goal: schema 6 no longer writes an attempt's dedupe row beside its
    // execution's when the attempt's result closes the execution. A
    // directory of schema 5 holds such rows; an engine's open deletes them
    // (`verify` would report them as rows nothing derives) and keeps every
    // other row, a retried attempt's included; each attempt still reads as
    // committed at its result, and inspection opens the directory again.
    // Method: a run closing its three executions in each way
    // (`closed_three_ways`); the rows a schema 5 build wrote beside each
    // execution's (the same bytes) are put back through the `rocksdb`
    // crate, the version set to 5, and the directory opened.
    let dir = tempfile::tempdir().unwrap();
    let store = RocksStore::open(dir.path(), Durability::Sync).unwrap();
    let (run, closing) = closed_three_ways(&store, 9);
    let written = dedupe_rows(&store);
    let retried = keel_storage::keys::dedupe_key(
        run,
        &DurableKey::Attempt(keel_storage::Step(2), keel_storage::AttemptNo(1)),
    );
    assert!(
        written.iter().any(|(k, _)| *k == retried),
        "a retried attempt keeps its row"
    );
    store.close().unwrap();
    {
        let opts = rocksdb::Options::default();
        let names = rocksdb::DB::list_cf(&opts, dir.path()).unwrap();
        let db = rocksdb::DB::open_cf(&opts, dir.path(), &names).unwrap();
        let h = db.cf_handle(Cf::Dedupe.name()).unwrap();
        for (step, attempt, _) in &closing {
            let step = keel_storage::Step(*step);
            let execution = keel_storage::keys::dedupe_key(run, &DurableKey::Execution(step));
            let value = db
                .get_cf(&h, execution)
                .unwrap()
                .expect("the execution's row");
            let key = DurableKey::Attempt(step, keel_storage::AttemptNo(*attempt));
            db.put_cf(&h, keel_storage::keys::dedupe_key(run, &key), value)
                .unwrap();
        }
    }
    mark_older_schema(dir.path(), 5);

    let store = RocksStore::open(dir.path(), Durability::Sync).unwrap();
    assert_eq!(dedupe_rows(&store), written, "only the planted rows went");
    assert_migrated_attempts(&store, run, &closing);
    store.close().unwrap();
    RocksStore::open_read_only(dir.path()).unwrap();
}

// Priming (`RocksStore::prime_logs`, what an engine does after its open):
// the log in use afterwards is an earlier log's file written again, so the
// first commits write over it instead of growing a new file; the store
// holds exactly what it held; commits after it land; a crash image taken
// then (the recycled log holding new commits over the filler of its earlier
// use) and a clean reopen both open whole, with keel's own log reading
// finding no damage. A read-only store is left alone.
#[test]
fn primed_logs_are_written_over_and_change_nothing_in_the_store() {
    use keel_storage::rocks::{PRIMED_LOG_BYTES, PRIME_ROUNDS_MAX};
    use keel_storage::wal;

    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let (store, a, mut b) = populated(&data);
    let before = dump(&store);
    let report = store.prime_logs().unwrap();
    assert!(report.primed, "{report:?}");
    assert!(
        (2..=PRIME_ROUNDS_MAX).contains(&report.rounds),
        "{report:?}"
    );
    assert_eq!(
        report.bytes,
        u64::from(report.rounds) * PRIMED_LOG_BYTES as u64
    );
    assert_eq!(dump(&store), before, "priming wrote nothing into the store");

    // The newest log is already as long as a primed log: a file written
    // before, renamed, which the next commits write over.
    let logs = wal::log_files(&data).unwrap();
    let current = logs.last().unwrap();
    let current_bytes = std::fs::metadata(current).unwrap().len();
    assert!(
        current_bytes >= PRIMED_LOG_BYTES as u64,
        "{} holds {current_bytes} bytes",
        current.display()
    );

    for i in 0..20u32 {
        b.commit(&store, vec![signal("after", &i.to_le_bytes())])
            .unwrap();
    }
    let expected = dump(&store);
    assert_eq!(
        std::fs::metadata(current).unwrap().len(),
        current_bytes,
        "the commits wrote inside the recycled file"
    );
    let scans = wal::scan_dir(&data).unwrap();
    assert_eq!(wal::describe(&scans), None);
    let in_log: usize = scans
        .iter()
        .filter(|s| s.file == *current)
        .flat_map(|s| s.batches.iter())
        .map(|batch| batch.events.len())
        .sum();
    assert_eq!(in_log, 20, "the log in use holds the new commits' events");

    // A crash image now, and the store reopened after a clean close.
    let crashed = dir.path().join("crashed");
    std::fs::create_dir_all(&crashed).unwrap();
    for e in std::fs::read_dir(&data).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() && e.file_name() != "LOCK" {
            std::fs::copy(e.path(), crashed.join(e.file_name())).unwrap();
        }
    }
    store.close().unwrap();
    for path in [&crashed, &data] {
        let reopened = RocksStore::open(path, Durability::Sync).unwrap();
        assert_eq!(dump(&reopened), expected, "{}", path.display());
        assert_eq!(reopened.history(a.run).unwrap().len(), 4);
        assert!(reopened.verify().unwrap().violations.is_empty());
    }

    let reader = RocksStore::open_read_only(&data).unwrap();
    assert_eq!(
        reader.prime_logs().unwrap(),
        keel_storage::PrimeReport::default()
    );
}
