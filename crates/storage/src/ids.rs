//! Durable identities and the small numbers that cross the API.
//!
//! Every id of the glossary has its own newtype so that a step can never be
//! passed where a seq is expected. Ids that derive from others (an execution
//! from its run and step, an attempt from its execution and number, a child
//! instance from its parent run and step) are derived here and nowhere else,
//! so the engine, the simulator and offline replay compute the same values.

use std::fmt;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Identity of one run (`workflow_run_id`).
///
/// Ordered as its 16 bytes are in keys, compared as one big-endian
/// number: a shard looks its runs up in ordered maps many times per
/// commit, and two 128-bit comparisons cost less than a byte loop.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RunId(pub Uuid);

impl Ord for RunId {
    #[inline]
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.as_u128().cmp(&other.0.as_u128())
    }
}

impl PartialOrd for RunId {
    #[inline]
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl RunId {
    /// A fresh random run id.
    pub fn new_random() -> Self {
        RunId(Uuid::new_v4())
    }

    /// A run id built from two 64-bit halves, for deterministic sources such
    /// as the simulator's seeded generator.
    pub fn from_u64_pair(high: u64, low: u64) -> Self {
        RunId(Uuid::from_u64_pair(high, low))
    }

    /// The 16 bytes used in keys.
    pub fn as_bytes(&self) -> &[u8; 16] {
        self.0.as_bytes()
    }

    /// Parses a run id from its hyphenated text form.
    pub fn parse(text: &str) -> Option<Self> {
        Uuid::parse_str(text).ok().map(RunId)
    }
}

impl fmt::Display for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl fmt::Debug for RunId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RunId({})", self.0)
    }
}

/// The public, user-chosen identity of one workflow (`workflow_instance_id`).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct InstanceId(pub String);

impl InstanceId {
    /// Wraps a user-chosen instance id.
    pub fn new(id: impl Into<String>) -> Self {
        InstanceId(id.into())
    }

    /// The instance id of the child started by `parent` at `step`: stable, so
    /// a redelivered start creates the same child once.
    pub fn for_child(parent: RunId, step: Step) -> Self {
        InstanceId(format!("{parent}/child-{}", step.0))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "InstanceId({:?})", self.0)
    }
}

/// Position of an event in its run's history; contiguous from 1.
#[derive(
    Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default, Serialize, Deserialize,
)]
pub struct Seq(pub u64);

impl Seq {
    /// The seq of the first event of every run.
    pub const FIRST: Seq = Seq(1);

    /// The seq after this one.
    pub fn next(self) -> Seq {
        Seq(self.0 + 1)
    }
}

impl fmt::Display for Seq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A durable position in workflow code: each command gets the next step in
/// the order the code issues it.
#[derive(
    Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default, Serialize, Deserialize,
)]
pub struct Step(pub u32);

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// One logical activity call across all its attempts
/// (`activity_execution_id`): the default idempotency key for external
/// systems. Derived from the run and the step that scheduled it.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ExecutionId {
    /// The run that scheduled the execution.
    pub run_id: RunId,
    /// The step of the scheduling command.
    pub step: Step,
}

impl fmt::Display for ExecutionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/act-{}", self.run_id, self.step.0)
    }
}

impl fmt::Debug for ExecutionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ExecutionId({self})")
    }
}

/// Attempt number of an execution, from 1.
#[derive(
    Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default, Serialize, Deserialize,
)]
pub struct AttemptNo(pub u32);

impl AttemptNo {
    /// The first attempt of every execution.
    pub const FIRST: AttemptNo = AttemptNo(1);

    /// The attempt after this one.
    pub fn next(self) -> AttemptNo {
        AttemptNo(self.0 + 1)
    }
}

impl fmt::Display for AttemptNo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// One try of an execution (`activity_attempt_id`); a retry is a new
/// attempt, a redelivery is the same attempt again.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct AttemptId {
    /// The execution this attempt belongs to.
    pub execution: ExecutionId,
    /// Its number within the execution, from 1.
    pub attempt: AttemptNo,
}

impl fmt::Display for AttemptId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/try-{}", self.execution, self.attempt.0)
    }
}

impl fmt::Debug for AttemptId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AttemptId({self})")
    }
}

/// Fencing epoch of a lease: only grows, so a stale holder can be refused.
#[derive(
    Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default, Serialize, Deserialize,
)]
pub struct LeaseEpoch(pub u64);

impl fmt::Display for LeaseEpoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Client-chosen id that deduplicates a state-changing request
/// (`workflow_command_id`).
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
pub struct CommandId(pub String);

impl CommandId {
    /// Wraps a client-chosen command id.
    pub fn new(id: impl Into<String>) -> Self {
        CommandId(id.into())
    }
}

impl fmt::Display for CommandId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Sender-chosen idempotency key of a stream message: a retried send with
/// the same key to the same stream of an instance is committed once.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Serialize, Deserialize)]
pub struct MessageKey(pub String);

impl MessageKey {
    /// Wraps a sender-chosen key.
    pub fn new(key: impl Into<String>) -> Self {
        MessageKey(key.into())
    }
}

impl fmt::Display for MessageKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Milliseconds since the Unix epoch, as the engine's clock (or the
/// simulator's virtual clock) reported it. Never read by the pure core.
#[derive(
    Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default, Serialize, Deserialize,
)]
pub struct Timestamp(pub u64);

impl Timestamp {
    /// Milliseconds since the epoch.
    pub fn as_millis(self) -> u64 {
        self.0
    }

    /// This time plus `ms` milliseconds, saturating.
    pub fn plus_ms(self, ms: u64) -> Timestamp {
        Timestamp(self.0.saturating_add(ms))
    }

    /// UTC RFC 3339 with milliseconds: `2026-12-01T22:18:06.000Z`.
    pub fn to_rfc3339(self) -> String {
        let ms = self.0 % 1000;
        let secs = self.0 / 1000;
        let (days, rem) = (secs / 86_400, secs % 86_400);
        let (y, m, d) = civil_from_days(days as i64);
        format!(
            "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{ms:03}Z",
            rem / 3600,
            rem % 3600 / 60,
            rem % 60
        )
    }

    /// Parses RFC 3339 (`2026-12-01T22:18:06Z`, with optional fraction of
    /// a second and a `Z` or `+hh:mm`/`-hh:mm` offset) or a plain date
    /// (`2026-12-01`, midnight UTC). `None` for anything else, or a time
    /// before the epoch.
    pub fn parse_rfc3339(text: &str) -> Option<Timestamp> {
        let b = text.trim().as_bytes();
        let num = |r: std::ops::Range<usize>| -> Option<i64> {
            let s = b.get(r)?;
            if s.is_empty() || !s.iter().all(u8::is_ascii_digit) {
                return None;
            }
            std::str::from_utf8(s).ok()?.parse().ok()
        };
        let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
        if b.get(4) != Some(&b'-') || b.get(7) != Some(&b'-') || !(1..=12).contains(&mo) {
            return None;
        }
        if d < 1 || d > days_in_month(y, mo as u32) as i64 {
            return None;
        }
        let mut secs = days_from_civil(y, mo as u32, d as u32) * 86_400;
        let mut ms = 0i64;
        if b.len() > 10 {
            if !matches!(b[10], b'T' | b't' | b' ') || b.get(13) != Some(&b':') {
                return None;
            }
            let (h, mi) = (num(11..13)?, num(14..16)?);
            if b.get(16) != Some(&b':') {
                return None;
            }
            let s = num(17..19)?;
            if h > 23 || mi > 59 || s > 60 {
                return None;
            }
            secs += h * 3600 + mi * 60 + s.min(59);
            let mut i = 19;
            if b.get(i) == Some(&b'.') {
                i += 1;
                let start = i;
                while b.get(i).is_some_and(u8::is_ascii_digit) {
                    i += 1;
                }
                if i == start {
                    return None;
                }
                let frac = &text.trim()[start..i.min(start + 3)];
                ms = frac.parse::<i64>().ok()? * 10i64.pow(3 - frac.len() as u32);
            }
            match b.get(i) {
                Some(b'Z' | b'z') if i + 1 == b.len() => {}
                Some(sign @ (b'+' | b'-')) if i + 6 == b.len() && b[i + 3] == b':' => {
                    let (oh, om) = (num(i + 1..i + 3)?, num(i + 4..i + 6)?);
                    if oh > 23 || om > 59 {
                        return None;
                    }
                    let offset = oh * 3600 + om * 60;
                    secs += if *sign == b'+' { -offset } else { offset };
                }
                _ => return None,
            }
        }
        let total = secs.checked_mul(1000)?.checked_add(ms)?;
        u64::try_from(total).ok().map(Timestamp)
    }
}

fn is_leap(y: i64) -> bool {
    y % 4 == 0 && (y % 100 != 0 || y % 400 == 0)
}

fn days_in_month(y: i64, m: u32) -> u32 {
    match m {
        2 if is_leap(y) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// (year, month, day) in the proleptic Gregorian calendar to days since
/// 1970-01-01 (Howard Hinnant's `days_from_civil`).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (m as i64 + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Days since 1970-01-01 to (year, month, day) in the proleptic Gregorian
/// calendar (Howard Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Goal: run ids order in memory exactly as their keys order on
        /// disk, so a map of runs and a scan of a run-prefixed family
        /// visit runs in one order. Method: random pairs, and pairs that
        /// share a prefix of random length, compared both ways.
        #[test]
        fn run_ids_order_as_their_bytes(
            a in any::<[u8; 16]>(),
            b in any::<[u8; 16]>(),
            shared in 0usize..=16,
        ) {
            let mut c = b;
            c[..shared].copy_from_slice(&a[..shared]);
            for (x, y) in [(a, b), (a, c), (c, a), (a, a)] {
                let (rx, ry) = (RunId(Uuid::from_bytes(x)), RunId(Uuid::from_bytes(y)));
                prop_assert_eq!(rx.cmp(&ry), x.cmp(&y));
                prop_assert_eq!(rx.partial_cmp(&ry), Some(x.cmp(&y)));
                prop_assert_eq!(rx == ry, x == y);
            }
        }
    }
}
