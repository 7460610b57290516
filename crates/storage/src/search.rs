//! Memo and search attributes, and finding runs by them.
//!
//! A run's **memo** is a small map of named payloads shown with the run
//! (`describe`, `list`), never indexed. Its **search attributes** are typed
//! values ([`SearchValue`]) that the commit writing them also writes into
//! the `index` family, so [`list`] finds runs by status, type, instance,
//! start and close time and attribute values by seeking an index, never by
//! reading every run's history.
//!
//! Index keys (every string is escaped so that it sorts as itself and ends
//! where its terminator is; every time is inverted, so newer sorts first):
//!
//! ```text
//! 'S' status       inv-start run     runs by status
//! 'X' status type  inv-start run     runs by status and type
//! 'I' instance     inv-start run     runs of an instance
//! 'C'              inv-close run     closed runs by close time
//! 'A' name tag value inv-start run   runs by a search attribute's value
//! ```
//!
//! Runs of a type, and every run, have no index of their own (schema 7
//! dropped them: they were two of the ten index rows a short run writes,
//! a few percent of the store writer's work). They are the status and
//! status-and-type indexes read across every status: one scan per status,
//! merged by start time ([`Plan::across_statuses`]).
//!
//! A filter ([`RunFilter`]) is a conjunction of conditions; the planner
//! seeks the most selective index one condition allows (an instance, then
//! an attribute equal to a value, a status and type, a type, an attribute
//! range, a close-time range, then every run), bounds the scan by the
//! start-time conditions where the index orders by start time, and checks
//! every condition against each candidate's run record. A page examines at
//! most [`LIST_SCAN_ENTRIES_MAX`] index entries, so a filter that matches
//! little may answer a short page with a token to go on (a list across
//! statuses reads at most one chunk (256 entries) ahead per
//! status besides, and skips the statuses its conditions rule out).

use std::collections::VecDeque;
use std::fmt;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::codec::{self, RecordKind};
use crate::event::Payload;
use crate::ids::{RunId, Timestamp};
use crate::keys::{prefix_end, Cf};
use crate::kv::KvRead;
use crate::state::{RunMeta, RunStatus};

/// Most search attributes one run holds.
pub const SEARCH_ATTRIBUTES_PER_RUN_MAX: usize = 32;
/// Longest search attribute or memo field name, in bytes.
pub const METADATA_NAME_BYTES_MAX: usize = 64;
/// Longest keyword value of a search attribute, in bytes.
pub const SEARCH_KEYWORD_BYTES_MAX: usize = 256;
/// Most memo fields one run holds.
pub const MEMO_FIELDS_MAX: usize = 32;
/// Most bytes one run's memo holds (names and values): the run record
/// carries it and is rewritten by every commit, so it stays small; larger
/// state belongs in workflow code, read with a query.
pub const MEMO_BYTES_MAX: usize = 8 << 10;
/// Most runs one page of [`list`] returns.
pub const LIST_PAGE_RUNS_MAX: usize = 1000;
/// Most index entries one page of [`list`] examines before it answers
/// with what it found and a token to go on.
pub const LIST_SCAN_ENTRIES_MAX: usize = 10_000;
/// Most conditions in one filter.
pub const FILTER_CONDITIONS_MAX: usize = 16;
/// Longest filter text, in bytes.
pub const FILTER_TEXT_BYTES_MAX: usize = 4096;

/// Names a filter uses for a run's own fields; no search attribute may
/// take one.
pub const RESERVED_NAMES: [&str; 7] = [
    "status",
    "type",
    "workflow_type",
    "instance",
    "instance_id",
    "start_time",
    "close_time",
];

/// The value of a search attribute. Values of different kinds never
/// compare equal, and a filter compares a value with a literal of its own
/// kind only (`42` is an `Int`, `42.0` a `Double`).
#[derive(Clone, PartialEq, Debug, Serialize, Deserialize)]
pub enum SearchValue {
    /// A string matched exactly (a customer id, a region, a state name).
    Keyword(String),
    /// A signed integer.
    Int(i64),
    /// A finite floating-point number.
    Double(f64),
    /// True or false.
    Bool(bool),
    /// A point in time.
    Time(Timestamp),
}

impl SearchValue {
    fn tag(&self) -> u8 {
        match self {
            SearchValue::Keyword(_) => 1,
            SearchValue::Int(_) => 2,
            SearchValue::Double(_) => 3,
            SearchValue::Bool(_) => 4,
            SearchValue::Time(_) => 5,
        }
    }

    /// The kind's name, as errors and `describe` show it.
    pub fn kind(&self) -> &'static str {
        match self {
            SearchValue::Keyword(_) => "keyword",
            SearchValue::Int(_) => "int",
            SearchValue::Double(_) => "double",
            SearchValue::Bool(_) => "bool",
            SearchValue::Time(_) => "time",
        }
    }

    /// Appends the tag and the order-preserving bytes of the value.
    fn encode_key(&self, out: &mut Vec<u8>) {
        out.push(self.tag());
        match self {
            SearchValue::Keyword(s) => push_str(out, s),
            SearchValue::Int(i) => out.extend_from_slice(&((*i as u64) ^ (1 << 63)).to_be_bytes()),
            SearchValue::Double(f) => {
                let bits = f.to_bits();
                let ordered = if bits >> 63 == 1 {
                    !bits
                } else {
                    bits | (1 << 63)
                };
                out.extend_from_slice(&ordered.to_be_bytes());
            }
            SearchValue::Bool(b) => out.push(u8::from(*b)),
            SearchValue::Time(t) => out.extend_from_slice(&t.0.to_be_bytes()),
        }
    }

    /// Orders two values of one kind; `None` across kinds.
    fn compare(&self, other: &SearchValue) -> Option<std::cmp::Ordering> {
        use SearchValue as V;
        match (self, other) {
            (V::Keyword(a), V::Keyword(b)) => Some(a.cmp(b)),
            (V::Int(a), V::Int(b)) => Some(a.cmp(b)),
            (V::Double(a), V::Double(b)) => a.partial_cmp(b),
            (V::Bool(a), V::Bool(b)) => Some(a.cmp(b)),
            (V::Time(a), V::Time(b)) => Some(a.cmp(b)),
            _ => None,
        }
    }

    /// The value as a payload, as events hold it.
    pub fn to_payload(&self) -> Payload {
        Payload::encode(self).expect("a search value always encodes")
    }

    /// The value a payload holds; an error names what is wrong.
    pub fn from_payload(p: &Payload) -> Result<SearchValue, MetadataError> {
        p.decode()
            .map_err(|e| MetadataError::BadValue(format!("not a search value: {e}")))
    }

    /// The value without quotes, for tables.
    pub fn plain(&self) -> String {
        match self {
            SearchValue::Keyword(s) => s.clone(),
            SearchValue::Time(t) => t.to_rfc3339(),
            other => other.to_string(),
        }
    }
}

impl fmt::Display for SearchValue {
    /// The value as a filter literal: `"c-42"`, `42`, `4.5`, `true`,
    /// `time("2026-12-01T10:00:00.000Z")`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SearchValue::Keyword(s) => write!(f, "{s:?}"),
            SearchValue::Int(i) => write!(f, "{i}"),
            SearchValue::Double(d) if d.fract() == 0.0 && d.abs() < 1e15 => write!(f, "{d:.1}"),
            SearchValue::Double(d) => write!(f, "{d}"),
            SearchValue::Bool(b) => write!(f, "{b}"),
            SearchValue::Time(t) => write!(f, "time({:?})", t.to_rfc3339()),
        }
    }
}

impl From<&str> for SearchValue {
    fn from(s: &str) -> Self {
        SearchValue::Keyword(s.to_string())
    }
}
impl From<String> for SearchValue {
    fn from(s: String) -> Self {
        SearchValue::Keyword(s)
    }
}
impl From<i64> for SearchValue {
    fn from(i: i64) -> Self {
        SearchValue::Int(i)
    }
}
impl From<i32> for SearchValue {
    fn from(i: i32) -> Self {
        SearchValue::Int(i.into())
    }
}
impl From<u32> for SearchValue {
    fn from(i: u32) -> Self {
        SearchValue::Int(i.into())
    }
}
impl From<f64> for SearchValue {
    fn from(f: f64) -> Self {
        SearchValue::Double(f)
    }
}
impl From<bool> for SearchValue {
    fn from(b: bool) -> Self {
        SearchValue::Bool(b)
    }
}
impl From<Timestamp> for SearchValue {
    fn from(t: Timestamp) -> Self {
        SearchValue::Time(t)
    }
}

/// Why memo fields or search attributes were refused.
#[derive(Clone, PartialEq, Eq, Debug, Error)]
pub enum MetadataError {
    /// A name that is empty, too long, or has characters other than ASCII
    /// letters, digits, `_`, `-` and `.` (or does not start with a letter
    /// or `_`).
    #[error("name {0:?} is not valid: use 1 to {METADATA_NAME_BYTES_MAX} ASCII letters, digits, '_', '-' or '.', starting with a letter or '_'")]
    BadName(String),
    /// A search attribute named like a run's own field.
    #[error("{0:?} is a run field a filter uses; a search attribute cannot take its name")]
    ReservedName(String),
    /// A keyword longer than [`SEARCH_KEYWORD_BYTES_MAX`].
    #[error("search attribute {name:?}: keyword of {bytes} bytes is over the limit of {SEARCH_KEYWORD_BYTES_MAX}")]
    KeywordTooLong {
        /// The attribute.
        name: String,
        /// Its size.
        bytes: usize,
    },
    /// A double that is NaN or infinite.
    #[error("search attribute {0:?}: a double must be finite")]
    NotFinite(String),
    /// More attributes than [`SEARCH_ATTRIBUTES_PER_RUN_MAX`].
    #[error("a run holds at most {SEARCH_ATTRIBUTES_PER_RUN_MAX} search attributes; this would make {0}")]
    TooManyAttributes(usize),
    /// More memo fields than [`MEMO_FIELDS_MAX`].
    #[error("a run holds at most {MEMO_FIELDS_MAX} memo fields; this would make {0}")]
    TooManyMemoFields(usize),
    /// A memo larger than [`MEMO_BYTES_MAX`].
    #[error("a run's memo holds at most {MEMO_BYTES_MAX} bytes; this would make {0}")]
    MemoTooLarge(usize),
    /// A value that does not decode.
    #[error("{0}")]
    BadValue(String),
}

fn check_name(name: &str) -> Result<(), MetadataError> {
    let ok = !name.is_empty()
        && name.len() <= METADATA_NAME_BYTES_MAX
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(MetadataError::BadName(name.to_string()))
    }
}

/// Checks one search attribute: its name and its value.
pub fn check_attribute(name: &str, value: &SearchValue) -> Result<(), MetadataError> {
    check_name(name)?;
    if RESERVED_NAMES.contains(&name) {
        return Err(MetadataError::ReservedName(name.to_string()));
    }
    match value {
        SearchValue::Keyword(s) if s.len() > SEARCH_KEYWORD_BYTES_MAX => {
            Err(MetadataError::KeywordTooLong {
                name: name.to_string(),
                bytes: s.len(),
            })
        }
        SearchValue::Double(d) if !d.is_finite() => Err(MetadataError::NotFinite(name.to_string())),
        _ => Ok(()),
    }
}

/// Applies upserted search attributes (as events hold them: an empty
/// payload removes) to a run's attributes, kept sorted by name.
pub fn upsert_attributes(
    current: &mut Vec<(String, SearchValue)>,
    upserts: &[(String, Payload)],
) -> Result<(), MetadataError> {
    for (name, payload) in upserts {
        let at = current.binary_search_by(|(n, _)| n.as_str().cmp(name));
        if payload.is_empty() {
            check_name(name)?;
            if let Ok(i) = at {
                current.remove(i);
            }
            continue;
        }
        let value = SearchValue::from_payload(payload)?;
        check_attribute(name, &value)?;
        match at {
            Ok(i) => current[i].1 = value,
            Err(i) => current.insert(i, (name.clone(), value)),
        }
    }
    if current.len() > SEARCH_ATTRIBUTES_PER_RUN_MAX {
        return Err(MetadataError::TooManyAttributes(current.len()));
    }
    Ok(())
}

/// Applies upserted memo fields (an empty payload removes) to a run's
/// memo, kept sorted by name.
pub fn upsert_memo(
    current: &mut Vec<(String, Payload)>,
    upserts: &[(String, Payload)],
) -> Result<(), MetadataError> {
    for (name, payload) in upserts {
        check_name(name)?;
        let at = current.binary_search_by(|(n, _)| n.as_str().cmp(name));
        match (at, payload.is_empty()) {
            (Ok(i), true) => {
                current.remove(i);
            }
            (Err(_), true) => {}
            (Ok(i), false) => current[i].1 = payload.clone(),
            (Err(i), false) => current.insert(i, (name.clone(), payload.clone())),
        }
    }
    if current.len() > MEMO_FIELDS_MAX {
        return Err(MetadataError::TooManyMemoFields(current.len()));
    }
    let bytes = memo_bytes(current);
    if bytes > MEMO_BYTES_MAX {
        return Err(MetadataError::MemoTooLarge(bytes));
    }
    Ok(())
}

/// A run's search attributes, sorted by name.
pub type Attributes = Vec<(String, SearchValue)>;
/// A run's memo, sorted by name.
pub type Memo = Vec<(String, Payload)>;

/// What a run starts with: the attributes and memo carried from the run it
/// continues (if any), overlaid by those its start gives (as
/// `WorkflowStarted` holds them). The one place the commit, the machine,
/// the driver and the client derive and check them.
pub fn start_metadata(
    carried: Option<&crate::event::Carried>,
    search_attributes: &[(String, Payload)],
    memo: &[(String, Payload)],
) -> Result<(Attributes, Memo), MetadataError> {
    let (mut attrs, mut fields) = (Vec::new(), Vec::new());
    if let Some(c) = carried {
        upsert_attributes(&mut attrs, &c.search_attributes)?;
        upsert_memo(&mut fields, &c.memo)?;
    }
    upsert_attributes(&mut attrs, search_attributes)?;
    upsert_memo(&mut fields, memo)?;
    Ok((attrs, fields))
}

/// The bytes a memo takes against [`MEMO_BYTES_MAX`].
pub fn memo_bytes(memo: &[(String, Payload)]) -> usize {
    memo.iter().map(|(n, p)| n.len() + p.len()).sum()
}

/// Search attributes as events hold them.
pub fn attributes_as_payloads(attrs: &[(String, SearchValue)]) -> Vec<(String, Payload)> {
    attrs
        .iter()
        .map(|(n, v)| (n.clone(), v.to_payload()))
        .collect()
}

// ------------------------------------------------------------ index keys

/// Appends `s` so that the bytes sort as the string does and end at an
/// unambiguous terminator: `0x00` becomes `0x00 0xff`, the end `0x00 0x01`.
fn push_str(out: &mut Vec<u8>, s: &str) {
    let bytes = s.as_bytes();
    out.reserve(bytes.len() + 2);
    if bytes.contains(&0) {
        for &b in bytes {
            out.push(b);
            if b == 0 {
                out.push(0xff);
            }
        }
    } else {
        out.extend_from_slice(bytes);
    }
    out.extend_from_slice(&[0, 1]);
}

fn inverted(t: Timestamp) -> [u8; 8] {
    (u64::MAX - t.0).to_be_bytes()
}

const BY_STATUS: u8 = b'S';
const BY_STATUS_TYPE: u8 = b'X';
const BY_INSTANCE: u8 = b'I';
const BY_CLOSE: u8 = b'C';
const BY_ATTRIBUTE: u8 = b'A';

/// The first byte of the index keys by type, and of those of every run,
/// that schemas before 7 wrote: a migration deletes keys that start with
/// either (`rocks::migrate`, the PostgreSQL store's migration).
pub const DROPPED_INDEX_PREFIXES: [u8; 2] = [b'T', b'R'];

/// What every time-ordered index key ends with: the inverted time and the
/// run id.
const INDEX_TAIL_BYTES: usize = 8 + 16;

/// Runs in each status, counting at most `limit` per status: a scan of
/// the status index's keys, so a count equal to `limit` reads "at least".
pub fn count_by_status(
    view: &dyn KvRead,
    limit: usize,
) -> crate::error::Result<Vec<(RunStatus, usize)>> {
    RunStatus::ALL
        .into_iter()
        .map(|status| Ok((status, count_status(view, status, limit)?)))
        .collect()
}

/// Runs in `status`, counting at most `limit` (one bounded index scan).
pub fn count_status(
    view: &dyn KvRead,
    status: RunStatus,
    limit: usize,
) -> crate::error::Result<usize> {
    let prefix = status_prefix(status, None);
    let mut n = 0;
    if limit > 0 {
        view.scan(Cf::Index, &prefix, &prefix, &mut |_, _| {
            n += 1;
            n < limit
        })?;
    }
    Ok(n)
}

fn status_prefix(status: RunStatus, workflow_type: Option<&str>) -> Vec<u8> {
    let mut k = Vec::new();
    push_status_prefix(&mut k, status, workflow_type);
    k
}

fn push_status_prefix(out: &mut Vec<u8>, status: RunStatus, workflow_type: Option<&str>) {
    match workflow_type {
        None => out.extend_from_slice(&[BY_STATUS, status.code()]),
        Some(t) => {
            out.extend_from_slice(&[BY_STATUS_TYPE, status.code()]);
            push_str(out, t);
        }
    }
}

fn attribute_prefix(name: &str, value: Option<&SearchValue>, tag: u8) -> Vec<u8> {
    let mut k = vec![BY_ATTRIBUTE];
    push_str(&mut k, name);
    match value {
        Some(v) => v.encode_key(&mut k),
        None => k.push(tag),
    }
    k
}

/// Every index key of a run in the state `meta` describes.
pub fn index_keys(meta: &RunMeta) -> Vec<Vec<u8>> {
    // Each key is sized once for its prefix (two bytes at most), an
    // escaped string and its terminator, and the tail, instead of growing
    // as it is built: the writer builds them for every run that starts or
    // closes.
    let sized = |text: &str| Vec::with_capacity(2 + text.len() + 2 + INDEX_TAIL_BYTES);
    let tail = |mut k: Vec<u8>| {
        k.extend_from_slice(&inverted(meta.started_at));
        k.extend_from_slice(meta.run_id.as_bytes());
        k
    };
    let (workflow_type, instance) = (meta.workflow_type.as_str(), meta.instance_id.as_str());
    let mut out = Vec::with_capacity(4 + meta.search_attributes.len());
    let mut k = sized("");
    push_status_prefix(&mut k, meta.status, None);
    out.push(tail(k));
    let mut k = sized(workflow_type);
    push_status_prefix(&mut k, meta.status, Some(workflow_type));
    out.push(tail(k));
    let mut k = sized(instance);
    k.push(BY_INSTANCE);
    push_str(&mut k, instance);
    out.push(tail(k));
    if let Some(closed) = meta.closed_at {
        let mut k = sized("");
        k.push(BY_CLOSE);
        k.extend_from_slice(&inverted(closed));
        k.extend_from_slice(meta.run_id.as_bytes());
        out.push(k);
    }
    for (name, value) in &meta.search_attributes {
        out.push(tail(attribute_prefix(name, Some(value), 0)));
    }
    out
}

/// Whether two states of a run have the same index keys, without building
/// them: the common commit changes none of the fields they are made of.
pub fn same_index_keys(a: &RunMeta, b: &RunMeta) -> bool {
    a.status == b.status
        && a.closed_at == b.closed_at
        && a.started_at == b.started_at
        && a.search_attributes == b.search_attributes
        && a.workflow_type == b.workflow_type
        && a.instance_id == b.instance_id
}

// ---------------------------------------------------------------- filter

/// A field a condition tests.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum Field {
    /// The run's status (a [`RunStatus`] name).
    Status,
    /// The workflow type.
    WorkflowType,
    /// The instance id.
    Instance,
    /// When the run started.
    StartTime,
    /// When the run closed (an open run has no close time and matches no
    /// condition on it).
    CloseTime,
    /// A search attribute (a run without it matches no condition on it).
    Attribute(String),
}

impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Field::Status => f.write_str("status"),
            Field::WorkflowType => f.write_str("type"),
            Field::Instance => f.write_str("instance"),
            Field::StartTime => f.write_str("start_time"),
            Field::CloseTime => f.write_str("close_time"),
            Field::Attribute(n) => f.write_str(n),
        }
    }
}

/// How a condition compares.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Op {
    /// `=`
    Eq,
    /// `!=`
    Ne,
    /// `<`
    Lt,
    /// `<=`
    Le,
    /// `>`
    Gt,
    /// `>=`
    Ge,
}

impl Op {
    fn holds(self, ord: std::cmp::Ordering) -> bool {
        use std::cmp::Ordering::*;
        match self {
            Op::Eq => ord == Equal,
            Op::Ne => ord != Equal,
            Op::Lt => ord == Less,
            Op::Le => ord != Greater,
            Op::Gt => ord == Greater,
            Op::Ge => ord != Less,
        }
    }

    fn symbol(self) -> &'static str {
        match self {
            Op::Eq => "=",
            Op::Ne => "!=",
            Op::Lt => "<",
            Op::Le => "<=",
            Op::Gt => ">",
            Op::Ge => ">=",
        }
    }
}

/// One condition of a filter: `field op value`.
#[derive(Clone, PartialEq, Debug)]
pub struct Condition {
    /// What is tested.
    pub field: Field,
    /// How.
    pub op: Op,
    /// Against what (a keyword for status, type and instance; a time for
    /// start and close time).
    pub value: SearchValue,
}

impl fmt::Display for Condition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.field, &self.value) {
            (Field::Status, SearchValue::Keyword(s)) => {
                write!(f, "{} {} {s}", self.field, self.op.symbol())
            }
            _ => write!(f, "{} {} {}", self.field, self.op.symbol(), self.value),
        }
    }
}

impl Condition {
    /// Whether a run satisfies the condition.
    pub fn matches(&self, meta: &RunMeta) -> bool {
        let kw = |s: &str| SearchValue::Keyword(s.to_string());
        let value = match &self.field {
            Field::Status => kw(meta.status.name()),
            Field::WorkflowType => kw(&meta.workflow_type),
            Field::Instance => kw(meta.instance_id.as_str()),
            Field::StartTime => SearchValue::Time(meta.started_at),
            Field::CloseTime => match meta.closed_at {
                Some(t) => SearchValue::Time(t),
                None => return false,
            },
            Field::Attribute(name) => {
                match meta
                    .search_attributes
                    .binary_search_by(|(n, _)| n.as_str().cmp(name))
                {
                    Ok(i) => meta.search_attributes[i].1.clone(),
                    Err(_) => return false,
                }
            }
        };
        value
            .compare(&self.value)
            .is_some_and(|ord| self.op.holds(ord))
    }
}

/// Which runs to list: every condition must hold (no condition: every
/// run). Build one with the methods, or parse the text `keel list --where`
/// takes with [`RunFilter::parse`].
#[derive(Clone, PartialEq, Debug, Default)]
pub struct RunFilter {
    /// The conditions, all of which must hold.
    pub conditions: Vec<Condition>,
    /// At most this many runs from [`crate::Store::runs`] (pages have their
    /// own size).
    pub limit: Option<usize>,
}

impl fmt::Display for RunFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, c) in self.conditions.iter().enumerate() {
            if i > 0 {
                f.write_str(" and ")?;
            }
            write!(f, "{c}")?;
        }
        Ok(())
    }
}

impl RunFilter {
    /// Every run.
    pub fn all() -> Self {
        RunFilter::default()
    }

    /// Adds a condition.
    pub fn and(mut self, field: Field, op: Op, value: impl Into<SearchValue>) -> Self {
        self.conditions.push(Condition {
            field,
            op,
            value: value.into(),
        });
        self
    }

    /// Only runs in `status`.
    pub fn status(self, status: RunStatus) -> Self {
        self.and(Field::Status, Op::Eq, status.name())
    }

    /// Only runs of `workflow_type`.
    pub fn workflow_type(self, workflow_type: &str) -> Self {
        self.and(Field::WorkflowType, Op::Eq, workflow_type)
    }

    /// Only runs of `instance`.
    pub fn instance(self, instance: &str) -> Self {
        self.and(Field::Instance, Op::Eq, instance)
    }

    /// Only runs whose search attribute `name` equals `value`.
    pub fn attribute(self, name: &str, value: impl Into<SearchValue>) -> Self {
        self.and(Field::Attribute(name.to_string()), Op::Eq, value)
    }

    /// Only runs started at or after `t`.
    pub fn started_after(self, t: Timestamp) -> Self {
        self.and(Field::StartTime, Op::Ge, t)
    }

    /// Only runs started before `t`.
    pub fn started_before(self, t: Timestamp) -> Self {
        self.and(Field::StartTime, Op::Lt, t)
    }

    /// Only runs closed at or after `t`.
    pub fn closed_after(self, t: Timestamp) -> Self {
        self.and(Field::CloseTime, Op::Ge, t)
    }

    /// At most `n` runs from [`crate::Store::runs`].
    pub fn limit(mut self, n: usize) -> Self {
        self.limit = Some(n);
        self
    }

    /// Whether a run satisfies every condition.
    pub fn matches(&self, meta: &RunMeta) -> bool {
        self.conditions.iter().all(|c| c.matches(meta))
    }

    /// Whether no run in `status` can match: a condition on the status
    /// fails for its name (as [`Condition::matches`] tests it).
    fn rules_out(&self, status: RunStatus) -> bool {
        let name = SearchValue::Keyword(status.name().to_string());
        self.conditions
            .iter()
            .filter(|c| c.field == Field::Status)
            .any(|c| !name.compare(&c.value).is_some_and(|ord| c.op.holds(ord)))
    }

    /// Checks the conditions a builder made: a status that is a status
    /// name, times compared with times, attribute names that are valid.
    pub fn check(&self) -> Result<(), FilterError> {
        if self.conditions.len() > FILTER_CONDITIONS_MAX {
            return Err(FilterError::new(
                0,
                format!("at most {FILTER_CONDITIONS_MAX} conditions"),
            ));
        }
        for c in &self.conditions {
            check_condition(c).map_err(|m| FilterError::new(0, format!("{c}: {m}")))?;
        }
        Ok(())
    }

    /// Parses `keel list --where` text: conditions joined by `and`, each
    /// `field op literal` with `op` one of `= != < <= > >=`. Fields:
    /// `status`, `type`, `instance`, `start_time`, `close_time`, or a
    /// search attribute's name. Literals: `"text"`, a bare word
    /// (`running`, `continued-as-new`), `42`, `-7`, `4.5`, `true`,
    /// `false`, and `time("2026-12-01T10:00:00Z")`; a time field also
    /// takes a quoted RFC 3339 time or milliseconds since the epoch.
    pub fn parse(text: &str) -> Result<RunFilter, FilterError> {
        if text.len() > FILTER_TEXT_BYTES_MAX {
            return Err(FilterError::new(
                0,
                format!("a filter is at most {FILTER_TEXT_BYTES_MAX} bytes"),
            ));
        }
        let tokens = tokenize(text)?;
        let mut filter = RunFilter::default();
        let mut i = 0;
        if tokens.is_empty() {
            return Ok(filter);
        }
        loop {
            let (at, field) = match tokens.get(i) {
                Some((at, Token::Word(w))) => (*at, w.clone()),
                Some((at, t)) => {
                    return Err(FilterError::new(
                        *at,
                        format!("expected a field name, found {t}"),
                    ))
                }
                None => {
                    return Err(FilterError::new(
                        text.len(),
                        "expected a condition after `and`",
                    ))
                }
            };
            let field = match field.as_str() {
                "status" => Field::Status,
                "type" | "workflow_type" => Field::WorkflowType,
                "instance" | "instance_id" => Field::Instance,
                "start_time" => Field::StartTime,
                "close_time" => Field::CloseTime,
                "and" | "or" | "not" => {
                    return Err(FilterError::new(
                        at,
                        format!("expected a field name, found `{field}`"),
                    ))
                }
                _ => Field::Attribute(field),
            };
            let op = match tokens.get(i + 1) {
                Some((_, Token::Op(op))) => *op,
                Some((at, t)) => {
                    return Err(FilterError::new(
                        *at,
                        format!("expected one of = != < <= > >= after `{field}`, found {t}"),
                    ))
                }
                None => {
                    return Err(FilterError::new(
                        text.len(),
                        format!("expected one of = != < <= > >= after `{field}`"),
                    ))
                }
            };
            let (vat, literal) = match tokens.get(i + 2) {
                Some((at, t @ (Token::Word(_) | Token::Str(_) | Token::Time(_)))) => {
                    (*at, t.clone())
                }
                Some((at, t)) => {
                    return Err(FilterError::new(
                        *at,
                        format!("expected a value, found {t}"),
                    ))
                }
                None => {
                    return Err(FilterError::new(
                        text.len(),
                        format!("expected a value after `{field} {}`", op.symbol()),
                    ))
                }
            };
            let value = literal_value(&field, literal).map_err(|m| FilterError::new(vat, m))?;
            let condition = Condition { field, op, value };
            check_condition(&condition).map_err(|m| FilterError::new(at, m))?;
            filter.conditions.push(condition);
            if filter.conditions.len() > FILTER_CONDITIONS_MAX {
                return Err(FilterError::new(
                    at,
                    format!("at most {FILTER_CONDITIONS_MAX} conditions"),
                ));
            }
            i += 3;
            match tokens.get(i) {
                None => break,
                Some((_, Token::Word(w))) if w.eq_ignore_ascii_case("and") => i += 1,
                Some((at, Token::Word(w))) if w.eq_ignore_ascii_case("or") => {
                    return Err(FilterError::new(
                        *at,
                        "only `and` joins conditions; run one list per alternative",
                    ))
                }
                Some((at, t)) => {
                    return Err(FilterError::new(
                        *at,
                        format!("expected `and` or the end, found {t}"),
                    ))
                }
            }
        }
        Ok(filter)
    }
}

fn check_condition(c: &Condition) -> Result<(), String> {
    let ordering = !matches!(c.op, Op::Eq | Op::Ne);
    match (&c.field, &c.value) {
        (Field::Status, SearchValue::Keyword(s)) => {
            if RunStatus::parse(s).is_none() {
                let names: Vec<&str> = RunStatus::ALL.iter().map(|s| s.name()).collect();
                return Err(format!("unknown status {s:?}; one of {}", names.join(", ")));
            }
            if ordering {
                return Err("a status is compared with = or != only".into());
            }
            Ok(())
        }
        (Field::WorkflowType | Field::Instance, SearchValue::Keyword(_)) => Ok(()),
        (Field::StartTime | Field::CloseTime, SearchValue::Time(_)) => Ok(()),
        (Field::Attribute(name), v) => {
            check_attribute(name, v).map_err(|e| e.to_string())?;
            if ordering && matches!(v, SearchValue::Bool(_)) {
                return Err("a bool is compared with = or != only".into());
            }
            Ok(())
        }
        (f, v) => Err(format!("{f} is not compared with a {}", v.kind())),
    }
}

/// A filter that does not parse or check, with where in the text.
#[derive(Clone, PartialEq, Eq, Debug, Error)]
#[error("bad filter at byte {at}: {message}")]
pub struct FilterError {
    /// Byte offset in the filter text (0 for a filter built in code).
    pub at: usize,
    /// What is wrong.
    pub message: String,
}

impl FilterError {
    fn new(at: usize, message: impl Into<String>) -> Self {
        FilterError {
            at,
            message: message.into(),
        }
    }
}

#[derive(Clone, PartialEq, Debug)]
enum Token {
    Word(String),
    Str(String),
    Time(String),
    Op(Op),
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Token::Word(w) => write!(f, "`{w}`"),
            Token::Str(s) => write!(f, "{s:?}"),
            Token::Time(s) => write!(f, "time({s:?})"),
            Token::Op(o) => write!(f, "`{}`", o.symbol()),
        }
    }
}

fn tokenize(text: &str) -> Result<Vec<(usize, Token)>, FilterError> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    let word_byte =
        |c: u8| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'-' | b'.' | b':' | b'+');
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_whitespace() {
            i += 1;
            continue;
        }
        let at = i;
        match c {
            b'"' | b'\'' => {
                let (s, next) = quoted(text, i)?;
                out.push((at, Token::Str(s)));
                i = next;
            }
            b'=' => {
                i += if b.get(i + 1) == Some(&b'=') { 2 } else { 1 };
                out.push((at, Token::Op(Op::Eq)));
            }
            b'!' if b.get(i + 1) == Some(&b'=') => {
                i += 2;
                out.push((at, Token::Op(Op::Ne)));
            }
            b'<' | b'>' => {
                let eq = b.get(i + 1) == Some(&b'=');
                let op = match (c, eq) {
                    (b'<', false) => Op::Lt,
                    (b'<', true) => Op::Le,
                    (_, false) => Op::Gt,
                    (_, true) => Op::Ge,
                };
                i += 1 + usize::from(eq);
                out.push((at, Token::Op(op)));
            }
            c if word_byte(c) => {
                while i < b.len() && word_byte(b[i]) {
                    i += 1;
                }
                let word = &text[at..i];
                if word == "time" && b.get(i) == Some(&b'(') {
                    let mut j = i + 1;
                    while b.get(j).is_some_and(u8::is_ascii_whitespace) {
                        j += 1;
                    }
                    if !matches!(b.get(j), Some(b'"' | b'\'')) {
                        return Err(FilterError::new(
                            j,
                            "time(...) takes a quoted RFC 3339 time",
                        ));
                    }
                    let (s, mut next) = quoted(text, j)?;
                    while b.get(next).is_some_and(u8::is_ascii_whitespace) {
                        next += 1;
                    }
                    if b.get(next) != Some(&b')') {
                        return Err(FilterError::new(next, "expected `)` after the time"));
                    }
                    out.push((at, Token::Time(s)));
                    i = next + 1;
                } else {
                    out.push((at, Token::Word(word.to_string())));
                }
            }
            b'(' | b')' => {
                return Err(FilterError::new(
                    at,
                    "parentheses are not supported: conditions are joined by `and`",
                ))
            }
            _ => {
                let ch = text[at..].chars().next().unwrap_or('?');
                return Err(FilterError::new(at, format!("unexpected character {ch:?}")));
            }
        }
    }
    Ok(out)
}

/// The string quoted at `start` (`"` or `'`, with `\` escaping the next
/// character) and the offset after its closing quote.
fn quoted(text: &str, start: usize) -> Result<(String, usize), FilterError> {
    let quote = text.as_bytes()[start] as char;
    let mut s = String::new();
    let mut chars = text[start + 1..].char_indices();
    while let Some((off, ch)) = chars.next() {
        match ch {
            '\\' => match chars.next() {
                Some((_, e)) => s.push(e),
                None => break,
            },
            c if c == quote => return Ok((s, start + 1 + off + 1)),
            c => s.push(c),
        }
    }
    Err(FilterError::new(start, "unterminated string"))
}

fn literal_value(field: &Field, literal: Token) -> Result<SearchValue, String> {
    let time = |s: &str| {
        Timestamp::parse_rfc3339(s)
            .map(SearchValue::Time)
            .ok_or_else(|| format!("{s:?} is not an RFC 3339 time (2026-12-01T10:00:00Z)"))
    };
    match literal {
        Token::Time(s) => time(&s),
        Token::Str(s) => match field {
            Field::StartTime | Field::CloseTime => time(&s),
            _ => Ok(SearchValue::Keyword(s)),
        },
        Token::Word(w) => {
            let numeric = w.starts_with(|c: char| c.is_ascii_digit())
                || (w.starts_with('-') && w[1..].starts_with(|c: char| c.is_ascii_digit()));
            if matches!(field, Field::StartTime | Field::CloseTime) {
                if let Ok(ms) = w.parse::<u64>() {
                    return Ok(SearchValue::Time(Timestamp(ms)));
                }
                return time(&w);
            }
            if matches!(field, Field::Status | Field::WorkflowType | Field::Instance) {
                return Ok(SearchValue::Keyword(w));
            }
            if w == "true" || w == "false" {
                return Ok(SearchValue::Bool(w == "true"));
            }
            if numeric {
                if let Ok(i) = w.parse::<i64>() {
                    return Ok(SearchValue::Int(i));
                }
                return match w.parse::<f64>() {
                    Ok(d) if d.is_finite() => Ok(SearchValue::Double(d)),
                    _ => Err(format!("`{w}` is not a number")),
                };
            }
            Ok(SearchValue::Keyword(w))
        }
        Token::Op(_) => unreachable!("the parser passes values only"),
    }
}

// ------------------------------------------------------------------ list

/// Where a page of [`list`] ends: pass it back to get the next page. It
/// holds the last index key examined and is only valid for the same
/// filter.
#[derive(Clone, PartialEq, Eq, Debug, Hash, Serialize, Deserialize)]
pub struct PageToken(pub String);

impl fmt::Display for PageToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// One page of runs, newest first within the index the filter uses.
#[derive(Clone, PartialEq, Debug, Default)]
pub struct RunPage {
    /// The runs.
    pub runs: Vec<RunMeta>,
    /// The token for the next page; `None` when there is none.
    pub next: Option<PageToken>,
}

/// How [`list`] walks the index for a filter.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Plan {
    /// Every key scanned starts with this.
    pub prefix: Vec<u8>,
    /// The first key to look at.
    pub from: Vec<u8>,
    /// The scan stops at this key (exclusive), if it does before the
    /// prefix ends.
    pub until: Option<Vec<u8>>,
    /// Which index, for `explain`.
    pub index: &'static str,
    /// Whether the plan reads a status index across every status: its
    /// keys (`prefix`, `from`, `until`, and the keys `list` hands on) then
    /// leave out the status byte that follows a status key's first byte,
    /// and each status's range is scanned with it put back, the ranges
    /// merged by what follows (the inverted start time and the run id).
    pub across_statuses: bool,
}

impl Plan {
    fn across_statuses(self) -> Plan {
        Plan {
            across_statuses: true,
            ..self
        }
    }
}

/// `key` of a plan across statuses as stored for `status`: its status byte
/// put back after the first.
fn with_status(key: &[u8], status: RunStatus) -> Vec<u8> {
    let mut k = Vec::with_capacity(key.len() + 1);
    k.extend_from_slice(&key[..1]);
    k.push(status.code());
    k.extend_from_slice(&key[1..]);
    k
}

/// The inclusive range of inverted start (or close) times the time
/// conditions on `field` allow.
fn inverted_bounds(filter: &RunFilter, field: &Field) -> (u64, u64) {
    let (mut lo, mut hi) = (0u64, u64::MAX);
    for c in filter.conditions.iter().filter(|c| &c.field == field) {
        let SearchValue::Time(t) = c.value else {
            continue;
        };
        let inv = u64::MAX - t.0;
        match c.op {
            // start >= t  <=>  inv <= MAX - t
            Op::Ge => hi = hi.min(inv),
            Op::Gt => hi = hi.min(inv.saturating_sub(1)),
            Op::Le => lo = lo.max(inv),
            Op::Lt => lo = lo.max(inv.saturating_add(1)),
            Op::Eq => {
                lo = lo.max(inv);
                hi = hi.min(inv);
            }
            Op::Ne => {}
        }
    }
    (lo, hi)
}

fn time_bounded(prefix: Vec<u8>, (lo, hi): (u64, u64), index: &'static str) -> Plan {
    let mut from = prefix.clone();
    if lo > 0 {
        from.extend_from_slice(&lo.to_be_bytes());
    }
    let until = match hi.checked_add(1) {
        Some(end) if lo <= hi => {
            let mut k = prefix.clone();
            k.extend_from_slice(&end.to_be_bytes());
            Some(k)
        }
        // An empty range: stop at once.
        Some(_) => Some(from.clone()),
        None => None,
    };
    Plan {
        prefix,
        from,
        until,
        index,
        across_statuses: false,
    }
}

/// The index walk for `filter` (see the module documentation).
pub fn plan(filter: &RunFilter) -> Plan {
    let eq = |field: &dyn Fn(&Field) -> bool| {
        filter
            .conditions
            .iter()
            .find(|c| c.op == Op::Eq && field(&c.field))
    };
    let starts = inverted_bounds(filter, &Field::StartTime);
    let keyword = |c: &Condition| match &c.value {
        SearchValue::Keyword(s) => s.clone(),
        _ => String::new(),
    };
    if let Some(c) = eq(&|f| *f == Field::Instance) {
        let mut p = vec![BY_INSTANCE];
        push_str(&mut p, &keyword(c));
        return time_bounded(p, starts, "instance");
    }
    if let Some(c) = eq(&|f| matches!(f, Field::Attribute(_))) {
        let Field::Attribute(name) = &c.field else {
            unreachable!("matched an attribute")
        };
        return time_bounded(
            attribute_prefix(name, Some(&c.value), 0),
            starts,
            "attribute",
        );
    }
    if let Some(c) = eq(&|f| *f == Field::Status) {
        let status = RunStatus::parse(&keyword(c)).unwrap_or(RunStatus::Running);
        let t = eq(&|f| *f == Field::WorkflowType).map(keyword);
        let index = if t.is_some() {
            "status and type"
        } else {
            "status"
        };
        return time_bounded(status_prefix(status, t.as_deref()), starts, index);
    }
    if let Some(c) = eq(&|f| *f == Field::WorkflowType) {
        let mut p = vec![BY_STATUS_TYPE];
        push_str(&mut p, &keyword(c));
        return time_bounded(p, starts, "type").across_statuses();
    }
    let range = filter
        .conditions
        .iter()
        .find(|c| matches!(c.field, Field::Attribute(_)) && !matches!(c.op, Op::Eq | Op::Ne));
    if let Some(c) = range {
        let Field::Attribute(name) = &c.field else {
            unreachable!("matched an attribute")
        };
        let prefix = attribute_prefix(name, None, c.value.tag());
        let mut from = prefix.clone();
        let mut until = None;
        for c in filter.conditions.iter().filter(|o| o.field == c.field) {
            if c.value.tag() != prefix[prefix.len() - 1] {
                continue;
            }
            let at = attribute_prefix(name, Some(&c.value), 0);
            let after = prefix_end(&at).unwrap_or_else(|| at.clone());
            match c.op {
                Op::Ge if at > from => from = at,
                Op::Gt if after > from => from = after,
                Op::Le if until.as_ref().is_none_or(|u| after < *u) => until = Some(after),
                Op::Lt if until.as_ref().is_none_or(|u| at < *u) => until = Some(at),
                _ => {}
            }
        }
        return Plan {
            prefix,
            from,
            until,
            index: "attribute range",
            across_statuses: false,
        };
    }
    if filter
        .conditions
        .iter()
        .any(|c| c.field == Field::CloseTime)
    {
        let closes = inverted_bounds(filter, &Field::CloseTime);
        return time_bounded(vec![BY_CLOSE], closes, "close time");
    }
    time_bounded(vec![BY_STATUS], starts, "start time").across_statuses()
}

/// Index entries read per scan at most before their run records are read
/// (in one batched read).
const LIST_CHUNK_ENTRIES: usize = 256;

/// Index entries read per scan at least: a chunk asks for as many entries
/// as the page still lacks (so a page of 50 whose runs all match reads 50
/// records, not 256), but never fewer than this when a filter rejects many.
const LIST_CHUNK_ENTRIES_MIN: usize = 32;

/// Errors of [`list`].
#[derive(Debug, Error)]
pub enum ListError {
    /// The filter does not check.
    #[error(transparent)]
    Filter(#[from] FilterError),
    /// A page token that this filter did not hand out.
    #[error("page token {0} does not belong to this filter")]
    BadToken(String),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] crate::Error),
}

/// One page of the runs `filter` matches, at most `page_size` (clamped to
/// 1..=[`LIST_PAGE_RUNS_MAX`]), after `after`.
pub fn list(
    view: &dyn KvRead,
    filter: &RunFilter,
    page_size: usize,
    after: Option<&PageToken>,
) -> Result<RunPage, ListError> {
    filter.check()?;
    let page_size = page_size.clamp(1, LIST_PAGE_RUNS_MAX);
    let plan = plan(filter);
    let mut from = plan.from.clone();
    if let Some(token) = after {
        let key = unhex(&token.0)
            .filter(|k| k.starts_with(&plan.prefix) && *k >= plan.from)
            .filter(|k| !plan.across_statuses || k.len() == plan.prefix.len() + INDEX_TAIL_BYTES)
            .ok_or_else(|| ListError::BadToken(token.0.clone()))?;
        from = key;
        from.push(0);
    }
    let mut walk = Walk::new(&plan, filter, from);
    let mut page = RunPage::default();
    let mut examined = 0;
    loop {
        let want = (page_size - page.runs.len())
            .clamp(LIST_CHUNK_ENTRIES_MIN, LIST_CHUNK_ENTRIES)
            .min(LIST_SCAN_ENTRIES_MAX - examined);
        let (chunk, ended) = walk.next(view, want)?;
        let runs: Vec<Option<RunId>> = chunk.iter().map(|k| run_of_key(k)).collect();
        let keys: Vec<Vec<u8>> = runs
            .iter()
            .flatten()
            .map(|r| crate::keys::run_key(*r))
            .collect();
        let mut records = view.get_many(Cf::Runs, &keys)?.into_iter();
        let mut last = None;
        for (key, run) in chunk.into_iter().zip(runs) {
            examined += 1;
            if let Some(run) = run {
                let record = records.next().expect("one record per run key");
                if let Some(mut meta) = record.map(|bytes| decode_run(run, &bytes)).transpose()? {
                    if filter.matches(&meta) {
                        crate::derive::current_run(view, run, &mut meta)?;
                        page.runs.push(meta);
                    }
                }
            }
            last = Some(key);
            if page.runs.len() == page_size {
                break;
            }
        }
        let Some(last) = last else {
            return Ok(page);
        };
        let full = page.runs.len() == page_size;
        if ended && !full {
            return Ok(page);
        }
        if full || examined >= LIST_SCAN_ENTRIES_MAX {
            // A full page may end exactly at the last match: the page
            // after it is then empty, which costs one more read.
            page.next = Some(PageToken(hex(&last)));
            return Ok(page);
        }
    }
}

/// The index keys a plan walks, in order, a chunk at a time.
enum Walk {
    /// One range, from `from` on.
    Range {
        prefix: Vec<u8>,
        until: Option<Vec<u8>>,
        from: Vec<u8>,
    },
    /// One range per status, merged by what follows the status byte
    /// ([`Plan::across_statuses`]).
    Merged {
        statuses: Vec<StatusWalk>,
        /// The last key handed out.
        last: Option<Vec<u8>>,
    },
}

/// One status's range of a merged walk, with the keys read and not yet
/// handed out (status byte removed).
struct StatusWalk {
    range: Walk,
    read: VecDeque<Vec<u8>>,
    ended: bool,
}

impl Walk {
    /// The walk of `plan` from `from` (in the plan's keys) on, leaving out
    /// the statuses `filter` rules out.
    fn new(plan: &Plan, filter: &RunFilter, from: Vec<u8>) -> Walk {
        if !plan.across_statuses {
            return Walk::Range {
                prefix: plan.prefix.clone(),
                until: plan.until.clone(),
                from,
            };
        }
        let statuses = RunStatus::ALL
            .into_iter()
            .filter(|s| !filter.rules_out(*s))
            .map(|s| StatusWalk {
                range: Walk::Range {
                    prefix: with_status(&plan.prefix, s),
                    until: plan.until.as_deref().map(|u| with_status(u, s)),
                    from: with_status(&from, s),
                },
                read: VecDeque::new(),
                ended: false,
            })
            .collect();
        Walk::Merged {
            statuses,
            last: None,
        }
    }

    /// Up to `want` more keys, in order, and whether the walk ends with
    /// them.
    fn next(
        &mut self,
        view: &dyn KvRead,
        want: usize,
    ) -> Result<(Vec<Vec<u8>>, bool), crate::Error> {
        match self {
            Walk::Range {
                prefix,
                until,
                from,
            } => {
                let mut chunk: Vec<Vec<u8>> = Vec::new();
                let mut ended = false;
                view.scan(Cf::Index, prefix, from, &mut |k, _| {
                    if until.as_deref().is_some_and(|u| k >= u) {
                        ended = true;
                        return false;
                    }
                    chunk.push(k.to_vec());
                    chunk.len() < want
                })?;
                if let Some(last) = chunk.last() {
                    from.clone_from(last);
                    from.push(0);
                }
                let ended = ended || chunk.len() < want;
                Ok((chunk, ended))
            }
            Walk::Merged { statuses, last } => {
                let mut chunk = Vec::with_capacity(want);
                while chunk.len() < want {
                    // A status that has not ended always shows its next
                    // key, so the smallest in view is the merge's next.
                    for s in statuses
                        .iter_mut()
                        .filter(|s| !s.ended && s.read.is_empty())
                    {
                        let (keys, ended) = s.range.next(view, want)?;
                        s.ended = ended;
                        s.read.extend(keys.into_iter().map(|mut k| {
                            k.remove(1);
                            k
                        }));
                    }
                    let first = statuses
                        .iter_mut()
                        .filter(|s| !s.read.is_empty())
                        .min_by(|a, b| a.read[0].cmp(&b.read[0]));
                    let Some(first) = first else {
                        break;
                    };
                    let key = first.read.pop_front().expect("a status with keys read");
                    // Each status is its own scan, not one snapshot: a run
                    // that closed between two of them is in both, once.
                    if last.as_ref().is_some_and(|l| key <= *l) {
                        continue;
                    }
                    *last = Some(key.clone());
                    chunk.push(key);
                }
                let ended = statuses.iter().all(|s| s.ended && s.read.is_empty());
                Ok((chunk, ended))
            }
        }
    }
}

/// The run an index key names (its last 16 bytes).
fn run_of_key(key: &[u8]) -> Option<RunId> {
    key.len()
        .checked_sub(16)
        .and_then(|at| crate::keys::run_prefix(&key[at..]))
}

fn decode_run(run: RunId, bytes: &[u8]) -> Result<RunMeta, crate::Error> {
    codec::decode(RecordKind::Run, bytes).map_err(|source| crate::Error::Corrupt {
        cf: Cf::Runs.name(),
        run: Some(run),
        seq: None,
        source,
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || s.len() > 4096 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    // Goal: the filter language parses what the documentation promises and
    // refuses the rest with where and why; key encodings sort as values do.
    // Method: table of texts; pairs of values compared through their keys.
    use super::*;

    #[test]
    fn strings_in_keys_escape_their_zero_bytes_and_sort_as_strings() {
        let key = |s: &str| {
            let mut k = vec![BY_INSTANCE];
            push_str(&mut k, s);
            k
        };
        assert_eq!(key("a\0b"), [BY_INSTANCE, b'a', 0, 0xff, b'b', 0, 1]);
        assert_eq!(key("ab"), [BY_INSTANCE, b'a', b'b', 0, 1]);
        let mut texts = ["", "a", "a\0", "a\0\0", "a\u{1}", "ab", "b", "\0"];
        let mut keys: Vec<Vec<u8>> = texts.iter().map(|t| key(t)).collect();
        texts.sort_unstable();
        keys.sort_unstable();
        assert_eq!(keys, texts.iter().map(|t| key(t)).collect::<Vec<_>>());
    }

    #[test]
    fn parses_conditions_and_refuses_bad_text() {
        let f = RunFilter::parse(r#"customer = "c-42" and status = running"#).unwrap();
        assert_eq!(
            f,
            RunFilter::all()
                .attribute("customer", "c-42")
                .status(RunStatus::Running)
        );
        let f = RunFilter::parse(
            "amount >= 100 and ratio < 0.5 and vip = true and start_time > '2026-12-01' \
             and close_time <= 1000 and due = time(\"2026-12-01T10:00:00Z\") and type != checkout",
        )
        .unwrap();
        assert_eq!(f.conditions.len(), 7);
        assert_eq!(f.conditions[0].value, SearchValue::Int(100));
        assert_eq!(f.conditions[1].value, SearchValue::Double(0.5));
        assert_eq!(f.conditions[2].value, SearchValue::Bool(true));
        assert_eq!(
            f.conditions[3].value,
            SearchValue::Time(Timestamp::parse_rfc3339("2026-12-01T00:00:00Z").unwrap())
        );
        assert_eq!(f.conditions[4].value, SearchValue::Time(Timestamp(1000)));
        assert_eq!(f.conditions[6].op, Op::Ne);
        // The text a filter prints parses back to the same filter.
        assert_eq!(RunFilter::parse(&f.to_string()).unwrap(), f);
        assert_eq!(RunFilter::parse("  ").unwrap(), RunFilter::all());
        for (text, at, needle) in [
            ("status = sleeping", 0, "unknown status"),
            ("status > running", 0, "= or !="),
            ("a = 1 or b = 2", 6, "only `and`"),
            ("(a = 1)", 0, "parentheses"),
            ("a = ", 4, "expected a value"),
            ("a 1", 2, "expected one of"),
            ("a = 1 b = 2", 6, "expected `and`"),
            ("start_time > 'yesterday'", 13, "RFC 3339"),
            ("a = \"open", 4, "unterminated"),
            ("start_time = true", 13, "RFC 3339"),
            ("vip > true", 0, "= or !="),
            ("9lives = 1", 0, "not valid"),
            ("x = 1 and", 9, "expected a condition"),
        ] {
            let e = RunFilter::parse(text).unwrap_err();
            assert_eq!(e.at, at, "{text}: {e}");
            assert!(e.message.contains(needle), "{text}: {e}");
        }
    }

    #[test]
    fn keys_sort_as_values() {
        let key = |v: SearchValue| {
            let mut k = Vec::new();
            v.encode_key(&mut k);
            k
        };
        let ints = [i64::MIN, -5, -1, 0, 1, 7, i64::MAX];
        for w in ints.windows(2) {
            assert!(key(w[0].into()) < key(w[1].into()));
        }
        let doubles = [f64::MIN, -2.5, -0.0, 0.0, 1e-9, 3.0, f64::MAX];
        for w in doubles.windows(2) {
            assert!(key(w[0].into()) <= key(w[1].into()), "{w:?}");
        }
        let words = ["", "a", "a\0", "a\0b", "ab", "b"];
        for w in words.windows(2) {
            assert!(key(w[0].into()) < key(w[1].into()), "{w:?}");
        }
        // No keyword's key is a prefix of another's.
        assert!(!key("ab".into()).starts_with(&key("a".into())));
    }

    #[test]
    fn upserts_apply_and_refuse_over_limits() {
        let mut attrs = Vec::new();
        upsert_attributes(
            &mut attrs,
            &[
                ("customer".into(), SearchValue::from("c-1").to_payload()),
                ("amount".into(), SearchValue::from(5i64).to_payload()),
            ],
        )
        .unwrap();
        assert_eq!(attrs[0].0, "amount");
        upsert_attributes(&mut attrs, &[("amount".into(), Payload::default())]).unwrap();
        assert_eq!(attrs.len(), 1);
        let e = upsert_attributes(
            &mut attrs,
            &[("status".into(), SearchValue::from("x").to_payload())],
        )
        .unwrap_err();
        assert!(matches!(e, MetadataError::ReservedName(_)));
        let long = "x".repeat(SEARCH_KEYWORD_BYTES_MAX + 1);
        let e = upsert_attributes(
            &mut attrs,
            &[("k".into(), SearchValue::from(long).to_payload())],
        )
        .unwrap_err();
        assert!(matches!(e, MetadataError::KeywordTooLong { .. }));
        let e = upsert_attributes(&mut attrs, &[("k".into(), Payload::from_bytes(vec![0xc1]))])
            .unwrap_err();
        assert!(matches!(e, MetadataError::BadValue(_)));
        let mut memo = Vec::new();
        let big = Payload::from_bytes(vec![1; MEMO_BYTES_MAX]);
        let e = upsert_memo(&mut memo, &[("note".into(), big)]).unwrap_err();
        assert!(matches!(e, MetadataError::MemoTooLarge(_)));
    }

    #[test]
    fn times_round_trip_through_rfc3339() {
        for ms in [
            0u64,
            1,
            999,
            86_399_999,
            951_782_400_000,
            1_796_167_086_123,
            4_102_444_800_000,
        ] {
            let t = Timestamp(ms);
            assert_eq!(
                Timestamp::parse_rfc3339(&t.to_rfc3339()),
                Some(t),
                "{}",
                t.to_rfc3339()
            );
        }
        assert_eq!(
            Timestamp::parse_rfc3339("2026-12-01T23:18:06+01:00"),
            Timestamp::parse_rfc3339("2026-12-01T22:18:06Z")
        );
        assert_eq!(Timestamp::parse_rfc3339("1970-01-01"), Some(Timestamp(0)));
        for bad in [
            "2026-02-30",
            "2026-13-01",
            "2026-12-01T25:00:00Z",
            "2026-12-01T10:00:00",
            "1969-12-31T23:59:59Z",
            "soon",
        ] {
            assert_eq!(Timestamp::parse_rfc3339(bad), None, "{bad}");
        }
    }
}
