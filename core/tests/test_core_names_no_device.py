"""House rule 5: no device or vendor names in the core. The core's code (not
its comments or prose) never compares against, or reaches for, a device name;
everything device-specific comes from the chosen accelerator plugin.

plinth.testing is exempt: the conformance kit names vendor modules only to
assert that a plugin's entry point does *not* import them."""

from __future__ import annotations

import tokenize
from pathlib import Path

import plinth

DEVICE_NAMES = {"cuda", "npu", "xla", "xpu", "tpu", "ascend", "mps", "nccl", "hccl", "xccl"}
CORE = Path(plinth.__file__).parent


def test_core_code_names_no_device() -> None:
    found = []
    for path in sorted(CORE.rglob("*.py")):
        if path.relative_to(CORE).parts[0] == "testing":
            continue
        with open(path, "rb") as f:
            for tok in tokenize.tokenize(f.readline):
                literal = tok.string.strip("'\"").lower() if tok.type == tokenize.STRING else None
                if (tok.type == tokenize.NAME and tok.string in DEVICE_NAMES) or literal in DEVICE_NAMES:
                    found.append(f"{path.relative_to(CORE.parent)}:{tok.start[0]}: {tok.string}")
    assert not found, "device names in core code (ask the accelerator plugin instead):\n" + "\n".join(found)
