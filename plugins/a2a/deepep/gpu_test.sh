#!/usr/bin/env bash
# One command on a GPU machine (SM90+, DeepEP installed or installable):
#   plugins/a2a/deepep/gpu_test.sh [NUM_GPUS]
# Installs the plugin, checks deepep's reasons, then runs the round trips of
# both DeepEP generations on NUM_GPUS ranks (default: every visible GPU).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
py="${PYTHON:-$root/.venv/bin/python}"
gpus="${1:-$("$py" -c 'import torch; print(torch.cuda.device_count())')}"
"$py" -m pip install -q -e "$root/core" -e "$here" -e "$root/plugins/a2a/nccl"
"$py" -c 'import importlib.util, sys; sys.exit(0 if importlib.util.find_spec("deep_ep") else 1)' || {
  echo "deep_ep is not installed: build DeepEP (https://github.com/deepseek-ai/DeepEP, needs CUDA, NCCL, NVSHMEM) first" >&2
  exit 2
}
if [ "$gpus" -lt 2 ]; then echo "DeepEP needs at least 2 GPUs (one rank per GPU); found $gpus" >&2; exit 2; fi
exec "$py" -m torch.distributed.run --standalone --nproc-per-node "$gpus" "$here/tests/gpu_roundtrip.py"
