//! The byte-level view both stores share, and the overlay that group commit
//! and `verify` write through.
//!
//! All typed logic (validation, derived state, reads, verify) is written once
//! against [`KvRead`]/[`KvWrite`]; the RocksDB store and the in-memory store
//! only move bytes.

use std::borrow::Cow;
use std::collections::BTreeMap;

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
        }
    }

    /// A view of `writes` over `base`, borrowing them: the writes of a
    /// group still in flight, under the next group's.
    pub fn over(base: &'a dyn KvRead, writes: &'a Writes) -> Self {
        Overlay {
            base,
            writes: Cow::Borrowed(writes),
        }
    }

    /// Takes another overlay's writes on top of this one's.
    pub fn absorb(&mut self, writes: Writes) {
        self.writes.to_mut().extend(writes);
    }

    /// The writes, for absorbing into a parent overlay.
    pub fn into_writes(self) -> Writes {
        self.writes.into_owned()
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
        self.writes.to_mut().insert((cf, key), Some(value));
    }

    fn delete(&mut self, cf: Cf, key: Vec<u8>) {
        self.writes.to_mut().insert((cf, key), None);
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
}

impl KvWrite for Maps {
    fn put(&mut self, cf: Cf, key: Vec<u8>, value: Vec<u8>) {
        self.cfs[cf.index()].insert(key, value);
    }

    fn delete(&mut self, cf: Cf, key: Vec<u8>) {
        self.cfs[cf.index()].remove(&key);
    }
}
