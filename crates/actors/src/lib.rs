//! keel-actors: the actix host of keel's driver.
//!
//! Runs are spread over shards; each shard is an actix actor on its own
//! arbiter thread hosting a `keel_core::driver::Shard`, which decides
//! everything. The host feeds it (client requests, messages between shards,
//! store answers, attempt results and heartbeats, the clock) and performs
//! its actions: reads on the blocking pool, commits through the store's
//! group-commit writer, attempts on the activity runtime, messages to other
//! shards, replies to clients. The simulator (`keel-sim`) hosts the same
//! driver on virtual time.

mod attempts;
mod client;
mod cluster;
mod engine;
mod readers;
mod routes;
mod schedules;
mod shard;

pub use client::{
    Client, EngineError, MessageSent, SignalWithStart, StartOptions, StartOutcome,
    CLIENT_RETRIES_MAX, CONTINUE_AS_NEW_FOLLOWS_MAX, REMOTE_ANSWER_WAIT_MS,
};
pub use cluster::{LOOK_MS, RELAY_POLL_MS, RELAY_SEND_NOTES_MAX, RELAY_TAKE_NOTES_MAX};
pub use engine::{Engine, EngineBuilder, EngineConfig, EngineStats, ACTIVITY_SHUTDOWN_MS};
pub use keel_core::driver::{AttemptView, ChildView, Resumed, ReusePolicy, RunDescription};
pub use readers::{READER_THREADS, READ_QUEUE_MAX};
pub use routes::RELAY_QUEUE_MAX;
pub use schedules::{NewSchedule, ScheduleSummary, Schedules, SCHEDULES_LIST_MAX};
pub use shard::{
    SHARD_MAILBOX_MAX, SHARD_RESTARTS_MAX, SHARD_RESTART_DELAY_MS, SHARD_RESTART_WINDOW_MS,
    STORE_HEALTH_POLL_MS,
};
