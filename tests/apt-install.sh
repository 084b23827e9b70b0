#!/bin/sh
# Install a Debian package that some tests need, when what they use is missing:
#   sh tests/apt-install.sh PACKAGE "WHAT NEEDS IT" COMMAND [COMMAND ...]
# Nothing happens when every COMMAND is there (a name on PATH, or an executable path). Where it cannot
# install (not root and no password-less sudo, no apt-get, no package registry), it says so and exits 0:
# the tests that need the package skip with the same reason.
set -u
package=$1 purpose=$2
shift 2
missing=""
for cmd in "$@"; do
  command -v "$cmd" >/dev/null 2>&1 || missing="$missing $cmd"
done
[ -z "$missing" ] && exit 0
say() { echo "apt-install $package:$missing missing; $*" >&2; }
SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
  else
    say "installing it needs root (apt-get install $package); $purpose will be skipped"
    exit 0
  fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
  say "no apt-get here; install it by hand, or $purpose will be skipped"
  exit 0
fi
# Where an init system runs, a package may start its service (prometheus on :9090): keep it from doing so.
created_policy=""
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null && $SUDO chmod 755 /usr/sbin/policy-rc.d \
    && created_policy=1
fi
export DEBIAN_FRONTEND=noninteractive
say "apt-get install $package (for $purpose)"
if ! $SUDO apt-get install -y -q --no-install-recommends "$package" >/dev/null 2>&1; then
  $SUDO apt-get update -q >/dev/null 2>&1
  $SUDO apt-get install -y -q --no-install-recommends "$package" >/dev/null 2>&1 \
    || say "apt-get install $package failed; $purpose will be skipped"
fi
if [ -n "$created_policy" ]; then
  $SUDO rm -f /usr/sbin/policy-rc.d
fi
exit 0
