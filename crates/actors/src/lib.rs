//! keel-actors: the pure run machine, the deterministic executor, the
//! authoring API, and the thin actix shell around them.
//!
//! The pure part ([`machine`], [`executor`], [`context`], [`workflow`],
//! [`activity`]) does no IO, reads no clock and draws no randomness; the
//! shell ([`shell`]) feeds it inputs, commits the events it returns, and
//! only then runs effects. The simulator drives the same pure part.

pub mod activity;
pub mod concurrency;
pub mod context;
mod core;
pub mod executor;
pub mod machine;
pub mod scope;
pub mod shell;
pub mod workflow;

pub use crate::core::{format_group, OpenWait, WaitKind};
pub use activity::{Activity, ActivityContext, ActivityError, ActivityRegistry};
pub use concurrency::{All, AllLimited, Branch, ChildCall, Select, SelectHandle, Selected};
pub use context::{ActivityCall, RetryPolicy, Timer, WorkflowContext};
pub use machine::{Input, MachineError, RunMachine, StartSpec, Verdict};
pub use scope::{CoroutineRef, Receiver, Scope, ScopeError, ScopeRef, ScopeView, Sender};
pub use workflow::{Workflow, WorkflowError, WorkflowRegistry};
