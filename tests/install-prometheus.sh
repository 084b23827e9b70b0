#!/bin/sh
# Install Debian's prometheus package (the prometheus server and promtool) for the tests, when missing.
# `make test` runs this first. Where it cannot install (not root and no password-less sudo, no apt-get, no
# package registry), it says so and the Prometheus tests skip with the same reason.
set -u
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
  else
    echo "install-prometheus: prometheus is missing and installing it needs root (apt-get install prometheus);" \
      "the Prometheus tests will be skipped" >&2
    exit 0
  fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-prometheus: no apt-get here; install prometheus and promtool by hand, or the Prometheus" \
    "tests will be skipped" >&2
  exit 0
fi
# Where an init system runs, the package would start a Prometheus server on :9090: keep it from doing so.
created_policy=""
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null && $SUDO chmod 755 /usr/sbin/policy-rc.d \
    && created_policy=1
fi
export DEBIAN_FRONTEND=noninteractive
echo "install-prometheus: apt-get install prometheus (for promtool and the end-to-end tests)" >&2
if ! $SUDO apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1; then
  $SUDO apt-get update -q >/dev/null 2>&1
  $SUDO apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 \
    || echo "install-prometheus: apt-get install prometheus failed; the Prometheus tests will be skipped" >&2
fi
if [ -n "$created_policy" ]; then
  $SUDO rm -f /usr/sbin/policy-rc.d
fi
exit 0
