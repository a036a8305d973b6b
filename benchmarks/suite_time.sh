#!/usr/bin/env bash
# How long `make test` takes as CI runs it (.ci/run): a fresh clone, the venv and the install included, with uv's
# cache empty (a cache of this run's own), one revision after another. Shared machines change speed from hour to
# hour, so each run prints a reference taken just before and after it: the seconds a fixed Python loop takes.
#
# Usage: bash benchmarks/suite_time.sh [REVISION ...]      (default: HEAD)
set -euo pipefail
repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
reference() {
  python3 -c 'import time; t = time.perf_counter(); sum(i * i for i in range(3 * 10**7)); print(f"{time.perf_counter() - t:.2f}")'
}
for rev in "${@:-HEAD}"; do
  work=$(mktemp -d)
  git clone -q "$repo" "$work/clone"
  git -C "$work/clone" checkout -q "$rev"
  before=$(reference)
  start=$(date +%s)
  if (cd "$work/clone" && UV_CACHE_DIR="$work/uv-cache" .ci/run >"$work/log.txt" 2>&1); then status=passed; else status=failed; fi
  seconds=$(($(date +%s) - start))
  after=$(reference)
  summary=$(grep -E "[0-9]+ (passed|failed)" "$work/log.txt" | tail -1 || true)
  echo "$(date -u +%F) $rev ($(git -C "$work/clone" rev-parse --short HEAD)): .ci/run $status in ${seconds} s;" \
    "speed reference ${before} s before, ${after} s after; ${summary}"
  [ "$status" = passed ] && rm -rf "$work" || echo "  log: $work/log.txt"
done
