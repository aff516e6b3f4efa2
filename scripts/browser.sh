#!/bin/sh
# Headless Chromium for the dashboard's browser tests (tests/entrypoints/test_dashboard.py): Debian's package,
# installed when missing and apt-get can (as root); elsewhere those tests skip and say why.
command -v chromium >/dev/null 2>&1 && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get install -y -qq chromium >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)) \
        && exit 0
fi
echo "scripts/browser.sh: chromium not installed (Debian: apt-get install chromium); the browser tests will skip" >&2
exit 0
