# Sourced by scripts/keel and .ci/run: installs what a fresh machine lacks
# and points cargo at the shared target directory outside the clone, so
# RocksDB's C++ compiles once per machine and every run reuses it.
set -euo pipefail

if ! command -v cargo >/dev/null 2>&1; then
  echo "keel: cargo is not installed (install Rust with rustup first)" >&2
  exit 2
fi
source "$(dirname "${BASH_SOURCE[0]}")/libclang.sh"
if ! keel_libclang_found /; then
  echo "keel: installing libclang-dev (needed to build RocksDB's bindings)" >&2
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libclang-dev >&2
  else
    sudo apt-get update -qq >&2
    sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libclang-dev >&2
  fi
fi
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/keel-target}"
mkdir -p "$CARGO_TARGET_DIR"
