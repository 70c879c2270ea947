#!/usr/bin/env bash
# Installs the system packages the build, the tests and the main job need, when missing.
# Sourced by scripts/test.sh and scripts/main.sh (and so by .ci/run): the list lives here only.
# Packages are checked by name (`dpkg -s`), never by a file glob: a machine can carry a file
# that looks right from another package (libclang-cpp14's libclang-cpp.so.14 is not the
# libclang.so that bindgen loads; only libclang-dev provides it).
#
#   cmake, g++, libclang-dev    HiGHS, which good_lp builds from source and binds with bindgen
#   pkg-config, libibverbs-dev, librdmacm-dev
#                               the verbs backend (rdma-sys builds against them)
#   libucx-dev                  the UCX backend loads libucp at run time (bindings are checked in)
#   iproute2                    the emulated cluster (ip netns, veth, tc)
#   python3, python3-pip        the persistent tier's interoperability test (safetensors, numpy)
#   chromium                    the report test opens `ironweave report`'s page headless
#
# IRONWEAVE_DEPS=build limits the list to what the default features need to build (the main
# job: cmake, g++, libclang-dev; UCX is loaded at run time and verbs is opt-in).
ironweave_install_deps() {
  local want=(cmake g++ libclang-dev)
  if [ "${IRONWEAVE_DEPS:-all}" != build ]; then
    want+=(pkg-config libibverbs-dev librdmacm-dev libucx-dev iproute2 python3 python3-pip chromium)
  fi
  local need=() p
  for p in "${want[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
  done
  if [ ${#need[@]} -gt 0 ]; then
    echo "installing ${need[*]}" >&2
    if [ "$(id -u)" != 0 ]; then
      echo "error: these Debian packages are missing and installing them needs root: ${need[*]}" >&2
      return 1
    fi
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  fi
  if [ "${IRONWEAVE_DEPS:-all}" != build ] && ! python3 -c "import safetensors, numpy" >/dev/null 2>&1; then
    echo "installing Python safetensors and numpy" >&2
    python3 -m pip install --quiet safetensors numpy 2>/dev/null \
      || python3 -m pip install --quiet --break-system-packages safetensors numpy
  fi
}
