#!/usr/bin/env bash
# The air-quality forecaster on a fresh machine: installs what the build needs and the AirBase
# data (Debian's r-cran-spacetime) when missing, builds `ironweave` and `airq`, then trains the
# domain-adversarial network (strategy 1, all source states, target Niedersachsen) on 4 local
# ranks through `ironweave launch` with a Capricorn checkpoint every iteration; rank 0 scores
# it against persistence and writes target/airq/report.html. Extra arguments go to `airq train`
# (e.g. --method grl-per-source --sources 4).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
IRONWEAVE_DEPS=airq ironweave_install_deps
cargo build --release -p ironweave-cli -p ironweave-airq
bin="${CARGO_TARGET_DIR:-target}/release"
exec "$bin/ironweave" launch -n 4 --max-restarts 2 -- "$bin/airq" train --out target/airq "$@"
