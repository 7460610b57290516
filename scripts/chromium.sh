# Sourced by .ci/run: headless Chromium for the operator page's browser
# test (tests/browser.rs), installed from the distribution if the machine
# lacks it. With KEEL_REQUIRE_BROWSER=1 that test fails, rather than
# skips, when no browser is found.

# The first browser on PATH the test can drive, or nothing. It must run:
# Ubuntu's chromium-browser package is only a stub that asks for a snap.
keel_chromium_bin() {
  local name
  for name in chromium chromium-browser google-chrome; do
    if command -v "$name" >/dev/null 2>&1 && "$name" --version >/dev/null 2>&1; then
      command -v "$name"
      return 0
    fi
  done
  return 1
}

keel_chromium_install() {
  if keel_chromium_bin >/dev/null; then
    return 0
  fi
  echo "keel: installing Chromium (the operator page is tested in a real browser)" >&2
  local sudo=""
  if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -qq >&2
  # Debian names the package chromium; Ubuntu's chromium-browser is a snap
  # stub, so try the Debian name first.
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >&2 \
    || $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium-browser >&2
  keel_chromium_bin >/dev/null || { echo "keel: Chromium installed but no chromium on PATH" >&2; return 1; }
}
