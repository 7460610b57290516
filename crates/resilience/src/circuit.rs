//! The circuit breaker: a count-based window over the last calls, an open
//! period, and a half-open trial with a bounded number of probes.
//!
//! States and transitions (evaluated lazily, at admission and settlement):
//!
//! ```text
//! Closed   --(window holds >= minimum_calls and failures/calls >= ratio)--> Open
//! Open     --(open_duration elapsed, at the next admission)-------------> HalfOpen
//! HalfOpen --(successes reach required_successes)------------------------> Closed
//! HalfOpen --(a probe fails)---------------------------------------------> Open
//! HalfOpen --(half_open_max_wait elapsed without a verdict)--------------> Open
//! ```
//!
//! Each transition starts a new generation. A ticket handed out at admission
//! carries its generation, and a settlement from an older generation is
//! ignored, so a slow call admitted while closed cannot re-open a circuit that
//! has since recovered. Releasing a ticket uncounted frees a half-open probe
//! slot without recording anything.

use std::time::Duration;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::classify::Verdict;
use crate::clock::Instant;

/// Largest count-based window, in calls.
pub const CIRCUIT_WINDOW_CALLS_MAX: u32 = 10_000;
/// Most half-open probes in flight at once, and most successes required.
pub const CIRCUIT_PROBES_MAX: u32 = 1_000;
/// Longest open duration and half-open wait, in milliseconds (one day).
pub const CIRCUIT_DURATION_MS_MAX: u64 = 86_400_000;

/// Why a circuit breaker was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The window was empty or above [`CIRCUIT_WINDOW_CALLS_MAX`].
    #[error("circuit window must hold 1..={CIRCUIT_WINDOW_CALLS_MAX} calls, found {found}")]
    Window {
        /// The window size given.
        found: u32,
    },
    /// The minimum number of calls was zero or above the window size.
    #[error("circuit minimum calls must be in 1..=window ({window}), found {found}")]
    MinimumCalls {
        /// The window size.
        window: u32,
        /// The value given.
        found: u32,
    },
    /// The failure ratio was not in `(0, 1]`.
    #[error("circuit failure ratio must be in (0, 1], found {numerator}/{denominator}")]
    Ratio {
        /// The numerator given.
        numerator: u32,
        /// The denominator given.
        denominator: u32,
    },
    /// A duration was zero or above [`CIRCUIT_DURATION_MS_MAX`].
    #[error("circuit {what} must be in 1ns..={CIRCUIT_DURATION_MS_MAX} ms, found {found:?}")]
    Duration {
        /// Which duration.
        what: &'static str,
        /// The duration given.
        found: Duration,
    },
    /// A half-open count was zero or above [`CIRCUIT_PROBES_MAX`].
    #[error("circuit {what} must be in 1..={CIRCUIT_PROBES_MAX}, found {found}")]
    Probes {
        /// Which count.
        what: &'static str,
        /// The value given.
        found: u32,
    },
}

/// A ratio `numerator / denominator`, checked when the pipeline is compiled.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct Ratio {
    numerator: u32,
    denominator: u32,
}

impl Ratio {
    /// The ratio `numerator / denominator`.
    pub const fn of(numerator: u32, denominator: u32) -> Self {
        Ratio {
            numerator,
            denominator,
        }
    }

    /// The numerator.
    pub const fn numerator(self) -> u32 {
        self.numerator
    }

    /// The denominator.
    pub const fn denominator(self) -> u32 {
        self.denominator
    }

    /// Whether `part / whole >= self`, in exact integer arithmetic.
    fn reached_by(self, part: u32, whole: u32) -> bool {
        u64::from(part) * u64::from(self.denominator)
            >= u64::from(self.numerator) * u64::from(whole)
    }
}

/// Which calls the breaker's failure ratio is computed over.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum Window {
    /// The last N settled calls (success or failure; ignored outcomes are not
    /// recorded).
    LastCalls(u32),
}

/// The numbers of a circuit breaker, in the order of
/// `Builder::circuit_breaker`'s arguments.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct CircuitSpec {
    /// The window the failure ratio is computed over.
    pub window: Window,
    /// Calls the window must hold before the ratio can open the circuit.
    pub minimum_calls: u32,
    /// Failures / calls at or above which the circuit opens.
    pub failure_ratio: Ratio,
    /// How long the circuit stays open before it lets probes through.
    pub open_duration: Duration,
    /// Probes allowed in flight at once while half-open.
    pub half_open_probes: u32,
    /// Probe successes that close the circuit again.
    pub half_open_successes: u32,
    /// Longest the circuit may stay half-open without a verdict (for example
    /// because a probe hangs); then it opens again for `open_duration`.
    pub half_open_max_wait: Duration,
}

impl CircuitSpec {
    /// Checks every number and their combination.
    pub fn validate(&self) -> Result<(), Error> {
        let Window::LastCalls(window) = self.window;
        if window == 0 || window > CIRCUIT_WINDOW_CALLS_MAX {
            return Err(Error::Window { found: window });
        }
        if self.minimum_calls == 0 || self.minimum_calls > window {
            return Err(Error::MinimumCalls {
                window,
                found: self.minimum_calls,
            });
        }
        let Ratio {
            numerator,
            denominator,
        } = self.failure_ratio;
        if numerator == 0 || denominator == 0 || numerator > denominator {
            return Err(Error::Ratio {
                numerator,
                denominator,
            });
        }
        for (what, found) in [
            ("open duration", self.open_duration),
            ("half-open max wait", self.half_open_max_wait),
        ] {
            if found.is_zero() || found > Duration::from_millis(CIRCUIT_DURATION_MS_MAX) {
                return Err(Error::Duration { what, found });
            }
        }
        for (what, found) in [
            ("half-open probes", self.half_open_probes),
            ("half-open successes", self.half_open_successes),
        ] {
            if found == 0 || found > CIRCUIT_PROBES_MAX {
                return Err(Error::Probes { what, found });
            }
        }
        Ok(())
    }
}

/// The breaker's state as seen from outside.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub enum CircuitState {
    /// Calls flow and are recorded in the window.
    Closed,
    /// Calls are rejected until the open duration has elapsed.
    Open,
    /// A bounded number of probes decides whether to close again.
    HalfOpen,
}

/// What an admission took from the breaker.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Ticket {
    generation: u64,
    probe: bool,
}

impl Ticket {
    /// Whether the ticket holds a half-open probe slot.
    pub(crate) fn is_probe(self) -> bool {
        self.probe
    }
}

/// Why the breaker refused an admission.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Refusal {
    /// Time until the open period ends; `None` while half-open with every
    /// probe slot taken.
    pub(crate) retry_after: Option<Duration>,
}

/// A live circuit breaker.
#[derive(Debug)]
pub(crate) struct CircuitBreaker {
    spec: CircuitSpec,
    state: Mutex<BreakerState>,
}

#[derive(Debug)]
struct BreakerState {
    generation: u64,
    phase: Phase,
    /// Ring of the last outcomes while closed: `true` is a failure.
    ring: Box<[bool]>,
    head: usize,
    len: u32,
    failures: u32,
}

#[derive(Debug, Clone, Copy)]
enum Phase {
    Closed,
    Open {
        until: Instant,
    },
    HalfOpen {
        since: Instant,
        in_flight: u32,
        successes: u32,
    },
}

impl CircuitBreaker {
    /// A closed breaker. The spec must have been validated.
    pub(crate) fn new(spec: CircuitSpec) -> Self {
        debug_assert_eq!(spec.validate(), Ok(()));
        let Window::LastCalls(window) = spec.window;
        CircuitBreaker {
            spec,
            state: Mutex::new(BreakerState {
                generation: 0,
                phase: Phase::Closed,
                ring: vec![false; window as usize].into_boxed_slice(),
                head: 0,
                len: 0,
                failures: 0,
            }),
        }
    }

    /// Admits a call, moving Open to HalfOpen when the open period is over.
    pub(crate) fn admit(&self, now: Instant) -> Result<Ticket, Refusal> {
        let mut guard = self.state.lock();
        let state = &mut *guard;
        if let Phase::Open { until } = state.phase {
            if now < until {
                return Err(Refusal {
                    retry_after: Some(until.saturating_duration_since(now)),
                });
            }
            state.transition(Phase::HalfOpen {
                since: now,
                in_flight: 0,
                successes: 0,
            });
        }
        match &mut state.phase {
            Phase::Closed => Ok(Ticket {
                generation: state.generation,
                probe: false,
            }),
            Phase::HalfOpen {
                since, in_flight, ..
            } => {
                if now.saturating_duration_since(*since) >= self.spec.half_open_max_wait {
                    self.open(state, now);
                    return Err(Refusal {
                        retry_after: Some(self.spec.open_duration),
                    });
                }
                if *in_flight >= self.spec.half_open_probes {
                    return Err(Refusal { retry_after: None });
                }
                *in_flight += 1;
                Ok(Ticket {
                    generation: state.generation,
                    probe: true,
                })
            }
            Phase::Open { .. } => unreachable!("an elapsed open phase became half-open above"),
        }
    }

    /// Records the verdict of a dispatched call.
    pub(crate) fn settle(&self, ticket: Ticket, verdict: Verdict, now: Instant) {
        let mut guard = self.state.lock();
        let state = &mut *guard;
        if ticket.generation != state.generation {
            return;
        }
        match &mut state.phase {
            Phase::Closed => {
                debug_assert!(!ticket.probe);
                let failed = match verdict {
                    Verdict::Success => false,
                    Verdict::Failure => true,
                    Verdict::Ignored => return,
                };
                state.record(failed);
                if state.len >= self.spec.minimum_calls
                    && self
                        .spec
                        .failure_ratio
                        .reached_by(state.failures, state.len)
                {
                    self.open(state, now);
                }
            }
            Phase::HalfOpen {
                since,
                in_flight,
                successes,
            } => {
                debug_assert!(ticket.probe && *in_flight > 0);
                *in_flight -= 1;
                if now.saturating_duration_since(*since) >= self.spec.half_open_max_wait {
                    self.open(state, now);
                    return;
                }
                match verdict {
                    Verdict::Success => {
                        *successes += 1;
                        if *successes >= self.spec.half_open_successes {
                            state.transition(Phase::Closed);
                        }
                    }
                    Verdict::Failure => self.open(state, now),
                    Verdict::Ignored => {}
                }
            }
            Phase::Open { .. } => {
                unreachable!("no ticket is handed out in an open generation")
            }
        }
    }

    /// Releases a ticket without recording anything: a half-open probe slot
    /// is freed, a closed ticket needs nothing.
    pub(crate) fn release(&self, ticket: Ticket) {
        if !ticket.probe {
            return;
        }
        let mut state = self.state.lock();
        if ticket.generation != state.generation {
            return;
        }
        if let Phase::HalfOpen { in_flight, .. } = &mut state.phase {
            debug_assert!(*in_flight > 0);
            *in_flight -= 1;
        }
    }

    /// The state at `now`, applying the lazy Open to HalfOpen rule without
    /// changing anything.
    pub(crate) fn state(&self, now: Instant) -> CircuitState {
        match self.state.lock().phase {
            Phase::Closed => CircuitState::Closed,
            Phase::Open { until } if now < until => CircuitState::Open,
            Phase::Open { .. } | Phase::HalfOpen { .. } => CircuitState::HalfOpen,
        }
    }

    fn open(&self, state: &mut BreakerState, now: Instant) {
        state.transition(Phase::Open {
            until: now + self.spec.open_duration,
        });
    }
}

impl BreakerState {
    fn transition(&mut self, phase: Phase) {
        self.generation += 1;
        self.phase = phase;
        self.head = 0;
        self.len = 0;
        self.failures = 0;
    }

    fn record(&mut self, failed: bool) {
        let capacity = self.ring.len();
        if self.len as usize == capacity {
            // The oldest outcome sits at head when the ring is full.
            if self.ring[self.head] {
                self.failures -= 1;
            }
            self.len -= 1;
        }
        self.ring[self.head] = failed;
        self.head = (self.head + 1) % capacity;
        self.len += 1;
        if failed {
            self.failures += 1;
        }
        debug_assert!(self.failures <= self.len && self.len as usize <= capacity);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Instant {
        Instant::from_epoch(Duration::from_millis(ms))
    }

    /// The seed's breaker: last 10 calls, 4 minimum, 1/2, 30 s open, 1 probe,
    /// 1 success, 10 s half-open max wait.
    fn seed_spec() -> CircuitSpec {
        CircuitSpec {
            window: Window::LastCalls(10),
            minimum_calls: 4,
            failure_ratio: Ratio::of(1, 2),
            open_duration: Duration::from_secs(30),
            half_open_probes: 1,
            half_open_successes: 1,
            half_open_max_wait: Duration::from_secs(10),
        }
    }

    fn call(breaker: &CircuitBreaker, verdict: Verdict, now: Instant) {
        let ticket = breaker.admit(now).expect("admitted");
        breaker.settle(ticket, verdict, now);
    }

    #[test]
    fn invalid_numbers_are_refused() {
        // Goal: every breaker rule has its typed error.
        // Method: break one field of the seed's spec at a time.
        let with = |change: fn(&mut CircuitSpec)| {
            let mut spec = seed_spec();
            change(&mut spec);
            spec.validate()
        };
        assert_eq!(seed_spec().validate(), Ok(()));
        assert_eq!(
            with(|s| s.window = Window::LastCalls(0)),
            Err(Error::Window { found: 0 })
        );
        assert_eq!(
            with(|s| s.minimum_calls = 11),
            Err(Error::MinimumCalls {
                window: 10,
                found: 11
            })
        );
        assert!(matches!(
            with(|s| s.failure_ratio = Ratio::of(3, 2)),
            Err(Error::Ratio { .. })
        ));
        assert!(matches!(
            with(|s| s.failure_ratio = Ratio::of(0, 2)),
            Err(Error::Ratio { .. })
        ));
        assert!(matches!(
            with(|s| s.failure_ratio = Ratio::of(1, 0)),
            Err(Error::Ratio { .. })
        ));
        assert!(matches!(
            with(|s| s.open_duration = Duration::ZERO),
            Err(Error::Duration {
                what: "open duration",
                ..
            })
        ));
        assert!(matches!(
            with(|s| s.half_open_probes = 0),
            Err(Error::Probes {
                what: "half-open probes",
                ..
            })
        ));
    }

    #[test]
    fn opens_only_after_minimum_calls_at_the_ratio() {
        // Goal: the window opens the circuit at >= ratio once minimum calls are in.
        // Method: three failures (below minimum) stay closed; a fourth call opens.
        let breaker = CircuitBreaker::new(seed_spec());
        for _ in 0..3 {
            call(&breaker, Verdict::Failure, at(0));
        }
        assert_eq!(breaker.state(at(0)), CircuitState::Closed);
        call(&breaker, Verdict::Success, at(0));
        assert_eq!(breaker.state(at(0)), CircuitState::Open);
        assert_eq!(
            breaker.admit(at(1_000)),
            Err(Refusal {
                retry_after: Some(Duration::from_secs(29))
            })
        );
    }

    #[test]
    fn old_failures_slide_out_of_the_window() {
        // Goal: only the last N calls count.
        // Method: 1 failure then 10 successes, then failures up to just below 1/2.
        let breaker = CircuitBreaker::new(seed_spec());
        call(&breaker, Verdict::Failure, at(0));
        for _ in 0..10 {
            call(&breaker, Verdict::Success, at(0));
        }
        for _ in 0..4 {
            call(&breaker, Verdict::Failure, at(0));
        }
        // Window: 6 successes, 4 failures: 0.4 < 0.5.
        assert_eq!(breaker.state(at(0)), CircuitState::Closed);
        call(&breaker, Verdict::Failure, at(0));
        assert_eq!(breaker.state(at(0)), CircuitState::Open);
    }

    #[test]
    fn ignored_outcomes_are_not_recorded() {
        // Goal: Verdict::Ignored neither fails nor succeeds.
        // Method: many ignored outcomes then four failures at minimum calls.
        let breaker = CircuitBreaker::new(seed_spec());
        for _ in 0..20 {
            call(&breaker, Verdict::Ignored, at(0));
        }
        assert_eq!(breaker.state(at(0)), CircuitState::Closed);
        for _ in 0..4 {
            call(&breaker, Verdict::Failure, at(0));
        }
        assert_eq!(breaker.state(at(0)), CircuitState::Open);
    }

    fn opened() -> CircuitBreaker {
        let breaker = CircuitBreaker::new(seed_spec());
        for _ in 0..4 {
            call(&breaker, Verdict::Failure, at(0));
        }
        breaker
    }

    #[test]
    fn half_open_admits_the_permitted_probes_and_closes_on_success() {
        // Goal: after the open period one probe is admitted; its success closes.
        // Method: open, advance 30 s, admit a probe, refuse a second, settle.
        let breaker = opened();
        let probe = breaker.admit(at(30_000)).expect("probe");
        assert_eq!(breaker.state(at(30_000)), CircuitState::HalfOpen);
        assert_eq!(
            breaker.admit(at(30_001)),
            Err(Refusal { retry_after: None })
        );
        breaker.settle(probe, Verdict::Success, at(30_002));
        assert_eq!(breaker.state(at(30_002)), CircuitState::Closed);
    }

    #[test]
    fn a_failed_probe_reopens() {
        // Goal: one probe failure opens the circuit for a fresh open period.
        // Method: fail the probe at 31 s and check the refusal until 61 s.
        let breaker = opened();
        let probe = breaker.admit(at(30_000)).unwrap();
        breaker.settle(probe, Verdict::Failure, at(31_000));
        assert_eq!(
            breaker.admit(at(31_000)),
            Err(Refusal {
                retry_after: Some(Duration::from_secs(30))
            })
        );
        assert!(breaker.admit(at(61_000)).is_ok());
    }

    #[test]
    fn released_probe_frees_its_slot_uncounted() {
        // Goal: a released probe records nothing and lets the next probe in.
        // Method: release the only probe, then admit another and settle it.
        let breaker = opened();
        let probe = breaker.admit(at(30_000)).unwrap();
        breaker.release(probe);
        assert_eq!(breaker.state(at(30_000)), CircuitState::HalfOpen);
        let second = breaker.admit(at(30_000)).expect("slot freed");
        breaker.settle(second, Verdict::Success, at(30_000));
        assert_eq!(breaker.state(at(30_000)), CircuitState::Closed);
    }

    #[test]
    fn half_open_without_verdict_reopens_after_max_wait() {
        // Goal: a hung probe cannot keep the circuit half-open forever.
        // Method: admit a probe, never settle it, admit again 10 s later.
        let breaker = opened();
        let hung = breaker.admit(at(30_000)).unwrap();
        assert_eq!(
            breaker.admit(at(40_000)),
            Err(Refusal {
                retry_after: Some(Duration::from_secs(30))
            })
        );
        // The hung probe's late success belongs to an old generation.
        breaker.settle(hung, Verdict::Success, at(40_001));
        assert_eq!(breaker.state(at(40_001)), CircuitState::Open);
    }

    #[test]
    fn stale_settlements_are_ignored() {
        // Goal: a call admitted before the circuit opened cannot affect later state.
        // Method: admit while closed, open the circuit, recover, then settle the old ticket.
        let breaker = CircuitBreaker::new(seed_spec());
        let slow = breaker.admit(at(0)).unwrap();
        for _ in 0..4 {
            call(&breaker, Verdict::Failure, at(0));
        }
        call(&breaker, Verdict::Success, at(30_000));
        assert_eq!(breaker.state(at(30_000)), CircuitState::Closed);
        breaker.settle(slow, Verdict::Failure, at(30_000));
        for _ in 0..3 {
            call(&breaker, Verdict::Failure, at(30_000));
        }
        // Only three failures count in this generation: still closed.
        assert_eq!(breaker.state(at(30_000)), CircuitState::Closed);
    }
}
