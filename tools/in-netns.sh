#!/usr/bin/env bash
# Run a command in a network namespace of its own, loopback only, so that every server a test
# starts is reachable from this machine alone: mooncake_master binds one of its ports on every
# interface whatever its flags say, and sglang's TP test runs gloo between two processes.
# Mooncake's transfer engine refuses to start without a non-loopback address ("not valid LAN
# address found"), so the namespace also gets a veth pair of its own holding 192.0.2.1
# (TEST-NET-1, RFC 5737: never routed anywhere); it has no route out of the namespace.
# As root: `unshare --net`; elsewhere an unprivileged user namespace where the kernel allows one.
# Where neither can be made the command fails under CI, and elsewhere runs as it is (a warning).
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: tools/in-netns.sh COMMAND [ARG...]" >&2; exit 2; }
if ! command -v ip >/dev/null 2>&1; then
    bash "$(dirname "$0")/apt-install.sh" iproute2 || true
fi
setup='ip link set lo up && ip link add kvstage0 type veth peer name kvstage1 && ip addr add 192.0.2.1/24 dev kvstage0 && ip link set kvstage0 up && ip link set kvstage1 up'
for flags in "--net" "--user --map-root-user --net"; do
    # shellcheck disable=SC2086
    if command -v ip >/dev/null 2>&1 && unshare $flags sh -c "$setup" 2>/dev/null; then
        # shellcheck disable=SC2086
        exec unshare $flags -- sh -c "$setup"' && exec "$@"' in-netns "$@"
    fi
done
if [ -n "${CI:-}" ]; then
    echo "in-netns: cannot make a network namespace (unshare --net, or iproute2's ip missing); CI runs its servers only inside one" >&2
    exit 1
fi
echo "in-netns: no network namespace here (unshare --net refused); running with the host's network" >&2
exec "$@"
