#!/usr/bin/env bash
# Install the servers the object-store tests start on 127.0.0.1 (idempotent, safe to re-run).
#
#   nginx  - serves http(s):// datasets (honours Range); Debian package nginx-light or nginx.
#   moto   - the S3 server; a Python package, installed with the dev extra (pip install -e .[dev]).
#   chromium - headless, for the docs site's screenshots (tests/docs/test_site.py); Debian's
#            package chromium.
#
# Azure (az://) is not tested against a server: azurite (npm) is not installed, and the tests
# skip that part cleanly and say so.
set -euo pipefail

have_nginx() {
    command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]
}

have_chromium() {
    [ -x /usr/bin/chromium ]
}

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
updated=0
apt_update() {
    if [ "$updated" -eq 0 ]; then
        $SUDO apt-get update -qq
        updated=1
    fi
}

if ! have_nginx; then
    apt_update
    $SUDO apt-get install -y -qq --no-install-recommends nginx-light \
        || $SUDO apt-get install -y -qq --no-install-recommends nginx
    # The tests start their own nginx on a free port; the distribution's service is not needed.
    if command -v service >/dev/null 2>&1; then
        $SUDO service nginx stop >/dev/null 2>&1 || true
    fi
fi

if ! have_chromium; then
    apt_update
    $SUDO apt-get install -y -qq --no-install-recommends chromium
fi

have_nginx || { echo "install-servers: nginx could not be installed" >&2; exit 1; }
have_chromium || { echo "install-servers: chromium could not be installed" >&2; exit 1; }
echo "install-servers: nginx $( (nginx -v 2>&1 || /usr/sbin/nginx -v 2>&1) | sed 's/.*\///')"
echo "install-servers: $(/usr/bin/chromium --version 2>/dev/null | head -n 1)"
