//! The acknowledged-commit record: how far commits were acknowledged, kept
//! in a file of its own (`KEEL-ACKED`) beside the log, so that damage that
//! takes the log's tail along (a write-ahead log truncated at a record
//! boundary, a directory restored from an older copy, a disk that dropped
//! writes it had confirmed) cannot take this record with it.
//!
//! The writer publishes RocksDB's last sequence number after every synced
//! group; a thread of the store writes it at most every
//! [`ACKED_RECORD_INTERVAL_MS`] and once more at close. An open compares
//! it with the sequence the log recovered to: a log that ends before the
//! record lost acknowledged commits, and the open fails with
//! [`Error::LostCommits`] instead of carrying on without them. The record
//! lags the acknowledgements by at most the interval, so a loss of only
//! the commits of the last interval before a crash is not detected; every
//! older one is.
//!
//! Format: two 24-byte slots written alternately, each `KACK`, a write
//! counter (u64 LE), the sequence (u64 LE) and a CRC32C of the 20 bytes
//! before it; a read takes the valid slot with the higher counter, so a
//! write torn by a crash leaves the other one.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::error::{Error, Result};

/// The file's name in a data directory.
pub const ACKED_FILE: &str = "KEEL-ACKED";

/// Longest time between two writes of the record while commits are made.
pub const ACKED_RECORD_INTERVAL_MS: u64 = 100;

const MAGIC: &[u8; 4] = b"KACK";
const SLOT_BYTES: usize = 24;

/// Reads the record: the highest acknowledged sequence, if any was kept.
pub fn read(dir: &Path) -> Result<Option<u64>> {
    Ok(newest_slot(dir)?.map(|(_, seq)| seq))
}

/// The valid slot with the higher write counter: (counter, sequence).
fn newest_slot(dir: &Path) -> Result<Option<(u64, u64)>> {
    let mut bytes = Vec::new();
    match File::open(dir.join(ACKED_FILE)) {
        Ok(mut f) => {
            f.read_to_end(&mut bytes)?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    Ok(bytes
        .chunks_exact(SLOT_BYTES)
        .take(2)
        .filter_map(decode_slot)
        .max_by_key(|(counter, _)| *counter))
}

fn decode_slot(slot: &[u8]) -> Option<(u64, u64)> {
    if &slot[..4] != MAGIC {
        return None;
    }
    let crc = u32::from_le_bytes(slot[20..24].try_into().ok()?);
    if crc32c::crc32c(&slot[..20]) != crc {
        return None;
    }
    let counter = u64::from_le_bytes(slot[4..12].try_into().ok()?);
    let seq = u64::from_le_bytes(slot[12..20].try_into().ok()?);
    Some((counter, seq))
}

fn encode_slot(counter: u64, seq: u64) -> [u8; SLOT_BYTES] {
    let mut slot = [0u8; SLOT_BYTES];
    slot[..4].copy_from_slice(MAGIC);
    slot[4..12].copy_from_slice(&counter.to_le_bytes());
    slot[12..20].copy_from_slice(&seq.to_le_bytes());
    let crc = crc32c::crc32c(&slot[..20]);
    slot[20..24].copy_from_slice(&crc.to_le_bytes());
    slot
}

/// Writes records into a directory's file.
#[derive(Debug)]
pub struct AckedFile {
    file: File,
    counter: u64,
    written: u64,
}

impl AckedFile {
    /// Opens (creating) the directory's record, starting from `seq`.
    pub fn open(dir: &Path, seq: u64) -> Result<AckedFile> {
        let path = dir.join(ACKED_FILE);
        let created = !path.exists();
        let mut options = OpenOptions::new();
        options.read(true).write(true).create(true).truncate(false);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            options.mode(0o600);
        }
        let file = options.open(&path)?;
        let newest = newest_slot(dir)?;
        let mut me = AckedFile {
            file,
            counter: newest.map_or(0, |(counter, _)| counter),
            written: 0,
        };
        if newest.map(|(_, s)| s) != Some(seq) {
            me.write(seq)?;
            if created {
                File::open(dir)?.sync_all()?;
            }
        }
        me.written = seq;
        Ok(me)
    }

    /// Records `seq` durably (never lower than what was recorded: a record
    /// only grows).
    pub fn write(&mut self, seq: u64) -> Result<()> {
        self.counter += 1;
        let offset = (self.counter % 2) * SLOT_BYTES as u64;
        self.file.seek(SeekFrom::Start(offset))?;
        self.file.write_all(&encode_slot(self.counter, seq))?;
        self.file.sync_data()?;
        self.written = seq;
        Ok(())
    }
}

/// The thread that keeps a directory's record up to date while a writer
/// acknowledges commits.
#[derive(Debug)]
pub(crate) struct AckedKeeper {
    acked: Arc<AtomicU64>,
    stop: Option<crossbeam_channel::Sender<()>>,
    thread: Option<JoinHandle<()>>,
    path: PathBuf,
}

impl AckedKeeper {
    /// Starts keeping `dir`'s record from `seq` (the sequence the log
    /// recovered to).
    pub(crate) fn start(dir: &Path, seq: u64) -> Result<AckedKeeper> {
        let mut file = AckedFile::open(dir, seq)?;
        let acked = Arc::new(AtomicU64::new(seq));
        let (stop, stopped) = crossbeam_channel::bounded::<()>(1);
        let shared = acked.clone();
        let path = dir.to_path_buf();
        let log_path = path.clone();
        let thread = std::thread::Builder::new()
            .name("keel-acked".into())
            .spawn(move || loop {
                let done = !matches!(
                    stopped.recv_timeout(Duration::from_millis(ACKED_RECORD_INTERVAL_MS)),
                    Err(crossbeam_channel::RecvTimeoutError::Timeout)
                );
                let seq = shared.load(Ordering::Acquire);
                if seq > file.written {
                    if let Err(e) = file.write(seq) {
                        tracing::error!(path = %log_path.display(), error = %e,
                            "cannot write the acknowledged-commit record; open cannot detect a lost log tail until it can");
                    }
                }
                if done {
                    return;
                }
            })?;
        Ok(AckedKeeper {
            acked,
            stop: Some(stop),
            thread: Some(thread),
            path,
        })
    }

    /// The sequence the writer publishes after each synced group.
    pub(crate) fn handle(&self) -> Arc<AtomicU64> {
        self.acked.clone()
    }

    /// Writes the last record and stops.
    pub(crate) fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!(path = %self.path.display(), "the acknowledged-commit record's thread panicked");
            }
        }
    }
}

impl Drop for AckedKeeper {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Fails when the log recovered to `found` but commits up to the record
/// were acknowledged.
pub(crate) fn check(path: &Path, recorded: Option<u64>, found: u64) -> Result<()> {
    match recorded {
        Some(acknowledged) if found < acknowledged => Err(Error::LostCommits {
            path: path.to_path_buf(),
            acknowledged,
            found,
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    // Goal: the record survives a torn write and only reports what was
    // written whole. Method: write records, damage the newer slot, read.
    use super::*;

    #[test]
    fn the_newer_whole_slot_wins_and_a_torn_one_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read(dir.path()).unwrap(), None);
        let mut f = AckedFile::open(dir.path(), 5).unwrap();
        assert_eq!(read(dir.path()).unwrap(), Some(5));
        f.write(9).unwrap();
        f.write(12).unwrap();
        assert_eq!(read(dir.path()).unwrap(), Some(12));
        // Tear the slot holding 12: the one holding 9 is read.
        let path = dir.path().join(ACKED_FILE);
        let mut bytes = std::fs::read(&path).unwrap();
        let newer = (f.counter % 2) as usize * SLOT_BYTES;
        bytes[newer + 15] ^= 0xff;
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(read(dir.path()).unwrap(), Some(9));
        assert!(check(dir.path(), Some(9), 8).is_err());
        assert!(check(dir.path(), Some(9), 9).is_ok());
        assert!(check(dir.path(), None, 0).is_ok());
    }
}
