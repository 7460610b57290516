//! Memo and search attributes from workflow code.
//!
//! Both are commands with an event (`MemoUpserted`,
//! `SearchAttributesUpserted`) and no step: the commit that records one also
//! moves the run's entries in the store's index, so `list` finds the run by
//! its new values as soon as the commit is durable. Values are checked here
//! with the store's own rules before anything is issued, so code that asks
//! for too much gets an error it can handle instead of a refused commit.

use keel_storage::search::{self, MetadataError};
use keel_storage::{EventKind, Failure, FailureKind, Payload, SearchValue};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::context::WorkflowContext;
use crate::core::Issued;

fn refused(e: MetadataError) -> Failure {
    Failure::new(FailureKind::Application, e.to_string(), false)
}

impl WorkflowContext {
    /// Sets memo field `name` (shown by `describe` and `list`, carried by
    /// continue-as-new, not indexed). At most
    /// [`search::MEMO_FIELDS_MAX`] fields and [`search::MEMO_BYTES_MAX`]
    /// bytes per run.
    pub fn upsert_memo<T: Serialize>(&self, name: &str, value: &T) -> Result<(), Failure> {
        let p = Payload::encode(value).map_err(|e| {
            Failure::new(
                FailureKind::Application,
                format!("memo {name:?} does not encode: {e}"),
                false,
            )
        })?;
        self.memo_command(vec![(name.to_string(), p)])
    }

    /// Removes memo field `name` (nothing if the run has none).
    pub fn remove_memo(&self, name: &str) -> Result<(), Failure> {
        self.memo_command(vec![(name.to_string(), Payload::default())])
    }

    /// The value of memo field `name`, if the run has it and it decodes as
    /// `T`.
    pub fn memo<T: DeserializeOwned>(&self, name: &str) -> Option<T> {
        let core = self.core.borrow();
        let at = core
            .memo
            .binary_search_by(|(n, _)| n.as_str().cmp(name))
            .ok()?;
        core.memo[at].1.decode().ok()
    }

    /// Sets search attributes: `list` finds the run by them once the
    /// commit is durable (`keel list --where 'customer = "c-42"'`). Names
    /// are ASCII identifiers other than the run's own fields (`status`,
    /// `type`, ...); at most [`search::SEARCH_ATTRIBUTES_PER_RUN_MAX`] per
    /// run. All or none are set.
    pub fn upsert_search_attributes<I, N, V>(&self, attributes: I) -> Result<(), Failure>
    where
        I: IntoIterator<Item = (N, V)>,
        N: Into<String>,
        V: Into<SearchValue>,
    {
        let pairs = attributes
            .into_iter()
            .map(|(n, v)| (n.into(), v.into().to_payload()))
            .collect();
        self.search_command(pairs)
    }

    /// Sets one search attribute (see
    /// [`WorkflowContext::upsert_search_attributes`]).
    pub fn upsert_search_attribute(
        &self,
        name: &str,
        value: impl Into<SearchValue>,
    ) -> Result<(), Failure> {
        self.upsert_search_attributes([(name, value)])
    }

    /// Removes search attribute `name`; `list` no longer finds the run by it.
    pub fn remove_search_attribute(&self, name: &str) -> Result<(), Failure> {
        self.search_command(vec![(name.to_string(), Payload::default())])
    }

    /// The run's search attributes, sorted by name.
    pub fn search_attributes(&self) -> Vec<(String, SearchValue)> {
        self.core.borrow().search_attributes.clone()
    }

    fn memo_command(&self, fields: Vec<(String, Payload)>) -> Result<(), Failure> {
        let mut core = self.core.borrow_mut();
        let mut next = core.memo.clone();
        search::upsert_memo(&mut next, &fields).map_err(refused)?;
        if let Issued::Diverged = core.issue(EventKind::MemoUpserted { fields }) {
            return Err(diverged());
        }
        core.memo = next;
        Ok(())
    }

    fn search_command(&self, attributes: Vec<(String, Payload)>) -> Result<(), Failure> {
        let mut core = self.core.borrow_mut();
        let mut next = core.search_attributes.clone();
        search::upsert_attributes(&mut next, &attributes).map_err(refused)?;
        if let Issued::Diverged = core.issue(EventKind::SearchAttributesUpserted { attributes }) {
            return Err(diverged());
        }
        core.search_attributes = next;
        Ok(())
    }
}

fn diverged() -> Failure {
    Failure::new(FailureKind::Application, "history diverged", false)
}
