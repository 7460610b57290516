//! # keel: durable workflows for Rust, embedded in your application
//!
//! Workflow code is ordinary `async` Rust, replayed from a committed
//! history: it must be deterministic, and it reaches the world only through
//! its [`WorkflowContext`] (activities, timers, signals, conditions, side
//! effects, `now`, `random`). Activities are the side effects: they run at
//! least once under leases, and each committed fact is recorded exactly
//! once per durable id, however often the work was delivered.
//!
//! ```no_run
//! use keel::{Activity, ActivityContext, ActivityError, Engine, Workflow, WorkflowContext, WorkflowError};
//!
//! #[derive(Default)]
//! struct Charge;
//! impl Activity for Charge {
//!     const NAME: &'static str = "charge";
//!     type Input = u64;
//!     type Output = String;
//!     async fn run(&self, ctx: ActivityContext, cents: u64) -> Result<String, ActivityError> {
//!         // ctx.execution_id() is the idempotency key for the payment API.
//!         Ok(format!("charged {cents} as {}", ctx.execution_id()))
//!     }
//! }
//!
//! struct Order;
//! impl Workflow for Order {
//!     const NAME: &'static str = "order";
//!     type Input = u64;
//!     type Output = String;
//!     async fn run(ctx: WorkflowContext, cents: u64) -> Result<String, WorkflowError> {
//!         Ok(ctx.activity::<Charge>(cents).await?)
//!     }
//! }
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let engine = Engine::builder()
//!     .data_dir("keel-data")
//!     .register_workflow::<Order>()
//!     .register_activity::<Charge>()
//!     .build()?;
//! let client = engine.client();
//! client.start::<Order>("order-1", &1299).await?;
//! let receipt = client.result::<Order>("order-1").await?;
//! # Ok(()) }
//! ```

pub mod replay;

pub use replay::{Bundle, ReplayOutcome, Replayer};

pub use keel_actors::{
    AttemptView, ChildView, Client, Engine, EngineBuilder, EngineConfig, EngineError, EngineStats,
    MessageSent, NewSchedule, Resumed, ReusePolicy, RunDescription, ScheduleSummary, Schedules,
    SignalWithStart, StartOptions, StartOutcome,
};
pub use keel_core::child;
pub use keel_core::child::{AnyChild, ChildCall, ChildHandle, ChildResult, StartChild};
pub use keel_core::concurrency::{
    All, AllLimited, AsyncCall, Branch, HandleResult, Select, SelectHandle, Selected,
};
/// Schedules: calendars, policies and what `describe` shows.
pub use keel_core::schedule;
pub use keel_core::schedule::{OverlapPolicy, ScheduleAction, ScheduleChange, ScheduleSpec};
pub use keel_core::{
    format_group, Activity, ActivityContext, ActivityError, ActivityRegistry, CancellationType,
    HandlerError, MachineError, RetryPolicy, Workflow, WorkflowContext, WorkflowError,
    WorkflowRegistry, CONTINUE_AS_NEW_SUGGESTED_EVENTS,
};
pub use keel_core::{
    CoroutineRef, Message, MessageStream, NextMessage, Receiver, Scope, ScopeError, ScopeRef,
    Sender, StreamPosition,
};
pub use keel_storage::{
    AttemptId, AttemptNo, Backoff, CommandId, Durability, ExecutionId, Failure, FailureKind, Field,
    FilterError, GroupEntry, InstanceId, Jitter, MessageKey, MetadataError, Op, OperationKind,
    Outcome, PageToken, ParentClosePolicy, Payload, PgOptions, RunFilter, RunId, RunMeta, RunPage,
    RunStatus, SearchValue, SelectKey, Seq, Step, StoreHealth, Timestamp, WorkflowTimeout,
    WriteFault,
};

/// The storage layer, for inspection tools (`keel` CLI) and custom stores.
pub mod storage {
    pub use keel_storage::*;
}

/// The resilience pipeline, usable around any async call.
pub mod resilience {
    pub use keel_resilience::*;
}

/// The pure run machine, for offline tools and the simulator.
pub mod machine {
    pub use keel_core::machine::*;
}

/// The deterministic driver the engine runs (and the simulator hosts).
pub mod driver {
    pub use keel_core::driver::*;
}
