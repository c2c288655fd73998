#!/usr/bin/env bash
# Copy the project's source into the arm64 root, fresh at every run (a second of work):
#
#   tools/arm64/sync_source.sh ROOT [worktree|head]
#
# worktree (the default, like `make test`): the checkout's files as they are now, the tracked
# ones and the untracked ones git does not ignore (no build/, .venv, caches); head: the last
# commit only (git archive HEAD). Into ROOT/src/edgesync, which the root's venv has installed in
# editable mode, with the workload data beside it in ROOT/src/shared/workloads (from
# EDGESYNC_WORKLOADS, default ../shared/workloads beside the checkout, as the tests expect).
set -euo pipefail

die() { echo "arm64-check: $*" >&2; exit 1; }
[ $# -ge 1 ] || die "usage: $0 ROOT [worktree|head]"
ROOT=$(realpath "$1")
MODE=${2:-worktree}
CHECKOUT=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
DEST=$ROOT/src/edgesync
NEW=$DEST.new

rm -rf "$NEW"
mkdir -p "$NEW"
case $MODE in
    head)
        git -C "$CHECKOUT" archive --format=tar HEAD | tar -x -C "$NEW"
        ;;
    worktree)
        (cd "$CHECKOUT" && git ls-files -z --cached --others --exclude-standard \
            | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
            | tar --null --no-recursion -T - -cf -) | tar -x -C "$NEW"
        ;;
    *) die "source mode: worktree or head, not '$MODE'" ;;
esac
{
    echo "mode=$MODE"
    echo "commit=$(git -C "$CHECKOUT" rev-parse HEAD)"
    if [ "$MODE" = worktree ] && [ -n "$(git -C "$CHECKOUT" status --porcelain --untracked-files=normal)" ]; then
        echo "worktree=modified"
    fi
} > "$NEW/.arm64-source"
rm -rf "$DEST"
mv "$NEW" "$DEST"

WORKLOADS=${EDGESYNC_WORKLOADS:-$CHECKOUT/../shared/workloads}
if [ -d "$WORKLOADS" ]; then
    rm -rf "$ROOT/src/shared/workloads"
    mkdir -p "$ROOT/src/shared"
    cp -a "$WORKLOADS" "$ROOT/src/shared/workloads"
else
    echo "arm64-check: no workload data at $WORKLOADS (tests that need it will say so)" >&2
fi
echo "arm64-check: source ($MODE, $(git -C "$CHECKOUT" rev-parse --short HEAD)) in $DEST"
