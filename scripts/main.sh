#!/usr/bin/env bash
# The main job on a fresh machine: install what the build needs when missing (cmake, g++ and
# libclang-dev for HiGHS, which good_lp builds from source; see scripts/deps.sh), then train the
# moe-small MoE model on 4 local ranks with a Capricorn checkpoint every iteration. Needs root
# for apt-get only when something is missing. Extra arguments go to `ironweave train`
# (e.g. --fail rank=1,iter=12).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
IRONWEAVE_DEPS=build ironweave_install_deps
exec cargo run --release -p ironweave-cli -- train --config configs/moe-small.toml --ranks 4 --ckpt capricorn \
  --iters "${IRONWEAVE_DEMO_ITERS:-30}" "$@"
