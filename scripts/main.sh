#!/usr/bin/env bash
# The main job on a fresh machine: install what the build needs (cmake, a C++ compiler and
# libclang for HiGHS, which good_lp builds from source), then train the moe-small MoE model on
# 4 local ranks with a Capricorn checkpoint every iteration. Needs root for apt-get only when
# something is missing. Extra arguments go to `ironweave train` (e.g. --fail rank=1,iter=12).
set -euo pipefail
cd "$(dirname "$0")/.."
need=()
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v c++ >/dev/null 2>&1 || need+=(g++)
ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1 || need+=(libclang-dev)
if [ ${#need[@]} -gt 0 ]; then
  echo "installing ${need[*]} (needed to build HiGHS)" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi
exec cargo run --release -p ironweave -- train --config configs/moe-small.toml --ranks 4 --ckpt capricorn \
  --iters "${IRONWEAVE_DEMO_ITERS:-30}" "$@"
