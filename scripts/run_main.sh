#!/usr/bin/env bash
# The main job on a fresh machine: installs dependencies, builds, starts hostd on the built-in
# tiny model (MODEL=dir-or-config.json for another), shows its state with slidedpctl and stops
# hostd cleanly. (Training through rank processes joins here once rankclient lands.)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
scripts/build.sh
B=${BUILD_DIR:-build}
RUN=$(mktemp -d)
SOCK="$RUN/hostd.sock"
INSTANCE="main$$"
"$B/hostd/hostd" --model "${MODEL:-tiny}" --socket "$SOCK" --instance "$INSTANCE" --mlock best_effort &
HOSTD=$!
trap 'kill $HOSTD 2>/dev/null; wait $HOSTD 2>/dev/null; rm -rf "$RUN"' EXIT
for _ in $(seq 100); do [ -S "$SOCK" ] && break; sleep 0.1; done
"$B/slidedpctl/slidedpctl" --socket "$SOCK" version
"$B/slidedpctl/slidedpctl" --socket "$SOCK" status
"$B/slidedpctl/slidedpctl" --socket "$SOCK" layers
"$B/slidedpctl/slidedpctl" --socket "$SOCK" stats
kill -TERM $HOSTD
wait $HOSTD
trap 'rm -rf "$RUN"' EXIT
echo "hostd stopped cleanly; leftover segments: $(ls /dev/shm | grep -c "slidedp.$INSTANCE" || true)"
