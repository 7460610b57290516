//! `keel recover --data D --accept-loss`: opens a data directory that every
//! other command refuses because its log lost acknowledged commits or is
//! damaged before its end, keeping the consistent prefix RocksDB can
//! recover, and reports exactly what was lost: every history event still
//! readable in the log past the recovered point (run and seq), and how many
//! acknowledged sequences are not readable at all. Without `--accept-loss`
//! it only says what it would do. No engine may hold the directory.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

use keel_storage::{Durability, Error as StoreError, RocksStore, Store};

use crate::bad_input;
use crate::table::to_stdout;

/// Arguments of `keel recover`.
#[derive(clap::Args, Debug)]
pub struct RecoverArgs {
    /// The data directory (opened read-write: no engine may hold it). A PostgreSQL store is named by its URL
    /// instead: `--store postgres://user:password@host:port/database`.
    #[arg(long, alias = "store", default_value = "keel-data")]
    pub data: PathBuf,
    /// Open it although acknowledged commits are lost, and report them.
    #[arg(long)]
    pub accept_loss: bool,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(serde::Serialize)]
struct LostRun {
    run_id: String,
    seqs: Vec<u64>,
}

#[derive(serde::Serialize)]
struct RecoverOut {
    acknowledged: Option<u64>,
    recovered_to: u64,
    damage: Option<String>,
    lost_commits: usize,
    lost_events: usize,
    unreadable_sequences: u64,
    lost_runs: Vec<LostRun>,
    verify_ok: bool,
}

pub(crate) fn run(args: RecoverArgs) -> anyhow::Result<ExitCode> {
    if crate::output::postgres_of(&args.data).is_some() {
        return Err(bad_input(
            "`keel recover` repairs data directories; a PostgreSQL store is recovered by the database itself (its WAL), and `keel verify --store URL` checks it".to_string(),
        ));
    }
    if !args.accept_loss {
        // Say what is wrong, if anything, and what the flag would do.
        return match RocksStore::open_read_only(&args.data) {
            Ok(_) => {
                to_stdout(|w| {
                    writeln!(
                        w,
                        "{} opens without loss: nothing to recover",
                        args.data.display()
                    )
                })?;
                Ok(ExitCode::SUCCESS)
            }
            Err(e @ (StoreError::LostCommits { .. } | StoreError::Damaged { .. })) => {
                Err(bad_input(format!(
                    "{e}; run again with --accept-loss to open it keeping what can be recovered"
                )))
            }
            Err(e) => Err(e.into()),
        };
    }
    let (store, report) = match RocksStore::open_accepting_loss(&args.data, Durability::Sync) {
        Ok(r) => r,
        Err(StoreError::Locked { path }) => {
            return Err(bad_input(format!(
                "{} is held by a running engine: stop it first",
                path.display()
            )))
        }
        Err(e) => return Err(e.into()),
    };
    let verify_ok = store.verify()?.ok;
    let mut runs: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for (run, seq) in &report.lost_events {
        runs.entry(run.to_string()).or_default().push(seq.0);
    }
    let out = RecoverOut {
        acknowledged: report.acknowledged,
        recovered_to: report.found,
        damage: report.damage.clone(),
        lost_commits: report.lost_commits,
        lost_events: report.lost_events.len(),
        unreadable_sequences: report.unreadable_sequences,
        lost_runs: runs
            .into_iter()
            .map(|(run_id, seqs)| LostRun { run_id, seqs })
            .collect(),
        verify_ok,
    };
    to_stdout(|w| {
        if args.json {
            return writeln!(w, "{}", serde_json::to_string(&out)?);
        }
        writeln!(
            w,
            "recovered {} up to sequence {}{}",
            args.data.display(),
            out.recovered_to,
            out.acknowledged
                .map(|a| format!(" (commits were acknowledged up to {a})"))
                .unwrap_or_default()
        )?;
        if let Some(d) = &out.damage {
            writeln!(w, "damage: {d}")?;
        }
        if !report.lost_anything() {
            return writeln!(w, "nothing acknowledged was lost");
        }
        writeln!(
            w,
            "lost: {} commits still readable in the log ({} history events), {} acknowledged sequences no longer readable",
            out.lost_commits, out.lost_events, out.unreadable_sequences
        )?;
        for r in &out.lost_runs {
            writeln!(w, "  run {}  seqs {}", r.run_id, ranges(&r.seqs))?;
        }
        writeln!(
            w,
            "verify: {}",
            if out.verify_ok {
                "ok (the recovered prefix is consistent)"
            } else {
                "violations: run `keel verify` for the list"
            }
        )
    })?;
    Ok(if verify_ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// `1..3, 7` for 1, 2, 3, 7.
fn ranges(seqs: &[u64]) -> String {
    let mut sorted = seqs.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let start = sorted[i];
        let mut end = start;
        while i + 1 < sorted.len() && sorted[i + 1] == end + 1 {
            i += 1;
            end = sorted[i];
        }
        parts.push(if start == end {
            start.to_string()
        } else {
            format!("{start}..{end}")
        });
        i += 1;
    }
    parts.join(", ")
}
