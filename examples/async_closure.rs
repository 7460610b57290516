//! An async closure run as a durable `keel.async` child (the seed's CustomerWorkflow).
#[path = "common.rs"]
mod common;

fn main() -> anyhow::Result<()> {
    common::run::<keel_e2e::seeds::CustomerWorkflow>("customer-1", "c-42".to_string())
}
