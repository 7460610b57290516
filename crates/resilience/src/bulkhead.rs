//! The bulkhead: a cap on calls in flight plus a bounded queue of waiters.
//!
//! `max_concurrent` slots are handed out in arrival order by a small fair
//! semaphore of our own (no runtime needed, so the crate's admission path
//! also runs on a simulator's virtual time).
//! When every slot is taken, up to `queue` admissions may wait for one, in
//! arrival order and never past the operation's deadline; any further
//! admission is rejected at once as `bulkhead_full`. A slot is freed when its
//! admission is settled or dropped, and a waiter that gives up leaves the
//! queue, both through drop guards, so cancellation never leaks a slot.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::task::{Context, Poll, Waker};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::clock::{until_deadline, Clock, Instant};

/// Most calls a bulkhead may allow in flight.
pub const BULKHEAD_CONCURRENT_MAX: u32 = 100_000;
/// Most admissions a bulkhead may queue.
pub const BULKHEAD_QUEUE_MAX: u32 = 100_000;

/// Why a bulkhead was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// `max_concurrent` was zero or above [`BULKHEAD_CONCURRENT_MAX`].
    #[error("bulkhead max concurrent must be in 1..={BULKHEAD_CONCURRENT_MAX}, found {found}")]
    MaxConcurrent {
        /// The value given.
        found: u32,
    },
    /// `queue` was above [`BULKHEAD_QUEUE_MAX`].
    #[error("bulkhead queue must be in 0..={BULKHEAD_QUEUE_MAX}, found {found}")]
    Queue {
        /// The value given.
        found: u32,
    },
}

/// The numbers of a bulkhead.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct BulkheadSpec {
    /// Calls allowed in flight at once.
    pub max_concurrent: u32,
    /// Admissions allowed to wait for a slot; 0 rejects as soon as every slot
    /// is taken.
    pub queue: u32,
}

impl BulkheadSpec {
    /// Checks both numbers.
    pub fn validate(&self) -> Result<(), Error> {
        if self.max_concurrent == 0 || self.max_concurrent > BULKHEAD_CONCURRENT_MAX {
            return Err(Error::MaxConcurrent {
                found: self.max_concurrent,
            });
        }
        if self.queue > BULKHEAD_QUEUE_MAX {
            return Err(Error::Queue { found: self.queue });
        }
        Ok(())
    }
}

/// Why the bulkhead did not hand out a slot.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Refusal {
    /// Every slot and every queue place was taken.
    Full,
    /// The operation's deadline came while waiting in the queue.
    Deadline,
}

/// A fair counting semaphore: a freed slot goes to the longest waiter, and
/// nobody overtakes a waiter by trying at the right moment.
#[derive(Debug)]
pub(crate) struct Slots {
    state: Mutex<SlotState>,
}

#[derive(Debug)]
struct SlotState {
    free: u32,
    next_ticket: u64,
    /// Waiters in arrival order: their ticket, their waker, and whether a
    /// freed slot was handed to them.
    waiters: VecDeque<(u64, Option<Waker>, bool)>,
}

impl Slots {
    fn new(slots: u32) -> Self {
        Slots {
            state: Mutex::new(SlotState {
                free: slots,
                next_ticket: 0,
                waiters: VecDeque::new(),
            }),
        }
    }

    fn try_acquire(&self) -> Option<SlotPermit<'_>> {
        let mut st = self.state.lock();
        if st.free > 0 && st.waiters.is_empty() {
            st.free -= 1;
            Some(SlotPermit { slots: self })
        } else {
            None
        }
    }

    fn acquire(&self) -> Acquire<'_> {
        Acquire {
            slots: self,
            ticket: None,
        }
    }

    fn free(&self) -> u32 {
        self.state.lock().free
    }

    /// Gives a slot back: to the first waiter not yet served, or to the pool.
    fn release(&self) {
        let mut st = self.state.lock();
        if let Some(w) = st.waiters.iter_mut().find(|w| !w.2) {
            w.2 = true;
            if let Some(waker) = w.1.take() {
                waker.wake();
            }
        } else {
            st.free += 1;
        }
    }
}

/// One slot, given back on drop.
#[derive(Debug)]
pub(crate) struct SlotPermit<'a> {
    slots: &'a Slots,
}

impl Drop for SlotPermit<'_> {
    fn drop(&mut self) {
        self.slots.release();
    }
}

/// Waiting for a slot; leaving the queue on drop (a slot handed to a waiter
/// that gave up goes on to the next one).
struct Acquire<'a> {
    slots: &'a Slots,
    ticket: Option<u64>,
}

impl<'a> Future for Acquire<'a> {
    type Output = SlotPermit<'a>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<SlotPermit<'a>> {
        let slots = self.slots;
        let mut st = slots.state.lock();
        match self.ticket {
            None => {
                if st.free > 0 && st.waiters.is_empty() {
                    st.free -= 1;
                    return Poll::Ready(SlotPermit { slots });
                }
                let ticket = st.next_ticket;
                st.next_ticket += 1;
                st.waiters
                    .push_back((ticket, Some(cx.waker().clone()), false));
                self.ticket = Some(ticket);
                Poll::Pending
            }
            Some(ticket) => {
                let i = st
                    .waiters
                    .iter()
                    .position(|w| w.0 == ticket)
                    .expect("a waiter stays queued until served or dropped");
                if st.waiters[i].2 {
                    st.waiters.remove(i);
                    self.ticket = None;
                    return Poll::Ready(SlotPermit { slots });
                }
                st.waiters[i].1 = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

impl Drop for Acquire<'_> {
    fn drop(&mut self) {
        let Some(ticket) = self.ticket else { return };
        let served = {
            let mut st = self.slots.state.lock();
            match st.waiters.iter().position(|w| w.0 == ticket) {
                Some(i) => st.waiters.remove(i).is_some_and(|w| w.2),
                None => false,
            }
        };
        if served {
            self.slots.release();
        }
    }
}

/// A live bulkhead.
#[derive(Debug)]
pub(crate) struct Bulkhead {
    spec: BulkheadSpec,
    slots: Slots,
    queued: AtomicU32,
}

impl Bulkhead {
    /// A bulkhead with every slot free. The spec must have been validated.
    pub(crate) fn new(spec: BulkheadSpec) -> Self {
        debug_assert_eq!(spec.validate(), Ok(()));
        Bulkhead {
            spec,
            slots: Slots::new(spec.max_concurrent),
            queued: AtomicU32::new(0),
        }
    }

    /// A free slot, without waiting.
    pub(crate) fn try_acquire(&self) -> Option<SlotPermit<'_>> {
        self.slots.try_acquire()
    }

    /// A free slot, waiting in the bounded queue until `deadline` if needed.
    pub(crate) async fn acquire(
        &self,
        clock: &dyn Clock,
        deadline: Instant,
    ) -> Result<SlotPermit<'_>, Refusal> {
        if let Some(permit) = self.try_acquire() {
            return Ok(permit);
        }
        let limit = self.spec.queue;
        if self
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |queued| {
                (queued < limit).then_some(queued + 1)
            })
            .is_err()
        {
            return Err(Refusal::Full);
        }
        let _place = QueuePlace(&self.queued);
        match until_deadline(clock, deadline, self.slots.acquire()).await {
            Some(permit) => Ok(permit),
            None => Err(Refusal::Deadline),
        }
    }

    /// Slots currently handed out.
    pub(crate) fn in_use(&self) -> u32 {
        self.spec.max_concurrent.saturating_sub(self.slots.free())
    }

    /// Admissions currently waiting for a slot.
    pub(crate) fn queued(&self) -> u32 {
        self.queued.load(Ordering::Acquire)
    }
}

/// A place in the queue, given up on drop (also when the waiter is cancelled).
struct QueuePlace<'a>(&'a AtomicU32);

impl Drop for QueuePlace<'_> {
    fn drop(&mut self) {
        let before = self.0.fetch_sub(1, Ordering::AcqRel);
        debug_assert!(before > 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use futures::FutureExt;
    use std::time::Duration;

    #[test]
    fn invalid_numbers_are_refused() {
        // Goal: a zero cap and an oversized queue are refused.
        // Method: validate both.
        let spec = |max_concurrent, queue| BulkheadSpec {
            max_concurrent,
            queue,
        };
        assert_eq!(
            spec(0, 0).validate(),
            Err(Error::MaxConcurrent { found: 0 })
        );
        assert_eq!(
            spec(1, BULKHEAD_QUEUE_MAX + 1).validate(),
            Err(Error::Queue {
                found: BULKHEAD_QUEUE_MAX + 1
            })
        );
        assert_eq!(spec(1, 0).validate(), Ok(()));
    }

    #[test]
    fn queue_is_bounded_and_waiters_get_freed_slots() {
        // Goal: with one slot and a queue of one, the third caller is rejected,
        // and the queued caller gets the slot when it is freed.
        // Method: poll acquisitions by hand with a manual clock.
        let clock = ManualClock::new();
        let deadline = Instant::ZERO + Duration::from_secs(1);
        let bulkhead = Bulkhead::new(BulkheadSpec {
            max_concurrent: 1,
            queue: 1,
        });
        let first = bulkhead.try_acquire().expect("free slot");
        let mut waiter = Box::pin(bulkhead.acquire(&clock, deadline));
        assert!(waiter.as_mut().now_or_never().is_none());
        assert_eq!(bulkhead.queued(), 1);
        let third = bulkhead.acquire(&clock, deadline).now_or_never();
        assert!(matches!(third, Some(Err(Refusal::Full))));
        drop(first);
        let second = waiter.now_or_never().expect("woken").expect("slot");
        assert_eq!(bulkhead.queued(), 0);
        assert_eq!(bulkhead.in_use(), 1);
        drop(second);
        assert_eq!(bulkhead.in_use(), 0);
    }

    #[test]
    fn queued_waiter_gives_up_at_the_deadline() {
        // Goal: waiting in the queue never outlasts the deadline, and leaves the queue.
        // Method: queue behind a held slot, advance the manual clock to the deadline.
        let clock = ManualClock::new();
        let deadline = Instant::ZERO + Duration::from_millis(5);
        let bulkhead = Bulkhead::new(BulkheadSpec {
            max_concurrent: 1,
            queue: 4,
        });
        let _held = bulkhead.try_acquire().unwrap();
        let mut waiter = Box::pin(bulkhead.acquire(&clock, deadline));
        assert!(waiter.as_mut().now_or_never().is_none());
        clock.advance(Duration::from_millis(5));
        assert!(matches!(
            waiter.now_or_never(),
            Some(Err(Refusal::Deadline))
        ));
        assert_eq!(bulkhead.queued(), 0);
    }
}
