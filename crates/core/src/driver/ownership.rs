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

use keel_storage::{Error as StoreError, Member, ShardLease, Timestamp};

use super::{Action, Answer, Due, Shard, ShardId};

/// How long a shard lease lasts unless renewed, by default: a killed
/// process's shards are taken over within this much of its last renewal.
pub const SHARD_LEASE_MS_DEFAULT: u64 = 5_000;
/// A shard renews its lease when this share of it (in percent) is left.
pub const SHARD_LEASE_RENEW_PERCENT: u64 = 60;
/// How long a shard waits before asking again after a renewal failed for
/// another reason than a fence (the store out of reach).
pub const SHARD_LEASE_RETRY_MS: u64 = 200;

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

impl Shard {
    /// Gives the shard the lease its host took for it (call before
    /// [`Shard::recover`]): its commits carry the lease's fence from now
    /// on, and it keeps the lease renewed.
    pub fn hold(&mut self, lease: ShardLease) {
        assert_eq!(lease.shard, self.id.0, "a lease for another shard");
        let at = renew_at(&lease, self.config.shard_lease_ms);
        self.lease = Some(lease);
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
        self.actions.push_back(Action::Commit { token, batch });
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

    /// Whether the shard stopped: it lost its lease before, or its lease
    /// has ended by its own clock (a process that was frozen, or too busy
    /// to renew, stops before it acts on anything more).
    pub(super) fn lease_ended(&mut self) -> bool {
        if self.lost {
            return true;
        }
        match &self.lease {
            Some(l) if l.expired(self.now) => {
                let reason = format!(
                    "its lease (epoch {}) ended at {} before a renewal got through",
                    l.epoch, l.expires_at
                );
                self.lose(reason);
                true
            }
            _ => false,
        }
    }

    /// The renewal time came, or the lease's end.
    pub(super) fn lease_due(&mut self) {
        let Some(lease) = self.lease.clone() else {
            return;
        };
        if self.lost {
            return;
        }
        if lease.expired(self.now) {
            self.lose(format!(
                "its lease (epoch {}) ended at {} before a renewal got through",
                lease.epoch, lease.expires_at
            ));
            return;
        }
        if !self.renewing {
            self.renewing = true;
            self.actions.push_back(Action::RenewLease {
                lease: lease.clone(),
            });
        }
        // If no answer comes in time, the lease's end stops the shard.
        self.due.push(lease.expires_at, Due::ShardLease);
    }

    /// The host's answer to [`Action::RenewLease`].
    pub(super) fn lease_renewed(&mut self, result: Result<ShardLease, StoreError>) {
        let held = self.lease.as_ref().map(|l| l.epoch);
        if !self.renewing || self.lost {
            return; // not this instance's renewal
        }
        if let Ok(l) = &result {
            if Some(l.epoch) != held {
                return; // an earlier instance's renewal
            }
        }
        self.renewing = false;
        match result {
            Ok(lease) => {
                let at = renew_at(&lease, self.config.shard_lease_ms);
                self.lease = Some(lease);
                self.due.push(at, Due::ShardLease);
            }
            Err(e @ StoreError::Fenced { .. }) => self.lose(e.to_string()),
            Err(e) => {
                tracing::warn!(shard = %self.id, error = %e, "renewing the shard's lease failed; trying again");
                let at = self.now.plus_ms(SHARD_LEASE_RETRY_MS);
                self.due.push(at, Due::ShardLease);
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
        self.stop_answering(Answer::Retry(format!(
            "{} moved to another engine process",
            self.id
        )));
        self.due = Default::default();
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
}
