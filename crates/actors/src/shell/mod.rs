//! The actix shell: run actors, the registry that activates and passivates
//! them, the timer service, activity workers with leases, the outbox, and the
//! engine/client API over them.
//!
//! The shell feeds inputs to the pure [`crate::machine::RunMachine`],
//! commits the events it returns through the store's group commit, and only
//! then runs effects (dispatch attempts, arm timers, start children, answer
//! clients).

mod engine;
mod run;
mod timers;
mod workers;

pub use engine::{
    AttemptView, ChildView, Client, Engine, EngineBuilder, EngineConfig, EngineError, ReusePolicy,
    RunDescription, StartOutcome,
};

/// Most messages waiting in one run actor's mailbox.
pub const RUN_MAILBOX_MAX: usize = 1024;
/// Most run actors kept in memory; beyond it the least recently used idle
/// run is passivated (it replays from its log when next needed).
pub const RUN_CACHE_MAX_DEFAULT: usize = 10_000;
/// Lease of an attempt without a heartbeat or start-to-close timeout.
pub const LEASE_MS_DEFAULT: u64 = 60_000;
/// Redeliveries of one attempt after lease expiry before it fails.
pub const LEASE_REDELIVERIES_MAX: u32 = 3;
/// Attempts running at once in one engine process.
pub const WORKER_CONCURRENCY_MAX: usize = 1024;
/// Times a delivery to a run is retried when its actor stopped meanwhile.
pub const DELIVERY_ATTEMPTS_MAX: u32 = 8;
/// Consecutive activation failures before a run is parked as crash-looping.
pub const RUN_RESTARTS_MAX: u32 = 5;
/// How often the worker supervisor checks leases.
pub const LEASE_SWEEP_MS: u64 = 50;
/// Overall deadline of an attempt admitted through a resilience profile
/// when the call has no schedule-to-close limit.
pub const PROFILE_DEADLINE_MS_DEFAULT: u64 = 3_600_000;
/// How long an attempt a resilience policy refused waits before it is
/// offered again.
pub const PROFILE_REJECTION_RETRY_MS: u64 = 250;
/// Longest wait between two retries of a delivery that must not be lost.
pub const DELIVERY_BACKOFF_MS_MAX: u64 = 5_000;
