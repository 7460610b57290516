//! Column families and the byte layout of every key.
//!
//! Numbers in keys are big-endian so that byte order is numeric order: a
//! run's events scan in seq order and timers scan in due order.

use crate::event::DurableKey;
use crate::ids::{RunId, Seq, Step, Timestamp};

/// The column families of a keel store. Everything except `Events` and
/// `Meta` is derived state that `verify` rebuilds from `Events` and compares.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub enum Cf {
    /// `run ‖ seq` → event record. The source of truth.
    Events,
    /// `run` → run metadata.
    Runs,
    /// `instance id` → the instance's current run.
    Instances,
    /// `run ‖ durable key` → seq of the committed terminal event.
    Dedupe,
    /// `due ‖ run ‖ step` → timer record, in due order.
    Timers,
    /// `run ‖ step` → due time, to find a run's open timers.
    RunTimers,
    /// `kind ‖ run ‖ step` → outbox message.
    Outbox,
    /// `run ‖ step` → the pending attempt of an activity execution.
    Tasks,
    /// Runs by status, type, instance, start and close time and search
    /// attribute values (layout in [`crate::search`]) → empty.
    Index,
    /// `parent run ‖ step` → the child a run started and has not heard
    /// back from: what its close policy applies to.
    Children,
    /// Store metadata (format, schema version) and parked runs. Not derived.
    Meta,
}

impl Cf {
    /// Every column family, in the order of [`Cf::index`] (per-family
    /// arrays, such as the PostgreSQL store's statements, are built from it
    /// and looked up by index).
    pub const ALL: [Cf; 11] = [
        Cf::Events,
        Cf::Runs,
        Cf::Instances,
        Cf::Dedupe,
        Cf::Timers,
        Cf::RunTimers,
        Cf::Outbox,
        Cf::Tasks,
        Cf::Index,
        Cf::Children,
        Cf::Meta,
    ];

    /// The derived column families that `verify` rebuilds.
    pub const DERIVED: [Cf; 9] = [
        Cf::Runs,
        Cf::Instances,
        Cf::Dedupe,
        Cf::Timers,
        Cf::RunTimers,
        Cf::Outbox,
        Cf::Tasks,
        Cf::Index,
        Cf::Children,
    ];

    /// The column family's name in RocksDB.
    pub fn name(self) -> &'static str {
        match self {
            Cf::Events => "events",
            Cf::Runs => "runs",
            Cf::Instances => "instances",
            Cf::Dedupe => "dedupe",
            Cf::Timers => "timers",
            Cf::RunTimers => "run_timers",
            Cf::Outbox => "outbox",
            Cf::Tasks => "tasks",
            Cf::Index => "index",
            Cf::Meta => "meta",
            Cf::Children => "children",
        }
    }

    /// Index into per-family arrays.
    pub fn index(self) -> usize {
        self as usize
    }
}

/// `run ‖ seq`.
pub fn event_key(run: RunId, seq: Seq) -> Vec<u8> {
    event_key_array(run, seq).to_vec()
}

/// [`event_key`] without an allocation.
pub fn event_key_array(run: RunId, seq: Seq) -> [u8; 24] {
    let mut k = [0; 24];
    k[..16].copy_from_slice(run.as_bytes());
    k[16..].copy_from_slice(&seq.0.to_be_bytes());
    k
}

/// Splits an events key into run and seq; `None` for a malformed key.
pub fn parse_event_key(key: &[u8]) -> Option<(RunId, Seq)> {
    if key.len() != 24 {
        return None;
    }
    let run = RunId(uuid::Uuid::from_slice(&key[..16]).ok()?);
    let seq = u64::from_be_bytes(key[16..24].try_into().ok()?);
    Some((run, Seq(seq)))
}

/// The run id at the front of a run-prefixed key.
pub fn run_prefix(key: &[u8]) -> Option<RunId> {
    key.get(..16)
        .and_then(|b| uuid::Uuid::from_slice(b).ok())
        .map(RunId)
}

/// `run`.
pub fn run_key(run: RunId) -> Vec<u8> {
    run.as_bytes().to_vec()
}

/// `run ‖ durable key`.
pub fn dedupe_key(run: RunId, key: &DurableKey) -> Vec<u8> {
    let mut k = run.as_bytes().to_vec();
    match key {
        DurableKey::Run => k.push(b'w'),
        DurableKey::Execution(s) => {
            k.push(b'x');
            k.extend_from_slice(&s.0.to_be_bytes());
        }
        DurableKey::Attempt(s, a) => {
            k.push(b'a');
            k.extend_from_slice(&s.0.to_be_bytes());
            k.extend_from_slice(&a.0.to_be_bytes());
        }
        DurableKey::Timer(s) => {
            k.push(b't');
            k.extend_from_slice(&s.0.to_be_bytes());
        }
        DurableKey::Child(s) => {
            k.push(b'c');
            k.extend_from_slice(&s.0.to_be_bytes());
        }
        DurableKey::SelectionWinner(s) => {
            k.push(b's');
            k.extend_from_slice(&s.0.to_be_bytes());
        }
        DurableKey::SelectionCancel(s, m) => {
            k.push(b'k');
            k.extend_from_slice(&s.0.to_be_bytes());
            k.extend_from_slice(&m.to_be_bytes());
        }
        DurableKey::Command(c) => {
            k.push(b'm');
            k.extend_from_slice(c.0.as_bytes());
        }
        DurableKey::UpdateCompleted(c) => {
            k.push(b'u');
            k.extend_from_slice(c.0.as_bytes());
        }
        DurableKey::Scope(s) => {
            k.push(b'p');
            k.extend_from_slice(&s.0.to_be_bytes());
        }
        DurableKey::ChildCancel(s) => {
            k.push(b'q');
            k.extend_from_slice(&s.0.to_be_bytes());
        }
        DurableKey::Send(s) => {
            k.push(b'e');
            k.extend_from_slice(&s.0.to_be_bytes());
        }
        DurableKey::Message(stream, key) => {
            // Length-prefixed stream name, so (stream, key) pairs never
            // collide.
            k.push(b'g');
            k.extend_from_slice(&(stream.len() as u32).to_be_bytes());
            k.extend_from_slice(stream.as_bytes());
            k.extend_from_slice(key.0.as_bytes());
        }
    }
    k
}

/// `due ‖ run ‖ step`.
pub fn timer_key(due: Timestamp, run: RunId, step: Step) -> Vec<u8> {
    let mut k = Vec::with_capacity(28);
    k.extend_from_slice(&due.0.to_be_bytes());
    k.extend_from_slice(run.as_bytes());
    k.extend_from_slice(&step.0.to_be_bytes());
    k
}

/// Splits the dedupe key of an attempt (`run ‖ 'a' ‖ step ‖ attempt`,
/// see [`dedupe_key`]); `None` for any other key.
pub fn parse_attempt_dedupe_key(key: &[u8]) -> Option<(RunId, Step, crate::ids::AttemptNo)> {
    if key.len() != 25 || key[16] != b'a' {
        return None;
    }
    let run = run_prefix(key)?;
    let step = u32::from_be_bytes(key[17..21].try_into().ok()?);
    let attempt = u32::from_be_bytes(key[21..25].try_into().ok()?);
    Some((run, Step(step), crate::ids::AttemptNo(attempt)))
}

/// `run ‖ step`, for run timers, tasks and children.
pub fn run_step_key(run: RunId, step: Step) -> Vec<u8> {
    let mut k = Vec::with_capacity(20);
    k.extend_from_slice(run.as_bytes());
    k.extend_from_slice(&step.0.to_be_bytes());
    k
}

/// Splits a `run ‖ step` key; `None` for a malformed key.
pub fn parse_run_step_key(key: &[u8]) -> Option<(RunId, Step)> {
    if key.len() != 20 {
        return None;
    }
    let run = run_prefix(key)?;
    let step = u32::from_be_bytes(key[16..20].try_into().ok()?);
    Some((run, Step(step)))
}

/// Outbox key of a child start: `'S' ‖ parent run ‖ step`.
pub fn outbox_start_key(parent: RunId, step: Step) -> Vec<u8> {
    let mut k = vec![b'S'];
    k.extend_from_slice(parent.as_bytes());
    k.extend_from_slice(&step.0.to_be_bytes());
    k
}

/// Outbox key of a child's result: `'R' ‖ child run`.
pub fn outbox_result_key(child: RunId) -> Vec<u8> {
    let mut k = vec![b'R'];
    k.extend_from_slice(child.as_bytes());
    k
}

/// Outbox key of a child's cancellation: `'C' ‖ child run`.
pub fn outbox_cancel_key(child: RunId) -> Vec<u8> {
    let mut k = vec![b'C'];
    k.extend_from_slice(child.as_bytes());
    k
}

/// Outbox key of a continue-as-new hand-off: `'N' ‖ new run`.
pub fn outbox_continue_key(new_run: RunId) -> Vec<u8> {
    let mut k = vec![b'N'];
    k.extend_from_slice(new_run.as_bytes());
    k
}

/// Outbox key of a send from workflow code: `'D' ‖ sender run ‖ step`.
pub fn outbox_deliver_key(sender: RunId, step: Step) -> Vec<u8> {
    let mut k = vec![b'D'];
    k.extend_from_slice(sender.as_bytes());
    k.extend_from_slice(&step.0.to_be_bytes());
    k
}

/// Key of the store's metadata record in `Meta`.
pub const STORE_META_KEY: &[u8] = b"store";

/// Prefix of the shard leases in `Meta` (see [`crate::lease`]).
pub const SHARD_LEASE_PREFIX: &[u8] = b"shard-lease/";

/// `"shard-lease/" ‖ shard` in `Meta`.
pub fn shard_lease_key(shard: u16) -> Vec<u8> {
    let mut k = SHARD_LEASE_PREFIX.to_vec();
    k.extend_from_slice(&shard.to_be_bytes());
    k
}

/// Key of the shard count of a shared store in `Meta` (see
/// [`crate::lease::decide_shard_count`]).
pub const SHARD_COUNT_KEY: &[u8] = b"shard-count";

/// Prefix of the members of a shared store in `Meta` (see
/// [`crate::lease::Member`]).
pub const MEMBER_PREFIX: &[u8] = b"member/";

/// `"member/" ‖ owner` in `Meta`.
pub fn member_key(owner: &str) -> Vec<u8> {
    let mut k = MEMBER_PREFIX.to_vec();
    k.extend_from_slice(owner.as_bytes());
    k
}

/// The prefix of every park marker in `Meta`.
pub const PARKED_PREFIX: &[u8] = b"parked/";

/// `"parked/" ‖ run` in `Meta`.
pub fn parked_key(run: RunId) -> Vec<u8> {
    let mut k = PARKED_PREFIX.to_vec();
    k.extend_from_slice(run.as_bytes());
    k
}

/// The smallest key strictly greater than every key with `prefix`, or `None`
/// when the prefix is all 0xff.
pub fn prefix_end(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return Some(end);
        }
    }
    None
}

#[cfg(test)]
mod cf_tests {
    // Goal: `Cf::ALL[cf.index()] == cf` for every family, so an array built
    // from `ALL` and read by `index()` names the right family (the
    // PostgreSQL store once kept children in `kv_meta` and its metadata in
    // `kv_children` because the two were listed out of order).
    use super::*;

    #[test]
    fn every_family_sits_at_its_index() {
        for (i, cf) in Cf::ALL.iter().enumerate() {
            assert_eq!(cf.index(), i, "{cf:?}");
        }
    }
}

#[cfg(test)]
mod dedupe_key_tests {
    // Goal: the layout the schema 6 migration reads dedupe keys by, in
    // `parse_attempt_dedupe_key` and the PostgreSQL store's
    // `migration_deletes` (offsets in SQL): the run's 16 bytes, then `a`,
    // the step and the attempt (25 bytes), or `x` and the step (21).
    use super::*;
    use crate::ids::AttemptNo;

    #[test]
    fn attempt_and_execution_keys_have_the_layout_the_migration_reads() {
        let run = RunId::from_u64_pair(7, 9);
        let attempt = dedupe_key(run, &DurableKey::Attempt(Step(0x0102_0304), AttemptNo(5)));
        assert_eq!(
            parse_attempt_dedupe_key(&attempt),
            Some((run, Step(0x0102_0304), AttemptNo(5)))
        );
        let execution = dedupe_key(run, &DurableKey::Execution(Step(0x0102_0304)));
        assert_eq!(attempt.len(), 25);
        assert_eq!(execution.len(), 21);
        assert_eq!(&attempt[..16], run.as_bytes());
        assert_eq!(&execution[..16], run.as_bytes());
        assert_eq!((attempt[16], execution[16]), (b'a', b'x'));
        assert_eq!(attempt[17..21], execution[17..21]);
        assert_eq!(&attempt[17..21], &[1, 2, 3, 4]);
        assert_eq!(&attempt[21..], &5u32.to_be_bytes());
    }
}
