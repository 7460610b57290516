//! Whether a store accepts writes: the state the writer keeps after a
//! write failed, and what the engine reads to tell its clients.
//!
//! A write that fails (a full disk, an I/O error, corruption found by a
//! flush or compaction) stops the store: every commit in flight and every
//! later one fails with [`Error::Unwritable`] naming the cause, until the
//! cause is gone. A stop is either waited out (no space: the store probes
//! and resumes once space is freed) or final (corruption, or an I/O error
//! that outlasts [`STORE_IO_RECOVERY_MS_MAX`]: RocksDB resumes by itself
//! only from errors it deems retryable, so most I/O errors need a restart
//! once the disk is fixed): the engine then shuts down and the process
//! should exit non-zero. Nothing acknowledged is lost either way: a commit
//! is acknowledged only after its write returned.

use std::fmt;

use parking_lot::Mutex;

use crate::error::Error;

/// How often a stopped store probes whether it can write again.
pub const STORE_PROBE_INTERVAL_MS: u64 = 250;

/// How long a stopped store keeps probing after an I/O error (other than a
/// full disk) before it gives up for good.
pub const STORE_IO_RECOVERY_MS_MAX: u64 = 60_000;

/// How often a store that stays stopped logs that it still is.
pub const STORE_STOPPED_LOG_INTERVAL_MS: u64 = 30_000;

/// How long a group's write and sync may take before the store reports
/// itself stalled ([`WriteFault::Stalled`]) until it returns: a hung disk
/// holds the thread that writes, which may be a committer's own (a commit
/// written in place), so the engine's own check of its commits cannot see
/// it there.
pub const STORE_WRITE_STALL_MS: u64 = 10_000;

/// What stopped a store's writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum WriteFault {
    /// The file system is full; writes resume once space is freed.
    NoSpace,
    /// The file system reported an I/O error.
    Io,
    /// A flush or compaction found damaged data.
    Corruption,
    /// Another engine process took over the database's write lease (this
    /// one paused, or lost the database, for longer than the lease).
    Fenced,
    /// The database cannot be reached (stopped, restarting, or the network
    /// is down); commits resume once it answers again.
    Unreachable,
    /// A commit has gone unanswered for longer than the engine allows (a
    /// hung disk, a database that holds the connection and answers
    /// nothing); commits resume once it is answered.
    Stalled,
}

impl WriteFault {
    /// Classifies a RocksDB status message.
    pub fn of_message(text: &str) -> WriteFault {
        let lower = text.to_ascii_lowercase();
        if lower.contains("no space") || lower.contains("nospace") || lower.contains("enospc") {
            WriteFault::NoSpace
        } else if text.starts_with("Corruption") || lower.contains("corruption") {
            WriteFault::Corruption
        } else {
            WriteFault::Io
        }
    }

    /// Whether the store waits for the cause to go away rather than giving
    /// up at once.
    pub fn waits(self) -> bool {
        !matches!(self, WriteFault::Corruption | WriteFault::Fenced)
    }

    /// What an operator does about it.
    pub fn remedy(self) -> &'static str {
        match self {
            WriteFault::NoSpace => "free space on the data directory's file system (at least 64 MiB, one memtable); commits resume by themselves within seconds",
            WriteFault::Io => "check the disk and the kernel log; keel retries for 60 s (RocksDB resumes by itself only from errors it deems retryable), then stops: restart the engine once the disk is fixed",
            WriteFault::Corruption => "stop keel, keep a copy of the directory and run `keel verify`; restore from a checkpoint if it reports damage",
            WriteFault::Fenced => "another engine process owns the database now and carries on this one's work; restart this process and it waits as a standby",
            WriteFault::Unreachable => "check that the database runs and this machine reaches it; keel reconnects every second and commits resume by themselves (if the outage outlasts the write lease, a standby may take over and this process stops)",
            WriteFault::Stalled => "check the disk (a hung device, a full I/O queue, a network volume that lost its server) or the database (locks, a stuck server); commits resume by themselves once the one in flight is answered",
        }
    }
}

impl fmt::Display for WriteFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WriteFault::NoSpace => "no space left on device",
            WriteFault::Io => "I/O error",
            WriteFault::Corruption => "corruption",
            WriteFault::Fenced => "write lease lost",
            WriteFault::Unreachable => "database unreachable",
            WriteFault::Stalled => "commit stalled",
        })
    }
}

/// Whether a store accepts writes.
#[derive(Clone, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum StoreHealth {
    /// Commits are written.
    #[default]
    Healthy,
    /// Writes fail; the store waits for the cause to go away.
    Stopped {
        /// What stopped them.
        fault: WriteFault,
        /// The storage engine's message (names the file where it can).
        detail: String,
    },
    /// Writes failed for good; the engine shuts down.
    Failed {
        /// What stopped them.
        fault: WriteFault,
        /// The storage engine's message.
        detail: String,
    },
}

impl StoreHealth {
    /// Whether commits are written.
    pub fn is_healthy(&self) -> bool {
        matches!(self, StoreHealth::Healthy)
    }

    /// Whether writes failed for good.
    pub fn is_failed(&self) -> bool {
        matches!(self, StoreHealth::Failed { .. })
    }

    /// The error a commit gets in this state (`None` when healthy).
    pub fn error(&self) -> Option<Error> {
        match self {
            StoreHealth::Healthy => None,
            StoreHealth::Stopped { fault, detail } | StoreHealth::Failed { fault, detail } => {
                Some(Error::Unwritable {
                    fault: *fault,
                    detail: detail.clone(),
                })
            }
        }
    }
}

impl fmt::Display for StoreHealth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreHealth::Healthy => f.write_str("healthy"),
            StoreHealth::Stopped { fault, detail } => {
                write!(f, "writes stopped ({fault}: {detail}); {}", fault.remedy())
            }
            StoreHealth::Failed { fault, detail } => {
                write!(
                    f,
                    "writes failed for good ({fault}: {detail}); {}",
                    fault.remedy()
                )
            }
        }
    }
}

/// The health a store's writer publishes and its handles read.
#[derive(Debug, Default)]
pub struct HealthCell(Mutex<StoreHealth>);

impl HealthCell {
    /// The current state.
    pub fn get(&self) -> StoreHealth {
        self.0.lock().clone()
    }

    /// Replaces the state; returns the one before.
    pub fn set(&self, health: StoreHealth) -> StoreHealth {
        std::mem::replace(&mut *self.0.lock(), health)
    }
}

#[cfg(test)]
mod tests {
    // Goal: RocksDB's messages for the faults real disks have map to the
    // right kind. Method: classify the messages RocksDB 11 prints for each.
    use super::*;

    #[test]
    fn rocksdb_messages_are_classified() {
        assert_eq!(
            WriteFault::of_message(
                "IO error: No space left on device: While appending to file: /d/000009.log: No space left on device"
            ),
            WriteFault::NoSpace
        );
        assert_eq!(
            WriteFault::of_message("Corruption: block checksum mismatch: stored = 1, computed = 2"),
            WriteFault::Corruption
        );
        assert_eq!(
            WriteFault::of_message("IO error: While fsync: a file: Input/output error"),
            WriteFault::Io
        );
        assert!(WriteFault::NoSpace.waits() && !WriteFault::Corruption.waits());
    }
}
