//! Goal: the quick start's install steps decide what is present the way
//! RocksDB's build decides it, so a fresh machine gets libclang-dev
//! installed and a machine that has it is left alone; and the PostgreSQL
//! server the tests need is found only where it is whole (not where only
//! its client is).
//!
//! Method: build fake filesystem roots in a temporary directory, holding
//! the files a Debian machine would have in each situation, and run the
//! real `keel_libclang_found` function from `scripts/libclang.sh` against
//! each root. The case that broke the last quick start is the first one: a
//! machine with only `libclang-cpp.so.N` (installed with other LLVM
//! packages) and no `libclang.so.N` must count as missing.

use std::fs;
use std::path::Path;
use std::process::Command;

fn touch(root: &Path, rel: &str) {
    let path = root.join(rel);
    fs::create_dir_all(path.parent().expect("a file has a parent")).expect("mkdir");
    fs::write(&path, b"").expect("write");
}

/// Runs the detection on `root`; true when it reports libclang usable.
fn found(root: &Path) -> bool {
    let script = manifest_dir().join("scripts/libclang.sh");
    let status = Command::new("bash")
        .arg("-c")
        .arg(r#"source "$1"; keel_libclang_found "$2""#)
        .arg("bash")
        .arg(&script)
        .arg(root)
        // The real machine's override must not leak into the fake roots.
        .env_remove("LIBCLANG_PATH")
        .status()
        .expect("bash runs");
    status.success()
}

const HEADER: &str = "usr/lib/llvm-14/lib/clang/14.0.6/include/stddef.h";

#[test]
fn only_libclang_cpp_counts_as_missing() {
    let root = tempfile::tempdir().unwrap();
    touch(root.path(), "usr/lib/x86_64-linux-gnu/libclang-cpp.so.14");
    touch(root.path(), "usr/lib/llvm-14/lib/libclang-cpp.so.14");
    touch(root.path(), HEADER);
    assert!(!found(root.path()), "libclang-cpp is not libclang");
}

#[test]
fn an_empty_machine_counts_as_missing() {
    let root = tempfile::tempdir().unwrap();
    assert!(!found(root.path()));
}

#[test]
fn the_library_without_clang_headers_counts_as_missing() {
    // libclang1 alone (no libclang-dev): bindgen would fail on stddef.h.
    let root = tempfile::tempdir().unwrap();
    touch(root.path(), "usr/lib/llvm-14/lib/libclang.so.1");
    assert!(!found(root.path()));
}

#[test]
fn libclang_dev_as_debian_installs_it_is_found() {
    let root = tempfile::tempdir().unwrap();
    touch(root.path(), "usr/lib/llvm-14/lib/libclang-14.so.1");
    touch(root.path(), "usr/lib/llvm-14/lib/libclang.so.1");
    touch(root.path(), "usr/lib/llvm-14/lib/libclang-cpp.so.14");
    touch(root.path(), HEADER);
    assert!(found(root.path()));
}

#[test]
fn every_name_clang_sys_accepts_is_found() {
    for name in [
        "usr/lib/x86_64-linux-gnu/libclang.so",
        "usr/lib/x86_64-linux-gnu/libclang-15.so",
        "usr/local/lib/libclang.so.13",
        "usr/lib/libclang-16.so.16",
    ] {
        let root = tempfile::tempdir().unwrap();
        touch(root.path(), name);
        touch(root.path(), HEADER);
        assert!(found(root.path()), "{name} should count as libclang");
    }
}

/// The package directory at run time. `cargo test` sets it for every test
/// binary; the compile-time `env!` would name whichever clone compiled the
/// binary, and clones sharing one target directory reuse each other's
/// binaries when their sources match.
fn manifest_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

/// Runs the PostgreSQL server detection of `scripts/postgres.sh` on
/// `root`; the bin directory it picked, if any.
fn postgres_bindir(root: &Path) -> Option<String> {
    let script = manifest_dir().join("scripts/postgres.sh");
    let out = Command::new("bash")
        .arg("-c")
        .arg(r#"source "$1"; keel_pg_bindir "$2""#)
        .arg("bash")
        .arg(&script)
        .arg(root)
        .output()
        .expect("bash runs");
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// An executable file at `rel` under `root`.
fn program(root: &Path, rel: &str) {
    use std::os::unix::fs::PermissionsExt;
    touch(root, rel);
    fs::set_permissions(root.join(rel), fs::Permissions::from_mode(0o755)).expect("chmod");
}

#[test]
fn only_the_postgres_client_counts_as_a_missing_server() {
    // Goal: the test script installs PostgreSQL where only psql is (the
    // client package puts it in the server's bin directory), and picks the
    // newest complete server where there are several.
    let root = tempfile::tempdir().unwrap();
    assert_eq!(postgres_bindir(root.path()), None, "an empty machine");
    program(root.path(), "usr/lib/postgresql/15/bin/psql");
    assert_eq!(postgres_bindir(root.path()), None, "psql is not a server");
    for tool in ["initdb", "pg_ctl", "postgres"] {
        program(root.path(), &format!("usr/lib/postgresql/15/bin/{tool}"));
    }
    program(root.path(), "usr/lib/postgresql/16/bin/psql");
    let found = postgres_bindir(root.path()).expect("a complete server");
    assert!(found.ends_with("/usr/lib/postgresql/15/bin"), "{found}");
    for tool in ["initdb", "pg_ctl", "postgres"] {
        program(root.path(), &format!("usr/lib/postgresql/16/bin/{tool}"));
    }
    let found = postgres_bindir(root.path()).expect("the newest server");
    assert!(found.ends_with("/usr/lib/postgresql/16/bin"), "{found}");
}
