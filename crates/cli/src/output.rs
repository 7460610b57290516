//! Shared output helpers: progress bars that stay quiet when stderr is not
//! a terminal, and opening data directories for inspection.

use std::io::IsTerminal;
use std::path::Path;

use indicatif::{ProgressBar, ProgressStyle};
use keel_storage::pg::{is_postgres_url, redact};
use keel_storage::{PgOptions, PgStore, RocksStore, Store};

/// A progress bar on stderr, hidden when stderr is not a terminal.
pub fn progress(len: u64, what: &str) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} {msg} [{bar:30}] {pos}/{len} ({per_sec}, eta {eta})",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    bar.set_message(what.to_string());
    bar
}

/// The PostgreSQL store named by `data`, when it is a `postgres://` URL
/// rather than a directory (`--store` is an alias of `--data`).
pub fn postgres_of(data: &Path) -> Option<PgOptions> {
    data.to_str()
        .filter(|s| is_postgres_url(s))
        .map(PgOptions::new)
}

/// How a store location is shown to people: a directory as its path, a
/// database without its password.
pub fn shown(data: &Path) -> String {
    match postgres_of(data) {
        Some(_) => redact(&data.to_string_lossy()),
        None => data.display().to_string(),
    }
}

/// Opens a store for inspection beside a possibly running engine:
/// read-only, a PostgreSQL store or a data directory (what the engine had
/// written by the open).
pub fn open_for_reading(data: &Path) -> Result<Box<dyn Store>, keel_storage::Error> {
    if let Some(options) = postgres_of(data) {
        return Ok(Box::new(PgStore::open_read_only(options)?));
    }
    Ok(Box::new(open_dir_for_reading(data)?))
}

/// Opens a data directory for inspection (see [`open_for_reading`]).
pub fn open_dir_for_reading(data: &Path) -> Result<RocksStore, keel_storage::Error> {
    RocksStore::open_read_only(data)
}

/// Peak resident memory of this process in MiB (Linux), 0 where unknown.
pub fn max_rss_mb() -> f64 {
    status_mib("VmHWM:")
}

/// Resident memory of this process now in MiB (Linux), 0 where unknown.
pub fn rss_mb() -> f64 {
    status_mib("VmRSS:")
}

/// A kB line of /proc/self/status (`field` with its colon) in MiB.
fn status_mib(field: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// Percentile of sorted samples.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}
