//! The trace: one line per simulated step, hashed with FNV-1a 64 so that
//! two runs of the same seed on the same build can be compared by one
//! number. Lines are kept only when asked for (tests, `--trace`).

use std::fmt::{self, Write};

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// FNV-1a 64 of `bytes`, continuing from `hash`.
pub fn fnv1a(mut hash: u64, bytes: &[u8]) -> u64 {
    for b in bytes {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(FNV_PRIME);
    }
    hash
}

pub(crate) struct Trace {
    hash: u64,
    lines: Option<Vec<String>>,
    buf: String,
}

impl Trace {
    pub(crate) fn new(keep: bool) -> Self {
        Trace {
            hash: FNV_OFFSET,
            lines: keep.then(Vec::new),
            buf: String::with_capacity(128),
        }
    }

    /// Appends one line: `time` then the text.
    pub(crate) fn line(&mut self, now: u64, args: fmt::Arguments<'_>) {
        self.buf.clear();
        let _ = write!(self.buf, "{now:>9} ");
        let _ = self.buf.write_fmt(args);
        self.buf.push('\n');
        self.hash = fnv1a(self.hash, self.buf.as_bytes());
        if let Some(lines) = &mut self.lines {
            lines.push(self.buf.trim_end().to_string());
        }
    }

    pub(crate) fn hash(&self) -> u64 {
        self.hash
    }

    pub(crate) fn take_lines(&mut self) -> Vec<String> {
        self.lines.take().unwrap_or_default()
    }
}
