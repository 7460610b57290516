//! `keel verify`: integrity of a data directory.

use std::path::Path;
use std::process::ExitCode;

use keel_storage::Violation;

use crate::output::open_for_reading;

pub(crate) fn run(data: &Path, json: bool) -> anyhow::Result<ExitCode> {
    let store = match open_for_reading(data) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("keel: cannot open {}: {e}", crate::output::shown(data));
            return Ok(ExitCode::from(2));
        }
    };
    let report = store.verify()?;
    if json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "{}: {} runs, {} events, {} violations",
            if report.ok { "ok" } else { "VIOLATIONS" },
            report.runs,
            report.events,
            report.violations.len()
        );
        for v in &report.violations {
            println!("  {}", describe(v));
        }
        if report.truncated {
            println!("  (more violations not listed)");
        }
    }
    Ok(if report.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn describe(v: &Violation) -> String {
    match v {
        Violation::Corrupt {
            cf,
            run,
            seq,
            detail,
        } => format!(
            "corrupt record in {cf}{}{}: {detail}",
            run.as_ref()
                .map(|r| format!(" run {r}"))
                .unwrap_or_default(),
            seq.map(|s| format!(" seq {s}")).unwrap_or_default()
        ),
        Violation::Gap {
            run,
            expected,
            found,
        } => {
            format!("gap in run {run}: expected seq {expected}, found seq {found}")
        }
        Violation::SeqMismatch {
            run,
            key_seq,
            record_seq,
        } => {
            format!("run {run}: key says seq {key_seq}, record says seq {record_seq}")
        }
        Violation::DuplicateTerminal {
            run,
            key,
            first_seq,
            seq,
        } => {
            format!("run {run}: {key} has a second terminal event at seq {seq} (first at seq {first_seq})")
        }
        Violation::InvalidHistory { run, seq, detail } => {
            format!("run {run} seq {seq}: {detail}")
        }
        Violation::DerivedMismatch { cf, key, problem } => {
            format!("derived state {cf} key {key}: {problem}")
        }
    }
}
