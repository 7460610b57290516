//! keel-core: everything keel decides, with no actix, no tokio, no clock,
//! no threads and no IO.
//!
//! - the authoring API ([`workflow`], [`activity`], [`context`],
//!   [`concurrency`], [`scope`]): what workflow and activity code is written
//!   against;
//! - the run machine ([`machine`]) and its deterministic [`executor`]: one
//!   run's workflow code, fed one input at a time, live and on replay;
//! - the driver ([`driver`]): every decision around the machine (activation,
//!   duplicates, commits, leases, timers, the outbox, close policies,
//!   recovery, client requests, passivation), inputs and `now` in, actions
//!   out.
//!
//! Hosts feed the driver and perform its actions: the actix engine
//! (`keel-actors`) in production, the simulator (`keel-sim`) in tests.
//! Time arrives with each input; randomness arrives recorded in events or
//! drawn by the host and handed in.

pub mod activity;
pub mod child;
pub mod concurrency;
pub mod context;
mod core;
pub mod driver;
pub mod executor;
pub mod handlers;
pub mod machine;
mod metadata;
pub mod retry;
pub mod schedule;
pub mod scope;
pub mod stream;
pub mod workflow;

pub use crate::core::{format_group, CancellationType, OpenWait, WaitKind};
pub use activity::{
    Activity, ActivityContext, ActivityError, ActivityRegistry, CancelSignal, HeartbeatFn,
};
pub use child::{AnyChild, ChildCall, ChildHandle, ChildOutput, ChildResult, StartChild};
pub use concurrency::{All, AllLimited, Branch, Select, SelectHandle, Selected};
pub use context::{ActivityCall, RetryPolicy, Timer, WorkflowContext};
pub use handlers::{HandlerError, HANDLERS_PER_RUN_MAX};
pub use machine::{
    Input, MachineError, RunMachine, StartSpec, StreamPosition, UpdateStatus, Verdict,
};
pub use scope::{CoroutineRef, Receiver, Scope, ScopeError, ScopeRef, ScopeView, Sender};
pub use stream::{ExternalSend, Message, MessageStream, NextMessage};
pub use workflow::{Workflow, WorkflowError, WorkflowRegistry};

/// History length (events) at which `ctx.continue_as_new_suggested()`
/// turns true: well under `keel_storage::HISTORY_EVENTS_MAX`, and where
/// rebuilding a passivated run by replay starts to cost milliseconds.
pub const CONTINUE_AS_NEW_SUGGESTED_EVENTS: u64 = 10_000;
const _: () = assert!(CONTINUE_AS_NEW_SUGGESTED_EVENTS * 100 <= keel_storage::HISTORY_EVENTS_MAX);

/// The message a caught panic carried (`panic!` with a literal or a
/// formatted string), for the typed error that reports it: the engine's
/// guards around user code (workflow code, handlers, inputs, activities,
/// offline replay) all word it this way.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".into())
}
