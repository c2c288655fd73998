#!/usr/bin/env bash
# make arm64-check's last step, on the host: the checks under emulation in the arm64 root.
#
#   tools/arm64/run.sh ROOT [worktree|head]
#
# Copies the source into ROOT (tools/arm64/sync_source.sh), starts a throw-away redis-server on
# the host's loopback when the host has one (the root shares the host's network: its Python
# reaches it at 127.0.0.1), runs tools/arm64/checks.py in the root (tools/arm64/chroot.sh), then
# the hook below. Results: ROOT/xfer/results (/xfer/results in the root). Exit status 1 when a
# check failed.
set -euo pipefail

die() { echo "arm64-check: $*" >&2; exit 1; }
[ $# -ge 1 ] || die "usage: $0 ROOT [worktree|head]"
ROOT=$(realpath "$1")
MODE=${2:-worktree}
HERE=$(cd "$(dirname "$0")" && pwd)
CHECKOUT=$(cd "$HERE/../.." && pwd)
XFER=$ROOT/xfer                       # /xfer in the root: results and stores both sides can read
HOST_PY=$CHECKOUT/.venv/bin/python    # the host's (x86_64) venv, for host-side steps of the hook
export XFER HOST_PY

in_arm64() {  # in_arm64 COMMAND [ARGS...]: run in the root under emulation, cwd /src/edgesync
    "$HERE/chroot.sh" "$ROOT" /bin/sh -c 'cd /src/edgesync && exec "$@"' sh "$@"
}

redis_pid=
stop_redis() {
    if [ -n "$redis_pid" ]; then
        kill "$redis_pid" 2>/dev/null || true
        wait "$redis_pid" 2>/dev/null || true
    fi
}
trap stop_redis EXIT

"$HERE/sync_source.sh" "$ROOT" "$MODE"
mkdir -p "$XFER"
rm -rf "$XFER/results"

if command -v redis-server >/dev/null; then
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    redis-server --bind 127.0.0.1 --port "$port" --save '' --appendonly no --daemonize no \
        --loglevel warning > "$XFER/redis-server.log" 2>&1 &
    redis_pid=$!
    for _ in $(seq 50); do
        redis-cli -p "$port" ping >/dev/null 2>&1 && break
        sleep 0.1
    done
    export ARM64_REDIS_URL=redis://127.0.0.1:$port/0
    echo "arm64-check: redis-server (pid $redis_pid) on the host at $ARM64_REDIS_URL"
else
    echo "arm64-check: no redis-server on the host (make redis-server installs it): the redis step is skipped"
fi

status=0
in_arm64 /opt/edgesync/venv/bin/python tools/arm64/checks.py --results /xfer/results ${ARM64_CHECKS:+--only "$ARM64_CHECKS"} \
    || status=$?

# KV across kernel sets (tools/arm64/cross_kernels.sh): the host's AVX2 build writes, aarch64 and
# the host's GGML_NATIVE build ($ARM64_NATIVE_LIB, `make arm64-check` builds it) read, directly
# and through $ARM64_REDIS_URL. ARM64_KERNELS=0 skips it.
if [ -n "${ARM64_NATIVE_LIB:-}" ] && [ "${ARM64_KERNELS:-1}" != 0 ]; then
    "$HERE/cross_kernels.sh" "$ROOT" "$ARM64_NATIVE_LIB" || status=1
fi

exit $status
