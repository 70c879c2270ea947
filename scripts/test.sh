#!/usr/bin/env bash
# Every test, on a fresh machine with Rust: installs the system packages the build and the tests
# need when they are missing (scripts/deps.sh; root for apt-get), then runs the test command.
# NCCL and verbs suites print `SKIPPED ...: reason` where there is no GPU or RDMA device.
# Extra arguments go to `cargo test` (e.g. `-p ironweave-train`).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
ironweave_install_deps
exec cargo test --workspace --release --all-features "$@"
