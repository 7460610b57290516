//! The state a run's workflow code shares with its machine.
//!
//! Command futures reach the machine through [`Core::issue`]: while the run
//! replays, an issued command must match the next recorded command event
//! (else a typed non-determinism error); once history is exhausted, the
//! command becomes a new event in the pending batch. So matching happens at
//! the moment code issues a command, in the order it issues them.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::task::Waker;

use keel_storage::{
    AttemptNo, CarriedStream, CommandId, Event, EventKind, Failure, GroupEntry, GroupPath,
    InstanceId, MessageKey, Payload, RunId, Seq, Step, StreamMessage, Timestamp,
};

use crate::machine::MachineError;

/// One message stream of a run: what was committed on it, what workflow
/// code has not read yet, and the keys that deduplicate sends.
#[derive(Clone, Debug, Default)]
pub(crate) struct StreamState {
    /// The offset the next committed message gets.
    pub next_offset: u64,
    /// Committed and not read yet, in offset order.
    pub unread: VecDeque<StreamMessage>,
    /// Every key committed on the stream in this run or carried into it,
    /// with its offset.
    pub keys: HashMap<MessageKey, u64>,
    /// The same keys, oldest first: the newest are carried on.
    key_order: VecDeque<MessageKey>,
}

impl StreamState {
    /// The state a run starts with, from what its predecessor carried.
    pub(crate) fn carried(c: &CarriedStream) -> Self {
        let mut s = StreamState {
            next_offset: c.next_offset,
            unread: c.unread.iter().cloned().collect(),
            ..StreamState::default()
        };
        for (key, offset) in &c.keys {
            s.remember(key.clone(), *offset);
        }
        s
    }

    /// Records a committed message.
    pub(crate) fn commit(&mut self, message: StreamMessage) {
        self.next_offset = message.offset + 1;
        self.remember(message.key.clone(), message.offset);
        self.unread.push_back(message);
    }

    fn remember(&mut self, key: MessageKey, offset: u64) {
        if self.keys.insert(key.clone(), offset).is_none() {
            self.key_order.push_back(key);
        }
    }

    /// The reader's position: the offset of the next message it reads.
    pub(crate) fn cursor(&self) -> u64 {
        self.unread.front().map_or(self.next_offset, |m| m.offset)
    }

    /// What continue-as-new hands on for this stream.
    pub(crate) fn to_carried(&self, name: &str) -> CarriedStream {
        let skip = self
            .key_order
            .len()
            .saturating_sub(keel_storage::STREAM_KEYS_CARRIED_MAX);
        CarriedStream {
            name: name.to_string(),
            next_offset: self.next_offset,
            unread: self.unread.iter().cloned().collect(),
            keys: self
                .key_order
                .iter()
                .skip(skip)
                .map(|k| (k.clone(), self.keys[k]))
                .collect(),
        }
    }
}

/// An `all` barrier whose leaves are being issued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ActiveGroup {
    /// The barrier's durable step.
    pub step: Step,
    /// Its size (leaves, or members for a limited barrier).
    pub size: u32,
    /// The index the next leaf gets.
    pub next: u32,
    /// Whether each leaf advances the index (plain `all`) or the barrier
    /// sets it per member (limited fan-out).
    pub per_leaf: bool,
}

/// How a command's wait ended.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Resolution {
    /// A value (activity or child result; timer fired with an empty payload).
    Value(Payload),
    /// A typed failure.
    Failed(Failure),
}

/// What cancelling a wait on an activity or a child does: its scope was
/// cancelled, or it lost a `select`. Not recorded: the commands it leads
/// to are, so changing it for running workflows is a code change like any
/// other (guard it with `ctx.patched`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CancellationType {
    /// Ask it to stop (an activity's cancel request, a child's cancel or
    /// termination per its close policy) and go on at once. The default.
    #[default]
    TryCancel,
    /// Ask it to stop, and hold the completion of the scope that owns it
    /// (and of every scope around that one) and the run's close until it
    /// has closed: its cancellation, result or failure is committed.
    WaitCancellationCompleted,
    /// Do not ask: it runs on while this run is open, and whatever it
    /// returns is committed but read by no one. When this run closes, an
    /// activity's pending attempts are dropped with it and a child follows
    /// its close policy.
    Abandon,
}

/// What kind of durable wait is open at a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WaitKind {
    /// An activity execution.
    Activity,
    /// A timer.
    Timer,
    /// A child workflow.
    Child,
    /// A signal or message sent to an instance, until its target answers.
    Send,
}

/// An open durable wait, for `describe`.
#[derive(Clone, Debug, PartialEq)]
pub struct OpenWait {
    /// The command's step.
    pub step: Step,
    /// What it waits for.
    pub kind: WaitKind,
    /// Activity or workflow type; empty for timers.
    pub name: String,
    /// Enclosing `all` barriers.
    pub group: GroupPath,
    /// When it was issued.
    pub since: Timestamp,
    /// For activities: the current attempt.
    pub attempt: AttemptNo,
    /// For timers: when it fires.
    pub fire_at: Option<Timestamp>,
    /// For children: the child's run.
    pub child_run: Option<RunId>,
    /// The scope and coroutine that issued it, if a scope's coroutine did.
    pub owner: Option<(Step, u32)>,
    /// For children: what happens to the child when its scope or its
    /// parent is cancelled or closes.
    pub close_policy: Option<keel_storage::ParentClosePolicy>,
    /// For children: whether `ChildStarted` was committed.
    pub child_started: bool,
    /// For activities and children: what cancelling the wait does.
    pub cancellation: CancellationType,
}

/// The result of issuing a command.
pub(crate) enum Issued {
    /// A new command: its event is in the pending batch.
    Live(Event),
    /// The command was found in history: its recorded event.
    Replayed(Event),
    /// The command does not match history; the machine parks the run.
    Diverged,
}

/// The result of [`Core::issue_unbuilt`]: a live command's event is in the
/// pending batch, and the caller gets only when it was recorded (no copy).
pub(crate) enum IssuedUnbuilt {
    /// A new command, recorded at this time.
    Live(Timestamp),
    /// The command was found in history: its recorded event.
    Replayed(Event),
    /// The command does not match history; the machine parks the run.
    Diverged,
}

impl std::fmt::Debug for Core {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Core")
            .field("run_id", &self.run_id)
            .field("next_step", &self.next_step)
            .field("next_seq", &self.next_seq)
            .finish()
    }
}

/// Hashes a [`Step`] with one multiply. The maps keyed by steps are
/// looked up on every member's poll and every resolution, where SipHash
/// was a fifth of a 1,000-member fan-out's time; the keys are numbers the
/// machine assigned itself, so no input can choose them to collide. Where
/// one is iterated (`resolved`'s keys, when a barrier picks the members to
/// poll) the members picked are sorted after, so the hasher's order never
/// reaches a decision.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct StepHasher(u64);

impl std::hash::Hasher for StepHasher {
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(u64::from(*b));
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        // The multiplier of rustc's FxHasher: odd, with bits spread over
        // the whole word, so the high bits hash tables use vary.
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x517c_c1b7_2722_0a95);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// A map keyed by steps, hashed with [`StepHasher`].
pub(crate) type StepMap<V> = HashMap<Step, V, std::hash::BuildHasherDefault<StepHasher>>;

pub(crate) struct Core {
    pub run_id: RunId,
    pub instance_id: InstanceId,
    pub workflow_type: String,
    pub next_step: u32,
    pub next_seq: Seq,
    pub now: Timestamp,
    rng: u64,
    pub replay: VecDeque<Event>,
    pub pending: Vec<Event>,
    pub resolved: StepMap<Resolution>,
    waiters: StepMap<Waker>,
    pub signals: BTreeMap<String, VecDeque<Payload>>,
    pub signal_waits: BTreeMap<String, usize>,
    /// Message streams, by name.
    pub streams: BTreeMap<String, StreamState>,
    /// Stream names coroutines are waiting on, with how many wait.
    pub stream_waits: BTreeMap<String, usize>,
    general_waiters: Vec<Waker>,
    pub cancel_requested: Option<String>,
    pub group_stack: Vec<ActiveGroup>,
    pub error: Option<MachineError>,
    /// Durable waits not yet resolved, by step (hashed: whoever needs them
    /// in order sorts them).
    pub open: StepMap<OpenWait>,
    pub seen_commands: HashSet<CommandId>,
    /// The same, in the order committed (what continue-as-new carries).
    seen_order: VecDeque<CommandId>,
    /// Command ids an earlier run of the instance committed.
    pub carried_commands: HashSet<CommandId>,
    pub closed: bool,
    /// The scope coroutine being polled (scope step, coroutine index).
    pub current_owner: Option<(Step, u32)>,
    /// Set while the machine is being dropped: scopes must not issue.
    pub tearing_down: bool,
    /// Memo fields, sorted by name (as the store keeps them).
    pub memo: Vec<(String, Payload)>,
    /// The run's timeouts, as its start recorded them (continue-as-new
    /// hands them on).
    pub timeouts: keel_storage::RunTimeouts,
    /// Search attributes, sorted by name (as the store keeps them).
    pub search_attributes: Vec<(String, keel_storage::SearchValue)>,
    /// Children whose cancellation was issued (at most once each).
    pub child_cancelled: std::collections::BTreeSet<Step>,
    /// Waits cancelled with [`CancellationType::WaitCancellationCompleted`]
    /// that have not closed yet, with the scope that owns each (`None` for
    /// the workflow's own coroutine).
    pub draining: BTreeMap<Step, Option<Step>>,
    /// Every scope the run created, with the scope it is nested in.
    pub scope_parents: BTreeMap<Step, Option<Step>>,
    /// True while the machine rebuilds the run from its committed history
    /// (`RunMachine::replay`): what the code decides now was decided
    /// before, by whatever code ran then.
    pub historical: bool,
    /// Versions chosen per change id in this run (`ctx.version`,
    /// `ctx.patched`): once recorded, a change keeps its version.
    pub versions: BTreeMap<String, u32>,
    /// Updates accepted (`None` while their handler runs) and completed.
    pub updates: BTreeMap<CommandId, Option<Result<Payload, Failure>>>,
    /// True while a query or an update validator runs: reading a stream
    /// then takes nothing and marks the handler as having tried to change
    /// state.
    pub in_read_only: bool,
    /// A read-only handler tried to take a stream message.
    pub read_only_touched: bool,
    /// Async children whose closing this run applied (their outcome, live
    /// or replayed) and nobody has taken yet: their closures are no longer
    /// needed ([`crate::RunMachine::take_closed_async_children`]).
    pub async_closed: Vec<RunId>,
    /// Async children whose calls the code issued live (not in replay),
    /// their closures bound by this call alone, that nobody has taken
    /// yet: bound before the commit that schedules them is durable
    /// ([`crate::RunMachine::take_unsettled_async_children`]).
    pub async_unsettled: Vec<RunId>,
}

/// What a read-only handler must leave as it found it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Untouched {
    rng: u64,
    next_step: u32,
    next_seq: Seq,
    pending: usize,
    touched: bool,
}

impl Core {
    pub(crate) fn new(
        run_id: RunId,
        instance_id: InstanceId,
        workflow_type: String,
        random_seed: u64,
    ) -> Self {
        Core {
            run_id,
            instance_id,
            workflow_type,
            next_step: 1,
            next_seq: Seq::FIRST,
            now: Timestamp(0),
            rng: random_seed,
            replay: VecDeque::new(),
            pending: Vec::new(),
            resolved: StepMap::default(),
            waiters: StepMap::default(),
            signals: BTreeMap::new(),
            signal_waits: BTreeMap::new(),
            streams: BTreeMap::new(),
            stream_waits: BTreeMap::new(),
            general_waiters: Vec::new(),
            cancel_requested: None,
            group_stack: Vec::new(),
            error: None,
            open: StepMap::default(),
            seen_commands: HashSet::new(),
            seen_order: VecDeque::new(),
            carried_commands: HashSet::new(),
            closed: false,
            current_owner: None,
            tearing_down: false,
            memo: Vec::new(),
            timeouts: keel_storage::RunTimeouts::default(),
            search_attributes: Vec::new(),
            child_cancelled: Default::default(),
            draining: BTreeMap::new(),
            scope_parents: BTreeMap::new(),
            historical: false,
            versions: BTreeMap::new(),
            updates: BTreeMap::new(),
            in_read_only: false,
            read_only_touched: false,
            async_closed: Vec::new(),
            async_unsettled: Vec::new(),
        }
    }

    /// Records a committed command id (a signal's, a cancellation's, an
    /// update's).
    pub(crate) fn see_command(&mut self, c: CommandId) {
        if self.seen_commands.insert(c.clone()) {
            self.seen_order.push_back(c);
            if self.seen_order.len() > keel_storage::CARRIED_COMMANDS_MAX {
                // Still deduplicated in this run; no longer carried.
                self.seen_order.pop_front();
            }
        }
    }

    /// What continue-as-new hands to the next run: unread signals (by
    /// name, in arrival order) and the newest command ids.
    pub(crate) fn carried(&self) -> keel_storage::Carried {
        let signals = self
            .signals
            .iter()
            .flat_map(|(name, q)| {
                q.iter().map(|payload| keel_storage::CarriedSignal {
                    name: name.clone(),
                    payload: payload.clone(),
                })
            })
            .take(keel_storage::CARRIED_SIGNALS_MAX)
            .collect();
        let unread: usize = self.signals.values().map(VecDeque::len).sum();
        if unread > keel_storage::CARRIED_SIGNALS_MAX {
            tracing::warn!(run_id = %self.run_id, unread, limit = keel_storage::CARRIED_SIGNALS_MAX,
                "continue-as-new carries only the first unread signals; read them before continuing");
        }
        keel_storage::Carried {
            signals,
            commands: self.seen_order.iter().cloned().collect(),
            memo: self.memo.clone(),
            search_attributes: keel_storage::search::attributes_as_payloads(
                &self.search_attributes,
            ),
            streams: self
                .streams
                .iter()
                .map(|(name, s)| s.to_carried(name))
                .collect(),
            timeouts: self.timeouts,
        }
    }

    /// The state a query or a validator must not change.
    pub(crate) fn untouched(&self) -> Untouched {
        Untouched {
            rng: self.rng,
            next_step: self.next_step,
            next_seq: self.next_seq,
            pending: self.pending.len(),
            touched: self.read_only_touched,
        }
    }

    /// Undoes what a read-only handler changed; true if it changed anything.
    pub(crate) fn restore(&mut self, before: Untouched) -> bool {
        let changed = self.untouched() != before;
        self.rng = before.rng;
        self.next_step = before.next_step;
        self.next_seq = before.next_seq;
        self.pending.truncate(before.pending);
        self.read_only_touched = before.touched;
        changed
    }

    /// True while recorded events remain to be matched.
    pub(crate) fn replaying(&self) -> bool {
        !self.replay.is_empty()
    }

    /// The next deterministic random number (splitmix64 over the run's seed,
    /// which is recorded in `WorkflowStarted`).
    pub(crate) fn next_random(&mut self) -> u64 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Allocates the next step.
    pub(crate) fn take_step(&mut self) -> Step {
        let s = Step(self.next_step);
        self.next_step += 1;
        s
    }

    /// The group path of a leaf issued now. Barriers that count leaves
    /// advance their index for the next leaf.
    pub(crate) fn group(&mut self) -> GroupPath {
        let path = self
            .group_stack
            .iter()
            .map(|g| GroupEntry {
                step: g.step,
                size: g.size,
                index: g.next,
            })
            .collect();
        for g in &mut self.group_stack {
            if g.per_leaf {
                g.next += 1;
            }
        }
        path
    }

    /// Appends a new event to the pending batch and returns a copy.
    pub(crate) fn push_event(&mut self, kind: EventKind) -> Event {
        self.append(kind);
        self.pending.last().expect("just appended").clone()
    }

    /// Appends a new event to the pending batch; returns when it happened.
    fn append(&mut self, kind: EventKind) -> Timestamp {
        self.pending.push(Event {
            seq: self.next_seq,
            at: self.now,
            kind,
        });
        self.next_seq = self.next_seq.next();
        self.now
    }

    /// [`Core::issue`] for a command whose event costs to build (an
    /// activity's type name, options and input): while replaying, the
    /// recorded command is taken when `recorded_is` accepts it, which must
    /// say what [`commands_match`] would say of the built candidate, and
    /// nothing is built. `build` runs live (the event goes into the batch
    /// without a copy for the caller), and to describe a divergence. Never
    /// a version marker.
    pub(crate) fn issue_unbuilt(
        &mut self,
        recorded_is: impl FnOnce(&EventKind) -> bool,
        build: impl FnOnce() -> EventKind,
    ) -> IssuedUnbuilt {
        if self.error.is_some() {
            return IssuedUnbuilt::Diverged;
        }
        self.skip_markers();
        match self.replay.front() {
            Some(front) if front.kind.is_command() && recorded_is(&front.kind) => {
                let event = self.replay.pop_front().expect("front exists");
                self.next_seq = event.seq.next();
                IssuedUnbuilt::Replayed(event)
            }
            Some(_) => {
                let candidate = build();
                debug_assert!(!matches!(candidate, EventKind::VersionMarker { .. }));
                match self.issue(candidate) {
                    Issued::Live(e) => IssuedUnbuilt::Live(e.at),
                    Issued::Replayed(e) => IssuedUnbuilt::Replayed(e),
                    Issued::Diverged => IssuedUnbuilt::Diverged,
                }
            }
            None => {
                let candidate = build();
                debug_assert!(!matches!(candidate, EventKind::VersionMarker { .. }));
                IssuedUnbuilt::Live(self.append(candidate))
            }
        }
    }

    /// Issues a command: matched against history while replaying, appended
    /// as a new event otherwise.
    pub(crate) fn issue(&mut self, candidate: EventKind) -> Issued {
        if self.error.is_some() {
            return Issued::Diverged;
        }
        self.skip_markers_not_asked(&candidate);
        let Some(front) = self.replay.front() else {
            return Issued::Live(self.push_event(candidate));
        };
        if front.kind.is_command() && commands_match(&front.kind, &candidate) {
            let event = self.replay.pop_front().expect("front exists");
            self.next_seq = event.seq.next();
            return Issued::Replayed(event);
        }
        let step = candidate.step().unwrap_or_default();
        self.error = Some(if missing_group(&front.kind, &candidate) {
            MachineError::IncompatibleHistory {
                step,
                detail: format!(
                    "{} at step {step} was recorded without its parallel group path; \
                     history from an older version cannot be placed in the current barrier",
                    front.kind.name()
                ),
            }
        } else {
            MachineError::NonDeterminism {
                step,
                recorded: describe_recorded(front),
                issued: describe_command(&candidate),
            }
        });
        Issued::Diverged
    }

    /// Version markers hold no step: code that no longer asks about a
    /// change (its `patched` call removed after the old branch was retired)
    /// replays histories that recorded the marker by passing over it.
    pub(crate) fn skip_markers_not_asked(&mut self, candidate: &EventKind) {
        if !matches!(candidate, EventKind::VersionMarker { .. }) {
            self.skip_markers();
        }
    }

    /// Passes over the version markers at the front of the history left
    /// to replay (for a command that is not one).
    fn skip_markers(&mut self) {
        while let Some(front) = self.replay.front() {
            if !matches!(front.kind, EventKind::VersionMarker { .. }) {
                break;
            }
            let marker = self.replay.pop_front().expect("front exists");
            self.next_seq = marker.seq.next();
        }
    }

    /// The version of `change_id` this run follows (`ctx.version`): the
    /// recorded one when history holds a marker for it here; 0 ("before
    /// the change") when the run is being rebuilt from history recorded
    /// without one; `max` (recorded now) for code running live. A recorded
    /// version outside `min..=max` is non-determinism: the run parks.
    pub(crate) fn version(&mut self, change_id: &str, min: u32, max: u32) -> u32 {
        assert!(
            min <= max,
            "version({change_id:?}, {min}, {max}): min > max"
        );
        if self.error.is_some() {
            return min;
        }
        let step = Step(self.next_step);
        let known = self.versions.get(change_id).copied().or_else(|| {
            let front = self.replay.front()?;
            match &front.kind {
                EventKind::VersionMarker {
                    change_id: c,
                    version,
                    ..
                } if c == change_id => {
                    let version = *version;
                    let marker = self.replay.pop_front().expect("front exists");
                    self.next_seq = marker.seq.next();
                    self.versions.insert(change_id.to_string(), version);
                    Some(version)
                }
                _ => None,
            }
        });
        let version = match known {
            Some(v) => v,
            None if self.historical => 0,
            None => {
                self.push_event(EventKind::VersionMarker {
                    step,
                    change_id: change_id.to_string(),
                    version: max,
                });
                self.versions.insert(change_id.to_string(), max);
                max
            }
        };
        if version < min || version > max {
            self.error = Some(MachineError::NonDeterminism {
                step,
                recorded: if version == 0 {
                    format!("code from before change {change_id:?} (no version marker)")
                } else {
                    format!("version {version} of change {change_id:?}")
                },
                issued: format!("code that supports versions {min}..={max} of {change_id:?}"),
            });
            return min;
        }
        version
    }

    /// `ctx.deprecate_patch`: accepts the marker of a retired change where
    /// history has one; records nothing.
    pub(crate) fn deprecate_patch(&mut self, change_id: &str) {
        if let Some(front) = self.replay.front() {
            if matches!(&front.kind, EventKind::VersionMarker { change_id: c, .. } if c == change_id)
            {
                let marker = self.replay.pop_front().expect("front exists");
                self.next_seq = marker.seq.next();
            }
        }
        self.versions.insert(change_id.to_string(), 1);
    }

    /// Registers the waker of the future waiting on `step`.
    pub(crate) fn wait_on(&mut self, step: Step, waker: &Waker) {
        // A member polled again by its barrier registers the same waker:
        // kept as it is rather than cloned again.
        match self.waiters.entry(step) {
            std::collections::hash_map::Entry::Occupied(mut e) => {
                if !e.get().will_wake(waker) {
                    e.insert(waker.clone());
                }
            }
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(waker.clone());
            }
        }
    }

    /// Registers a waker woken after every input (signals, conditions,
    /// cancellation).
    pub(crate) fn wait_any(&mut self, waker: &Waker) {
        self.general_waiters.push(waker.clone());
    }

    /// Notes that the child waited on at `step` closed (its outcome is
    /// being applied): an async child's closure is then no longer needed.
    pub(crate) fn child_closed(&mut self, step: Step) {
        if let Some(w) = self.open.get(&step) {
            if w.name == crate::concurrency::ASYNC_WORKFLOW_TYPE {
                if let Some(run) = w.child_run {
                    self.async_closed.push(run);
                }
            }
        }
    }

    /// Records a step's resolution and wakes its waiter.
    pub(crate) fn resolve(&mut self, step: Step, r: Resolution) {
        self.open.remove(&step);
        self.resolved.insert(step, r);
        if let Some(w) = self.waiters.remove(&step) {
            w.wake();
        }
        if self.draining.remove(&step).is_some() {
            // A scope's completion (or the run's close) may wait for it.
            self.wake_general();
        }
    }

    /// Whether a cancelled wait owned by `scope`, or by a scope nested in
    /// it at any depth, has yet to close.
    pub(crate) fn draining_under(&self, scope: Step) -> bool {
        self.draining.values().any(|owner| {
            let mut at = *owner;
            // Each scope's parent was created before it: the chain ends.
            while let Some(s) = at {
                if s == scope {
                    return true;
                }
                at = self.scope_parents.get(&s).copied().flatten();
            }
            false
        })
    }

    /// Issues the command that cancels the open wait at `step`: a timer is
    /// cancelled, an activity asked to cancel, a child cancelled per its
    /// close policy (an abandoned child is left alone). Returns false when
    /// nothing is open there.
    pub(crate) fn cancel_wait(&mut self, step: Step, reason: &str) -> bool {
        let Some(w) = self.open.get(&step) else {
            return false;
        };
        let (kind, fire_at, child, policy) = (w.kind, w.fire_at, w.child_run, w.close_policy);
        let (cancellation, owner) = (w.cancellation, w.owner.map(|(s, _)| s));
        if matches!(kind, WaitKind::Activity | WaitKind::Child) {
            // A child with an `Abandon` close policy is never asked: there
            // is no cancellation to wait for.
            let asked = kind == WaitKind::Activity
                || (child.is_some()
                    && policy.unwrap_or_default() != keel_storage::ParentClosePolicy::Abandon);
            match cancellation {
                CancellationType::Abandon => return true,
                CancellationType::WaitCancellationCompleted if asked => {
                    self.draining.insert(step, owner);
                }
                CancellationType::WaitCancellationCompleted | CancellationType::TryCancel => {}
            }
        }
        match kind {
            WaitKind::Timer => {
                let fire_at = fire_at.unwrap_or(self.now);
                self.open.remove(&step);
                let _ = self.issue(EventKind::TimerCancelled { step, fire_at });
            }
            WaitKind::Activity => {
                let _ = self.issue(EventKind::ActivityCancelRequested {
                    step,
                    execution_id: keel_storage::event::execution_of(self.run_id, step),
                });
            }
            WaitKind::Child => {
                let policy = policy.unwrap_or_default();
                if let (Some(child_run_id), true) =
                    (child, policy != keel_storage::ParentClosePolicy::Abandon)
                {
                    if !self.child_cancelled.contains(&step) {
                        self.child_cancelled.insert(step);
                        let _ = self.issue(EventKind::ChildCancelRequested {
                            step,
                            child_run_id,
                            policy,
                            reason: reason.to_string(),
                        });
                    }
                }
            }
            // A send cannot be taken back: it is answered on its own.
            WaitKind::Send => {}
        }
        true
    }

    /// Records an open wait at `step` issued by the current coroutine, with
    /// the fields every kind shares; the caller sets its own (fire time,
    /// child run, close policy, cancellation) on what it returns.
    pub(crate) fn open_wait(
        &mut self,
        step: Step,
        kind: WaitKind,
        name: String,
        group: GroupPath,
        since: Timestamp,
    ) -> &mut OpenWait {
        let owner = self.current_owner;
        self.open.insert(
            step,
            OpenWait {
                step,
                kind,
                name,
                group,
                since,
                attempt: AttemptNo::FIRST,
                fire_at: None,
                child_run: None,
                owner,
                close_policy: None,
                child_started: false,
                cancellation: CancellationType::TryCancel,
            },
        );
        self.open.get_mut(&step).expect("just inserted")
    }

    /// Issues `ChildCancelRequested` for the open child at `step` with
    /// `policy` (cancel or terminate), whatever its close policy. False
    /// when no child is open there or one was issued already.
    pub(crate) fn cancel_child(
        &mut self,
        step: Step,
        policy: keel_storage::ParentClosePolicy,
        reason: &str,
    ) -> bool {
        let child_run_id = match self.open.get(&step) {
            Some(w) if w.kind == WaitKind::Child => match w.child_run {
                Some(run) => run,
                None => return false,
            },
            _ => return false,
        };
        if !self.child_cancelled.insert(step) {
            return false;
        }
        let _ = self.issue(EventKind::ChildCancelRequested {
            step,
            child_run_id,
            policy,
            reason: reason.to_string(),
        });
        true
    }

    /// Coroutines waiting for any change (signal waits, conditions,
    /// cancellation).
    pub(crate) fn general_waiting(&self) -> usize {
        self.general_waiters.len()
    }

    /// Wakes every general waiter (they re-check their own condition).
    pub(crate) fn wake_general(&mut self) {
        for w in self.general_waiters.drain(..) {
            w.wake();
        }
    }
}

fn missing_group(recorded: &EventKind, issued: &EventKind) -> bool {
    std::mem::discriminant(recorded) == std::mem::discriminant(issued)
        && recorded.step() == issued.step()
        && recorded.group().is_some_and(|g| g.is_empty())
        && issued.group().is_some_and(|g| !g.is_empty())
}

/// Whether an issued command is the one history recorded: same kind, same
/// step, same identity (type names) and same group path. Inputs and
/// durations may change between versions without breaking replay.
fn commands_match(recorded: &EventKind, issued: &EventKind) -> bool {
    use EventKind as K;
    match (recorded, issued) {
        (
            K::ActivityScheduled {
                step: a,
                group: ga,
                activity_type: ta,
                ..
            },
            K::ActivityScheduled {
                step: b,
                group: gb,
                activity_type: tb,
                ..
            },
        ) => a == b && ga == gb && ta == tb,
        (
            K::TimerStarted {
                step: a, group: ga, ..
            },
            K::TimerStarted {
                step: b, group: gb, ..
            },
        ) => a == b && ga == gb,
        (K::ChildScheduled(a), K::ChildScheduled(b)) => {
            a.step == b.step && a.group == b.group && a.workflow_type == b.workflow_type
        }
        (
            K::ExternalSendScheduled {
                step: a,
                target: ta,
                delivery: da,
            },
            K::ExternalSendScheduled {
                step: b,
                target: tb,
                delivery: db,
            },
        ) => a == b && ta == tb && same_delivery(da, db),
        (K::VersionMarker { change_id: ca, .. }, K::VersionMarker { change_id: cb, .. }) => {
            ca == cb
        }
        (
            K::SelectionWinnerRecorded { step: a, .. },
            K::SelectionWinnerRecorded { step: b, .. },
        ) => a == b,
        (
            K::SelectionOperationCancelled {
                step: a,
                member_index: ma,
                ..
            },
            K::SelectionOperationCancelled {
                step: b,
                member_index: mb,
                ..
            },
        ) => a == b && ma == mb,
        (K::UpdateCompleted { update_id: a, .. }, K::UpdateCompleted { update_id: b, .. }) => {
            a == b
        }
        (K::MemoUpserted { .. }, K::MemoUpserted { .. })
        | (K::SearchAttributesUpserted { .. }, K::SearchAttributesUpserted { .. })
        | (K::WorkflowCompleted { .. }, K::WorkflowCompleted { .. })
        | (K::WorkflowFailed { .. }, K::WorkflowFailed { .. })
        | (K::WorkflowCancelled { .. }, K::WorkflowCancelled { .. })
        | (K::WorkflowContinuedAsNew { .. }, K::WorkflowContinuedAsNew { .. }) => true,
        (r, i) => std::mem::discriminant(r) == std::mem::discriminant(i) && r.step() == i.step(),
    }
}

/// A one-line description of a recorded event, for divergence reports.
pub(crate) fn describe_recorded(e: &Event) -> String {
    format!("{} (seq {})", describe_command(&e.kind), e.seq)
}

/// A one-line description of a command.
/// Two sends are the same command when they send the same kind of thing
/// under the same name (and key): the payload may differ between builds.
fn same_delivery(a: &keel_storage::Delivery, b: &keel_storage::Delivery) -> bool {
    use keel_storage::Delivery as D;
    match (a, b) {
        (D::Signal { name: na, .. }, D::Signal { name: nb, .. }) => na == nb,
        (
            D::Message {
                stream: sa,
                key: ka,
                ..
            },
            D::Message {
                stream: sb,
                key: kb,
                ..
            },
        ) => sa == sb && ka == kb,
        _ => false,
    }
}

pub(crate) fn describe_command(kind: &EventKind) -> String {
    let step = kind
        .step()
        .map(|s| format!(" at step {s}"))
        .unwrap_or_default();
    let what = match kind {
        EventKind::ActivityScheduled { activity_type, .. } => {
            format!("schedule activity {activity_type}")
        }
        EventKind::ChildScheduled(child) => format!("start child {}", child.workflow_type),
        EventKind::TimerStarted { .. } => "start timer".to_string(),
        EventKind::ExternalSendScheduled {
            target, delivery, ..
        } => match delivery {
            keel_storage::Delivery::Signal { name, .. } => {
                format!("signal {name:?} to {target}")
            }
            keel_storage::Delivery::Message { stream, key, .. } => {
                format!("send message {key} on {stream:?} to {target}")
            }
        },
        other if !other.is_command() => {
            format!("no command (next recorded is input {})", other.name())
        }
        other => other.name().to_string(),
    };
    let group = kind
        .group()
        .filter(|g| !g.is_empty())
        .map(|g| format!(" group {}", format_group(g)))
        .unwrap_or_default();
    format!("{what}{step}{group}")
}

/// Renders a group path as `[step/size#index, ...]`.
pub fn format_group(g: &GroupPath) -> String {
    let parts: Vec<String> = g
        .iter()
        .map(|e| format!("{}/{}#{}", e.step, e.size, e.index))
        .collect();
    format!("[{}]", parts.join(", "))
}
