//! What crosses between engine processes that share a store: client
//! requests, messages between shards and answers are encoded for the
//! store's relay (see `keel_storage::Relay`). The vocabulary is the
//! driver's own; this module only gives the few fields that name a fixed
//! word (`&'static str`) a way back from the wire.

use serde::{Deserialize, Deserializer};

/// A fixed word (a status, a kind) in a type that crosses the wire. An
/// alias, so that serde's derive does not take the field for text borrowed
/// from the input (it reads the word back through one of the functions
/// below).
pub type Word = &'static str;

/// The word of `known` that `found` spells, or `unknown`: a peer of a
/// newer version may send a word this one does not know.
fn pick(found: &str, known: &[&'static str]) -> &'static str {
    known
        .iter()
        .find(|k| **k == found)
        .copied()
        .unwrap_or("unknown")
}

fn word<'de, D: Deserializer<'de>>(d: D, known: &[&'static str]) -> Result<&'static str, D::Error> {
    let found = String::deserialize(d)?;
    Ok(pick(&found, known))
}

/// A run status's name (`RunStatus::name`).
pub(crate) fn run_status<'de, D: Deserializer<'de>>(d: D) -> Result<&'static str, D::Error> {
    let found = String::deserialize(d)?;
    Ok(keel_storage::RunStatus::parse(&found).map_or("unknown", |s| s.name()))
}

/// `query` or `update`.
pub(crate) fn handler_kind<'de, D: Deserializer<'de>>(d: D) -> Result<&'static str, D::Error> {
    word(d, &["query", "update"])
}

/// An attempt's state as `describe` shows it.
pub(crate) fn attempt_state<'de, D: Deserializer<'de>>(d: D) -> Result<&'static str, D::Error> {
    word(
        d,
        &[
            "waiting",
            "queued",
            "running",
            "refused",
            "reporting",
            "fallback",
            "stored",
        ],
    )
}
