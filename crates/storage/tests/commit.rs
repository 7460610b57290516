// Goal: the commit path enforces the log's invariants (contiguous seqs, one
// open run per instance, one terminal event per durable id, nothing after a
// run closes, the payload limit), writes all of a batch or none of it, and
// derives the right state (run meta, instances, tasks, timers, outbox, the
// status/type index); group commit keeps all of that under concurrency.
// Method: every test body is written once against `&dyn Store` and run on
// `MemStore` (Sync and Buffered), `RocksStore` (tempdir) and `PgStore` (a
// fresh schema on the test server `.ci/run` starts). "Nothing
// written" is checked by comparing a byte dump of every column family
// before and after the refused commit.

use std::sync::Barrier;

use crate::common::*;
use keel_storage::{
    AppendAck, AttemptNo, CommitBatch, Durability, DurableKey, Error, Event, EventKind, InstanceId,
    MemStore, OutboxMessage, Outcome, ParentClosePolicy, ParentRef, Payload, PgStore, RocksStore,
    RunAppend, RunFilter, RunStatus, Seq, ShardLeases, Step, Store, Timestamp, PAYLOAD_BYTES_MAX,
};

fn start(store: &dyn Store, n: u64, instance: &str, wtype: &str) -> RunBuilder {
    let mut b = RunBuilder::new(run_id(n), 1_000 * n);
    b.commit(store, vec![started(b.run, instance, wtype)])
        .expect("start run");
    b
}

#[test]
fn seq_gap_is_refused_and_writes_nothing() {
    for_each_store(|store| {
        let b = start(store, 1, "gap", "wf");
        let before = dump(store);
        // Skipping seq 2.
        let err = commit(store, b.run, vec![ev(3, 5_000, signal("s", b"x"))]).unwrap_err();
        assert!(
            matches!(err, Error::SeqGap { run, expected: Seq(2), found: Seq(3) } if run == b.run),
            "{err}"
        );
        // Rewriting seq 1.
        let err = commit(store, b.run, vec![ev(1, 5_000, signal("s", b"x"))]).unwrap_err();
        assert!(
            matches!(
                err,
                Error::SeqGap {
                    expected: Seq(2),
                    found: Seq(1),
                    ..
                }
            ),
            "{err}"
        );
        // Non-contiguous inside one append.
        let err = commit(
            store,
            b.run,
            vec![
                ev(2, 5_000, signal("s", b"x")),
                ev(4, 5_000, signal("s", b"y")),
            ],
        )
        .unwrap_err();
        assert!(matches!(err, Error::InvalidCommit { .. }), "{err}");
        // A new run must start at seq 1.
        let other = run_id(99);
        let err = commit(store, other, vec![ev(2, 5_000, started(other, "o", "wf"))]).unwrap_err();
        assert!(
            matches!(
                err,
                Error::SeqGap {
                    expected: Seq(1),
                    found: Seq(2),
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(dump(store), before, "a refused commit wrote something");
        assert_eq!(store.history(b.run).unwrap().len(), 1);
    });
}

#[test]
fn unknown_run_is_refused() {
    for_each_store(|store| {
        let run = run_id(1);
        let err = commit(store, run, vec![ev(1, 10, signal("s", b"x"))]).unwrap_err();
        assert!(
            matches!(err, Error::UnknownRun { run: r } if r == run),
            "{err}"
        );
        // A start whose run id names another run does not start this one.
        let err = commit(store, run, vec![ev(1, 10, started(run_id(2), "i", "wf"))]).unwrap_err();
        assert!(
            matches!(err, Error::UnknownRun { run: r } if r == run),
            "{err}"
        );
        // An empty append is malformed.
        let err = commit(store, run, vec![]).unwrap_err();
        assert!(matches!(err, Error::InvalidCommit { .. }), "{err}");
        assert!(dump(store).iter().all(|(cf, _, _)| cf.name() == "meta"));
        assert!(store.run_meta(run).unwrap().is_none());
    });
}

#[test]
fn second_start_of_an_open_instance_is_refused() {
    for_each_store(|store| {
        let mut a = start(store, 1, "order-1", "checkout");
        let before = dump(store);
        let b_run = run_id(2);
        let err = commit(
            store,
            b_run,
            vec![ev(1, 5_000, started(b_run, "order-1", "checkout"))],
        )
        .unwrap_err();
        assert!(
            matches!(&err, Error::InstanceRunning { instance, run }
                if instance == &InstanceId::new("order-1") && *run == a.run),
            "{err}"
        );
        assert_eq!(dump(store), before);
        // A second WorkflowStarted inside the open run is malformed too.
        let err = a
            .commit(store, vec![started(a.run, "order-1", "checkout")])
            .unwrap_err();
        assert!(matches!(err, Error::InvalidCommit { .. }), "{err}");
        // Once the first run closes, the instance may start again.
        a.commit(store, vec![workflow_completed()]).unwrap();
        commit(
            store,
            b_run,
            vec![ev(
                1,
                9_000,
                started_after(b_run, "order-1", "checkout", a.run),
            )],
        )
        .unwrap();
        let inst = store
            .instance(&InstanceId::new("order-1"))
            .unwrap()
            .unwrap();
        assert_eq!(inst.current_run, b_run);
        assert_eq!(inst.started_at, Timestamp(9_000));
        assert_eq!(store.resolve("order-1").unwrap(), Some(b_run));
        assert_eq!(store.resolve(&a.run.to_string()).unwrap(), Some(a.run));
        assert!(store.verify().unwrap().ok);
    });
}

#[test]
fn duplicate_terminal_events_are_refused() {
    for_each_store(|store| {
        let mut b = start(store, 1, "dup", "wf");
        b.commit(store, vec![scheduled(b.run, 1), timer_started(2, 50_000)])
            .unwrap();
        b.commit(store, vec![completed(b.run, 1, 1)]).unwrap();
        let completed_at = Seq(b.next - 1);
        b.commit(store, vec![timer_fired(2, 50_000)]).unwrap();
        let fired_at = Seq(b.next - 1);
        assert_eq!(
            store
                .committed(b.run, &DurableKey::Execution(Step(1)))
                .unwrap(),
            Some(completed_at)
        );
        let before = dump(store);

        // The completion closed the attempt and its execution with one
        // row, the execution's (schema 6): a second result of the same
        // attempt, a completion or a failure to retry, is refused by it,
        // and the attempt is still found committed at the completion.
        assert_eq!(
            store
                .committed(b.run, &DurableKey::Attempt(Step(1), AttemptNo(1)))
                .unwrap(),
            Some(completed_at)
        );
        assert_eq!(
            store
                .committed(b.run, &DurableKey::Attempt(Step(1), AttemptNo(2)))
                .unwrap(),
            None
        );
        let attempt_row =
            keel_storage::keys::dedupe_key(b.run, &DurableKey::Attempt(Step(1), AttemptNo(1)));
        assert!(
            !before
                .iter()
                .any(|(cf, k, _)| *cf == keel_storage::keys::Cf::Dedupe && *k == attempt_row),
            "the completion wrote no attempt row"
        );
        for again in [
            completed(b.run, 1, 1),
            attempt_failed(b.run, 1, 1, Some(90_000)),
        ] {
            let err = b.commit(store, vec![again]).unwrap_err();
            assert!(
                matches!(&err, Error::DuplicateTerminal { run, key: DurableKey::Execution(Step(1)), committed }
                    if *run == b.run && *committed == completed_at),
                "{err}"
            );
        }
        let err = b.commit(store, vec![timer_fired(2, 50_000)]).unwrap_err();
        assert!(
            matches!(&err, Error::DuplicateTerminal { key: DurableKey::Timer(Step(2)), committed, .. }
                if *committed == fired_at),
            "{err}"
        );
        // A cancel after the fire closes the same timer again.
        let err = b
            .commit(
                store,
                vec![EventKind::TimerCancelled {
                    step: Step(2),
                    fire_at: Timestamp(50_000),
                }],
            )
            .unwrap_err();
        assert!(matches!(err, Error::DuplicateTerminal { .. }), "{err}");
        assert_eq!(dump(store), before, "a refused duplicate wrote something");

        // Two terminal events for one id inside a single append: refused
        // whole, the valid first one included.
        b.commit(store, vec![timer_started(3, 60_000)]).unwrap();
        let before = dump(store);
        let err = b
            .commit(store, vec![timer_fired(3, 60_000), timer_fired(3, 60_000)])
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::DuplicateTerminal {
                    key: DurableKey::Timer(Step(3)),
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(dump(store), before);

        // Client command ids deduplicate signals.
        let sig = |p: &[u8]| EventKind::SignalReceived {
            name: "approve".into(),
            payload: Payload::from_bytes(p.to_vec()),
            command_id: Some(keel_storage::CommandId::new("cmd-1")),
        };
        b.commit(store, vec![sig(b"1")]).unwrap();
        let err = b.commit(store, vec![sig(b"2")]).unwrap_err();
        assert!(
            matches!(
                err,
                Error::DuplicateTerminal {
                    key: DurableKey::Command(_),
                    ..
                }
            ),
            "{err}"
        );
        assert!(store.verify().unwrap().ok);
    });
}

#[test]
fn append_to_a_closed_run_is_refused() {
    for_each_store(|store| {
        let mut b = start(store, 1, "closed", "wf");
        b.commit(store, vec![workflow_completed()]).unwrap();
        let before = dump(store);
        let err = b.commit(store, vec![signal("late", b"x")]).unwrap_err();
        assert!(
            matches!(err, Error::RunClosed { run } if run == b.run),
            "{err}"
        );
        assert_eq!(dump(store), before);

        // An event after the closing event of the same append.
        let mut c = start(store, 2, "closed-2", "wf");
        let before = dump(store);
        let err = c
            .commit(store, vec![workflow_completed(), signal("late", b"x")])
            .unwrap_err();
        assert!(matches!(err, Error::RunClosed { .. }), "{err}");
        assert_eq!(dump(store), before);
    });
}

#[test]
fn oversized_payload_is_refused_and_writes_nothing() {
    for_each_store(|store| {
        let mut b = start(store, 1, "big", "wf");
        let before = dump(store);
        let big = vec![0xab; PAYLOAD_BYTES_MAX + 1];
        let err = b
            .commit(store, vec![signal("ok", b"small"), signal("big", &big)])
            .unwrap_err();
        assert!(
            matches!(err, Error::PayloadTooLarge { run, seq: Seq(3), bytes, max }
                if run == b.run && bytes == PAYLOAD_BYTES_MAX + 1 && max == PAYLOAD_BYTES_MAX),
            "{err}"
        );
        // In a memo field, and in the input of a new run.
        let err = b
            .commit(
                store,
                vec![EventKind::MemoUpserted {
                    fields: vec![("k".into(), Payload::from_bytes(big.clone()))],
                }],
            )
            .unwrap_err();
        assert!(matches!(err, Error::PayloadTooLarge { .. }), "{err}");
        let other = run_id(2);
        let mut start_big = started(other, "big-2", "wf");
        if let EventKind::WorkflowStarted(start) = &mut start_big {
            let keel_storage::WorkflowStart { input, .. } = &mut **start;
            *input = Payload::from_bytes(big.clone());
        }
        let err = commit(store, other, vec![ev(1, 10, start_big)]).unwrap_err();
        assert!(
            matches!(err, Error::PayloadTooLarge { seq: Seq(1), .. }),
            "{err}"
        );
        assert_eq!(dump(store), before);

        // Exactly the limit is accepted and reads back whole.
        let max = vec![0xcd; PAYLOAD_BYTES_MAX];
        b.commit(store, vec![signal("max", &max)]).unwrap();
        match &store.history(b.run).unwrap()[1].kind {
            EventKind::SignalReceived { payload, .. } => assert_eq!(payload.0, max),
            other => panic!("unexpected {other:?}"),
        }
    });
}

#[test]
fn run_meta_instance_and_history_follow_the_events() {
    for_each_store(|store| {
        let mut b = start(store, 1, "meta", "checkout");
        let meta = store.run_meta(b.run).unwrap().unwrap();
        assert_eq!(meta.status, RunStatus::Running);
        assert_eq!(meta.next_seq, Seq(2));
        assert_eq!(meta.instance_id, InstanceId::new("meta"));
        assert_eq!(meta.workflow_type, "checkout");
        assert_eq!(meta.started_at, Timestamp(1_000));
        let ack = b
            .commit(
                store,
                vec![signal("a", b"1"), signal("b", b"2"), signal("c", b"3")],
            )
            .unwrap();
        assert_eq!(
            ack.appends,
            vec![AppendAck {
                run_id: b.run,
                first: Seq(2),
                last: Seq(4)
            }]
        );
        let meta = store.run_meta(b.run).unwrap().unwrap();
        assert_eq!(meta.next_seq, Seq(5));
        assert_eq!(meta.updated_at, Timestamp(1_030));
        b.commit(
            store,
            vec![EventKind::WorkflowCancelRequested {
                command_id: None,
                reason: "stop".into(),
            }],
        )
        .unwrap();
        assert!(store.run_meta(b.run).unwrap().unwrap().cancel_requested);
        b.commit(
            store,
            vec![EventKind::WorkflowCancelled {
                reason: "stop".into(),
            }],
        )
        .unwrap();
        let meta = store.run_meta(b.run).unwrap().unwrap();
        assert_eq!(meta.status, RunStatus::Cancelled);
        assert_eq!(meta.closed_at, Some(Timestamp(1_050)));
        assert_eq!(meta.outcome, Some(Outcome::Cancelled("stop".into())));
        assert_eq!(
            store.committed(b.run, &DurableKey::Run).unwrap(),
            Some(Seq(6))
        );

        let all = store.history(b.run).unwrap();
        assert_eq!(
            all.iter().map(|e| e.seq.0).collect::<Vec<_>>(),
            (1..=6).collect::<Vec<_>>()
        );
        let tail = store.history_from(b.run, Seq(4)).unwrap();
        assert_eq!(tail, all[3..].to_vec());
        assert!(store.history_from(b.run, Seq(7)).unwrap().is_empty());
        assert!(store.history(run_id(42)).unwrap().is_empty());
        // Streaming stops when asked.
        let mut seen = Vec::new();
        store
            .for_each_event(b.run, Seq(2), &mut |e| {
                seen.push(e.seq);
                seen.len() < 2
            })
            .unwrap();
        assert_eq!(seen, vec![Seq(2), Seq(3)]);
    });
}

#[test]
fn tasks_follow_schedule_retry_and_completion() {
    for_each_store(|store| {
        let mut b = start(store, 1, "tasks", "wf");
        b.commit(store, vec![scheduled(b.run, 1), scheduled(b.run, 2)])
            .unwrap();
        let t = store.task(b.run, Step(1)).unwrap().unwrap();
        assert_eq!(t.attempt.0, 1);
        assert_eq!(t.due, Timestamp(1_010));
        assert_eq!(t.activity_type, "charge");
        assert_eq!(store.run_tasks(b.run).unwrap().len(), 2);

        // A retry bumps the attempt and sets the durable backoff.
        b.commit(store, vec![attempt_failed(b.run, 1, 1, Some(77_000))])
            .unwrap();
        let t = store.task(b.run, Step(1)).unwrap().unwrap();
        assert_eq!((t.attempt.0, t.due), (2, Timestamp(77_000)));
        // A result for the superseded attempt is refused.
        let before = dump(store);
        let err = b.commit(store, vec![completed(b.run, 1, 3)]).unwrap_err();
        assert!(matches!(err, Error::InvalidCommit { .. }), "{err}");
        assert_eq!(dump(store), before);
        // Completion removes the task.
        b.commit(store, vec![completed(b.run, 1, 2)]).unwrap();
        assert!(store.task(b.run, Step(1)).unwrap().is_none());
        // A failure without retry removes it and closes the execution.
        b.commit(store, vec![attempt_failed(b.run, 2, 1, None)])
            .unwrap();
        assert!(store.task(b.run, Step(2)).unwrap().is_none());
        assert!(store
            .committed(b.run, &DurableKey::Execution(Step(2)))
            .unwrap()
            .is_some());
        // Completing a step with no pending execution is malformed.
        let err = b.commit(store, vec![completed(b.run, 9, 1)]).unwrap_err();
        assert!(matches!(err, Error::InvalidCommit { .. }), "{err}");

        // Cancel request marks it; cancellation removes it.
        b.commit(store, vec![scheduled(b.run, 3)]).unwrap();
        let exec = keel_storage::event::execution_of(b.run, Step(3));
        b.commit(
            store,
            vec![EventKind::ActivityCancelRequested {
                step: Step(3),
                execution_id: exec,
            }],
        )
        .unwrap();
        assert!(
            store
                .task(b.run, Step(3))
                .unwrap()
                .unwrap()
                .cancel_requested
        );
        b.commit(
            store,
            vec![EventKind::ActivityCancelled {
                step: Step(3),
                execution_id: exec,
            }],
        )
        .unwrap();
        assert!(store.task(b.run, Step(3)).unwrap().is_none());

        // Closing the run drops its open tasks; other runs keep theirs.
        let mut other = start(store, 2, "tasks-2", "wf");
        other.commit(store, vec![scheduled(other.run, 1)]).unwrap();
        b.commit(store, vec![scheduled(b.run, 4)]).unwrap();
        assert_eq!(store.tasks(100).unwrap().len(), 2);
        assert_eq!(store.tasks(1).unwrap().len(), 1);
        b.commit(store, vec![workflow_completed()]).unwrap();
        let left = store.tasks(100).unwrap();
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].execution_id.run_id, other.run);
        assert!(store.verify().unwrap().ok);
    });
}

#[test]
fn timers_come_back_in_due_order() {
    for_each_store(|store| {
        let mut a = start(store, 1, "timers-a", "wf");
        let mut b = start(store, 2, "timers-b", "wf");
        a.commit(
            store,
            vec![timer_started(1, 9_000), timer_started(2, 7_000)],
        )
        .unwrap();
        b.commit(
            store,
            vec![timer_started(1, 8_000), timer_started(2, 20_000)],
        )
        .unwrap();
        let due = |now: u64, limit: usize| -> Vec<(u64, u32)> {
            store
                .due_timers(Timestamp(now), limit)
                .unwrap()
                .iter()
                .map(|t| (t.fire_at.0, t.step.0))
                .collect()
        };
        assert_eq!(due(6_999, 10), vec![]);
        assert_eq!(due(8_500, 10), vec![(7_000, 2), (8_000, 1)]);
        assert_eq!(due(9_000, 10), vec![(7_000, 2), (8_000, 1), (9_000, 1)]);
        assert_eq!(due(u64::MAX, 2), vec![(7_000, 2), (8_000, 1)]);
        assert_eq!(store.next_timer().unwrap(), Some(Timestamp(7_000)));
        let first = store.due_timers(Timestamp(7_000), 1).unwrap();
        assert_eq!(first[0].run_id, a.run);
        assert_eq!(store.run_timers(a.run).unwrap().len(), 2);

        a.commit(store, vec![timer_fired(2, 7_000)]).unwrap();
        assert_eq!(store.next_timer().unwrap(), Some(Timestamp(8_000)));
        b.commit(
            store,
            vec![EventKind::TimerCancelled {
                step: Step(1),
                fire_at: Timestamp(8_000),
            }],
        )
        .unwrap();
        assert_eq!(due(u64::MAX, 10), vec![(9_000, 1), (20_000, 2)]);
        // Firing a timer that is not open is malformed.
        let err = a.commit(store, vec![timer_fired(7, 1)]).unwrap_err();
        assert!(matches!(err, Error::InvalidCommit { .. }), "{err}");
        // Closing a run drops its timers.
        a.commit(store, vec![workflow_completed()]).unwrap();
        assert_eq!(due(u64::MAX, 10), vec![(20_000, 2)]);
        assert!(store.run_timers(a.run).unwrap().is_empty());
        assert!(store.verify().unwrap().ok);
    });
}

#[test]
fn timer_windows_follow_one_another_in_due_order() {
    // Goal: the windows a shard reads its timers in (`timers_after`) cover
    // every row once, in due order, each starting right after the last
    // one's end (ties in due time broken by run and step), and the filter
    // keeps only what it accepts, on every store. Method: two runs with
    // timers at tied and distinct due times, read in windows of 2 from
    // the start; then only run b's.
    for_each_store(|store| {
        let mut a = start(store, 1, "window-a", "wf");
        let mut b = start(store, 2, "window-b", "wf");
        a.commit(
            store,
            vec![
                timer_started(1, 5_000),
                timer_started(2, 9_000),
                timer_started(3, 5_000),
            ],
        )
        .unwrap();
        b.commit(
            store,
            vec![timer_started(1, 5_000), timer_started(2, 1_000)],
        )
        .unwrap();
        let mut seen = Vec::new();
        let mut after = None;
        loop {
            let window = store.timers_after(after, 2, &mut |_| true).unwrap();
            assert!(window.len() <= 2);
            let Some(last) = window.last() else { break };
            after = Some((last.fire_at, last.run_id, last.step));
            seen.extend(window.iter().map(|t| (t.fire_at.0, t.run_id, t.step.0)));
        }
        let mut expected = vec![
            (5_000, a.run, 1),
            (9_000, a.run, 2),
            (5_000, a.run, 3),
            (5_000, b.run, 1),
            (1_000, b.run, 2),
        ];
        expected.sort();
        assert_eq!(seen, expected);
        let only_b = store
            .timers_after(None, 10, &mut |t| t.run_id == b.run)
            .unwrap();
        let only_b: Vec<(u64, u32)> = only_b.iter().map(|t| (t.fire_at.0, t.step.0)).collect();
        assert_eq!(only_b, vec![(1_000, 2), (5_000, 1)]);
    });
}

#[test]
fn fired_timer_leaves_no_due_entry_even_if_the_event_misstates_fire_at() {
    // The due-order entry is keyed by the fire time committed in
    // TimerStarted; a TimerFired naming another time must still remove it,
    // or the timer would be handed out again forever.
    for_each_store(|store| {
        let mut b = start(store, 1, "misfire", "wf");
        b.commit(store, vec![timer_started(1, 5_000)]).unwrap();
        b.commit(store, vec![timer_fired(1, 5_001)]).unwrap();
        assert!(store
            .due_timers(Timestamp(u64::MAX), 10)
            .unwrap()
            .is_empty());
        assert_eq!(store.next_timer().unwrap(), None);
        assert!(store.run_timers(b.run).unwrap().is_empty());
    });
}

/// `ChildScheduled` at step 1 of a `ship` child with input `in`.
fn ship_child(
    instance: &InstanceId,
    run: keel_storage::RunId,
    policy: ParentClosePolicy,
) -> EventKind {
    EventKind::ChildScheduled(Box::new(keel_storage::ChildSchedule {
        step: Step(1),
        group: Vec::new(),
        child_instance_id: instance.clone(),
        child_run_id: run,
        workflow_type: "ship".into(),
        input: Payload::from_bytes(b"in".to_vec()),
        close_policy: policy,
        memo: Vec::new(),
        search_attributes: Vec::new(),
        timeouts: Default::default(),
    }))
}

/// Starts parent run `n` of `instance`, which schedules a `ship` child
/// (run `child`, with `policy`) at step 1: the parent's builder, and the
/// child's instance.
fn parent_of_child(
    store: &dyn Store,
    n: u64,
    instance: &str,
    child: keel_storage::RunId,
    policy: ParentClosePolicy,
) -> (RunBuilder, InstanceId) {
    let mut parent = start(store, n, instance, "order");
    let child_instance = InstanceId::for_child(parent.run, Step(1));
    parent
        .commit(store, vec![ship_child(&child_instance, child, policy)])
        .unwrap();
    (parent, child_instance)
}

#[test]
fn child_start_and_result_flow_through_the_outbox() {
    for_each_store(|store| {
        let child_run = run_id(2);
        let (mut parent, child_instance) =
            parent_of_child(store, 1, "parent", child_run, ParentClosePolicy::Terminate);
        let parent_ref = ParentRef {
            instance_id: InstanceId::new("parent"),
            run_id: parent.run,
            step: Step(1),
            close_policy: ParentClosePolicy::Terminate,
        };
        let outbox = store.outbox(10).unwrap();
        assert_eq!(
            outbox,
            vec![OutboxMessage::StartChild {
                parent: parent_ref.clone(),
                child_instance_id: child_instance.clone(),
                child_run_id: child_run,
                workflow_type: "ship".into(),
                input: Payload::from_bytes(b"in".to_vec()),
                memo: Vec::new(),
                search_attributes: Vec::new(),
                timeouts: Default::default(),
            }]
        );

        // The child's start keeps the start message until the parent has
        // heard of it: a crash in between re-delivers the start, which
        // tells the parent.
        let mut child = RunBuilder::new(child_run, 5_000);
        child
            .commit(
                store,
                vec![EventKind::WorkflowStarted(Box::new(
                    keel_storage::WorkflowStart {
                        instance_id: child_instance.clone(),
                        run_id: child_run,
                        workflow_type: "ship".into(),
                        input: Payload::from_bytes(b"in".to_vec()),
                        command_id: None,
                        parent: Some(parent_ref.clone()),
                        continued_from: None,
                        random_seed: 1,
                        previous_run: None,
                        carried: Default::default(),
                        memo: Vec::new(),
                        search_attributes: Vec::new(),
                        timeouts: Default::default(),
                    },
                ))],
            )
            .unwrap();
        assert_eq!(store.outbox(10).unwrap().len(), 1, "kept for the notice");
        assert_eq!(
            store.run_meta(child_run).unwrap().unwrap().parent,
            Some(parent_ref.clone())
        );
        parent
            .commit(
                store,
                vec![EventKind::ChildStarted {
                    step: Step(1),
                    child_run_id: child_run,
                }],
            )
            .unwrap();
        assert!(
            store.outbox(10).unwrap().is_empty(),
            "the notice consumed it"
        );

        // The child's close queues its result for the parent.
        child.commit(store, vec![workflow_completed()]).unwrap();
        assert_eq!(
            store.outbox(10).unwrap(),
            vec![OutboxMessage::ChildResult {
                parent: parent_ref.clone(),
                child_run_id: child_run,
                outcome: Outcome::Completed(Payload::from_bytes(b"done".to_vec())),
            }]
        );
        // The parent's receipt removes it.
        parent
            .commit(
                store,
                vec![EventKind::ChildCompleted {
                    step: Step(1),
                    child_run_id: child_run,
                    result: Payload::from_bytes(b"done".to_vec()),
                }],
            )
            .unwrap();
        assert!(store.outbox(10).unwrap().is_empty());
        assert!(store.verify().unwrap().ok);
    });
}

/// A child that started, and a parent that closes before hearing of it:
/// the parent's close drops the start row. A child that starts after its
/// parent closed drops it itself.
#[test]
fn a_start_row_is_dropped_once_its_parent_closed_and_its_child_started() {
    for_each_store(|store| {
        for (n, child_first) in [(1u64, true), (3, false)] {
            let child_run = run_id(n + 1);
            let (mut parent, child_instance) = parent_of_child(
                store,
                n,
                &format!("parent-{n}"),
                child_run,
                ParentClosePolicy::Abandon,
            );
            let parent_ref = ParentRef {
                instance_id: InstanceId::new(format!("parent-{n}")),
                run_id: parent.run,
                step: Step(1),
                close_policy: ParentClosePolicy::Abandon,
            };
            let mut child = RunBuilder::new(child_run, 5_000);
            let mut child_start = started(child_run, child_instance.as_str(), "ship");
            if let EventKind::WorkflowStarted(start) = &mut child_start {
                let keel_storage::WorkflowStart { parent, .. } = &mut **start;
                *parent = Some(parent_ref);
            }
            if child_first {
                child.commit(store, vec![child_start.clone()]).unwrap();
                parent.commit(store, vec![workflow_completed()]).unwrap();
            } else {
                parent.commit(store, vec![workflow_completed()]).unwrap();
                assert_eq!(store.outbox(10).unwrap().len(), 1, "still to start");
                child.commit(store, vec![child_start.clone()]).unwrap();
            }
            assert!(store.outbox(10).unwrap().is_empty(), "case {n}");
        }
        assert!(store.verify().unwrap().ok);

        // A child that started in the same millisecond as its parent, with
        // a smaller run id, is rebuilt first by `verify`: its row, kept
        // for the parent's notice, must be rebuilt all the same.
        let child_run = run_id(9);
        let (parent, child_instance) = parent_of_child(
            store,
            10,
            "parent-10",
            child_run,
            ParentClosePolicy::Abandon,
        );
        let mut child = RunBuilder::new(child_run, 10_000);
        let mut child_start = started(child_run, child_instance.as_str(), "ship");
        if let EventKind::WorkflowStarted(start) = &mut child_start {
            let keel_storage::WorkflowStart { parent: p, .. } = &mut **start;
            *p = Some(ParentRef {
                instance_id: InstanceId::new("parent-10"),
                run_id: parent.run,
                step: Step(1),
                close_policy: ParentClosePolicy::Abandon,
            });
        }
        child.commit(store, vec![child_start]).unwrap();
        assert_eq!(store.outbox(10).unwrap().len(), 1, "kept for the notice");
        let report = store.verify().unwrap();
        assert!(report.ok, "{:?}", report.violations);
    });
}

#[test]
fn long_histories_read_back_whole_and_in_order() {
    // Longer than a store's read page (PostgreSQL reads 512 rows per round
    // trip): every event comes back once, in seq order, from any start,
    // and `verify`'s scan of every run sees no gap.
    for_each_store(|store| {
        let mut a = start(store, 1, "long-a", "wf");
        let mut b = start(store, 2, "long-b", "wf");
        for chunk in 0..12u32 {
            let kinds = (0..100u32)
                .map(|i| signal("s", &(chunk * 100 + i).to_le_bytes()))
                .collect::<Vec<_>>();
            a.commit(store, kinds.clone()).expect("commit a");
            b.commit(store, kinds).expect("commit b");
        }
        for run in [a.run, b.run] {
            let history = store.history(run).expect("history");
            assert_eq!(history.len(), 1_201);
            for (i, e) in history.iter().enumerate() {
                assert_eq!(e.seq, Seq(i as u64 + 1));
            }
            let tail = store.history_from(run, Seq(700)).expect("tail");
            assert_eq!(tail.len(), 502);
            assert_eq!(tail[0].seq, Seq(700));
        }
        let report = store.verify().expect("verify");
        assert!(report.ok, "{:?}", report.violations);
        assert_eq!(report.events, 2 * 1_201);
    });
}

#[test]
fn runs_are_listed_by_status_and_type() {
    for_each_store(|store| {
        let a = start(store, 1, "a", "checkout");
        let mut b = start(store, 2, "b", "checkout");
        let c = start(store, 3, "c", "ship");
        let mut d = start(store, 4, "d", "checkout-extra");
        b.commit(store, vec![workflow_completed()]).unwrap();
        d.commit(
            store,
            vec![EventKind::WorkflowFailed {
                failure: keel_storage::Failure::new(keel_storage::FailureKind::Panic, "p", false),
            }],
        )
        .unwrap();
        let ids = |f: RunFilter| -> Vec<_> {
            let mut v: Vec<_> = store
                .runs(&f)
                .unwrap()
                .into_iter()
                .map(|m| m.run_id)
                .collect();
            v.sort();
            v
        };
        let status = |s| RunFilter::all().status(s);
        assert_eq!(ids(status(RunStatus::Running)), vec![a.run, c.run]);
        assert_eq!(ids(status(RunStatus::Completed)), vec![b.run]);
        assert_eq!(ids(status(RunStatus::Failed)), vec![d.run]);
        assert!(ids(status(RunStatus::Terminated)).is_empty());
        // The type is matched whole, not as a prefix ("checkout-extra").
        assert_eq!(
            ids(RunFilter::all()
                .status(RunStatus::Running)
                .workflow_type("checkout")),
            vec![a.run]
        );
        assert!(ids(RunFilter::all()
            .status(RunStatus::Failed)
            .workflow_type("checkout"))
        .is_empty());
        assert_eq!(
            ids(RunFilter::all().workflow_type("checkout")),
            vec![a.run, b.run]
        );
        assert_eq!(ids(RunFilter::default()).len(), 4);
        assert_eq!(
            ids(RunFilter {
                limit: Some(1),
                ..status(RunStatus::Running)
            })
            .len(),
            1
        );
        assert_eq!(
            ids(RunFilter {
                limit: Some(3),
                ..RunFilter::default()
            })
            .len(),
            3
        );
    });
}

#[test]
fn a_batch_with_an_invalid_append_writes_nothing() {
    for_each_store(|store| {
        let existing = start(store, 1, "atom", "wf");
        let before = dump(store);
        let new_run = run_id(2);
        let batch = CommitBatch {
            appends: vec![
                RunAppend {
                    run_id: existing.run,
                    events: vec![ev(2, 9_000, signal("s", b"first"))],
                },
                RunAppend {
                    run_id: new_run,
                    events: vec![ev(1, 9_000, started(new_run, "atom-2", "wf"))],
                },
                RunAppend {
                    run_id: run_id(3),
                    events: vec![ev(1, 9_000, signal("s", b"unknown run"))],
                },
            ],
            parked: vec![(
                existing.run,
                Some(keel_storage::ParkInfo {
                    at: Timestamp(9_000),
                    kind: "panic".into(),
                    reason: "r".into(),
                }),
            )],
            fence: None,
        };
        let err = store.commit(batch).wait().unwrap_err();
        assert!(matches!(err, Error::UnknownRun { .. }), "{err}");
        assert_eq!(dump(store), before, "part of a refused batch was written");
        assert!(store.run_meta(new_run).unwrap().is_none());
        assert!(store.parked(existing.run).unwrap().is_none());

        // Two appends to one run in one batch: the second must continue the
        // first; a conflicting second append refuses the whole batch.
        let conflicting = CommitBatch {
            appends: vec![
                RunAppend {
                    run_id: existing.run,
                    events: vec![ev(2, 9_000, signal("s", b"a"))],
                },
                RunAppend {
                    run_id: existing.run,
                    events: vec![ev(2, 9_000, signal("s", b"b"))],
                },
            ],
            parked: Vec::new(),
            fence: None,
        };
        let err = store.commit(conflicting).wait().unwrap_err();
        assert!(
            matches!(
                err,
                Error::SeqGap {
                    expected: Seq(3),
                    found: Seq(2),
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(dump(store), before);

        // The valid version commits every part atomically.
        let good = CommitBatch {
            appends: vec![
                RunAppend {
                    run_id: existing.run,
                    events: vec![ev(2, 9_000, signal("s", b"a"))],
                },
                RunAppend {
                    run_id: new_run,
                    events: vec![ev(1, 9_000, started(new_run, "atom-2", "wf"))],
                },
                RunAppend {
                    run_id: existing.run,
                    events: vec![ev(3, 9_000, signal("s", b"b"))],
                },
            ],
            parked: vec![(
                new_run,
                Some(keel_storage::ParkInfo {
                    at: Timestamp(9_000),
                    kind: "crash_loop".into(),
                    reason: "r".into(),
                }),
            )],
            fence: None,
        };
        let ack = store.commit(good).wait().unwrap();
        assert_eq!(ack.appends.len(), 3);
        assert_eq!(ack.appends[2].first, Seq(3));
        assert_eq!(store.history(existing.run).unwrap().len(), 3);
        assert_eq!(store.parked(new_run).unwrap().unwrap().kind, "crash_loop");
        // Clearing a parked marker.
        store
            .commit(CommitBatch {
                appends: Vec::new(),
                parked: vec![(new_run, None)],
                fence: None,
            })
            .wait()
            .unwrap();
        assert!(store.parked(new_run).unwrap().is_none());
        assert!(store.verify().unwrap().ok);
    });
}

fn concurrent_distinct_runs(store: &dyn Store, threads: u64, commits: u64) {
    std::thread::scope(|s| {
        for t in 0..threads {
            s.spawn(move || {
                let mut b = RunBuilder::new(run_id(1_000 + t), 1);
                b.commit(store, vec![started(b.run, &format!("inst-{t}"), "wf")])
                    .unwrap();
                for i in 0..commits {
                    b.commit(store, vec![signal("s", &i.to_le_bytes())])
                        .unwrap();
                }
            });
        }
    });
    for t in 0..threads {
        let history = store.history(run_id(1_000 + t)).unwrap();
        let seqs: Vec<u64> = history.iter().map(|e| e.seq.0).collect();
        assert_eq!(seqs, (1..=commits + 1).collect::<Vec<_>>(), "run {t}");
    }
    let report = store.verify().unwrap();
    assert!(report.ok, "{:?}", report.violations);
    assert_eq!(report.runs, threads);
    assert_eq!(report.events, threads * (commits + 1));
}

#[test]
fn group_commit_many_threads_distinct_runs() {
    for durability in [Durability::Sync, Durability::Buffered] {
        let dir = tempfile::tempdir().unwrap();
        let store = RocksStore::open(dir.path(), durability).unwrap();
        concurrent_distinct_runs(&store, 64, 10);
    }
    concurrent_distinct_runs(&MemStore::new(Durability::Buffered), 64, 10);
}

/// Goal: commits of one run submitted back to back, without waiting for
/// their answers, land in the order they were made and are answered in
/// that order, whether a commit went through the writer's queue or was
/// written in place by its committer because the writer was idle at that
/// moment (RocksDB). Method: threads each pipeline appends to their own
/// run, so the writer is sometimes busy and sometimes idle between one
/// thread's commits; every commit must be accepted (a commit overtaking an
/// earlier queued one would be refused with a seq gap; without the
/// writer's `queued` count this fails at once), the handles are polled from
/// the last to the first so that a later commit found answered before an
/// earlier one is caught, and every history must come back in seq order.
/// (An in-place commit answered ahead of a group still with the answer
/// thread needs that thread to be slower than a whole commit: the order
/// check catches it if it happens, but this load rarely makes it happen.)
fn pipelined_runs_keep_their_order(store: &dyn Store, threads: u64, commits: u64) {
    std::thread::scope(|s| {
        for t in 0..threads {
            s.spawn(move || {
                let mut b = RunBuilder::new(run_id(2_000 + t), 1);
                // Every other commit may be written in place.
                let commit = |i: u64, batch| match i % 2 {
                    0 => store.commit_alone(batch),
                    _ => store.commit(batch),
                };
                let mut handles = vec![commit(
                    0,
                    CommitBatch::append(
                        b.run,
                        vec![b.next(started(b.run, &format!("piped-{t}"), "wf"))],
                    ),
                )];
                for i in 0..commits {
                    let event = b.next(signal("s", &i.to_le_bytes()));
                    handles.push(commit(i + 1, CommitBatch::append(b.run, vec![event])));
                }
                answered_in_order(t, handles);
            });
        }
    });
    for t in 0..threads {
        let seqs: Vec<u64> = store
            .history(run_id(2_000 + t))
            .unwrap()
            .iter()
            .map(|e| e.seq.0)
            .collect();
        assert_eq!(seqs, (1..=commits + 1).collect::<Vec<_>>(), "run {t}");
    }
    assert!(store.verify().unwrap().ok);
}

/// Waits for every handle of thread `t`, checking each was accepted and
/// that none was answered before an earlier one.
fn answered_in_order(t: u64, handles: Vec<keel_storage::CommitHandle>) {
    use futures::FutureExt;
    let mut handles: Vec<Option<keel_storage::CommitHandle>> =
        handles.into_iter().map(Some).collect();
    let mut left = handles.len();
    while left > 0 {
        // From the last to the first: whatever answers arrive during the
        // sweep, an earlier commit's came first, so it is seen too.
        let mut later_answered = None;
        for i in (0..handles.len()).rev() {
            if let Some(h) = &mut handles[i] {
                if let Some(answer) = h.now_or_never() {
                    answer.unwrap_or_else(|e| panic!("thread {t}, commit {i}: {e}"));
                    handles[i] = None;
                    left -= 1;
                }
            }
            match (&handles[i], later_answered) {
                (None, None) => later_answered = Some(i),
                (Some(_), Some(j)) => panic!("thread {t}: commit {j} answered before commit {i}"),
                _ => {}
            }
        }
        std::thread::sleep(std::time::Duration::from_micros(50));
    }
}

#[test]
fn pipelined_commits_keep_their_order_in_place_or_queued() {
    for durability in [Durability::Sync, Durability::Buffered] {
        let dir = tempfile::tempdir().unwrap();
        let store = RocksStore::open(dir.path(), durability).unwrap();
        pipelined_runs_keep_their_order(&store, 4, 300);
    }
}

/// Goal: a commit made alone (`commit_alone`: the committer has nothing
/// else in flight) while the RocksDB writer is idle is written by its
/// committer and answered before the call returns, saving the two thread
/// wake-ups of the queue (what makes W1 at concurrency 1 faster). Method:
/// on a new store with nothing queued, the handle `commit_alone` returns
/// must already hold its answer.
#[test]
fn a_commit_made_alone_to_an_idle_store_is_answered_before_it_returns() {
    use futures::FutureExt;
    let dir = tempfile::tempdir().unwrap();
    let store = RocksStore::open(dir.path(), Durability::Sync).unwrap();
    let run = run_id(3_000);
    let handle = store.commit_alone(CommitBatch::append(
        run,
        vec![ev(1, 1, started(run, "in-place", "wf"))],
    ));
    let answered = handle.now_or_never().expect("answered in place");
    answered.expect("accepted");
    assert_eq!(store.history(run).unwrap().len(), 1);
}

/// Goal: a plain `commit` goes to the writer thread even when the writer is
/// idle, so a committer with more commits coming is never blocked through
/// a sync and its commits can share a group (written in place one by one,
/// a 1,000-way fan-out's results took 20 times longer). Method: twenty
/// plain commits on an idle synced store, each waited for before the next:
/// one written in place would be answered when `commit` returns, a queued
/// one only after the writer thread's sync, so at least one handle must
/// still be pending when first polled (all twenty answered would need this
/// thread to lose the processor for longer than a sync after every call).
#[test]
fn a_plain_commit_is_queued_even_when_the_writer_is_idle() {
    use futures::FutureExt;
    let dir = tempfile::tempdir().unwrap();
    let store = RocksStore::open(dir.path(), Durability::Sync).unwrap();
    let mut b = RunBuilder::new(run_id(4_000), 1);
    b.commit(&store, vec![started(b.run, "queued", "wf")])
        .unwrap();
    let mut pending = 0;
    for i in 0u8..20 {
        let event = b.next(signal("s", &[i]));
        let mut handle = store.commit(CommitBatch::append(b.run, vec![event]));
        match (&mut handle).now_or_never() {
            Some(answer) => answer.map(drop).unwrap(),
            None => {
                pending += 1;
                handle.wait().unwrap();
            }
        }
    }
    assert!(pending > 0, "every plain commit was answered in place");
}

fn race_same_run(store: &dyn Store) {
    const RACERS: usize = 16;
    let b = start(store, 1, "race", "wf");
    let barrier = Barrier::new(RACERS);
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..RACERS)
            .map(|i| {
                let barrier = &barrier;
                s.spawn(move || {
                    barrier.wait();
                    let r = commit(store, b.run, vec![ev(2, 5_000, signal("s", &[i as u8]))]);
                    (i, r)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    check_one_winner(store, b.run, results);

    // Submitted without waiting: the first may be committed in place by
    // this thread (an idle writer), the rest meet in the writer's queue or
    // follow it.
    let handles: Vec<_> = (0..RACERS)
        .map(|i| {
            store.commit(CommitBatch::append(
                b.run,
                vec![ev(3, 6_000, signal("t", &[i as u8]))],
            ))
        })
        .collect();
    let results = handles
        .into_iter()
        .enumerate()
        .map(|(i, h)| (i, h.wait()))
        .collect();
    check_one_winner(store, b.run, results);
    assert_eq!(store.history(b.run).unwrap().len(), 3);
}

fn check_one_winner(
    store: &dyn Store,
    run: keel_storage::RunId,
    results: Vec<(usize, keel_storage::Result<keel_storage::CommitAck>)>,
) {
    let winners: Vec<usize> = results
        .iter()
        .filter(|(_, r)| r.is_ok())
        .map(|(i, _)| *i)
        .collect();
    assert_eq!(winners.len(), 1, "exactly one commit of a seq wins");
    let seq = store.run_meta(run).unwrap().unwrap().next_seq.0 - 1;
    for (_, r) in &results {
        if let Err(e) = r {
            assert!(
                matches!(e, Error::SeqGap { expected, found, .. }
                    if expected.0 == seq + 1 && found.0 == seq),
                "{e}"
            );
        }
    }
    let last: Event = store.history(run).unwrap().pop().unwrap();
    match last.kind {
        EventKind::SignalReceived { payload, .. } => assert_eq!(payload.0, vec![winners[0] as u8]),
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn racing_commits_to_one_run_have_exactly_one_winner() {
    for_each_store(race_same_run);
}

/// A batch for `run` under shard 3's lease at `epoch`.
fn fenced_batch(run: keel_storage::RunId, events: Vec<Event>, epoch: u64) -> CommitBatch {
    CommitBatch {
        fence: Some(keel_storage::Fence { shard: 3, epoch }),
        ..CommitBatch::append(run, events)
    }
}

/// One engine process's handles on a store processes share.
struct Process<'a> {
    store: &'a dyn Store,
    leases: &'a dyn ShardLeases,
}

fn lease_fencing(p1: Process, p2: Process) {
    let p1_lease = p1
        .leases
        .take_shard_lease(3, "p1", Timestamp(0), 1_000)
        .unwrap();
    assert_eq!(p1_lease.epoch, 1);
    assert!(matches!(
        p2.leases.take_shard_lease(3, "p2", Timestamp(500), 1_000),
        Err(Error::ShardHeld { shard: 3, .. })
    ));
    let run = run_id(1);
    let fenced = |events, epoch| fenced_batch(run, events, epoch);
    p1.store
        .commit(fenced(vec![ev(1, 100, started(run, "fence", "wf"))], 1))
        .wait()
        .unwrap();
    let p2_lease = p2
        .leases
        .take_shard_lease(3, "p2", Timestamp(1_000), 1_000)
        .unwrap();
    assert_eq!(p2_lease.epoch, 2);
    let before = dump(p2.store);
    let err = p1
        .store
        .commit(fenced(vec![ev(2, 1_100, signal("s", b"stale"))], 1))
        .wait()
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Fenced {
                shard: 3,
                epoch: 1,
                current: Some(2)
            }
        ),
        "{err}"
    );
    assert_eq!(dump(p2.store), before, "a fenced commit wrote something");
    assert!(matches!(
        p1.leases
            .renew_shard_lease(&p1_lease, Timestamp(1_100), 1_000),
        Err(Error::Fenced { .. })
    ));
    p2.store
        .commit(fenced(vec![ev(2, 1_200, signal("s", b"owner"))], 2))
        .wait()
        .unwrap();
    // A renewal keeps the epoch; a release lets the next owner in at once.
    let p2_lease = p2
        .leases
        .renew_shard_lease(&p2_lease, Timestamp(1_500), 1_000)
        .unwrap();
    assert_eq!((p2_lease.epoch, p2_lease.expires_at), (2, Timestamp(2_500)));
    p2.leases
        .release_shard_lease(&p2_lease, Timestamp(1_600))
        .unwrap();
    let p3 = p1
        .leases
        .take_shard_lease(3, "p3", Timestamp(1_600), 1_000)
        .unwrap();
    assert_eq!(p3.epoch, 3);
    assert_eq!(p2.leases.shard_leases().unwrap(), vec![p3]);
    assert!(p2.store.verify().unwrap().ok);
    // Members: the live ones, and the long gone forgotten.
    p1.leases
        .heartbeat_member("p1", Timestamp(0), 1_000)
        .unwrap();
    p2.leases
        .heartbeat_member("p2", Timestamp(1_500), 1_000)
        .unwrap();
    let names = |ms: Vec<keel_storage::Member>| -> Vec<String> {
        ms.into_iter().map(|m| m.owner).collect()
    };
    assert_eq!(names(p1.leases.members().unwrap()), ["p1", "p2"]);
    p2.leases
        .heartbeat_member("p2", Timestamp(2_500), 1_000)
        .unwrap();
    assert_eq!(
        names(p1.leases.members().unwrap()),
        ["p2"],
        "p1 ended at 1000, gone by 2000"
    );
}

#[test]
fn a_commit_under_a_lost_shard_lease_is_refused() {
    // Goal: on every store processes can share, a process whose shard
    // lease was taken over can never commit for that shard again. Method:
    // p1 takes shard 3 and commits under its fence; after its lease ends
    // p2 takes the shard; p1's next commit and its renewal are refused as
    // fenced and write nothing; p2 commits, renews and releases, and the
    // next taker gets the next epoch. On the in-memory store both
    // processes use one handle; on PostgreSQL each opens the database
    // sharded.
    let store = MemStore::new(Durability::Sync);
    let process = || Process {
        store: &store,
        leases: &store,
    };
    lease_fencing(process(), process());
    if let Some(url) = postgres_url() {
        let scratch = PgScratch::new(&url);
        let a = PgStore::open(scratch.0.clone().sharded()).expect("open p1");
        let b = PgStore::open(scratch.0.clone().sharded()).expect("open p2");
        lease_fencing(
            Process {
                store: &a,
                leases: &a,
            },
            Process {
                store: &b,
                leases: &b,
            },
        );
    }
    let run = run_id(1);
    let fenced = |events, epoch| fenced_batch(run, events, epoch);

    // A store nobody leased shards of refuses a fenced commit too.
    let dir = tempfile::tempdir().unwrap();
    let rocks = RocksStore::open(dir.path(), Durability::Sync).unwrap();
    let err = rocks
        .commit(fenced(vec![ev(1, 100, started(run, "fence", "wf"))], 1))
        .wait()
        .unwrap_err();
    assert!(matches!(err, Error::Fenced { current: None, .. }), "{err}");
}

#[test]
fn the_rocksdb_writer_counts_its_idle_and_validating_time() {
    // Goal: the writer's time is split into what `keel bench w1` reports:
    // waiting with nothing queued, validating, writing and syncing.
    // Method: commit to a fresh RocksDB store with pauses in between (the
    // writer waits through each), and read its counters.
    let dir = tempfile::tempdir().unwrap();
    let rocks = RocksStore::open(dir.path(), Durability::Sync).unwrap();
    let before = rocks.writer_stats().expect("the RocksDB writer counts");
    for n in 1..=3 {
        std::thread::sleep(std::time::Duration::from_millis(20));
        start(&rocks, n, &format!("idle-{n}"), "wf");
    }
    let after = rocks.writer_stats().unwrap();
    assert_eq!(after.commits - before.commits, 3, "{after:?}");
    assert!(
        after.idle_seconds - before.idle_seconds >= 0.05,
        "three pauses of 20 ms are idle time: {after:?}"
    );
    assert!(
        after.validate_seconds > before.validate_seconds,
        "{after:?}"
    );
    assert!(
        after.validate_seconds < after.idle_seconds,
        "validating three starts is quicker than the pauses: {after:?}"
    );
}

#[test]
fn only_a_child_s_close_removes_a_cancellation_addressed_to_it() {
    // Goal: a close writes the tombstone of the cancellation addressed to
    // its run only when the run can have one (it is a child); a parentless
    // run's close leaves nothing in the outbox family, whose windows
    // recovery scans (a blind delete per close piled up there). Method:
    // derive a start and a completion over empty maps, once without a
    // parent and once as a child, and look at the outbox writes of the
    // completion.
    use keel_storage::derive::{apply_batch, PreparedBatch};
    use keel_storage::keys::{self, Cf};
    use keel_storage::kv::{mutations_of, Maps};
    let run = run_id(7);
    let close_writes = |parent: Option<ParentRef>| {
        let mut start = started(run, "tomb", "wf");
        if let EventKind::WorkflowStarted(s) = &mut start {
            s.parent = parent;
        }
        let prepare = |events| PreparedBatch::new(CommitBatch::append(run, events)).unwrap();
        let mut maps = Maps::default();
        let (writes, _) = apply_batch(&maps, &prepare(vec![ev(1, 100, start)])).unwrap();
        maps.apply(&mutations_of(writes));
        let (writes, _) =
            apply_batch(&maps, &prepare(vec![ev(2, 200, workflow_completed())])).unwrap();
        writes
            .into_iter()
            .filter(|((cf, _), _)| *cf == Cf::Outbox)
            .collect::<Vec<_>>()
    };
    assert_eq!(close_writes(None), vec![]);
    let parent = ParentRef {
        instance_id: InstanceId::new("parent"),
        run_id: run_id(8),
        step: Step(3),
        close_policy: ParentClosePolicy::Terminate,
    };
    let child = close_writes(Some(parent));
    assert!(
        child.contains(&((Cf::Outbox, keys::outbox_cancel_key(run)), None)),
        "{child:?}"
    );
}

#[test]
fn a_child_that_never_started_takes_its_cancellation_with_it() {
    // Goal: a cancellation sent to a child whose start was refused does
    // not stay in the outbox (its delivery would meet "no such run"
    // forever). Method: a parent schedules a child, asks to cancel it
    // before it started, and records that the child failed to start; the
    // outbox must then be empty on every store and `verify` agree.
    for_each_store(|store| {
        let child_run = run_id(2);
        let (mut parent, _) =
            parent_of_child(store, 1, "parent", child_run, ParentClosePolicy::Terminate);
        parent
            .commit(
                store,
                vec![EventKind::ChildCancelRequested {
                    step: Step(1),
                    child_run_id: child_run,
                    policy: ParentClosePolicy::RequestCancel,
                    reason: "not needed".into(),
                }],
            )
            .unwrap();
        assert!(
            store
                .outbox(10)
                .unwrap()
                .iter()
                .any(|m| matches!(m, OutboxMessage::CancelChild { .. })),
            "the cancellation is queued"
        );
        parent
            .commit(
                store,
                vec![EventKind::ChildFailed {
                    step: Step(1),
                    child_run_id: child_run,
                    failure: keel_storage::Failure::new(
                        keel_storage::FailureKind::Application,
                        "child did not start",
                        false,
                    ),
                }],
            )
            .unwrap();
        assert_eq!(store.outbox(10).unwrap(), vec![]);
        assert!(store.verify().unwrap().ok);
    });
}

#[test]
fn a_group_keeps_its_good_commits_and_answers_each_with_its_own_rows() {
    // Goal: validating a group as steps of one overlay (RocksDB's writer)
    // writes and answers exactly what validating its good commits one by
    // one does; a refused commit between them leaves no trace, and leaving
    // the events to the writer leaves only them out. Method: four batches
    // over empty maps (a start and a schedule; a completion, a schedule
    // and then a completion of an unknown step, refused; the same without
    // the bad event; another run's start), validated as one group both
    // ways and one by one, comparing the writes and each answer.
    use keel_storage::derive::{apply_batch, apply_batch_step, Checks, EventRows, PreparedBatch};
    use keel_storage::keys::Cf;
    use keel_storage::kv::{mutations_of, Maps, Overlay};
    let (a, b) = (run_id(1), run_id(2));
    let prepare = |run, events| PreparedBatch::new(CommitBatch::append(run, events)).unwrap();
    let batches = [
        prepare(
            a,
            vec![
                ev(1, 100, started(a, "a", "wf")),
                ev(2, 100, scheduled(a, 1)),
            ],
        ),
        prepare(
            a,
            vec![
                ev(3, 200, completed(a, 1, 1)),
                ev(4, 200, scheduled(a, 2)),
                ev(5, 200, completed(a, 9, 1)),
            ],
        ),
        prepare(
            a,
            vec![ev(3, 200, completed(a, 1, 1)), ev(4, 200, scheduled(a, 2))],
        ),
        prepare(b, vec![ev(1, 300, started(b, "b", "wf"))]),
    ];

    // Maps that keep every record whole, as PostgreSQL does: where records
    // lag, a group writes a run's record its commits alone would leave out
    // (a progress rewrite after a real change in the same group).
    struct Whole<'a>(&'a Maps);
    impl keel_storage::kv::KvRead for Whole<'_> {
        fn get(&self, cf: Cf, key: &[u8]) -> keel_storage::Result<Option<Vec<u8>>> {
            self.0.get(cf, key)
        }
        fn scan(
            &self,
            cf: Cf,
            prefix: &[u8],
            from: &[u8],
            visit: &mut dyn FnMut(&[u8], &[u8]) -> bool,
        ) -> keel_storage::Result<()> {
            self.0.scan(cf, prefix, from, visit)
        }
        fn records_lag(&self) -> bool {
            false
        }
    }

    // One by one, each good commit over the writes of those before it.
    let mut maps = Maps::default();
    let mut alone = Vec::new();
    let mut all_writes = keel_storage::kv::Writes::new();
    for (i, batch) in batches.iter().enumerate() {
        match apply_batch(&Whole(&maps), batch) {
            Ok((writes, ack)) => {
                maps.apply(&mutations_of(writes.clone()));
                all_writes.extend(writes);
                alone.push(Some(ack));
            }
            Err(e) => {
                assert_eq!(i, 1, "only the second batch is bad: {e}");
                alone.push(None);
            }
        }
    }

    for rows in [EventRows::Written, EventRows::Caller] {
        let empty = Maps::default();
        let whole = Whole(&empty);
        let mut group = Overlay::new(&whole);
        let answers: Vec<_> = batches
            .iter()
            .map(|batch| {
                apply_batch_step(&mut group, batch, Checks::ALL, rows)
                    .and_then(|raw| raw.decode())
                    .ok()
            })
            .collect();
        assert_eq!(answers, alone, "{rows:?}");
        let expected: keel_storage::kv::Writes = all_writes
            .iter()
            .filter(|((cf, _), _)| rows == EventRows::Written || *cf != Cf::Events)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        assert_eq!(group.into_writes(), expected, "{rows:?}");
    }
}

/// The raw stored record of `run`, decoded as it is (not caught up).
fn stored_record(store: &dyn Store, run: keel_storage::RunId) -> keel_storage::RunMeta {
    let bytes = store
        .view()
        .get(
            keel_storage::keys::Cf::Runs,
            &keel_storage::keys::run_key(run),
        )
        .unwrap()
        .expect("a run record");
    keel_storage::codec::decode(keel_storage::codec::RecordKind::Run, &bytes).unwrap()
}

/// Goal: a store whose run records lag leaves out a rewrite of an open
/// run's record that changes only its progress, yet every reader sees the
/// progress its events say, the commit path still refuses a commit that
/// does not continue from the last event, and a change of anything else
/// (here the close) is written. Method: five signals committed one at a
/// time; the raw record must still say what the start wrote (the saving
/// taken) where the store lags, and be current where it does not
/// (PostgreSQL); `run_meta` and a list must say seq 7 and the last
/// event's time; a commit at the record's stale seq must be refused as a
/// gap; after the close the raw record is current; `verify` passes.
#[test]
fn an_open_runs_record_trails_its_events_and_every_reader_catches_it_up() {
    for_each_store(|store| {
        let mut b = start(store, 41, "lag", "wf");
        let started_at = b.at - 10;
        for i in 0..5u8 {
            b.commit(store, vec![signal("s", &[i])]).unwrap();
        }
        let last_at = Timestamp(b.at - 10);
        let raw = stored_record(store, b.run);
        if store.view().records_lag() {
            assert_eq!(raw.next_seq, Seq(2), "the progress rewrites were left out");
            assert_eq!(raw.updated_at, Timestamp(started_at));
        } else {
            assert_eq!(raw.next_seq, Seq(7));
        }
        let meta = store.run_meta(b.run).unwrap().unwrap();
        assert_eq!((meta.next_seq, meta.updated_at), (Seq(7), last_at));
        let listed = store
            .list(&RunFilter::default(), 1000, None)
            .unwrap()
            .runs
            .into_iter()
            .find(|m| m.run_id == b.run)
            .expect("listed");
        assert_eq!(listed, meta);
        // The seq the stale record names is taken.
        let err = commit(store, b.run, vec![ev(2, b.at, signal("s", b"again"))]).unwrap_err();
        assert!(
            matches!(
                err,
                Error::SeqGap {
                    expected: Seq(7),
                    found: Seq(2),
                    ..
                }
            ),
            "{err}"
        );
        b.commit(store, vec![workflow_completed()]).unwrap();
        let raw = stored_record(store, b.run);
        assert_eq!((raw.next_seq, raw.status), (Seq(8), RunStatus::Completed));
        assert!(store.verify().unwrap().ok);
    });
}

/// Goal: after a restart, when the writer knows nothing of a run, its
/// trailing record is caught up from the run's last event before a commit
/// is checked, so a commit that repeats a seq already written is refused
/// and the next one accepted. Method: RocksDB; seven signals, close,
/// reopen; commits at the record's stale seq and at a seq in the middle
/// are refused as gaps naming seq 9; seq 9 is accepted.
#[test]
fn a_trailing_record_is_caught_up_before_a_commit_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut b = {
        let store = RocksStore::open(dir.path(), Durability::Sync).unwrap();
        let mut b = start(&store, 42, "restart-lag", "wf");
        for i in 0..7u8 {
            b.commit(&store, vec![signal("s", &[i])]).unwrap();
        }
        assert_eq!(stored_record(&store, b.run).next_seq, Seq(2));
        store.close().unwrap();
        b
    };
    let store = RocksStore::open(dir.path(), Durability::Sync).unwrap();
    for seq in [2, 5] {
        let err = commit(&store, b.run, vec![ev(seq, b.at, signal("s", b"dup"))]).unwrap_err();
        assert!(
            matches!(
                err,
                Error::SeqGap {
                    expected: Seq(9),
                    ..
                }
            ),
            "seq {seq}: {err}"
        );
    }
    b.commit(&store, vec![signal("s", b"next")]).unwrap();
    assert_eq!(store.run_meta(b.run).unwrap().unwrap().next_seq, Seq(10));
    assert!(store.verify().unwrap().ok);
}
