//! The task and outbox rows a shard has not read yet: read in bounded
//! windows, never the whole table at once.
//!
//! At recovery a shard must drive every pending attempt and every outbox
//! message its runs own, but it need not hold them all: a restart over a
//! million queued attempts would otherwise load a million rows (with their
//! inputs) before it did anything. So the rows come in *passes* over the
//! store's order (task rows by run and step, outbox rows by their key), a
//! window of at most `limit` rows per read, and the next window is read
//! only once the rows the last ones brought in are mostly done (the shard
//! holds fewer than `limit` of them). Rows written by live commits are
//! driven as they arrive and do not count.
//!
//! A window takes only rows due before its read's `due_before` (the host's
//! now plus a lead): a row waiting out a long retry backoff is read past,
//! not held, and the earliest such due time is remembered. A new pass
//! starts when that time comes (less the lead). So every row the shard
//! does not hold is either ahead of the current pass's cursor or covered
//! by the time of the next pass, and memory follows the window, not the
//! number of rows.
//!
//! Rows held may wait on rows not read yet, or on nothing a shard can
//! hurry (a send to a full stream). The one such wait a shard can name, a
//! child's cancellation waiting for the child's start (which sorts after
//! it), reads that start row at once (`Shard::outbox_answered`). For the
//! rest, when none of the rows windows brought in got done for
//! `BACKLOG_STALL_MS` (since the last read, or the last row done), the
//! next window comes in regardless: memory follows the window while rows
//! get done, and grows by a window per stall only while none can be.
//!
//! A window read races commits exactly as every intent read does: rows
//! removed while it is in flight are filtered by the shard, and a row it
//! brings back that memory drives already is merged with what memory
//! knows (see `Shard::intents_read_back`).

use keel_storage::Timestamp;

use super::BACKLOG_STALL_MS;

#[derive(Debug)]
pub(super) struct Backlog {
    /// Rows one window read asks for; the next is read once fewer than
    /// this many rows that windows brought in are held.
    limit: usize,
    /// A pass is under way; its cursor is the key of the last row read
    /// (`None`: from the first).
    pass: Option<Option<Vec<u8>>>,
    /// A window read is in flight.
    reading: bool,
    /// Rows the store holds that no pass will reach before they are due
    /// make a new pass due at this time.
    next_pass_at: Option<Timestamp>,
    /// After a failed read, the next is not tried before this.
    retry_at: Timestamp,
    /// When the last window read was asked for.
    read_at: Timestamp,
}

impl Backlog {
    pub(super) fn new(limit: usize) -> Self {
        assert!(limit > 0, "a window holds at least one row");
        Backlog {
            limit,
            pass: None,
            reading: false,
            next_pass_at: None,
            retry_at: Timestamp(0),
            read_at: Timestamp(0),
        }
    }

    /// The rows one window read asks for.
    pub(super) fn window_rows(&self) -> usize {
        self.limit
    }

    /// Recovery: every row in the store is unread, so a pass is due now.
    pub(super) fn start_recovery(&mut self) {
        self.note(Timestamp(0));
    }

    /// A row the shard does not hold needs a pass by `at`.
    pub(super) fn note(&mut self, at: Timestamp) {
        self.next_pass_at = Some(self.next_pass_at.map_or(at, |t| t.min(at)));
    }

    /// When the next window is to be read, given how many rows windows
    /// brought in are still held and when one of them was last done: never
    /// while a read is in flight; at once while a pass is under way,
    /// otherwise when a new pass is due; while a window's worth is held,
    /// not before [`BACKLOG_STALL_MS`] after the last read or the last row
    /// done, whichever is later. Not before a failed read's retry time.
    pub(super) fn window_at(&self, (held, done_at): (usize, Timestamp)) -> Option<Timestamp> {
        if self.reading {
            return None;
        }
        let mut at = match self.pass {
            Some(_) => Timestamp(0),
            None => self.next_pass_at?,
        };
        if held >= self.limit {
            at = at.max(self.read_at.max(done_at).plus_ms(BACKLOG_STALL_MS));
        }
        Some(at.max(self.retry_at))
    }

    /// Whether the next window should be read at `now` (see
    /// [`Backlog::window_at`]); if so the read is taken as started and the
    /// key it reads after is returned.
    pub(super) fn start_window(
        &mut self,
        now: Timestamp,
        held: (usize, Timestamp),
    ) -> Option<Option<Vec<u8>>> {
        if self.window_at(held)? > now {
            return None;
        }
        if self.pass.is_none() {
            // A new pass reads every row from the first: whatever a note
            // asked for is covered by it.
            self.next_pass_at = None;
            self.pass = Some(None);
        }
        self.reading = true;
        self.read_at = now;
        self.pass.clone()
    }

    /// A window read failed: the next try, not before `retry_at`, reads
    /// from the same place.
    pub(super) fn window_failed(&mut self, retry_at: Timestamp) {
        self.reading = false;
        self.retry_at = retry_at;
    }

    /// A window read was answered: `last` is the key of the last row it
    /// took when it stopped at its limit (the store may hold more), `None`
    /// when it read to the end; `skipped_due` the earliest due time of the
    /// rows it read past because they were not due soon enough, less the
    /// lead.
    pub(super) fn window_read(&mut self, last: Option<Vec<u8>>, skipped_due: Option<Timestamp>) {
        self.reading = false;
        if let Some(at) = skipped_due {
            self.note(at);
        }
        self.pass = last.map(Some);
    }
}

#[cfg(test)]
mod tests {
    // Goal: a backlog reads window after window while a pass is under way
    // and room is left (or the last window stalled), starts a new pass only
    // when a note asks for one, and waits out a failed read. Method: drive
    // it by hand.
    use super::*;

    #[test]
    fn passes_windows_and_notes() {
        let none = (0, Timestamp(0));
        let mut b = Backlog::new(2);
        assert_eq!(b.window_at(none), None, "nothing to read before recovery");
        b.start_recovery();
        assert_eq!(
            b.start_window(Timestamp(5), none),
            Some(None),
            "first window from the start"
        );
        assert_eq!(b.window_at(none), None, "one read at a time");
        b.window_read(Some(vec![7]), Some(Timestamp(100)));
        assert_eq!(
            b.window_at((2, Timestamp(0))),
            Some(Timestamp(5 + BACKLOG_STALL_MS)),
            "a window's worth held: wait, unless it stalls"
        );
        assert_eq!(
            b.window_at((2, Timestamp(9))),
            Some(Timestamp(9 + BACKLOG_STALL_MS)),
            "a row done is progress: the stall counts from it"
        );
        assert_eq!(
            b.start_window(Timestamp(6), (1, Timestamp(0))),
            Some(Some(vec![7])),
            "the pass goes on"
        );
        b.window_failed(Timestamp(50));
        assert_eq!(
            b.start_window(Timestamp(20), none),
            None,
            "not before the retry time"
        );
        assert_eq!(
            b.start_window(Timestamp(50), none),
            Some(Some(vec![7])),
            "same place again"
        );
        b.window_read(None, None);
        assert_eq!(
            b.window_at(none),
            Some(Timestamp(100)),
            "the skipped row's pass"
        );
        b.note(Timestamp(80));
        assert_eq!(
            b.window_at(none),
            Some(Timestamp(80)),
            "the earliest note wins"
        );
        assert_eq!(
            b.start_window(Timestamp(80), none),
            Some(None),
            "a new pass from the start"
        );
        b.window_read(None, None);
        assert_eq!(b.window_at(none), None, "nothing left to read");
    }
}
