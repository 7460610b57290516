//! The core crate's integration tests as one test binary: each file of
//! `tests/` is a module here, with its own goal and method in its first
//! comment.
//!
//! One binary instead of one per file: each test binary links RocksDB
//! statically (about 500 MB), so one per file cost gigabytes of disk and a
//! link each per build. Tests of different files run side by side in one
//! process, as the tests of one file always did.

#[path = "machine.rs"]
mod machine;
#[path = "scope.rs"]
mod scope;
