//! When a schedule triggers: fixed intervals and cron expressions in a
//! time zone, pure functions of a time.
//!
//! Cron expressions have five fields (minute, hour, day of month, month,
//! day of week) with `*`, numbers, names (`JAN`, `MON`), ranges `a-b`,
//! steps `*/n` and `a-b/n`, lists `a,b`, and the macros `@yearly`,
//! `@monthly`, `@weekly`, `@daily` and `@hourly`. As in classic cron, a
//! day matches if both day fields match, or either one when both are
//! restricted. Local times come from the IANA database built into keel
//! (never the machine's), so every host computes the same times. A local
//! time that does not exist that day (a clock moved forward) does not
//! trigger; one that happens twice (a clock moved back) triggers once, at
//! its first occurrence.

use jiff::civil::{Date, DateTime};
use jiff::tz::{AmbiguousOffset, TimeZone};
use keel_storage::Timestamp;

use super::{ScheduleError, ScheduleSpec};

/// How far ahead a cron search looks for its next match before giving up
/// (a `30 2 30 2 *` never matches): five years covers every leap-day rule.
pub const CRON_SEARCH_DAYS_MAX: u32 = 5 * 366;
/// Bytes in one cron expression.
pub const CRON_EXPR_BYTES_MAX: usize = 256;
/// Cron expressions and intervals in one schedule.
pub const SCHEDULE_CALENDARS_MAX: usize = 16;
/// The shortest interval a schedule may have.
pub const SCHEDULE_INTERVAL_MS_MIN: u64 = 1_000;

/// One parsed cron expression: a bit set per field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cron {
    pub(crate) minutes: u64,
    pub(crate) hours: u32,
    days: u32,
    months: u16,
    weekdays: u8,
    days_star: bool,
    weekdays_star: bool,
}

const MONTHS: [&str; 12] = [
    "JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC",
];
const WEEKDAYS: [&str; 7] = ["SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"];

impl Cron {
    /// Parses a five-field expression or a macro.
    pub fn parse(expr: &str) -> Result<Cron, ScheduleError> {
        let bad = |why: String| ScheduleError::BadCron {
            expr: expr.chars().take(CRON_EXPR_BYTES_MAX).collect(),
            why,
        };
        if expr.len() > CRON_EXPR_BYTES_MAX {
            return Err(bad(format!("longer than {CRON_EXPR_BYTES_MAX} bytes")));
        }
        let expanded = match expr.trim() {
            "@yearly" | "@annually" => "0 0 1 1 *",
            "@monthly" => "0 0 1 * *",
            "@weekly" => "0 0 * * 0",
            "@daily" | "@midnight" => "0 0 * * *",
            "@hourly" => "0 * * * *",
            other if other.starts_with('@') => return Err(bad(format!("unknown macro {other}"))),
            other => other,
        };
        let fields: Vec<&str> = expanded.split_whitespace().collect();
        if fields.len() != 5 {
            return Err(bad(format!(
                "needs 5 fields (minute hour day-of-month month day-of-week), found {}",
                fields.len()
            )));
        }
        let field = |i: usize, lo: u32, hi: u32, names: &[&str]| {
            parse_field(fields[i], lo, hi, names)
                .map_err(|why| bad(format!("field {}: {why}", i + 1)))
        };
        let minutes = field(0, 0, 59, &[])?;
        let hours = field(1, 0, 23, &[])?;
        let days = field(2, 1, 31, &[])?;
        let months = field(3, 1, 12, &MONTHS)?;
        // 7 is Sunday too.
        let mut weekdays = field(4, 0, 7, &WEEKDAYS)?;
        if weekdays & (1 << 7) != 0 {
            weekdays |= 1;
        }
        Ok(Cron {
            minutes,
            hours: hours as u32,
            days: days as u32,
            months: months as u16,
            weekdays: (weekdays & 0x7f) as u8,
            // `*/n` counts as unrestricted for the either-day rule, as in
            // classic cron.
            days_star: fields[2].starts_with('*') || fields[2] == "?",
            weekdays_star: fields[4].starts_with('*') || fields[4] == "?",
        })
    }

    pub(crate) fn day_matches(&self, date: Date) -> bool {
        if self.months & (1 << date.month()) == 0 {
            return false;
        }
        let dom = self.days & (1 << date.day()) != 0;
        let dow = self.weekdays & (1 << date.weekday().to_sunday_zero_offset()) != 0;
        match (self.days_star, self.weekdays_star) {
            (false, false) => dom || dow,
            _ => dom && dow,
        }
    }

    /// The first local minute at or after `from` (same day) that matches.
    fn first_in_day(&self, hour: u32, minute: u32) -> Option<(u32, u32)> {
        for h in hour..24 {
            if self.hours & (1 << h) == 0 {
                continue;
            }
            let start = if h == hour { minute } else { 0 };
            for m in start..60 {
                if self.minutes & (1 << m) != 0 {
                    return Some((h, m));
                }
            }
        }
        None
    }

    /// The first trigger strictly after `after`, in `tz`.
    pub fn next_after(&self, tz: &TimeZone, after: Timestamp) -> Option<Timestamp> {
        let ts = jiff::Timestamp::from_millisecond(after.as_millis() as i64).ok()?;
        let local = ts.to_zoned(tz.clone()).datetime();
        // The next whole minute after `after`.
        let mut date = local.date();
        let (mut hour, mut minute) = (local.hour() as u32, local.minute() as u32 + 1);
        if minute == 60 {
            (hour, minute) = (hour + 1, 0);
        }
        for _ in 0..CRON_SEARCH_DAYS_MAX {
            if hour < 24 && self.day_matches(date) {
                while let Some((h, m)) = self.first_in_day(hour, minute) {
                    let civil =
                        DateTime::from_parts(date, jiff::civil::time(h as i8, m as i8, 0, 0));
                    let zoned = tz.to_ambiguous_zoned(civil);
                    let exists = !matches!(zoned.offset(), AmbiguousOffset::Gap { .. });
                    if exists {
                        if let Ok(z) = zoned.earlier() {
                            let at = z.timestamp().as_millisecond();
                            if at > after.as_millis() as i64 {
                                return Some(Timestamp(at as u64));
                            }
                        }
                    }
                    (hour, minute) = if m == 59 { (h + 1, 0) } else { (h, m + 1) };
                }
            }
            date = date.tomorrow().ok()?;
            (hour, minute) = (0, 0);
        }
        None
    }
}

/// Parses one field into a bit set over `lo..=hi`.
fn parse_field(text: &str, lo: u32, hi: u32, names: &[&str]) -> Result<u64, String> {
    let value = |s: &str| -> Result<u32, String> {
        let upper = s.to_ascii_uppercase();
        if let Some(i) = names.iter().position(|n| *n == upper) {
            // Month names count from 1, weekday names from 0.
            return Ok(i as u32 + lo);
        }
        let v: u32 = s.parse().map_err(|_| format!("{s:?} is not a number"))?;
        if v < lo || v > hi {
            return Err(format!("{v} is outside {lo}-{hi}"));
        }
        Ok(v)
    };
    let mut bits = 0u64;
    for part in text.split(',') {
        let (range, step) = match part.split_once('/') {
            Some((r, s)) => {
                let step: u32 = s
                    .parse()
                    .map_err(|_| format!("step {s:?} is not a number"))?;
                if step == 0 {
                    return Err("a step of 0".into());
                }
                (r, step)
            }
            None => (part, 1),
        };
        let (a, b) = match range {
            "*" | "?" => (lo, hi),
            r => match r.split_once('-') {
                Some((a, b)) => (value(a)?, value(b)?),
                // `a/n` runs from a to the end.
                None if step > 1 => (value(r)?, hi),
                None => {
                    let v = value(r)?;
                    (v, v)
                }
            },
        };
        if a > b {
            return Err(format!("range {a}-{b} runs backwards"));
        }
        let mut v = a;
        while v <= b {
            bits |= 1 << v;
            match v.checked_add(step) {
                Some(next) => v = next,
                None => break,
            }
        }
    }
    Ok(bits)
}

/// A schedule's calendars, parsed and checked: what computes its triggers.
#[derive(Clone, Debug)]
pub struct Calendar {
    intervals: Vec<(u64, u64)>,
    crons: Vec<Cron>,
    tz: TimeZone,
    start_at: Option<Timestamp>,
    end_at: Option<Timestamp>,
}

impl Calendar {
    /// Checks `spec` and parses its calendars.
    pub fn new(spec: &ScheduleSpec) -> Result<Calendar, ScheduleError> {
        let count = spec.intervals.len() + spec.cron.len();
        if count == 0 {
            return Err(ScheduleError::Empty);
        }
        if count > SCHEDULE_CALENDARS_MAX {
            return Err(ScheduleError::TooManyCalendars(count));
        }
        let mut intervals = Vec::new();
        for i in &spec.intervals {
            if i.every_ms < SCHEDULE_INTERVAL_MS_MIN {
                return Err(ScheduleError::IntervalTooShort(i.every_ms));
            }
            intervals.push((i.every_ms, i.offset_ms % i.every_ms));
        }
        let crons = spec
            .cron
            .iter()
            .map(|c| Cron::parse(c))
            .collect::<Result<Vec<_>, _>>()?;
        let tz = if spec.time_zone.is_empty() || spec.time_zone == "UTC" {
            TimeZone::UTC
        } else {
            TimeZone::get(&spec.time_zone)
                .map_err(|_| ScheduleError::UnknownTimeZone(spec.time_zone.clone()))?
        };
        if let (Some(s), Some(e)) = (spec.start_at, spec.end_at) {
            if e < s {
                return Err(ScheduleError::EndsBeforeStart);
            }
        }
        Ok(Calendar {
            intervals,
            crons,
            tz,
            start_at: spec.start_at,
            end_at: spec.end_at,
        })
    }

    /// The first trigger time strictly after `after`, within the spec's
    /// start and end; `None` once the schedule has no more.
    pub fn next_after(&self, after: Timestamp) -> Option<Timestamp> {
        // Strictly after `after` and at or after the start.
        let after = match self.start_at {
            Some(s) if s.as_millis() > 0 && after < s => Timestamp(s.as_millis() - 1),
            _ => after,
        };
        let a = after.as_millis();
        let by_interval = self.intervals.iter().map(|&(every, offset)| {
            // The first offset + k * every > a.
            let k = if a < offset {
                0
            } else {
                (a - offset) / every + 1
            };
            Timestamp(offset + k * every)
        });
        let by_cron = self
            .crons
            .iter()
            .filter_map(|c| c.next_after(&self.tz, after));
        let next = by_interval.chain(by_cron).min()?;
        match self.end_at {
            Some(end) if next > end => None,
            _ => Some(next),
        }
    }

    /// Up to `n` trigger times after `after`.
    pub fn upcoming(&self, after: Timestamp, n: usize) -> Vec<Timestamp> {
        let mut out = Vec::with_capacity(n);
        let mut at = after;
        while out.len() < n {
            match self.next_after(at) {
                Some(t) => {
                    out.push(t);
                    at = t;
                }
                None => break,
            }
        }
        out
    }
}

/// `t` as RFC 3339 in UTC with seconds (what trigger instance ids use).
pub fn rfc3339(t: Timestamp) -> String {
    match jiff::Timestamp::from_millisecond(t.as_millis() as i64) {
        Ok(ts) if t.as_millis().is_multiple_of(1000) => format!("{ts:.0}"),
        Ok(ts) => format!("{ts:.3}"),
        Err(_) => format!("{}ms", t.as_millis()),
    }
}

#[cfg(test)]
mod tests {
    //! Goal: cron fields, day rules, intervals and time zones compute the
    //! triggers a person reading the expression expects, including across
    //! daylight-saving changes. Method: fixed instants in, expected RFC
    //! 3339 times out.
    use super::*;
    use crate::schedule::IntervalSpec;

    fn at(s: &str) -> Timestamp {
        let ts: jiff::Timestamp = s.parse().expect("timestamp");
        Timestamp(ts.as_millisecond() as u64)
    }

    fn spec(cron: &str, tz: &str) -> Calendar {
        let s = ScheduleSpec {
            cron: vec![cron.to_string()],
            time_zone: tz.to_string(),
            ..ScheduleSpec::default()
        };
        Calendar::new(&s).expect("valid")
    }

    fn next(cal: &Calendar, from: &str, n: usize) -> Vec<String> {
        cal.upcoming(at(from), n).into_iter().map(rfc3339).collect()
    }

    #[test]
    fn weekday_mornings_in_berlin() {
        let cal = spec("30 9 * * MON-FRI", "Europe/Berlin");
        // Friday 2026-12-04 10:00 Berlin: next is Monday, then Tuesday.
        assert_eq!(
            next(&cal, "2026-12-04T09:00:00Z", 2),
            ["2026-12-07T08:30:00Z", "2026-12-08T08:30:00Z"]
        );
    }

    #[test]
    fn steps_lists_and_macros() {
        let cal = spec("*/15 0,12 * * *", "UTC");
        assert_eq!(
            next(&cal, "2026-01-01T00:40:00Z", 3),
            [
                "2026-01-01T00:45:00Z",
                "2026-01-01T12:00:00Z",
                "2026-01-01T12:15:00Z"
            ]
        );
        let cal = spec("@monthly", "UTC");
        assert_eq!(
            next(&cal, "2026-01-01T00:00:00Z", 1),
            ["2026-02-01T00:00:00Z"]
        );
        // Either day field when both are restricted: the 13th or a Friday.
        let cal = spec("0 0 13 * FRI", "UTC");
        assert_eq!(
            next(&cal, "2026-02-01T00:00:00Z", 3),
            [
                "2026-02-06T00:00:00Z",
                "2026-02-13T00:00:00Z",
                "2026-02-20T00:00:00Z"
            ]
        );
        // A leap day is years away.
        let cal = spec("0 0 29 2 *", "UTC");
        assert_eq!(
            next(&cal, "2026-03-01T00:00:00Z", 1),
            ["2028-02-29T00:00:00Z"]
        );
        // Never.
        assert!(spec("0 0 30 2 *", "UTC")
            .next_after(at("2026-01-01T00:00:00Z"))
            .is_none());
        // A stepped star is unrestricted for the either-day rule.
        let c = Cron::parse("0 0 */2 * MON").expect("valid");
        assert!(c.days_star && !c.weekdays_star);
        // A huge step does not overflow.
        assert!(Cron::parse("0 0 1/4294967295 * *").is_ok());
        assert!(Cron::parse(&"* ".repeat(200)).is_err());
    }

    #[test]
    fn daylight_saving_gap_and_fold() {
        // New York springs forward on 2026-03-08 at 02:00 local: 02:30
        // does not exist that day and is skipped.
        let cal = spec("30 2 * * *", "America/New_York");
        assert_eq!(
            next(&cal, "2026-03-07T12:00:00Z", 2),
            ["2026-03-09T06:30:00Z", "2026-03-10T06:30:00Z"]
        );
        // It falls back on 2026-11-01 at 02:00 local: 01:30 happens twice
        // and triggers once, at the first (EDT, UTC-4).
        let cal = spec("30 1 * * *", "America/New_York");
        assert_eq!(
            next(&cal, "2026-10-31T12:00:00Z", 2),
            ["2026-11-01T05:30:00Z", "2026-11-02T06:30:00Z"]
        );
    }

    #[test]
    fn intervals_with_offsets_and_bounds() {
        let s = ScheduleSpec {
            intervals: vec![IntervalSpec {
                every_ms: 3_600_000,
                offset_ms: 600_000,
            }],
            start_at: Some(at("2026-01-01T05:00:00Z")),
            end_at: Some(at("2026-01-01T08:00:00Z")),
            ..ScheduleSpec::default()
        };
        let cal = Calendar::new(&s).expect("valid");
        assert_eq!(
            next(&cal, "2026-01-01T00:00:00Z", 9),
            [
                "2026-01-01T05:10:00Z",
                "2026-01-01T06:10:00Z",
                "2026-01-01T07:10:00Z"
            ]
        );
    }

    #[test]
    fn bad_specs_are_typed_errors() {
        let bad = |c: &str| {
            Calendar::new(&ScheduleSpec {
                cron: vec![c.into()],
                ..ScheduleSpec::default()
            })
            .unwrap_err()
        };
        assert!(matches!(bad("* * *"), ScheduleError::BadCron { .. }));
        assert!(matches!(bad("61 * * * *"), ScheduleError::BadCron { .. }));
        assert!(matches!(bad("*/0 * * * *"), ScheduleError::BadCron { .. }));
        assert!(matches!(bad("@often"), ScheduleError::BadCron { .. }));
        let tz = Calendar::new(&ScheduleSpec {
            cron: vec!["@daily".into()],
            time_zone: "Mars/Olympus".into(),
            ..ScheduleSpec::default()
        });
        assert!(matches!(tz, Err(ScheduleError::UnknownTimeZone(_))));
        assert!(matches!(
            Calendar::new(&ScheduleSpec::default()),
            Err(ScheduleError::Empty)
        ));
    }
}
