#!/bin/sh
# Installs Debian's chromium for the browser tests (tests/e2e/test_webui.py,
# marker `browser`). Playwright drives it with executable_path=/usr/bin/chromium:
# `playwright install` downloads browser builds, which our machines cannot fetch.
#
# Where it cannot install (not root, no apt-get) it says so and exits 0: the
# browser tests then skip with the reason. Where it can and the install fails,
# it exits 1, so CI never passes with the browser tests silently skipped.
# Set ROUNDHOUSE_SKIP_BROWSER_INSTALL=1 to leave the machine alone.
set -u

say() {
    echo "************************************************************************" >&2
    echo "* $1" >&2
    echo "* The browser tests (marker 'browser') will be skipped." >&2
    echo "************************************************************************" >&2
}

if command -v chromium >/dev/null 2>&1; then
    exit 0
fi
if [ -n "${ROUNDHOUSE_SKIP_BROWSER_INSTALL:-}" ]; then
    say "chromium is not installed and ROUNDHOUSE_SKIP_BROWSER_INSTALL is set."
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    say "chromium is not installed and there is no apt-get to install it with."
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    say "chromium is not installed; run 'sudo apt-get install chromium' to enable them."
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
install() {
    apt-get install -y -q --no-install-recommends chromium >/dev/null
}
echo "installing chromium (Debian package) for the browser tests" >&2
# A fresh machine may have no package lists yet, or stale ones.
if ! install 2>/dev/null; then
    apt-get update -q >/dev/null && install
fi
if ! command -v chromium >/dev/null 2>&1; then
    echo "error: apt-get could not install chromium for the browser tests" >&2
    exit 1
fi
