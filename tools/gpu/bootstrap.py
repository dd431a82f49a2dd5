"""Make the project importable on a bare GPU machine, using only the standard library.

The device machine has a Python with torch, transformers, accelerate, peft, safetensors,
tokenizers, pytest and hypothesis, but no internet, no venv of this project and (as seen in
2026-11) no ``pypdfium2`` or ``datasets``. Missing packages travel as wheels in a folder beside
the working tree (``tools/gpu/fetch_wheels.sh`` fills it, default ``.cache/gpu-wheels``,
which git ignores). This module:

1. installs every wheel of that folder with ``pip install --no-index --no-deps --target SITE``
   (nothing is downloaded; nothing is written into the machine's own environment) and puts
   SITE first on ``sys.path`` and ``PYTHONPATH``, so a carried wheel wins over the machine's
   copy (e.g. the pinned transformers over an older one);
2. puts the project's ``src/`` on ``sys.path`` and ``PYTHONPATH`` when ``raggedvl`` is not
   importable (no ``pip install -e``: the check runs from the source tree as it travelled);
3. reports which packages are present (with versions), which differ from ``constraints.txt``,
   and which are missing, without importing any of them.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

# import name -> distribution name
REQUIRED = {
    "torch": "torch", "transformers": "transformers", "tokenizers": "tokenizers", "safetensors": "safetensors",
    "accelerate": "accelerate", "peft": "peft", "PIL": "pillow", "numpy": "numpy", "pypdfium2": "pypdfium2",
    "yaml": "pyyaml", "tqdm": "tqdm", "filelock": "filelock", "pytest": "pytest", "hypothesis": "hypothesis",
}
OPTIONAL = {"datasets": "datasets", "matplotlib": "matplotlib", "flash_attn": "flash-attn"}


def _prepend_path(entry: str) -> None:
    if entry not in sys.path:
        sys.path.insert(0, entry)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != entry]
    os.environ["PYTHONPATH"] = os.pathsep.join([entry, *parts])


def install_wheels(wheel_dir: Path, site: Path, log) -> list[str]:
    """Install the wheels of ``wheel_dir`` into ``site`` (offline) and put ``site`` on the path.

    Returns the wheel file names installed ([] when the folder is absent or empty). Raises
    ``RuntimeError`` with pip's output when pip fails (e.g. two versions of one package)."""
    wheels = sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []
    if not wheels:
        return []
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wheels)]
    log(f"+ pip install --no-index --no-deps --target {site} {len(wheels)} wheels from {wheel_dir}")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"pip could not install the carried wheels:\n{done.stdout}\n{done.stderr}")
    _prepend_path(str(site))
    importlib.invalidate_caches()
    return [w.name for w in wheels]


def make_project_importable(repo: Path) -> str:
    """How ``raggedvl`` is imported: "installed" or "source tree (src/ on PYTHONPATH)"."""
    if importlib.util.find_spec("raggedvl") is not None:
        return "installed"
    _prepend_path(str(repo / "src"))
    importlib.invalidate_caches()
    if importlib.util.find_spec("raggedvl") is None:
        raise RuntimeError(f"raggedvl is not importable from {repo / 'src'}")
    return "source tree (src/ on PYTHONPATH)"


def _pins(repo: Path) -> dict[str, str]:
    pins: dict[str, str] = {}
    path = repo / "constraints.txt"
    if path.is_file():
        for line in path.read_text().splitlines():
            if "==" in line and not line.lstrip().startswith("#"):
                name, version = line.split("==", 1)
                pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def package_report(repo: Path) -> list[dict[str, str]]:
    """One row per package: name, version (or "missing"), whether required, pin note."""
    pins = _pins(repo)
    rows = []
    for group, table in (("required", REQUIRED), ("optional", OPTIONAL)):
        for module, dist in table.items():
            found = importlib.util.find_spec(module) is not None
            version = _version(dist) if found else None
            pin = pins.get(dist.lower())
            note = ""
            if found and pin and version and version.split("+")[0] != pin:
                note = f"pinned {pin}"
            rows.append({"package": dist, "group": group,
                         "version": (version or "present") if found else "missing", "note": note})
    return rows


def missing_required(rows: list[dict[str, str]]) -> list[str]:
    return [r["package"] for r in rows if r["group"] == "required" and r["version"] == "missing"]
