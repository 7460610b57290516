//! Shared helpers for keel-storage's integration tests: deterministic ids,
//! an event builder that keeps seqs contiguous, a runner that executes one
//! test body against every store kind, and a byte-level dump of a store for
//! "nothing was written" checks.

#![allow(dead_code, unreachable_pub)]

use keel_storage::keys::Cf;
use keel_storage::{
    attempt_of_helper, ActivityOptions, CommitAck, CommitBatch, Durability, Event, EventKind,
    InstanceId, MemStore, Payload, RocksStore, RunId, Seq, Step, Store, Timestamp,
};
