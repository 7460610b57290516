//! The relay: notes that engine processes sharing a store leave for each
//! other. A client request made on a process that does not own the run's
//! shard, a message to a shard another process runs, and the answers to
//! both travel as notes addressed to a shard (read by whichever process
//! holds it, now or later) or to a process (read by that process only).
//!
//! A note is read once: taking it removes it. Delivery is at most once,
//! and what must arrive is sent again by its sender until answered (the
//! outbox resends a message, a client resends its request), so together
//! they deliver at least once, and the driver's deduplication by durable
//! id makes that exactly one commit. Notes nobody takes (a process that
//! died) are forgotten after [`RELAY_NOTE_AGE_MS_MAX`].
//!
//! A store that can tell a process at once that notes were left for an
//! address (PostgreSQL's `NOTIFY`) offers a [`RelayNotices`] stream from
//! [`Relay::relay_listen`]; the process takes notes when a notice names
//! one of its addresses, and still looks now and then without one, since
//! notices are lossy (a connection that broke, a full queue).

use std::collections::VecDeque;
use std::fmt;

use crossbeam_channel::{Receiver, Sender, TrySendError};
use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::ids::Timestamp;
use crate::lease::ShardLeases;

/// Largest note in bytes: a request or an answer carries at most a few
/// payloads of [`crate::PAYLOAD_BYTES_MAX`].
pub const RELAY_NOTE_BYTES_MAX: usize = 4 << 20;

/// Notes older than this are forgotten: their addressee is gone, and
/// their sender has sent again or given up long before.
pub const RELAY_NOTE_AGE_MS_MAX: u64 = 10 * 60 * 1_000;

/// Most notes an in-memory relay keeps waiting (a real database keeps
/// what its disk holds, forgotten after [`RELAY_NOTE_AGE_MS_MAX`]).
pub const MEM_RELAY_NOTES_MAX: usize = 65_536;

/// Most notices queued for a listener that has not read them: further
/// ones are dropped (the listener's own polling finds their notes).
pub const RELAY_NOTICES_QUEUED_MAX: usize = 4_096;

/// Notices of notes left: each is the address ([`RelayTo::key`]) of a note
/// some process left since the listener started. Lossy, never false: a
/// notice always follows a note, but a note may come without one.
pub type RelayNotices = Receiver<String>;

/// The sending half of a listener's notices: a full queue drops the
/// notice (returns `false` only when the listener is gone).
pub fn notify(to: &Sender<String>, key: String) -> bool {
    !matches!(to.try_send(key), Err(TrySendError::Disconnected(_)))
}

/// Who a note is for.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RelayTo {
    /// Whichever process holds the shard's lease.
    Shard(u16),
    /// One engine process, by its member name.
    Process(String),
    /// Whichever process that runs this activity type takes it first (an
    /// attempt any such process may run).
    Work(String),
}

impl RelayTo {
    /// The address as the store keeps it: `s/<shard>` or `p/<name>`.
    pub fn key(&self) -> String {
        match self {
            RelayTo::Shard(s) => format!("s/{s}"),
            RelayTo::Process(p) => format!("p/{p}"),
            RelayTo::Work(activity_type) => format!("w/{activity_type}"),
        }
    }

    /// Reads back an address [`RelayTo::key`] wrote.
    pub fn parse(key: &str) -> Option<Self> {
        match key.split_once('/')? {
            ("s", s) => s.parse().ok().map(RelayTo::Shard),
            ("p", p) if !p.is_empty() => Some(RelayTo::Process(p.to_string())),
            ("w", t) if !t.is_empty() => Some(RelayTo::Work(t.to_string())),
            _ => None,
        }
    }
}

impl fmt::Display for RelayTo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RelayTo::Shard(s) => write!(f, "shard {s}"),
            RelayTo::Process(p) => write!(f, "process {p}"),
            RelayTo::Work(t) => write!(f, "any process running {t}"),
        }
    }
}

/// A note: its address and its bytes (the sender's encoding).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Note {
    /// Who it is for.
    pub to: RelayTo,
    /// What it says.
    pub body: Vec<u8>,
}

/// Notes between engine processes that share a store.
pub trait Relay: Send + Sync {
    /// Leaves `notes` (all or none) at `now`.
    fn relay_send(&self, notes: &[Note], now: Timestamp) -> Result<()>;

    /// Takes up to `max` notes addressed to any of `to`, oldest first:
    /// nobody else gets them.
    fn relay_take(&self, to: &[RelayTo], max: usize) -> Result<Vec<Note>>;

    /// Forgets notes left before `before`; returns how many.
    fn relay_forget(&self, before: Timestamp) -> Result<u64>;

    /// Notices of the notes left from now on, if this store gives them;
    /// `None` when the caller must poll.
    fn relay_listen(&self) -> Option<RelayNotices> {
        None
    }
}

/// What a store shared by several engine processes offers them: shard
/// leases and the relay.
pub trait SharedStore: ShardLeases + Relay {}

impl<T: ShardLeases + Relay> SharedStore for T {}

/// Checks a note before it is left.
pub fn check_note(note: &Note) -> Result<()> {
    if note.body.len() > RELAY_NOTE_BYTES_MAX {
        return Err(Error::NoteTooLarge {
            to: note.to.to_string(),
            bytes: note.body.len(),
            max: RELAY_NOTE_BYTES_MAX,
        });
    }
    Ok(())
}

/// The notes of an in-memory store, in the order they were left.
#[derive(Debug, Default)]
pub struct MemRelay {
    notes: Mutex<VecDeque<(Timestamp, Note)>>,
    listeners: Mutex<Vec<Sender<String>>>,
}

impl Relay for MemRelay {
    fn relay_send(&self, notes: &[Note], now: Timestamp) -> Result<()> {
        notes.iter().try_for_each(check_note)?;
        let mut q = self.notes.lock();
        if q.len() + notes.len() > MEM_RELAY_NOTES_MAX {
            return Err(Error::RelayFull {
                max: MEM_RELAY_NOTES_MAX,
            });
        }
        q.extend(notes.iter().map(|n| (now, n.clone())));
        drop(q);
        self.listeners
            .lock()
            .retain(|l| notes.iter().all(|n| notify(l, n.to.key())));
        Ok(())
    }

    fn relay_take(&self, to: &[RelayTo], max: usize) -> Result<Vec<Note>> {
        let mut q = self.notes.lock();
        let mut taken = Vec::new();
        let mut kept = VecDeque::with_capacity(q.len());
        for (at, note) in q.drain(..) {
            if taken.len() < max && to.contains(&note.to) {
                taken.push(note);
            } else {
                kept.push_back((at, note));
            }
        }
        *q = kept;
        Ok(taken)
    }

    fn relay_forget(&self, before: Timestamp) -> Result<u64> {
        let mut q = self.notes.lock();
        let n = q.len();
        q.retain(|(at, _)| *at >= before);
        Ok((n - q.len()) as u64)
    }

    fn relay_listen(&self) -> Option<RelayNotices> {
        let (tx, rx) = crossbeam_channel::bounded(RELAY_NOTICES_QUEUED_MAX);
        self.listeners.lock().push(tx);
        Some(rx)
    }
}

#[cfg(test)]
mod tests {
    // Goal: addresses survive their round trip through the store's key,
    // and the in-memory relay gives each note to one taker, oldest first,
    // only to its addressee. Method: direct calls.
    use super::*;

    #[test]
    fn a_listener_hears_of_the_notes_left_after_it_started() {
        // Goal: notices name the address of every note left while a
        // listener listens, and a listener that went away is forgotten.
        let relay = MemRelay::default();
        let note = |to: RelayTo| Note { to, body: vec![0] };
        relay
            .relay_send(&[note(RelayTo::Shard(1))], Timestamp(1))
            .unwrap();
        let notices = relay.relay_listen().unwrap();
        relay
            .relay_send(
                &[note(RelayTo::Shard(2)), note(RelayTo::Process("a".into()))],
                Timestamp(2),
            )
            .unwrap();
        assert_eq!(notices.try_iter().collect::<Vec<_>>(), ["s/2", "p/a"]);
        drop(notices);
        relay
            .relay_send(&[note(RelayTo::Shard(3))], Timestamp(3))
            .unwrap();
        assert!(relay.listeners.lock().is_empty());
    }

    #[test]
    fn addresses_round_trip_and_notes_go_once_to_their_addressee() {
        for to in [
            RelayTo::Shard(7),
            RelayTo::Process("h:1:ab".into()),
            RelayTo::Work("billing/charge".into()),
        ] {
            assert_eq!(RelayTo::parse(&to.key()), Some(to));
        }
        assert_eq!(RelayTo::parse("x/1"), None);
        assert_eq!(RelayTo::parse("p/"), None);
        let relay = MemRelay::default();
        let note = |to: RelayTo, b: u8| Note { to, body: vec![b] };
        relay
            .relay_send(
                &[
                    note(RelayTo::Shard(1), 1),
                    note(RelayTo::Process("a".into()), 2),
                    note(RelayTo::Shard(1), 3),
                ],
                Timestamp(10),
            )
            .unwrap();
        let mine = relay.relay_take(&[RelayTo::Shard(1)], 10).unwrap();
        assert_eq!(mine.iter().map(|n| n.body[0]).collect::<Vec<_>>(), [1, 3]);
        assert!(relay
            .relay_take(&[RelayTo::Shard(1)], 10)
            .unwrap()
            .is_empty());
        assert_eq!(relay.relay_forget(Timestamp(11)).unwrap(), 1);
        let big = note(RelayTo::Shard(0), 0);
        let big = Note {
            body: vec![0; RELAY_NOTE_BYTES_MAX + 1],
            ..big
        };
        assert!(matches!(
            relay.relay_send(&[big], Timestamp(12)),
            Err(Error::NoteTooLarge { .. })
        ));
    }
}
