//! The in-memory store: the same validation as RocksDB, with synced and
//! not-yet-synced data kept apart so a simulated crash can drop or tear the
//! unsynced tail.

use parking_lot::Mutex;

use crate::derive::{apply_batch_checked, Checks, CommitBatch, PreparedBatch};
use crate::error::{Error, Result};
use crate::health::{StoreHealth, WriteFault};
use crate::ids::Timestamp;
use crate::keys::{self, Cf};
use crate::kv::{mutations_of, KvRead, KvWrite, Maps, Mutation};
use crate::lease::{self, Member, ShardLease, ShardLeases};
use crate::relay::{MemRelay, Note, Relay, RelayTo};
use crate::store::{CommitHandle, Durability, Store};

/// What a simulated crash does with commits that were written but not yet
/// synced.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum CrashMode {
    /// Every unsynced commit is lost.
    DropUnsynced,
    /// The first `n` unsynced commits survive, the rest are lost (a torn
    /// tail: commits are atomic, so the tear falls between commits).
    KeepUnsynced(usize),
}

#[derive(Debug, Default)]
struct Inner {
    live: Maps,
    durable: Maps,
    unsynced: Vec<Vec<Mutation>>,
    fail_next: u32,
    health: StoreHealth,
    checks: Checks,
}

/// An in-memory keel store.
#[derive(Debug)]
pub struct MemStore {
    inner: Mutex<Inner>,
    durability: Durability,
    /// Shared by engine processes (see [`MemStore::shared_by_processes`]).
    sharded: bool,
    relay: MemRelay,
}

impl MemStore {
    /// An empty store acknowledging commits under `durability`. In `Sync`
    /// mode every acknowledged commit is durable; in `Buffered` mode commits
    /// stay unsynced until [`Store::sync`].
    pub fn new(durability: Durability) -> Self {
        MemStore {
            inner: Mutex::new(Inner::default()),
            durability,
            sharded: false,
            relay: MemRelay::default(),
        }
    }

    /// An empty store that several engines in this process share as
    /// engine processes share a database: each runs the shards it holds
    /// leases for ([`Store::shared`]), and they pass notes through its
    /// relay.
    pub fn shared_by_processes(durability: Durability) -> Self {
        MemStore {
            sharded: true,
            ..MemStore::new(durability)
        }
    }

    /// Makes the next `n` commits fail with [`Error::CommitFailed`],
    /// writing nothing (fault injection).
    pub fn fail_next_commits(&self, n: u32) {
        self.inner.lock().fail_next = n;
    }

    /// Stops writes as a full disk or a failing one would: every commit
    /// fails with [`Error::Unwritable`] and [`Store::health`] reports it,
    /// until [`MemStore::resume_writes`] (fault injection). `for_good`
    /// makes it a stop the store does not wait out.
    pub fn stop_writes(&self, fault: WriteFault, detail: &str, for_good: bool) {
        let detail = detail.to_string();
        self.inner.lock().health = if for_good {
            StoreHealth::Failed { fault, detail }
        } else {
            StoreHealth::Stopped { fault, detail }
        };
    }

    /// Writes are accepted again (the injected cause went away).
    pub fn resume_writes(&self) {
        self.inner.lock().health = StoreHealth::Healthy;
    }

    /// Simulates a process crash and restart: live state falls back to what
    /// was synced plus whatever part of the unsynced tail `mode` keeps.
    pub fn crash(&self, mode: CrashMode) {
        let mut inner = self.inner.lock();
        let keep = match mode {
            CrashMode::DropUnsynced => 0,
            CrashMode::KeepUnsynced(n) => n.min(inner.unsynced.len()),
        };
        let kept: Vec<Vec<Mutation>> = inner.unsynced.drain(..).take(keep).collect();
        for m in &kept {
            inner.durable.apply(m);
        }
        inner.live = inner.durable.clone();
    }

    /// Switches the duplicate-terminal check on or off (fault injection for
    /// the simulator's deliberately broken engine; never off in production).
    pub fn set_duplicate_terminal_check(&self, on: bool) {
        self.inner.lock().checks.duplicate_terminals = on;
    }

    /// Runs `f` on the synced column families: what a crash right now would
    /// keep (the simulator checks that effects only follow durable events).
    pub fn with_durable<R>(&self, f: impl FnOnce(&Maps) -> R) -> R {
        f(&self.inner.lock().durable)
    }

    /// This store as a reader sees it when only synced data is visible (as
    /// with RocksDB in `Sync` mode, where a commit becomes readable once its
    /// write, fsync included, returned). The simulator reads through it, so
    /// no decision rests on a commit that a crash could still take back.
    pub fn synced(self: &std::sync::Arc<Self>) -> SyncedView {
        SyncedView(self.clone())
    }

    /// Commits written but not yet synced.
    pub fn unsynced_commits(&self) -> usize {
        self.inner.lock().unsynced.len()
    }

    /// A copy of the live column families (for comparing logical state).
    pub fn snapshot(&self) -> Maps {
        self.inner.lock().live.clone()
    }

    /// Runs `f` on the live column families, for corruption tests.
    pub fn with_live_mut<R>(&self, f: impl FnOnce(&mut Maps) -> R) -> R {
        let mut inner = self.inner.lock();
        let r = f(&mut inner.live);
        let live = inner.live.clone();
        inner.durable = live;
        r
    }
}

impl Inner {
    /// Writes a lease record to the live and the durable state alike.
    fn put_lease(&mut self, l: &ShardLease) -> Result<()> {
        let bytes = lease::encode(l)?;
        self.put_meta_durable(keys::shard_lease_key(l.shard), Some(bytes));
        Ok(())
    }

    /// Writes (`Some`) or deletes a `Meta` record in the live and the
    /// durable state alike: lease and member records are durable at once.
    fn put_meta_durable(&mut self, key: Vec<u8>, value: Option<Vec<u8>>) {
        match value {
            Some(v) => {
                self.live.put(Cf::Meta, key.clone(), v.clone());
                self.durable.put(Cf::Meta, key, v);
            }
            None => {
                self.live.delete(Cf::Meta, key.clone());
                self.durable.delete(Cf::Meta, key);
            }
        }
    }
}

impl ShardLeases for MemStore {
    /// Takes shard `shard` for `owner` at `now` for `ttl_ms` (the rules of
    /// [`lease::decide_take`]). The record is durable at once, as a
    /// database's synchronous write of its lease row.
    fn take_shard_lease(
        &self,
        shard: u16,
        owner: &str,
        now: Timestamp,
        ttl_ms: u64,
    ) -> Result<ShardLease> {
        let mut inner = self.inner.lock();
        if let Some(e) = inner.health.error() {
            return Err(e);
        }
        let current = lease::read(&inner.live, shard)?;
        let taken = lease::decide_take(current.as_ref(), shard, owner, now, ttl_ms)?;
        inner.put_lease(&taken)?;
        Ok(taken)
    }

    /// Renews `held` at `now` for `ttl_ms` ([`lease::decide_renew`]):
    /// [`Error::Fenced`] once another owner took the shard.
    fn renew_shard_lease(
        &self,
        held: &ShardLease,
        now: Timestamp,
        ttl_ms: u64,
    ) -> Result<ShardLease> {
        let mut inner = self.inner.lock();
        if let Some(e) = inner.health.error() {
            return Err(e);
        }
        let current = lease::read(&inner.live, held.shard)?;
        let renewed = lease::decide_renew(current.as_ref(), held, now, ttl_ms)?;
        inner.put_lease(&renewed)?;
        Ok(renewed)
    }

    /// Gives `held` up at `now` ([`lease::decide_release`]); nothing
    /// happens if it was lost already.
    fn release_shard_lease(&self, held: &ShardLease, now: Timestamp) -> Result<()> {
        let mut inner = self.inner.lock();
        let current = lease::read(&inner.live, held.shard)?;
        if let Some(released) = lease::decide_release(current.as_ref(), held, now) {
            inner.put_lease(&released)?;
        }
        Ok(())
    }

    /// Records that `owner` is alive and wants shards, until `now` plus
    /// `ttl_ms` (durable at once, like a lease).
    fn heartbeat_member(&self, owner: &str, now: Timestamp, ttl_ms: u64) -> Result<()> {
        let mut inner = self.inner.lock();
        if let Some(e) = inner.health.error() {
            return Err(e);
        }
        let member = lease::decide_member(owner, now, ttl_ms)?;
        let bytes = lease::encode_member(&member)?;
        let key = keys::member_key(owner);
        inner.put_meta_durable(key, Some(bytes));
        // Members gone for a whole lease more are forgotten: the table
        // stays as small as the processes alive.
        for gone in lease::read_members(&inner.live)? {
            if gone.expires_at.plus_ms(ttl_ms) < now {
                let key = keys::member_key(&gone.owner);
                inner.put_meta_durable(key, None);
            }
        }
        Ok(())
    }

    /// Every member recorded (expired ones included), in name order.
    fn members(&self) -> Result<Vec<Member>> {
        lease::read_members(&self.inner.lock().live)
    }

    /// Every shard lease recorded, in shard order.
    fn shard_leases(&self) -> Result<Vec<ShardLease>> {
        lease::read_all(&self.inner.lock().live)
    }

    fn agree_shard_count(&self, shards: u16) -> Result<()> {
        let mut inner = self.inner.lock();
        if let Some(e) = inner.health.error() {
            return Err(e);
        }
        let recorded = lease::read_shard_count(&inner.live)?;
        if lease::decide_shard_count(recorded, shards)? {
            let bytes = lease::encode_shard_count(shards)?;
            inner.put_meta_durable(keys::SHARD_COUNT_KEY.to_vec(), Some(bytes));
        }
        Ok(())
    }
}

impl KvRead for MemStore {
    fn get(&self, cf: Cf, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.inner.lock().live.get(cf, key)
    }

    fn scan(
        &self,
        cf: Cf,
        prefix: &[u8],
        from: &[u8],
        visit: &mut dyn FnMut(&[u8], &[u8]) -> bool,
    ) -> Result<()> {
        self.inner.lock().live.scan(cf, prefix, from, visit)
    }

    fn last(&self, cf: Cf, prefix: &[u8]) -> Result<Option<(Vec<u8>, Vec<u8>)>> {
        self.inner.lock().live.last(cf, prefix)
    }
}

impl Relay for MemStore {
    fn relay_send(&self, notes: &[Note], now: Timestamp) -> Result<()> {
        self.relay.relay_send(notes, now)
    }

    fn relay_take(&self, to: &[RelayTo], max: usize) -> Result<Vec<Note>> {
        self.relay.relay_take(to, max)
    }

    fn relay_forget(&self, before: Timestamp) -> Result<u64> {
        self.relay.relay_forget(before)
    }

    fn relay_listen(&self) -> Option<crate::relay::RelayNotices> {
        self.relay.relay_listen()
    }
}

impl Store for MemStore {
    fn view(&self) -> &dyn KvRead {
        self
    }

    fn shared(&self) -> Option<&dyn crate::relay::SharedStore> {
        self.sharded
            .then_some(self as &dyn crate::relay::SharedStore)
    }

    fn commit(&self, batch: CommitBatch) -> CommitHandle {
        let prepared = match PreparedBatch::new(batch) {
            Ok(p) => p,
            Err(e) => return CommitHandle::ready(Err(e)),
        };
        let mut inner = self.inner.lock();
        if inner.fail_next > 0 {
            inner.fail_next -= 1;
            return CommitHandle::ready(Err(Error::CommitFailed("injected commit failure".into())));
        }
        if let Some(e) = inner.health.error() {
            return CommitHandle::ready(Err(e));
        }
        let result = apply_batch_checked(&inner.live, &prepared, inner.checks)
            .map(|(w, ack)| (mutations_of(w), ack));
        CommitHandle::ready(result.map(|(mutations, ack)| {
            inner.live.apply(&mutations);
            match self.durability {
                Durability::Sync => inner.durable.apply(&mutations),
                Durability::Buffered => inner.unsynced.push(mutations),
            }
            ack
        }))
    }

    fn sync(&self) -> Result<()> {
        let mut inner = self.inner.lock();
        let pending: Vec<Vec<Mutation>> = inner.unsynced.drain(..).collect();
        for m in &pending {
            inner.durable.apply(m);
        }
        Ok(())
    }

    fn durability(&self) -> Durability {
        self.durability
    }

    fn health(&self) -> StoreHealth {
        self.inner.lock().health.clone()
    }
}

/// The synced part of a [`MemStore`], as a read-only [`Store`]; see
/// [`MemStore::synced`]. Its `commit` refuses.
#[derive(Debug, Clone)]
pub struct SyncedView(std::sync::Arc<MemStore>);

impl KvRead for SyncedView {
    fn get(&self, cf: Cf, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.0.inner.lock().durable.get(cf, key)
    }

    fn scan(
        &self,
        cf: Cf,
        prefix: &[u8],
        from: &[u8],
        visit: &mut dyn FnMut(&[u8], &[u8]) -> bool,
    ) -> Result<()> {
        // Copy the range first: `visit` may read the store again.
        let mut found = Vec::new();
        self.0
            .inner
            .lock()
            .durable
            .scan(cf, prefix, from, &mut |k, v| {
                found.push((k.to_vec(), v.to_vec()));
                true
            })?;
        for (k, v) in found {
            if !visit(&k, &v) {
                break;
            }
        }
        Ok(())
    }

    fn last(&self, cf: Cf, prefix: &[u8]) -> Result<Option<(Vec<u8>, Vec<u8>)>> {
        self.0.inner.lock().durable.last(cf, prefix)
    }
}

impl Store for SyncedView {
    fn view(&self) -> &dyn KvRead {
        self
    }

    fn commit(&self, _batch: CommitBatch) -> CommitHandle {
        CommitHandle::ready(Err(Error::ReadOnly))
    }

    fn sync(&self) -> Result<()> {
        Ok(())
    }

    fn durability(&self) -> Durability {
        self.0.durability
    }
}
