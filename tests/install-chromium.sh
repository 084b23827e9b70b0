#!/bin/sh
# Install Debian's chromium for the browser tests (tests/test_web_browser.py) and the page benchmark, when
# missing. `make test` and `make bench` run this first. Where it cannot install (not root and no password-less
# sudo, no apt-get, no package registry), it says so and the browser tests skip with the same reason.
set -u
if [ -x /usr/bin/chromium ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
  else
    echo "install-chromium: /usr/bin/chromium is missing and installing it needs root (apt-get install chromium);" \
      "the browser tests will be skipped" >&2
    exit 0
  fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-chromium: no apt-get here; install Chromium as /usr/bin/chromium by hand, or the browser tests" \
    "will be skipped" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
echo "install-chromium: apt-get install chromium (for the browser tests of the web pages)" >&2
if ! $SUDO apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1; then
  $SUDO apt-get update -q >/dev/null 2>&1
  $SUDO apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 \
    || echo "install-chromium: apt-get install chromium failed; the browser tests will be skipped" >&2
fi
exit 0
