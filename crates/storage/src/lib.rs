//! keel-storage: the persisted schema, the history log and the stores.
//!
//! Owns everything that touches bytes on disk: typed history [`event`]s in a
//! versioned, checksummed envelope ([`codec`]), the key layout ([`keys`]),
//! the [`Store`] trait with its RocksDB ([`RocksStore`]) and in-memory
//! ([`MemStore`]) implementations, group commit, open modes and integrity
//! verification. Validation and derived state are written once
//! ([`derive`]) and shared by both stores and by `verify`.
//!
//! No actix and no workflow code here: the engine depends on this crate,
//! never the other way.

pub mod acked;
pub mod cache;
pub mod codec;
pub mod derive;
pub mod error;
pub mod event;
pub mod health;
pub mod history;
pub mod ids;
pub mod keys;
pub mod kv;
pub mod lease;
pub mod mem;
pub mod pg;
pub mod pg_tls;
pub mod relay;
pub mod rocks;
pub mod search;
mod slice_de;
mod slice_ser;
pub use slice_de::BODY_NESTING_MAX;
pub mod state;
pub mod stats;
pub mod store;
pub mod verify;
pub mod wal;

pub use derive::{AppendAck, CommitAck, CommitBatch, Intent, IntentKey, RunAppend};
pub use error::{DatabaseFault, Error, Result};
pub use event::{
    check_stream_message, ActivityOptions, Backoff, Carried, CarriedSignal, CarriedStream,
    ChildSchedule, Delivery, DurableKey, Event, EventClass, EventKind, Failure, FailureKind,
    GroupEntry, GroupPath, Jitter, OperationKind, Outcome, ParentClosePolicy, ParentRef, Payload,
    RetrySettings, RunTimeouts, SelectKey, StartTimeouts, StreamMessage, WorkflowStart,
    WorkflowTimeout, CARRIED_COMMANDS_MAX, CARRIED_SIGNALS_MAX, EVENT_KIND_BYTES_MAX,
    MESSAGE_KEY_BYTES_MAX, STREAMS_PER_RUN_MAX, STREAM_BACKLOG_MAX, STREAM_KEYS_CARRIED_MAX,
    STREAM_NAME_BYTES_MAX,
};
pub use health::{StoreHealth, WriteFault};
pub use ids::{
    AttemptId, AttemptNo, CommandId, ExecutionId, InstanceId, LeaseEpoch, MessageKey, RunId, Seq,
    Step, Timestamp,
};
pub use lease::{Fence, Member, ShardLease, ShardLeases};
pub use mem::{CrashMode, MemStore, SyncedView};
pub use pg::{PgOptions, PgStore};
pub use relay::{Note, Relay, RelayNotices, RelayTo, SharedStore};
pub use rocks::{LossReport, OpenMode, PrimeReport, RocksStore};
pub use search::{
    Condition, Field, FilterError, ListError, MetadataError, Op, PageToken, RunFilter, RunPage,
    SearchValue,
};
pub use state::{
    ChildEntry, InstanceMeta, OutboxMessage, ParkInfo, RunMeta, RunStatus, StoreMeta, TaskEntry,
    TimerEntry,
};
pub use stats::StoreMemory;
pub use store::{CommitHandle, Durability, ReadHistory, Reply, Store};
pub use verify::{VerifyReport, Violation};

/// Schema version of a data directory; opening another version fails with
/// [`Error::SchemaVersion`] naming both, except that a read-write open
/// migrates an older directory (see `rocks::migrate`). Version 5: events
/// (event version 8) and derived-state records (state version 4) are
/// written positionally, which a build of version 4 cannot read. Version
/// 6: an activity's result that closes its execution records the
/// execution's durable id alone, not its attempt's as well (a row less per
/// activity), which a build of version 5 would report missing. Version 7:
/// the index keeps no keys by type alone nor of every run (both are read
/// across the status indexes), which a build of version 6 would report
/// missing and could not list by. Version 8: an open run's record is not
/// rewritten by a commit that only moves its progress (its last event says
/// it, see [`kv::KvWrite::put_derivable`]), which a build of version 7
/// would take for a gap in the history.
pub const SCHEMA_VERSION: u32 = 8;

/// The schema version a PostgreSQL database records, which moves only when
/// what PostgreSQL holds changes: version 8 changed what the embedded
/// stores leave out (an open run's record trails its events there, never on
/// PostgreSQL, whose other processes read the records as written), so a
/// database stays at 7 and engines of both builds share it.
pub const PG_SCHEMA_VERSION: u32 = 7;

/// The oldest schema whose records this build reads as they are: migrating
/// from it, or from a newer one, rewrites no record; it deletes the rows
/// that [`SCHEMA_VERSION_ATTEMPT_ROWS_DROPPED`] and
/// [`SCHEMA_VERSION_INDEX_NARROWED`] stopped writing (see
/// `rocks::migrate` and the PostgreSQL store's `create_or_check`); an older
/// one has its derived state rebuilt from its events.
pub const SCHEMA_VERSION_READ_AS_IS: u32 = 4;

/// The schema from which an attempt's dedupe row is not written beside its
/// execution's: a migration from an older one deletes such rows.
pub const SCHEMA_VERSION_ATTEMPT_ROWS_DROPPED: u32 = 6;

/// The schema from which the index keeps no keys by type alone nor of
/// every run ([`search::DROPPED_INDEX_PREFIXES`]): a migration from an
/// older one deletes them.
pub const SCHEMA_VERSION_INDEX_NARROWED: u32 = 7;

/// Largest payload (input, result, signal, side effect value) in bytes.
pub const PAYLOAD_BYTES_MAX: usize = 1 << 20;

/// Longest history of one run, in events; continue-as-new past it.
pub const HISTORY_EVENTS_MAX: u64 = 5_000_000;

/// A limit logs a warning once usage passes this share of it.
pub const LIMIT_WARN_PERCENT: usize = 80;

/// Most commit requests the writer merges into one `WriteBatch`.
pub const GROUP_COMMITS_MAX: usize = 4096;

/// Most encoded bytes the writer merges into one `WriteBatch`.
pub const GROUP_COMMIT_BYTES_MAX: usize = 32 << 20;

/// Commit requests that may wait for the writer; committers block (or wait)
/// beyond it, which is the store's backpressure.
pub const COMMIT_QUEUE_MAX: usize = 65_536;

/// Most violations one `verify` report lists.
pub const VERIFY_VIOLATIONS_MAX: usize = 1000;
