//! keel's end-to-end tests and examples. [`seeds`] holds the seed
//! documents' examples as keel workflows, shared by `examples/` and
//! `tests/`.

pub mod import;
pub mod seeds;
pub mod shapes;
