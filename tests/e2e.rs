//! keel's end-to-end tests as one test binary: each file of `tests/` is a
//! module here, with its own goal and method in its first comment.
//!
//! One binary instead of one per file: every test binary links the whole
//! engine and RocksDB (about 500 MB each), so thirty of them cost about
//! 15 GB of disk and as many links per build. Tests of different files now
//! run side by side in one process, as the tests of one file always did:
//! none may depend on a process of its own. `traces` and `otlp` stay
//! binaries of their own, because each installs the process's global
//! tracing subscriber.

#[path = "activity_limits.rs"]
mod activity_limits;
#[path = "backlog.rs"]
mod backlog;
#[path = "browser.rs"]
mod browser;
#[path = "cancellation_types.rs"]
mod cancellation_types;
#[path = "child_handles.rs"]
mod child_handles;
#[path = "command_ids.rs"]
mod command_ids;
#[path = "continue_as_new.rs"]
mod continue_as_new;
#[path = "embedding.rs"]
mod embedding;
#[path = "engine.rs"]
mod engine;
#[path = "execute.rs"]
mod execute;
#[path = "golden_derived.rs"]
mod golden_derived;
#[path = "golden_histories.rs"]
mod golden_histories;
#[path = "golden_shapes.rs"]
mod golden_shapes;
#[path = "import.rs"]
mod import;
#[path = "install_checks.rs"]
mod install_checks;
#[path = "intents.rs"]
mod intents;
#[path = "message_streams.rs"]
mod message_streams;
#[path = "no_stuck_runs.rs"]
mod no_stuck_runs;
#[path = "non_blocking_activities.rs"]
mod non_blocking_activities;
#[path = "postgres_engine.rs"]
mod postgres_engine;
#[path = "postgres_restart.rs"]
mod postgres_restart;
#[path = "queries_and_updates.rs"]
mod queries_and_updates;
#[path = "resilience_activities.rs"]
mod resilience_activities;
#[path = "resume_offline.rs"]
mod resume_offline;
#[path = "schedules.rs"]
mod schedules;
#[path = "scope_children.rs"]
mod scope_children;
#[path = "search_attributes.rs"]
mod search_attributes;
#[path = "seed_examples.rs"]
mod seed_examples;
#[path = "serve.rs"]
mod serve;
#[path = "shared_store.rs"]
mod shared_store;
#[path = "signals_and_conditions.rs"]
mod signals_and_conditions;
#[path = "store_faults.rs"]
mod store_faults;
#[path = "timeouts.rs"]
mod timeouts;
#[path = "versioning.rs"]
mod versioning;
