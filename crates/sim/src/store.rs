//! The store under simulation: the in-memory store (synced and unsynced
//! data kept apart, so a crash can drop or tear the unsynced tail) or
//! RocksDB in a temporary directory (a crash drops the store and reopens
//! the directory).

use std::sync::Arc;

use keel_storage::keys::{self, Cf};
use keel_storage::kv::KvRead;
use keel_storage::{
    CommitAck, CommitBatch, CrashMode, Durability, Error, MemStore, RocksStore, RunId, Seq,
    ShardLeases, Store, SyncedView,
};

use crate::sim::SimError;

/// Which store a simulation runs on.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum StoreKind {
    /// The in-memory store in `Buffered` mode: commits are synced
    /// explicitly when the simulated group commit acknowledges them, and a
    /// crash drops or tears what was not synced yet.
    #[default]
    Mem,
    /// The in-memory store in `Sync` mode: every commit is durable when it
    /// returns, as on RocksDB. Used to compare the two stores.
    MemSync,
    /// RocksDB in a temporary directory, `Sync` durability; a crash drops the
    /// store and reopens the directory.
    RocksDb,
}

impl StoreKind {
    /// The `--store` name.
    pub fn name(self) -> &'static str {
        match self {
            StoreKind::Mem => "mem",
            StoreKind::MemSync => "mem-sync",
            StoreKind::RocksDb => "rocksdb",
        }
    }
}

impl std::str::FromStr for StoreKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "mem" => Ok(StoreKind::Mem),
            "mem-sync" => Ok(StoreKind::MemSync),
            "rocksdb" => Ok(StoreKind::RocksDb),
            other => Err(format!(
                "unknown store {other:?}; expected mem, mem-sync or rocksdb"
            )),
        }
    }
}

pub(crate) enum SimStore {
    Mem(Arc<MemStore>, SyncedView),
    Rocks {
        dir: tempfile::TempDir,
        /// Boxed: a store is large beside the in-memory variant.
        store: Option<Box<RocksStore>>,
        /// Commits still to fail, as `MemStore::fail_next_commits` counts
        /// them (RocksDB has no such hook; a failed commit writes nothing).
        fail_next: u32,
    },
}

impl SimStore {
    pub(crate) fn open(kind: StoreKind) -> Result<Self, SimError> {
        Ok(match kind {
            StoreKind::Mem => {
                let m = Arc::new(MemStore::new(Durability::Buffered));
                let synced = m.synced();
                SimStore::Mem(m, synced)
            }
            StoreKind::MemSync => {
                let m = Arc::new(MemStore::new(Durability::Sync));
                let synced = m.synced();
                SimStore::Mem(m, synced)
            }
            StoreKind::RocksDb => {
                let dir = tempfile::Builder::new()
                    .prefix("keel-sim")
                    .tempdir()
                    .map_err(|e| SimError::Store(e.to_string()))?;
                let store = RocksStore::open(dir.path(), Durability::Sync)
                    .map_err(|e| SimError::Store(e.to_string()))?;
                SimStore::Rocks {
                    dir,
                    store: Some(Box::new(store)),
                    fail_next: 0,
                }
            }
        })
    }

    pub(crate) fn store(&self) -> &dyn Store {
        match self {
            SimStore::Mem(m, _) => m.as_ref(),
            SimStore::Rocks { store, .. } => store.as_deref().expect("the store is open"),
        }
    }

    /// What readers see: only durable data (in-memory store: the synced
    /// part; RocksDB in `Sync` mode: everything a commit returned).
    pub(crate) fn reader(&self) -> &dyn Store {
        match self {
            SimStore::Mem(_, synced) => synced,
            SimStore::Rocks { store, .. } => store.as_deref().expect("the store is open"),
        }
    }

    pub(crate) fn commit(&mut self, batch: CommitBatch) -> Result<CommitAck, Error> {
        match self {
            SimStore::Mem(m, _) => m.commit(batch).wait(),
            SimStore::Rocks {
                store, fail_next, ..
            } => {
                if *fail_next > 0 {
                    *fail_next -= 1;
                    return Err(Error::CommitFailed("injected commit failure".into()));
                }
                store
                    .as_ref()
                    .expect("the store is open")
                    .commit(batch)
                    .wait()
            }
        }
    }

    /// The store holding shard leases: several processes run on the
    /// in-memory store only (`Simulation::run` refuses anything else).
    pub(crate) fn leases(&self) -> &dyn ShardLeases {
        match self {
            SimStore::Mem(m, _) => m.as_ref(),
            SimStore::Rocks { .. } => unreachable!("several processes run on the in-memory store"),
        }
    }

    pub(crate) fn sync(&self) -> Result<(), Error> {
        self.store().sync()
    }

    pub(crate) fn fail_next_commits(&mut self, n: u32) {
        match self {
            SimStore::Mem(m, _) => m.fail_next_commits(n),
            SimStore::Rocks { fail_next, .. } => *fail_next = n,
        }
    }

    /// Switches the store's duplicate-terminal check (broken engine only).
    pub(crate) fn set_duplicate_terminal_check(&self, on: bool) {
        if let SimStore::Mem(m, _) = self {
            m.set_duplicate_terminal_check(on);
        }
    }

    /// The process dies: unsynced data is dropped or torn (in-memory), or
    /// the store is closed and its directory reopened (RocksDB).
    pub(crate) fn crash(&mut self, mode: CrashMode) -> Result<(), SimError> {
        match self {
            SimStore::Mem(m, _) => m.crash(mode),
            SimStore::Rocks {
                dir,
                store,
                fail_next,
            } => {
                *fail_next = 0;
                drop(store.take());
                *store = Some(Box::new(
                    RocksStore::open(dir.path(), Durability::Sync)
                        .map_err(|e| SimError::Store(e.to_string()))?,
                ));
            }
        }
        Ok(())
    }

    /// The durable bytes of event `seq` of `run`: what a crash now keeps.
    pub(crate) fn durable_event(&self, run: RunId, seq: Seq) -> Option<Vec<u8>> {
        let key = keys::event_key(run, seq);
        match self {
            SimStore::Mem(m, _) => m.with_durable(|d| d.get(Cf::Events, &key).ok().flatten()),
            // Sync durability: whatever a commit wrote is durable.
            SimStore::Rocks { .. } => self.store().view().get(Cf::Events, &key).ok().flatten(),
        }
    }
}
