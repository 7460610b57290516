//! The seed's ResolveInRealTime: a select over a resolver activity, a manual
//! signal and a 2-second deadline. `--timeout` makes the resolver slow so
//! the deadline wins; without it the resolver wins.
#[path = "common.rs"]
mod common;

fn main() -> anyhow::Result<()> {
    let timeout = std::env::args().any(|a| a == "--timeout");
    let request = if timeout {
        "slow-request"
    } else {
        "fast-request"
    };
    common::run::<keel_e2e::seeds::ResolveInRealTime>("resolve-1", request.to_string())
}
