//! The storage crate's integration tests as one test binary: each file of
//! `tests/` is a module here, with its own goal and method in its first
//! comment.
//!
//! One binary instead of one per file: each test binary links RocksDB
//! statically (about 500 MB), so one per file cost gigabytes of disk and a
//! link each per build. Tests of different files run side by side in one
//! process, as the tests of one file always did.

mod common;

#[path = "codec_props.rs"]
mod codec_props;
#[path = "commit.rs"]
mod commit;
#[path = "crash.rs"]
mod crash;
#[path = "creation.rs"]
mod creation;
#[path = "disk_full.rs"]
mod disk_full;
#[path = "golden.rs"]
mod golden;
#[path = "limits.rs"]
mod limits;
#[path = "list.rs"]
mod list;
#[path = "lost_commits.rs"]
mod lost_commits;
#[path = "postgres.rs"]
mod postgres;
#[path = "rocks_modes.rs"]
mod rocks_modes;
#[path = "verify.rs"]
mod verify;
