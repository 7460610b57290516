//! The deterministic executor: polls a run's coroutines in FIFO order.
//!
//! One executor per run, on one thread. The only thing that decides order is
//! the ready queue: a coroutine is queued when spawned and each time its
//! waker fires, at most once until it is polled. Nothing here reads a clock
//! or draws randomness, so the same inputs give the same polls.

use std::collections::VecDeque;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use parking_lot::Mutex;

/// Identity of a coroutine within its run, in spawn order.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct CoroutineId(pub u32);

#[derive(Default)]
struct Ready {
    queue: VecDeque<u32>,
    queued: Vec<bool>,
}

/// The ready queue, shared with the wakers. Wakers must be `Send + Sync`
/// by the standard library's contract; the lock is never contended because
/// a run's executor lives on one thread.
#[derive(Default)]
struct ReadyQueue(Mutex<Ready>);

impl ReadyQueue {
    fn push(&self, id: u32) {
        let mut r = self.0.lock();
        let i = id as usize;
        if r.queued.len() <= i {
            r.queued.resize(i + 1, false);
        }
        if !r.queued[i] {
            r.queued[i] = true;
            r.queue.push_back(id);
        }
    }

    fn pop(&self) -> Option<u32> {
        let mut r = self.0.lock();
        let id = r.queue.pop_front()?;
        r.queued[id as usize] = false;
        Some(id)
    }
}

struct CoroutineWaker {
    id: u32,
    ready: Arc<ReadyQueue>,
}

impl Wake for CoroutineWaker {
    fn wake(self: Arc<Self>) {
        self.ready.push(self.id);
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.ready.push(self.id);
    }
}

type Coroutine = Pin<Box<dyn Future<Output = ()>>>;

struct Slot {
    future: Coroutine,
    waker: Waker,
}

/// A panic caught while polling workflow code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Panicked {
    /// The coroutine that panicked.
    pub coroutine: CoroutineId,
    /// The panic's message.
    pub message: String,
}

/// Polls coroutines in FIFO order until none can make progress.
#[derive(Default)]
pub struct Executor {
    slots: Vec<Option<Slot>>,
    ready: Arc<ReadyQueue>,
    live: usize,
}

impl std::fmt::Debug for Executor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Executor({} live coroutines)", self.live)
    }
}

impl Executor {
    /// An executor with no coroutines.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a coroutine; it is polled on the next [`Executor::run_until_stalled`].
    pub fn spawn(&mut self, future: impl Future<Output = ()> + 'static) -> CoroutineId {
        let id = self.slots.len() as u32;
        let waker = Waker::from(Arc::new(CoroutineWaker {
            id,
            ready: self.ready.clone(),
        }));
        self.slots.push(Some(Slot {
            future: Box::pin(future),
            waker,
        }));
        self.live += 1;
        self.ready.push(id);
        CoroutineId(id)
    }

    /// Coroutines that have not finished.
    pub fn live(&self) -> usize {
        self.live
    }

    /// True if `id` has finished (or was never spawned).
    pub fn is_finished(&self, id: CoroutineId) -> bool {
        self.slots.get(id.0 as usize).is_none_or(|s| s.is_none())
    }

    /// Drops a coroutine without polling it again.
    pub fn cancel(&mut self, id: CoroutineId) {
        if let Some(slot) = self.slots.get_mut(id.0 as usize) {
            if slot.take().is_some() {
                self.live -= 1;
            }
        }
    }

    /// Polls ready coroutines, FIFO, until the queue is empty, and returns
    /// how many polls that took. `between` runs after each poll (the
    /// machine uses it to move spawn requests into the executor). Returns
    /// the first panic, leaving the rest unpolled.
    pub fn run_until_stalled(
        &mut self,
        mut between: impl FnMut(&mut Executor),
    ) -> Result<usize, Panicked> {
        let mut polls = 0;
        while let Some(id) = self.ready.pop() {
            polls += 1;
            let Some(slot) = self.slots.get_mut(id as usize).and_then(Option::as_mut) else {
                continue;
            };
            let Slot { future, waker } = slot;
            let mut cx = Context::from_waker(waker);
            let polled = catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(&mut cx)));
            match polled {
                Ok(Poll::Ready(())) => {
                    self.slots[id as usize] = None;
                    self.live -= 1;
                }
                Ok(Poll::Pending) => {}
                Err(payload) => {
                    let message = crate::panic_message(payload.as_ref());
                    self.slots[id as usize] = None;
                    self.live -= 1;
                    return Err(Panicked {
                        coroutine: CoroutineId(id),
                        message,
                    });
                }
            }
            between(self);
        }
        Ok(polls)
    }
}

#[cfg(test)]
mod tests {
    // Goal: the executor polls in FIFO order and only what was woken.
    // Method: coroutines that log when polled and yield once.
    use super::*;
    use std::cell::RefCell;
    use std::rc::Rc;

    struct YieldOnce(bool);
    impl Future for YieldOnce {
        type Output = ();
        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
            if self.0 {
                Poll::Ready(())
            } else {
                self.0 = true;
                cx.waker().wake_by_ref();
                Poll::Pending
            }
        }
    }

    #[test]
    fn fifo_order_and_completion() {
        let log = Rc::new(RefCell::new(Vec::new()));
        let mut ex = Executor::new();
        for i in 0..3 {
            let log = log.clone();
            ex.spawn(async move {
                log.borrow_mut().push(format!("start {i}"));
                YieldOnce(false).await;
                log.borrow_mut().push(format!("end {i}"));
            });
        }
        ex.run_until_stalled(|_| {}).unwrap();
        assert_eq!(
            *log.borrow(),
            ["start 0", "start 1", "start 2", "end 0", "end 1", "end 2"]
        );
        assert_eq!(ex.live(), 0);
    }

    #[test]
    fn a_panic_is_caught_and_reported() {
        let mut ex = Executor::new();
        let id = ex.spawn(async { panic!("boom") });
        let err = ex.run_until_stalled(|_| {}).unwrap_err();
        assert_eq!(err.coroutine, id);
        assert_eq!(err.message, "boom");
    }
}
