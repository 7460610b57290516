//! The versioned record envelope around every persisted value.
//!
//! Layout of one record (little-endian numbers):
//!
//! ```text
//! [0]      magic 0x4B ('K')
//! [1]      record kind (see `RecordKind`)
//! [2..4]   schema version of that kind, u16
//! [4..8]   CRC32C of bytes [0..4] followed by the body
//! [8..]    body: msgpack (see below)
//! ```
//!
//! The body of a history event (from event version 8) and of every other
//! store record (derived state, park markers, shard leases, members, the
//! shard count: from state version 4) is positional: each struct
//! is a msgpack array of its fields in declaration order, enum variants
//! keep their names (`rmp_serde::encode::write`). The store's own metadata
//! record, exported bundles, and older events and state records are maps
//! with field names (`rmp_serde::encode::write_named`). The decoder reads
//! both forms, so a store written by an older build keeps decoding. Positional bodies are
//! why a field is only ever added at the end of its struct or variant,
//! with `#[serde(default)]`, and never removed or moved: a shorter array
//! written before the field existed then decodes with it at its default.
//! Events are the bulk of every store and of every replay; without the
//! field names the average event of `keel bench read` is 76 bytes instead
//! of 191 and decodes about 1.5 times as fast; a run record, decoded and
//! written again on every commit and read for every run a list shows,
//! shrinks the same way.
//!
//! Decoding checks every field and that the body was consumed to the last
//! byte; it returns a typed [`Error`] for anything else and never panics.

use serde::{de::DeserializeOwned, Serialize};

/// First byte of every keel record.
pub const MAGIC: u8 = 0x4B;
/// Bytes before the body.
pub const HEADER_BYTES: usize = 8;
/// Current schema version of history events. Version 2 added
/// `ChildCancelRequested`, `WorkflowStarted::previous_run`,
/// `ActivityAttemptFailed::heartbeat` and `RetrySettings::backoff_mode`;
/// version 3 added `UpdateCompleted::failure`; version 4 added
/// `WorkflowStarted::memo` and `search_attributes` and the memo and search
/// attributes of `Carried`; version 5 added `MessageReceived`,
/// `ExternalSendScheduled`, `ExternalSendCompleted` and the message streams
/// of `Carried`; version 6 added `ChildScheduled::memo` and
/// `search_attributes`; version 7 added workflow timeouts
/// (`WorkflowStarted::timeouts`, `Carried::timeouts`,
/// `ChildScheduled::timeouts`, `WorkflowTimedOut`); version 8 writes the
/// body positionally (no field names; see the module documentation);
/// older records decode unchanged (the new fields default).
pub const EVENT_VERSION: u16 = 8;
/// Current schema version of every derived-state record. Version 2 added
/// the cancellation and continue-as-new intents to the outbox, the
/// `children` records and `TaskEntry::heartbeat`; version 3 added the
/// memo and search attributes of `RunMeta`; version 4 writes the body
/// positionally, as event version 8 does (older maps decode unchanged).
pub const STATE_VERSION: u16 = 4;

/// Version of an exported bundle's envelope. A bundle is a file that
/// travels between builds, so it keeps field names and its own version
/// (it followed [`STATE_VERSION`] up to 3).
pub const BUNDLE_ENVELOPE_VERSION: u16 = 3;

/// What a record holds; stored in the envelope so a record read from the
/// wrong place is refused rather than misread.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
pub enum RecordKind {
    /// A history event.
    Event = 1,
    /// A run's derived metadata.
    Run = 2,
    /// An instance's current run.
    Instance = 3,
    /// A committed durable id.
    Dedupe = 4,
    /// A due timer.
    Timer = 5,
    /// An outbox message.
    Outbox = 6,
    /// A pending activity attempt.
    Task = 7,
    /// The store's own metadata (format and schema version).
    StoreMeta = 8,
    /// An exported history bundle.
    Bundle = 9,
    /// A parked run's reason.
    Parked = 10,
    /// A child a parent has not heard back from.
    Child = 11,
    /// A shard's lease (see [`crate::lease`]).
    ShardLease = 12,
    /// A member of a shared store (see [`crate::lease::Member`]).
    Member = 13,
    /// The shard count the processes of a shared store agreed on (see
    /// [`crate::lease::decide_shard_count`]).
    ShardCount = 14,
}

impl RecordKind {
    fn from_u8(b: u8) -> Option<Self> {
        Some(match b {
            1 => RecordKind::Event,
            2 => RecordKind::Run,
            3 => RecordKind::Instance,
            4 => RecordKind::Dedupe,
            5 => RecordKind::Timer,
            6 => RecordKind::Outbox,
            7 => RecordKind::Task,
            8 => RecordKind::StoreMeta,
            9 => RecordKind::Bundle,
            10 => RecordKind::Parked,
            11 => RecordKind::Child,
            12 => RecordKind::ShardLease,
            13 => RecordKind::Member,
            14 => RecordKind::ShardCount,
            _ => return None,
        })
    }

    /// The newest version of this kind that this build writes and reads.
    pub fn current_version(self) -> u16 {
        match self {
            RecordKind::Event => EVENT_VERSION,
            // The store metadata record is read before anything else to learn
            // the schema version, so its own envelope version never changes.
            RecordKind::StoreMeta => 1,
            RecordKind::Bundle => BUNDLE_ENVELOPE_VERSION,
            _ => STATE_VERSION,
        }
    }

    /// Whether this kind's body is written positionally (structs as arrays
    /// of their fields) rather than as maps with field names: all but the
    /// records read by other builds first or elsewhere (the store's
    /// metadata, exported bundles).
    fn positional(self) -> bool {
        !matches!(self, RecordKind::StoreMeta | RecordKind::Bundle)
    }
}

/// Why a record could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    /// Fewer bytes than the header.
    #[error("record of {len} bytes is shorter than the {HEADER_BYTES}-byte header")]
    TooShort {
        /// Bytes found.
        len: usize,
    },
    /// The first byte is not keel's magic.
    #[error("bad magic byte: expected 0x4b, found {found:#04x}")]
    BadMagic {
        /// The byte found.
        found: u8,
    },
    /// A record of another kind than expected.
    #[error("expected a {expected:?} record, found kind {found}")]
    WrongKind {
        /// What the reader asked for.
        expected: RecordKind,
        /// The kind byte found.
        found: u8,
    },
    /// A schema version this build does not know.
    #[error("{kind:?} record has schema version {found}, this build reads up to {supported}")]
    UnsupportedVersion {
        /// The record's kind.
        kind: RecordKind,
        /// The version found.
        found: u16,
        /// The newest version this build reads.
        supported: u16,
    },
    /// The checksum does not match the bytes.
    #[error("checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    Checksum {
        /// The stored CRC32C.
        stored: u32,
        /// The CRC32C of the bytes read.
        computed: u32,
    },
    /// The body is not a valid msgpack value of the expected type.
    #[error("body does not decode: {0}")]
    Body(String),
    /// The body decoded but bytes were left over.
    #[error("{0} trailing bytes after the body")]
    TrailingBytes(usize),
    /// The value could not be encoded (a programmer error in a serde impl).
    #[error("value does not encode: {0}")]
    Encode(String),
}

/// The record's CRC32C: of its first four header bytes, then of its body.
/// The four bytes go through a table here instead of a second call into
/// `crc32c`, whose set-up is most of its cost on a record this small (one
/// call less per record read; every event of a replay is read).
fn checksum(header: &[u8; 4], body: &[u8]) -> u32 {
    crc32c::crc32c_append(header_crc(header), body)
}

/// CRC32C (Castagnoli, reflected polynomial) of four bytes, by table.
fn header_crc(header: &[u8; 4]) -> u32 {
    let mut crc = !0u32;
    for &b in header {
        crc = CRC32C_TABLE[((crc ^ u32::from(b)) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

/// The byte-at-a-time table of CRC32C, built at compile time.
const CRC32C_TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = i as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

/// The first four bytes of a record (magic, kind, version), which its
/// checksum covers with the body.
fn header_of(bytes: &[u8]) -> &[u8; 4] {
    bytes[..4]
        .try_into()
        .expect("a header is at least four bytes")
}

/// Encodes `value` as a record of `kind` at the kind's current version.
pub fn encode<T: Serialize>(kind: RecordKind, value: &T) -> Result<Vec<u8>, Error> {
    let mut out = Vec::with_capacity(64);
    out.push(MAGIC);
    out.push(kind as u8);
    out.extend_from_slice(&kind.current_version().to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    let written = if kind.positional() {
        // keel's own writer first (see `slice_ser`): the same bytes as
        // rmp-serde's, written straight into the vector. What it leaves,
        // rmp-serde writes again from the start, and its bytes or its
        // error stand.
        crate::slice_ser::write(&mut out, value).or_else(|_| {
            out.truncate(HEADER_BYTES);
            let general = rmp_serde::encode::write(&mut out, value);
            debug_assert!(
                general.is_err(),
                "keel's writer left a {kind:?} record to rmp-serde that rmp-serde wrote"
            );
            general
        })
    } else {
        rmp_serde::encode::write_named(&mut out, value)
    };
    written.map_err(|e| Error::Encode(e.to_string()))?;
    let crc = checksum(header_of(&out), &out[HEADER_BYTES..]);
    out[4..8].copy_from_slice(&crc.to_le_bytes());
    Ok(out)
}

/// Checks a record's envelope and returns its body, without decoding it.
pub fn open(expected: RecordKind, bytes: &[u8]) -> Result<&[u8], Error> {
    if bytes.len() < HEADER_BYTES {
        return Err(Error::TooShort { len: bytes.len() });
    }
    if bytes[0] != MAGIC {
        return Err(Error::BadMagic { found: bytes[0] });
    }
    let stored = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
    let computed = checksum(header_of(bytes), &bytes[HEADER_BYTES..]);
    if stored != computed {
        return Err(Error::Checksum { stored, computed });
    }
    match RecordKind::from_u8(bytes[1]) {
        Some(kind) if kind == expected => {}
        _ => {
            return Err(Error::WrongKind {
                expected,
                found: bytes[1],
            })
        }
    }
    let version = u16::from_le_bytes([bytes[2], bytes[3]]);
    if version == 0 || version > expected.current_version() {
        return Err(Error::UnsupportedVersion {
            kind: expected,
            found: version,
            supported: expected.current_version(),
        });
    }
    Ok(&bytes[HEADER_BYTES..])
}

/// Decodes a record of `expected` kind into `T`.
pub fn decode<T: DeserializeOwned>(expected: RecordKind, bytes: &[u8]) -> Result<T, Error> {
    let body = open(expected, bytes)?;
    decode_body(body)
}

/// Decodes a msgpack body, refusing trailing bytes (rmp-serde ignores them).
pub fn decode_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, Error> {
    // Fast path: keel's own reader over the slice (strings and bytes
    // borrowed from the body, no reader abstraction, free refusals; see
    // `slice_de`). It refuses whatever it does not read exactly as
    // `rmp_serde` does, and every refusal, like every damaged body, falls
    // through to the general reader below, which produces the exact typed
    // error or the value.
    if let Ok(value) = crate::slice_de::from_record_slice(body) {
        return Ok(value);
    }
    // The general reader recurses into enum variants without counting:
    // a body nested too deep would overflow the stack.
    if !crate::slice_de::nests_within(body, crate::slice_de::BODY_NESTING_MAX) {
        return Err(Error::Body(format!(
            "nested deeper than {} levels",
            crate::slice_de::BODY_NESTING_MAX
        )));
    }
    let mut de = rmp_serde::Deserializer::new(body);
    let value = T::deserialize(&mut de).map_err(|e| Error::Body(e.to_string()))?;
    let rest = de.into_inner();
    if !rest.is_empty() {
        return Err(Error::TrailingBytes(rest.len()));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    // Goal: the envelope refuses every kind of damage with a typed error.
    // Method: encode a value, damage one thing at a time, decode.
    use super::*;

    #[test]
    fn a_value_that_fails_part_way_gets_rmp_serdes_error_not_half_a_record() {
        // keel's writer gives up on a failing field after writing the ones
        // before it; the codec must start again with rmp-serde, whose
        // error then stands, and never return the half-written bytes.
        struct Fails;
        impl Serialize for Fails {
            fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
                Err(serde::ser::Error::custom("field refused"))
            }
        }
        let value = ("a string written first", 7u32, Fails);
        match encode(RecordKind::Run, &value) {
            Err(Error::Encode(message)) => assert!(message.contains("field refused"), "{message}"),
            other => panic!("expected rmp-serde's error, got {other:?}"),
        }
    }

    #[test]
    fn round_trip_and_every_damage_is_typed() {
        let bytes = encode(RecordKind::Run, &("hello", 42u32)).unwrap();
        let back: (String, u32) = decode(RecordKind::Run, &bytes).unwrap();
        assert_eq!(back, ("hello".to_string(), 42));

        assert!(matches!(
            decode::<(String, u32)>(RecordKind::Run, &bytes[..5]),
            Err(Error::TooShort { len: 5 })
        ));
        let mut bad = bytes.clone();
        bad[0] = 0;
        assert!(matches!(
            decode::<(String, u32)>(RecordKind::Run, &bad),
            Err(Error::BadMagic { found: 0 })
        ));
        let mut flipped = bytes.clone();
        *flipped.last_mut().unwrap() ^= 0x40;
        assert!(matches!(
            decode::<(String, u32)>(RecordKind::Run, &flipped),
            Err(Error::Checksum { .. })
        ));
        assert!(matches!(
            decode::<(String, u32)>(RecordKind::Event, &bytes),
            Err(Error::WrongKind { .. })
        ));
        // A newer version with a valid checksum: refused, naming both versions.
        let mut newer = bytes.clone();
        newer[2..4].copy_from_slice(&9u16.to_le_bytes());
        let crc = checksum(header_of(&newer), &newer[HEADER_BYTES..]);
        newer[4..8].copy_from_slice(&crc.to_le_bytes());
        let err = decode::<(String, u32)>(RecordKind::Run, &newer).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("Run record has schema version 9, this build reads up to {STATE_VERSION}")
        );
        // Trailing bytes with a valid checksum: refused.
        let mut longer = bytes.clone();
        longer.push(0xc0);
        let crc = checksum(header_of(&longer), &longer[HEADER_BYTES..]);
        longer[4..8].copy_from_slice(&crc.to_le_bytes());
        assert!(matches!(
            decode::<(String, u32)>(RecordKind::Run, &longer),
            Err(Error::TrailingBytes(1))
        ));
        // Trailing bytes that start a value the body then lacks (a map
        // header, a string header): still trailing bytes, counted exactly.
        for tail in [&[0x81u8][..], &[0xa3, b'a'], &[0xdc, 0x00]] {
            let mut longer = bytes.clone();
            longer.extend_from_slice(tail);
            let crc = checksum(header_of(&longer), &longer[HEADER_BYTES..]);
            longer[4..8].copy_from_slice(&crc.to_le_bytes());
            assert_eq!(
                decode::<(String, u32)>(RecordKind::Run, &longer),
                Err(Error::TrailingBytes(tail.len()))
            );
        }
    }

    // Every entry of the header CRC's table is right: the first byte of a
    // header selects the entry at `0xff ^ byte`, so these 256 headers use
    // each entry once (a random sample could miss a wrong one).
    #[test]
    fn header_crc_table_is_crc32c_at_every_entry() {
        for b in 0..=255u8 {
            for header in [[b, 0, 0, 0], [b, 0xff, 0x4b, 0x01]] {
                assert_eq!(header_crc(&header), crc32c::crc32c(&header), "{header:?}");
            }
        }
    }

    // The table-driven header CRC is the library's CRC32C: for every four
    // bytes, and chained into a body, so records written before it still
    // verify.
    proptest::proptest! {
        #[test]
        fn header_crc_is_the_library_crc32c(
            header in proptest::array::uniform4(proptest::num::u8::ANY),
            body in proptest::collection::vec(proptest::num::u8::ANY, 0..300),
        ) {
            proptest::prop_assert_eq!(header_crc(&header), crc32c::crc32c(&header));
            proptest::prop_assert_eq!(
                checksum(&header, &body),
                crc32c::crc32c_append(crc32c::crc32c(&header), &body)
            );
        }
    }
}
