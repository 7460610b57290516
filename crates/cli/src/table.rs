//! Text helpers for people: aligned tables, UTC times, writing to a pipe
//! that may close early.

use std::io::{self, Write};

use keel::Timestamp;

/// Rows printed with every column padded to its widest cell.
#[derive(Debug, Default)]
pub(crate) struct Table {
    rows: Vec<Vec<String>>,
}

impl Table {
    pub(crate) fn new(header: &[&str]) -> Self {
        Table {
            rows: vec![header.iter().map(|h| h.to_string()).collect()],
        }
    }

    pub(crate) fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub(crate) fn write(&self, out: &mut dyn Write, indent: &str) -> io::Result<()> {
        let cols = self.rows.iter().map(Vec::len).max().unwrap_or(0);
        let mut widths = vec![0; cols];
        for r in &self.rows {
            for (i, c) in r.iter().enumerate() {
                widths[i] = widths[i].max(c.chars().count());
            }
        }
        for r in &self.rows {
            let mut line = String::from(indent);
            for (i, c) in r.iter().enumerate() {
                if i + 1 == r.len() {
                    line.push_str(c);
                } else {
                    line.push_str(&format!("{c:<w$}  ", w = widths[i]));
                }
            }
            writeln!(out, "{}", line.trim_end())?;
        }
        Ok(())
    }
}

/// A timestamp as UTC ISO-8601 with milliseconds, `-` for zero.
pub(crate) fn time(ts: Timestamp) -> String {
    if ts.0 == 0 {
        return "-".into();
    }
    ts.to_rfc3339()
}

/// Runs `body` against stdout; a reader that went away (`keel show | head`)
/// ends the output quietly instead of failing.
pub(crate) fn to_stdout(body: impl FnOnce(&mut dyn Write) -> io::Result<()>) -> io::Result<()> {
    let stdout = io::stdout();
    let mut out = io::BufWriter::with_capacity(1 << 16, stdout.lock());
    let result = body(&mut out).and_then(|()| out.flush());
    match result {
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    // Goal: times print as the calendar says; tables align.
    // Method: known instants, a two-row table.
    use super::*;

    #[test]
    fn times_and_tables() {
        assert_eq!(time(Timestamp(0)), "-");
        assert_eq!(time(Timestamp(1)), "1970-01-01T00:00:00.001Z");
        assert_eq!(time(Timestamp(951_782_400_123)), "2000-02-29T00:00:00.123Z");
        assert_eq!(
            time(Timestamp(1_735_689_599_999)),
            "2024-12-31T23:59:59.999Z"
        );
        let mut t = Table::new(&["A", "LONG"]);
        t.row(vec!["xyz".into(), "1".into()]);
        let mut out = Vec::new();
        t.write(&mut out, "").unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "A    LONG\nxyz  1\n");
    }
}
