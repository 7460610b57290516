//! Goal: a data directory whose log lost acknowledged commits never opens
//! as if nothing happened. A write-ahead log cut short (at any point, so
//! RocksDB's recovery sees only a torn last record and would keep the
//! rest without a word) or a directory restored from an older copy is
//! refused with `LostCommits` naming how far commits were acknowledged and
//! where the log ends, by read-write and read-only opens alike; a torn
//! record after the last acknowledged commit (what a crash leaves) still
//! opens with everything.
//! `open_accepting_loss` then opens such a directory on request and names
//! exactly the history events the damage hid.
//! Method: commit a few hundred synced commits, close (the
//! acknowledged-commit record is written), then damage a copy of the
//! directory the way each case does and open it.

use std::path::{Path, PathBuf};

use crate::common::*;
use keel_storage::acked::ACKED_FILE;
use keel_storage::{wal, Durability, Error, RocksStore, Store};

const COMMITS: u64 = 300;

/// A closed directory holding one run with `COMMITS` signals after its start.
fn written(dir: &Path) -> PathBuf {
    let data = dir.join("data");
    let store = RocksStore::open(&data, Durability::Sync).unwrap();
    let mut run = RunBuilder::new(run_id(1), 100);
    run.commit(&store, vec![started(run.run, "order-1", "wf")])
        .unwrap();
    for i in 0..COMMITS {
        run.commit(&store, vec![signal("s", &i.to_le_bytes())])
            .unwrap();
    }
    store.close().unwrap();
    data
}

fn newest_log(dir: &Path) -> PathBuf {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .max()
        .expect("a write-ahead log")
}

/// Cuts the newest log at half its length (at any byte, as a disk or a
/// careless copy might).
fn cut_newest_log_in_half(data: &Path) {
    let log = newest_log(data);
    let len = std::fs::metadata(&log).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&log).unwrap();
    f.set_len(len / 2).unwrap();
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

fn assert_lost(err: Error) {
    match err {
        Error::LostCommits {
            acknowledged,
            found,
            ..
        } => assert!(found < acknowledged, "{found} < {acknowledged}"),
        other => panic!("expected LostCommits, got: {other}"),
    }
}

#[test]
fn a_log_cut_short_is_refused_not_opened_without_its_acknowledged_commits() {
    let dir = tempfile::tempdir().unwrap();
    let data = written(dir.path());
    cut_newest_log_in_half(&data);
    assert_lost(RocksStore::open(&data, Durability::Sync).unwrap_err());
    assert_lost(RocksStore::open_read_only(&data).unwrap_err());
    let text = RocksStore::open_read_only(&data).unwrap_err().to_string();
    assert!(text.contains("--accept-loss"), "{text}");
}

#[test]
fn a_directory_restored_from_an_older_copy_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let data = written(dir.path());
    // An older copy: a checkpoint taken early, then more commits.
    let old = dir.path().join("old");
    {
        let store = RocksStore::open(&data, Durability::Sync).unwrap();
        store.checkpoint(&old).unwrap();
        let mut run = RunBuilder::new(run_id(2), 100);
        run.commit(&store, vec![started(run.run, "order-2", "wf")])
            .unwrap();
        for _ in 0..10 {
            run.commit(&store, vec![signal("s", b"x")]).unwrap();
        }
        store.close().unwrap();
    }
    // The old files come back; the record of what was acknowledged stays.
    let restored = dir.path().join("restored");
    copy_dir(&old, &restored);
    std::fs::copy(data.join(ACKED_FILE), restored.join(ACKED_FILE)).unwrap();
    assert_lost(RocksStore::open(&restored, Durability::Sync).unwrap_err());
    // The checkpoint on its own is a consistent directory.
    let store = RocksStore::open(&old, Durability::Sync).unwrap();
    assert!(store.verify().unwrap().ok);
}

#[test]
fn a_torn_record_after_the_last_acknowledged_commit_opens_with_everything() {
    let dir = tempfile::tempdir().unwrap();
    let data = written(dir.path());
    // A crash in the middle of writing the next record: part of a header.
    let log = newest_log(&data);
    let mut bytes = std::fs::read(&log).unwrap();
    bytes.extend_from_slice(&[0x5a, 0x13, 0x77, 0x01, 0x20]);
    std::fs::write(&log, bytes).unwrap();
    let store = RocksStore::open(&data, Durability::Sync).unwrap();
    assert_eq!(store.history(run_id(1)).unwrap().len() as u64, 1 + COMMITS);
    assert!(store.verify().unwrap().ok);
}

#[test]
fn a_log_damaged_in_the_middle_names_the_place_and_accepting_the_loss_names_the_events() {
    let dir = tempfile::tempdir().unwrap();
    let data = written(dir.path());
    let log = newest_log(&data);
    let clean = wal::scan_file(&log).unwrap();
    assert_eq!(clean.damage, None);
    let events: usize = clean.batches.iter().map(|b| b.events.len()).sum();
    assert!(events as u64 > COMMITS, "{events} events read back");
    let mut bytes = std::fs::read(&log).unwrap();
    let flip = bytes.len() / 2;
    bytes[flip] ^= 0x40;
    std::fs::write(&log, bytes).unwrap();

    let scan = wal::scan_file(&log).unwrap();
    let damage = scan.damage.clone().expect("damage found");
    assert!(damage.offset <= flip as u64 && flip as u64 - damage.offset < 32 * 1024);
    let err = RocksStore::open(&data, Durability::Sync).unwrap_err();
    assert!(matches!(err, Error::Damaged { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains(&format!("damaged at byte {}", damage.offset)),
        "{text}"
    );

    let (store, report) = RocksStore::open_accepting_loss(&data, Durability::Sync).unwrap();
    assert!(report.lost_anything());
    let kept = store.history(run_id(1)).unwrap().len() as u64;
    assert!(kept < 1 + COMMITS, "the prefix before the damage: {kept}");
    // Every event after the prefix is named, except those of the one
    // batch inside the damaged record, which cannot be read.
    let lost: Vec<u64> = report
        .lost_events
        .iter()
        .map(|(run, seq)| {
            assert_eq!(*run, run_id(1));
            seq.0
        })
        .collect();
    let expected: Vec<u64> = (kept + 1..=1 + COMMITS).collect();
    assert!(
        lost == expected || lost == expected[1..],
        "lost {lost:?}, expected {expected:?}"
    );
    assert!(store.verify().unwrap().ok);
    // Accepted: it opens normally from now on, and takes new commits.
    store.close().unwrap();
    let store = RocksStore::open(&data, Durability::Sync).unwrap();
    let mut run = RunBuilder::new(run_id(1), 10_000);
    run.next = kept + 1;
    run.commit(&store, vec![signal("after", b"z")]).unwrap();
    assert_eq!(store.history(run_id(1)).unwrap().len() as u64, kept + 1);
}

/// A directory as a crash leaves it, whose newest log is a recycled one: a
/// first log of `FIRST` signals, flushed; a second of a few, flushed
/// (RocksDB then writes the first log's file again under a new number);
/// `AFTER` signals in it, then a copy taken before the close (which would
/// cut the file to what it wrote). Returns the copy and the signals
/// committed in all.
fn written_into_a_recycled_log(dir: &Path) -> (PathBuf, u64) {
    const FIRST: u64 = 600;
    const SECOND: u64 = 5;
    const AFTER: u64 = 200;
    let data = dir.join("data");
    let store = RocksStore::open(&data, Durability::Sync).unwrap();
    let mut run = RunBuilder::new(run_id(1), 100);
    run.commit(&store, vec![started(run.run, "order-1", "wf")])
        .unwrap();
    for (i, n) in [FIRST, SECOND, AFTER].into_iter().enumerate() {
        for j in 0..n {
            run.commit(&store, vec![signal("s", &j.to_le_bytes())])
                .unwrap();
        }
        if i < 2 {
            store.flush().unwrap();
        }
    }
    let crashed = dir.join("crashed");
    copy_dir(&data, &crashed);
    store.close().unwrap();
    (crashed, FIRST + SECOND + AFTER)
}

/// Goal: a recycled log (written over an older log's file, so records of
/// that earlier use follow the new ones) opens with everything, a torn
/// write at its end is not damage, and a flipped byte among its new
/// records is refused, not dropped: RocksDB's point-in-time recovery,
/// which recycling needs, would keep the prefix before it without a word.
/// Method: fill a log, flush twice so the next log is the first one's file
/// again, commit fewer records into it than it held, close; then damage
/// copies of the directory.
#[test]
fn a_recycled_log_opens_whole_and_damage_among_its_new_records_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (data, signals) = written_into_a_recycled_log(dir.path());
    let log = newest_log(&data);
    let scan = wal::scan_file(&log).unwrap();
    assert_eq!(scan.damage, None);
    let last = scan.batches.last().expect("batches in the recycled log");
    let bytes = std::fs::read(&log).unwrap();
    let end = last.end as usize;
    assert!(
        bytes.len() > end + 4096 && bytes[end..].iter().any(|b| *b != 0),
        "the newest log holds its earlier use past byte {end} of {}",
        bytes.len()
    );
    assert!(scan
        .batches
        .windows(2)
        .all(|w| w[1].sequence == w[0].sequence + u64::from(w[0].count)));

    let whole = dir.path().join("whole");
    copy_dir(&data, &whole);
    let store = RocksStore::open(&whole, Durability::Sync).unwrap();
    assert_eq!(store.history(run_id(1)).unwrap().len() as u64, 1 + signals);
    assert!(store.verify().unwrap().ok);
    store.close().unwrap();

    // A crash while writing the next record: its header and part of its
    // payload over the earlier use's bytes.
    let torn = dir.path().join("torn");
    copy_dir(&data, &torn);
    let mut t = bytes.clone();
    let number: u32 = log.file_stem().unwrap().to_str().unwrap().parse().unwrap();
    let mut header = vec![0x11, 0x22, 0x33, 0x44, 200, 0, 5];
    header.extend_from_slice(&number.to_le_bytes());
    t[end..end + header.len()].copy_from_slice(&header);
    t[end + header.len()..end + header.len() + 40].fill(0x77);
    std::fs::write(newest_log(&torn), &t).unwrap();
    let store = RocksStore::open(&torn, Durability::Sync).unwrap();
    assert_eq!(store.history(run_id(1)).unwrap().len() as u64, 1 + signals);
    store.close().unwrap();

    // A flipped byte in the middle of the new records.
    let middle = &scan.batches[scan.batches.len() / 2];
    let mut d = bytes.clone();
    d[middle.offset as usize + 20] ^= 0x40;
    std::fs::write(&log, &d).unwrap();
    let found = wal::scan_file(&log).unwrap().damage.expect("damage found");
    assert!(found.offset <= middle.offset + 20, "{found:?}");
    let err = RocksStore::open(&data, Durability::Sync).unwrap_err();
    assert!(matches!(err, Error::Damaged { .. }), "{err}");
    assert!(
        err.to_string()
            .contains(&format!("damaged at byte {}", found.offset)),
        "{err}"
    );
    let err = RocksStore::open_read_only(&data).unwrap_err();
    assert!(matches!(err, Error::Damaged { .. }), "{err}");
}

/// Goal: a log that ends early, followed by a log whose commits therefore
/// cannot be applied, is refused: point-in-time recovery stops at the gap
/// (it never applies a later log over a hole) and would open without the
/// later log's commits; no single log's scan shows damage, since the
/// earlier log only looks torn at its end. Method: a keel directory, then
/// two families RocksDB writes into two logs (the first family's flush
/// switches logs while the second still needs the first log; the first is
/// then dropped); the first log is cut inside its last record, and the
/// open must fail naming the commits left past the recovered sequence,
/// until the loss is accepted.
#[test]
fn commits_a_recovery_leaves_behind_a_log_that_ended_early_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let data = written(dir.path());
    let (first, second) = {
        let mut opts = rocksdb::Options::default();
        opts.create_missing_column_families(true);
        opts.set_recycle_log_file_num(2);
        opts.set_atomic_flush(true);
        opts.set_wal_recovery_mode(rocksdb::DBRecoveryMode::PointInTime);
        let mut names = rocksdb::DB::list_cf(&opts, &data).unwrap();
        names.extend(["a".to_string(), "b".to_string()]);
        let mut db = rocksdb::DB::open_cf(&opts, &data, &names).unwrap();
        {
            let (a, b) = (db.cf_handle("a").unwrap(), db.cf_handle("b").unwrap());
            db.put_cf(&b, b"b1", [1u8; 100]).unwrap();
            db.put_cf(&a, b"a1", [2u8; 100]).unwrap();
            db.put_cf(&b, b"b1-again", [3u8; 100]).unwrap();
        }
        let first = newest_log(&data);
        db.flush_cf(&db.cf_handle("a").unwrap()).unwrap();
        // Without `a`, whose flush moved it past the first log, RocksDB's
        // own check (a family with tables newer than where recovery
        // stopped) has nothing to find.
        db.drop_cf("a").unwrap();
        db.put_cf(&db.cf_handle("b").unwrap(), b"b2", [4u8; 100])
            .unwrap();
        db.put(b"c", [5u8; 100]).unwrap();
        let second = newest_log(&data);
        assert_ne!(first, second, "the flush switched logs");
        (first, second)
    };
    assert!(wal::scan_file(&second).unwrap().batches.len() >= 2);
    // The first log loses half of its last record (b's second put): its
    // recovery ends before it, and the second log does not start there.
    let len = std::fs::metadata(&first).unwrap().len();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&first)
        .unwrap();
    f.set_len(len - 50).unwrap();
    drop(f);
    assert_eq!(
        wal::scan_file(&first).unwrap().damage,
        None,
        "it looks torn"
    );
    let err = RocksStore::open(&data, Durability::Sync).unwrap_err();
    assert!(matches!(err, Error::Damaged { .. }), "{err}");
    assert!(err.to_string().contains("past sequence"), "{err}");
    let err = RocksStore::open_read_only(&data).unwrap_err();
    assert!(matches!(err, Error::Damaged { .. }), "{err}");
    // Accepted on request: the later log's commits are counted as lost,
    // and from then on the directory opens as usual.
    let (store, report) = RocksStore::open_accepting_loss(&data, Durability::Sync).unwrap();
    assert!(report.lost_commits >= 2, "{report:?}");
    assert!(store.verify().unwrap().ok);
    store.close().unwrap();
    RocksStore::open(&data, Durability::Sync).expect("accepted once, it opens");
}

#[test]
fn a_log_cut_short_opened_accepting_the_loss_counts_what_is_unreadable() {
    let dir = tempfile::tempdir().unwrap();
    let data = written(dir.path());
    cut_newest_log_in_half(&data);
    let (store, report) = RocksStore::open_accepting_loss(&data, Durability::Sync).unwrap();
    assert!(report.lost_anything());
    assert!(report.unreadable_sequences > 0, "{report:?}");
    assert!(report.acknowledged.unwrap() > report.found);
    assert!(store.verify().unwrap().ok);
    store.close().unwrap();
    RocksStore::open(&data, Durability::Sync).expect("accepted once, it opens");
}

/// Goal: a compaction that meets a damaged table block stops the store
/// loudly instead of leaving the writer stuck: later commits fail at once
/// with a typed corruption error and the store reports that it gave up
/// (the engine then stops serving with that cause).
/// Method: write three table files, damage a data block of one while the
/// store is closed, reopen, write a fourth (of other runs), which makes
/// RocksDB compact the four (it reads every block, checksums on), then
/// commit again.
#[test]
fn a_compaction_meeting_a_damaged_table_stops_writes_with_a_typed_error() {
    compaction_meets_damage(false);
}

/// Goal: reading a damaged block first does not hide the damage from the
/// compaction that follows. Reads of records that carry their own checksum
/// may pass a block whose checksum fails (so the damage costs only the
/// records it hit); such a block must not be kept in the block cache,
/// where a compaction would take it as checked and write its bytes into a
/// new table under a fresh checksum.
/// Method: as the test above, but read every old run's whole history (and
/// each run's last event, as a commit's catch-up does) after reopening and
/// before the fourth table is written; a damaged record may fail its read.
#[test]
fn a_damaged_block_read_before_its_compaction_still_stops_writes() {
    compaction_meets_damage(true);
}

fn compaction_meets_damage(read_old_runs_first: bool) {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let payload = vec![0x33u8; 4096];
    // Every table file holds events of the same four runs, so their key
    // ranges overlap and compaction must read and merge them (files that
    // do not overlap are moved without being read).
    let mut runs: Vec<RunBuilder> = (0..4u64)
        .map(|n| RunBuilder::new(run_id(100 + n), 100))
        .collect();
    {
        let store = RocksStore::open(&data, Durability::Sync).unwrap();
        for (n, run) in runs.iter_mut().enumerate() {
            run.commit(&store, vec![started(run.run, &format!("c-{n}"), "wf")])
                .unwrap();
        }
        for _ in 0..3 {
            for run in runs.iter_mut() {
                for _ in 0..5 {
                    run.commit(&store, vec![signal("s", &payload)]).unwrap();
                }
            }
            store.flush().unwrap();
        }
        store.close().unwrap();
    }
    // Damage the middle of the largest table file (a data block).
    let sst = std::fs::read_dir(&data)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "sst"))
        .max_by_key(|p| std::fs::metadata(p).unwrap().len())
        .expect("a table file");
    let mut bytes = std::fs::read(&sst).unwrap();
    let at = bytes.len() / 3;
    bytes[at] ^= 0x55;
    std::fs::write(&sst, bytes).unwrap();

    let store = RocksStore::open(&data, Durability::Sync).unwrap();
    if read_old_runs_first {
        let mut damaged = 0;
        for run in &runs {
            // The damaged record's reader gets a typed error; the others
            // read on.
            damaged += usize::from(store.history(run.run).is_err());
            let _ = store.run_meta(run.run);
        }
        // The byte lands in an event's payload: that run's history fails
        // its record checksum, the three others read (and so do the
        // records around it in its block).
        assert_eq!(damaged, 1, "runs unreadable for one damaged byte");
    }
    // New runs write the fourth table: a commit to one of the old runs
    // would read that run's last event first (its record is caught up
    // after a restart), which may be in the damaged block, and would find
    // the damage there instead of the compaction.
    let mut fresh: Vec<RunBuilder> = (0..4u64)
        .map(|n| RunBuilder::new(run_id(200 + n), 100))
        .collect();
    for (n, run) in fresh.iter_mut().enumerate() {
        run.commit(&store, vec![started(run.run, &format!("d-{n}"), "wf")])
            .unwrap();
        for _ in 0..5 {
            run.commit(&store, vec![signal("s", &payload)]).unwrap();
        }
    }
    let run = &mut fresh[0];
    // The flush may itself fail once the compaction has stopped writes.
    let _ = store.flush();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let err = loop {
        match run.commit(&store, vec![signal("s", b"x")]) {
            Ok(_) => {
                if std::time::Instant::now() >= deadline {
                    let log = std::fs::read_to_string(data.join("LOG")).unwrap_or_default();
                    for l in log
                        .lines()
                        .filter(|l| l.contains("orrupt") || l.contains("rror"))
                    {
                        eprintln!("LOG: {l}");
                    }
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "writes kept going past a damaged table's compaction"
                );
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            Err(e) => break e,
        }
    };
    assert!(
        matches!(
            err,
            Error::Unwritable {
                fault: keel_storage::WriteFault::Corruption,
                ..
            }
        ),
        "expected a typed corruption error, got: {err}"
    );
    assert!(store.health().is_failed(), "{}", store.health());
    // Final: nothing is written any more, fast.
    let again = run.commit(&store, vec![signal("s", b"y")]).unwrap_err();
    assert!(matches!(again, Error::Unwritable { .. }), "{again}");
}

/// Goal: a block of zeros inside a log (a disk that dropped a write it had
/// confirmed), which RocksDB's recovery skips without a word while later
/// records still push its sequence past the acknowledged one, is refused.
/// Method: commit enough for several 32 KiB log blocks, close, zero one
/// whole block in the middle, open.
#[test]
fn a_zeroed_block_inside_the_log_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    {
        let store = RocksStore::open(&data, Durability::Sync).unwrap();
        let mut run = RunBuilder::new(run_id(7), 100);
        run.commit(&store, vec![started(run.run, "z", "wf")])
            .unwrap();
        for _ in 0..300 {
            run.commit(&store, vec![signal("s", &[9u8; 1024])]).unwrap();
        }
        store.close().unwrap();
    }
    let log = newest_log(&data);
    let mut bytes = std::fs::read(&log).unwrap();
    let block = 32 * 1024;
    assert!(bytes.len() > 4 * block, "{} bytes of log", bytes.len());
    let start = (bytes.len() / 2) / block * block;
    bytes[start..start + block].fill(0);
    std::fs::write(&log, bytes).unwrap();
    for err in [
        RocksStore::open(&data, Durability::Sync).unwrap_err(),
        RocksStore::open_read_only(&data).unwrap_err(),
    ] {
        match &err {
            Error::Damaged { detail, .. } => {
                assert!(
                    detail.contains(&format!("damaged at byte {start}")),
                    "{detail}"
                )
            }
            other => panic!("expected Damaged, got: {other}"),
        }
    }
}
