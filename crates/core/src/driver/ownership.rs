//! Shard ownership when several engine processes share one store: which
//! shards a process takes, how a shard keeps its lease, and what it does
//! when it loses it.
//!
//! A host that shares its store asks [`shards_to_take`] which free or
//! expired shards to take (from the store's lease records and its clock),
//! takes each in the store, and hands the lease to a new [`Shard`] with
//! [`Shard::hold`] before [`Shard::recover`]. From then on the shard decides:
//! every commit carries the lease's fence, the shard asks for renewals
//! ([`Action::RenewLease`]) well before the lease ends, and it stops
//! ([`Action::ShardLost`]) when a renewal or a commit is refused as fenced,
//! or when its lease ends before a renewal got through: it cannot know then
//! whether another process took the shard, so it acts as if one had. The
//! store's fence check is what makes that safe; the shard stopping itself
//! keeps a cut-off process from running activities no one will record.

use std::collections::BTreeMap;

use keel_storage::{Error as StoreError, Member, ShardLease, Timestamp};

use super::{Action, Answer, Due, Message, ReplyTo, Shard, ShardId, ShardInput};

/// How long a shard lease lasts unless renewed, by default: a killed
/// process's shards are taken over within this much of its last renewal.
pub const SHARD_LEASE_MS_DEFAULT: u64 = 5_000;
/// A shard renews its lease when this share of it (in percent) is left.
pub const SHARD_LEASE_RENEW_PERCENT: u64 = 60;
/// How long a shard waits before asking again after a renewal failed for
/// another reason than a fence (the store out of reach).
pub const SHARD_LEASE_RETRY_MS: u64 = 200;

/// Whether the process `owner` is gone at `now`: no live member record
/// says it is alive (a killed process stops renewing its record, which
/// ends within a shard lease).
pub fn member_gone(members: &[Member], owner: &str, now: Timestamp) -> bool {
    !members
        .iter()
        .any(|m| m.owner == owner && m.expires_at > now)
}

/// The processes shards are shared out over: the live members and the
/// holders of live leases, `me` included, in name order.
fn owners<'a>(
    leases: &'a [ShardLease],
    members: &'a [Member],
    me: &'a str,
    now: Timestamp,
) -> Vec<&'a str> {
    let mut owners: Vec<&str> = leases
        .iter()
        .filter(|l| !l.expired(now))
        .map(|l| l.owner.as_str())
        .chain(
            members
                .iter()
                .filter(|m| m.expires_at > now)
                .map(|m| m.owner.as_str()),
        )
        .collect();
    owners.push(me);
    owners.sort_unstable();
    owners.dedup();
    owners
}

/// The shards a process called `me` should try to take now, given every
/// lease and member the store records: free and expired shards, until it
/// holds its fair share (the shard count over the live processes, itself
/// included, rounded up). Taking can still fail (another process was
/// faster); the host asks again at its next look.
pub fn shards_to_take(
    leases: &[ShardLease],
    members: &[Member],
    shards: u16,
    me: &str,
    now: Timestamp,
) -> Vec<ShardId> {
    let owners = owners(leases, members, me, now);
    let share = usize::from(shards).div_ceil(owners.len());
    let live: Vec<&ShardLease> = leases.iter().filter(|l| !l.expired(now)).collect();
    let held = live.iter().filter(|l| l.owner == me).count();
    let free = (0..shards).filter(|s| !live.iter().any(|l| l.shard == *s));
    free.take(share.saturating_sub(held)).map(ShardId).collect()
}

/// The shards `me` should give up now so that a process holding less than
/// its share can take them: `me`'s highest shards beyond its fair share,
/// and only while some live process holds fewer than the share rounded
/// down (so that shards do not move back and forth). One at a time: the
/// next look decides again.
pub fn shards_to_release(
    leases: &[ShardLease],
    members: &[Member],
    shards: u16,
    me: &str,
    now: Timestamp,
) -> Vec<ShardId> {
    let owners = owners(leases, members, me, now);
    let share = usize::from(shards).div_ceil(owners.len());
    let floor = usize::from(shards) / owners.len();
    let live: Vec<&ShardLease> = leases.iter().filter(|l| !l.expired(now)).collect();
    let held = |o: &str| live.iter().filter(|l| l.owner == o).count();
    let mine: Vec<u16> = live
        .iter()
        .filter(|l| l.owner == me)
        .map(|l| l.shard)
        .collect();
    let starved = owners.iter().any(|o| held(o) < floor);
    if mine.len() <= share || !starved {
        return Vec::new();
    }
    mine.iter()
        .max()
        .map(|s| vec![ShardId(*s)])
        .unwrap_or_default()
}

/// The live leases the store records for `me` that no shard of this
/// process holds (`held`: the fences of the shards it runs): a take that
/// was written but whose answer never came back (the connection broke as
/// it committed). The host releases them, so that such a shard does not
/// sit unowned until its lease runs out.
pub fn leases_unheld<'a>(
    leases: &'a [ShardLease],
    me: &str,
    held: &[keel_storage::Fence],
    now: Timestamp,
) -> Vec<&'a ShardLease> {
    leases
        .iter()
        .filter(|l| l.owner == me && !l.expired(now) && !held.contains(&l.fence()))
        .collect()
}

/// The shards a new owner took since the last look: a lease epoch higher
/// than `seen` holds for it (`seen` is updated; a shard seen for the first
/// time counts as not taken). The host tells every shard it runs of each
/// ([`ShardInput::PeerTaken`]), but the one taken.
pub fn shards_taken_since(leases: &[ShardLease], seen: &mut BTreeMap<u16, u64>) -> Vec<ShardId> {
    leases
        .iter()
        .filter(|l| seen.insert(l.shard, l.epoch).is_some_and(|e| e < l.epoch))
        .map(|l| ShardId(l.shard))
        .collect()
}

impl Shard {
    /// Gives the shard the lease its host took for it (call before
    /// [`Shard::recover`]): its commits carry the lease's fence from now
    /// on, and it keeps the lease renewed.
    pub fn hold(&mut self, lease: ShardLease) {
        assert_eq!(lease.shard, self.id.0, "a lease for another shard");
        let at = renew_at(&lease, self.config.shard_lease_ms);
        self.lease = Some(lease);
        self.check_lease_at(at);
    }

    /// Schedules the lease's next check; an earlier one still queued
    /// becomes stale (see [`Shard::lease_due`]).
    fn check_lease_at(&mut self, at: Timestamp) {
        self.lease_check_at = Some(at);
        self.due.push(at, Due::ShardLease);
    }

    /// Asks for a commit of `batch`, fenced by the shard's lease if it
    /// holds one.
    pub(super) fn push_commit(
        &mut self,
        token: super::Token,
        mut batch: keel_storage::CommitBatch,
    ) {
        if !self.breaks(super::BreakMode::SkipFence) {
            batch.fence = self.lease.as_ref().map(ShardLease::fence);
        }
        self.commit_asked(token);
        self.actions.push_back(Action::Commit {
            token,
            batch,
            alone: false,
        });
    }

    /// Gives the shard up so that another process can take it (a
    /// rebalance, a clean shutdown): it stops like a shard that lost its
    /// lease, then asks its host to release the lease
    /// ([`Action::ReleaseLease`]) and to drop it.
    pub fn release(&mut self) {
        let Some(lease) = self.lease.clone() else {
            return;
        };
        if self.lost {
            return;
        }
        self.lose_then(
            format!(
                "released (epoch {}) for another process to take",
                lease.epoch
            ),
            Some(Action::ReleaseLease { lease }),
        );
    }

    /// The lease this shard holds, if its store is shared.
    pub fn lease(&self) -> Option<&ShardLease> {
        self.lease.as_ref()
    }

    /// Whether the shard lost its lease and stopped.
    pub fn lost(&self) -> bool {
        self.lost
    }

    /// Why the shard must stop now, if it must: its lease has ended by
    /// its own clock (a process that was frozen, or too busy to renew,
    /// stops before it acts on anything more).
    pub(super) fn lease_over(&self) -> Option<String> {
        let lease = self.lease.as_ref().filter(|l| l.expired(self.now))?;
        Some(format!(
            "its lease (epoch {}) ended at {} before a renewal got through",
            lease.epoch, lease.expires_at
        ))
    }

    /// An input that reached the shard as its lease ended: whoever waits
    /// for an answer is told to ask again, and finds the next owner. The
    /// rest needs no answer: store answers die with the shard, and an
    /// attempt's report is redelivered by the next owner's lease check.
    pub(super) fn turn_away(&mut self, input: ShardInput) {
        let reply = match input {
            ShardInput::Request { id, .. } => ReplyTo::Client(id),
            ShardInput::Message(Message::ToRun { reply, .. } | Message::Start { reply, .. }) => {
                reply
            }
            _ => return,
        };
        let answer = self.moved();
        self.reply(reply, answer, None);
    }

    /// The answer for whoever waits on a shard that leaves this process.
    fn moved(&self) -> Answer {
        Answer::Retry(format!("{} moved to another engine process", self.id))
    }

    /// A [`Due::ShardLease`] came: when it is the scheduled check, the
    /// shard renews its lease, or stops if the lease ended first.
    pub(super) fn lease_due(&mut self) {
        if self.lease_check_at.is_none_or(|at| at > self.now) {
            return; // stale: a later check replaced it
        }
        self.lease_check_at = None;
        let Some(lease) = self.lease.clone() else {
            return;
        };
        if self.lost {
            return;
        }
        if let Some(reason) = self.lease_over() {
            self.lose(reason);
            return;
        }
        if !self.renewing {
            self.renewing = true;
            self.actions.push_back(Action::RenewLease {
                lease: lease.clone(),
            });
        }
        // If no answer comes in time, the lease's end stops the shard.
        self.check_lease_at(lease.expires_at);
    }

    /// The host's answer to [`Action::RenewLease`].
    pub(super) fn lease_renewed(&mut self, result: Result<ShardLease, StoreError>) {
        let held = self.lease.as_ref().map(|l| l.epoch);
        if !self.renewing || self.lost {
            return; // not this instance's renewal
        }
        let epoch = match &result {
            Ok(l) => Some(l.epoch),
            Err(StoreError::Fenced { epoch, .. }) => Some(*epoch),
            Err(_) => held,
        };
        if epoch != held {
            return; // an earlier instance's renewal
        }
        self.renewing = false;
        match result {
            Ok(lease) => {
                let at = renew_at(&lease, self.config.shard_lease_ms);
                self.lease = Some(lease);
                self.check_lease_at(at);
            }
            Err(e @ StoreError::Fenced { .. }) => self.lose(e.to_string()),
            Err(e) => {
                tracing::warn!(shard = %self.id, error = %e, "renewing the shard's lease failed; trying again");
                // Never later than the lease's end, which stops the shard.
                let end = self.lease.as_ref().map_or(self.now, |l| l.expires_at);
                let at = self.now.plus_ms(SHARD_LEASE_RETRY_MS).min(end);
                self.check_lease_at(at);
            }
        }
    }

    /// The shard lost its lease: everything it holds in memory may be out
    /// of date, and another process may own its runs now. It stops every
    /// copy of an attempt it dispatched, answers its waiting clients with a
    /// retry (the next owner answers them), and tells its host to drop it.
    pub(super) fn lose(&mut self, reason: String) {
        self.lose_then(reason, None);
    }

    /// [`Shard::lose`], with `last` performed just before the shard is
    /// dropped.
    fn lose_then(&mut self, reason: String, last: Option<Action>) {
        if self.lost {
            return;
        }
        self.lost = true;
        tracing::warn!(shard = %self.id, %reason, "the shard stops in this process");
        for (key, epoch) in self.attempts.running_copies() {
            self.actions.push_back(Action::StopAttempt { key, epoch });
        }
        let answer = self.moved();
        self.stop_answering(answer, true);
        self.due = Default::default();
        self.stall_check_armed = false;
        // Its async children's closures: the next owner's parents bind
        // them (a child runs on its parent's shard), and one that closes
        // there is never forgotten here.
        let (id, shards) = (self.id, self.config.shards);
        self.workflows
            .unbind_async_where(|child| super::shard_of(child, shards) == id);
        self.unsure_async.clear();
        self.actions.extend(last);
        self.actions.push_back(Action::ShardLost {
            shard: self.id,
            reason,
        });
    }
}

/// When a lease should be renewed: with [`SHARD_LEASE_RENEW_PERCENT`] of
/// `lease_ms` left before its end.
fn renew_at(lease: &ShardLease, lease_ms: u64) -> Timestamp {
    let left = lease_ms * SHARD_LEASE_RENEW_PERCENT / 100;
    Timestamp(lease.expires_at.0.saturating_sub(left))
}

#[cfg(test)]
mod tests {
    // Goal: a process takes free and expired shards up to its fair share
    // and never a live one, and one holding more than its share gives
    // shards up, one at a time, only while another holds less, so shards
    // do not move back and forth. Method: lease and member tables checked
    // against the expected choice.

    use super::*;

    fn lease(shard: u16, owner: &str, expires: u64) -> ShardLease {
        ShardLease {
            shard,
            owner: owner.into(),
            epoch: 1,
            expires_at: Timestamp(expires),
        }
    }

    #[test]
    fn takes_free_and_expired_shards_up_to_a_fair_share() {
        let now = Timestamp(1_000);
        // Nobody holds anything: the first process takes every shard.
        assert_eq!(
            shards_to_take(&[], &[], 4, "a", now),
            (0..4).map(ShardId).collect::<Vec<_>>()
        );
        // "b" holds two live shards, one of "c" expired: a's share of 4
        // over {a, b} is 2: shards 2 and 3 (2 expired, 3 never taken).
        let leases = [
            lease(0, "b", 5_000),
            lease(1, "b", 5_000),
            lease(2, "c", 900),
        ];
        assert_eq!(
            shards_to_take(&leases, &[], 4, "a", now),
            vec![ShardId(2), ShardId(3)]
        );
        // Three processes over 4 shards: a share of 2; "a" holds one.
        let leases = [
            lease(0, "b", 5_000),
            lease(1, "c", 5_000),
            lease(2, "a", 5_000),
        ];
        assert_eq!(shards_to_take(&leases, &[], 4, "a", now), vec![ShardId(3)]);
        // Everything live and held: nothing to take.
        let leases = [lease(0, "b", 5_000), lease(1, "a", 5_000)];
        assert!(shards_to_take(&leases, &[], 2, "a", now).is_empty());
    }

    fn member(owner: &str, expires: u64) -> Member {
        Member {
            owner: owner.into(),
            expires_at: Timestamp(expires),
        }
    }

    #[test]
    fn a_live_lease_of_mine_that_no_shard_holds_is_released() {
        let now = Timestamp(1_000);
        let leases = [
            lease(0, "a", 5_000), // held
            lease(1, "a", 5_000), // taken, answer lost
            lease(2, "a", 900),   // ended: nothing to release
            lease(3, "b", 5_000), // another's
        ];
        let held = [leases[0].fence()];
        let unheld: Vec<u16> = leases_unheld(&leases, "a", &held, now)
            .iter()
            .map(|l| l.shard)
            .collect();
        assert_eq!(unheld, vec![1]);
        // A shard held under an older epoch does not hold the newer lease.
        let mut older = leases[1].fence();
        older.epoch -= 1;
        assert_eq!(
            leases_unheld(&leases[..2], "a", &[leases[0].fence(), older], now).len(),
            1
        );
    }

    #[test]
    fn a_new_member_gets_shards_given_up_one_at_a_time() {
        let now = Timestamp(1_000);
        // "a" took all four shards alone; "b" joins as a member.
        let leases: Vec<ShardLease> = (0..4).map(|s| lease(s, "a", 5_000)).collect();
        let members = [member("a", 5_000), member("b", 5_000)];
        assert_eq!(
            shards_to_release(&leases, &members, 4, "a", now),
            vec![ShardId(3)]
        );
        // "b" sees nothing free yet...
        assert!(shards_to_take(&leases, &members, 4, "b", now).is_empty());
        // ...until shard 3 is released (expired).
        let mut leases = leases;
        leases[3].expires_at = now;
        assert_eq!(
            shards_to_take(&leases, &members, 4, "b", now),
            vec![ShardId(3)]
        );
        // With b at one shard and a at three, a gives up one more.
        leases[3] = lease(3, "b", 5_000);
        assert_eq!(
            shards_to_release(&leases, &members, 4, "a", now),
            vec![ShardId(2)]
        );
        // Balanced (two each): nothing moves, in either direction.
        leases[2] = lease(2, "b", 5_000);
        assert!(shards_to_release(&leases, &members, 4, "a", now).is_empty());
        assert!(shards_to_release(&leases, &members, 4, "b", now).is_empty());
        // Three shards over two: 2 and 1 is as fair as it gets.
        let leases = [
            lease(0, "a", 5_000),
            lease(1, "a", 5_000),
            lease(2, "b", 5_000),
        ];
        assert!(shards_to_release(&leases, &members, 3, "a", now).is_empty());
        // A member gone (expired) does not count.
        let leases: Vec<ShardLease> = (0..4).map(|s| lease(s, "a", 5_000)).collect();
        let members = [member("a", 5_000), member("b", 900)];
        assert!(shards_to_release(&leases, &members, 4, "a", now).is_empty());
    }

    // Goal: a shard that holds a lease renews it at a steady pace however
    // long it runs (one renewal per renewal period, not more as stale
    // checks pile up), ignores a refusal meant for an older lease, and
    // answers an input that reaches it as its lease ends. Method: a shard
    // with no runs, driven by hand through simulated time, its renewals
    // answered at once.

    use crate::driver::{DriverConfig, Request, RequestId};
    use crate::workflow::WorkflowRegistry;

    const LEASE_MS: u64 = 1_000;

    /// Goal: the driver marks a commit `alone` (the host may write it on
    /// its own thread, blocking the shard) only when the shard waits for
    /// nothing else: no other commit, read or running attempt, and no
    /// further action queued behind it. Were every commit alone, a shard
    /// with more commits coming would write each on its own thread,
    /// finding the writer idle every time, one sync per commit (a
    /// 1,000-way fan-out ran 20 times slower). Method: commits are queued
    /// on a fresh shard with and without other work in flight, and the
    /// flag read as the host takes each one.
    #[test]
    fn a_commit_is_alone_only_when_nothing_else_is_in_flight() {
        let mut shard = Shard::new(
            ShardId(0),
            WorkflowRegistry::new(),
            DriverConfig::default(),
            0,
        );
        let run = keel_storage::RunId::from_u64_pair(1, 1);
        let commit = |shard: &mut Shard| {
            let token = shard.token();
            shard
                .commits
                .insert(token, crate::driver::CommitFor::Run(run));
            shard.push_commit(token, keel_storage::CommitBatch::default());
            token
        };
        let alone = |shard: &mut Shard| match shard.poll_action() {
            Some(Action::Commit { alone, .. }) => alone,
            other => panic!("a commit, not {other:?}"),
        };
        // Nothing else: alone.
        let only = commit(&mut shard);
        assert!(alone(&mut shard));
        shard.commits.remove(&only);
        // Two queued: the first has an action behind it, the second waits
        // with the first in flight.
        let first = commit(&mut shard);
        let second = commit(&mut shard);
        assert!(!alone(&mut shard));
        assert!(!alone(&mut shard));
        shard.commits.remove(&first);
        shard.commits.remove(&second);
        // Another action waits behind it.
        let token = commit(&mut shard);
        shard.actions.push_back(Action::ReleaseLease {
            lease: lease(0, "a", 1),
        });
        assert!(!alone(&mut shard));
        shard.actions.clear();
        shard.commits.remove(&token);
        // A running attempt's result is on its way.
        shard.attempts.running = 1;
        let token = commit(&mut shard);
        assert!(!alone(&mut shard));
        shard.commits.remove(&token);
        shard.attempts.running = 0;
        // So is a read's.
        let read = shard.token();
        shard
            .reads
            .insert(read, crate::driver::ReadFor::Activate(run));
        commit(&mut shard);
        assert!(!alone(&mut shard));
    }

    fn held_shard() -> Shard {
        let config = DriverConfig {
            shard_lease_ms: LEASE_MS,
            ..DriverConfig::default()
        };
        let mut shard = Shard::new(ShardId(0), WorkflowRegistry::new(), config, 1 << 40);
        shard.hold(lease(0, "a", LEASE_MS));
        shard
    }

    /// Runs the shard until `until`, answering renewals with `answer`;
    /// returns the renewals it asked for.
    fn run(
        shard: &mut Shard,
        until: u64,
        mut answer: impl FnMut(&ShardLease, Timestamp) -> Result<ShardLease, StoreError>,
    ) -> usize {
        let mut renewals = 0;
        while let Some(at) = shard.poll_timeout().filter(|t| t.0 <= until) {
            shard.handle_timeout(at);
            while let Some(action) = shard.poll_action() {
                if let Action::RenewLease { lease } = action {
                    renewals += 1;
                    let result = answer(&lease, at);
                    shard.handle(at, ShardInput::LeaseRenewed { result });
                }
            }
        }
        renewals
    }

    #[test]
    fn renews_once_per_period_however_long_it_runs() {
        let mut shard = held_shard();
        let renewed = |l: &ShardLease, now: Timestamp| {
            Ok(ShardLease {
                expires_at: now.plus_ms(LEASE_MS),
                ..l.clone()
            })
        };
        let renewals = run(&mut shard, 100_000, renewed);
        // Renewed with 60 % left: every 400 ms, 250 times in 100 s.
        let period = LEASE_MS * (100 - SHARD_LEASE_RENEW_PERCENT) / 100;
        let expected = 100_000 / period;
        assert!(
            (expected - 1..=expected + 1).contains(&(renewals as u64)),
            "{renewals} renewals in 100 s, expected about {expected}"
        );
        assert!(!shard.lost());
    }

    #[test]
    fn a_store_out_of_reach_stops_the_shard_at_its_lease_end() {
        let mut shard = held_shard();
        let unreachable = |_: &ShardLease, _: Timestamp| {
            Err(StoreError::Io(std::io::Error::other("the store is down")))
        };
        let renewals = run(&mut shard, 10_000, unreachable);
        assert!(shard.lost(), "the lease ended: the shard must stop");
        // At 400 ms (60 % left), then every 200 ms: 600 and 800; at 1000
        // the lease has ended and the shard stops instead.
        assert_eq!(renewals, 3, "retries until the lease's end");
    }

    #[test]
    fn a_refusal_for_an_older_lease_is_ignored() {
        let mut shard = held_shard();
        shard.handle_timeout(Timestamp(400));
        assert!(matches!(
            shard.poll_action(),
            Some(Action::RenewLease { .. })
        ));
        // The renewal of an earlier holder of this shard's lease (epoch 0)
        // is refused: not this lease's business.
        let stale = StoreError::Fenced {
            shard: 0,
            epoch: 0,
            current: Some(1),
        };
        shard.handle(
            Timestamp(410),
            ShardInput::LeaseRenewed { result: Err(stale) },
        );
        assert!(!shard.lost());
        let fenced = StoreError::Fenced {
            shard: 0,
            epoch: 1,
            current: Some(2),
        };
        shard.handle(
            Timestamp(420),
            ShardInput::LeaseRenewed {
                result: Err(fenced),
            },
        );
        assert!(shard.lost(), "its own lease refused: the shard stops");
    }

    #[test]
    fn a_request_reaching_a_shard_whose_lease_ended_is_answered() {
        let mut shard = held_shard();
        let request = Request::List {
            filter: Default::default(),
            page_size: 10,
            after: None,
        };
        shard.handle(
            Timestamp(LEASE_MS),
            ShardInput::Request {
                id: RequestId(7),
                request,
            },
        );
        let actions: Vec<Action> = std::iter::from_fn(|| shard.poll_action()).collect();
        let reply = actions.iter().position(|a| {
            matches!(
                a,
                Action::Reply {
                    id: RequestId(7),
                    answer: Answer::Retry(_),
                    ..
                }
            )
        });
        let lost = actions
            .iter()
            .position(|a| matches!(a, Action::ShardLost { .. }));
        assert!(
            reply.is_some() && reply < lost,
            "answered before the shard leaves: {actions:?}"
        );
    }
}
