//! Injected time: the [`Clock`] trait, its tokio-backed implementation and a
//! manual clock for tests.
//!
//! This module owns every reading of time in the crate. Policies never call
//! `std::time::Instant::now()` or `tokio::time::sleep` themselves: they ask the
//! pipeline's clock, so a test can drive every policy in virtual time, either
//! with [`TokioClock`] inside a runtime started with `start_paused(true)` or
//! with [`ManualClock`], which only moves when told to.

use std::fmt;
use std::future::Future;
use std::ops::Add;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use futures::future::BoxFuture;
use parking_lot::Mutex;

/// A monotonic instant: the time elapsed since the epoch of the clock that
/// produced it.
///
/// Instants from two different clocks are not comparable; a pipeline and the
/// contexts it creates always use the pipeline's clock.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
pub struct Instant(Duration);

impl Instant {
    /// The clock's epoch.
    pub const ZERO: Instant = Instant(Duration::ZERO);

    /// The instant `since_epoch` after the clock's epoch.
    pub const fn from_epoch(since_epoch: Duration) -> Self {
        Instant(since_epoch)
    }

    /// Time elapsed since the clock's epoch.
    pub const fn since_epoch(self) -> Duration {
        self.0
    }

    /// Time from `earlier` to `self`, or zero when `earlier` is later.
    pub fn saturating_duration_since(self, earlier: Instant) -> Duration {
        self.0.saturating_sub(earlier.0)
    }

    /// `self + duration`, saturating at the largest representable instant.
    pub fn saturating_add(self, duration: Duration) -> Instant {
        Instant(self.0.saturating_add(duration))
    }
}

impl Add<Duration> for Instant {
    type Output = Instant;

    /// Saturating addition: instants never wrap.
    fn add(self, duration: Duration) -> Instant {
        self.saturating_add(duration)
    }
}

/// A source of monotonic time and of asynchronous sleeps.
///
/// Implementations must be monotonic: `now()` never goes backwards.
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// The current instant.
    fn now(&self) -> Instant;

    /// A future that completes once `duration` has elapsed on this clock.
    /// It holds no pipeline state, so dropping it early is always safe.
    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()>;

    /// A future that completes once this clock reaches `deadline`.
    fn sleep_until(&self, deadline: Instant) -> BoxFuture<'static, ()> {
        self.sleep(deadline.saturating_duration_since(self.now()))
    }
}

/// The real clock (feature `tokio`, on by default): `tokio::time`, so it also follows a runtime's paused,
/// auto-advancing test time (`#[tokio::test(start_paused = true)]`).
///
/// `now()` works outside a runtime; `sleep()` must be polled inside a tokio
/// runtime with the time driver enabled.
#[cfg(feature = "tokio")]
#[derive(Clone, Copy, Debug)]
pub struct TokioClock {
    epoch: tokio::time::Instant,
}

#[cfg(feature = "tokio")]
impl TokioClock {
    /// A clock whose epoch is the current instant.
    pub fn new() -> Self {
        TokioClock {
            epoch: tokio::time::Instant::now(),
        }
    }
}

#[cfg(feature = "tokio")]
impl Default for TokioClock {
    fn default() -> Self {
        TokioClock::new()
    }
}

#[cfg(feature = "tokio")]
impl Clock for TokioClock {
    fn now(&self) -> Instant {
        Instant(tokio::time::Instant::now().saturating_duration_since(self.epoch))
    }

    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        Box::pin(tokio::time::sleep(duration))
    }

    fn sleep_until(&self, deadline: Instant) -> BoxFuture<'static, ()> {
        let at = self.epoch + deadline.since_epoch();
        Box::pin(tokio::time::sleep_until(at))
    }
}

/// A virtual clock that moves only when [`ManualClock::advance`] is called.
///
/// Sleeps complete when the clock is advanced to or past their deadline. Clones
/// share the same time.
#[derive(Clone, Debug, Default)]
pub struct ManualClock {
    inner: Arc<Mutex<ManualState>>,
}

#[derive(Debug, Default)]
struct ManualState {
    now: Duration,
    sleepers: Vec<Waker>,
}

impl ManualClock {
    /// A manual clock standing at its epoch.
    pub fn new() -> Self {
        ManualClock::default()
    }

    /// Moves time forward by `duration` and wakes every pending sleep so it
    /// can check its deadline.
    pub fn advance(&self, duration: Duration) {
        let wakers = {
            let mut state = self.inner.lock();
            state.now = state.now.saturating_add(duration);
            std::mem::take(&mut state.sleepers)
        };
        for waker in wakers {
            waker.wake();
        }
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        Instant(self.inner.lock().now)
    }

    fn sleep(&self, duration: Duration) -> BoxFuture<'static, ()> {
        let deadline = self.now() + duration;
        self.sleep_until(deadline)
    }

    fn sleep_until(&self, deadline: Instant) -> BoxFuture<'static, ()> {
        Box::pin(ManualSleep {
            inner: Arc::clone(&self.inner),
            deadline,
        })
    }
}

/// The sleep future of [`ManualClock`].
#[derive(Debug)]
struct ManualSleep {
    inner: Arc<Mutex<ManualState>>,
    deadline: Instant,
}

impl Future for ManualSleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let mut state = self.inner.lock();
        if Instant(state.now) >= self.deadline {
            return Poll::Ready(());
        }
        // Waking a sleep that is not due yet is harmless: it re-registers.
        if !state.sleepers.iter().any(|w| w.will_wake(cx.waker())) {
            state.sleepers.push(cx.waker().clone());
        }
        Poll::Pending
    }
}

/// Runs `future` until `deadline` on `clock`: `Some(output)` when it finishes
/// first, `None` when the deadline comes first, in which case `future` is
/// dropped. The future is polled before the timer, so an output ready at the
/// deadline wins, and the timer is only created when the future is pending,
/// so a future that completes on its first poll costs no timer.
pub(crate) async fn until_deadline<F: Future>(
    clock: &dyn Clock,
    deadline: Instant,
    future: F,
) -> Option<F::Output> {
    let mut future = std::pin::pin!(future);
    let mut timer: Option<BoxFuture<'static, ()>> = None;
    std::future::poll_fn(|cx| {
        if let Poll::Ready(output) = future.as_mut().poll(cx) {
            return Poll::Ready(Some(output));
        }
        let timer = timer.get_or_insert_with(|| clock.sleep_until(deadline));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;

    #[test]
    fn manual_clock_sleep_completes_only_at_its_deadline() {
        // Goal: a manual sleep is pending until the clock reaches its deadline.
        // Method: poll the sleep with now_or_never before and after advancing.
        let clock = ManualClock::new();
        let mut sleep = clock.sleep(Duration::from_millis(10));
        assert!((&mut sleep).now_or_never().is_none());
        clock.advance(Duration::from_millis(9));
        assert!((&mut sleep).now_or_never().is_none());
        clock.advance(Duration::from_millis(1));
        assert!(sleep.now_or_never().is_some());
        assert_eq!(clock.now(), Instant::from_epoch(Duration::from_millis(10)));
    }

    #[tokio::test(start_paused = true)]
    async fn tokio_clock_follows_paused_time() {
        // Goal: TokioClock reads and sleeps in tokio's paused virtual time.
        // Method: sleep one hour of virtual time and compare the readings.
        let clock = TokioClock::new();
        let before = clock.now();
        clock.sleep(Duration::from_secs(3600)).await;
        assert_eq!(
            clock.now().saturating_duration_since(before),
            Duration::from_secs(3600)
        );
        clock.sleep_until(before + Duration::from_secs(3601)).await;
        assert_eq!(clock.now(), before + Duration::from_secs(3601));
    }
}
