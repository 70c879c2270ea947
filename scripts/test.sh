#!/usr/bin/env bash
# Every test, on a fresh machine with Rust: installs the system packages the build and the tests
# need when they are missing (scripts/deps.sh; root for apt-get), then runs the test command.
# NCCL and verbs suites (and the emulated-cluster tests without root) skip where their hardware
# is missing: each prints `SKIPPED test: reason`, and the skips are counted at the end — a skip
# is reported as a skip, not as a pass. Then the Python package: its wheel is built (maturin) and
# installed, and its tests run under pytest. Extra arguments go to `cargo test` (e.g. `-p
# ironweave-train`) and leave the Python tests out.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
ironweave_install_deps
skips="$(mktemp -t ironweave-skipped.XXXXXX)"
trap 'rm -f "$skips"' EXIT
status=0
IRONWEAVE_SKIP_LOG="$skips" cargo test --workspace --release --all-features "$@" || status=$?
# The Python package (crates/py): its wheel built and installed, its tests (torchrun jobs on CPU
# ranks, real processes) under pytest. Left out when the arguments pick cargo tests.
if [ $# -eq 0 ]; then
  echo "== Python package: wheel (maturin) and pytest crates/py/tests"
  # an absolute path: maturin runs inside crates/py, where a relative one would point elsewhere
  # (a newcomer's run, with no CARGO_TARGET_DIR, put the wheel in crates/py/target/wheels)
  target="${CARGO_TARGET_DIR:-target}"
  case "$target" in /*) ;; *) target="$PWD/$target" ;; esac
  wheels="$target/wheels"
  rm -f "$wheels"/ironweave-*.whl
  if (cd crates/py && python3 -m maturin build --release --quiet -o "$wheels") \
    && python3 -m pip install --quiet --root-user-action=ignore --force-reinstall --no-deps "$wheels"/ironweave-*.whl; then
    python3 -m pytest -q crates/py/tests || status=1
  else
    echo "the Python package did not build or install" >&2
    status=1
  fi
fi
if [ -s "$skips" ]; then
  echo "== skipped (not run, not passed): $(sort -u "$skips" | wc -l) tests"
  # per reason: how many, the reason (cut at 200 characters) and the first three tests
  sort -u "$skips" | awk -F'\t' '{ n[$2]++; if (n[$2] <= 3) by[$2] = (by[$2] != "" ? by[$2] ", " $1 : $1) }
    END { for (r in n) printf "  %d: %s\n    (%s%s)\n", n[r], substr(r, 1, 200), by[r], (n[r] > 3 ? ", ..." : "") }'
else
  echo "== skipped: none"
fi
exit "$status"
