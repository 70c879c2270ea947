#!/usr/bin/env bash
# Runs every cargo-fuzz target (fuzz/) with the limits docs/RELIABILITY.md reports: each until
# RUNS executions or SECONDS seconds, whichever comes first, with libFuzzer's memory limits
# (a process over -rss_limit_mb, or one allocation over -malloc_limit_mb, is a finding).
# New inputs go to target/fuzz-work/<target>/ (the checked-in corpus fuzz/corpus/<target>/ seeds
# it and stays small), minimised to the edges covered afterwards; a crash leaves its input in
# fuzz/artifacts/<target>/ and fails the script. Prints one table row per target: executions,
# seconds, edges covered, peak RSS (MB), inputs kept.
# Needs cargo-fuzz (`cargo install cargo-fuzz`); the stable toolchain works with RUSTC_BOOTSTRAP=1.
#
#   bash scripts/fuzz.sh                      # every target, 10 M executions or 15 minutes each
#   RUNS=1000000 SECONDS_EACH=60 bash scripts/fuzz.sh ckpt_wire
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS="${RUNS:-10000000}"
SECONDS_EACH="${SECONDS_EACH:-900}"
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(frame_decoder ckpt_wire ckpt_files configs plans rdata orthonets)
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "error: cargo-fuzz is missing: cargo install cargo-fuzz" >&2
  exit 1
fi
export RUSTC_BOOTSTRAP=1
cd fuzz
cargo fuzz build -O
for t in "${targets[@]}"; do
  work="../target/fuzz-work/$t"
  mkdir -p "$work"
  log="../target/fuzz-work/$t.log"
  start=$(date +%s)
  cargo fuzz run -O "$t" "$work" "corpus/$t" -- \
    -runs="$RUNS" -max_total_time="$SECONDS_EACH" -rss_limit_mb=2048 -malloc_limit_mb=64 \
    -timeout=10 -print_final_stats=1 >"$log" 2>&1 || { echo "$t: FINDING (see $log and fuzz/artifacts/$t/)"; tail -30 "$log"; exit 1; }
  secs=$(( $(date +%s) - start ))
  # keep the inputs that cover every edge the run reached (counters off: edges only), so the
  # set can be checked in small: cp target/fuzz-work/$t/* fuzz/corpus/$t/
  cargo fuzz cmin -O "$t" "$work" -- -use_counters=0 >"$log.cmin" 2>&1
  # libFuzzer's log may hold raw input bytes: read it as text (-a)
  execs=$(grep -ao 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1 || true)
  peak=$(grep -ao 'stat::peak_rss_mb: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1 || true)
  cov=$(grep -ao '[0-9]* new coverage edges' "$log.cmin" | tail -1 | grep -o '^[0-9]*' || true)
  echo "| $t | ${execs:-?} | $secs | ${cov:-?} | ${peak:-?} | $(ls "$work" | wc -l) |"
done
