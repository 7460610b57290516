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
    let ms = ts.0 % 1000;
    let secs = ts.0 / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{ms:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Days since 1970-01-01 to (year, month, day) in the proleptic Gregorian
/// calendar (Howard Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
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
