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
//! handed to their actors and clients: when the store's notice names one
//! of its addresses (PostgreSQL's `LISTEN`/`NOTIFY`), and every
//! [`RELAY_POLL_FALLBACK_MS`] in case a notice was lost (every
//! [`RELAY_POLL_MS`] on a store without notices).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use actix::{Actor, ArbiterHandle};
use crossbeam_channel::Receiver;
use keel_core::driver::{
    leases_unheld, member_gone, shard_of, shards_taken_since, shards_to_release, shards_to_take,
    AttemptKey, DriverConfig, Shard, ShardId, ShardInput,
};
use keel_core::WorkflowRegistry;
use keel_storage::relay::RELAY_NOTE_AGE_MS_MAX;
use keel_storage::{Fence, LeaseEpoch, Note, RelayNotices, RelayTo, ShardLease, SharedStore};

use crate::engine::{now, Host, ReportTo};
use crate::routes::{Local, Report, Wire};
use crate::shard::{Feed, Release, ShardActor};

/// How often a process says it is alive and looks for shards to take or
/// give up: a dead process's shards are taken within this much of its
/// leases' end.
pub const LOOK_MS: u64 = 500;

/// How long the relay waits for notes to send (or, on a store that gives
/// notices, for a notice) before it goes round again; on a store without
/// notices, also how often it looks for notes to take.
pub const RELAY_POLL_MS: u64 = 5;

/// On a store that gives notices of notes left ([`SharedStore`]'s
/// `relay_listen`), how often the relay is read without one: notices are
/// lossy (a listening connection that broke), so a note whose notice was
/// lost waits this long at most.
pub(crate) const RELAY_POLL_FALLBACK_MS: u64 = 250;

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
    /// The addresses of the attempts this process takes: one per activity
    /// type it runs (none unless attempts go anywhere).
    pub(crate) work: Vec<RelayTo>,
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
        let mut seen_epochs = std::collections::BTreeMap::new();
        let mut last_look: Option<Instant> = None;
        let mut last_forget = Instant::now();
        let mut notices = self.shared().relay_listen();
        let mut last_take: Option<Instant> = None;
        let mut take_now = true;
        loop {
            let stopping = stop.load(Ordering::Acquire);
            let wait_ms = if stopping { 0 } else { RELAY_POLL_MS };
            take_now |= self.send_queued(wait_ms, &mut notices);
            if stopping {
                return;
            }
            let poll_ms = match notices {
                Some(_) => RELAY_POLL_FALLBACK_MS,
                None => RELAY_POLL_MS,
            };
            let poll_due =
                last_take.is_none_or(|at| at.elapsed() >= Duration::from_millis(poll_ms));
            if take_now || poll_due {
                // A full batch may have left more behind.
                take_now = self.take_notes();
                last_take = Some(Instant::now());
            }
            self.host.client.expire_relayed(Instant::now());
            let look_due =
                last_look.is_none_or(|at| at.elapsed() >= Duration::from_millis(LOOK_MS));
            if look_due && !quiesce.load(Ordering::Acquire) {
                self.look(&mut generation, &mut seen_epochs);
                last_look = Some(Instant::now());
                // Notes may wait for a shard just taken.
                take_now = true;
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

    /// Sends the notes queued (waiting up to `wait_ms` for a first one or
    /// a notice), in batches; whether a notice named an address of this
    /// process. Notices that stopped coming are given up (`None`): the
    /// caller polls instead.
    fn send_queued(&self, wait_ms: u64, notices: &mut Option<RelayNotices>) -> bool {
        let mut heard = self.heard(notices);
        let first = match notices.clone() {
            _ if wait_ms == 0 || heard => self.outgoing.try_recv().ok(),
            None => self
                .outgoing
                .recv_timeout(Duration::from_millis(wait_ms))
                .ok(),
            Some(n) => crossbeam_channel::select! {
                recv(self.outgoing) -> m => m.ok(),
                recv(n) -> key => {
                    match key {
                        Ok(key) => heard |= self.is_mine(&key),
                        Err(_) => *notices = None,
                    }
                    heard |= self.heard(notices);
                    None
                }
                default(Duration::from_millis(wait_ms)) => None,
            },
        };
        let Some(first) = first else {
            return heard;
        };
        let mut batch: Vec<Note> = Vec::new();
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
        heard
    }

    /// Reads the notices that arrived: whether one named an address of
    /// this process.
    fn heard(&self, notices: &mut Option<RelayNotices>) -> bool {
        let Some(n) = notices else {
            return false;
        };
        let mut heard = false;
        loop {
            match n.try_recv() {
                Ok(key) => heard |= self.is_mine(&key),
                Err(crossbeam_channel::TryRecvError::Empty) => return heard,
                Err(crossbeam_channel::TryRecvError::Disconnected) => {
                    tracing::warn!("the store's notices of notes stopped; polling instead");
                    *notices = None;
                    return heard;
                }
            }
        }
    }

    /// Whether the address `key` ([`RelayTo::key`]) is this process, a
    /// shard it runs, or work while it has room for a copy.
    fn is_mine(&self, key: &str) -> bool {
        match RelayTo::parse(key) {
            Some(RelayTo::Process(p)) => p == self.name,
            Some(RelayTo::Shard(s)) => self.host.routes.local(ShardId(s)).is_some(),
            Some(RelayTo::Work(t)) => {
                self.host.activities.get(&t).is_some() && self.room_for_copies() > 0
            }
            None => false,
        }
    }

    /// How many more copies of attempts this process may take.
    fn room_for_copies(&self) -> usize {
        if !self.host.attempts_anywhere {
            return 0;
        }
        let running = self.host.copies.lock().len();
        self.host.copies_max.saturating_sub(running)
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
    /// them over; whether a full batch came (more may wait).
    fn take_notes(&self) -> bool {
        let routes = &self.host.routes;
        let mut to: Vec<RelayTo> = vec![RelayTo::Process(self.name.clone())];
        to.extend(routes.all_local().iter().map(|(s, _)| RelayTo::Shard(s.0)));
        let notes = match self.shared().relay_take(&to, RELAY_TAKE_NOTES_MAX) {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(error = %e, "reading notes from other engine processes failed");
                std::thread::sleep(Duration::from_millis(RELAY_POLL_MS * 20));
                return false;
            }
        };
        let mut full = notes.len() >= RELAY_TAKE_NOTES_MAX;
        for note in notes {
            self.deliver(note);
        }
        // Attempts of the activity types this process runs: as many as
        // there is room for.
        let room = self.room_for_copies().min(RELAY_TAKE_NOTES_MAX);
        if room > 0 && !self.work.is_empty() {
            match self.shared().relay_take(&self.work, room) {
                Ok(work) => {
                    full |= work.len() >= room;
                    for note in work {
                        self.deliver(note);
                    }
                }
                Err(e) => tracing::warn!(error = %e, "taking attempts from the store failed"),
            }
        }
        full
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
            (RelayTo::Work(_), Wire::Attempt { shard, order }) => {
                if routes.local(shard).is_none() {
                    let taken = Report::Taken {
                        key: order.key,
                        epoch: order.epoch,
                        by: self.name.clone(),
                    };
                    self.host.report_taken(shard, taken);
                }
                crate::attempts::run(
                    &self.host,
                    ReportTo::Shard(shard),
                    order,
                    crate::attempts::Caller::Elsewhere,
                );
            }
            (RelayTo::Shard(s), Wire::Report(report)) => match routes.local(ShardId(s)) {
                Some(addr) => self.host.reported(&addr, report),
                // Its shard left this process: its next owner redelivers
                // the attempt when the lease ends, so a result may wait.
                None => {
                    routes.relay(RelayTo::Shard(s), Wire::Report(report));
                }
            },
            (RelayTo::Process(_), Wire::Stop { key, epoch }) => self.host.stop_copy(key, epoch),
            (to, wire) => {
                tracing::warn!(%to, ?wire, "a note of the wrong kind for its address; dropped")
            }
        }
    }

    /// Says this process is alive, then takes and gives up shards as the
    /// driver's ownership rules say.
    fn look(
        &mut self,
        generation: &mut u64,
        seen_epochs: &mut std::collections::BTreeMap<u16, u64>,
    ) {
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
        self.copies_of_the_gone(&members, now);
        self.tell_of_takeovers(&leases, seen_epochs);
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

    /// Shards a new owner took since the last look (a higher epoch than
    /// seen then): every shard here hears of it and delivers again, now,
    /// what it sent there and still waits to hear of, which the earlier
    /// owner may have lost (`ShardInput::PeerTaken`).
    fn tell_of_takeovers(
        &self,
        leases: &[ShardLease],
        seen_epochs: &mut std::collections::BTreeMap<u16, u64>,
    ) {
        let taken = shards_taken_since(leases, seen_epochs);
        if taken.is_empty() {
            return;
        }
        for (shard, local) in self.host.routes.all_local() {
            for &t in taken.iter().filter(|&&t| t != shard) {
                local.addr.do_send(Feed(ShardInput::PeerTaken(t)));
            }
        }
    }

    /// Copies of this process's attempts taken by processes that are gone:
    /// their shards hear of it and deliver the attempts again now, not when
    /// their leases end.
    fn copies_of_the_gone(&self, members: &[keel_storage::Member], now: keel_storage::Timestamp) {
        let lost: Vec<(AttemptKey, LeaseEpoch)> = {
            let mut taken = self.host.taken.lock();
            let lost: Vec<_> = taken
                .iter()
                .filter(|(_, by)| member_gone(members, by, now))
                .map(|(copy, _)| *copy)
                .collect();
            for copy in &lost {
                taken.remove(copy);
            }
            lost
        };
        for (key, epoch) in lost {
            let shard = shard_of(key.run, self.driver.shards);
            if let Some(addr) = self.host.routes.local(shard) {
                addr.do_send(Feed(ShardInput::CopyLost { key, epoch }));
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
