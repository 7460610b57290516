// Goal: the limits on one run hold at their exact boundaries and refuse
// without writing anything: HISTORY_EVENTS_MAX events per history, and
// PAYLOAD_BYTES_MAX bytes for every payload an event carries (including
// failure details and memo fields).
// Method: writing 5,000,000 events is too slow for a unit test, and the
// commit path takes a history's length from the run's `next_seq`; so the
// history test moves `next_seq` of a real run to just below the limit
// through `MemStore::with_live_mut` and commits across the boundary.
// Payloads are built one byte either side of the limit.

use crate::common::*;
use keel_storage::codec::{self, RecordKind};
use keel_storage::keys::{self, Cf};
use keel_storage::{
    Durability, Error, EventKind, Failure, FailureKind, MemStore, Payload, Seq, Store,
    HISTORY_EVENTS_MAX, PAYLOAD_BYTES_MAX,
};

#[test]
fn history_length_limit_is_exact_and_writes_nothing_past_it() {
    let store = MemStore::new(Durability::Sync);
    let mut b = RunBuilder::new(run_id(1), 100);
    b.commit(&store, vec![started(b.run, "long", "wf")])
        .unwrap();
    // Pretend HISTORY_EVENTS_MAX - 1 events are committed.
    store.with_live_mut(|m| {
        let key = keys::run_key(b.run);
        let mut meta: keel_storage::RunMeta =
            codec::decode(RecordKind::Run, &m.cf(Cf::Runs)[&key]).unwrap();
        meta.next_seq = Seq(HISTORY_EVENTS_MAX);
        m.cf_mut(Cf::Runs)
            .insert(key, codec::encode(RecordKind::Run, &meta).unwrap());
    });
    b.next = HISTORY_EVENTS_MAX;

    let before = store.snapshot();
    // Two events would make HISTORY_EVENTS_MAX + 1.
    let err = b
        .commit(&store, vec![signal("a", b"1"), signal("b", b"2")])
        .unwrap_err();
    assert!(
        matches!(err, Error::HistoryTooLong { run, events, max }
            if run == b.run && events == HISTORY_EVENTS_MAX + 1 && max == HISTORY_EVENTS_MAX),
        "{err}"
    );
    assert_eq!(store.snapshot().cf(Cf::Events), before.cf(Cf::Events));
    assert_eq!(store.snapshot().cf(Cf::Runs), before.cf(Cf::Runs));

    // Exactly the limit is accepted; one more is not.
    b.commit(&store, vec![signal("last", b"x")]).unwrap();
    assert_eq!(
        store.run_meta(b.run).unwrap().unwrap().next_seq,
        Seq(HISTORY_EVENTS_MAX + 1)
    );
    let err = b.commit(&store, vec![signal("over", b"x")]).unwrap_err();
    assert!(
        matches!(err, Error::HistoryTooLong { events, .. } if events == HISTORY_EVENTS_MAX + 1),
        "{err}"
    );
    // Closing the run is refused too: at the limit, continue-as-new must
    // be committed before the last slot is used.
    let err = b.commit(&store, vec![workflow_completed()]).unwrap_err();
    assert!(matches!(err, Error::HistoryTooLong { .. }), "{err}");
}

#[test]
fn every_payload_of_an_event_is_limited() {
    let too_big = || Payload::from_bytes(vec![1; PAYLOAD_BYTES_MAX + 1]);
    let max = || Payload::from_bytes(vec![2; PAYLOAD_BYTES_MAX]);
    let with_details = |details: Payload| EventKind::WorkflowFailed {
        failure: Failure {
            details: Some(details),
            ..Failure::new(FailureKind::Application, "f", false)
        },
    };
    let memo = |p: Payload| EventKind::MemoUpserted {
        fields: vec![
            ("small".into(), Payload::from_bytes(vec![0])),
            ("big".into(), p),
        ],
    };
    let update = |p: Payload| EventKind::UpdateCompleted {
        update_id: keel_storage::CommandId::new("u"),
        result: p,
        failure: None,
    };
    for_each_store(|store| {
        let mut b = RunBuilder::new(run_id(1), 100);
        b.commit(store, vec![started(b.run, "p", "wf")]).unwrap();
        let before = dump(store);
        for kind in [with_details(too_big()), memo(too_big()), update(too_big())] {
            let err = b.commit(store, vec![kind]).unwrap_err();
            assert!(
                matches!(err, Error::PayloadTooLarge { seq: Seq(2), bytes, .. } if bytes == PAYLOAD_BYTES_MAX + 1),
                "{err}"
            );
        }
        assert_eq!(dump(store), before);
        // A memo is limited as a whole, far below one payload's limit: the
        // run record that carries it is rewritten by every commit.
        let err = b.commit(store, vec![memo(max())]).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Metadata {
                    source: keel_storage::MetadataError::MemoTooLarge(_),
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(dump(store), before);
        // Exactly at the limit: names and values, "small" + 1 + "big" + 8183.
        let memo_max = Payload::from_bytes(vec![3; keel_storage::search::MEMO_BYTES_MAX - 9]);
        b.commit(store, vec![memo(memo_max), update(max())])
            .unwrap();
        b.commit(store, vec![with_details(max())]).unwrap();
        assert!(store.verify().unwrap().ok);
    });
}
