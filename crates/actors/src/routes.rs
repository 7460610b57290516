//! Where a request or a message for a shard goes: to the shard's actor
//! when this process runs it, else, on a store shared by several engine
//! processes, to the relay (see [`crate::cluster`]), addressed to the
//! shard, whose owner (now or later) takes it.

use actix::Addr;
use crossbeam_channel::{Sender, TrySendError};
use keel_core::driver::{Answer, Message, Request, RequestId, ShardId};
use keel_storage::{Fence, RelayTo};
use parking_lot::RwLock;

use crate::shard::ShardActor;

/// Notes queued for the relay at most; a sender finding the queue full
/// drops its note (the outbox and the clients send again, so nothing that
/// matters is lost, and a stuck database cannot grow memory without end).
pub const RELAY_QUEUE_MAX: usize = 65_536;

/// What goes between engine processes through the store's relay.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub(crate) enum Wire {
    /// A client request made on process `from`; answer to it with `id`.
    Request {
        /// The member name of the process the client waits on.
        from: String,
        /// Its id there.
        id: RequestId,
        /// The request.
        request: Request,
    },
    /// A message between shards.
    Message(Message),
    /// The answer to a request relayed from this process.
    Answer {
        /// The id the request had here.
        id: RequestId,
        /// The answer.
        answer: Answer,
    },
}

/// A shard running in this process: its actor, the lease it runs under
/// (on a shared store) and the generation that tells one actor of the
/// shard from the next.
#[derive(Clone)]
pub(crate) struct Local {
    pub(crate) addr: Addr<ShardActor>,
    pub(crate) fence: Option<Fence>,
    pub(crate) generation: u64,
}

/// The relay's end in this process: its member name and the queue of
/// notes to send.
pub(crate) struct RelayLink {
    pub(crate) name: String,
    pub(crate) tx: Sender<(RelayTo, Wire)>,
}

/// The shards of this process, by id, and the way to the others.
pub(crate) struct Routes {
    count: u16,
    local: RwLock<Vec<Option<Local>>>,
    pub(crate) relay: Option<RelayLink>,
}

impl Routes {
    pub(crate) fn new(count: u16, relay: Option<RelayLink>) -> Self {
        Routes {
            count,
            local: RwLock::new(vec![None; usize::from(count)]),
            relay,
        }
    }

    /// Shards runs are spread over (the same in every process).
    pub(crate) fn count(&self) -> u16 {
        self.count
    }

    /// The actor of `shard`, if this process runs it.
    pub(crate) fn local(&self, shard: ShardId) -> Option<Addr<ShardActor>> {
        self.local.read()[usize::from(shard.0)]
            .as_ref()
            .map(|l| l.addr.clone())
    }

    /// `shard` as it runs here: its actor and generation.
    pub(crate) fn local_entry(&self, shard: ShardId) -> Option<(ShardId, Local)> {
        self.local.read()[usize::from(shard.0)]
            .clone()
            .map(|l| (shard, l))
    }

    /// Any shard this process runs (a list reads the shared index).
    pub(crate) fn any_local(&self) -> Option<(ShardId, Local)> {
        self.all_local().into_iter().next()
    }

    /// Every shard this process runs.
    pub(crate) fn all_local(&self) -> Vec<(ShardId, Local)> {
        self.local
            .read()
            .iter()
            .enumerate()
            .filter_map(|(i, l)| l.clone().map(|l| (ShardId(i as u16), l)))
            .collect()
    }

    /// `shard` runs here from now on.
    pub(crate) fn set(&self, shard: ShardId, local: Local) {
        self.local.write()[usize::from(shard.0)] = Some(local);
    }

    /// Generation `generation` of `shard` stopped (a later one, already
    /// started, stays).
    pub(crate) fn remove(&self, shard: ShardId, generation: u64) {
        let mut local = self.local.write();
        let slot = &mut local[usize::from(shard.0)];
        if slot.as_ref().is_some_and(|l| l.generation == generation) {
            *slot = None;
        }
    }

    /// Queues a note for another process; `false` when there is no relay
    /// (one process alone on its store) or its queue is full.
    pub(crate) fn relay(&self, to: RelayTo, wire: Wire) -> bool {
        let Some(link) = &self.relay else {
            return false;
        };
        match link.tx.try_send((to, wire)) {
            Ok(()) => true,
            Err(TrySendError::Full(_)) => {
                tracing::warn!(
                    limit = RELAY_QUEUE_MAX,
                    "the relay's queue is full; a note is dropped and will be sent again"
                );
                false
            }
            Err(TrySendError::Disconnected(_)) => false,
        }
    }
}
