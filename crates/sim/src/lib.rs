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
//! use keel_actors::{Activity, ActivityContext, ActivityError, Workflow, WorkflowContext, WorkflowError};
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
//! The engine model mirrors `keel_actors::shell` (see the `world` module)
//! except where the shell was found to break an invariant; there the model
//! does what the design asks, and a `--break` mode ([`BreakMode`]) runs the
//! shell's behavior so that the simulator demonstrates the bug:
//!
//! - a timer fire whose commit failed is fired again (the shell drops it
//!   until the next engine start: `drop-failed-timer`);
//! - a child start whose commit failed is tried again, and a start of a
//!   child that exists counts as started (the shell reports either to the
//!   parent as a failed child: `fail-child-on-start-error`);
//! - a duplicate verdict is answered to the client after the group sync
//!   (the shell answers at once, although the verdict may rest on a commit
//!   still in flight that a crash then loses: `early-duplicate-answer`).
//!
//! Also on purpose: an attempt result and a continue-as-new start are
//! retried until the run answers (the shell gives up after five tries, or
//! at once, until the next engine start); the simulated client starts with
//! `ReusePolicy::RejectDuplicate`, so a start retried after its run closed
//! does not start a second run; the seed of a continued run is derived from
//! its chain instead of drawn; no resilience profiles and no async closures
//! (their closures live in a process-wide table).

mod check;
mod fault;
mod sim;
mod store;
mod trace;
pub mod workload;
mod world;

pub use check::{Violation, ViolationKind};
pub use fault::{FaultKind, Faults};
pub use sim::{BreakMode, Report, Shrunk, SimError, Simulation};
pub use store::StoreKind;
pub use trace::fnv1a;
pub use workload::{ClientOp, ClientOpKind, WorkflowPlan, Workload};
