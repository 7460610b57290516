//! The byte-level view both stores share, and the overlay that group commit
//! and `verify` write through.
//!
//! All typed logic (validation, derived state, reads, verify) is written once
//! against [`KvRead`]/[`KvWrite`]; the RocksDB store and the in-memory store
//! only move bytes.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashSet};

use crate::error::Result;
use crate::keys::Cf;

/// Read access to the column families.
pub trait KvRead {
    /// The value at `key`, if any.
    fn get(&self, cf: Cf, key: &[u8]) -> Result<Option<Vec<u8>>>;

    /// The values at `keys`, in their order: one batched read where the
    /// store has one (a list page reads its runs' records this way).
    fn get_many(&self, cf: Cf, keys: &[Vec<u8>]) -> Result<Vec<Option<Vec<u8>>>> {
        keys.iter().map(|k| self.get(cf, k)).collect()
    }

    /// Visits keys `>= from` that start with `prefix`, in key order, until
    /// `visit` returns false.
    fn scan(
        &self,
        cf: Cf,
        prefix: &[u8],
        from: &[u8],
        visit: &mut dyn FnMut(&[u8], &[u8]) -> bool,
    ) -> Result<()>;

    /// [`KvRead::scan`] for a pass that reads its rows once and keeps
    /// none of them (describing a run streams its whole history): where
    /// the store caches the blocks it reads, this pass leaves the cache to
    /// the rows read again, so a long history neither evicts them nor
    /// grows the process up to the cache's bound. A view that forwards
    /// `scan` to such a store forwards this too, or its passes fill the
    /// cache again (the default is a plain `scan`).
    fn scan_once(
        &self,
        cf: Cf,
        prefix: &[u8],
        from: &[u8],
        visit: &mut dyn FnMut(&[u8], &[u8]) -> bool,
    ) -> Result<()> {
        self.scan(cf, prefix, from, visit)
    }

    /// Visits, for each of `prefixes` in turn, the keys that start with
    /// it, in key order: `visit(i, item)` gets the prefix's index, and
    /// returning false moves on to the next prefix. A read that fails
    /// reaches `visit` as an `Err` item of its prefix, and the scan goes on
    /// with the next one. Where the store has a cursor one cursor serves
    /// every prefix, so neighbouring prefixes are read from the blocks it
    /// already holds (an offline replay reads thousands of runs this way).
    /// `visit` runs inside the scan: as with [`KvRead::scan`], it must not
    /// call into the store (the in-memory store holds its lock).
    fn scan_prefixes(&self, cf: Cf, prefixes: &[Vec<u8>], visit: &mut PrefixVisitor<'_>) {
        for (i, prefix) in prefixes.iter().enumerate() {
            if let Err(e) = self.scan(cf, prefix, prefix, &mut |k, v| visit(i, Ok((k, v)))) {
                visit(i, Err(e));
            }
        }
    }

    /// The last key that starts with `prefix`, with its value: a run's
    /// last event. A store with a cursor seeks it from the end; the
    /// default scans the prefix.
    fn last(&self, cf: Cf, prefix: &[u8]) -> Result<Option<(Vec<u8>, Vec<u8>)>> {
        last_by_scan(self, cf, prefix)
    }

    /// Whether an open run's record read here may trail its events: the
    /// store leaves out a rewrite of the record that changes only its
    /// progress (`next_seq`, `updated_at`), which its events already say
    /// ([`KvWrite::put_derivable`]), and readers catch the record up from
    /// them (`derive::catch_up`). True unless a view says otherwise: a
    /// view that wraps a store and forwards only `get` and `scan` (say, to
    /// count reads) still reads current records, at the cost of a scan of
    /// the run's events where it does not forward [`KvRead::last`]. Only a
    /// store that writes every record whole (PostgreSQL) says false.
    fn records_lag(&self) -> bool {
        true
    }

    /// [`KvRead::get`], and whether the value is what this view's writer
    /// wrote rather than what the store holds: such a run record is current
    /// even where [`KvRead::records_lag`], so validating a commit need not
    /// read the run's events.
    fn get_knowing(&self, cf: Cf, key: &[u8]) -> Result<(Option<Vec<u8>>, bool)> {
        Ok((self.get(cf, key)?, false))
    }
}

/// [`KvRead::last`] by scanning the whole prefix.
pub fn last_by_scan<V: KvRead + ?Sized>(
    view: &V,
    cf: Cf,
    prefix: &[u8],
) -> Result<Option<(Vec<u8>, Vec<u8>)>> {
    let mut last: Option<(Vec<u8>, Vec<u8>)> = None;
    view.scan(cf, prefix, prefix, &mut |k, v| {
        let (key, value) = last.get_or_insert_with(Default::default);
        key.clear();
        key.extend_from_slice(k);
        value.clear();
        value.extend_from_slice(v);
        true
    })?;
    Ok(last)
}

/// What [`KvRead::scan_prefixes`] calls for each key: the prefix's index,
/// and the key and value or the error that ended the prefix's read.
pub type PrefixVisitor<'v> = dyn FnMut(usize, Result<(&[u8], &[u8])>) -> bool + 'v;

/// Write access, used by the shared derivation code.
pub trait KvWrite: KvRead {
    /// Puts a value.
    fn put(&mut self, cf: Cf, key: Vec<u8>, value: Vec<u8>);
    /// Deletes a key (a no-op if absent).
    fn delete(&mut self, cf: Cf, key: Vec<u8>);
    /// Puts a value that later reads through this writer see, but which a
    /// store whose records lag ([`KvRead::records_lag`]) need not write,
    /// because rows written with it say the same: an open run's record
    /// whose only change is its progress. An [`Overlay`] lists such keys
    /// ([`Overlay::into_parts`]) for its writer to leave out; anything else
    /// puts it.
    fn put_derivable(&mut self, cf: Cf, key: Vec<u8>, value: Vec<u8>) {
        self.put(cf, key, value);
    }
}

/// Keys whose pending value an [`Overlay`] took as
/// [derivable](KvWrite::put_derivable), with the families they are in: a
/// write to any other family (almost every write) skips the set.
#[derive(Debug, Default)]
pub struct Derivable {
    keys: HashSet<(Cf, Vec<u8>), foldhash::fast::RandomState>,
    /// A bit per family with keys here (`1 << Cf::index`).
    cfs: u32,
}

impl Derivable {
    /// Whether `key` is listed.
    pub fn contains(&self, key: &(Cf, Vec<u8>)) -> bool {
        self.cfs & (1 << key.0.index()) != 0 && self.keys.contains(key)
    }

    /// The listed keys.
    pub fn keys(&self) -> impl Iterator<Item = &(Cf, Vec<u8>)> {
        self.keys.iter()
    }

    fn insert(&mut self, key: (Cf, Vec<u8>)) {
        self.cfs |= 1 << key.0.index();
        self.keys.insert(key);
    }

    fn remove(&mut self, key: &(Cf, Vec<u8>)) {
        if self.cfs & (1 << key.0.index()) != 0 {
            self.keys.remove(key);
        }
    }
}

/// One byte-level change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mutation {
    /// Put `value` at `key`.
    Put(Cf, Vec<u8>, Vec<u8>),
    /// Delete `key`.
    Delete(Cf, Vec<u8>),
}

/// Pending writes keyed by family and key; `None` is a delete.
pub type Writes = BTreeMap<(Cf, Vec<u8>), Option<Vec<u8>>>;

/// Turns pending writes into mutations in key order.
pub fn mutations_of(writes: Writes) -> Vec<Mutation> {
    writes
        .into_iter()
        .map(|((cf, k), v)| match v {
            Some(v) => Mutation::Put(cf, k, v),
            None => Mutation::Delete(cf, k),
        })
        .collect()
}

/// Pending writes layered over a base view; reads see the writes first.
pub struct Overlay<'a> {
    base: &'a dyn KvRead,
    writes: Cow<'a, Writes>,
    /// While a [step](Overlay::step) runs: what each of its writes
    /// replaced, in the order written.
    undo: Option<Vec<Undo>>,
    /// The keys whose pending value was put as derivable and not written
    /// over since.
    derivable: Derivable,
}

/// One write of a step and the pending write it replaced (`None`: the key
/// had none).
type Undo = ((Cf, Vec<u8>), Option<Option<Vec<u8>>>);

/// The keys a successful [step](Overlay::step) wrote, in the order
/// written (a key written twice is listed twice).
#[derive(Debug, Default)]
pub struct Stepped(Vec<Undo>);

impl Stepped {
    /// The written keys.
    pub fn keys(&self) -> impl Iterator<Item = (Cf, &[u8])> {
        self.0.iter().map(|((cf, k), _)| (*cf, k.as_slice()))
    }
}

impl std::fmt::Debug for Overlay<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Overlay({} writes)", self.writes.len())
    }
}

impl<'a> Overlay<'a> {
    /// An empty overlay over `base`.
    pub fn new(base: &'a dyn KvRead) -> Self {
        Overlay::with(base, Writes::new())
    }

    /// An overlay over `base` that starts from `writes` (taken, not
    /// copied: a writer validating a group in steps keeps them between
    /// steps).
    pub fn with(base: &'a dyn KvRead, writes: Writes) -> Self {
        Overlay {
            base,
            writes: Cow::Owned(writes),
            undo: None,
            derivable: Derivable::default(),
        }
    }

    /// A view of `writes` over `base`, borrowing them: the writes of a
    /// group still in flight, under the next group's.
    pub fn over(base: &'a dyn KvRead, writes: &'a Writes) -> Self {
        Overlay {
            base,
            writes: Cow::Borrowed(writes),
            undo: None,
            derivable: Derivable::default(),
        }
    }

    /// Takes another overlay's writes on top of this one's (written whole:
    /// a key this one held as derivable no longer is).
    pub fn absorb(&mut self, writes: Writes) {
        for key in writes.keys() {
            self.derivable.remove(key);
        }
        self.writes.to_mut().extend(writes);
    }

    /// Runs `f` as one step of this overlay: if it fails, every write it
    /// made is taken back and the overlay is as before; if it succeeds, its
    /// writes stay and the keys it wrote come with its result. A group
    /// commit validates each commit as a step of the group's own overlay,
    /// so a write goes into one map once and a read searches one map,
    /// instead of a map per commit merged into the group's afterwards.
    pub fn step<T, E>(
        &mut self,
        f: impl FnOnce(&mut Self) -> std::result::Result<T, E>,
    ) -> std::result::Result<(T, Stepped), E> {
        assert!(self.undo.is_none(), "overlay steps do not nest");
        self.undo = Some(Vec::new());
        let result = f(self);
        let undo = self.undo.take().unwrap_or_default();
        match result {
            Ok(t) => Ok((t, Stepped(undo))),
            Err(e) => {
                let writes = self.writes.to_mut();
                for (key, before) in undo.into_iter().rev() {
                    // Whatever the key held before is written, which is
                    // never wrong (only a saving is given up).
                    self.derivable.remove(&key);
                    match before {
                        Some(v) => writes.insert(key, v),
                        None => writes.remove(&key),
                    };
                }
                Err(e)
            }
        }
    }

    /// The pending write at `key`, if any (`Some(None)`: a delete).
    pub fn pending(&self, cf: Cf, key: &[u8]) -> Option<&Option<Vec<u8>>> {
        self.writes.get(&(cf, key.to_vec()))
    }

    /// Writes `key`; whether a write of it was pending already.
    fn write(&mut self, cf: Cf, key: Vec<u8>, value: Option<Vec<u8>>) -> bool {
        let entry = (cf, key);
        self.derivable.remove(&entry);
        let writes = self.writes.to_mut();
        match &mut self.undo {
            Some(undo) => {
                let before = writes.insert(entry.clone(), value);
                let pending = before.is_some();
                undo.push((entry, before));
                pending
            }
            None => writes.insert(entry, value).is_some(),
        }
    }

    /// The writes, for absorbing into a parent overlay.
    pub fn into_writes(self) -> Writes {
        self.writes.into_owned()
    }

    /// The writes, and which of them a store whose records lag leaves out
    /// ([`KvWrite::put_derivable`]); its writer still learns them.
    pub fn into_parts(self) -> (Writes, Derivable) {
        (self.writes.into_owned(), self.derivable)
    }

    /// The writes as mutations in key order.
    pub fn mutations(self) -> Vec<Mutation> {
        mutations_of(self.into_writes())
    }

    /// Number of pending writes.
    pub fn len(&self) -> usize {
        self.writes.len()
    }

    /// True when nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.writes.is_empty()
    }
}

impl KvRead for Overlay<'_> {
    fn get(&self, cf: Cf, key: &[u8]) -> Result<Option<Vec<u8>>> {
        match self.writes.get(&(cf, key.to_vec())) {
            Some(v) => Ok(v.clone()),
            None => self.base.get(cf, key),
        }
    }

    fn records_lag(&self) -> bool {
        self.base.records_lag()
    }

    fn get_knowing(&self, cf: Cf, key: &[u8]) -> Result<(Option<Vec<u8>>, bool)> {
        match self.writes.get(&(cf, key.to_vec())) {
            Some(v) => Ok((v.clone(), true)),
            None => self.base.get_knowing(cf, key),
        }
    }

    fn last(&self, cf: Cf, prefix: &[u8]) -> Result<Option<(Vec<u8>, Vec<u8>)>> {
        let mut pending = None;
        for ((c, k), v) in self.writes.range((cf, prefix.to_vec())..) {
            if *c != cf || !k.starts_with(prefix) {
                break;
            }
            match v {
                Some(v) => pending = Some((k, v)),
                // A pending delete may be of the base's last key.
                None => return last_by_scan(self, cf, prefix),
            }
        }
        let base = self.base.last(cf, prefix)?;
        Ok(match (base, pending) {
            (Some(b), Some((k, _))) if b.0 > *k => Some(b),
            (_, Some((k, v))) => Some((k.clone(), v.clone())),
            (base, None) => base,
        })
    }

    fn scan(
        &self,
        cf: Cf,
        prefix: &[u8],
        from: &[u8],
        visit: &mut dyn FnMut(&[u8], &[u8]) -> bool,
    ) -> Result<()> {
        // Merge the base's keys with the overlay's: collect both (overlay
        // scans are small: a run's tasks or timers when it closes).
        let mut merged: BTreeMap<Vec<u8>, Option<Vec<u8>>> = BTreeMap::new();
        self.base.scan(cf, prefix, from, &mut |k, v| {
            merged.insert(k.to_vec(), Some(v.to_vec()));
            true
        })?;
        let start = if from > prefix { from } else { prefix };
        for ((c, k), v) in self.writes.range((cf, start.to_vec())..) {
            if *c != cf || !k.starts_with(prefix) {
                break;
            }
            merged.insert(k.clone(), v.clone());
        }
        for (k, v) in merged {
            if let Some(v) = v {
                if !visit(&k, &v) {
                    break;
                }
            }
        }
        Ok(())
    }
}

impl KvWrite for Overlay<'_> {
    fn put(&mut self, cf: Cf, key: Vec<u8>, value: Vec<u8>) {
        self.write(cf, key, Some(value));
    }

    fn delete(&mut self, cf: Cf, key: Vec<u8>) {
        self.write(cf, key, None);
    }

    fn put_derivable(&mut self, cf: Cf, key: Vec<u8>, value: Vec<u8>) {
        // Derivable from what the store holds only if every write of the
        // key here was: over a pending full put (no longer listed once
        // `write` has run), this value is written in its place.
        let entry = (cf, key);
        let listed = self.derivable.contains(&entry);
        let pending = self.write(cf, entry.1.clone(), Some(value));
        if listed || !pending {
            self.derivable.insert(entry);
        }
    }
}

/// Plain in-memory column families: the in-memory store's state and the
/// state `verify` rebuilds.
#[derive(Clone, Debug, Default)]
pub struct Maps {
    cfs: [BTreeMap<Vec<u8>, Vec<u8>>; Cf::ALL.len()],
}

impl Maps {
    /// Applies mutations in order.
    pub fn apply(&mut self, mutations: &[Mutation]) {
        for m in mutations {
            match m {
                Mutation::Put(cf, k, v) => {
                    self.cfs[cf.index()].insert(k.clone(), v.clone());
                }
                Mutation::Delete(cf, k) => {
                    self.cfs[cf.index()].remove(k);
                }
            }
        }
    }

    /// One column family's entries.
    pub fn cf(&self, cf: Cf) -> &BTreeMap<Vec<u8>, Vec<u8>> {
        &self.cfs[cf.index()]
    }

    /// One column family's entries, mutably (for fault injection in tests).
    pub fn cf_mut(&mut self, cf: Cf) -> &mut BTreeMap<Vec<u8>, Vec<u8>> {
        &mut self.cfs[cf.index()]
    }
}

impl KvRead for Maps {
    fn get(&self, cf: Cf, key: &[u8]) -> Result<Option<Vec<u8>>> {
        Ok(self.cfs[cf.index()].get(key).cloned())
    }

    fn scan(
        &self,
        cf: Cf,
        prefix: &[u8],
        from: &[u8],
        visit: &mut dyn FnMut(&[u8], &[u8]) -> bool,
    ) -> Result<()> {
        let start = if from > prefix { from } else { prefix };
        for (k, v) in self.cfs[cf.index()].range(start.to_vec()..) {
            if !k.starts_with(prefix) || !visit(k, v) {
                break;
            }
        }
        Ok(())
    }

    fn last(&self, cf: Cf, prefix: &[u8]) -> Result<Option<(Vec<u8>, Vec<u8>)>> {
        let map = &self.cfs[cf.index()];
        let found = match crate::keys::prefix_end(prefix) {
            Some(end) => map.range(prefix.to_vec()..end).next_back(),
            None => map.range(prefix.to_vec()..).next_back(),
        };
        Ok(found
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k.clone(), v.clone())))
    }
}

impl KvWrite for Maps {
    fn put(&mut self, cf: Cf, key: Vec<u8>, value: Vec<u8>) {
        self.cfs[cf.index()].insert(key, value);
    }

    fn delete(&mut self, cf: Cf, key: Vec<u8>) {
        self.cfs[cf.index()].remove(&key);
    }
}

#[cfg(test)]
mod tests {
    // Goal: a failed overlay step leaves the overlay exactly as it was, and
    // a successful one keeps its writes and names its keys. Method: an
    // overlay with pending writes over a base, a step that overwrites a
    // pending put, deletes a pending key, writes a new key twice and reads
    // its own writes, run once failing and once succeeding.
    use super::*;

    fn value(o: &Overlay<'_>, cf: Cf, key: &[u8]) -> Option<Vec<u8>> {
        o.get(cf, key).expect("in memory")
    }

    /// Goal: a key is left out of the store's write only while every
    /// write of it in the overlay was derivable: one over a pending full
    /// put, a full put or delete after it, or a failed step's derivable
    /// put puts it back in. Method: each case on a fresh key, then the
    /// set `into_parts` hands out.
    #[test]
    fn a_key_is_derivable_only_while_every_write_of_it_was() {
        let base = Maps::default();
        let mut o = Overlay::new(&base);
        o.put_derivable(Cf::Runs, b"alone".to_vec(), b"1".to_vec());
        o.put_derivable(Cf::Runs, b"alone".to_vec(), b"2".to_vec());
        o.put(Cf::Runs, b"full-first".to_vec(), b"1".to_vec());
        o.put_derivable(Cf::Runs, b"full-first".to_vec(), b"2".to_vec());
        o.put_derivable(Cf::Runs, b"full-after".to_vec(), b"1".to_vec());
        o.put(Cf::Runs, b"full-after".to_vec(), b"2".to_vec());
        o.put_derivable(Cf::Runs, b"deleted".to_vec(), b"1".to_vec());
        o.delete(Cf::Runs, b"deleted".to_vec());
        let failed: std::result::Result<((), Stepped), ()> = o.step(|o| {
            o.put_derivable(Cf::Runs, b"failed".to_vec(), b"1".to_vec());
            Err(())
        });
        assert!(failed.is_err());
        let (writes, derivable) = o.into_parts();
        assert_eq!(
            derivable.keys().cloned().collect::<Vec<_>>(),
            vec![(Cf::Runs, b"alone".to_vec())]
        );
        assert_eq!(
            writes.get(&(Cf::Runs, b"alone".to_vec())),
            Some(&Some(b"2".to_vec()))
        );
        assert_eq!(
            writes.get(&(Cf::Runs, b"full-first".to_vec())),
            Some(&Some(b"2".to_vec()))
        );
        assert!(!writes.contains_key(&(Cf::Runs, b"failed".to_vec())));
    }

    #[test]
    fn a_failed_step_takes_back_every_write_and_a_good_one_keeps_them() {
        let mut base = Maps::default();
        base.put(Cf::Runs, b"base".to_vec(), b"b".to_vec());
        let mut overlay = Overlay::new(&base);
        overlay.put(Cf::Runs, b"a".to_vec(), b"1".to_vec());
        overlay.put(Cf::Tasks, b"t".to_vec(), b"2".to_vec());
        let before = overlay.writes.clone().into_owned();

        let step = |o: &mut Overlay<'_>| {
            o.put(Cf::Runs, b"a".to_vec(), b"3".to_vec());
            o.delete(Cf::Tasks, b"t".to_vec());
            o.delete(Cf::Runs, b"base".to_vec());
            o.put(Cf::Events, b"new".to_vec(), b"4".to_vec());
            o.put(Cf::Events, b"new".to_vec(), b"5".to_vec());
            assert_eq!(value(o, Cf::Runs, b"a"), Some(b"3".to_vec()));
            assert_eq!(value(o, Cf::Runs, b"base"), None);
            assert_eq!(value(o, Cf::Tasks, b"t"), None);
        };
        let failed = overlay.step(|o| {
            step(o);
            Err::<(), _>("refused")
        });
        assert_eq!(failed.unwrap_err(), "refused");
        assert_eq!(*overlay.writes, before);
        assert_eq!(value(&overlay, Cf::Runs, b"base"), Some(b"b".to_vec()));

        let ((), stepped) = overlay
            .step(|o| {
                step(o);
                Ok::<_, ()>(())
            })
            .expect("the step succeeds");
        let keys: Vec<_> = stepped.keys().collect();
        assert_eq!(
            keys,
            [
                (Cf::Runs, &b"a"[..]),
                (Cf::Tasks, b"t"),
                (Cf::Runs, b"base"),
                (Cf::Events, b"new"),
                (Cf::Events, b"new"),
            ]
        );
        assert_eq!(value(&overlay, Cf::Runs, b"a"), Some(b"3".to_vec()));
        assert_eq!(value(&overlay, Cf::Events, b"new"), Some(b"5".to_vec()));
        assert_eq!(overlay.pending(Cf::Tasks, b"t"), Some(&None));
        assert_eq!(value(&overlay, Cf::Runs, b"base"), None);
    }
}
