//! keel's resilience pipeline: attempt timeout, retry, retry budget, rate
//! limit, circuit breaker, bulkhead, overall deadline and fallback around any
//! async call, usable on its own and later attached by the engine to durable
//! activities.
//!
//! # Four things kept apart
//!
//! * The **pipeline** ([`CompiledPipeline`]) is built once by a [`Builder`]
//!   for one profile (id and version) and one [`Partition`], and holds the
//!   live state of its policies. Share it (`Arc`); never rebuild it per
//!   request.
//! * The **operation** has an [`ExecutionContext`], created right before the
//!   call by [`CompiledPipeline::new_context`]: overall deadline, [`Safety`]
//!   declaration, [`OperationId`].
//! * Each **attempt** gets an [`AttemptContext`] with a unique [`AttemptId`]
//!   and its dispatched attempt number.
//! * The **classifier** ([`Classifier`]) says what each outcome means:
//!   retryable, breaker failure, fallback-eligible. It starts conservative.
//!
//! # Check order per attempt
//!
//! Partition, retry safety (retries only), overall deadline, circuit breaker,
//! retry budget (retries only), rate limit, bulkhead, then dispatch under the
//! attempt timeout. A later refusal releases what earlier checks took; see
//! [`admission`].
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use keel_resilience::{AttemptTimeoutRequirement, Builder, Classifier, Safety};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let pipeline = Builder::profile("catalog", "v1")
//!     .partition("shop", "prod", "catalog-api")
//!     .attempt_timeout(Duration::from_secs(2), AttemptTimeoutRequirement::Preemptive)
//!     .rate_limit(Builder::token_bucket(5, 5, Duration::from_secs(1)))
//!     .compile_in_memory(Classifier::<std::io::Error>::new())?;
//! let ctx = pipeline.new_context(Duration::from_secs(30), Safety::NotRepeatable, "op-1")?;
//! let answer = pipeline.execute(&ctx, |_attempt| async { Ok(42) }).await?;
//! assert_eq!(answer, 42);
//! # Ok(())
//! # }
//! ```
//!
//! # Engine hooks
//!
//! [`RetryPolicy::next_delay`] is a pure function of the attempt number, the
//! previous delay and a caller-drawn random word, so the engine can record
//! the draw and make the delay a durable timer. [`CompiledPipeline::admit`]
//! runs the checks without dispatching and returns an [`Admission`] guard to
//! settle with a [`Verdict`].

pub mod admission;
pub mod bucket;
pub mod budget;
pub mod builder;
pub mod bulkhead;
pub mod circuit;
pub mod classify;
pub mod clock;
pub mod context;
pub mod explain;
pub mod ids;
pub mod partition;
pub mod pipeline;
pub mod reason;
pub mod retry;

pub use admission::{Admission, Rejection};
pub use bucket::TokenBucketSpec;
pub use budget::RetryBudgetSpec;
pub use builder::{AttemptTimeoutRequirement, Builder};
pub use bulkhead::BulkheadSpec;
pub use circuit::{CircuitSpec, CircuitState, Ratio, Window};
pub use classify::{Classification, Classifier, Verdict};
#[cfg(feature = "tokio")]
pub use clock::TokioClock;
pub use clock::{Clock, Instant, ManualClock};
pub use context::{AttemptContext, ExecutionContext, ReplaySafetyContract, RetryRefusal, Safety};
pub use explain::{CapabilityNote, Explanation};
pub use ids::{AttemptId, OperationId, ProfileId, ProfileVersion};
pub use partition::Partition;
pub use pipeline::CompiledPipeline;
pub use reason::Reason;
pub use retry::{BackoffMode, JitterMode, RetryPolicy};
