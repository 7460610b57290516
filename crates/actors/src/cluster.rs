//! Several engine processes on one shared store (a sharded PostgreSQL
//! database): the thread that makes this process a member of the cluster.
//!
//! It decides nothing itself. Every [`LOOK_MS`] it says it is alive, reads
//! the shard leases and members, and does what the driver's ownership
//! rules say (`shards_to_take`, `shards_to_release`, `leases_unheld`):
//! a shard it takes gets a new shard actor holding the lease, which
//! recovers the shard's durable work, renews the lease and stops when it
//! loses it. In between it carries notes: what this process's shards and
//! clients send to shards of other processes goes to the store's relay in
//! batches, and the notes for this process and its shards are taken and
//! handed to their actors and clients.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use actix::{Actor, ArbiterHandle};
use crossbeam_channel::Receiver;
use keel_core::driver::{
    leases_unheld, shards_to_release, shards_to_take, DriverConfig, Shard, ShardId, ShardInput,
};
use keel_core::WorkflowRegistry;
use keel_storage::relay::RELAY_NOTE_AGE_MS_MAX;
use keel_storage::{Fence, Note, RelayTo, ShardLease, SharedStore};

use crate::engine::{now, Host};
use crate::routes::{Local, Wire};
use crate::shard::{Feed, Release, ShardActor};

/// How often a process says it is alive and looks for shards to take or
/// give up: a dead process's shards are taken within this much of its
/// leases' end.
pub const LOOK_MS: u64 = 500;

/// How long the relay waits for notes to send before it looks for notes
/// to take (the longest a note waits here when nothing else moves).
pub const RELAY_POLL_MS: u64 = 5;

/// Most notes sent in one batch.
pub const RELAY_SEND_NOTES_MAX: usize = 512;

/// Most notes taken in one read.
pub const RELAY_TAKE_NOTES_MAX: usize = 512;

/// How often notes no process took are forgotten.
const RELAY_FORGET_EVERY_MS: u64 = 60_000;

/// The member thread's handle, held by the engine.
pub(crate) struct ClusterHandle {
    /// Stop taking shards (the engine is stopping its shards).
    quiesce: Arc<AtomicBool>,
    /// Send what is queued, then stop.
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl ClusterHandle {
    /// No shard is taken from now on.
    pub(crate) fn quiesce(&self) {
        self.quiesce.store(true, Ordering::Release);
    }

    /// Sends what is queued (answers to other processes' clients) and
    /// stops the thread.
    pub(crate) fn stop(&mut self) {
        self.quiesce();
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What the member thread needs to start shards.
pub(crate) struct Member {
    pub(crate) host: Arc<Host>,
    pub(crate) name: String,
    pub(crate) workflows: WorkflowRegistry,
    pub(crate) driver: DriverConfig,
    pub(crate) arbiters: Vec<ArbiterHandle>,
    pub(crate) outgoing: Receiver<(RelayTo, Wire)>,
}

impl Member {
    /// Starts the member thread.
    pub(crate) fn spawn(self) -> std::io::Result<ClusterHandle> {
        let quiesce = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let (q, s) = (quiesce.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("keel-member".into())
            .spawn(move || self.run(&q, &s))?;
        Ok(ClusterHandle {
            quiesce,
            stop,
            thread: Some(thread),
        })
    }

    fn run(mut self, quiesce: &AtomicBool, stop: &AtomicBool) {
        let span = tracing::info_span!("member", name = %self.name);
        let _guard = span.enter();
        let mut generation = 0u64;
        let mut last_look: Option<Instant> = None;
        let mut last_forget = Instant::now();
        loop {
            let stopping = stop.load(Ordering::Acquire);
            self.send_queued(if stopping { 0 } else { RELAY_POLL_MS });
            if stopping {
                return;
            }
            self.take_notes();
            self.host.client.expire_relayed(Instant::now());
            let look_due =
                last_look.is_none_or(|at| at.elapsed() >= Duration::from_millis(LOOK_MS));
            if look_due && !quiesce.load(Ordering::Acquire) {
                self.look(&mut generation);
                last_look = Some(Instant::now());
            }
            if last_forget.elapsed() >= Duration::from_millis(RELAY_FORGET_EVERY_MS) {
                last_forget = Instant::now();
                let before = keel_storage::Timestamp(now().0.saturating_sub(RELAY_NOTE_AGE_MS_MAX));
                match self.shared().relay_forget(before) {
                    Ok(0) => {}
                    Ok(n) => tracing::info!(notes = n, "forgot notes no process took"),
                    Err(e) => tracing::warn!(error = %e, "forgetting old notes failed"),
                }
            }
        }
    }

    fn shared(&self) -> &dyn SharedStore {
        self.host
            .store
            .shared()
            .expect("a member thread runs on a shared store only")
    }

    /// Sends the notes queued (waiting up to `wait_ms` for a first one),
    /// in batches.
    fn send_queued(&self, wait_ms: u64) {
        let mut batch: Vec<Note> = Vec::new();
        let first = if wait_ms == 0 {
            self.outgoing.try_recv().ok()
        } else {
            self.outgoing
                .recv_timeout(Duration::from_millis(wait_ms))
                .ok()
        };
        let Some(first) = first else {
            return;
        };
        let mut next = Some(first);
        while let Some((to, wire)) = next.take() {
            match rmp_serde::to_vec(&wire) {
                Ok(body) => batch.push(Note { to, body }),
                Err(e) => tracing::error!(error = %e, ?wire, "a note does not encode; dropped"),
            }
            if batch.len() >= RELAY_SEND_NOTES_MAX {
                self.send(&mut batch);
            }
            next = self.outgoing.try_recv().ok();
        }
        self.send(&mut batch);
    }

    fn send(&self, batch: &mut Vec<Note>) {
        if batch.is_empty() {
            return;
        }
        if let Err(e) = self.shared().relay_send(batch, now()) {
            // Their senders send again: the outbox until the message is
            // answered, a client once its wait is over.
            tracing::warn!(notes = batch.len(), error = %e, "notes for other engine processes were not sent");
        }
        batch.clear();
    }

    /// Takes the notes for this process and the shards it runs, and hands
    /// them over.
    fn take_notes(&self) {
        let routes = &self.host.routes;
        let mut to: Vec<RelayTo> = vec![RelayTo::Process(self.name.clone())];
        to.extend(routes.all_local().iter().map(|(s, _)| RelayTo::Shard(s.0)));
        let notes = match self.shared().relay_take(&to, RELAY_TAKE_NOTES_MAX) {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(error = %e, "reading notes from other engine processes failed");
                std::thread::sleep(Duration::from_millis(RELAY_POLL_MS * 20));
                return;
            }
        };
        for note in notes {
            self.deliver(note);
        }
    }

    fn deliver(&self, note: Note) {
        let routes = &self.host.routes;
        let wire: Wire = match rmp_serde::from_slice(&note.body) {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!(to = %note.to, error = %e, "a note from another engine process does not decode (another keel version?); dropped");
                return;
            }
        };
        match (note.to, wire) {
            (RelayTo::Shard(s), Wire::Request { from, id, request }) => {
                match routes.local_entry(ShardId(s)) {
                    Some((shard, local)) => {
                        let at = (shard, local.generation);
                        let mine = self.host.client.relayed(from, id, at);
                        local
                            .addr
                            .do_send(Feed(ShardInput::Request { id: mine, request }));
                    }
                    // The shard left this process since: the note waits
                    // for its next owner.
                    None => {
                        routes.relay(RelayTo::Shard(s), Wire::Request { from, id, request });
                    }
                }
            }
            (RelayTo::Shard(s), Wire::Message(message)) => match routes.local(ShardId(s)) {
                Some(addr) => addr.do_send(Feed(ShardInput::Message(message))),
                None => {
                    routes.relay(RelayTo::Shard(s), Wire::Message(message));
                }
            },
            (RelayTo::Process(_), Wire::Answer { id, answer }) => {
                self.host.client.answer(id, answer)
            }
            (to, wire) => {
                tracing::warn!(%to, ?wire, "a note of the wrong kind for its address; dropped")
            }
        }
    }

    /// Says this process is alive, then takes and gives up shards as the
    /// driver's ownership rules say.
    fn look(&mut self, generation: &mut u64) {
        let shared = self.shared();
        let now = now();
        let ttl = self.driver.shard_lease_ms;
        let routes = &self.host.routes;
        if let Err(e) = shared.heartbeat_member(&self.name, now, ttl) {
            tracing::warn!(error = %e, "cannot say this process is alive");
        }
        let (leases, members) = match (shared.shard_leases(), shared.members()) {
            (Ok(l), Ok(m)) => (l, m),
            (Err(e), _) | (_, Err(e)) => {
                tracing::warn!(error = %e, "cannot read the shard leases");
                return;
            }
        };
        // A shard whose actor stopped without saying so is not run here.
        for (shard, local) in routes.all_local() {
            if !local.addr.connected() {
                routes.remove(shard, local.generation);
            }
        }
        let local = routes.all_local();
        let held: Vec<Fence> = local.iter().filter_map(|(_, l)| l.fence).collect();
        for lease in leases_unheld(&leases, &self.name, &held, now) {
            tracing::info!(
                shard = lease.shard,
                epoch = lease.epoch,
                "releasing a lease no shard here holds"
            );
            if let Err(e) = shared.release_shard_lease(lease, now) {
                tracing::warn!(shard = lease.shard, error = %e, "cannot release the lease");
            }
        }
        let shards = self.driver.shards;
        for shard in shards_to_release(&leases, &members, shards, &self.name, now) {
            if let Some(addr) = routes.local(shard) {
                tracing::info!(%shard, "giving the shard up for another process");
                addr.do_send(Release);
            }
        }
        for shard in shards_to_take(&leases, &members, shards, &self.name, now) {
            if routes.local(shard).is_some() {
                continue; // a lost shard not stopped yet
            }
            match shared.take_shard_lease(shard.0, &self.name, now, ttl) {
                Ok(lease) => {
                    *generation += 1;
                    self.start_shard(lease, *generation);
                }
                Err(keel_storage::Error::ShardHeld { .. }) => {}
                Err(e) => tracing::warn!(%shard, error = %e, "cannot take the shard"),
            }
        }
    }

    /// Runs the shard `lease` names here: a new actor on the shard's
    /// arbiter holds the lease and recovers the shard's work.
    fn start_shard(&self, lease: ShardLease, generation: u64) {
        let shard = ShardId(lease.shard);
        tracing::info!(%shard, epoch = lease.epoch, "the shard starts in this engine process");
        let fence = lease.fence();
        let (workflows, config, host) = (
            self.workflows.clone(),
            self.driver.clone(),
            self.host.clone(),
        );
        // Attempt epochs above every earlier owner's of the shard.
        let base = lease.epoch << 40;
        let arbiter = &self.arbiters[usize::from(shard.0)];
        let addr = ShardActor::start_in_arbiter(arbiter, move |_| {
            let mut driver = Shard::new(shard, workflows, config, base);
            driver.hold(lease);
            ShardActor::new(driver, host, generation)
        });
        self.host.routes.set(
            shard,
            Local {
                addr,
                fence: Some(fence),
                generation,
            },
        );
    }
}
