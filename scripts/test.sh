#!/usr/bin/env bash
# Every test, on a fresh machine with Rust: installs the system packages the build and the tests
# need when they are missing (scripts/deps.sh; root for apt-get), then runs the test command.
# NCCL and verbs suites (and the emulated-cluster tests without root) skip where their hardware
# is missing: each prints `SKIPPED test: reason`, and the skips are counted at the end — a skip
# is reported as a skip, not as a pass. Extra arguments go to `cargo test` (e.g. `-p ironweave-train`).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
ironweave_install_deps
skips="$(mktemp -t ironweave-skipped.XXXXXX)"
trap 'rm -f "$skips"' EXIT
status=0
IRONWEAVE_SKIP_LOG="$skips" cargo test --workspace --release --all-features "$@" || status=$?
if [ -s "$skips" ]; then
  echo "== skipped (not run, not passed): $(sort -u "$skips" | wc -l) tests"
  # per reason: how many, the reason (cut at 200 characters) and the first three tests
  sort -u "$skips" | awk -F'\t' '{ n[$2]++; if (n[$2] <= 3) by[$2] = (by[$2] != "" ? by[$2] ", " $1 : $1) }
    END { for (r in n) printf "  %d: %s\n    (%s%s)\n", n[r], substr(r, 1, 200), by[r], (n[r] > 3 ? ", ..." : "") }'
else
  echo "== skipped: none"
fi
exit "$status"
