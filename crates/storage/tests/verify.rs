// Goal: `verify` passes a sound store with the right counts and, for each
// kind of damage, reports exactly the violation that names the damage (the
// run and seq of a bad event, the key of bad derived state) without noise
// about healthy state; it never panics on arbitrary bytes in any column
// family; its report serialises with `ok`, `runs`, `events`, `violations`.
// Method: populate a store through the commit path, damage it below the
// commit path (MemStore: `with_live_mut`; RocksDB: raw `rocksdb` writes, or
// a flipped byte inside an `.sst` file of a copied directory), verify.

use std::path::Path;

use crate::common::*;
use keel_storage::codec::{self, RecordKind};
use keel_storage::keys::{self, Cf};
use keel_storage::{
    Durability, Event, EventKind, MemStore, RocksStore, RunId, RunMeta, RunStatus, Seq, Store,
    TimerEntry, Timestamp, VerifyReport, Violation, VERIFY_VIOLATIONS_MAX,
};
use proptest::prelude::*;

const MARKER: &[u8] = b"KEEL-MARKER-6f1d93a2";

/// Three runs: a completed one, an open one with a task, a timer and a
/// marker signal at seq 4, and an open child of the first with its result
/// delivered. Returns (runs, events).
fn populate(store: &dyn Store) -> (u64, u64) {
    let mut a = RunBuilder::new(run_id(1), 100);
    a.commit(store, vec![started(a.run, "a", "wf"), scheduled(a.run, 1)])
        .unwrap();
    a.commit(store, vec![completed(a.run, 1, 1), workflow_completed()])
        .unwrap();
    let mut b = RunBuilder::new(run_id(2), 200);
    b.commit(store, vec![started(b.run, "b", "wf"), scheduled(b.run, 1)])
        .unwrap();
    b.commit(store, vec![timer_started(2, 9_000)]).unwrap();
    b.commit(store, vec![signal("marked", MARKER)]).unwrap();
    b.commit(store, vec![signal("after", b"x")]).unwrap();
    (2, 9)
}

fn b_run() -> RunId {
    run_id(2)
}

fn assert_clean(report: &VerifyReport, runs: u64, events: u64) {
    assert!(report.ok, "{:?}", report.violations);
    assert!(report.violations.is_empty());
    assert!(!report.truncated);
    assert_eq!((report.runs, report.events), (runs, events));
}

#[test]
fn clean_store_verifies_with_counts_and_json() {
    for_each_store(|store| {
        let empty = store.verify().unwrap();
        assert_clean(&empty, 0, 0);
        let (runs, events) = populate(store);
        let report = store.verify().unwrap();
        assert_clean(&report, runs, events);
        let json: serde_json::Value = serde_json::to_value(&report).unwrap();
        assert_eq!(json["ok"], true);
        assert_eq!(json["runs"], runs);
        assert_eq!(json["events"], events);
        assert_eq!(json["violations"], serde_json::json!([]));
    });
}

#[test]
fn flipped_event_byte_in_memory_is_corrupt_naming_run_and_seq() {
    let store = MemStore::new(Durability::Sync);
    populate(&store);
    store.with_live_mut(|m| {
        let v = m
            .cf_mut(Cf::Events)
            .get_mut(&keys::event_key(b_run(), Seq(4)))
            .unwrap();
        let i = v.windows(MARKER.len()).position(|w| w == MARKER).unwrap();
        v[i + 3] ^= 0x01;
    });
    let report = store.verify().unwrap();
    assert!(!report.ok);
    assert_eq!(report.violations.len(), 1, "{:?}", report.violations);
    assert!(
        matches!(&report.violations[0], Violation::Corrupt { cf, run: Some(r), seq: Some(4), detail }
            if cf == "events" && *r == b_run().to_string() && detail.contains("checksum")),
        "{:?}",
        report.violations
    );
    // Reading the run names the same place.
    let err = store.history(b_run()).unwrap_err();
    assert!(
        matches!(err, keel_storage::Error::Corrupt { run: Some(r), seq: Some(Seq(4)), .. } if r == b_run()),
        "{err}"
    );
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["ok"], false);
    assert_eq!(json["violations"][0]["kind"], "corrupt");
    assert_eq!(json["violations"][0]["seq"], 4);
}

/// Opens every column family of a closed store with the `rocksdb` crate.
fn raw_db(path: &Path) -> rocksdb::DB {
    let opts = rocksdb::Options::default();
    let names = rocksdb::DB::list_cf(&opts, path).unwrap();
    rocksdb::DB::open_cf(&opts, path, &names).unwrap()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
}

/// Populates a RocksDB store under `dir`, flushes it to table files, and
/// copies it; in the copy, one byte of the marker signal (run b, seq 4)
/// is flipped inside its `.sst` file. Returns (original, copy, runs,
/// events).
fn copy_with_a_flipped_marker(dir: &Path) -> (std::path::PathBuf, std::path::PathBuf, u64, u64) {
    let live = dir.join("live");
    let store = RocksStore::open(&live, Durability::Sync).unwrap();
    let (runs, events) = populate(&store);
    store.flush().unwrap();
    store.close().unwrap();
    let copy = dir.join("copy");
    copy_dir(&live, &copy);

    let mut hits = Vec::new();
    for entry in std::fs::read_dir(&copy).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "sst") {
            let bytes = std::fs::read(&path).unwrap();
            for (i, w) in bytes.windows(MARKER.len()).enumerate() {
                if w == MARKER {
                    hits.push((path.clone(), i));
                }
            }
        }
    }
    assert_eq!(
        hits.len(),
        1,
        "the marker must be in exactly one table: {hits:?}"
    );
    let (file, at) = &hits[0];
    let mut bytes = std::fs::read(file).unwrap();
    bytes[at + 3] ^= 0x01;
    std::fs::write(file, bytes).unwrap();
    (live, copy, runs, events)
}

#[test]
fn flipped_byte_inside_an_sst_file_is_corrupt_naming_run_and_seq() {
    let dir = tempfile::tempdir().unwrap();
    let (live, copy, runs, events) = copy_with_a_flipped_marker(dir.path());
    let damaged = RocksStore::open_read_only(&copy).unwrap();
    let report = damaged.verify().unwrap();
    assert_eq!(report.violations.len(), 1, "{:?}", report.violations);
    assert!(
        matches!(&report.violations[0], Violation::Corrupt { cf, run: Some(r), seq: Some(4), .. }
            if cf == "events" && *r == b_run().to_string()),
        "{:?}",
        report.violations
    );
    assert_eq!((report.runs, report.events), (runs, events));
    // The original directory is untouched.
    assert_clean(
        &RocksStore::open_read_only(&live).unwrap().verify().unwrap(),
        runs,
        events,
    );
}

/// Goal: a point read of an event (what the engine does when an input is
/// repeated against a closed run) loses only the damaged event, named by
/// the codec, and not the other events of its table block. Method: the
/// copy with one flipped byte in run b's seq 4; seq 3, in the same block,
/// reads and decodes, and seq 4's bytes fail the record's own checksum.
#[test]
fn a_point_read_beside_a_damaged_event_still_reads() {
    let dir = tempfile::tempdir().unwrap();
    let (_, copy, _, _) = copy_with_a_flipped_marker(dir.path());
    let damaged = RocksStore::open_read_only(&copy).unwrap();
    let view = damaged.view();
    let read = |seq: u64| {
        view.get(Cf::Events, &keys::event_key(b_run(), Seq(seq)))
            .expect("a point read of an event does not fail on a damaged block")
            .expect("the event is there")
    };
    let before: Event = codec::decode(RecordKind::Event, &read(3)).unwrap();
    assert_eq!(before.seq, Seq(3));
    assert!(
        matches!(
            codec::decode::<Event>(RecordKind::Event, &read(4)),
            Err(codec::Error::Checksum { .. })
        ),
        "the damaged event fails its own checksum"
    );
}

/// Goal: a point read of a derived record whose table block is damaged
/// fails with a typed error naming the family, never reads as absent (a
/// damaged durable id's row read as absent would let a duplicate in).
/// Method: flush a populated store, copy it, flip one byte inside the
/// `runs` family's table file, and read run b's record from the copy by
/// key, alone and in a batch.
#[test]
fn a_point_read_of_a_damaged_runs_block_is_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    let (_, copy, _, _) = copy_with_a_flipped_marker(dir.path());
    let table = {
        let db = raw_db(&copy);
        let files = db.live_files().unwrap();
        let runs: Vec<_> = files
            .iter()
            .filter(|f| f.column_family_name == Cf::Runs.name())
            .collect();
        assert_eq!(runs.len(), 1, "one table for the runs family: {files:?}");
        copy.join(runs[0].name.trim_start_matches('/'))
    };
    let mut bytes = std::fs::read(&table).unwrap();
    // Inside the first data block (a table of two records has one).
    bytes[8] ^= 0x01;
    std::fs::write(&table, bytes).unwrap();
    let damaged = RocksStore::open_read_only(&copy).unwrap();
    let view = damaged.view();
    let key = keys::run_key(b_run());
    match view.get(Cf::Runs, &key) {
        Err(keel_storage::Error::DamagedTable { cf, detail }) => {
            assert_eq!(cf, "runs");
            assert!(detail.contains(".sst"), "{detail}");
        }
        other => panic!("a damaged block read as {other:?}"),
    }
    assert!(
        matches!(
            view.get_many(Cf::Runs, &[key]),
            Err(keel_storage::Error::DamagedTable { cf: "runs", .. })
        ),
        "a batched read of a damaged block"
    );
}

/// Runs `damage` on the store's bytes: MemStore through `with_live_mut`,
/// RocksDB through raw writes to the closed directory. Returns the report.
fn damaged_report(
    durable_damage: impl Fn(&mut dyn FnMut(Cf, Vec<u8>, Option<Vec<u8>>), &dyn Store),
) -> Vec<VerifyReport> {
    let mut reports = Vec::new();
    // In memory.
    let mem = MemStore::new(Durability::Sync);
    populate(&mem);
    let mut writes = Vec::new();
    durable_damage(&mut |cf, k, v| writes.push((cf, k, v)), &mem);
    mem.with_live_mut(|m| {
        for (cf, k, v) in writes {
            match v {
                Some(v) => m.cf_mut(cf).insert(k, v),
                None => m.cf_mut(cf).remove(&k),
            };
        }
    });
    reports.push(mem.verify().unwrap());
    // On disk.
    let dir = tempfile::tempdir().unwrap();
    let store = RocksStore::open(dir.path(), Durability::Sync).unwrap();
    populate(&store);
    let mut writes = Vec::new();
    durable_damage(&mut |cf, k, v| writes.push((cf, k, v)), &store);
    store.close().unwrap();
    {
        let db = raw_db(dir.path());
        for (cf, k, v) in writes {
            let h = db.cf_handle(cf.name()).unwrap();
            match v {
                Some(v) => db.put_cf(&h, k, v).unwrap(),
                None => db.delete_cf(&h, k).unwrap(),
            }
        }
    }
    reports.push(
        RocksStore::open_read_only(dir.path())
            .unwrap()
            .verify()
            .unwrap(),
    );
    reports
}

// Replay reads many runs through `Store::for_each_history` (one cursor on
// RocksDB): a record of one run that does not decode ends that run's read
// with an error naming it, keeps the events before it, and hides nothing
// of the runs around it.
#[test]
fn a_corrupt_record_ends_its_own_history_only() {
    let damage_and_read = |store: &dyn Store| {
        let runs = [run_id(1), b_run(), run_id(3), run_id(9)];
        let mut reads = Vec::new();
        store.for_each_history(&runs, &mut |i, read| reads.push((i, read)));
        assert_eq!(
            reads.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
            [0, 1, 2, 3]
        );
        assert_eq!(reads[0].1.events, store.history(run_id(1)).unwrap());
        assert!(reads[0].1.failure.is_none());
        let seqs: Vec<u64> = reads[1].1.events.iter().map(|e| e.seq.0).collect();
        assert_eq!(seqs, [1, 2], "the events before the damage");
        match &reads[1].1.failure {
            Some(keel_storage::Error::Corrupt { run, seq, .. }) => {
                assert_eq!((*run, *seq), (Some(b_run()), Some(Seq(3))));
            }
            other => panic!("expected a corrupt record of b at seq 3, got {other:?}"),
        }
        assert_eq!(reads[2].1.events.len(), 3);
        assert_eq!(reads[2].1.events, store.history(run_id(3)).unwrap());
        assert!(reads[2].1.failure.is_none());
        assert!(reads[3].1.events.is_empty() && reads[3].1.failure.is_none());
    };
    let populate_three = |store: &dyn Store| {
        populate(store);
        let mut c = RunBuilder::new(run_id(3), 300);
        c.commit(store, vec![started(c.run, "c", "wf"), scheduled(c.run, 1)])
            .unwrap();
        c.commit(store, vec![completed(c.run, 1, 1)]).unwrap();
    };
    let garbage = b"not an event record".to_vec();

    let mem = MemStore::new(Durability::Sync);
    populate_three(&mem);
    mem.with_live_mut(|m| {
        m.cf_mut(Cf::Events)
            .insert(keys::event_key(b_run(), Seq(3)), garbage.clone());
    });
    damage_and_read(&mem);

    let dir = tempfile::tempdir().unwrap();
    let store = RocksStore::open(dir.path(), Durability::Sync).unwrap();
    populate_three(&store);
    store.close().unwrap();
    {
        let db = raw_db(dir.path());
        let h = db.cf_handle(Cf::Events.name()).unwrap();
        db.put_cf(&h, keys::event_key(b_run(), Seq(3)), &garbage)
            .unwrap();
    }
    damage_and_read(&RocksStore::open_read_only(dir.path()).unwrap());
}

#[test]
fn deleted_middle_event_is_a_gap() {
    for report in
        damaged_report(|write, _| write(Cf::Events, keys::event_key(b_run(), Seq(3)), None))
    {
        assert_eq!(
            report.violations,
            vec![Violation::Gap {
                run: b_run().to_string(),
                expected: 3,
                found: 4
            }]
        );
        assert_eq!(report.events, 8);
    }
}

#[test]
fn deleted_first_event_is_a_gap() {
    for report in
        damaged_report(|write, _| write(Cf::Events, keys::event_key(b_run(), Seq(1)), None))
    {
        assert_eq!(
            report.violations,
            vec![Violation::Gap {
                run: b_run().to_string(),
                expected: 1,
                found: 2
            }],
        );
    }
}

#[test]
fn directly_inserted_duplicate_terminal_is_reported() {
    // Run b's timer fires at seq 6; a second TimerFired is then written
    // straight into the events family at seq 7, past the commit path.
    for report in damaged_report(|write, store| {
        let mut b = RunBuilder::new(b_run(), 10_000);
        b.next = 6;
        b.commit(store, vec![timer_fired(2, 9_000)]).unwrap();
        let dup = ev(7, 20_000, timer_fired(2, 9_000));
        write(
            Cf::Events,
            keys::event_key(b_run(), Seq(7)),
            Some(codec::encode(RecordKind::Event, &dup).unwrap()),
        );
    }) {
        assert_eq!(
            report.violations,
            vec![Violation::DuplicateTerminal {
                run: b_run().to_string(),
                key: "timer@2".into(),
                first_seq: 6,
                seq: 7
            }]
        );
        assert_eq!(report.events, 11);
    }
}

#[test]
fn event_whose_record_names_another_seq_is_reported() {
    for report in damaged_report(|write, store| {
        let mut e: Event = store.history(b_run()).unwrap()[4].clone();
        e.seq = Seq(40);
        write(
            Cf::Events,
            keys::event_key(b_run(), Seq(5)),
            Some(codec::encode(RecordKind::Event, &e).unwrap()),
        );
    }) {
        assert_eq!(
            report.violations,
            vec![Violation::SeqMismatch {
                run: b_run().to_string(),
                key_seq: 5,
                record_seq: 40
            }]
        );
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn mismatch(cf: Cf, key: &[u8], problem: &str) -> Violation {
    Violation::DerivedMismatch {
        cf: cf.name().into(),
        key: hex(key),
        problem: problem.into(),
    }
}

#[test]
fn tampered_derived_state_is_a_derived_mismatch() {
    let task_key = keys::run_step_key(b_run(), keel_storage::Step(1));
    let run_key = keys::run_key(b_run());
    let extra_timer = TimerEntry {
        run_id: b_run(),
        step: keel_storage::Step(7),
        fire_at: Timestamp(1),
    };
    let extra_timer_key = keys::timer_key(Timestamp(1), b_run(), keel_storage::Step(7));
    for report in damaged_report(|write, store| {
        // A lost task, a run meta that says Completed, a timer no event made.
        write(Cf::Tasks, task_key.clone(), None);
        let mut meta: RunMeta = store.run_meta(b_run()).unwrap().unwrap();
        meta.status = RunStatus::Completed;
        write(
            Cf::Runs,
            run_key.clone(),
            Some(codec::encode(RecordKind::Run, &meta).unwrap()),
        );
        write(
            Cf::Timers,
            extra_timer_key.clone(),
            Some(codec::encode(RecordKind::Timer, &extra_timer).unwrap()),
        );
    }) {
        let mut got = report.violations.clone();
        got.sort_by_key(|v| format!("{v:?}"));
        let mut want = vec![
            mismatch(Cf::Tasks, &task_key, "missing"),
            mismatch(Cf::Runs, &run_key, "differs"),
            mismatch(Cf::Timers, &extra_timer_key, "extra"),
        ];
        want.sort_by_key(|v| format!("{v:?}"));
        assert_eq!(got, want);
        assert!(!report.ok);
    }
}

#[test]
fn runs_of_one_instance_started_in_the_same_millisecond_verify_clean() {
    // A run that continues as new within the millisecond it started, as a
    // simulator with a frozen clock produces. The new run's id sorts before
    // the old one's, so an order by start time and run id alone would fold
    // the new run first.
    for_each_store(|store| {
        let old = RunId::from_u64_pair(9, 9);
        let new = RunId::from_u64_pair(1, 1);
        commit(
            store,
            old,
            vec![
                ev(1, 500, started(old, "loop", "wf")),
                ev(
                    2,
                    500,
                    EventKind::WorkflowContinuedAsNew {
                        new_run_id: new,
                        input: keel_storage::Payload::default(),
                        carried: Default::default(),
                    },
                ),
            ],
        )
        .unwrap();
        let mut start_new = started_after(new, "loop", "wf", old);
        if let EventKind::WorkflowStarted(start) = &mut start_new {
            let keel_storage::WorkflowStart { continued_from, .. } = &mut **start;
            *continued_from = Some(old);
        }
        commit(store, new, vec![ev(1, 500, start_new)]).unwrap();
        assert_clean(&store.verify().unwrap(), 2, 3);
        // Also when the new run closes within that millisecond too.
        commit(store, new, vec![ev(2, 500, workflow_completed())]).unwrap();
        assert_clean(&store.verify().unwrap(), 2, 4);
    });
}

#[test]
fn a_new_start_after_a_close_in_the_same_millisecond_verifies_clean() {
    // Two runs of one instance with no continue-as-new between them: the
    // first closes and a client starts the second in the same millisecond.
    // The second's id sorts first, so an order by clock and id folds it
    // first (and reports the instance as "differs"). The second start
    // records the run it follows; verify folds along that link.
    for_each_store(|store| {
        let first = RunId::from_u64_pair(9, 9);
        let second = RunId::from_u64_pair(1, 1);
        commit(
            store,
            first,
            vec![
                ev(1, 700, started(first, "again", "wf")),
                ev(2, 700, workflow_completed()),
            ],
        )
        .unwrap();
        let mut start = started(second, "again", "wf");
        if let EventKind::WorkflowStarted(start) = &mut start {
            let keel_storage::WorkflowStart { previous_run, .. } = &mut **start;
            *previous_run = Some(first);
        }
        commit(store, second, vec![ev(1, 700, start)]).unwrap();
        commit(store, second, vec![ev(2, 700, workflow_completed())]).unwrap();
        assert_clean(&store.verify().unwrap(), 2, 4);
        // A start decided against a run that is no longer the instance's
        // is refused, naming both.
        let third = RunId::from_u64_pair(5, 5);
        let mut stale = started(third, "again", "wf");
        if let EventKind::WorkflowStarted(start) = &mut stale {
            let keel_storage::WorkflowStart { previous_run, .. } = &mut **start;
            *previous_run = Some(first);
        }
        let err = commit(store, third, vec![ev(1, 701, stale)]).unwrap_err();
        assert!(
            matches!(err, keel_storage::Error::InstanceMoved { expected, found: Some(f), .. }
                if expected == Some(first) && f == second),
            "{err}"
        );
        // So is one decided when the instance had no run, now that it has
        // one, although that run has closed since (a client's retried
        // start that read the instance before the first start was durable).
        let fourth = RunId::from_u64_pair(6, 6);
        let err = commit(
            store,
            fourth,
            vec![ev(1, 702, started(fourth, "again", "wf"))],
        )
        .unwrap_err();
        assert!(
            matches!(err, keel_storage::Error::InstanceMoved { expected: None, found: Some(f), .. }
                if f == second),
            "{err}"
        );
    });
}

/// Flips a byte in the last event of `run` (a MemStore).
fn corrupt_last_event(store: &MemStore, run: RunId) -> u64 {
    let last = store.run_meta(run).unwrap().unwrap().next_seq.0 - 1;
    store.with_live_mut(|m| {
        let v = m
            .cf_mut(Cf::Events)
            .get_mut(&keys::event_key(run, Seq(last)))
            .unwrap();
        let n = v.len();
        v[n - 1] ^= 0x10;
    });
    last
}

fn only_corrupt(report: &VerifyReport, run: RunId, seq: u64) {
    assert_eq!(report.violations.len(), 1, "{:?}", report.violations);
    assert!(
        matches!(&report.violations[0], Violation::Corrupt { run: Some(r), seq: Some(s), .. }
            if *r == run.to_string() && *s == seq),
        "{:?}",
        report.violations
    );
}

#[test]
fn broken_run_does_not_make_its_instance_or_outbox_look_wrong() {
    // The instance's current run is the damaged one, while an older sound
    // run of the same instance is folded: the instance record must not be
    // reported, only the damaged event.
    let store = MemStore::new(Durability::Sync);
    let mut old = RunBuilder::new(run_id(1), 100);
    old.commit(
        &store,
        vec![started(old.run, "inst", "wf"), workflow_completed()],
    )
    .unwrap();
    let mut new = RunBuilder::new(run_id(2), 200);
    new.commit(
        &store,
        vec![
            started_after(new.run, "inst", "wf", old.run),
            signal("s", b"x"),
        ],
    )
    .unwrap();
    let seq = corrupt_last_event(&store, new.run);
    only_corrupt(&store.verify().unwrap(), new.run, seq);

    // A damaged child: its start removed the parent's StartChild message
    // and its close queued a result, neither of which can be refolded.
    let store = MemStore::new(Durability::Sync);
    let mut parent = RunBuilder::new(run_id(1), 100);
    let child = run_id(2);
    let child_instance = keel_storage::InstanceId::for_child(parent.run, keel_storage::Step(1));
    parent
        .commit(
            &store,
            vec![
                started(parent.run, "p", "wf"),
                EventKind::ChildScheduled(Box::new(keel_storage::ChildSchedule {
                    step: keel_storage::Step(1),
                    group: Vec::new(),
                    child_instance_id: child_instance.clone(),
                    child_run_id: child,
                    workflow_type: "c".into(),
                    input: keel_storage::Payload::default(),
                    close_policy: keel_storage::ParentClosePolicy::Abandon,
                    memo: Vec::new(),
                    search_attributes: Vec::new(),
                    timeouts: Default::default(),
                })),
            ],
        )
        .unwrap();
    let mut c = RunBuilder::new(child, 300);
    let mut start_child = started(child, child_instance.as_str(), "c");
    if let EventKind::WorkflowStarted(start) = &mut start_child {
        let keel_storage::WorkflowStart { parent: p, .. } = &mut **start;
        *p = Some(keel_storage::ParentRef {
            instance_id: keel_storage::InstanceId::new("p"),
            run_id: parent.run,
            step: keel_storage::Step(1),
            close_policy: keel_storage::ParentClosePolicy::Abandon,
        });
    }
    c.commit(
        &store,
        vec![start_child, signal("s", b"x"), workflow_completed()],
    )
    .unwrap();
    assert!(store.verify().unwrap().ok);
    let seq = corrupt_last_event(&store, child);
    only_corrupt(&store.verify().unwrap(), child, seq);
}

#[test]
fn verify_lists_at_most_the_limit_and_says_it_truncated() {
    let store = MemStore::new(Durability::Sync);
    populate(&store);
    store.with_live_mut(|m| {
        for i in 0..(VERIFY_VIOLATIONS_MAX as u32 + 5) {
            m.cf_mut(Cf::Tasks)
                .insert(i.to_be_bytes().to_vec(), vec![1]);
        }
    });
    let report = store.verify().unwrap();
    assert_eq!(report.violations.len(), VERIFY_VIOLATIONS_MAX);
    assert!(report.truncated && !report.ok);
}

#[test]
fn event_key_with_the_largest_seq_does_not_panic() {
    let store = MemStore::new(Durability::Sync);
    populate(&store);
    store.with_live_mut(|m| {
        m.cf_mut(Cf::Events)
            .insert(keys::event_key(b_run(), Seq(u64::MAX)), b"junk".to_vec());
    });
    let report = store.verify().unwrap();
    assert!(!report.ok);
    assert!(report
        .violations
        .iter()
        .any(|v| matches!(v, Violation::Gap { found, .. } if *found == u64::MAX)));
}

/// Keys that reach the interesting code paths: well-formed event keys of an
/// existing or a new run (any seq, including u64::MAX), keys of other
/// lengths, and derived keys with a run prefix.
fn garbage_key() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        (any::<bool>(), any::<u64>()).prop_map(|(existing, seq)| {
            let run = if existing { b_run() } else { run_id(77) };
            keys::event_key(run, Seq(seq))
        }),
        (0u64..12).prop_map(|seq| keys::event_key(b_run(), Seq(seq))),
        Just(keys::event_key(run_id(78), Seq(u64::MAX))),
        proptest::collection::vec(any::<u8>(), 0..40),
        any::<u32>().prop_map(|s| keys::run_step_key(b_run(), keel_storage::Step(s))),
    ]
}

/// Values: random bytes, or random bodies in a valid envelope of any kind,
/// or a valid event record (well-formed but out of place).
fn garbage_value() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..64),
        (1u8..=10, proptest::collection::vec(any::<u8>(), 0..64)).prop_map(|(kind, body)| {
            let mut out = vec![codec::MAGIC, kind, 1, 0, 0, 0, 0, 0];
            out.extend_from_slice(&body);
            let crc = crc32c::crc32c_append(crc32c::crc32c(&out[..4]), &out[codec::HEADER_BYTES..]);
            out[4..8].copy_from_slice(&crc.to_le_bytes());
            out
        }),
        (0u64..12, 0u8..4).prop_map(|(seq, which)| {
            let kind = match which {
                0 => started(b_run(), "b", "wf"),
                1 => workflow_completed(),
                2 => timer_fired(2, 9_000),
                _ => signal("s", b"x"),
            };
            codec::encode(RecordKind::Event, &ev(seq, 1, kind)).unwrap()
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn verify_never_panics_on_garbage(
        entries in proptest::collection::vec((0usize..Cf::ALL.len(), garbage_key(), garbage_value()), 1..6),
    ) {
        let store = MemStore::new(Durability::Sync);
        populate(&store);
        let before = store.snapshot();
        store.with_live_mut(|m| {
            for (cf, k, v) in &entries {
                m.cf_mut(Cf::ALL[*cf]).insert(k.clone(), v.clone());
            }
        });
        let after = store.snapshot();
        // `meta` is not verified; every other family is.
        let changed = Cf::ALL
            .iter()
            .filter(|cf| **cf != Cf::Meta)
            .any(|cf| before.cf(*cf) != after.cf(*cf));
        let report = store.verify().unwrap();
        serde_json::to_string(&report).unwrap();
        prop_assert_eq!(
            report.ok,
            !changed,
            "changed: {}, violations: {:?}",
            changed,
            report.violations
        );
    }
}

#[test]
fn verify_never_panics_on_garbage_on_disk() {
    // The same through RocksDB's iterators, every family, fixed seed.
    let dir = tempfile::tempdir().unwrap();
    let store = RocksStore::open(dir.path(), Durability::Sync).unwrap();
    populate(&store);
    store.close().unwrap();
    {
        let db = raw_db(dir.path());
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for cf in Cf::ALL {
            let h = db.cf_handle(cf.name()).unwrap();
            for _ in 0..20 {
                let len = (next() % 30) as usize;
                let mut k: Vec<u8> = (0..len).map(|_| next() as u8).collect();
                if next() % 2 == 0 {
                    k = keys::event_key(b_run(), Seq(next() % 12));
                }
                let v: Vec<u8> = (0..(next() % 40)).map(|_| next() as u8).collect();
                // Leave the store metadata readable so the store opens.
                if cf == Cf::Meta && k == keys::STORE_META_KEY {
                    continue;
                }
                db.put_cf(&h, k, v).unwrap();
            }
        }
    }
    let report = RocksStore::open_read_only(dir.path())
        .unwrap()
        .verify()
        .unwrap();
    assert!(!report.ok);
    assert!(report
        .violations
        .iter()
        .any(|v| matches!(v, Violation::Corrupt { .. })));
    assert!(report
        .violations
        .iter()
        .any(|v| matches!(v, Violation::DerivedMismatch { .. })));
}
