//! Reading RocksDB's write-ahead log files ourselves, to say where one is
//! damaged and which commits the damage hides.
//!
//! RocksDB's own message for a damaged log names neither the file nor the
//! offset ("Corruption: checksum mismatch"), and a recovery that keeps the
//! prefix before the damage cannot say what it dropped. This module walks
//! the log format (32 KiB blocks of records: a masked CRC32C over the type
//! and payload, a 16-bit length, a type; a batch may span fragments) and
//! the write batches inside (a sequence number, a count, then puts and
//! deletes), finds the first record that fails its checksum, and keeps
//! scanning past it (at the next record, or from the next block when the
//! length is bad too) for the batches that follow: the events in those are
//! the commits a point-in-time recovery loses.
//!
//! Only reading; nothing here writes a log. Anything it does not recognise
//! ends the scan of that file with a note rather than a guess.

use std::path::{Path, PathBuf};

use crate::codec::{self, RecordKind};
use crate::ids::{RunId, Seq};
use crate::keys;

const BLOCK_BYTES: usize = 32 * 1024;
const HEADER_BYTES: usize = 7;
const RECYCLABLE_HEADER_BYTES: usize = 11;

/// Where a log file first fails its checks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WalDamage {
    /// Byte offset of the first bad record.
    pub offset: u64,
    /// What is wrong there.
    pub what: String,
}

/// One write batch read from a log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WalBatch {
    /// Offset of the record that starts it.
    pub offset: u64,
    /// Its first RocksDB sequence number.
    pub sequence: u64,
    /// Entries it holds.
    pub count: u32,
    /// The history events among them (run, seq).
    pub events: Vec<(RunId, Seq)>,
    /// Whether it comes after the damage (lost to a recovery that keeps
    /// the prefix).
    pub after_damage: bool,
}

/// What a scan of one log file found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WalScan {
    /// The file.
    pub file: PathBuf,
    /// Its size.
    pub bytes: u64,
    /// The first damage, if any (a torn last record is not damage).
    pub damage: Option<WalDamage>,
    /// Every batch read whole, in order.
    pub batches: Vec<WalBatch>,
}

impl WalScan {
    /// The batches after the damage.
    pub fn lost(&self) -> impl Iterator<Item = &WalBatch> {
        self.batches.iter().filter(|b| b.after_damage)
    }
}

/// The log files of a data directory, oldest first.
pub fn log_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut logs: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let number = name.strip_suffix(".log")?.parse::<u64>().ok()?;
            Some((number, e.path()))
        })
        .collect();
    logs.sort();
    Ok(logs.into_iter().map(|(_, p)| p).collect())
}

/// Scans every log file of a directory, oldest first.
pub fn scan_dir(dir: &Path) -> std::io::Result<Vec<WalScan>> {
    log_files(dir)?.into_iter().map(|f| scan_file(&f)).collect()
}

/// Scans one log file.
pub fn scan_file(path: &Path) -> std::io::Result<WalScan> {
    let bytes = std::fs::read(path)?;
    let mut scan = WalScan {
        file: path.to_path_buf(),
        bytes: bytes.len() as u64,
        damage: None,
        batches: Vec::new(),
    };
    // Past the last non-zero byte nothing was written (preallocated or
    // never reached).
    let written = bytes.iter().rposition(|b| *b != 0).map_or(0, |i| i + 1);
    let mut pos = 0usize;
    // A batch being assembled from fragments: (offset, payload).
    let mut partial: Option<(usize, Vec<u8>)> = None;
    while pos < bytes.len() {
        let block_left = BLOCK_BYTES - pos % BLOCK_BYTES;
        if block_left < HEADER_BYTES {
            pos += block_left; // the block's zero trailer
            continue;
        }
        let rest = &bytes[pos..];
        if rest.len() < HEADER_BYTES {
            break; // a header torn by a crash
        }
        if rest[..HEADER_BYTES].iter().all(|b| *b == 0) {
            if pos >= written {
                break; // nothing written past here
            }
            damaged(
                &mut scan,
                pos,
                "zeroed bytes inside the log".into(),
                &mut partial,
            );
            pos += block_left;
            continue;
        }
        let masked = u32::from_le_bytes(rest[..4].try_into().expect("4 bytes"));
        let length = usize::from(u16::from_le_bytes([rest[4], rest[5]]));
        let kind = rest[6];
        let header = if matches!(kind, 5..=8 | 11 | 131) {
            RECYCLABLE_HEADER_BYTES
        } else {
            HEADER_BYTES
        };
        if header + length > block_left {
            let what = format!("a record of {length} bytes crosses its 32 KiB block");
            damaged(&mut scan, pos, what, &mut partial);
            pos += block_left;
            continue;
        }
        if header + length > rest.len() {
            break; // the last record, torn by a crash
        }
        let covered = &rest[6..header + length];
        if unmask(masked) != crc32c::crc32c(covered) {
            // Most damage is a flipped byte in the payload: the length
            // still leads to the next record, whose own checksum tells
            // whether the scan is back in step (if not, the same happens
            // there, and a bad length ends in the next block).
            damaged(&mut scan, pos, "checksum mismatch".into(), &mut partial);
            pos += header + length;
            continue;
        }
        let payload = &rest[header..header + length];
        let after = scan.damage.is_some();
        match kind {
            1 | 5 => {
                partial = None;
                batch(&mut scan, pos, payload, after);
            }
            2 | 6 => {
                if partial.is_some() {
                    damaged(
                        &mut scan,
                        pos,
                        "a batch starts before the previous one ended".into(),
                        &mut partial,
                    );
                }
                partial = Some((pos, payload.to_vec()));
            }
            3 | 7 => match &mut partial {
                Some((_, p)) => p.extend_from_slice(payload),
                None => damaged(
                    &mut scan,
                    pos,
                    "a fragment without its start".into(),
                    &mut partial,
                ),
            },
            4 | 8 => match partial.take() {
                Some((start, mut p)) => {
                    p.extend_from_slice(payload);
                    batch(&mut scan, start, &p, after);
                }
                None => damaged(
                    &mut scan,
                    pos,
                    "a fragment without its start".into(),
                    &mut partial,
                ),
            },
            // Metadata records (compression, timestamp sizes, the previous
            // log's description) and ignorable types carry no commits.
            _ => {}
        }
        pos += header + length;
    }
    Ok(scan)
}

fn damaged(scan: &mut WalScan, pos: usize, what: String, partial: &mut Option<(usize, Vec<u8>)>) {
    *partial = None;
    if scan.damage.is_none() {
        scan.damage = Some(WalDamage {
            offset: pos as u64,
            what,
        });
    }
}

/// RocksDB stores CRCs masked (rotated and offset) so that a CRC of data
/// holding CRCs stays strong.
fn unmask(masked: u32) -> u32 {
    let rot = masked.wrapping_sub(0xa282_ead8);
    rot.rotate_left(15)
}

fn batch(scan: &mut WalScan, offset: usize, rep: &[u8], after_damage: bool) {
    if rep.len() < 12 {
        return;
    }
    let sequence = u64::from_le_bytes(rep[..8].try_into().expect("8 bytes"));
    let count = u32::from_le_bytes(rep[8..12].try_into().expect("4 bytes"));
    let mut events = Vec::new();
    let mut r = Reader(&rep[12..]);
    while !r.0.is_empty() {
        let Some(tag) = r.byte() else { break };
        let has_cf = matches!(tag, 0x4 | 0x5 | 0x6 | 0x8 | 0xE);
        if has_cf && r.varint().is_none() {
            break;
        }
        match tag {
            // Put: the events family's puts are history events.
            0x1 | 0x5 => {
                let (Some(key), Some(value)) = (r.slice(), r.slice()) else {
                    break;
                };
                if key.len() == 24 && codec::open(RecordKind::Event, value).is_ok() {
                    if let Some(id) = keys::parse_event_key(key) {
                        events.push(id);
                    }
                }
            }
            0x0 | 0x4 | 0x7 | 0x8 => {
                if r.slice().is_none() {
                    break;
                }
            }
            0x2 | 0x6 | 0xE | 0xF => {
                if r.slice().is_none() || r.slice().is_none() {
                    break;
                }
            }
            0x3 => {
                if r.slice().is_none() {
                    break;
                }
            }
            0xD => {}
            _ => break, // not a kind keel writes
        }
    }
    scan.batches.push(WalBatch {
        offset: offset as u64,
        sequence,
        count,
        events,
        after_damage,
    });
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn byte(&mut self) -> Option<u8> {
        let (b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(*b)
    }

    fn varint(&mut self) -> Option<u32> {
        let mut value = 0u32;
        for shift in (0..35).step_by(7) {
            let b = self.byte()?;
            value |= u32::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Some(value);
            }
        }
        None
    }

    fn slice(&mut self) -> Option<&'a [u8]> {
        let len = self.varint()? as usize;
        if len > self.0.len() {
            return None;
        }
        let (s, rest) = self.0.split_at(len);
        self.0 = rest;
        Some(s)
    }
}

/// Describes the first damage in a directory's logs for an error message:
/// the file, the offset and what follows it.
pub fn describe_damage(dir: &Path) -> Option<String> {
    describe(&scan_dir(dir).ok()?)
}

/// [`describe_damage`] for logs already scanned.
pub fn describe(scans: &[WalScan]) -> Option<String> {
    let scan = scans.iter().find(|s| s.damage.is_some())?;
    let damage = scan.damage.as_ref()?;
    let lost: Vec<&WalBatch> = scan.lost().collect();
    let events: usize = lost.iter().map(|b| b.events.len()).sum();
    Some(format!(
        "write-ahead log {} is damaged at byte {} of {} ({}); {} commits ({} history events) follow the damage",
        scan.file.display(),
        damage.offset,
        scan.bytes,
        damage.what,
        lost.len(),
        events
    ))
}

#[cfg(test)]
mod tests {
    // Goal: the scanner reads back what RocksDB wrote, never panics on
    // damaged bytes, calls a cut log a torn tail (not damage) and keeps
    // every batch before a damaged byte. Method: one real log written by
    // RocksDB, then random cuts and random flipped bytes (proptest).
    use std::sync::OnceLock;

    use proptest::prelude::*;

    use super::*;

    /// A real log: 200 batches of one put each in a column family.
    fn real_log() -> &'static (Vec<u8>, WalScan) {
        static LOG: OnceLock<(Vec<u8>, WalScan)> = OnceLock::new();
        LOG.get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            {
                let mut opts = rocksdb::Options::default();
                opts.create_if_missing(true);
                opts.create_missing_column_families(true);
                let db = rocksdb::DB::open_cf(&opts, dir.path(), ["default", "events"]).unwrap();
                let cf = db.cf_handle("events").unwrap();
                for i in 0..200u32 {
                    let mut b = rocksdb::WriteBatch::default();
                    b.put_cf(&cf, i.to_be_bytes(), vec![i as u8; 300]);
                    db.write(b).unwrap();
                }
            }
            let file = log_files(dir.path()).unwrap().pop().unwrap();
            let bytes = std::fs::read(&file).unwrap();
            let scan = scan_file(&file).unwrap();
            (bytes, scan)
        })
    }

    fn scan_bytes(bytes: &[u8]) -> WalScan {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("000001.log");
        std::fs::write(&file, bytes).unwrap();
        scan_file(&file).unwrap()
    }

    #[test]
    fn reads_back_every_batch_rocksdb_wrote() {
        let (_, scan) = real_log();
        assert_eq!(scan.damage, None);
        assert_eq!(scan.batches.len(), 200);
        assert!(scan
            .batches
            .windows(2)
            .all(|w| w[1].sequence == w[0].sequence + 1));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn a_cut_log_is_a_torn_tail_holding_a_prefix(cut in 0usize..100_000) {
            let (bytes, full) = real_log();
            let cut = cut % bytes.len();
            let scan = scan_bytes(&bytes[..cut]);
            prop_assert_eq!(scan.damage, None);
            prop_assert!(scan.batches.len() <= full.batches.len());
            prop_assert_eq!(&scan.batches[..], &full.batches[..scan.batches.len()]);
        }

        #[test]
        fn a_flipped_byte_is_found_and_what_precedes_it_is_kept(at in 0usize..100_000, bit in 0u8..8) {
            let (bytes, full) = real_log();
            let at = at % bytes.len();
            let mut damaged = bytes.clone();
            damaged[at] ^= 1 << bit;
            let scan = scan_bytes(&damaged);
            let before: Vec<&WalBatch> = full
                .batches
                .iter()
                .filter(|b| (b.offset as usize) + 7 + 400 < at)
                .collect();
            for b in &before {
                prop_assert!(scan.batches.contains(b));
            }
                if let Some(d) = &scan.damage {
                prop_assert!(d.offset as usize <= at);
            }
            // A flipped byte inside the records (not in a block's zero
            // trailer, not past the last record) is always found.
            let last = full.batches.last().map_or(0, |b| b.offset as usize);
            let in_trailer = BLOCK_BYTES - at % BLOCK_BYTES < HEADER_BYTES;
            if at < last && !in_trailer {
                prop_assert!(scan.damage.is_some(), "a flip at {} went unnoticed", at);
            }
        }
    }
}
