#!/usr/bin/env bash
# make arm64-check's KV-across-kernels step (tools/kernel_check.py), called by tools/arm64/run.sh:
#
#   tools/arm64/cross_kernels.sh ROOT NATIVE_LIB_DIR
#
# The host's portable x86_64 build (AVX2, the .venv's wheel) writes SmolLM2 KV for
# $ARM64_KERNEL_PROMPTS workload prompts (default 1: about 350 tokens, some 8 minutes a reader
# under emulation) into a local store and, when $ARM64_REDIS_URL is set, into a store behind that remote
# tier. Two other kernel sets read it, each from a copy of the local store and from a new local
# store behind the same remote tier: aarch64 under emulation (NEON, fp16, dotprod) and this
# machine's GGML_NATIVE build (NATIVE_LIB_DIR, loaded through LLAMA_CPP_LIB_PATH; AVX-512 where
# the CPU has it). Each read must answer as its own uncached run and may hit exactly only KV
# whose bits equal its own. JSON in $XFER/results/kernels-*.json; exit status 1 when one fails.
set -euo pipefail

die() { echo "arm64-check: $*" >&2; exit 1; }
[ $# -eq 2 ] || die "usage: $0 ROOT NATIVE_LIB_DIR"
ROOT=$(realpath "$1")
NATIVE=$(realpath "$2")
HERE=$(cd "$(dirname "$0")" && pwd)
CHECKOUT=$(cd "$HERE/../.." && pwd)
: "${XFER:?set by tools/arm64/run.sh}" "${HOST_PY:?set by tools/arm64/run.sh}"
RESULTS=$XFER/results
WORK=$XFER/kernels
rm -rf "$WORK" && mkdir -p "$WORK" "$RESULTS"
"$HOST_PY" -c 'from edgesync_bench.workloads import workloads_dir; print(workloads_dir() / "system_prompts.json")' \
    | xargs -I{} cp {} "$WORK/system_prompts.json"
PREFIX=arm64-check-$$
remote=()
[ -n "${ARM64_REDIS_URL:-}" ] && remote=(--remote-url "$ARM64_REDIS_URL" --prefix "$PREFIX")

host() { (cd "$CHECKOUT" && "$HOST_PY" tools/kernel_check.py "$@"); }
native() { (cd "$CHECKOUT" && LLAMA_CPP_LIB_PATH=$NATIVE "$HOST_PY" tools/kernel_check.py "$@"); }
arm64() {
    "$HERE/chroot.sh" "$ROOT" /bin/sh -c 'cd /src/edgesync && exec python tools/kernel_check.py "$@"' sh "$@"
}

status=0
# check NAME RUNNER DIR(as the runner sees $WORK) ARGS...
check() {
    local name=$1 runner=$2 dir=$3
    shift 3
    echo "arm64-check: kernels: $name"
    if ! "$runner" read --prompts "$dir/system_prompts.json" --out "$dir/$name.json" "$@" > "$WORK/$name.log" 2>&1; then
        echo "arm64-check: kernels: $name FAILED (log: $WORK/$name.log)" >&2
        status=1
    fi
    [ -f "$WORK/$name.json" ] && cp "$WORK/$name.json" "$RESULTS/kernels-$name.json"
    return 0
}

echo "arm64-check: kernels: x86_64 AVX2 writes"
N=${ARM64_KERNEL_PROMPTS:-1}
host write --n "$N" --prompts "$WORK/system_prompts.json" --store "$WORK/x86" --out "$WORK/x86-writer.json" > "$WORK/x86-writer.log" 2>&1 \
    || die "the x86_64 writer failed (log: $WORK/x86-writer.log)"
if [ ${#remote[@]} -gt 0 ]; then
    host write --n "$N" --prompts "$WORK/system_prompts.json" --store "$WORK/x86-remote" "${remote[@]}" \
        --out "$WORK/x86-remote-writer.json" > "$WORK/x86-remote-writer.log" 2>&1 \
        || die "the x86_64 writer to the remote tier failed (log: $WORK/x86-remote-writer.log)"
fi
cp "$WORK/x86-writer.json" "$RESULTS/kernels-x86-writer.json"

for reader in arm64 native; do
    case $reader in arm64) dir=/xfer/kernels ;; *) dir=$WORK ;; esac
    cp -a "$WORK/x86" "$WORK/$reader-direct-store"
    check "$reader-direct" "$reader" "$dir" --store "$dir/$reader-direct-store" --writer "$dir/x86-writer.json"
    if [ ${#remote[@]} -gt 0 ]; then
        check "$reader-remote" "$reader" "$dir" --store "$dir/$reader-remote-store" "${remote[@]}" \
            --writer "$dir/x86-remote-writer.json"
    fi
done
exit $status
