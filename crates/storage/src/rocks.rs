//! The RocksDB store: column families, open modes, and group commit.
//!
//! Group commit: committers encode their events on their own thread and
//! queue a request; one writer thread takes every request waiting at that
//! moment (up to [`crate::GROUP_COMMITS_MAX`]), validates each against the
//! store plus the earlier requests of the group, writes one `WriteBatch`
//! (fsynced in `Sync` mode) and answers each committer. A request that fails
//! validation is answered with its error and leaves no trace in the batch.
//! A committer with nothing else in flight (`Store::commit_alone`) that
//! finds the writer idle (nothing queued, every answer sent, writes
//! succeeding, the lock free) does the same for its own request, as a group
//! of one, on its own thread and under the same lock: at low load a commit
//! then costs no thread wake-ups (the committer blocks for the synced write
//! instead), and order is kept because nothing was waiting ahead. A plain
//! `commit` always queues: a committer with more commits coming (a shard
//! taking a fan-out's results) would otherwise write each one itself,
//! finding the writer idle every time, one sync per commit instead of one
//! per group.
//!
//! Two things keep the single writer fast (measured in BENCHMARKS.md): the
//! answers of a group of more than two commits are sent by a second thread
//! (`keel-answer`), in order and only after the group's write returned, so
//! the writer does not spend its time waking committers; and the writer
//! serves `runs` records it wrote itself from a bounded cache instead of
//! searching the memtable for them on every commit.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};
use rocksdb::{
    checkpoint::Checkpoint, BlockBasedOptions, Cache, ColumnFamilyDescriptor, DBCompressionType,
    DBRecoveryMode, Options, ReadOptions, WriteBatch, WriteOptions, DB,
};
use tracing::{debug, info_span};

use crate::acked;
use crate::cache::{CachedView, Learned, ReadAhead, ScanAhead, WriterCache};
use crate::codec::{self, RecordKind};
use crate::derive::{
    apply_batch_step, event_rows, Checks, CommitBatch, EventRows, PreparedBatch, RawAck,
};
use crate::error::{Error, Result};
use crate::health::{
    HealthCell, StoreHealth, WriteFault, STORE_IO_RECOVERY_MS_MAX, STORE_PROBE_INTERVAL_MS,
    STORE_STOPPED_LOG_INTERVAL_MS, STORE_WRITE_STALL_MS,
};
use crate::ids::{RunId, Seq};
use crate::keys::{prefix_end, Cf, STORE_META_KEY};
use crate::kv::{Derivable, KvRead, Mutation, Overlay, PrefixVisitor, Writes};
use crate::state::StoreMeta;
use crate::stats::StoreMemory;
use crate::store::{CommitHandle, Durability, Reply, Store};
use crate::{COMMIT_QUEUE_MAX, GROUP_COMMITS_MAX, GROUP_COMMIT_BYTES_MAX, SCHEMA_VERSION};

/// How a data directory is opened.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum OpenMode {
    /// Read-write and exclusive; creates the directory if missing.
    ReadWrite,
    /// Read-only snapshot of the directory as it was at open (beside a
    /// live writer too: what it had written by then). RocksDB's secondary
    /// instances, which follow a writer, are not used: their log reader
    /// loops forever on the first record of a recycled log's earlier use
    /// (`FragmentBufferedReader` reports it without consuming it).
    ReadOnly,
}

struct Request {
    prepared: PreparedBatch,
    reply: Reply,
}

/// A keel store in a RocksDB directory.
pub struct RocksStore {
    db: Arc<DB>,
    path: PathBuf,
    mode: OpenMode,
    durability: Durability,
    /// The writer's queue and its shared state (read-write opens).
    tx: Option<(Sender<Request>, Arc<WriterShared>)>,
    writer: Option<JoinHandle<()>>,
    health: Arc<HealthCell>,
    /// What the writer counted (groups, their sizes, write and sync time).
    stats: Arc<crate::stats::WriterStats>,
    /// The block cache every family reads through.
    block_cache: Cache,
    /// Keeps the acknowledged-commit record (read-write opens).
    acked: Option<acked::AckedKeeper>,
}

impl std::fmt::Debug for RocksStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RocksStore")
            .field("path", &self.path)
            .field("mode", &self.mode)
            .field("durability", &self.durability)
            .finish()
    }
}

/// Times an open is tried before it reports an error a live writer can
/// cause for a moment ([`Error::LostCommits`] from a read-only look, or a
/// write-ahead log deleted between RocksDB listing and reading it).
const RACED_OPEN_TRIES_MAX: u32 = 8;

/// Times [`RocksStore::copy_live`] starts over because the writer changed
/// the directory's MANIFEST during the copy.
pub const LIVE_COPY_ATTEMPTS_MAX: u32 = 50;

/// Memory all memtables together may use before RocksDB flushes them.
/// They are the largest part of what a long import or a 100,000-member
/// fan-out grows the process by; W1 runs no slower at 16 MiB than at 32
/// (BENCHMARKS.md, "the memtables halved").
pub const MEMTABLES_BYTES_MAX: usize = 16 << 20;

/// Write-ahead logs RocksDB keeps, once their memtables are flushed, to
/// write again from their start instead of creating new ones. A sync that
/// overwrites a file already written leaves its size alone, so it writes
/// no inode: about a third cheaper per commit on this machine's disk
/// (BENCHMARKS.md, "recycled logs"). Each is about half of
/// [`MEMTABLES_BYTES_MAX`] (all families flush together, so a log is
/// switched only at a flush); two cover a flush still running when the
/// next log is needed.
pub const RECYCLED_LOGS_MAX: usize = 2;

/// Log bytes [`RocksStore::prime_logs`] writes into each of the logs it
/// primes: about what a log holds when the memtables flush (half of
/// [`MEMTABLES_BYTES_MAX`], see [`RECYCLED_LOGS_MAX`]), so that the first
/// use of a primed log writes over it all the way.
pub const PRIMED_LOG_BYTES: usize = MEMTABLES_BYTES_MAX / 2;

/// Rounds (a log filled, then switched) [`RocksStore::prime_logs`] makes
/// at most. Two prime both recycled logs; more are needed only when RocksDB
/// has not yet put the first switched-away log on its recycling list when
/// the next switch comes.
pub const PRIME_ROUNDS_MAX: u32 = 4;

/// The size of each log-only record priming writes.
const PRIME_CHUNK_BYTES: usize = 1 << 20;
const _: () = assert!(PRIMED_LOG_BYTES / PRIME_CHUNK_BYTES * PRIME_CHUNK_BYTES == PRIMED_LOG_BYTES);

/// Memory for table blocks read from disk, one cache shared by every
/// column family. (Left unset, RocksDB gives each family its own 32 MiB
/// cache: twelve of them, a bound nobody chose.)
pub const BLOCK_CACHE_BYTES_MAX: usize = 32 << 20;

/// The size of a table block of the events family (RocksDB's default,
/// 4 KiB, elsewhere). Events are scanned, a run's history at a time or
/// every run's for replay and verify; a point lookup reads one only when
/// an input is repeated against a run that has closed. A larger block
/// saves a scan three of every four block changes (a read from the file
/// or the cache, and an iterator set up over the new block), and neither
/// kind of read checks RocksDB's block checksum, so damage stays the
/// damaged record's own (the codec's checksum names it).
pub const EVENTS_BLOCK_BYTES: usize = 16 << 10;

/// How every family's tables are read: through `cache`.
fn table_options(cache: &Cache) -> BlockBasedOptions {
    let mut t = BlockBasedOptions::default();
    t.set_block_cache(cache);
    t
}

/// A block cache of [`BLOCK_CACHE_BYTES_MAX`], for one open.
fn block_cache() -> Cache {
    Cache::new_lru_cache(BLOCK_CACHE_BYTES_MAX)
}

/// What an open that accepts a loss found (see [`RocksStore::open_accepting_loss`]).
#[derive(Clone, Debug, serde::Serialize)]
pub struct LossReport {
    /// The last sequence acknowledged, as recorded (none if no record).
    pub acknowledged: Option<u64>,
    /// The last sequence the log recovered to.
    pub found: u64,
    /// The first damage found in the write-ahead logs, described.
    pub damage: Option<String>,
    /// History events that were in the log past the recovered point and
    /// are gone: (run, seq), in log order.
    pub lost_events: Vec<(RunId, Seq)>,
    /// Commits (write batches) past the recovered point still readable in
    /// the log.
    pub lost_commits: usize,
    /// Sequences acknowledged but neither recovered nor readable in the
    /// log any more (a log cut short): their content cannot be named.
    pub unreadable_sequences: u64,
}

impl LossReport {
    /// Whether anything was lost.
    pub fn lost_anything(&self) -> bool {
        !self.lost_events.is_empty()
            || self.lost_commits > 0
            || self.unreadable_sequences > 0
            || self.acknowledged.is_some_and(|a| a > self.found)
    }
}

/// What [`RocksStore::prime_logs`] did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PrimeReport {
    /// Logs filled and switched.
    pub rounds: u32,
    /// Log bytes written.
    pub bytes: u64,
    /// Whether the log in use afterwards is a recycled one.
    pub primed: bool,
    /// How long it took, in milliseconds.
    pub elapsed_ms: f64,
}

fn db_options(mode: OpenMode, cache: &Cache) -> Options {
    let mut opts = Options::default();
    opts.set_block_based_table_factory(&table_options(cache));
    opts.create_if_missing(mode == OpenMode::ReadWrite);
    opts.create_missing_column_families(mode == OpenMode::ReadWrite);
    opts.set_max_background_jobs(2);
    opts.set_write_buffer_size(64 << 20);
    // One budget for the memtables of every family: memory follows this
    // limit, not the amount of history written.
    opts.set_db_write_buffer_size(MEMTABLES_BYTES_MAX);
    opts.set_max_open_files(512);
    // Records carry their own CRC32C, and an uncompressed block keeps a
    // damaged record local to itself, so `verify` can name its run and seq.
    opts.set_compression_type(DBCompressionType::None);
    // Logs are recycled (`RECYCLED_LOGS_MAX`), and all families flush
    // together, so a log is switched only when every memtable is flushed:
    // logs are then as long as the memtables allow, and a recycled one is
    // long enough to be written over, not appended to.
    opts.set_recycle_log_file_num(RECYCLED_LOGS_MAX);
    opts.set_atomic_flush(true);
    // A recycled log's end is its first bad or stale record, so RocksDB
    // recycles only under point-in-time recovery, which keeps the prefix
    // before the first bad record (and never a prefix with a hole: a log
    // that ended early is followed only if the next one starts where it
    // ended). On its own that mode would drop acknowledged commits after
    // damage in the middle of a log without a word; keel reads the logs
    // itself before every open and refuses one whose end is followed by
    // records of its own, or whose recovery would leave readable commits
    // behind (`Error::Damaged`; see `open_mode_inner` and `wal.rs`).
    opts.set_wal_recovery_mode(DBRecoveryMode::PointInTime);
    opts
}

/// Every column family an open names: keel's, RocksDB's default, and any
/// other the directory has (`found`), which RocksDB requires be named.
fn family_names(found: Vec<String>) -> Vec<String> {
    let mut names: Vec<String> = Cf::ALL.iter().map(|c| c.name().to_string()).collect();
    names.push("default".into());
    for n in found {
        if !names.contains(&n) {
            names.push(n);
        }
    }
    names
}

fn cf_descriptors(names: &[String], cache: &Cache) -> Vec<ColumnFamilyDescriptor> {
    names
        .iter()
        .map(|n| {
            let events = n == Cf::Events.name();
            let mut t = table_options(cache);
            if events {
                t.set_block_size(EVENTS_BLOCK_BYTES);
            }
            let mut o = Options::default();
            o.set_block_based_table_factory(&t);
            o.set_compression_type(DBCompressionType::None);
            if events {
                o = with_insert_hints(o);
            }
            ColumnFamilyDescriptor::new(n, o)
        })
        .collect()
}

/// The option that makes a memtable remember, per key prefix, where it
/// last inserted: the next key of that prefix starts its search there.
/// The prefix is an events key's run id ([`crate::keys::event_key`]), and a run
/// appends its events in seq order, so each event's insert starts right
/// after its predecessor instead of at the top of a skip list holding
/// every run's recent events. One hint per run in the memtable; gone with
/// it at the flush. (The C API has no setter for it; RocksDB parses it
/// from an options string.)
const EVENTS_INSERT_HINTS: &str =
    "memtable_insert_with_hint_prefix_extractor=rocksdb.FixedPrefix.16";

/// `options` with [`EVENTS_INSERT_HINTS`]; unchanged, with a warning, if
/// this RocksDB does not know the option (only speed depends on it).
fn with_insert_hints(mut options: Options) -> Options {
    match options.get_options_from_string(EVENTS_INSERT_HINTS) {
        Ok(hinted) => hinted,
        Err(e) => {
            tracing::warn!(error = %e, "events are inserted into the memtable without hints");
            options
        }
    }
}

fn map_open_error(path: &Path, e: rocksdb::Error) -> Error {
    let text = e.into_string();
    // Match RocksDB's two lock failures exactly (env/fs_posix.cc: another
    // process, or this one): a bare "lock" also matches "block checksum
    // mismatch", which is corruption, not a second writer.
    if text.contains("While lock file") || text.contains("lock hold by current process") {
        Error::Locked {
            path: path.to_path_buf(),
        }
    } else if WriteFault::of_message(&text) == WriteFault::NoSpace {
        // A full disk at open (RocksDB writes a new MANIFEST and log).
        Error::Unwritable {
            fault: WriteFault::NoSpace,
            detail: format!("opening {}: {text}", path.display()),
        }
    } else if text.starts_with("Corruption:") {
        // RocksDB names neither file nor offset for a damaged log: find
        // them.
        let detail = match crate::wal::describe_damage(path) {
            Some(found) => format!(
                "{found} (RocksDB: {text}); `keel recover --accept-loss` opens what precedes it and lists what it drops"
            ),
            None => text,
        };
        Error::Damaged {
            path: path.to_path_buf(),
            detail,
        }
    } else {
        Error::Rocks(text)
    }
}

/// The error for damage keel's own reading of the logs found.
fn damaged_logs(path: &Path, found: String) -> Error {
    Error::Damaged {
        path: path.to_path_buf(),
        detail: format!(
            "{found}; `keel recover --accept-loss` opens what precedes it and lists what it drops"
        ),
    }
}

/// Checks what a recovery reached (`found`, RocksDB's last sequence after
/// replaying the logs) against what must be there: every commit still
/// readable in the logs (`scans`, read before the recovery; point-in-time
/// recovery stops at a log that ended early and leaves the logs after it
/// unread), and every commit acknowledged (`recorded`).
fn check_recovered(
    path: &Path,
    scans: &[crate::wal::WalScan],
    recorded: Option<u64>,
    found: u64,
) -> Result<()> {
    if let Some(dropped) = crate::wal::describe_past(scans, found) {
        return Err(damaged_logs(path, dropped));
    }
    acked::check(path, recorded, found)
}

/// A read's error: a damaged table block as [`Error::DamagedTable`],
/// anything else as RocksDB said it.
fn read_error(cf: Cf, e: rocksdb::Error) -> Error {
    if e.kind() == rocksdb::ErrorKind::Corruption {
        Error::DamagedTable {
            cf: cf.name(),
            detail: e.into_string(),
        }
    } else {
        e.into()
    }
}

/// Whether a read-only open failed for a reason a live writer
/// causes for a moment and a fresh open does not meet again: a flush that
/// hid the newest commits from the open's view, or a write-ahead log the
/// writer deleted (its memtable flushed) between RocksDB listing the
/// directory and reading the file.
fn raced_by_writer(e: &Error) -> bool {
    match e {
        Error::LostCommits { .. } => true,
        Error::Rocks(text) => text.starts_with("IO error") && text.contains("No such file"),
        _ => false,
    }
}

impl RocksStore {
    /// Opens `path` read-write and exclusively, creating it if missing.
    pub fn open(path: impl AsRef<Path>, durability: Durability) -> Result<Self> {
        Self::open_mode(path.as_ref(), OpenMode::ReadWrite, durability)
    }

    /// Opens `path` read-write although its log lost acknowledged commits
    /// or is damaged before its end ([`Error::LostCommits`],
    /// [`Error::Damaged`]): only on an operator's explicit request (`keel
    /// recover --accept-loss`). The logs are read first, so the report
    /// names every history event RocksDB's point-in-time recovery then
    /// drops; RocksDB keeps everything before the first damage, which is a
    /// consistent prefix (each commit is one atomic batch). The
    /// acknowledged-commit record is reset to what was recovered.
    pub fn open_accepting_loss(
        path: impl AsRef<Path>,
        durability: Durability,
    ) -> Result<(Self, LossReport)> {
        let path = path.as_ref();
        if !path.join("CURRENT").exists() {
            return Err(Error::NotFound {
                path: path.to_path_buf(),
            });
        }
        let acknowledged = acked::read(path)?;
        let scans = crate::wal::scan_dir(path)?;
        let damage = crate::wal::describe(&scans);
        let names = family_names(DB::list_cf(&Options::default(), path)?);
        let cache = block_cache();
        // Point-in-time recovery, as every open: what the checks of a
        // plain open refuse, this one accepts.
        let opts = db_options(OpenMode::ReadWrite, &cache);
        let db = DB::open_cf_descriptors(&opts, path, cf_descriptors(&names, &cache))
            .map_err(|e| map_open_error(path, e))?;
        let found = db.latest_sequence_number();
        db.flush_wal(true)?;
        drop(db);
        // Accepted: the record starts again from what was recovered.
        acked::AckedFile::open(path, found)?;
        let mut report = LossReport {
            acknowledged,
            found,
            damage,
            lost_events: Vec::new(),
            lost_commits: 0,
            unreadable_sequences: 0,
        };
        let mut readable_past = 0u64;
        for b in scans.iter().flat_map(|s| s.batches.iter()) {
            // Empty batches (log-only records) hold no sequence.
            if b.count > 0 && b.sequence > found {
                report.lost_commits += 1;
                report.lost_events.extend(b.events.iter().copied());
                readable_past = readable_past.max(b.sequence + u64::from(b.count.max(1)) - 1);
            }
        }
        if let Some(a) = acknowledged {
            report.unreadable_sequences = a.saturating_sub(found.max(readable_past));
        }
        tracing::warn!(path = %path.display(), found, ?acknowledged,
            lost_events = report.lost_events.len(), "opened a data directory accepting the loss of commits");
        let store = Self::open(path, durability)?;
        Ok((store, report))
    }

    /// Opens `path` read-only (works beside a running writer).
    pub fn open_read_only(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_mode(path.as_ref(), OpenMode::ReadOnly, Durability::Sync)
    }

    fn open_mode(path: &Path, mode: OpenMode, durability: Durability) -> Result<Self> {
        let mut result = Self::open_mode_inner(path, mode, durability);
        // Beside a live writer, a flush that ends while a read-only open
        // reads the log can hide the newest commits from
        // this open's view, or delete a write-ahead log the open listed a
        // moment before: a fresh open sees the directory as it is now. A
        // read-write open looks read-only first (its pre-check), so the
        // same flush can make it report lost commits instead of the lock
        // the writer holds (seen in CI as `keel checkpoint` beside a
        // running engine): it looks again too. So does any open whose own
        // reading of the logs found damage: a live writer writing over a
        // recycled log while keel reads it can show a stale record before
        // new ones. A directory that lost commits or is damaged keeps
        // failing.
        let mut tries = 1;
        while tries < RACED_OPEN_TRIES_MAX
            && result.as_ref().is_err_and(|e| match mode {
                OpenMode::ReadWrite => {
                    matches!(e, Error::LostCommits { .. } | Error::Damaged { .. })
                }
                OpenMode::ReadOnly => raced_by_writer(e) || matches!(e, Error::Damaged { .. }),
            })
        {
            std::thread::sleep(std::time::Duration::from_millis(20 * u64::from(tries)));
            result = Self::open_mode_inner(path, mode, durability);
            tries += 1;
        }
        result.map_err(|e| match e {
            // A full disk while keel creates the directory or its records:
            // the typed error, with the path and what to do.
            Error::Io(io) if io.kind() == std::io::ErrorKind::StorageFull => Error::Unwritable {
                fault: WriteFault::NoSpace,
                detail: format!("opening {}: {io}", path.display()),
            },
            other => other,
        })
    }

    fn open_mode_inner(path: &Path, mode: OpenMode, durability: Durability) -> Result<Self> {
        if mode == OpenMode::ReadWrite {
            creation::prepare(path)?;
            // The next start cleans what killed inspection commands of
            // older builds left (their secondaries' directories; finding
            // the scratch directory, not making one).
            creation::remove_dead_secondaries(creation::existing_scratch_dir().as_deref());
        }
        creation::warn_if_others_can_write(path);
        let exists = path.exists();
        if !exists && mode != OpenMode::ReadWrite {
            return Err(Error::NotFound {
                path: path.to_path_buf(),
            });
        }
        if exists {
            if !path.is_dir() {
                return Err(Error::NotKeel {
                    path: path.to_path_buf(),
                    detail: "not a directory".into(),
                });
            }
            let empty = std::fs::read_dir(path)?.next().is_none();
            if !path.join("CURRENT").exists() && (!empty || mode != OpenMode::ReadWrite) {
                return Err(Error::NotKeel {
                    path: path.to_path_buf(),
                    detail: "no RocksDB CURRENT file".into(),
                });
            }
        }
        // Read before RocksDB recovers: what was acknowledged by then is
        // in the log it recovers from.
        let recorded = if exists { acked::read(path)? } else { None };
        let cache = block_cache();
        let opts = db_options(mode, &cache);
        let existing = if path.join("CURRENT").exists() {
            let found = DB::list_cf(&opts, path)?;
            let unfinished = mode == OpenMode::ReadWrite && creation::unfinished(path, &found)?;
            if !unfinished && !found.iter().any(|n| n == Cf::Meta.name()) {
                return Err(Error::NotKeel {
                    path: path.to_path_buf(),
                    detail: "a RocksDB directory without keel's column families".into(),
                });
            }
            found
        } else {
            Vec::new()
        };
        // A read-only look opens only the families there are (a directory
        // whose creation was cut short lacks some; the read-write open
        // makes them).
        let there = existing.clone();
        let names = family_names(existing);
        // What the logs hold, read by keel before RocksDB recovers from
        // them.
        let scans = if path.join("CURRENT").exists() {
            // Damage RocksDB's recovery does not report (a zeroed block
            // inside a log: it skips the block and reads on; a recycled
            // log's end followed by its own records: point-in-time
            // recovery stops there) must still stop the open.
            let scans = crate::wal::scan_dir(path)?;
            if let Some(found) = crate::wal::describe(&scans) {
                return Err(damaged_logs(path, found));
            }
            Some(scans)
        } else {
            None
        };
        if let (OpenMode::ReadWrite, Some(scans)) = (mode, &scans) {
            // Compared before a read-write open, which would replay and
            // remove the logs (the evidence `recover` reads) and could
            // write (a migration) before the comparison. A write-ahead log
            // deleted under this look means another process is writing
            // the directory now: it is locked, as the read-write open
            // would say (seen in CI beside a running engine, where this
            // open came first).
            let ro = DB::open_cf_for_read_only(&opts, path, &there, false).map_err(|e| {
                match map_open_error(path, e) {
                    e if raced_by_writer(&e) => Error::Locked {
                        path: path.to_path_buf(),
                    },
                    e => e,
                }
            })?;
            let found = ro.latest_sequence_number();
            drop(ro);
            check_recovered(path, scans, recorded, found)?;
        }
        let db = match mode {
            OpenMode::ReadWrite => {
                DB::open_cf_descriptors(&opts, path, cf_descriptors(&names, &cache))
            }
            OpenMode::ReadOnly => DB::open_cf_for_read_only(&opts, path, &names, false),
        }
        .map_err(|e| map_open_error(path, e))?;
        let db = Arc::new(db);
        if let (OpenMode::ReadOnly, Some(scans)) = (mode, &scans) {
            check_recovered(path, scans, recorded, db.latest_sequence_number())?;
        }
        check_or_init_meta(&db, path, mode)?;
        if mode == OpenMode::ReadWrite {
            if let Err(e) = creation::make_files_private(path) {
                tracing::warn!(path = %path.display(), error = %e,
                    "cannot make the data directory's files private to their owner");
            }
        }
        let health = Arc::new(HealthCell::default());
        let stats = Arc::new(crate::stats::WriterStats::default());
        let (tx, writer, acked) = if mode == OpenMode::ReadWrite {
            let keeper = acked::AckedKeeper::start(path, db.latest_sequence_number())?;
            let watch = WriteWatch::new(health.clone(), path.to_path_buf());
            let published = (durability == Durability::Sync).then(|| keeper.handle());
            let (tx, handle, shared) =
                start_writer(db.clone(), durability, watch, published, stats.clone())?;
            (Some((tx, shared)), Some(handle), Some(keeper))
        } else {
            (None, None, None)
        };
        Ok(RocksStore {
            db,
            path: path.to_path_buf(),
            mode,
            durability,
            tx,
            writer,
            health,
            stats,
            block_cache: cache,
            acked,
        })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// How it was opened.
    pub fn mode(&self) -> OpenMode {
        self.mode
    }

    /// Writes a consistent checkpoint of the store to `dir` (which must not
    /// exist): a directory that opens as a keel store.
    pub fn checkpoint(&self, dir: impl AsRef<Path>) -> Result<()> {
        Checkpoint::new(&self.db)?.create_checkpoint(dir.as_ref())?;
        Ok(())
    }

    /// Copies the data directory at `path` to `dest` (which must not
    /// exist) while another process holds it open for writing: a
    /// consistent copy that opens as a keel store, holding at least every
    /// commit acknowledged before the call. RocksDB's own checkpoint needs
    /// the writing process; from outside, keel copies the files itself: the
    /// MANIFEST up to its current length, every table file (hard-linked:
    /// they never change) and every write-ahead log as it is now (a record
    /// being written is a torn tail, which recovery drops as after a crash).
    /// A flush or compaction that finishes during the copy changes the
    /// MANIFEST and may delete files; the copy is then thrown away and
    /// taken again, at most [`LIVE_COPY_ATTEMPTS_MAX`] times.
    pub fn copy_live(path: impl AsRef<Path>, dest: impl AsRef<Path>) -> Result<()> {
        live_copy::copy(path.as_ref(), dest.as_ref())
    }

    /// Flushes every family's memtable to table files in one atomic flush:
    /// one log switch (a flush per family would switch the log once per
    /// family that holds anything). An engine's clean shutdown ends with
    /// it, and [`RocksStore::prime_logs`] switches logs with it.
    pub fn flush(&self) -> Result<()> {
        let handles: Vec<_> = Cf::ALL
            .iter()
            .filter_map(|cf| self.db.cf_handle(cf.name()))
            .collect();
        self.db
            .flush_cfs_opt(&handles, &rocksdb::FlushOptions::default())?;
        Ok(())
    }

    /// Gives RocksDB written logs to recycle, so that the engine's first
    /// syncs after an open already write over a file instead of growing
    /// it (which costs each sync an inode write: about 1.3x an fsync here
    /// against 0.9x, BENCHMARKS.md "primed logs"). RocksDB recycles only
    /// logs the running instance wrote, and only from its second switch
    /// on, so without this every open appends for its first two logs
    /// (about 16 MiB, thousands of commits).
    ///
    /// Each round writes [`PRIMED_LOG_BYTES`] of log-only records (kept
    /// in the log, never applied: recovery and keel's log scan read past
    /// them), syncs them, rewrites the store's metadata record unchanged so
    /// the memtables hold something, and flushes, which switches the log;
    /// it stops once the log in use is a recycled one, after at most
    /// [`PRIME_ROUNDS_MAX`] rounds. Nothing else changes in the store. It
    /// is meant for right after an open, before commits begin (commits
    /// meanwhile are correct, only slower), and is a no-op for a read-only
    /// store.
    pub fn prime_logs(&self) -> Result<PrimeReport> {
        let started = std::time::Instant::now();
        let mut report = PrimeReport::default();
        if self.tx.is_none() {
            return Ok(report);
        }
        let meta = self.db.cf_handle(Cf::Meta.name()).ok_or(Error::Closed)?;
        let Some(record) = self.db.get_cf(&meta, STORE_META_KEY)? else {
            return Ok(report); // not initialised: nothing opened this store yet
        };
        let chunk = vec![0x6b_u8; PRIME_CHUNK_BYTES];
        // A switch makes a new log until the one before it is free to be
        // recycled: the log in use is long only from the second round on.
        while !report.primed && report.rounds < PRIME_ROUNDS_MAX {
            for _ in 0..PRIMED_LOG_BYTES / PRIME_CHUNK_BYTES {
                let mut batch = WriteBatch::default();
                batch.put_log_data(&chunk);
                self.db.write(batch)?;
            }
            report.bytes += PRIMED_LOG_BYTES as u64;
            self.db.put_cf(&meta, STORE_META_KEY, &record)?;
            self.db.flush_wal(true)?;
            self.flush()?;
            report.rounds += 1;
            report.primed = self.current_log_bytes()? >= PRIMED_LOG_BYTES as u64;
        }
        report.elapsed_ms = started.elapsed().as_secs_f64() * 1000.0;
        if !report.primed {
            tracing::warn!(path = %self.path.display(), rounds = report.rounds,
                "the write-ahead log in use is still a new one after priming; the first syncs append");
        }
        Ok(report)
    }

    /// The size of the newest log file, the one RocksDB writes.
    fn current_log_bytes(&self) -> Result<u64> {
        let newest = crate::wal::log_files(&self.path)?.pop();
        Ok(match newest {
            Some(file) => std::fs::metadata(file)?.len(),
            None => 0,
        })
    }

    /// Stops the writer after it has answered every queued commit.
    pub fn close(mut self) -> Result<()> {
        self.shutdown();
        Ok(())
    }

    /// Queues `batch` for the writer thread, or, if `alone` (see
    /// [`Store::commit_alone`]) and the writer is idle, writes it on this
    /// thread ([`WriterShared::commit_in_place`]).
    fn commit_queued_or_in_place(&self, batch: CommitBatch, alone: bool) -> CommitHandle {
        let Some((tx, shared)) = &self.tx else {
            return CommitHandle::ready(Err(Error::ReadOnly));
        };
        let prepared = match PreparedBatch::new(batch) {
            Ok(p) => p,
            Err(e) => return CommitHandle::ready(Err(e)),
        };
        let (reply, handle) = CommitHandle::channel();
        let mut request = Request { prepared, reply };
        if alone {
            match shared.commit_in_place(request) {
                // Answered already.
                None => return handle,
                Some(back) => request = back,
            }
        }
        shared.queued.fetch_add(1, Ordering::AcqRel);
        match tx.send(request) {
            Ok(()) => handle,
            Err(_) => {
                shared.queued.fetch_sub(1, Ordering::AcqRel);
                CommitHandle::ready(Err(Error::Closed))
            }
        }
    }

    fn shutdown(&mut self) {
        self.tx.take();
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
        if let Some(mut keeper) = self.acked.take() {
            if self.durability == Durability::Buffered && self.db.flush_wal(true).is_ok() {
                keeper
                    .handle()
                    .store(self.db.latest_sequence_number(), Ordering::Release);
            }
            keeper.stop();
        }
    }
}

impl Drop for RocksStore {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn check_or_init_meta(db: &DB, path: &Path, mode: OpenMode) -> Result<()> {
    let cf = db
        .cf_handle(Cf::Meta.name())
        .ok_or_else(|| Error::NotKeel {
            path: path.to_path_buf(),
            detail: "missing meta column family".into(),
        })?;
    match db.get_cf(&cf, STORE_META_KEY)? {
        Some(bytes) => {
            let meta: StoreMeta =
                codec::decode(RecordKind::StoreMeta, &bytes).map_err(|e| Error::NotKeel {
                    path: path.to_path_buf(),
                    detail: format!("store metadata does not decode: {e}"),
                })?;
            if meta.format != "keel" {
                return Err(Error::NotKeel {
                    path: path.to_path_buf(),
                    detail: format!("format is {:?}", meta.format),
                });
            }
            if meta.schema_version < SCHEMA_VERSION && mode == OpenMode::ReadWrite {
                return migrate(db, path, meta);
            }
            if meta.schema_version != SCHEMA_VERSION {
                return Err(Error::SchemaVersion {
                    found: meta.schema_version,
                    expected: SCHEMA_VERSION,
                });
            }
            Ok(())
        }
        None if mode == OpenMode::ReadWrite => {
            let meta = StoreMeta {
                format: "keel".into(),
                schema_version: SCHEMA_VERSION,
                created_by: format!("keel {}", env!("CARGO_PKG_VERSION")),
            };
            let bytes =
                codec::encode(RecordKind::StoreMeta, &meta).map_err(|source| Error::Corrupt {
                    cf: "meta",
                    run: None,
                    seq: None,
                    source,
                })?;
            let mut wo = WriteOptions::default();
            wo.set_sync(true);
            db.put_cf_opt(&cf, STORE_META_KEY, bytes, &wo)?;
            Ok(())
        }
        None => Err(Error::NotKeel {
            path: path.to_path_buf(),
            detail: "no store metadata".into(),
        }),
    }
}

/// An older schema to this one. Schema 1 to 2: derived state gained the
/// `children` family, the cancellation and continue-as-new intents and a
/// new record version. Schema 2 to 3: events gained an update's failure
/// (event version 3), which an older build could not read. Events are
/// never rewritten, so the whole derived state is rebuilt from them
/// through the commit path's own code and written in one synced batch with
/// the new schema version: a crash before the batch leaves the old schema,
/// which the next read-write open migrates again. Schema 4 to 5: only the
/// encoding of new records changed (positional bodies), and this build
/// reads schema 4's records as they are, so only the version is written:
/// the older records stay maps until their keys are written again (and
/// `verify` compares a record by its value, not its bytes). Schema 5 to 6:
/// an attempt's result that closes its execution no longer writes the
/// attempt's dedupe row beside the execution's, so those rows are deleted
/// (in the same synced batch as the version). Schema 6 to 7: the index
/// keeps no keys by type alone nor of every run, so the ranges of keys
/// starting with [`crate::search::DROPPED_INDEX_PREFIXES`] are deleted,
/// by one range deletion each in that batch (nothing is read, however
/// many runs the directory holds). Schema 7 to 8: an open run's record
/// may trail its events ([`crate::kv::KvWrite::put_derivable`]); schema 7's
/// records are all current, which is one case of that, so only the version
/// is written. Only a read-write open migrates;
/// inspection of an older directory asks for one.
fn migrate(db: &DB, path: &Path, mut meta: StoreMeta) -> Result<()> {
    let from = meta.schema_version;
    let mut mutations = Vec::new();
    let mut runs = None;
    if from < crate::SCHEMA_VERSION_READ_AS_IS {
        let view = DbView(db);
        let (rebuilt, report) = crate::verify::rebuild(&view)?;
        if !report.ok {
            tracing::warn!(path = %path.display(), problems = report.violations.len(), from,
                "migrating an older data directory with damaged runs; `keel verify` lists them");
        }
        for cf in Cf::DERIVED {
            view.scan(cf, &[], &[], &mut |k, _| {
                mutations.push(Mutation::Delete(cf, k.to_vec()));
                true
            })?;
            for (k, v) in rebuilt.cf(cf) {
                mutations.push(Mutation::Put(cf, k.clone(), v.clone()));
            }
        }
        runs = Some(report.runs);
    } else if from < crate::SCHEMA_VERSION_ATTEMPT_ROWS_DROPPED {
        let dropped = crate::derive::attempt_rows_beside_executions(&DbView(db))?;
        tracing::info!(path = %path.display(), rows = dropped.len(),
            "dropping the attempt rows an execution's row makes redundant");
        mutations.extend(dropped.into_iter().map(|k| Mutation::Delete(Cf::Dedupe, k)));
    }
    meta.schema_version = SCHEMA_VERSION;
    let bytes = codec::encode(RecordKind::StoreMeta, &meta).map_err(|source| Error::Corrupt {
        cf: "meta",
        run: None,
        seq: None,
        source,
    })?;
    mutations.push(Mutation::Put(Cf::Meta, STORE_META_KEY.to_vec(), bytes));
    let mut batch = batch_of(db, mutations)?;
    if from < crate::SCHEMA_VERSION_INDEX_NARROWED {
        let index = db.cf_handle(Cf::Index.name()).ok_or(Error::Closed)?;
        for first in crate::search::DROPPED_INDEX_PREFIXES {
            batch.delete_range_cf(&index, [first], [first + 1]);
        }
    }
    let mut wo = WriteOptions::default();
    wo.set_sync(true);
    write_opt(db, batch, &wo)?;
    tracing::info!(path = %path.display(), rebuilt_runs = ?runs, from, to = SCHEMA_VERSION,
        "migrated the data directory to the current schema");
    Ok(())
}

struct DbView<'a>(&'a DB);

impl DbView<'_> {
    /// [`KvRead::scan`], with `fill_cache` saying whether the blocks it
    /// reads go into the block cache: an inspection open scans whole
    /// families once, and caching them would only evict block after block.
    ///
    /// Our records carry their own checksums, so a damaged block is read
    /// record by record and costs only the records it hit, named by the
    /// codec. But a block goes into the cache only once RocksDB has checked
    /// it: a compaction takes cached blocks as checked and would write a
    /// damaged one into a new table under a fresh checksum, where nothing
    /// would find the damage again. So a scan that fills the cache checks
    /// blocks, and on a block that fails goes on from its last record
    /// without checking or caching ([`read_options`]).
    fn scan_filling(
        &self,
        cf: Cf,
        prefix: &[u8],
        from: &[u8],
        fill_cache: bool,
        visit: &mut dyn FnMut(&[u8], &[u8]) -> bool,
    ) -> Result<()> {
        if !fill_cache {
            return self.scan_with(cf, prefix, from, Read::Unchecked, &mut None, visit);
        }
        let mut last = Some(Vec::new());
        match self.scan_with(cf, prefix, from, Read::Checked, &mut last, visit) {
            Err(Error::DamagedTable { detail, .. }) => {
                damaged_block_read(cf, &detail);
                let last = last.expect("kept above");
                let from = if last.is_empty() {
                    from.to_vec()
                } else {
                    key_after(last)
                };
                self.scan_with(cf, prefix, &from, Read::Unchecked, &mut None, visit)
            }
            done => done,
        }
    }

    /// One iterator's pass of [`Self::scan_filling`], keeping the last key
    /// it visited in `last` if asked (to go on after it).
    fn scan_with(
        &self,
        cf: Cf,
        prefix: &[u8],
        from: &[u8],
        read: Read,
        last: &mut Option<Vec<u8>>,
        visit: &mut dyn FnMut(&[u8], &[u8]) -> bool,
    ) -> Result<()> {
        let h = self.0.cf_handle(cf.name()).ok_or(Error::Closed)?;
        let mut ro = read_options(read);
        // With an upper bound every key the iterator yields has the
        // prefix (it starts at or after it): no comparison per record.
        let mut check_prefix = !prefix.is_empty();
        if let Some(end) = prefix_end(prefix) {
            ro.set_iterate_upper_bound(end);
            check_prefix = false;
        }
        let start = if from > prefix { from } else { prefix };
        // A raw iterator hands out borrowed slices: no allocation or copy per
        // record (the boxed iterator costs both, which dominates long scans).
        // A checked scan copies each key into `last` (into one buffer), to
        // go on after it past a damaged block.
        let mut it = self.0.raw_iterator_cf_opt(&h, ro);
        it.seek(start);
        while let Some((k, v)) = it.item() {
            if (check_prefix && !k.starts_with(prefix)) || !visit(k, v) {
                return Ok(());
            }
            if let Some(last) = last.as_mut() {
                last.clear();
                last.extend_from_slice(k);
            }
            it.next();
        }
        // The iterator stops on an error as on the end: tell them apart.
        it.status().map_err(|e| read_error(cf, e))?;
        Ok(())
    }

    /// [`KvRead::scan_prefixes`] through one iterator, with or without
    /// filling the block cache.
    ///
    /// A prefix after the one before it, in key order, whose keys follow at
    /// once is not sought: the iterator already stands on its first key.
    /// (Every key between the last seek and the iterator was visited and
    /// started with an earlier prefix, so none of a greater prefix was
    /// passed.) The prefixes of one family have one length (run ids), so a
    /// key starting with one cannot start with another.
    fn scan_prefixes_filling(
        &self,
        cf: Cf,
        prefixes: &[Vec<u8>],
        fill_cache: bool,
        visit: &mut PrefixVisitor<'_>,
    ) {
        let Some(h) = self.0.cf_handle(cf.name()) else {
            for i in 0..prefixes.len() {
                visit(i, Err(Error::Closed));
            }
            return;
        };
        // As in `scan_filling`: blocks are checked where they are cached,
        // and a prefix whose block fails is read again by `scan_filling`.
        let read = if fill_cache {
            Read::Checked
        } else {
            Read::Unchecked
        };
        let mut it = self.0.raw_iterator_cf_opt(&h, read_options(read));
        // The prefix whose keys ran out under the iterator, if it ran on.
        let mut ran_past: Option<&[u8]> = None;
        let mut last: Vec<u8> = Vec::new();
        for (i, prefix) in prefixes.iter().enumerate() {
            let follows = ran_past.is_some_and(|before| prefix.as_slice() > before)
                && it.key().is_some_and(|k| k.starts_with(prefix));
            if !follows {
                it.seek(prefix);
            }
            ran_past = Some(prefix);
            // The last key visited, to go on after it if the iterator fails
            // (one buffer for every prefix: no allocation per key).
            last.clear();
            let mut stopped = false;
            while let Some((k, v)) = it.item() {
                if !k.starts_with(prefix) {
                    break;
                }
                if !visit(i, Ok((k, v))) {
                    ran_past = None;
                    stopped = true;
                    break;
                }
                last.clear();
                last.extend_from_slice(k);
                it.next();
            }
            if it.status().is_err() {
                // Without an upper bound the shared iterator may have failed
                // past this prefix, in a block of another one: this prefix
                // is read again alone, from after its last key, and only its
                // own failure is its error. A failed iterator stays failed:
                // the next prefix gets a new one.
                it = self.0.raw_iterator_cf_opt(&h, read_options(read));
                ran_past = None;
                if !stopped {
                    let from = if last.is_empty() {
                        prefix.clone()
                    } else {
                        key_after(std::mem::take(&mut last))
                    };
                    let rest = self.scan_filling(cf, prefix, &from, fill_cache, &mut |k, v| {
                        visit(i, Ok((k, v)))
                    });
                    if let Err(e) = rest {
                        visit(i, Err(e));
                    }
                }
            }
        }
    }
}

impl KvRead for DbView<'_> {
    fn get(&self, cf: Cf, key: &[u8]) -> Result<Option<Vec<u8>>> {
        let h = self.0.cf_handle(cf.name()).ok_or(Error::Closed)?;
        if cf == Cf::Events {
            // As the scans read events: each record carries its own
            // checksum, which the codec checks, so a damaged byte costs
            // its own event, named by run and seq, and not every event of
            // its table block (`EVENTS_BLOCK_BYTES`) through RocksDB's
            // block checksum. The block is checked first all the same, so
            // that a damaged one is never cached (see `scan_filling`).
            return match self.0.get_cf_opt(&h, key, &read_options(Read::Checked)) {
                Err(e) if e.kind() == rocksdb::ErrorKind::Corruption => {
                    damaged_block_read(cf, e.as_ref());
                    self.0
                        .get_cf_opt(&h, key, &read_options(Read::Unchecked))
                        .map_err(|e| read_error(cf, e))
                }
                read => read.map_err(|e| read_error(cf, e)),
            };
        }
        // The block's checksum stays checked here: a damaged key must not
        // read as absent (a durable id's row, a run's record).
        self.0.get_cf(&h, key).map_err(|e| read_error(cf, e))
    }

    fn get_many(&self, cf: Cf, keys: &[Vec<u8>]) -> Result<Vec<Option<Vec<u8>>>> {
        let h = self.0.cf_handle(cf.name()).ok_or(Error::Closed)?;
        self.0
            .batched_multi_get_cf(&h, keys, false)
            .into_iter()
            .map(|v| {
                v.map(|found| found.map(|slice| slice.to_vec()))
                    .map_err(|e| read_error(cf, e))
            })
            .collect()
    }

    fn scan(
        &self,
        cf: Cf,
        prefix: &[u8],
        from: &[u8],
        visit: &mut dyn FnMut(&[u8], &[u8]) -> bool,
    ) -> Result<()> {
        self.scan_filling(cf, prefix, from, true, visit)
    }

    fn scan_prefixes(&self, cf: Cf, prefixes: &[Vec<u8>], visit: &mut PrefixVisitor<'_>) {
        self.scan_prefixes_filling(cf, prefixes, true, visit)
    }

    fn last(&self, cf: Cf, prefix: &[u8]) -> Result<Option<(Vec<u8>, Vec<u8>)>> {
        // As the other reads of events: the record's own checksum, which
        // the codec checks, covers what is used, so a damaged block costs
        // only the readers of the event it damaged (and is not cached).
        match self.last_with(cf, prefix, Read::Checked) {
            Err(Error::DamagedTable { detail, .. }) if cf == Cf::Events => {
                damaged_block_read(cf, &detail);
                self.last_with(cf, prefix, Read::Unchecked)
            }
            read => read,
        }
    }
}

impl DbView<'_> {
    fn last_with(&self, cf: Cf, prefix: &[u8], read: Read) -> Result<Option<(Vec<u8>, Vec<u8>)>> {
        let h = self.0.cf_handle(cf.name()).ok_or(Error::Closed)?;
        let mut ro = read_options(read);
        ro.set_iterate_lower_bound(prefix.to_vec());
        if let Some(end) = prefix_end(prefix) {
            ro.set_iterate_upper_bound(end);
        }
        let mut it = self.0.raw_iterator_cf_opt(&h, ro);
        it.seek_to_last();
        if let Some((k, v)) = it.item().filter(|(k, _)| k.starts_with(prefix)) {
            return Ok(Some((k.to_vec(), v.to_vec())));
        }
        it.status().map_err(|e| read_error(cf, e))?;
        Ok(None)
    }
}

/// How a read treats RocksDB's block checksums and its block cache.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Read {
    /// Checks each block read from a file and caches it.
    Checked,
    /// Neither checks nor caches: the records' own checksums, which the
    /// codec checks, find damage record by record. A block read so may be
    /// damaged, and the cache must hold only checked blocks (a compaction
    /// takes cached blocks as checked).
    Unchecked,
}

fn read_options(read: Read) -> ReadOptions {
    let mut ro = ReadOptions::default();
    ro.set_verify_checksums(read == Read::Checked);
    ro.fill_cache(read == Read::Checked);
    ro
}

/// The least key after `key`.
fn key_after(mut key: Vec<u8>) -> Vec<u8> {
    key.push(0);
    key
}

/// A block failed its checksum under a read that can go on record by
/// record: said once per read, since the compaction that meets the block
/// later stops the store, and this is the first sign of it.
fn damaged_block_read(cf: Cf, detail: &str) {
    tracing::warn!(
        cf = cf.name(),
        detail,
        "a table block failed its checksum; reading its records one by one, uncached"
    );
}

impl KvRead for RocksStore {
    fn get(&self, cf: Cf, key: &[u8]) -> Result<Option<Vec<u8>>> {
        DbView(&self.db).get(cf, key)
    }

    fn last(&self, cf: Cf, prefix: &[u8]) -> Result<Option<(Vec<u8>, Vec<u8>)>> {
        DbView(&self.db).last(cf, prefix)
    }

    fn get_many(&self, cf: Cf, keys: &[Vec<u8>]) -> Result<Vec<Option<Vec<u8>>>> {
        DbView(&self.db).get_many(cf, keys)
    }

    fn scan(
        &self,
        cf: Cf,
        prefix: &[u8],
        from: &[u8],
        visit: &mut dyn FnMut(&[u8], &[u8]) -> bool,
    ) -> Result<()> {
        // A read-only open is an inspection (replay, verify, export) that
        // reads each block once; engines and followers read them again.
        let fill_cache = self.mode != OpenMode::ReadOnly;
        DbView(&self.db).scan_filling(cf, prefix, from, fill_cache, visit)
    }

    fn scan_once(
        &self,
        cf: Cf,
        prefix: &[u8],
        from: &[u8],
        visit: &mut dyn FnMut(&[u8], &[u8]) -> bool,
    ) -> Result<()> {
        DbView(&self.db).scan_filling(cf, prefix, from, false, visit)
    }

    fn scan_prefixes(&self, cf: Cf, prefixes: &[Vec<u8>], visit: &mut PrefixVisitor<'_>) {
        let fill_cache = self.mode != OpenMode::ReadOnly;
        DbView(&self.db).scan_prefixes_filling(cf, prefixes, fill_cache, visit)
    }
}

impl Store for RocksStore {
    fn view(&self) -> &dyn KvRead {
        self
    }

    fn for_each_history(
        &self,
        runs: &[RunId],
        visit: &mut dyn FnMut(usize, crate::store::ReadHistory),
    ) {
        // An iterator holds no lock: `visit` may read the store.
        crate::store::histories_through_one_cursor(self, runs, visit)
    }

    fn flush_log(&self) -> Result<()> {
        if self.tx.is_none() {
            return Ok(()); // read-only: nothing of ours is in the log
        }
        self.flush()
    }

    fn commit(&self, batch: CommitBatch) -> CommitHandle {
        self.commit_queued_or_in_place(batch, false)
    }

    fn commit_alone(&self, batch: CommitBatch) -> CommitHandle {
        self.commit_queued_or_in_place(batch, true)
    }

    fn sync(&self) -> Result<()> {
        if self.mode == OpenMode::ReadWrite {
            let seq = self.db.latest_sequence_number();
            self.db.flush_wal(true)?;
            if let Some(keeper) = &self.acked {
                keeper.handle().fetch_max(seq, Ordering::AcqRel);
            }
        }
        Ok(())
    }

    fn durability(&self) -> Durability {
        self.durability
    }

    fn health(&self) -> StoreHealth {
        let health = self.health.get();
        if health.is_healthy() {
            if let Some(stalled) = self.tx.as_ref().and_then(|(_, shared)| shared.stalled()) {
                return stalled;
            }
        }
        health
    }

    fn writer_stats(&self) -> Option<crate::stats::WriterSnapshot> {
        (self.mode == OpenMode::ReadWrite).then(|| self.stats.snapshot())
    }

    fn memory(&self) -> Option<StoreMemory> {
        let mut memory = StoreMemory {
            block_cache_bytes: self.block_cache.get_usage() as u64,
            writer_cache_bytes: self.stats.snapshot().cache_bytes,
            ..StoreMemory::default()
        };
        for cf in Cf::ALL {
            let h = self.db.cf_handle(cf.name())?;
            let property = |p: &str| {
                self.db
                    .property_int_value_cf(&h, p)
                    .ok()
                    .flatten()
                    .unwrap_or(0)
            };
            memory.memtables_bytes += property("rocksdb.cur-size-all-mem-tables");
            memory.table_readers_bytes += property("rocksdb.estimate-table-readers-mem");
        }
        Some(memory)
    }
}

/// Groups of at most this many commits are answered by the writer itself;
/// larger groups are handed to the answer thread (see [`start_writer`]).
const ANSWER_INLINE_MAX: usize = 2;

/// Each request with its answer; the request (its events and their
/// encoding) is freed by whoever answers, off the writer when handed over.
type Answers = Vec<(Request, Result<RawAck>)>;

/// Sends each committer its answer, decoding the intent rows here rather
/// than on the writer (on the answer thread for all but small groups).
fn answer(answers: Answers) {
    crate::store::answering(|| {
        for (req, result) in answers {
            req.reply.send(result.and_then(RawAck::decode));
        }
    });
}

/// Starts the single writer thread, which drains the queue into a group,
/// validates each request against the store plus the earlier requests of
/// the group, writes the group as one `WriteBatch` and answers every
/// requester ([`WriterCore::commit_group`]), and its answer thread. A
/// committer that finds the writer idle does the same for its own request
/// on its own thread ([`WriterShared::commit_in_place`]); whoever commits a
/// group holds the core's lock, so the two never overlap.
///
/// Answering is a thread wake-up per committer, which profiling showed to be
/// a third of the writer's time under many committers; so answers of a
/// group larger than [`ANSWER_INLINE_MAX`] go to a second thread and the
/// writer starts on the next group at once. Answers are only ever sent after
/// the group's write returned, in commit order (a small group is answered
/// inline only when the answer thread has nothing left to send), and the
/// answer thread is joined before the writer exits, so closing the store
/// still answers every queued commit.
fn start_writer(
    db: Arc<DB>,
    durability: Durability,
    watch: WriteWatch,
    acked: Option<Arc<AtomicU64>>,
    stats: Arc<crate::stats::WriterStats>,
) -> std::io::Result<(Sender<Request>, JoinHandle<()>, Arc<WriterShared>)> {
    let (tx, rx) = crossbeam_channel::bounded(COMMIT_QUEUE_MAX);
    let (answer_tx, answer_rx) = crossbeam_channel::unbounded::<Answers>();
    let handed = Arc::new(AtomicUsize::new(0));
    let answerer = {
        let handed = handed.clone();
        // If the thread cannot start, its receiver is dropped with the
        // closure and every send fails: the writer answers inline.
        std::thread::Builder::new()
            .name("keel-answer".into())
            .spawn(move || {
                for answers in answer_rx {
                    answer(answers);
                    handed.fetch_sub(1, Ordering::AcqRel);
                }
            })
            .ok()
    };
    let mut wo = WriteOptions::default();
    wo.set_sync(durability == Durability::Sync);
    let shared = Arc::new(WriterShared {
        core: Mutex::new(WriterCore {
            db,
            wo,
            watch,
            acked,
            stats,
            cache: WriterCache::default(),
            // RocksDB reads are local: nothing is read ahead.
            ahead: ReadAhead::new(),
            scans: ScanAhead::new(),
            answer_tx: Some(answer_tx),
            idle_since: Some(std::time::Instant::now()),
        }),
        queued: AtomicUsize::new(0),
        handed,
        stopped: std::sync::atomic::AtomicBool::new(false),
        writing_since_ms: AtomicU64::new(0),
    });
    let looped = shared.clone();
    let handle = std::thread::Builder::new()
        .name("keel-writer".into())
        .spawn(move || {
            writer_loop(&looped, &rx);
            // Only after a committer's panic does the loop end with the
            // store still open: every commit queued or made from then on
            // is answered `Closed` (committers no longer get the core).
            for req in rx {
                req.reply.send(Err(Error::Closed));
            }
            // The answer thread ends once its last sender is gone.
            looped
                .core
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .answer_tx = None;
            if let Some(a) = answerer {
                let _ = a.join();
            }
        })?;
    Ok((tx, handle, shared))
}

/// The writer thread's loop: a group of what is queued at a time, and a
/// probe every [`STORE_PROBE_INTERVAL_MS`] while writes fail (a failure may
/// come from a commit written in place, so the wait is timed rather than
/// woken by it: an idle writer thread wakes that often, finds writes
/// succeeding and waits again). Returns when the store closes, or at once
/// if a committer panicked while it held the core.
fn writer_loop(shared: &WriterShared, rx: &Receiver<Request>) {
    let mut group: Vec<Request> = Vec::with_capacity(GROUP_COMMITS_MAX);
    let probe_every = std::time::Duration::from_millis(STORE_PROBE_INTERVAL_MS);
    loop {
        let first = match rx.recv_timeout(probe_every) {
            Ok(r) => r,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                if shared.stopped.load(Ordering::Acquire) {
                    let Some(mut core) = shared.lock() else {
                        return;
                    };
                    let core = &mut *core;
                    core.watch.probe(&core.db, &core.wo);
                    shared.learn_health(core);
                }
                continue;
            }
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return,
        };
        let Some(mut core) = shared.lock() else {
            first.reply.send(Err(Error::Closed));
            return;
        };
        let mut bytes = first.prepared.bytes();
        group.push(first);
        while group.len() < GROUP_COMMITS_MAX && bytes < GROUP_COMMIT_BYTES_MAX {
            match rx.try_recv() {
                Ok(r) => {
                    bytes += r.prepared.bytes();
                    group.push(r);
                }
                Err(_) => break,
            }
        }
        let taken = group.len();
        shared.commit(&mut core, &mut group, bytes, taken);
    }
}

/// Milliseconds since the Unix epoch, by the wall clock.
fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The writer's state and the counts that say whether it is idle, shared by
/// the writer thread and the committers (see [`start_writer`]).
struct WriterShared {
    core: Mutex<WriterCore>,
    /// Requests sent to the writer thread and not yet answered or handed
    /// to the answer thread.
    queued: AtomicUsize,
    /// Groups handed to the answer thread and not yet fully answered.
    handed: Arc<AtomicUsize>,
    /// Whether writes fail and the writer thread probes (the core's
    /// `WriteWatch::stopped`, readable without its lock).
    stopped: std::sync::atomic::AtomicBool,
    /// When the group being written started (milliseconds since the Unix
    /// epoch), 0 between groups: read by [`WriterShared::stalled`].
    writing_since_ms: AtomicU64,
}

impl WriterShared {
    /// Whether the group being written has taken longer than
    /// [`STORE_WRITE_STALL_MS`] (a hung disk), as a health to report.
    fn stalled(&self) -> Option<StoreHealth> {
        let since = self.writing_since_ms.load(Ordering::Acquire);
        let stalled = since != 0 && wall_ms().saturating_sub(since) > STORE_WRITE_STALL_MS;
        stalled.then(|| StoreHealth::Stopped {
            fault: WriteFault::Stalled,
            detail: format!("a write and sync has not returned for over {STORE_WRITE_STALL_MS} ms"),
        })
    }

    /// The core, or `None` if a thread panicked while holding it.
    fn lock(&self) -> Option<std::sync::MutexGuard<'_, WriterCore>> {
        self.core.lock().ok()
    }

    /// Whether nothing is queued for the writer thread and every answer has
    /// been sent: a commit made now follows every earlier one, in the log
    /// and in the order committers hear back.
    fn idle(&self) -> bool {
        self.queued.load(Ordering::Acquire) == 0 && self.handed.load(Ordering::Acquire) == 0
    }

    /// Commits `group` (`bytes` in all, `from_queue` of its requests taken
    /// from the writer's queue) with `core` held, publishes what its write
    /// taught the health watch, and counts the queued requests out, which
    /// are answered or handed over (and counted in `handed`) by now. With
    /// nothing queued any more, the writer is idle from here.
    fn commit(
        &self,
        core: &mut WriterCore,
        group: &mut Vec<Request>,
        bytes: usize,
        from_queue: usize,
    ) {
        self.writing_since_ms
            .store(wall_ms().max(1), Ordering::Release);
        core.commit_group(group, bytes, &self.handed);
        self.writing_since_ms.store(0, Ordering::Release);
        self.learn_health(core);
        if self.queued.fetch_sub(from_queue, Ordering::AcqRel) == from_queue {
            core.idle_since = Some(std::time::Instant::now());
        }
    }

    fn learn_health(&self, core: &WriterCore) {
        self.stopped.store(core.watch.stopped(), Ordering::Release);
    }

    /// Commits `req` as a group of one on the calling thread if the writer
    /// is idle and writes succeed, answering it before this returns; gives
    /// it back otherwise.
    ///
    /// At low load this saves the two thread wake-ups of a queued commit
    /// (the writer's, then the committer's): W1 at concurrency 1 has its
    /// p50 about 8 % lower on 14 % less CPU (BENCHMARKS.md). Only for
    /// `commit_alone`: the committer's thread blocks for one synced write
    /// (on the engine, a shard's thread, which a stalled disk holds), so
    /// it is for a committer that would only wait anyway.
    fn commit_in_place(&self, req: Request) -> Option<Request> {
        if !self.idle() || self.stopped.load(Ordering::Acquire) {
            return Some(req);
        }
        let Ok(mut core) = self.core.try_lock() else {
            return Some(req);
        };
        // Checked again under the lock: the writer thread counts a group
        // out only after answering it, while it holds the lock.
        if !self.idle() || core.watch.stopped() {
            return Some(req);
        }
        let bytes = req.prepared.bytes();
        self.commit(&mut core, &mut vec![req], bytes, 0);
        None
    }
}

/// What validating, writing and answering a group needs. Whoever commits a
/// group holds it: the writer thread, or a committer that found the writer
/// idle ([`WriterShared::commit_in_place`]).
struct WriterCore {
    db: Arc<DB>,
    wo: WriteOptions,
    watch: WriteWatch,
    /// Where an acknowledged sequence is published (synced opens).
    acked: Option<Arc<AtomicU64>>,
    stats: Arc<crate::stats::WriterStats>,
    cache: WriterCache,
    ahead: ReadAhead,
    scans: ScanAhead,
    /// Hands larger groups' answers to the answer thread; `None` once the
    /// writer thread has ended.
    answer_tx: Option<Sender<Answers>>,
    /// Since when no group has been committed with nothing queued: the
    /// writer waits for work rather than work for the writer (counted as
    /// idle when the next group starts).
    idle_since: Option<std::time::Instant>,
}

impl WriterCore {
    /// Validates, writes and answers `group` (emptied), in its order.
    fn commit_group(&mut self, group: &mut Vec<Request>, bytes: usize, handed: &AtomicUsize) {
        let validating = std::time::Instant::now();
        if let Some(since) = self.idle_since.take() {
            self.stats.idle(validating.duration_since(since));
        }
        let span = info_span!("commit", commits = group.len(), bytes);
        let _enter = span.enter();
        let db_view = DbView(&self.db);
        let view = CachedView {
            base: &db_view,
            cache: &self.cache,
            ahead: &self.ahead,
            scans: &self.scans,
        };
        let mut overlay = Overlay::new(&view);
        let results: Vec<_> = group
            .iter()
            .map(|req| {
                apply_batch_step(&mut overlay, &req.prepared, Checks::ALL, EventRows::Caller)
            })
            .collect();
        self.stats.validated(validating.elapsed());
        let mut took = None;
        let written = if overlay.is_empty() {
            Ok(())
        } else if let Some(e) = self.watch.failed() {
            // Given up for good: nothing is written any more.
            Err(e)
        } else {
            let (writes, derivable) = overlay.into_parts();
            let accepted: Vec<&PreparedBatch> = group
                .iter()
                .zip(&results)
                .filter(|(_, r)| r.is_ok())
                .map(|(req, _)| &req.prepared)
                .collect();
            let started = std::time::Instant::now();
            let written = write_batch(&self.db, &writes, &derivable, &accepted, &self.wo);
            took = Some(started.elapsed());
            match &written {
                Ok(()) => {
                    self.cache.learn(Learned::take(writes, accepted));
                    // Synced: acknowledged from here on.
                    if let Some(acked) = &self.acked {
                        acked.store(self.db.latest_sequence_number(), Ordering::Release);
                    }
                }
                Err(_) => self.cache.forget(),
            }
            self.stats.cache_holds(self.cache.bytes());
            self.watch.wrote(&written);
            written
        };
        debug!(
            commits = group.len(),
            ok = written.is_ok(),
            "group committed"
        );
        let accepted = if written.is_ok() {
            results.iter().filter(|r| r.is_ok()).count()
        } else {
            0
        };
        self.stats.group(accepted, group.len() - accepted, took);
        let inline = group.len() <= ANSWER_INLINE_MAX && handed.load(Ordering::Acquire) == 0;
        let answers: Answers = group
            .drain(..)
            .zip(results)
            .map(|(req, result)| {
                let result = match (&written, result) {
                    (Err(Error::Unwritable { fault, detail }), Ok(_)) => Err(Error::Unwritable {
                        fault: *fault,
                        detail: detail.clone(),
                    }),
                    (Err(e), Ok(_)) => Err(Error::CommitFailed(e.to_string())),
                    (_, r) => r,
                };
                (req, result)
            })
            .collect();
        match &self.answer_tx {
            Some(tx) if !inline => {
                handed.fetch_add(1, Ordering::AcqRel);
                if let Err(crossbeam_channel::SendError(answers)) = tx.send(answers) {
                    // The answer thread never started.
                    handed.fetch_sub(1, Ordering::AcqRel);
                    answer(answers);
                }
            }
            _ => answer(answers),
        }
    }
}

/// What the writer knows about whether its writes work: it publishes the
/// state to the store's [`HealthCell`], logs each change at error (stopped)
/// or warn (resumed) level, and decides when a stop is final.
struct WriteWatch {
    health: Arc<HealthCell>,
    path: PathBuf,
    /// Since when writes fail, and when that was last logged.
    stop: Option<(std::time::Instant, std::time::Instant)>,
}

impl WriteWatch {
    fn new(health: Arc<HealthCell>, path: PathBuf) -> Self {
        WriteWatch {
            health,
            path,
            stop: None,
        }
    }

    /// Whether writes are failing (and not yet given up on).
    fn stopped(&self) -> bool {
        self.stop.is_some() && !self.health.get().is_failed()
    }

    /// The error every commit gets once the store gave up.
    fn failed(&self) -> Option<Error> {
        let health = self.health.get();
        if health.is_failed() {
            health.error()
        } else {
            None
        }
    }

    /// Learns from a write's result.
    fn wrote(&mut self, result: &Result<()>) {
        match result {
            Ok(()) => {
                if let Some((since, _)) = self.stop.take() {
                    self.health.set(StoreHealth::Healthy);
                    tracing::warn!(path = %self.path.display(), stopped_ms = since.elapsed().as_millis() as u64,
                        "the store accepts writes again");
                }
            }
            Err(Error::Unwritable { fault, detail }) => {
                let now = std::time::Instant::now();
                // A new cause starts its own wait (a full disk that turns
                // into an I/O error gets the I/O budget from now).
                let same = matches!(self.health.get(),
                    StoreHealth::Stopped { fault: f, .. } if f == *fault);
                if !same {
                    self.stop = None;
                }
                let first = self.stop.is_none();
                let (since, logged) = *self.stop.get_or_insert((now, now));
                let waited_ms = now.duration_since(since).as_millis() as u64;
                let give_up = !fault.waits()
                    || (*fault != WriteFault::NoSpace && waited_ms > STORE_IO_RECOVERY_MS_MAX);
                let (fault, detail) = (*fault, detail.clone());
                if give_up {
                    self.health.set(StoreHealth::Failed {
                        fault,
                        detail: detail.clone(),
                    });
                    tracing::error!(path = %self.path.display(), %fault, %detail, waited_ms,
                        "the store stopped accepting writes for good; the engine shuts down: {}", fault.remedy());
                } else if first {
                    self.health.set(StoreHealth::Stopped {
                        fault,
                        detail: detail.clone(),
                    });
                    tracing::error!(path = %self.path.display(), %fault, %detail,
                        "the store stopped accepting writes; commits fail until the cause is gone: {}", fault.remedy());
                } else if now.duration_since(logged).as_millis() as u64
                    >= STORE_STOPPED_LOG_INTERVAL_MS
                {
                    self.stop = Some((since, now));
                    tracing::error!(path = %self.path.display(), %fault, %detail, waited_ms,
                        "the store still does not accept writes: {}", fault.remedy());
                }
            }
            Err(_) => {}
        }
    }

    /// Tries whether a write goes through now (deleting a key that never
    /// exists, synced like a commit: it needs the log to take a record).
    fn probe(&mut self, db: &DB, wo: &WriteOptions) {
        let written = write_mutations(db, vec![Mutation::Delete(Cf::Meta, PROBE_KEY.to_vec())], wo);
        self.wrote(&written);
    }
}

/// The key a stopped writer's probe deletes (never written).
const PROBE_KEY: &[u8] = b"keel-write-probe";

/// Writes a group: `writes`, and the events of the `accepted` batches,
/// which validation left out of them (`EventRows::Caller`).
fn write_batch(
    db: &DB,
    writes: &Writes,
    derivable: &Derivable,
    accepted: &[&PreparedBatch],
    wo: &WriteOptions,
) -> Result<()> {
    let handles = handles(db);
    let handle = |cf: Cf| handles[cf.index()].ok_or(Error::Closed);
    // Sized once: RocksDB's record of a write is a tag, the family, two
    // lengths and the bytes, so the batch's buffer is not grown (and
    // copied) as it fills.
    let bytes: usize = writes
        .iter()
        .map(|((_, k), v)| k.len() + v.as_ref().map_or(0, Vec::len))
        .sum::<usize>()
        + writes.len() * WRITE_BATCH_RECORD_HEADER_BYTES_MAX
        + WRITE_BATCH_HEADER_BYTES
        + accepted
            .iter()
            .flat_map(|p| p.encoded.iter().flatten())
            .map(|e| e.len() + 24 + WRITE_BATCH_RECORD_HEADER_BYTES_MAX)
            .sum::<usize>();
    let mut batch = WriteBatch::with_capacity_bytes(bytes);
    let events = handle(Cf::Events)?;
    for prepared in accepted {
        for (key, bytes) in event_rows(prepared) {
            batch.put_cf(events, key, bytes);
        }
    }
    for (key, v) in writes {
        let (cf, k) = key;
        match v {
            // The events in this batch say it (`KvWrite::put_derivable`).
            Some(_) if derivable.contains(key) => {}
            Some(v) => batch.put_cf(handle(*cf)?, k, v),
            None => batch.delete_cf(handle(*cf)?, k),
        }
    }
    write_opt(db, batch, wo)
}

/// RocksDB's fixed header of a write batch: a sequence number and a count.
const WRITE_BATCH_HEADER_BYTES: usize = 12;

/// The most a write batch's record adds to its key and value: a tag byte,
/// the family's id and the two lengths, each a varint of at most 5 bytes.
const WRITE_BATCH_RECORD_HEADER_BYTES_MAX: usize = 16;

/// Writes `mutations` in their order as one batch (a delete and then a
/// put of the same key leave the put).
fn write_mutations(db: &DB, mutations: Vec<Mutation>, wo: &WriteOptions) -> Result<()> {
    write_opt(db, batch_of(db, mutations)?, wo)
}

/// `mutations` in their order, as one batch.
fn batch_of(db: &DB, mutations: Vec<Mutation>) -> Result<WriteBatch> {
    let handles = handles(db);
    let handle = |cf: Cf| handles[cf.index()].ok_or(Error::Closed);
    let mut batch = WriteBatch::default();
    for m in mutations {
        match m {
            Mutation::Put(cf, k, v) => batch.put_cf(handle(cf)?, k, v),
            Mutation::Delete(cf, k) => batch.delete_cf(handle(cf)?, k),
        }
    }
    Ok(batch)
}

/// Each family's handle, looked up once per batch (a search of the open's
/// family names by string), not once per key; `None` once closed.
fn handles(db: &DB) -> [Option<&rocksdb::ColumnFamily>; Cf::ALL.len()] {
    Cf::ALL.map(|cf| db.cf_handle(cf.name()))
}

fn write_opt(db: &DB, batch: WriteBatch, wo: &WriteOptions) -> Result<()> {
    db.write_opt(batch, wo).map_err(|e| {
        let detail = e.into_string();
        Error::Unwritable {
            fault: WriteFault::of_message(&detail),
            detail,
        }
    })
}

/// Creating a data directory atomically. A new directory is built beside
/// its final path under a name that says it is unfinished
/// (`.NAME.keel-creating.PID`), complete with every column family and the
/// store metadata, synced, and only then renamed into place: a process
/// killed while creating leaves either nothing at the path or a complete
/// directory, and the next read-write open removes the leftover. A
/// directory left half-made by an older build (RocksDB files without all
/// of keel's column families and without any data) is completed by the
/// next read-write open instead of being refused.
mod creation {
    use std::path::{Path, PathBuf};

    use super::*;

    /// Marks a directory that is still being created.
    const CREATING_MARK: &str = ".keel-creating.";

    /// Makes sure a read-write open of `path` finds either nothing usable
    /// to create in place or a complete directory.
    pub(super) fn prepare(path: &Path) -> Result<()> {
        let (parent, name) = match (path.parent(), path.file_name()) {
            (Some(p), Some(n)) => (
                if p.as_os_str().is_empty() {
                    Path::new(".")
                } else {
                    p
                },
                n.to_string_lossy().into_owned(),
            ),
            _ => return Ok(()),
        };
        if !parent.is_dir() {
            std::fs::create_dir_all(parent)?;
        }
        remove_leftovers(parent, &name)?;
        if path.is_dir() && !path.join("CURRENT").exists() && rocksdb_debris_only(path)? {
            // An older build killed before RocksDB wrote CURRENT: nothing
            // could have been committed yet.
            tracing::warn!(path = %path.display(),
                "recreating a data directory whose creation was interrupted (it holds no data)");
            for entry in std::fs::read_dir(path)? {
                std::fs::remove_file(entry?.path())?;
            }
        }
        let empty_dir = path.is_dir() && std::fs::read_dir(path)?.next().is_none();
        if path.exists() && !empty_dir {
            return Ok(());
        }
        let building = parent.join(format!(".{name}{CREATING_MARK}{}", std::process::id()));
        if building.exists() {
            std::fs::remove_dir_all(&building)?;
        }
        if let Err(e) = create_private_dir(&building) {
            if e.kind() == std::io::ErrorKind::PermissionDenied && empty_dir {
                // The parent is not ours to write in (an empty directory
                // made for keel under a root-owned one): create in place,
                // not atomically, as RocksDB would.
                tracing::warn!(path = %path.display(),
                    "cannot create beside the data directory; creating it in place");
                return Ok(());
            }
            return Err(e.into());
        }
        {
            let cache = block_cache();
            let opts = db_options(OpenMode::ReadWrite, &cache);
            let mut names: Vec<String> = Cf::ALL.iter().map(|c| c.name().to_string()).collect();
            names.push("default".into());
            let db = DB::open_cf_descriptors(&opts, &building, cf_descriptors(&names, &cache))
                .map_err(|e| map_open_error(&building, e))?;
            check_or_init_meta(&db, &building, OpenMode::ReadWrite)?;
            db.flush_wal(true)?;
        }
        make_files_private(&building)?;
        sync_dir(&building)?;
        // Replaces an empty directory at `path` too (rename(2)).
        if let Err(e) = std::fs::rename(&building, path) {
            std::fs::remove_dir_all(&building)?;
            // Another process created it first: open theirs.
            let created = path.join("CURRENT").exists();
            if !created {
                return Err(e.into());
            }
        }
        sync_dir(parent)?;
        Ok(())
    }

    /// Removes directories an earlier creation of `NAME` left behind, unless
    /// the process that was creating them still runs.
    fn remove_leftovers(parent: &Path, name: &str) -> Result<()> {
        let prefix = format!(".{name}{CREATING_MARK}");
        for entry in std::fs::read_dir(parent)? {
            let entry = entry?;
            let file = entry.file_name().to_string_lossy().into_owned();
            let Some(pid) = file.strip_prefix(&prefix) else {
                continue;
            };
            let ours = pid == std::process::id().to_string();
            if ours || !process_alive(pid) {
                tracing::info!(leftover = %entry.path().display(),
                    "removing an unfinished data directory left by a killed creation");
                std::fs::remove_dir_all(entry.path())?;
            }
        }
        Ok(())
    }

    /// The name a secondary's own directory started with, followed by the
    /// process id: `secondary-PID-RANDOM`, in the scratch directory. (Keel
    /// no longer opens secondaries: see [`super::OpenMode::ReadOnly`].)
    const SECONDARY_PREFIX: &str = "secondary-";

    /// What secondaries of older builds were called, directly in the temp
    /// dir (`keel-secondary-PID-RANDOM`): removed like the new ones.
    const OLD_SECONDARY_PREFIX: &str = "keel-secondary-";

    /// What older builds called the scratch directory (`keel-UID`): a
    /// name plain enough for anything else to take, such as a file a user
    /// left in the temp dir.
    const OLD_SCRATCH_PREFIX: &str = "keel-";

    /// The scratch directory's name before the user id.
    const SCRATCH_PREFIX: &str = "keel-scratch-";

    /// Most alternatives to the scratch directory's own name older builds
    /// tried when something that is not a private directory of this user
    /// held it (`keel-scratch-UID-1`, `-2`, ...).
    const SCRATCH_DIR_ALTERNATIVES_MAX: u32 = 8;

    /// The scratch directory older builds' inspection commands took, if one
    /// exists: the first of its names that is a directory private to this
    /// user.
    pub(super) fn existing_scratch_dir() -> Option<PathBuf> {
        let uid = user_id();
        scratch_names(&std::env::temp_dir(), uid).find(|dir| private_to_us(dir, uid))
    }

    /// The scratch directory's names in `base`, in the order they are
    /// taken: its own, then the numbered alternatives.
    fn scratch_names(base: &Path, uid: u32) -> impl Iterator<Item = PathBuf> + '_ {
        (0..=SCRATCH_DIR_ALTERNATIVES_MAX).map(move |n| match n {
            0 => base.join(format!("{SCRATCH_PREFIX}{uid}")),
            n => base.join(format!("{SCRATCH_PREFIX}{uid}-{n}")),
        })
    }

    /// The effective user id: the owner of a file this process creates
    /// (works without `/proc`, and without a libc dependency).
    /// Found once per process (each finding makes a file).
    #[cfg(unix)]
    fn user_id() -> u32 {
        use std::os::unix::fs::MetadataExt;
        static UID: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
        *UID.get_or_init(|| {
            tempfile::tempfile()
                .and_then(|f| f.metadata())
                .map_or(0, |m| m.uid())
        })
    }

    #[cfg(not(unix))]
    fn user_id() -> u32 {
        0
    }

    #[cfg(unix)]
    fn private_to_us(dir: &Path, uid: u32) -> bool {
        use std::os::unix::fs::MetadataExt;
        std::fs::symlink_metadata(dir)
            .is_ok_and(|m| m.is_dir() && m.uid() == uid && m.mode() & 0o077 == 0)
    }

    #[cfg(not(unix))]
    fn private_to_us(dir: &Path, _uid: u32) -> bool {
        dir.is_dir()
    }

    /// Warns when users other than the owner can write to the data
    /// directory: they could change or remove every workflow's history.
    pub(super) fn warn_if_others_can_write(path: &Path) {
        #[cfg(unix)]
        {
            use std::os::unix::fs::MetadataExt;
            if let Ok(m) = std::fs::metadata(path) {
                if m.mode() & 0o022 != 0 {
                    tracing::warn!(path = %path.display(), mode = format!("{:o}", m.mode() & 0o777),
                        "the data directory can be written by other users; make it private (chmod 700)");
                }
            }
        }
        #[cfg(not(unix))]
        let _ = path;
    }

    /// Removes the directories of secondaries whose process is gone (an
    /// inspection command of an older build, which followed the writer as a
    /// RocksDB secondary, killed before it could remove its own), in
    /// `scratch` (if there is one), in the temp dir and in the old scratch
    /// directory (if it is one private to this user).
    pub(super) fn remove_dead_secondaries(scratch: Option<&Path>) {
        let old = std::env::temp_dir();
        let uid = user_id();
        let old_scratch = old.join(format!("{OLD_SCRATCH_PREFIX}{uid}"));
        let old_scratch = private_to_us(&old_scratch, uid).then_some(old_scratch);
        for (dir, prefix) in [
            (scratch, SECONDARY_PREFIX),
            (Some(old.as_path()), OLD_SECONDARY_PREFIX),
            (old_scratch.as_deref(), SECONDARY_PREFIX),
        ] {
            let Some(dir) = dir else {
                continue;
            };
            let Ok(entries) = std::fs::read_dir(dir) else {
                continue;
            };
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                let Some(pid) = name
                    .strip_prefix(prefix)
                    .and_then(|rest| rest.split('-').next())
                else {
                    continue;
                };
                if !process_alive(pid) {
                    let _ = std::fs::remove_dir_all(entry.path());
                }
            }
        }
    }

    /// Whether `dir` holds only files RocksDB writes while it creates a
    /// database (and at least one), no CURRENT among them.
    fn rocksdb_debris_only(dir: &Path) -> Result<bool> {
        let mut any = false;
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            if !entry.file_type()?.is_file() {
                return Ok(false);
            }
            let name = entry.file_name().to_string_lossy().into_owned();
            let debris = name == "LOCK"
                || name == "IDENTITY"
                || name.starts_with("LOG")
                || name.starts_with("MANIFEST-")
                || name.starts_with("OPTIONS-")
                || name.ends_with(".log")
                || name.ends_with(".dbtmp");
            if !debris {
                return Ok(false);
            }
            any = true;
        }
        Ok(any)
    }

    /// Whether the process `pid` runs; `true` when that cannot be told (a
    /// leftover is then kept, never removed from under a live creation).
    fn process_alive(pid: &str) -> bool {
        if pid.parse::<u32>().is_err() {
            return true;
        }
        let proc_root = Path::new("/proc");
        !proc_root.join("self").exists() || proc_root.join(pid).exists()
    }

    /// Whether a RocksDB directory lacking keel's metadata family is one a
    /// killed creation of an older build left behind: every family it has
    /// is one of keel's (or RocksDB's default), and none holds a key.
    pub(super) fn unfinished(path: &Path, families: &[String]) -> Result<bool> {
        if families.iter().any(|n| n == Cf::Meta.name()) {
            return Ok(false);
        }
        let keel = |n: &String| n == "default" || Cf::ALL.iter().any(|c| c.name() == n);
        if !families.iter().all(keel) {
            return Ok(false);
        }
        let opts = Options::default();
        let db = DB::open_cf_for_read_only(&opts, path, families, false)
            .map_err(|e| map_open_error(path, e))?;
        for n in families {
            let Some(cf) = db.cf_handle(n) else {
                return Ok(false);
            };
            if db
                .iterator_cf(&cf, rocksdb::IteratorMode::Start)
                .next()
                .is_some()
            {
                return Ok(false);
            }
        }
        tracing::warn!(path = %path.display(),
            "completing a data directory whose creation was interrupted (it holds no data)");
        Ok(true)
    }

    /// Creates `dir` readable by its owner only: it will hold every
    /// workflow's inputs and results.
    fn create_private_dir(dir: &PathBuf) -> std::io::Result<()> {
        let mut builder = std::fs::DirBuilder::new();
        #[cfg(unix)]
        {
            use std::os::unix::fs::DirBuilderExt;
            builder.mode(0o700);
        }
        builder.create(dir)
    }

    /// Makes the files in `dir` readable by their owner only. RocksDB
    /// creates files with the process umask; a read-write open tightens
    /// every file there is, and the directory's 0700 keeps files made
    /// later private too (a process with umask 077 makes them 0600 from
    /// the start).
    pub(super) fn make_files_private(dir: &Path) -> Result<()> {
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            for entry in std::fs::read_dir(dir)? {
                let entry = entry?;
                if entry.file_type()?.is_file() {
                    std::fs::set_permissions(entry.path(), std::fs::Permissions::from_mode(0o600))?;
                }
            }
        }
        #[cfg(not(unix))]
        let _ = dir;
        Ok(())
    }

    fn sync_dir(dir: &Path) -> Result<()> {
        std::fs::File::open(dir)?.sync_all()?;
        Ok(())
    }
}

/// Copying a directory another process writes (see
/// [`RocksStore::copy_live`]).
mod live_copy {
    use std::path::{Path, PathBuf};

    use super::*;

    /// The MANIFEST that CURRENT names and its length now.
    fn manifest_state(dir: &Path) -> Result<(String, u64)> {
        let current = std::fs::read_to_string(dir.join("CURRENT"))?;
        let name = current.trim().to_string();
        let len = std::fs::metadata(dir.join(&name))?.len();
        Ok((name, len))
    }

    /// Reads the first `len` bytes of `from` into a new file `to`.
    fn copy_prefix(from: &Path, to: &Path, len: u64) -> std::io::Result<()> {
        use std::io::{Read, Write};
        let mut bytes = Vec::new();
        std::fs::File::open(from)?
            .take(len)
            .read_to_end(&mut bytes)?;
        let mut out = std::fs::File::create(to)?;
        out.write_all(&bytes)?;
        out.sync_all()
    }

    fn copy_synced(from: &Path, to: &Path) -> std::io::Result<()> {
        std::fs::copy(from, to)?;
        std::fs::File::open(to)?.sync_all()
    }

    /// One attempt: `Ok(false)` when the writer changed the directory
    /// meanwhile.
    fn attempt(src: &Path, tmp: &Path) -> Result<bool> {
        let (manifest, len) = manifest_state(src)?;
        copy_prefix(&src.join(&manifest), &tmp.join(&manifest), len)?;
        for entry in std::fs::read_dir(src)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let (from, to) = (entry.path(), tmp.join(&name));
            let copied = if name.ends_with(".sst") {
                std::fs::hard_link(&from, &to).or_else(|_| copy_synced(&from, &to))
            } else if name.ends_with(".log") || name.starts_with("OPTIONS-") || name == "IDENTITY" {
                copy_synced(&from, &to)
            } else {
                // LOCK, RocksDB's info LOG, older MANIFESTs, CURRENT (written
                // below), keel's acknowledged-commit record (the copy's own
                // starts when it is first opened).
                continue;
            };
            match copied {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
                Err(e) => return Err(e.into()),
            }
        }
        let mut current = std::fs::File::create(tmp.join("CURRENT"))?;
        std::io::Write::write_all(&mut current, format!("{manifest}\n").as_bytes())?;
        current.sync_all()?;
        Ok(manifest_state(src)? == (manifest, len))
    }

    pub(super) fn copy(src: &Path, dest: &Path) -> Result<()> {
        if dest.exists() {
            return Err(Error::Io(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                format!("{} already exists", dest.display()),
            )));
        }
        if !src.join("CURRENT").exists() {
            return Err(Error::NotFound {
                path: src.to_path_buf(),
            });
        }
        let name = dest
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "copy".into());
        let parent = match dest.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&parent)?;
        let tmp = parent.join(format!(".{name}.keel-copying.{}", std::process::id()));
        for _ in 0..LIVE_COPY_ATTEMPTS_MAX {
            if tmp.exists() {
                std::fs::remove_dir_all(&tmp)?;
            }
            std::fs::DirBuilder::new().create(&tmp)?;
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o700))?;
            }
            match attempt(src, &tmp) {
                Ok(true) => {
                    std::fs::File::open(&tmp)?.sync_all()?;
                    std::fs::rename(&tmp, dest)?;
                    std::fs::File::open(&parent)?.sync_all()?;
                    return Ok(());
                }
                Ok(false) => {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                Err(e) => {
                    let _ = std::fs::remove_dir_all(&tmp);
                    return Err(e);
                }
            }
        }
        let _ = std::fs::remove_dir_all(&tmp);
        Err(Error::Io(std::io::Error::other(format!(
            "the engine changed {} during each of {LIVE_COPY_ATTEMPTS_MAX} copies (flushes or compactions); try again",
            src.display()
        ))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal: a reader's open retries exactly the failures a live writer
    /// causes for a moment. Method: RocksDB's own text for a write-ahead
    /// log deleted under a read-only open (seen in CI beside a writing
    /// engine) is retried; a missing directory, damage and a lock are not.
    #[test]
    fn a_reader_retries_only_what_a_writer_causes() {
        let vanished = Error::Rocks(
            "IO error: No such file or directory: while stat a file for size: /tmp/d/000009.log: No such file or directory".into(),
        );
        assert!(raced_by_writer(&vanished));
        assert!(!raced_by_writer(&Error::Rocks(
            "Corruption: block checksum mismatch".into()
        )));
        assert!(!raced_by_writer(&Error::Locked {
            path: "/tmp/d".into()
        }));
        assert!(!raced_by_writer(&Error::NotFound {
            path: "/tmp/d".into()
        }));
    }

    /// Goal: the events family's memtable keeps a hint per run, and only
    /// per run. Method: the hinted prefix's length is checked against an
    /// events key (it must be exactly the run id, or hints would be kept
    /// per event or shared by unrelated runs), then a store is opened and
    /// the options RocksDB recorded for it are read back: a typo in the
    /// option, or an option this RocksDB dropped, opens without hints and
    /// only warns, so nothing else would notice.
    #[test]
    fn events_are_inserted_with_a_hint_per_run() {
        let prefix: usize = EVENTS_INSERT_HINTS
            .rsplit('.')
            .next()
            .and_then(|n| n.parse().ok())
            .expect("a fixed prefix length");
        let run = RunId::new_random();
        let key = crate::keys::event_key_array(run, Seq(7));
        assert_eq!(&key[..prefix], run.as_bytes());
        assert_eq!(crate::keys::run_prefix(&key[..prefix]), Some(run));

        let dir = tempfile::tempdir().expect("a temporary directory");
        let text = recorded_options(&dir.path().join("data"));
        let section = |name: &str| options_section(&text, &format!("[CFOptions \"{name}\"]"));
        assert!(section("events").contains(&EVENTS_INSERT_HINTS.to_string()));
        for other in Cf::ALL.iter().filter(|c| **c != Cf::Events) {
            let lines = section(other.name());
            assert!(
                !lines.is_empty(),
                "{} has its options recorded",
                other.name()
            );
            assert!(
                lines
                    .iter()
                    .any(|l| l == "memtable_insert_with_hint_prefix_extractor=nullptr"),
                "{} keeps no hints: {lines:?}",
                other.name()
            );
        }
    }

    /// Goal: a write and sync that does not return (a hung disk) shows in
    /// the store's health once it has taken `STORE_WRITE_STALL_MS`, also
    /// when it holds a committer's own thread, and the next group that
    /// returns clears it. Method: this kernel offers no way to hang a
    /// real disk (no device-mapper), so the writer's mark is set as a
    /// group begun that long ago leaves it; the health must say
    /// `Stalled`; then an empty commit goes through the writer, and the
    /// health must be healthy again.
    #[test]
    fn a_write_that_does_not_return_is_reported_stalled() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let store = RocksStore::open(dir.path(), Durability::Sync).expect("a new store");
        assert!(store.health().is_healthy());
        let shared = store.tx.as_ref().map(|(_, s)| s.clone()).expect("a writer");
        let begun = wall_ms() - STORE_WRITE_STALL_MS - 1_000;
        shared.writing_since_ms.store(begun, Ordering::Release);
        assert!(
            matches!(
                store.health(),
                StoreHealth::Stopped {
                    fault: WriteFault::Stalled,
                    ..
                }
            ),
            "{:?}",
            store.health()
        );
        // A group begun just now is not stalled.
        shared.writing_since_ms.store(wall_ms(), Ordering::Release);
        assert!(store.health().is_healthy());
        shared.writing_since_ms.store(begun, Ordering::Release);
        store
            .commit(crate::derive::CommitBatch::default())
            .wait()
            .expect("an empty commit");
        assert!(store.health().is_healthy(), "{:?}", store.health());
    }

    /// The options RocksDB recorded (its newest `OPTIONS` file) for a new
    /// store it opens and closes at `path`, as text.
    fn recorded_options(path: &Path) -> String {
        RocksStore::open(path, Durability::Sync)
            .expect("a new store")
            .close()
            .expect("closed");
        let mut recorded: Vec<_> = std::fs::read_dir(path)
            .expect("the data directory")
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("OPTIONS-"))
            })
            .collect();
        recorded.sort();
        std::fs::read_to_string(recorded.last().expect("an OPTIONS file"))
            .expect("the options RocksDB recorded")
    }

    /// The trimmed lines of the section of `text` headed `header`.
    fn options_section(text: &str, header: &str) -> Vec<String> {
        text.lines()
            .skip_while(|l| l.trim() != header)
            .skip(1)
            .take_while(|l| !l.starts_with('['))
            .map(|l| l.trim().to_string())
            .collect()
    }

    /// Goal: the events family's tables have blocks of
    /// `EVENTS_BLOCK_BYTES`, every other family RocksDB's default, and they
    /// still read through the one block cache. Method: a new store is
    /// opened; the table options RocksDB recorded for each family give the
    /// block sizes (a size set on a table factory the family does not use
    /// would fail nothing else), and RocksDB's log, which prints the
    /// options of the first ten families it opens, gives each of those its
    /// cache's address (a second cache made by the way would double the
    /// memory the cache's limit promises).
    #[test]
    fn event_tables_have_larger_blocks_and_share_the_cache() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("data");
        let recorded = recorded_options(&path);
        let block_size = |family: &str| {
            options_section(
                &recorded,
                &format!("[TableOptions/BlockBasedTable \"{family}\"]"),
            )
            .into_iter()
            .find_map(|l| l.strip_prefix("block_size=").map(str::to_string))
            .unwrap_or_else(|| panic!("{family} has its table options recorded"))
        };
        assert_eq!(
            block_size(Cf::Events.name()),
            EVENTS_BLOCK_BYTES.to_string()
        );
        for other in Cf::ALL.iter().filter(|c| **c != Cf::Events) {
            assert_eq!(block_size(other.name()), "4096", "{}", other.name());
        }

        let log = std::fs::read_to_string(path.join("LOG")).expect("RocksDB's log");
        let mut caches = Vec::new();
        let mut family = None;
        for line in log.lines() {
            if let Some(rest) = line.split("Options for column family [").nth(1) {
                family = rest.split(']').next().map(str::to_string);
            } else if let Some(cache) = line.trim().strip_prefix("block_cache: ") {
                if let Some(f) = family.take() {
                    caches.push((f, cache.to_string()));
                }
            }
        }
        assert!(
            caches.iter().any(|(f, _)| f == Cf::Events.name()) && caches.len() >= 3,
            "the log names the caches of events and others: {caches:?}"
        );
        assert!(
            caches.iter().all(|(_, c)| *c == caches[0].1),
            "one cache: {caches:?}"
        );
    }
}
