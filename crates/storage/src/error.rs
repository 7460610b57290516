//! The storage error type.

use std::path::PathBuf;

use crate::event::DurableKey;
use crate::ids::{InstanceId, RunId, Seq};

/// Everything that can go wrong in the storage layer. Variants carry the ids
/// needed to act; messages say what was expected and what was found.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The data directory does not exist (read-only opens never
    /// create one).
    #[error("no keel data directory at {path}")]
    NotFound {
        /// The path given.
        path: PathBuf,
    },
    /// The directory exists but does not hold a keel store.
    #[error("{path} is not a keel data directory: {detail}")]
    NotKeel {
        /// The path given.
        path: PathBuf,
        /// What was found instead.
        detail: String,
    },
    /// The store was written by another schema version.
    #[error(
        "data directory has schema version {found}, this build reads version {expected}{}",
        schema_hint(*.found, *.expected)
    )]
    SchemaVersion {
        /// The version in the directory.
        found: u32,
        /// The version this build reads and writes.
        expected: u32,
    },
    /// Another process holds the directory open for writing.
    #[error("{path} is already open for writing by another process (open it read-only instead)")]
    Locked {
        /// The path given.
        path: PathBuf,
    },
    /// The directory's files are damaged where a crash cannot have damaged
    /// them (a write-ahead log record before its end, a table file, the
    /// MANIFEST): opening it would lose acknowledged commits silently, so
    /// it is refused.
    #[error("{path} is damaged and was not opened, so that no acknowledged commit is dropped silently: {detail}. Keep a copy of the directory, and restore it from a checkpoint or backup")]
    Damaged {
        /// The path given.
        path: PathBuf,
        /// RocksDB's description (names the file).
        detail: String,
    },
    /// A read found a table block of `cf` damaged where RocksDB checks it
    /// (a point read's block checksum, any read's index and footer): what
    /// the block holds cannot be read, and nothing is answered from it as
    /// if it were absent. A damaged record that scans and event reads reach
    /// is that record's own [`Error::Corrupt`].
    #[error("a table block of the `{cf}` family is damaged and cannot be read ({detail}). Keep a copy of the directory; `keel verify` reports what is damaged, and a checkpoint or backup restores it")]
    DamagedTable {
        /// The column family read.
        cf: &'static str,
        /// RocksDB's description (names the table file and offset).
        detail: String,
    },
    /// The log recovered to an earlier point than commits were acknowledged
    /// (see [`crate::acked`]): acknowledged commits are gone.
    #[error("{path} lost acknowledged commits: its log ends at sequence {found}, but commits up to sequence {acknowledged} were acknowledged (the log's tail was cut, or the directory was restored from an older copy). Keep a copy of the directory; `keel recover --data {} --accept-loss` opens it anyway and reports what it can of the loss", path.display())]
    LostCommits {
        /// The path given.
        path: PathBuf,
        /// The last sequence acknowledged, as recorded.
        acknowledged: u64,
        /// The last sequence the log holds.
        found: u64,
    },
    /// A write was attempted on a store opened read-only.
    #[error("the store is open read-only")]
    ReadOnly,
    /// A record could not be decoded.
    #[error("corrupt record in {cf}{}{}: {source}", run.map(|r| format!(" run {r}")).unwrap_or_default(), seq.map(|s| format!(" seq {s}")).unwrap_or_default())]
    Corrupt {
        /// The column family.
        cf: &'static str,
        /// The run, where the key names one.
        run: Option<RunId>,
        /// The seq, for an event.
        seq: Option<Seq>,
        /// What is wrong with the bytes.
        source: crate::codec::Error,
    },
    /// A commit's first event does not continue the run's history.
    #[error(
        "run {run}: expected the next event at seq {expected}, the commit starts at seq {found}"
    )]
    SeqGap {
        /// The run.
        run: RunId,
        /// The seq the history continues at.
        expected: Seq,
        /// The seq the commit gave.
        found: Seq,
    },
    /// A commit to a run that has already closed.
    #[error("run {run} is closed; nothing more can be appended")]
    RunClosed {
        /// The run.
        run: RunId,
    },
    /// A commit for a run that does not exist and does not start it.
    #[error("run {run} does not exist and the commit does not start it")]
    UnknownRun {
        /// The run.
        run: RunId,
    },
    /// A start for an instance whose current run is still open.
    #[error("instance {instance} already has an open run {run}")]
    InstanceRunning {
        /// The instance.
        instance: InstanceId,
        /// Its open run.
        run: RunId,
    },
    /// A start decided against an instance's run when another run has
    /// taken the instance since; nothing was written.
    #[error("instance {instance} moved on: the start was decided against run {expected:?}, the instance's run is {found:?}")]
    InstanceMoved {
        /// The instance.
        instance: InstanceId,
        /// The run the start was decided against (`None`: the instance had
        /// no run then).
        expected: Option<RunId>,
        /// The instance's run now.
        found: Option<RunId>,
    },
    /// A second terminal event for a durable id; nothing was written.
    #[error("run {run}: {key} already has a terminal event at seq {committed}")]
    DuplicateTerminal {
        /// The run.
        run: RunId,
        /// The durable id.
        key: DurableKey,
        /// The seq of the committed terminal event.
        committed: Seq,
    },
    /// A payload over [`crate::PAYLOAD_BYTES_MAX`]; nothing was written.
    #[error("run {run} seq {seq}: payload of {bytes} bytes exceeds the limit of {max} bytes")]
    PayloadTooLarge {
        /// The run.
        run: RunId,
        /// The event's seq.
        seq: Seq,
        /// The payload's size.
        bytes: usize,
        /// The limit.
        max: usize,
    },
    /// A history over [`crate::HISTORY_EVENTS_MAX`]; nothing was written.
    #[error("run {run}: history of {events} events would exceed the limit of {max}")]
    HistoryTooLong {
        /// The run.
        run: RunId,
        /// The length the commit would reach.
        events: u64,
        /// The limit.
        max: u64,
    },
    /// Memo fields or search attributes the commit would write are not
    /// valid or over a limit; nothing was written.
    #[error("run {run}: {source}")]
    Metadata {
        /// The run.
        run: RunId,
        /// What is wrong.
        source: crate::search::MetadataError,
    },
    /// A filter for listing runs that does not check (see
    /// [`crate::search::RunFilter::check`]).
    #[error("{0}")]
    InvalidFilter(String),
    /// A malformed commit (a programmer error in the caller, reported rather
    /// than asserted because it crosses the store's API).
    #[error("invalid commit for run {run}: {detail}")]
    InvalidCommit {
        /// The run.
        run: RunId,
        /// What is wrong.
        detail: String,
    },
    /// The commit could not be made durable; nothing acknowledged was lost.
    #[error("commit failed: {0}")]
    CommitFailed(String),
    /// The store stopped accepting writes (see [`crate::health`]): this
    /// commit is not acknowledged, and none will be until the cause is
    /// gone. (Commits refused after the stop wrote nothing; the group whose
    /// write failed may still reach the log if only its sync failed, and
    /// then appears after a restart, where durable ids keep a retry from
    /// applying twice.)
    #[error("the store stopped accepting writes ({fault}): {detail}; {}", fault.remedy())]
    Unwritable {
        /// What stopped them.
        fault: crate::health::WriteFault,
        /// The storage engine's message.
        detail: String,
    },
    /// The store has shut down.
    #[error("the store is closed")]
    Closed,
    /// An error from RocksDB.
    #[error("rocksdb: {0}")]
    Rocks(String),
    /// A database store could not do what was asked (see
    /// [`DatabaseFault`]); nothing was acknowledged.
    #[error("database {target}: {fault}: {detail}")]
    Database {
        /// The database, as host, port, database name and schema (never
        /// the password).
        target: String,
        /// What went wrong, for callers that react differently.
        fault: DatabaseFault,
        /// The driver's or the server's message.
        detail: String,
    },
    /// A database holds keel tables of another schema version.
    #[error(
        "database {target} has keel schema version {found}, this build reads version {expected}{}",
        schema_hint(*.found, *.expected)
    )]
    DatabaseSchemaVersion {
        /// The database and schema.
        target: String,
        /// The version its tables record.
        found: u32,
        /// The version this build reads and writes.
        expected: u32,
    },
    /// Another engine process holds the database for writing.
    #[error("database {target} is held for writing by another engine process ({detail}); open it read-only, or stop the other process")]
    DatabaseLocked {
        /// The database and schema.
        target: String,
        /// Who holds it, as far as the database tells.
        detail: String,
    },
    /// A commit made under a shard lease whose epoch moved on: another
    /// process took the shard (this one was paused, cut off or too slow to
    /// renew). Nothing was written; this process must stop acting for the
    /// shard.
    #[error("shard {shard}: the lease of epoch {epoch} is lost ({}); nothing was written", match current { Some(c) => format!("the shard's lease is at epoch {c} now"), None => "the shard has no lease".to_string() })]
    Fenced {
        /// The shard.
        shard: u16,
        /// The epoch the committer held.
        epoch: u64,
        /// The shard's epoch now.
        current: Option<u64>,
    },
    /// A commit without a fence on a store several engine processes share:
    /// only a commit made under a shard lease may write there.
    #[error("database {target} is shared by engine processes: a commit must carry its shard lease's fence")]
    FenceRequired {
        /// The database and schema.
        target: String,
    },
    /// This process counts a different number of shards than the store's
    /// other processes agreed on (see [`crate::lease::decide_shard_count`]).
    #[error("the store's engine processes spread runs over {recorded} shards; this one is configured with {configured}: give every process the same shard count")]
    ShardCountDiffers {
        /// The count recorded by the first process.
        recorded: u16,
        /// This process's count.
        configured: u16,
    },
    /// A shard's lease is held by a live owner; it can be taken once it
    /// expires.
    #[error("shard {shard} is held by {owner} until {expires_at}")]
    ShardHeld {
        /// The shard.
        shard: u16,
        /// Its holder.
        owner: String,
        /// When the lease ends unless renewed.
        expires_at: crate::ids::Timestamp,
    },
    /// A lease owner's name that is empty or too long.
    #[error("a lease owner's name must have 1 to {max} bytes, not {bytes}")]
    InvalidLeaseOwner {
        /// Its length.
        bytes: usize,
        /// The limit.
        max: usize,
    },
    /// A note between engine processes over the relay's size limit.
    #[error("a note for {to} of {bytes} bytes is over the relay's limit of {max} bytes")]
    NoteTooLarge {
        /// Its addressee.
        to: String,
        /// Its size.
        bytes: usize,
        /// The limit.
        max: usize,
    },
    /// The in-memory relay is full.
    #[error("the in-memory relay holds {max} notes already")]
    RelayFull {
        /// The limit.
        max: usize,
    },
    /// An error from the file system.
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}

impl Error {
    /// The store is out of reach for now (a database stopped, restarting
    /// or cut off): asking again later may succeed, and nothing about the
    /// data is wrong.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            Error::Database {
                fault: DatabaseFault::Lost | DatabaseFault::Unreachable,
                ..
            } | Error::Unwritable {
                fault: crate::health::WriteFault::Unreachable,
                ..
            }
        )
    }

    /// A commit that failed with this error may have been written anyway
    /// (the connection went away with it in flight, and the store could
    /// not find out): its writer must read its rows back before acting as
    /// if it had not happened. Every other commit error wrote nothing.
    pub fn outcome_unknown(&self) -> bool {
        matches!(
            self,
            Error::Database {
                fault: DatabaseFault::Lost | DatabaseFault::Unreachable,
                ..
            }
        )
    }
}

impl From<rocksdb::Error> for Error {
    fn from(e: rocksdb::Error) -> Self {
        Error::Rocks(e.into_string())
    }
}

/// What kind of trouble a database store ran into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DatabaseFault {
    /// No connection could be made (wrong host or port, server down).
    Unreachable,
    /// The server refused the credentials or the database name.
    Refused,
    /// The connection broke while a request was in flight.
    Lost,
    /// The server answered a statement with an error.
    Statement,
    /// No keel tables in the database (a read-only open does not create
    /// them).
    Missing,
    /// The connection string or the schema name does not parse.
    Config,
    /// The TLS handshake was refused: the server's certificate is not
    /// trusted or names another host (`sslmode=verify-*`), or the two sides
    /// share no protocol.
    Tls,
    /// Engine processes hold the database (shard leases, memberships), so
    /// what was asked (a schema migration) must wait until they stop.
    InUse,
}

impl std::fmt::Display for DatabaseFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DatabaseFault::Unreachable => "cannot connect",
            DatabaseFault::Refused => "the server refused the connection",
            DatabaseFault::Lost => "the connection was lost",
            DatabaseFault::Statement => "a statement failed",
            DatabaseFault::Missing => "no keel tables",
            DatabaseFault::Config => "invalid connection settings",
            DatabaseFault::Tls => "TLS to the server failed",
            DatabaseFault::InUse => "engine processes hold the database",
        })
    }
}

/// Result alias for the storage layer.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What to do about a directory of another schema version.
fn schema_hint(found: u32, expected: u32) -> &'static str {
    if found < expected {
        " (an older one: the first read-write open, an engine's, migrates it)"
    } else {
        " (a newer one: use the keel build that wrote it)"
    }
}
