# Sourced by .ci/run: keeps the shared target directory from filling the
# disk. A checkout at a new path (a clean CI clone) gives each package a
# new hash, so cargo writes a new executable per test and example target
# (about 30, each 300-560 MB with RocksDB linked in: about 11 GB in all)
# and new incremental caches (about 7 GB), and never removes the old ones. Libraries (.rlib,
# RocksDB's build) are never touched here, so nothing makes a build compile
# RocksDB again: a checkout whose tests were removed only builds them again.

# Free space (GiB) the test build needs on the target directory's disk.
KEEL_TEST_BUILD_SPACE_GIB=25

# Test and example executables (the files cargo marks executable that are
# not libraries) and incremental caches, untouched for an hour: a cargo
# running beside this one may be using a recent one.
keel_prune_candidates() {
  local release="$1"
  find "$release/deps" "$release/examples" -maxdepth 1 -type f -perm -u+x -mmin +60 \
    ! -name '*.so' ! -name '*.rlib' ! -name '*.rmeta' ! -name '*.d' -name '*-*' 2>/dev/null || true
  find "$release/incremental" -mindepth 1 -maxdepth 1 -type d -mmin +60 2>/dev/null || true
}

# Removes the candidates not named in "$2" (one path per line).
keel_prune_except() {
  local release="$1" keep="$2" path kb freed_kb=0 n=0
  while IFS= read -r path; do
    [ -n "$path" ] || continue
    grep -qxF "$path" <<<"$keep" && continue
    # A file another cargo removed meanwhile counts as nothing freed.
    kb=$(du -sk "$path" 2>/dev/null | cut -f1 || true)
    rm -rf "$path" "$path.d"
    freed_kb=$((freed_kb + ${kb:-0}))
    n=$((n + 1))
  done < <(keel_prune_candidates "$release")
  echo "keel: pruned $n old test executables and incremental caches ($((freed_kb / 1024)) MiB) from $CARGO_TARGET_DIR" >&2
}

# Before the build: when the disk cannot hold another set of test
# executables, removes every old one (other checkouts build theirs again).
keel_prune_for_build() {
  local release="${CARGO_TARGET_DIR:?}/release" free_gib
  [ -d "$release" ] || return 0
  free_gib=$(keel_free_gib "$release")
  if [ "${free_gib:-0}" -lt "$KEEL_TEST_BUILD_SPACE_GIB" ]; then
    echo "keel: ${free_gib} GiB free, the test build needs about ${KEEL_TEST_BUILD_SPACE_GIB}" >&2
    keel_prune_except "$release" ""
    free_gib=$(keel_free_gib "$release")
    if [ "${free_gib:-0}" -lt "$KEEL_TEST_BUILD_SPACE_GIB" ]; then
      # Said now, so that a linker killed later by a full disk (SIGBUS)
      # has an explanation above it.
      echo "keel: warning: still only ${free_gib} GiB free in $CARGO_TARGET_DIR; the build may fill the disk (files younger than an hour were kept: another cargo may be using them)" >&2
    fi
  fi
}

# Free GiB on the disk that holds "$1".
keel_free_gib() {
  df -P -BG "$1" | awk 'NR == 2 { sub("G", "", $4); print $4 }'
}

# After the tests: removes the old executables that are not this
# checkout's current ones.
keel_prune_target() {
  local release="${CARGO_TARGET_DIR:?}/release" current
  [ -d "$release" ] || return 0
  current=$(cargo test --release --workspace --no-run --message-format=json 2>/dev/null |
    grep -o '"executable":"[^"]*"' | cut -d'"' -f4 | sort -u || true)
  keel_prune_except "$release" "$current"
}
