//! keel-sim: the deterministic simulator.
//!
//! It runs the real run machine, workflow executor and store validation
//! (`keel_actors::RunMachine`, `keel_storage::derive` through `MemStore` or
//! `RocksStore`) inside a model of the engine shell, on virtual time, with
//! every decision drawn from one `ChaCha8Rng` seeded by the seed: delivery
//! order and latency, worker speed, lease expiry, redelivery, duplicate and
//! late results, outbox redelivery, timer skew, worker crashes, commit
//! failures, engine crashes with the unsynced tail dropped or torn, injected
//! activity failures, and stray signals and cancels. See [`FaultKind`].
//!
//! After every step it checks the commit-path invariants (append-only,
//! gap-free logs; one terminal event per durable id; no effect before its
//! event is durable; no acknowledged commit lost; `select` winners never
//! change). After the faults stop it lets the workload finish and checks
//! that every workflow finished with the same outcome as a fault-free run,
//! that offline replay of every final history reproduces it, that nothing
//! is parked and that the store verifies. Same seed and build, same trace
//! hash.
//!
//! Users check their own workflows the same way:
//!
//! ```
//! use keel_core::{Activity, ActivityContext, ActivityError, Workflow, WorkflowContext, WorkflowError};
//! use keel_sim::{Faults, Simulation, Workload};
//!
//! struct Charge;
//! impl Activity for Charge {
//!     const NAME: &'static str = "charge";
//!     type Input = u64;
//!     type Output = String;
//!     async fn run(&self, _ctx: ActivityContext, cents: u64) -> Result<String, ActivityError> {
//!         Ok(format!("charged {cents}"))
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
//! let report = Simulation::new(42)
//!     .register_workflow::<Order>()
//!     .mock_activity::<Charge, _>(|cents, _attempt| Ok(format!("charged {cents}")))
//!     .faults(Faults::all())
//!     .workload(Workload::new().start::<Order>("order-1", &1299))
//!     .run()
//!     .unwrap();
//! assert!(report.passed, "{report}");
//! ```
//!
//! The simulator is a host of the engine's own driver
//! (`keel_core::driver`), like the actix engine: it performs the driver's
//! actions on a simulated store, workers, clients and network, and decides
//! nothing the engine decides. A deliberately broken driver
//! ([`BreakMode`], `--break`) proves that the checks can fail.

mod check;
mod fault;
mod host;
mod sim;
mod store;
mod trace;
pub mod workload;

pub use check::{Violation, ViolationKind};
pub use fault::{FaultKind, Faults, Firings};
pub use sim::{detected_as, BreakMode, Report, Shrunk, SimError, Simulation, SIM_PROCESSES_MAX};
pub use store::StoreKind;
pub use trace::fnv1a;
pub use workload::{ClientOp, ClientOpKind, WorkflowPlan, Workload};
