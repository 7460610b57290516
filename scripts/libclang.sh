# Sourced by scripts/env.sh (and by the test of this detection): decides
# whether RocksDB's bindings can find libclang, the way the build looks for
# it. bindgen loads libclang through clang-sys, which accepts only files
# named libclang.so, libclang.so.N, libclang-N.so or libclang-N.so.N;
# `libclang-cpp.so.N` (the C++ API, which Debian installs with other LLVM
# packages) is a different library and does not count. bindgen also needs
# clang's builtin headers (stddef.h), which come with libclang-dev.
#
# keel_libclang_found ROOT: exit 0 when ROOT (/ on a real machine) has both.
keel_libclang_found() {
  local root="${1:-/}" dir lib header found_lib="" found_header=""
  shopt -s nullglob
  local dirs=()
  if [ -n "${LIBCLANG_PATH:-}" ] && [ "$root" = / ]; then
    dirs+=("$LIBCLANG_PATH")
  fi
  dirs+=("$root"/usr/lib/llvm-*/lib "$root"/usr/lib/*-linux-gnu "$root"/usr/lib "$root"/usr/local/lib)
  for dir in "${dirs[@]}"; do
    for lib in "$dir"/libclang.so "$dir"/libclang.so.[0-9]* "$dir"/libclang-[0-9]*.so "$dir"/libclang-[0-9]*.so.[0-9]*; do
      [ -e "$lib" ] && found_lib="$lib" && break 2
    done
  done
  for header in "$root"/usr/lib/llvm-*/lib/clang/*/include/stddef.h "$root"/usr/lib/clang/*/include/stddef.h "$root"/usr/local/lib/clang/*/include/stddef.h; do
    [ -e "$header" ] && found_header="$header" && break
  done
  shopt -u nullglob
  [ -n "$found_lib" ] && [ -n "$found_header" ]
}
