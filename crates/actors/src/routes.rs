//! Where a request or a message for a shard goes: to the shard's actor
//! when this process runs it, else, on a store shared by several engine
//! processes, to the relay (see [`crate::cluster`]), addressed to the
//! shard, whose owner (now or later) takes it.

use actix::Addr;
use crossbeam_channel::{Sender, TrySendError};
use keel_core::driver::{
    Answer, AttemptKey, AttemptOrder, Message, Request, RequestId, ShardId, ShardInput,
};
use keel_storage::{AttemptNo, Failure, Fence, LeaseEpoch, Payload, RelayTo};
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
    /// An attempt for whichever process takes it ([`RelayTo::Work`]).
    Attempt {
        /// The shard that supervises it.
        shard: ShardId,
        /// The attempt.
        order: AttemptOrder,
    },
    /// What a copy of an attempt running in another process reports to
    /// the shard that supervises it.
    Report(Report),
    /// Stop the copy of an attempt this process took.
    Stop {
        /// The execution.
        key: AttemptKey,
        /// The copy's epoch.
        epoch: LeaseEpoch,
    },
}

/// A copy's report, as it travels between processes.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub(crate) enum Report {
    /// Process `by` took the copy (so that a stop finds it).
    Taken {
        key: AttemptKey,
        epoch: LeaseEpoch,
        by: String,
    },
    /// See [`ShardInput::AttemptFinished`].
    Finished {
        key: AttemptKey,
        attempt: AttemptNo,
        epoch: LeaseEpoch,
        result: Result<Payload, Failure>,
    },
    /// See [`ShardInput::Heartbeat`].
    Heartbeat {
        key: AttemptKey,
        epoch: LeaseEpoch,
        details: Option<Payload>,
    },
    /// See [`ShardInput::AttemptRefused`].
    Refused {
        key: AttemptKey,
        epoch: LeaseEpoch,
        policy: String,
    },
}

impl Report {
    /// The report of a copy's input to its shard; `None` for inputs that
    /// are not a copy's.
    pub(crate) fn of(input: ShardInput) -> Option<Report> {
        Some(match input {
            ShardInput::AttemptFinished {
                key,
                attempt,
                epoch,
                result,
            } => Report::Finished {
                key,
                attempt,
                epoch,
                result,
            },
            ShardInput::Heartbeat {
                key,
                epoch,
                details,
            } => Report::Heartbeat {
                key,
                epoch,
                details,
            },
            ShardInput::AttemptRefused { key, epoch, policy } => {
                Report::Refused { key, epoch, policy }
            }
            _ => return None,
        })
    }

    /// The execution and copy it is about.
    pub(crate) fn copy(&self) -> (AttemptKey, LeaseEpoch) {
        match self {
            Report::Taken { key, epoch, .. }
            | Report::Finished { key, epoch, .. }
            | Report::Heartbeat { key, epoch, .. }
            | Report::Refused { key, epoch, .. } => (*key, *epoch),
        }
    }

    /// The input for the shard; `None` for [`Report::Taken`], which only
    /// the host keeps.
    pub(crate) fn into_input(self) -> Option<ShardInput> {
        Some(match self {
            Report::Taken { .. } => return None,
            Report::Finished {
                key,
                attempt,
                epoch,
                result,
            } => ShardInput::AttemptFinished {
                key,
                attempt,
                epoch,
                result,
            },
            Report::Heartbeat {
                key,
                epoch,
                details,
            } => ShardInput::Heartbeat {
                key,
                epoch,
                details,
            },
            Report::Refused { key, epoch, policy } => {
                ShardInput::AttemptRefused { key, epoch, policy }
            }
        })
    }
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
        self.try_relay(to, wire).is_ok()
    }

    /// [`Routes::relay`], handing back a note it could not queue.
    pub(crate) fn try_relay(&self, to: RelayTo, wire: Wire) -> Result<(), Box<Wire>> {
        let Some(link) = &self.relay else {
            return Err(Box::new(wire));
        };
        match link.tx.try_send((to, wire)) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full((_, wire))) => {
                tracing::warn!(
                    limit = RELAY_QUEUE_MAX,
                    "the relay's queue is full; a note is dropped and will be sent again"
                );
                Err(Box::new(wire))
            }
            Err(TrySendError::Disconnected((_, wire))) => Err(Box::new(wire)),
        }
    }
}
