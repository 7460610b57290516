//! Goal: the rows the commit path derives from a history (run and instance
//! records, index keys, dedupe rows, tasks, timers, outbox rows, children)
//! never change by accident. A changed key or record encoding leaves every
//! existing data directory with rows the new build neither finds nor
//! expects in `keel verify`: that needs a schema version and a migration,
//! so it must be a decision, not a side effect of a refactor.
//! Method: every golden history under `tests/data/histories/` (and its
//! `shapes/`) is put into in-memory families as its event rows and its
//! derived state rebuilt by the commit path's own code
//! (`verify::rebuild`, what a migration writes); every derived row, key
//! and value in hex, is compared with
//! `tests/data/golden/derived/<bundle>.txt`. `KEEL_BLESS=1` writes them
//! after an intended change. A second test checks the comparison has
//! teeth: one changed byte in a derived value is reported.

use std::path::{Path, PathBuf};

use keel::replay::Bundle;
use keel::storage::codec::{self, RecordKind};
use keel::storage::keys::{self, Cf};
use keel::storage::kv::{KvWrite, Maps};
use keel::storage::verify;

fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every bundle under `tests/data/histories/`, in name order.
fn bundles() -> Vec<PathBuf> {
    let root = manifest_dir().join("tests/data/histories");
    let mut out = Vec::new();
    for dir in [root.clone(), root.join("shapes")] {
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.expect("directory entry").path();
            if path.extension().is_some_and(|x| x == "bundle") {
                out.push(path);
            }
        }
    }
    out.sort();
    assert!(
        out.len() >= 10,
        "expected the golden bundles, found {}",
        out.len()
    );
    out
}

/// The derived rows of `bundle`'s history, one line per row:
/// `family<TAB>key hex<TAB>value hex`, families in their order, keys sorted.
fn derived_rows(bundle: &Bundle) -> String {
    let mut events = Maps::default();
    for event in &bundle.events {
        let bytes = codec::encode(RecordKind::Event, event).expect("encode a golden event");
        events.put(
            Cf::Events,
            keys::event_key(bundle.run.run_id, event.seq),
            bytes,
        );
    }
    let (rebuilt, report) = verify::rebuild(&events).expect("rebuild");
    assert!(report.ok, "the history rebuilds cleanly: {report:?}");
    let mut out = String::new();
    for cf in Cf::DERIVED {
        for (key, value) in rebuilt.cf(cf) {
            out.push_str(&format!("{}\t{}\t{}\n", cf.name(), hex(key), hex(value)));
        }
    }
    out
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn golden_path(bundle: &Path) -> PathBuf {
    let name = bundle.file_stem().expect("bundle name").to_string_lossy();
    let group = if bundle.parent().is_some_and(|p| p.ends_with("shapes")) {
        "shapes-"
    } else {
        ""
    };
    manifest_dir()
        .join("tests/data/golden/derived")
        .join(format!("{group}{name}.txt"))
}

/// The first line where `found` and `expected` differ, for the report.
fn first_difference(found: &str, expected: &str) -> Option<String> {
    let (mut f, mut e) = (found.lines(), expected.lines());
    let mut n = 0;
    loop {
        n += 1;
        match (f.next(), e.next()) {
            (None, None) => return None,
            (a, b) if a == b => {}
            (a, b) => {
                return Some(format!(
                    "line {n}: found {:?}, expected {:?}",
                    a.unwrap_or("(end)"),
                    b.unwrap_or("(end)")
                ))
            }
        }
    }
}

#[test]
fn the_rows_derived_from_every_golden_history_never_change() {
    let bless = std::env::var("KEEL_BLESS").is_ok_and(|v| v == "1");
    let mut failures = Vec::new();
    for path in bundles() {
        let bundle = Bundle::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let found = derived_rows(&bundle);
        assert!(!found.is_empty(), "{}: no derived rows", path.display());
        let golden = golden_path(&path);
        if bless {
            std::fs::create_dir_all(golden.parent().expect("golden dir")).expect("golden dir");
            std::fs::write(&golden, &found).expect("write golden");
            continue;
        }
        match std::fs::read_to_string(&golden) {
            Ok(expected) => {
                if let Some(diff) = first_difference(&found, &expected) {
                    failures.push(format!("{}: {diff}", golden.display()));
                }
            }
            Err(e) => failures.push(format!(
                "{}: {e} (KEEL_BLESS=1 writes it)",
                golden.display()
            )),
        }
    }
    assert!(
        failures.is_empty(),
        "derived rows changed; if intended, that needs a schema version and a migration, then KEEL_BLESS=1:\n{}",
        failures.join("\n")
    );
}

#[test]
fn a_history_that_derives_other_rows_is_reported() {
    // The same history with its start one millisecond later: its run
    // record and its index keys (which hold the start time) differ, and the
    // comparison must say where. Compared with the rows derived here, not
    // the golden file, which the test above rewrites when blessing.
    let path = &bundles()[0];
    let mut bundle = Bundle::read(path).expect("bundle");
    let golden = derived_rows(&bundle);
    assert_eq!(first_difference(&derived_rows(&bundle), &golden), None);
    bundle.events[0].at.0 += 1;
    let diff = first_difference(&derived_rows(&bundle), &golden)
        .expect("a later start derives other rows");
    assert!(diff.starts_with("line "), "{diff}");
}
