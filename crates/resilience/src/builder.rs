//! The pipeline builder: collects the policies of one profile and partition,
//! checks every number and their combination, and compiles a
//! [`CompiledPipeline`] that holds the policies' state.
//!
//! The builder has no defaults. A policy exists only if its method is called,
//! and every number is passed explicitly. Two options are required: the
//! partition and the attempt timeout. Problems are collected and reported
//! by `compile_in_memory` as one typed [`Error`], so a builder chain never
//! panics and never needs `?` between calls.

#[cfg(feature = "tokio")]
use std::hash::BuildHasher;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::bucket::{self, TokenBucketSpec};
use crate::budget::{self, RetryBudgetSpec};
use crate::bulkhead::{self, BulkheadSpec};
use crate::circuit::{self, CircuitSpec, Ratio, Window};
use crate::classify::Classifier;
use crate::clock::Clock;
use crate::ids::{self, ProfileId, ProfileVersion};
use crate::partition::Partition;
use crate::pipeline::CompiledPipeline;
use crate::retry::{self, BackoffMode, JitterMode, RetryPolicy};

/// Longest attempt timeout, in milliseconds (one day).
pub const ATTEMPT_TIMEOUT_MS_MAX: u64 = 86_400_000;

/// How the attempt timeout is enforced.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum AttemptTimeoutRequirement {
    /// The callable reads its attempt deadline from its
    /// [`AttemptContext`](crate::AttemptContext) and stops itself; the pipeline
    /// never interrupts it, and a result that arrives after the attempt
    /// timeout is treated as an attempt timeout.
    Cooperative,
    /// The attempt future races the timer and is dropped when the timer wins.
    /// Only for futures that are safe to drop at any await point.
    Preemptive,
}

/// Why a pipeline could not be compiled.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// `partition` was never called.
    #[error("a pipeline needs a partition: call partition(application, environment, subject)")]
    MissingPartition,
    /// `attempt_timeout` was never called.
    #[error("a pipeline needs an attempt timeout: call attempt_timeout(timeout, requirement)")]
    MissingAttemptTimeout,
    /// A method was called twice.
    #[error("{method} was called more than once")]
    Duplicate {
        /// The method.
        method: &'static str,
    },
    /// An id or partition part was empty or too long.
    #[error(transparent)]
    Id(#[from] ids::Error),
    /// The attempt timeout was zero or above [`ATTEMPT_TIMEOUT_MS_MAX`].
    #[error("attempt timeout must be in 1ns..={ATTEMPT_TIMEOUT_MS_MAX} ms, found {found:?}")]
    AttemptTimeout {
        /// The value given.
        found: Duration,
    },
    /// Invalid retry numbers.
    #[error(transparent)]
    Retry(#[from] retry::Error),
    /// Invalid retry budget numbers.
    #[error(transparent)]
    RetryBudget(#[from] budget::Error),
    /// Invalid rate limit numbers.
    #[error("rate limit: {0}")]
    RateLimit(#[from] bucket::Error),
    /// Invalid circuit breaker numbers.
    #[error(transparent)]
    Circuit(#[from] circuit::Error),
    /// Invalid bulkhead numbers.
    #[error(transparent)]
    Bulkhead(#[from] bulkhead::Error),
    /// A retry budget without retries would never be spent.
    #[error("a retry budget needs retries: call retry with max attempts of at least 2")]
    BudgetWithoutRetry,
    /// The fallback policy with a classifier that never allows a fallback.
    #[error("the fallback policy needs a classifier that allows it: use fallback_on, fallback_on_attempt_timeout or fallback_on_rejection")]
    FallbackNeverEligible,
}

/// Collects the policies of one pipeline. See the [module docs](self).
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until compiled"]
pub struct Builder {
    profile_id: String,
    profile_version: String,
    partition: Option<[String; 3]>,
    tenant: Option<String>,
    attempt_timeout: Option<(Duration, AttemptTimeoutRequirement)>,
    retry: Option<(u32, BackoffMode, Duration, Duration, JitterMode)>,
    retry_budget: Option<RetryBudgetSpec>,
    rate_limit: Option<TokenBucketSpec>,
    circuit: Option<CircuitSpec>,
    bulkhead: Option<BulkheadSpec>,
    fallback: bool,
    duplicate: Option<&'static str>,
}

/// The checked configuration handed to the pipeline.
#[derive(Debug)]
pub(crate) struct Config {
    pub(crate) profile_id: ProfileId,
    pub(crate) profile_version: ProfileVersion,
    pub(crate) partition: Partition,
    pub(crate) attempt_timeout: Duration,
    pub(crate) requirement: AttemptTimeoutRequirement,
    pub(crate) retry: RetryPolicy,
    pub(crate) retry_budget: Option<RetryBudgetSpec>,
    pub(crate) rate_limit: Option<TokenBucketSpec>,
    pub(crate) circuit: Option<CircuitSpec>,
    pub(crate) bulkhead: Option<BulkheadSpec>,
    pub(crate) fallback: bool,
}

impl Builder {
    /// Starts a pipeline named `profile_id`, version `profile_version`.
    pub fn profile(profile_id: &str, profile_version: &str) -> Builder {
        Builder {
            profile_id: profile_id.to_owned(),
            profile_version: profile_version.to_owned(),
            partition: None,
            tenant: None,
            attempt_timeout: None,
            retry: None,
            retry_budget: None,
            rate_limit: None,
            circuit: None,
            bulkhead: None,
            fallback: false,
            duplicate: None,
        }
    }

    fn once<T>(
        mut self,
        method: &'static str,
        slot: fn(&mut Builder) -> &mut Option<T>,
        value: T,
    ) -> Self {
        let target = slot(&mut self);
        if target.is_some() {
            self.duplicate.get_or_insert(method);
        } else {
            *target = Some(value);
        }
        self
    }

    /// Required. Whose state the pipeline keeps: `application` (e.g. `shop`),
    /// `environment` (e.g. `prod`) and `subject`, the protected dependency
    /// (e.g. `catalog-api`; never a credential).
    pub fn partition(self, application: &str, environment: &str, subject: &str) -> Self {
        let parts = [
            application.to_owned(),
            environment.to_owned(),
            subject.to_owned(),
        ];
        self.once("partition", |b| &mut b.partition, parts)
    }

    /// Narrows the partition to one tenant, when limits are kept per tenant.
    pub fn tenant(self, tenant: &str) -> Self {
        self.once("tenant", |b| &mut b.tenant, tenant.to_owned())
    }

    /// Required. Every attempt gets `timeout`, enforced as `requirement` says.
    pub fn attempt_timeout(
        self,
        timeout: Duration,
        requirement: AttemptTimeoutRequirement,
    ) -> Self {
        self.once(
            "attempt_timeout",
            |b| &mut b.attempt_timeout,
            (timeout, requirement),
        )
    }

    /// Retries retryable failures: `max_attempts` in total (first attempt
    /// included), waiting as `backoff` grows from `base` up to `max`, spread
    /// by `jitter`. See [`RetryPolicy::new`].
    pub fn retry(
        self,
        max_attempts: u32,
        backoff: BackoffMode,
        base: Duration,
        max: Duration,
        jitter: JitterMode,
    ) -> Self {
        self.once(
            "retry",
            |b| &mut b.retry,
            (max_attempts, backoff, base, max, jitter),
        )
    }

    /// Caps retries across all operations with a bucket of retry tokens:
    /// `max_tokens` when full (it starts full), `refill_tokens` added every
    /// `refill_interval`, and a reservation returnable for `reservation_ttl`.
    /// See [`RetryBudgetSpec`].
    pub fn retry_budget(
        self,
        max_tokens: u32,
        refill_tokens: u32,
        refill_interval: Duration,
        reservation_ttl: Duration,
    ) -> Self {
        let spec = RetryBudgetSpec {
            max_tokens,
            refill_tokens,
            refill_interval,
            reservation_ttl,
        };
        self.once("retry_budget", |b| &mut b.retry_budget, spec)
    }

    /// The numbers of a token bucket for [`Builder::rate_limit`]: `capacity`
    /// tokens (starting full), `refill_tokens` added every `refill_interval`.
    pub fn token_bucket(
        capacity: u32,
        refill_tokens: u32,
        refill_interval: Duration,
    ) -> TokenBucketSpec {
        TokenBucketSpec {
            capacity,
            refill_tokens,
            refill_interval,
        }
    }

    /// Limits attempts (first attempts and retries alike) to one token each
    /// from `bucket`; without a token the attempt is rejected at once.
    pub fn rate_limit(self, bucket: TokenBucketSpec) -> Self {
        self.once("rate_limit", |b| &mut b.rate_limit, bucket)
    }

    /// A count-based breaker window over the last `calls` settled calls.
    pub fn last_calls(calls: u32) -> Window {
        Window::LastCalls(calls)
    }

    /// Opens the circuit when, over `window`, at least `minimum_calls` calls
    /// were recorded and failures / calls reached `failure_ratio`. It stays
    /// open for `open_duration`, then lets `half_open_probes` probes through
    /// at once; `half_open_successes` probe successes close it, one probe
    /// failure re-opens it, and a half-open state without a verdict after
    /// `half_open_max_wait` re-opens it too. See [`CircuitSpec`].
    #[allow(clippy::too_many_arguments)] // Mirrors the seed's seven numbers, in order.
    pub fn circuit_breaker(
        self,
        window: Window,
        minimum_calls: u32,
        failure_ratio: Ratio,
        open_duration: Duration,
        half_open_probes: u32,
        half_open_successes: u32,
        half_open_max_wait: Duration,
    ) -> Self {
        let spec = CircuitSpec {
            window,
            minimum_calls,
            failure_ratio,
            open_duration,
            half_open_probes,
            half_open_successes,
            half_open_max_wait,
        };
        self.once("circuit_breaker", |b| &mut b.circuit, spec)
    }

    /// At most `max_concurrent` calls in flight; up to `queue` more wait for
    /// a slot (never past their deadline), the rest are rejected.
    pub fn bulkhead(self, max_concurrent: u32, queue: u32) -> Self {
        let spec = BulkheadSpec {
            max_concurrent,
            queue,
        };
        self.once("bulkhead", |b| &mut b.bulkhead, spec)
    }

    /// Enables the fallback policy: `execute_with_fallback` may replace a
    /// final outcome that the classifier marks as fallback-eligible.
    pub fn fallback(mut self) -> Self {
        if self.fallback {
            self.duplicate.get_or_insert("fallback");
        }
        self.fallback = true;
        self
    }

    /// Checks everything and builds the pipeline on the real (tokio) clock
    /// with a random seed for attempt ids and jitter (feature `tokio`).
    #[cfg(feature = "tokio")]
    pub fn compile_in_memory<E>(
        self,
        classifier: Classifier<E>,
    ) -> Result<CompiledPipeline<E>, Error> {
        let seed = std::collections::hash_map::RandomState::new().hash_one(0x6b65_656c_u64);
        self.compile_in_memory_with(classifier, Arc::new(crate::clock::TokioClock::new()), seed)
    }

    /// Checks everything and builds the pipeline on `clock`, deriving attempt
    /// ids and jitter draws from `seed` (same seed, same ids and delays).
    pub fn compile_in_memory_with<E>(
        self,
        classifier: Classifier<E>,
        clock: Arc<dyn Clock>,
        seed: u64,
    ) -> Result<CompiledPipeline<E>, Error> {
        let config = self.check(&classifier)?;
        Ok(CompiledPipeline::new(config, classifier, clock, seed))
    }

    fn check<E>(self, classifier: &Classifier<E>) -> Result<Config, Error> {
        if let Some(method) = self.duplicate {
            return Err(Error::Duplicate { method });
        }
        let profile_id = ProfileId::new(&self.profile_id)?;
        let profile_version = ProfileVersion::new(&self.profile_version)?;
        let [application, environment, subject] = self.partition.ok_or(Error::MissingPartition)?;
        let mut partition = Partition::new(&application, &environment, &subject)?;
        if let Some(tenant) = &self.tenant {
            partition = partition.with_tenant(tenant)?;
        }
        let (attempt_timeout, requirement) =
            self.attempt_timeout.ok_or(Error::MissingAttemptTimeout)?;
        if attempt_timeout.is_zero()
            || attempt_timeout > Duration::from_millis(ATTEMPT_TIMEOUT_MS_MAX)
        {
            return Err(Error::AttemptTimeout {
                found: attempt_timeout,
            });
        }
        let retry = match self.retry {
            Some((max_attempts, backoff, base, max, jitter)) => {
                RetryPolicy::new(max_attempts, backoff, base, max, jitter)?
            }
            None => RetryPolicy::single_attempt(),
        };
        if let Some(spec) = &self.retry_budget {
            spec.validate()?;
            if retry.max_attempts() < 2 {
                return Err(Error::BudgetWithoutRetry);
            }
        }
        if let Some(spec) = &self.rate_limit {
            spec.validate()?;
        }
        if let Some(spec) = &self.circuit {
            spec.validate()?;
        }
        if let Some(spec) = &self.bulkhead {
            spec.validate()?;
        }
        if self.fallback && !classifier.allows_any_fallback() {
            return Err(Error::FallbackNeverEligible);
        }
        Ok(Config {
            profile_id,
            profile_version,
            partition,
            attempt_timeout,
            requirement,
            retry,
            retry_budget: self.retry_budget,
            rate_limit: self.rate_limit,
            circuit: self.circuit,
            bulkhead: self.bulkhead,
            fallback: self.fallback,
        })
    }
}
