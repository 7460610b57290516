// Goal: the persisted bytes of every history event kind never change by
// accident, and bytes written by a released build keep decoding.
// Method: one deterministic sample per `EventKind` variant (every optional
// field filled, so a renamed or reordered field shows), encoded through the
// record envelope and compared byte for byte with
// `tests/data/golden/events/v<EVENT_VERSION>/<Variant>.bin`; each golden file
// is also decoded and compared with its sample. The files of every earlier
// version stay, and each must still decode to its sample with the fields
// that version lacked at their defaults. `KEEL_BLESS=1` rewrites the files of
// the current version only. An exhaustive `match` (no wildcard) makes a new
// variant a build error here until it has a sample and a golden file.

use std::collections::BTreeSet;
use std::path::PathBuf;

use keel_storage::codec::{self, RecordKind, EVENT_VERSION};
use keel_storage::event::{attempt_of, execution_of};
use keel_storage::{
    ActivityOptions, AttemptNo, Backoff, Carried, CarriedSignal, CarriedStream, CommandId,
    Delivery, Event, EventKind, Failure, FailureKind, GroupEntry, InstanceId, Jitter, MessageKey,
    OperationKind, ParentClosePolicy, ParentRef, Payload, RetrySettings, RunId, RunTimeouts,
    SearchValue, SelectKey, Seq, StartTimeouts, Step, StreamMessage, Timestamp, WorkflowTimeout,
};

/// Number of `EventKind` variants; `ordinal` must map onto `0..VARIANTS`.
const VARIANTS: usize = 34;

/// A dense number per variant. No wildcard arm: adding a variant to
/// `EventKind` fails to compile until it is listed here (and then the
/// coverage test fails until `samples` has one).
fn ordinal(kind: &EventKind) -> usize {
    match kind {
        EventKind::WorkflowStarted { .. } => 0,
        EventKind::WorkflowCompleted { .. } => 1,
        EventKind::WorkflowFailed { .. } => 2,
        EventKind::WorkflowCancelRequested { .. } => 3,
        EventKind::WorkflowCancelled { .. } => 4,
        EventKind::WorkflowTerminated { .. } => 5,
        EventKind::WorkflowContinuedAsNew { .. } => 6,
        EventKind::ActivityScheduled { .. } => 7,
        EventKind::ActivityAttemptFailed { .. } => 8,
        EventKind::ActivityCompleted { .. } => 9,
        EventKind::ActivityCancelRequested { .. } => 10,
        EventKind::ActivityCancelled { .. } => 11,
        EventKind::TimerStarted { .. } => 12,
        EventKind::TimerFired { .. } => 13,
        EventKind::TimerCancelled { .. } => 14,
        EventKind::ChildScheduled { .. } => 15,
        EventKind::ChildStarted { .. } => 16,
        EventKind::ChildCompleted { .. } => 17,
        EventKind::ChildFailed { .. } => 18,
        EventKind::SignalReceived { .. } => 19,
        EventKind::UpdateAccepted { .. } => 20,
        EventKind::UpdateCompleted { .. } => 21,
        EventKind::SideEffectRecorded { .. } => 22,
        EventKind::SelectionWinnerRecorded { .. } => 23,
        EventKind::SelectionOperationCancelled { .. } => 24,
        EventKind::VersionMarker { .. } => 25,
        EventKind::MemoUpserted { .. } => 26,
        EventKind::SearchAttributesUpserted { .. } => 27,
        EventKind::ScopeCancelled { .. } => 28,
        EventKind::ChildCancelRequested { .. } => 29,
        EventKind::MessageReceived { .. } => 30,
        EventKind::ExternalSendScheduled { .. } => 31,
        EventKind::ExternalSendCompleted { .. } => 32,
        EventKind::WorkflowTimedOut { .. } => 33,
    }
}

fn run() -> RunId {
    RunId::from_u64_pair(0x0123_4567_89ab_cdef, 0xfedc_ba98_7654_3210)
}

fn other_run() -> RunId {
    RunId::from_u64_pair(0x1111_2222_3333_4444, 0x5555_6666_7777_8888)
}

fn payload(text: &str) -> Payload {
    Payload::encode(text).expect("encode payload")
}

fn failure() -> Failure {
    Failure {
        kind: FailureKind::Application,
        message: "card declined".into(),
        retryable: true,
        details: Some(payload("details")),
    }
}

fn carried() -> Carried {
    Carried {
        signals: vec![CarriedSignal {
            name: "approve".into(),
            payload: payload("unread"),
        }],
        commands: vec![CommandId::new("signal-0")],
        memo: vec![("owner".into(), payload("ann"))],
        search_attributes: vec![("customer".into(), SearchValue::from("c-42").to_payload())],
        streams: vec![CarriedStream {
            name: "orders".into(),
            next_offset: 7,
            unread: vec![StreamMessage {
                offset: 6,
                key: MessageKey::new("order-6"),
                payload: payload("unread message"),
            }],
            keys: vec![
                (MessageKey::new("order-5"), 5),
                (MessageKey::new("order-6"), 6),
            ],
        }],
        timeouts: timeouts(),
    }
}

fn timeouts() -> RunTimeouts {
    RunTimeouts {
        run_ms: Some(30_000),
        execution_deadline: Some(Timestamp(1_700_000_600_000)),
    }
}

fn group() -> Vec<GroupEntry> {
    vec![
        GroupEntry {
            step: Step(2),
            size: 3,
            index: 1,
        },
        GroupEntry {
            step: Step(4),
            size: 2,
            index: 0,
        },
    ]
}

/// One sample per variant, in declaration order, with fixed values.
fn samples() -> Vec<Event> {
    let run = run();
    let kinds = vec![
        EventKind::WorkflowStarted(Box::new(keel_storage::WorkflowStart {
            instance_id: InstanceId::new("order-42"),
            run_id: run,
            workflow_type: "checkout".into(),
            input: payload("input"),
            command_id: Some(CommandId::new("start-1")),
            parent: Some(ParentRef {
                instance_id: InstanceId::new("parent-7"),
                run_id: other_run(),
                step: Step(3),
                close_policy: ParentClosePolicy::RequestCancel,
            }),
            continued_from: Some(other_run()),
            random_seed: 0xdead_beef_cafe_f00d,
            previous_run: Some(other_run()),
            carried: carried(),
            memo: vec![("tier".into(), payload("gold"))],
            search_attributes: vec![("amount".into(), SearchValue::Int(1250).to_payload())],
            timeouts: timeouts(),
        })),
        EventKind::WorkflowCompleted {
            result: payload("result"),
        },
        EventKind::WorkflowFailed { failure: failure() },
        EventKind::WorkflowCancelRequested {
            command_id: Some(CommandId::new("cancel-1")),
            reason: "user asked".into(),
        },
        EventKind::WorkflowCancelled {
            reason: "user asked".into(),
        },
        EventKind::WorkflowTerminated {
            reason: "operator".into(),
            command_id: Some(CommandId::new("terminate-1")),
        },
        EventKind::WorkflowContinuedAsNew {
            new_run_id: other_run(),
            input: payload("next"),
            carried: Box::new(carried()),
        },
        EventKind::ActivityScheduled {
            step: Step(5),
            group: group(),
            execution_id: execution_of(run, Step(5)),
            activity_type: "charge_card".into(),
            input: payload("charge"),
            options: Box::new(ActivityOptions {
                start_to_close_ms: Some(30_000),
                schedule_to_close_ms: Some(600_000),
                heartbeat_ms: Some(5_000),
                retry: Some(RetrySettings {
                    attempts_max: 5,
                    initial_delay_ms: 100,
                    backoff_factor: 2.5,
                    delay_max_ms: 60_000,
                    jitter: Jitter::Full,
                    backoff_mode: Some(Backoff::Linear),
                }),
                profile: Some("payments".into()),
                schedule_to_start_ms: Some(2_000),
            }),
        },
        EventKind::ActivityAttemptFailed {
            step: Step(5),
            attempt_id: attempt_of(run, Step(5), AttemptNo(2)),
            failure: Box::new(failure()),
            retry_at: Some(Timestamp(1_700_000_005_000)),
            heartbeat: Some(payload("row 812")),
        },
        EventKind::ActivityCompleted {
            step: Step(5),
            attempt_id: attempt_of(run, Step(5), AttemptNo(3)),
            result: payload("charged"),
        },
        EventKind::ActivityCancelRequested {
            step: Step(6),
            execution_id: execution_of(run, Step(6)),
        },
        EventKind::ActivityCancelled {
            step: Step(6),
            execution_id: execution_of(run, Step(6)),
        },
        EventKind::TimerStarted {
            step: Step(7),
            group: group(),
            fire_at: Timestamp(1_700_000_060_000),
        },
        EventKind::TimerFired {
            step: Step(7),
            fire_at: Timestamp(1_700_000_060_000),
        },
        EventKind::TimerCancelled {
            step: Step(8),
            fire_at: Timestamp(1_700_000_090_000),
        },
        EventKind::ChildScheduled(Box::new(keel_storage::ChildSchedule {
            step: Step(9),
            group: group(),
            child_instance_id: InstanceId::for_child(run, Step(9)),
            child_run_id: other_run(),
            workflow_type: "ship".into(),
            input: payload("ship it"),
            close_policy: ParentClosePolicy::Abandon,
            memo: vec![("shipment".into(), payload("SHP-7"))],
            search_attributes: vec![("warehouse".into(), SearchValue::from("north").to_payload())],
            timeouts: StartTimeouts {
                run_ms: Some(60_000),
                execution_ms: Some(3_600_000),
            },
        })),
        EventKind::ChildStarted {
            step: Step(9),
            child_run_id: other_run(),
        },
        EventKind::ChildCompleted {
            step: Step(9),
            child_run_id: other_run(),
            result: payload("shipped"),
        },
        EventKind::ChildFailed {
            step: Step(10),
            child_run_id: other_run(),
            failure: Failure {
                kind: FailureKind::Terminated,
                message: "terminated".into(),
                retryable: false,
                details: None,
            },
        },
        EventKind::SignalReceived {
            name: "approve".into(),
            payload: payload("yes"),
            command_id: Some(CommandId::new("signal-1")),
        },
        EventKind::UpdateAccepted {
            update_id: CommandId::new("update-1"),
            name: "set_address".into(),
            payload: payload("street"),
        },
        EventKind::UpdateCompleted {
            update_id: CommandId::new("update-1"),
            result: payload("updated"),
            failure: Some(failure()),
        },
        EventKind::SideEffectRecorded {
            step: Step(11),
            value: payload("uuid"),
        },
        EventKind::SelectionWinnerRecorded {
            step: Step(12),
            member_index: 1,
            key: SelectKey::Name("timeout".into()),
            operation: OperationKind::Timer,
            member_step: Step(14),
        },
        EventKind::SelectionOperationCancelled {
            step: Step(12),
            member_index: 0,
            member_step: Step(13),
        },
        EventKind::VersionMarker {
            step: Step(15),
            change_id: "new-tax-rules".into(),
            version: 2,
        },
        EventKind::MemoUpserted {
            fields: vec![
                ("owner".into(), payload("ann")),
                ("tier".into(), payload("gold")),
            ],
        },
        EventKind::SearchAttributesUpserted {
            attributes: vec![("region".into(), payload("eu"))],
        },
        EventKind::ScopeCancelled {
            step: Step(16),
            reason: "select lost".into(),
        },
        EventKind::ChildCancelRequested {
            step: Step(9),
            child_run_id: other_run(),
            policy: ParentClosePolicy::Terminate,
            reason: "its scope was cancelled".into(),
        },
        EventKind::MessageReceived {
            stream: "orders".into(),
            offset: 6,
            key: MessageKey::new("order-6"),
            payload: payload("message"),
        },
        EventKind::ExternalSendScheduled {
            step: Step(17),
            target: "warehouse-3".into(),
            delivery: Delivery::Message {
                stream: "orders".into(),
                key: MessageKey::new("order-42"),
                payload: payload("order"),
            },
        },
        EventKind::ExternalSendCompleted {
            step: Step(17),
            offset: Some(6),
            failure: Some(failure()),
        },
        EventKind::WorkflowTimedOut {
            timeout: WorkflowTimeout::Execution,
            deadline: Timestamp(1_700_000_600_000),
        },
    ];
    kinds
        .into_iter()
        .enumerate()
        .map(|(i, kind)| Event {
            seq: Seq(i as u64 + 1),
            at: Timestamp(1_700_000_000_000 + i as u64 * 1_000),
            kind,
        })
        .collect()
}

fn golden_dir_of(version: u16) -> PathBuf {
    manifest_dir()
        .join("../../tests/data/golden/events")
        .join(format!("v{version}"))
}

fn golden_dir() -> PathBuf {
    golden_dir_of(EVENT_VERSION)
}

/// What a sample looked like in schema version 1: the fields added since
/// at their defaults; `None` for a variant version 1 did not have.
fn as_v1(e: Event) -> Option<Event> {
    let mut e = as_v2(e)?;
    match &mut e.kind {
        EventKind::WorkflowStarted(start) => start.previous_run = None,
        EventKind::ActivityAttemptFailed { heartbeat, .. } => *heartbeat = None,
        EventKind::ActivityScheduled { options, .. } => {
            options.schedule_to_start_ms = None;
            if let Some(r) = &mut options.retry {
                r.backoff_mode = None;
            }
        }
        EventKind::ChildCancelRequested { .. } => return None,
        _ => {}
    }
    Some(e)
}

/// What a sample looked like in event version 6: no workflow timeouts.
fn as_v6(mut e: Event) -> Option<Event> {
    match &mut e.kind {
        EventKind::WorkflowTimedOut { .. } => return None,
        EventKind::WorkflowStarted(start) => {
            let keel_storage::WorkflowStart {
                timeouts, carried, ..
            } = &mut **start;
            *timeouts = RunTimeouts::default();
            carried.timeouts = RunTimeouts::default();
        }
        EventKind::WorkflowContinuedAsNew { carried, .. } => {
            carried.timeouts = RunTimeouts::default()
        }
        EventKind::ChildScheduled(child) => child.timeouts = Default::default(),
        _ => {}
    }
    Some(e)
}

/// What a sample looked like in event version 5: children started
/// without memo and search attributes.
fn as_v5(e: Event) -> Option<Event> {
    let mut e = as_v6(e)?;
    if let EventKind::ChildScheduled(child) = &mut e.kind {
        let keel_storage::ChildSchedule {
            memo,
            search_attributes,
            ..
        } = &mut **child;
        memo.clear();
        search_attributes.clear();
    }
    Some(e)
}

/// What a sample looked like in event version 4: no message streams, no
/// sends from workflow code.
fn as_v4(e: Event) -> Option<Event> {
    let mut e = as_v5(e)?;
    match &mut e.kind {
        EventKind::MessageReceived { .. }
        | EventKind::ExternalSendScheduled { .. }
        | EventKind::ExternalSendCompleted { .. } => return None,
        EventKind::WorkflowTerminated { command_id, .. } => *command_id = None,
        EventKind::WorkflowStarted(start) => start.carried.streams.clear(),
        EventKind::WorkflowContinuedAsNew { carried, .. } => carried.streams.clear(),
        _ => {}
    }
    Some(e)
}

/// What a sample looked like in event version 3: starts without memo and
/// search attributes, nothing of either carried.
fn as_v3(e: Event) -> Option<Event> {
    let mut e = as_v4(e)?;
    match &mut e.kind {
        EventKind::WorkflowStarted(start) => {
            let keel_storage::WorkflowStart {
                carried,
                memo,
                search_attributes,
                ..
            } = &mut **start;
            memo.clear();
            search_attributes.clear();
            carried.memo.clear();
            carried.search_attributes.clear();
        }
        EventKind::WorkflowContinuedAsNew { carried, .. } => {
            carried.memo.clear();
            carried.search_attributes.clear();
        }
        _ => {}
    }
    Some(e)
}

/// What a sample looked like in event version 2: `UpdateCompleted`
/// without its failure, starts and continue-as-new without what is carried.
fn as_v2(e: Event) -> Option<Event> {
    let mut e = as_v3(e)?;
    match &mut e.kind {
        EventKind::UpdateCompleted { failure, .. } => *failure = None,
        EventKind::WorkflowStarted(start) => start.carried = Carried::default(),
        EventKind::WorkflowContinuedAsNew { carried, .. } => **carried = Carried::default(),
        _ => {}
    }
    Some(e)
}

fn blessing() -> bool {
    std::env::var("KEEL_BLESS").is_ok_and(|v| v == "1")
}

#[test]
fn samples_cover_every_variant_once() {
    let samples = samples();
    let ordinals: Vec<usize> = samples.iter().map(|e| ordinal(&e.kind)).collect();
    assert_eq!(
        ordinals,
        (0..VARIANTS).collect::<Vec<_>>(),
        "samples must list every EventKind variant exactly once, in order"
    );
    let names: BTreeSet<&str> = samples.iter().map(|e| e.kind.name()).collect();
    assert_eq!(names.len(), VARIANTS, "EventKind::name() must be distinct");
}

#[test]
fn encoding_matches_golden_bytes_and_golden_bytes_decode() {
    // One test does both the blessing and the checks, so a parallel test
    // never reads a half-written directory.
    if blessing() {
        write_golden();
    }
    let expected: BTreeSet<String> = samples()
        .iter()
        .map(|e| format!("{}.bin", e.kind.name()))
        .collect();
    let found: BTreeSet<String> = std::fs::read_dir(golden_dir())
        .expect("golden directory exists (run with KEEL_BLESS=1 to create it)")
        .map(|e| {
            e.expect("dir entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    let missing: Vec<_> = expected.difference(&found).collect();
    let stale: Vec<_> = found.difference(&expected).collect();
    assert!(missing.is_empty(), "golden files missing: {missing:?}");
    assert!(stale.is_empty(), "golden files for no variant: {stale:?}");

    let mut failures = Vec::new();
    for sample in samples() {
        let name = sample.kind.name();
        let path = golden_dir().join(format!("{name}.bin"));
        let bytes = codec::encode(RecordKind::Event, &sample).expect("encode sample");
        let golden = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) => {
                failures.push(format!("{name}: cannot read {}: {e}", path.display()));
                continue;
            }
        };
        if bytes != golden {
            failures.push(format!(
                "{name}: encoding changed ({} bytes now, {} golden); if intended, bump the \
                 schema version and re-bless with KEEL_BLESS=1",
                bytes.len(),
                golden.len()
            ));
        }
        match codec::decode::<Event>(RecordKind::Event, &golden) {
            Ok(decoded) if decoded == sample => {}
            Ok(decoded) => failures.push(format!("{name}: golden decodes to {decoded:?}")),
            Err(e) => failures.push(format!("{name}: golden does not decode: {e}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_earlier_version_still_decodes() {
    // Version 1's files were written before `previous_run`, `heartbeat`,
    // `backoff_mode`, `schedule_to_start_ms` and `ChildCancelRequested`
    // existed (its sample for `ActivityScheduled` recorded jitter "full",
    // factor 2.5): they decode, the new fields at their defaults.
    let mut failures = Vec::new();
    let mut checked = 0;
    for sample in samples() {
        let Some(mut old) = as_v1(sample) else {
            continue;
        };
        let name = old.kind.name();
        let path = golden_dir_of(1).join(format!("{name}.bin"));
        let bytes = std::fs::read(&path)
            .unwrap_or_else(|e| panic!("{name}: cannot read {}: {e}", path.display()));
        if let EventKind::ActivityScheduled { options, .. } = &mut old.kind {
            if let Some(r) = &mut options.retry {
                r.jitter = Jitter::Full;
            }
        }
        checked += 1;
        match codec::decode::<Event>(RecordKind::Event, &bytes) {
            Ok(decoded) if decoded == old => {}
            Ok(decoded) => failures.push(format!("{name}: v1 decodes to {decoded:?}")),
            Err(e) => failures.push(format!("{name}: v1 does not decode: {e}")),
        }
    }
    // Version 1 lacked `ChildCancelRequested`, the three message-stream
    // events and `WorkflowTimedOut`.
    assert_eq!(checked, VARIANTS - 5, "every v1 variant has a file");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Each golden file of `version` decodes to its sample as that version
/// saw it (`as_old`).
fn version_still_decodes(version: u16, as_old: fn(Event) -> Option<Event>) {
    let mut failures = Vec::new();
    for sample in samples() {
        let Some(old) = as_old(sample) else {
            continue;
        };
        let name = old.kind.name();
        let path = golden_dir_of(version).join(format!("{name}.bin"));
        let bytes = std::fs::read(&path)
            .unwrap_or_else(|e| panic!("{name}: cannot read {}: {e}", path.display()));
        match codec::decode::<Event>(RecordKind::Event, &bytes) {
            Ok(decoded) if decoded == old => {}
            Ok(decoded) => failures.push(format!("{name}: v{version} decodes to {decoded:?}")),
            Err(e) => failures.push(format!("{name}: v{version} does not decode: {e}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn version_2_still_decodes() {
    // Version 2's files were written before `UpdateCompleted::failure` and
    // `carried`.
    version_still_decodes(2, as_v2);
}

#[test]
fn version_3_still_decodes() {
    // Version 3's files were written before memo and search attributes at
    // start and in what continue-as-new carries.
    version_still_decodes(3, as_v3);
}

#[test]
fn version_4_still_decodes() {
    // Version 4's files were written before message streams.
    version_still_decodes(4, as_v4);
}

#[test]
fn version_5_still_decodes() {
    // Version 5's files were written before children started with memo
    // and search attributes.
    version_still_decodes(5, as_v5);
}

#[test]
fn version_6_still_decodes() {
    // Version 6's files were written before workflow run and execution
    // timeouts.
    version_still_decodes(6, as_v6);
}

#[test]
fn version_7_still_decodes() {
    // Version 7's files hold the same fields as today's samples, written
    // as maps with field names; version 8 writes the same values
    // positionally, and the decoder reads both.
    version_still_decodes(7, Some);
}

#[test]
fn golden_bytes_are_positional_with_binary_payloads() {
    // The schema rules (structs as arrays of their fields in declaration
    // order, variants by name, payloads as `bin`) are what the golden files
    // pin and what additive evolution relies on; check them on the bytes.
    let sample = &samples()[0];
    let bytes = codec::encode(RecordKind::Event, sample).expect("encode");
    let contains = |needle: &[u8]| bytes.windows(needle.len()).any(|w| w == needle);
    // The event is an array of its three fields (seq, at, kind).
    assert_eq!(bytes[codec::HEADER_BYTES], 0x93, "an event is a 3-array");
    assert!(
        contains(b"WorkflowStarted"),
        "variant names stay in the bytes"
    );
    for field in ["seq", "instance_id", "random_seed", "workflow_type"] {
        assert!(
            !contains(field.as_bytes()),
            "field name {field} is in the bytes"
        );
    }
    let input = payload("input").0;
    let mut bin = vec![0xc4, input.len() as u8];
    bin.extend_from_slice(&input);
    assert!(contains(&bin), "payload is not stored as a msgpack bin");
}

fn write_golden() {
    let dir = golden_dir();
    std::fs::create_dir_all(&dir).expect("create golden dir");
    for sample in samples() {
        let bytes = codec::encode(RecordKind::Event, &sample).expect("encode sample");
        std::fs::write(dir.join(format!("{}.bin", sample.kind.name())), bytes)
            .expect("write golden");
    }
}

/// The package directory at run time. `cargo test` sets it for every test
/// binary; the compile-time `env!` would name whichever clone compiled the
/// binary, and clones sharing one target directory reuse each other's
/// binaries when their sources match.
fn manifest_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}
