//! The store readers: a few threads that perform the driver's reads
//! ([`keel_core::driver::ReadQuery`]) so that no arbiter thread ever waits
//! on the store.
//!
//! A dedicated pool rather than the activity runtime's blocking pool: under
//! load the readers take queued reads one after another without sleeping in
//! between, where `spawn_blocking` took the pool's lock and woke a thread
//! for every read (the largest source of futex calls in `keel bench w1`).
//! The queue is bounded; a read that finds it full goes to the blocking
//! pool instead, so a shard never blocks and no read is dropped.

use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender, TrySendError};

/// Reader threads per engine. Reads are short point lookups and history
/// scans; two keep one long history read from holding up the others.
pub const READER_THREADS: usize = 2;

/// Reads queued for the readers at most; more go to the blocking pool.
pub const READ_QUEUE_MAX: usize = 4_096;

/// One read and the delivery of its result.
pub(crate) type ReadJob = Box<dyn FnOnce() + Send + 'static>;

/// The sending side, held by the host.
#[derive(Clone)]
pub(crate) struct ReadQueue {
    tx: Sender<ReadJob>,
    overflow: tokio::runtime::Handle,
}

impl ReadQueue {
    /// Queues `job` for a reader, or hands it back when the queue is full
    /// or the readers are gone. Never blocks.
    pub(crate) fn try_submit(&self, job: ReadJob) -> Result<(), ReadJob> {
        self.tx.try_send(job).map_err(|e| e.into_inner())
    }

    /// Queues `job` for a reader, or runs it on the blocking pool when the
    /// queue is full. Never blocks.
    pub(crate) fn submit(&self, job: ReadJob) {
        match self.tx.try_send(job) {
            Ok(()) => {}
            Err(TrySendError::Full(job)) => {
                tracing::debug!(
                    limit = READ_QUEUE_MAX,
                    "read queue full; reading on the blocking pool"
                );
                self.overflow.spawn_blocking(job);
            }
            // The readers are gone (they stop only when the engine's
            // shutdown joins them, after the shards stopped queueing, so
            // this is a bug): the read still happens.
            Err(TrySendError::Disconnected(job)) => {
                tracing::error!("store readers stopped; reading on the blocking pool");
                self.overflow.spawn_blocking(job);
            }
        }
    }
}

/// The reader threads, stopped and joined at shutdown (so the store they
/// read is closed when the engine says it is).
pub(crate) struct Readers {
    threads: Vec<JoinHandle<()>>,
    stop: Sender<()>,
}

impl Readers {
    /// Starts the readers; `overflow` runs reads the queue has no room for.
    pub(crate) fn start(overflow: tokio::runtime::Handle) -> std::io::Result<(ReadQueue, Readers)> {
        let (tx, rx) = crossbeam_channel::bounded::<ReadJob>(READ_QUEUE_MAX);
        // Never sent on: dropping the sender is the stop signal. (The read
        // queue's own senders may outlive the shutdown in an activity copy
        // that never yields, so its disconnection cannot be the signal.)
        let (stop, stopped) = crossbeam_channel::bounded::<()>(0);
        let mut threads = Vec::with_capacity(READER_THREADS);
        for i in 0..READER_THREADS {
            let (rx, stopped): (Receiver<ReadJob>, Receiver<()>) = (rx.clone(), stopped.clone());
            threads.push(
                std::thread::Builder::new()
                    .name(format!("keel-reader-{i}"))
                    .spawn(move || reader(&rx, &stopped))?,
            );
        }
        Ok((ReadQueue { tx, overflow }, Readers { threads, stop }))
    }

    /// Stops the readers once the reads queued now are done, and waits for
    /// them. Called after the shards stopped, so nothing is queued later.
    pub(crate) fn join(self) {
        drop(self.stop);
        for t in self.threads {
            let _ = t.join();
        }
    }
}

fn reader(rx: &Receiver<ReadJob>, stopped: &Receiver<()>) {
    loop {
        crossbeam_channel::select! {
            recv(rx) -> job => match job {
                Ok(job) => perform(job),
                Err(_) => return,
            },
            recv(stopped) -> _ => {
                while let Ok(job) = rx.try_recv() {
                    perform(job);
                }
                return;
            }
        }
    }
}

fn perform(job: ReadJob) {
    // A panicking read is a bug; it must not take the reader (and every
    // later read) with it.
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
        tracing::error!("a store read panicked");
    }
}
