"""A fresh virtual environment for install tests.

``IsolatedEnv`` proves what a user sees after ``pip install``: a new venv,
plinth-core installed into it, then whatever plugin distributions the test
installs, and ``platform`` run there as a subprocess. Nothing is patched, and
the environment shares nothing with the one running the tests (no
PYTHONPATH, no $PLINTH_PLUGINS_* lists leak in).

    env = IsolatedEnv.create(tmp_path / "venv")          # venv + plinth-core
    env.install("plugins/accelerators/cpu", deps=False)  # a local distribution
    print(env.platform("plugins").stdout)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

#: a build backend new enough for PEP 639 license strings, installed first so
#: local distributions build without an isolated build env (much faster)
SETUPTOOLS = "setuptools>=77"
_SKIP_COPY = shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", ".pytest_cache")


def core_source() -> str:
    """What to ``pip install`` for plinth-core: this checkout's core/ when the
    running plinth comes from one, else the released version."""
    import plinth

    core = Path(plinth.__file__).resolve().parents[2]
    if (core / "pyproject.toml").is_file() and "plinth-core" in (core / "pyproject.toml").read_text():
        return str(core)
    return f"plinth-core=={plinth.__version__}"


class IsolatedEnv:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.bin = self.path / ("Scripts" if os.name == "nt" else "bin")
        self.python = str(self.bin / ("python.exe" if os.name == "nt" else "python"))
        self._builds = Path(tempfile.mkdtemp(prefix="plinth-builds-"))

    # ---- creation ------------------------------------------------------------

    @classmethod
    def create(
        cls, path: str | os.PathLike[str], *, core: str | None = None, build_isolation: bool = False, extra: Sequence[str] = ()
    ) -> IsolatedEnv:
        """A new venv at ``path`` with plinth-core (``core``: a path or a
        requirement; default ``core_source()``) and its dependencies, and the
        requirements ``extra`` in the same pip run (``"torch==2.13.0"``)."""
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, capture_output=True)
        env = cls(path)
        env.build_isolation = build_isolation
        if not build_isolation:
            env.pip("install", SETUPTOOLS)
        env.install(core or core_source(), *extra)
        return env

    build_isolation = False

    # ---- pip ---------------------------------------------------------------------

    def environ(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment subprocesses run with: this venv first on PATH,
        nothing inherited that would change what is discovered."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("PLINTH_") and k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
        }
        env["VIRTUAL_ENV"] = str(self.path)
        env["PATH"] = str(self.bin) + os.pathsep + env.get("PATH", "")
        env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
        env["PIP_NO_INPUT"] = "1"
        env.update(extra or {})
        return env

    def pip(self, *args: str) -> subprocess.CompletedProcess[str]:
        proc = self.run([self.python, "-m", "pip", *args, "-q"])
        if proc.returncode != 0:
            raise RuntimeError(f"pip {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return proc

    def install(self, *sources: str | os.PathLike[str], deps: bool = True) -> None:
        """pip install local folders (copied first, so no build output lands
        in the source tree) and/or requirement strings."""
        args = []
        for src in sources:
            p = Path(src)
            if p.is_dir():
                dest = self._builds / f"{len(list(self._builds.iterdir()))}-{p.resolve().name}"
                shutil.copytree(p, dest, ignore=_SKIP_COPY)
                args.append(str(dest))
            else:
                args.append(str(src))
        flags = [] if deps else ["--no-deps"]
        if not self.build_isolation:
            flags.append("--no-build-isolation")
        self.pip("install", *flags, *args)

    def uninstall(self, *distributions: str) -> None:
        self.pip("uninstall", "-y", *distributions)

    def distributions(self) -> dict[str, str]:
        """Installed distribution name -> version."""
        code = "import importlib.metadata as m, json; print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))"
        import json

        return json.loads(self.run([self.python, "-c", code], check=True).stdout)

    def ensure(self, installed: Mapping[str, str | os.PathLike[str]], *, absent: Sequence[str] = (), deps: bool = True) -> None:
        """Make the venv hold exactly these distributions of the given set:
        ``installed`` maps distribution name -> source; ``absent`` names ones
        to remove. Lets tests that share one venv run in any order."""
        have = {k.lower() for k in self.distributions()}
        gone = [d for d in absent if d.lower() in have]
        if gone:
            self.uninstall(*gone)
        missing = [src for name, src in installed.items() if name.lower() not in have]
        if missing:
            self.install(*missing, deps=deps)

    # ---- running -----------------------------------------------------------------

    def run(
        self, cmd: Sequence[str], *, env: Mapping[str, str] | None = None, check: bool = False, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(cmd), capture_output=True, text=True, env=self.environ(env), check=check, timeout=timeout, cwd=self.path
        )

    def platform(self, *args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run this venv's ``platform`` console script."""
        return self.run([str(self.bin / "platform"), *args], env=env)

    def run_python(self, code: str, *, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return self.run([self.python, "-c", code], env=env)

    def cleanup(self) -> None:
        shutil.rmtree(self._builds, ignore_errors=True)
