// Goal: the event envelope round-trips every value and refuses every damaged
// record with a typed error, never a panic.
// Method: proptest. Arbitrary events (a strategy over many variants with
// arbitrary payload bytes, strings and numbers) must decode to themselves;
// appended bytes, any single flipped byte, truncation and arbitrary byte
// strings (raw, or wrapped in a valid envelope so the msgpack decoder itself
// is exercised) must return `Err`, and decoding must never panic. Run
// records and task rows, written positionally, round-trip too, and their
// maps with field names (what older builds wrote) decode to the same value.
// The codec decodes with its own slice reader first and falls back to
// rmp-serde's: on valid, damaged and arbitrary bodies the two must give the
// same value or both an error.

use keel_storage::codec::{self, RecordKind, HEADER_BYTES, MAGIC};
use keel_storage::event::{attempt_of, execution_of};
use keel_storage::{
    ActivityOptions, AttemptNo, Backoff, CommandId, Event, EventKind, ExecutionId, Failure,
    FailureKind, GroupEntry, InstanceId, Jitter, OperationKind, Outcome, ParentClosePolicy,
    ParentRef, Payload, RetrySettings, RunId, RunMeta, RunStatus, SearchValue, SelectKey, Seq,
    Step, TaskEntry, Timestamp,
};
use proptest::prelude::*;

fn run_id() -> impl Strategy<Value = RunId> {
    any::<(u64, u64)>().prop_map(|(h, l)| RunId::from_u64_pair(h, l))
}

fn payload() -> impl Strategy<Value = Payload> {
    proptest::collection::vec(any::<u8>(), 0..64).prop_map(Payload::from_bytes)
}

fn text() -> impl Strategy<Value = String> {
    // Any unicode, including empty and multi-byte characters.
    any::<String>()
}

fn failure() -> impl Strategy<Value = Failure> {
    (
        prop_oneof![
            Just(FailureKind::Application),
            Just(FailureKind::Panic),
            Just(FailureKind::Timeout),
            Just(FailureKind::LeaseExpired),
            Just(FailureKind::Cancelled),
            Just(FailureKind::Terminated),
            Just(FailureKind::Rejected),
        ],
        text(),
        any::<bool>(),
        proptest::option::of(payload()),
    )
        .prop_map(|(kind, message, retryable, details)| Failure {
            kind,
            message,
            retryable,
            details,
        })
}

fn group() -> impl Strategy<Value = Vec<GroupEntry>> {
    proptest::collection::vec(
        (any::<u32>(), any::<u32>(), any::<u32>()).prop_map(|(s, size, index)| GroupEntry {
            step: Step(s),
            size,
            index,
        }),
        0..4,
    )
}

fn options() -> impl Strategy<Value = ActivityOptions> {
    let retry = (
        any::<u32>(),
        any::<u64>(),
        // Finite floats only: NaN != NaN would make equality meaningless.
        -1e12f64..1e12f64,
        any::<u64>(),
        prop_oneof![
            Just(Jitter::None),
            Just(Jitter::Full),
            Just(Jitter::Equal),
            Just(Jitter::Decorrelated)
        ],
        proptest::option::of(prop_oneof![
            Just(Backoff::Constant),
            Just(Backoff::Linear),
            Just(Backoff::Exponential)
        ]),
    )
        .prop_map(
            |(
                attempts_max,
                initial_delay_ms,
                backoff_factor,
                delay_max_ms,
                jitter,
                backoff_mode,
            )| {
                RetrySettings {
                    attempts_max,
                    initial_delay_ms,
                    backoff_factor,
                    delay_max_ms,
                    jitter,
                    backoff_mode,
                }
            },
        );
    (
        proptest::option::of(any::<u64>()),
        proptest::option::of(any::<u64>()),
        proptest::option::of(any::<u64>()),
        proptest::option::of(retry),
        proptest::option::of(text()),
        proptest::option::of(any::<u64>()),
    )
        .prop_map(|(a, b, c, retry, profile, d)| ActivityOptions {
            start_to_close_ms: a,
            schedule_to_close_ms: b,
            heartbeat_ms: c,
            retry,
            profile,
            schedule_to_start_ms: d,
        })
}

fn kind() -> impl Strategy<Value = EventKind> {
    prop_oneof![
        (
            text(),
            run_id(),
            text(),
            payload(),
            proptest::option::of(text()),
            proptest::option::of(run_id()),
            any::<u64>(),
            proptest::option::of(run_id()),
        )
            .prop_map(|(i, run_id, t, input, cmd, from, seed, previous)| {
                EventKind::WorkflowStarted(Box::new(keel_storage::WorkflowStart {
                    instance_id: InstanceId::new(i),
                    run_id,
                    workflow_type: t,
                    input,
                    command_id: cmd.map(CommandId::new),
                    parent: None,
                    continued_from: from,
                    random_seed: seed,
                    previous_run: previous,
                    carried: Default::default(),
                    memo: Vec::new(),
                    search_attributes: Vec::new(),
                    timeouts: Default::default(),
                }))
            }),
        payload().prop_map(|result| EventKind::WorkflowCompleted { result }),
        failure().prop_map(|failure| EventKind::WorkflowFailed { failure }),
        (run_id(), payload()).prop_map(|(new_run_id, input)| EventKind::WorkflowContinuedAsNew {
            new_run_id,
            input,
            carried: Default::default(),
        }),
        (
            run_id(),
            any::<u32>(),
            group(),
            text(),
            payload(),
            options()
        )
            .prop_map(|(run, step, group, t, input, options)| {
                EventKind::ActivityScheduled {
                    step: Step(step),
                    group,
                    execution_id: execution_of(run, Step(step)),
                    activity_type: t,
                    input,
                    options: Box::new(options),
                }
            }),
        (
            run_id(),
            any::<u32>(),
            any::<u32>(),
            failure(),
            proptest::option::of(any::<u64>()),
            proptest::option::of(payload()),
        )
            .prop_map(|(run, step, a, failure, retry, heartbeat)| {
                EventKind::ActivityAttemptFailed {
                    step: Step(step),
                    attempt_id: attempt_of(run, Step(step), AttemptNo(a)),
                    failure: Box::new(failure),
                    retry_at: retry.map(Timestamp),
                    heartbeat,
                }
            }),
        (run_id(), any::<u32>(), any::<u32>(), payload()).prop_map(|(run, step, a, result)| {
            EventKind::ActivityCompleted {
                step: Step(step),
                attempt_id: attempt_of(run, Step(step), AttemptNo(a)),
                result,
            }
        }),
        (any::<u32>(), group(), any::<u64>()).prop_map(|(s, group, f)| EventKind::TimerStarted {
            step: Step(s),
            group,
            fire_at: Timestamp(f),
        }),
        (any::<u32>(), any::<u64>()).prop_map(|(s, f)| EventKind::TimerFired {
            step: Step(s),
            fire_at: Timestamp(f),
        }),
        (text(), payload(), proptest::option::of(text())).prop_map(|(name, payload, cmd)| {
            EventKind::SignalReceived {
                name,
                payload,
                command_id: cmd.map(CommandId::new),
            }
        }),
        (any::<u32>(), payload()).prop_map(|(s, value)| EventKind::SideEffectRecorded {
            step: Step(s),
            value
        }),
        (
            any::<u32>(),
            any::<u32>(),
            prop_oneof![
                text().prop_map(SelectKey::Name),
                any::<u64>().prop_map(SelectKey::Index)
            ],
            any::<u32>()
        )
            .prop_map(|(s, m, key, ms)| EventKind::SelectionWinnerRecorded {
                step: Step(s),
                member_index: m,
                key,
                operation: OperationKind::Child,
                member_step: Step(ms),
            }),
        proptest::collection::vec((text(), payload()), 0..4)
            .prop_map(|fields| EventKind::MemoUpserted { fields }),
        (any::<u32>(), text()).prop_map(|(s, reason)| EventKind::ScopeCancelled {
            step: Step(s),
            reason
        }),
    ]
}

fn event() -> impl Strategy<Value = Event> {
    (any::<u64>(), any::<u64>(), kind()).prop_map(|(seq, at, kind)| Event {
        seq: Seq(seq),
        at: Timestamp(at),
        kind,
    })
}

/// Wraps `body` in a valid envelope (right magic, kind, version and CRC).
fn envelope(body: &[u8]) -> Vec<u8> {
    let mut out = vec![MAGIC, RecordKind::Event as u8, 1, 0, 0, 0, 0, 0];
    out.extend_from_slice(body);
    let crc = crc32c::crc32c_append(crc32c::crc32c(&out[..4]), &out[HEADER_BYTES..]);
    out[4..8].copy_from_slice(&crc.to_le_bytes());
    out
}

/// `body` in a valid envelope of `kind` at version 1 (the oldest).
fn envelope_of(kind: RecordKind, body: &[u8]) -> Vec<u8> {
    let mut out = envelope(body);
    out[1] = kind as u8;
    let crc = crc32c::crc32c_append(crc32c::crc32c(&out[..4]), &out[HEADER_BYTES..]);
    out[4..8].copy_from_slice(&crc.to_le_bytes());
    out
}

fn run_meta() -> impl Strategy<Value = RunMeta> {
    (
        (
            run_id(),
            text(),
            text(),
            0..RunStatus::ALL.len(),
            any::<u64>(),
        ),
        proptest::option::of((run_id(), text(), any::<u32>())),
        (
            any::<u64>(),
            any::<u64>(),
            proptest::option::of(any::<u64>()),
        ),
        proptest::option::of(prop_oneof![
            payload().prop_map(Outcome::Completed),
            failure().prop_map(Outcome::Failed),
            text().prop_map(Outcome::Cancelled),
            run_id().prop_map(Outcome::ContinuedAsNew),
        ]),
        any::<bool>(),
        proptest::collection::vec((text(), any::<i64>().prop_map(SearchValue::Int)), 0..3),
        proptest::collection::vec((text(), payload()), 0..3),
    )
        .prop_map(
            |(
                (run, instance, ty, status, next),
                parent,
                (started, updated, closed),
                outcome,
                cancel,
                search,
                memo,
            )| {
                RunMeta {
                    run_id: run,
                    instance_id: InstanceId(instance),
                    workflow_type: ty,
                    status: RunStatus::ALL[status],
                    next_seq: Seq(next),
                    parent: parent.map(|(run_id, instance, step)| ParentRef {
                        instance_id: InstanceId(instance),
                        run_id,
                        step: Step(step),
                        close_policy: ParentClosePolicy::RequestCancel,
                    }),
                    started_at: Timestamp(started),
                    updated_at: Timestamp(updated),
                    closed_at: closed.map(Timestamp),
                    outcome,
                    cancel_requested: cancel,
                    search_attributes: search,
                    memo,
                }
            },
        )
}

fn task_entry() -> impl Strategy<Value = TaskEntry> {
    (
        (run_id(), any::<u32>(), any::<u32>(), text(), payload()),
        (options(), group()),
        (
            any::<u64>(),
            any::<u64>(),
            any::<bool>(),
            proptest::option::of(payload()),
        ),
    )
        .prop_map(
            |(
                (run, step, attempt, ty, input),
                (options, group),
                (scheduled, due, cancel, heartbeat),
            )| TaskEntry {
                execution_id: ExecutionId {
                    run_id: run,
                    step: Step(step),
                },
                attempt: AttemptNo(attempt),
                activity_type: ty,
                input,
                options,
                group,
                scheduled_at: Timestamp(scheduled),
                due: Timestamp(due),
                cancel_requested: cancel,
                heartbeat,
            },
        )
}

fn decode(bytes: &[u8]) -> Result<Event, codec::Error> {
    codec::decode::<Event>(RecordKind::Event, bytes)
}

/// What rmp-serde's reader alone makes of a body: the value, or `None` for
/// an error or bytes left over (the codec without its fast reader).
fn general<T: serde::de::DeserializeOwned>(body: &[u8]) -> Option<T> {
    let mut de = rmp_serde::Deserializer::new(body);
    let value = T::deserialize(&mut de).ok()?;
    de.into_inner().is_empty().then_some(value)
}

/// Asserts that the codec and rmp-serde's reader agree on `body`, comparing
/// values by their encoding (a damaged float may be NaN, unequal to itself).
fn agree<T: serde::de::DeserializeOwned + serde::Serialize>(
    body: &[u8],
) -> Result<(), TestCaseError> {
    let fast = codec::decode_body::<T>(body)
        .ok()
        .map(|v| rmp_serde::to_vec(&v).unwrap());
    let slow = general::<T>(body).map(|v| rmp_serde::to_vec(&v).unwrap());
    prop_assert_eq!(fast, slow, "body {:02x?}", body);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn events_round_trip(e in event()) {
        let bytes = codec::encode(RecordKind::Event, &e).unwrap();
        prop_assert_eq!(decode(&bytes).unwrap(), e);
    }

    #[test]
    fn events_written_as_maps_by_earlier_versions_still_decode(e in event()) {
        // Event versions 1 to 7 wrote bodies as maps with field names;
        // version 8 writes them positionally. Every stored map must still
        // decode to the same event.
        let named = rmp_serde::to_vec_named(&e).unwrap();
        let positional = codec::encode(RecordKind::Event, &e).unwrap();
        prop_assert!(named.len() > positional.len() - HEADER_BYTES);
        prop_assert_eq!(decode(&envelope(&named)).unwrap(), e);
    }

    #[test]
    fn state_records_are_positional_and_their_older_maps_still_decode(
        run in run_meta(),
        task in task_entry(),
    ) {
        // State version 4 writes run records and every other derived
        // record positionally; versions 1 to 3 wrote maps with field names,
        // which a migrated store still holds and must decode unchanged.
        let bytes = codec::encode(RecordKind::Run, &run).unwrap();
        prop_assert!(matches!(bytes[HEADER_BYTES], 0x90..=0x9f | 0xdc | 0xdd), "an array");
        prop_assert_eq!(codec::decode::<RunMeta>(RecordKind::Run, &bytes).unwrap(), run.clone());
        let named = rmp_serde::to_vec_named(&run).unwrap();
        prop_assert!(named.len() > bytes.len() - HEADER_BYTES);
        let old = envelope_of(RecordKind::Run, &named);
        prop_assert_eq!(codec::decode::<RunMeta>(RecordKind::Run, &old).unwrap(), run);

        let bytes = codec::encode(RecordKind::Task, &task).unwrap();
        prop_assert_eq!(codec::decode::<TaskEntry>(RecordKind::Task, &bytes).unwrap(), task.clone());
        let old = envelope_of(RecordKind::Task, &rmp_serde::to_vec_named(&task).unwrap());
        prop_assert_eq!(codec::decode::<TaskEntry>(RecordKind::Task, &old).unwrap(), task.clone());
        // The writer reads a pending task's attempt without the rest of the
        // row: it must find the attempt the whole entry holds, either way.
        prop_assert_eq!(TaskEntry::attempt_of(&bytes), Ok(task.attempt));
        prop_assert_eq!(TaskEntry::attempt_of(&old), Ok(task.attempt));
    }

    #[test]
    fn records_are_written_as_rmp_serde_writes_them(
        e in event(),
        run in run_meta(),
        task in task_entry(),
    ) {
        // The codec writes positional records with keel's own writer; its
        // bytes must be rmp-serde's, or stored records and golden files
        // would change with the writer.
        let body = |bytes: Vec<u8>| bytes[HEADER_BYTES..].to_vec();
        prop_assert_eq!(body(codec::encode(RecordKind::Event, &e).unwrap()), rmp_serde::to_vec(&e).unwrap());
        prop_assert_eq!(body(codec::encode(RecordKind::Run, &run).unwrap()), rmp_serde::to_vec(&run).unwrap());
        prop_assert_eq!(body(codec::encode(RecordKind::Task, &task).unwrap()), rmp_serde::to_vec(&task).unwrap());
    }

    #[test]
    fn trailing_bytes_are_refused(e in event(), extra in proptest::collection::vec(any::<u8>(), 1..16)) {
        let bytes = codec::encode(RecordKind::Event, &e).unwrap();
        let body = &bytes[HEADER_BYTES..];
        let mut longer = body.to_vec();
        longer.extend_from_slice(&extra);
        // With a recomputed checksum, only the body check can refuse it.
        prop_assert!(matches!(decode(&envelope(&longer)), Err(codec::Error::TrailingBytes(n)) if n == extra.len()));
        // Appended to the stored record, the checksum refuses it first.
        let mut appended = bytes.clone();
        appended.extend_from_slice(&extra);
        prop_assert!(decode(&appended).is_err());
    }

    #[test]
    fn any_single_flipped_byte_is_refused(e in event(), pos in any::<prop::sample::Index>(), mask in 1u8..=255) {
        let mut bytes = codec::encode(RecordKind::Event, &e).unwrap();
        let i = pos.index(bytes.len());
        bytes[i] ^= mask;
        prop_assert!(decode(&bytes).is_err(), "flip at {} of {} decoded", i, bytes.len());
    }

    #[test]
    fn truncation_is_refused(e in event(), cut in any::<prop::sample::Index>()) {
        let bytes = codec::encode(RecordKind::Event, &e).unwrap();
        let len = cut.index(bytes.len());
        prop_assert!(decode(&bytes[..len]).is_err());
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        // Raw: almost always refused by the header or the checksum.
        let _ = decode(&bytes);
        // Enveloped: the checksum passes, the msgpack decoder sees garbage.
        let _ = decode(&envelope(&bytes));
        let _ = codec::decode_body::<Event>(&bytes);
    }

    #[test]
    fn mutated_bodies_in_valid_envelopes_never_panic(
        e in event(),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
    ) {
        // Structurally near-valid msgpack reaches deeper into the decoder
        // than random bytes do.
        let bytes = codec::encode(RecordKind::Event, &e).unwrap();
        let mut body = bytes[HEADER_BYTES..].to_vec();
        for (pos, b) in edits {
            let i = pos.index(body.len());
            body[i] = b;
        }
        let _ = decode(&envelope(&body));
    }

    #[test]
    fn the_fast_reader_agrees_with_the_general_one(
        e in event(),
        run in run_meta(),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        raw in proptest::collection::vec(any::<u8>(), 0..64),
    ) {
        // Positional and named bodies, intact and with a few bytes
        // replaced (no edit at all in some cases), and arbitrary bytes.
        let damage = |mut body: Vec<u8>| {
            for (pos, b) in &edits {
                if !body.is_empty() {
                    let i = pos.index(body.len());
                    body[i] = *b;
                }
            }
            body
        };
        for body in [rmp_serde::to_vec(&e).unwrap(), rmp_serde::to_vec_named(&e).unwrap()] {
            agree::<Event>(&body)?;
            agree::<Event>(&damage(body))?;
        }
        for body in [rmp_serde::to_vec(&run).unwrap(), rmp_serde::to_vec_named(&run).unwrap()] {
            agree::<RunMeta>(&body)?;
            agree::<RunMeta>(&damage(body))?;
        }
        agree::<Event>(&raw)?;
        agree::<RunMeta>(&raw)?;
    }
}

#[test]
fn hostile_bodies_are_refused_without_panic_or_huge_allocation() {
    // A bin32 claiming 4 GiB, an array32 claiming 4 billion items, a map
    // nested far deeper than any event: each must be a typed error.
    let huge_bin = [0xc6, 0xff, 0xff, 0xff, 0xff];
    let huge_array = [0xdd, 0xff, 0xff, 0xff, 0xff];
    let mut deep = vec![0x82, 0xa3, b's', b'e', b'q', 0x01, 0xa3, b'z', b'z', b'z'];
    deep.extend(std::iter::repeat_n(0x91, 100_000));
    deep.push(0xc0);
    for body in [&huge_bin[..], &huge_array[..], &deep[..]] {
        assert!(decode(&envelope(body)).is_err());
    }
}

#[test]
fn every_header_field_is_checked() {
    let e = Event {
        seq: Seq(3),
        at: Timestamp(9),
        kind: EventKind::TimerFired {
            step: Step(1),
            fire_at: Timestamp(5),
        },
    };
    let bytes = codec::encode(RecordKind::Event, &e).unwrap();
    // Another record kind with a valid checksum: refused as the wrong kind.
    assert!(matches!(
        codec::decode::<Event>(RecordKind::Run, &bytes),
        Err(codec::Error::WrongKind { .. })
    ));
    // Version 0 with a valid checksum: refused.
    let mut v0 = bytes.clone();
    v0[2] = 0;
    let crc = crc32c::crc32c_append(crc32c::crc32c(&v0[..4]), &v0[HEADER_BYTES..]);
    v0[4..8].copy_from_slice(&crc.to_le_bytes());
    assert!(matches!(
        decode(&v0),
        Err(codec::Error::UnsupportedVersion { found: 0, .. })
    ));
    assert!(matches!(
        decode(&[]),
        Err(codec::Error::TooShort { len: 0 })
    ));
}
