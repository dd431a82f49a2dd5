"""Run one of the benchmark's helper functions in a fresh interpreter and return its result.

The benchmark process measures each job's memory as the summed PSS of the job's processes.
PSS divides a shared page among every process that maps it, so a library the measuring process
itself has loaded (torch, transformers, triton, datasets, pyarrow) would lower the PSS of a job
that maps the same library, and favour the side that loads more of what the measurer loaded.
Everything that needs those libraries (building and describing the workloads, probing the
processor and the head, replaying raggedvl's padding, evaluating) therefore runs here, in a
child process, and the benchmark process checks before each run that it holds none of them
(``HEAVY_MODULES``).

    call("colpali_bench.workloads.describe", path)   ->   what describe(path) returns

Arguments and results travel as JSON (a ``RunSettings`` as ``{"RunSettings": fields}``);
``pathlib.Path`` arguments travel as strings.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

HEAVY_MODULES = ("torch", "transformers", "triton", "datasets", "pyarrow", "pandas", "colpali_engine")
_MARK = "@@isolated-result@@"


def held_heavy_modules() -> list[str]:
    """Which of ``HEAVY_MODULES`` this process has imported (empty: no page shared with a job)."""
    return [m for m in HEAVY_MODULES if m in sys.modules]


def _encode(value: Any) -> Any:
    from colpali_bench.settings import RunSettings

    if isinstance(value, RunSettings):
        return {"RunSettings": dataclasses.asdict(value)}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def _decode(value: Any) -> Any:
    from colpali_bench.settings import RunSettings

    if isinstance(value, dict) and set(value) == {"RunSettings"}:
        return RunSettings(**value["RunSettings"])
    return value


def call(target: str, *args: Any, env: dict[str, str] | None = None, timeout_s: float | None = None, **kwargs: Any) -> Any:
    """``target(*args, **kwargs)`` (``"package.module.function"``) in a child interpreter (this
    one's executable, ``env``); returns its JSON-decoded result. Raises ``RuntimeError`` with the
    child's stderr tail when it fails."""
    payload = json.dumps({"target": target, "args": _encode(list(args)), "kwargs": {k: _encode(v) for k, v in kwargs.items()}})
    here = str(Path(__file__).resolve().parents[1])
    cmd = [sys.executable, "-c", f"import sys; sys.path.insert(0, {here!r}); from colpali_bench.isolated import _main; _main()", payload]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"{target} failed in its child process (exit {out.returncode}):\n{out.stderr[-3000:]}")
    lines = [line for line in out.stdout.splitlines() if line.startswith(_MARK)]
    if not lines:
        raise RuntimeError(f"{target} returned nothing; stdout tail:\n{out.stdout[-2000:]}")
    return json.loads(lines[-1][len(_MARK):])


def _main() -> None:
    request = json.loads(sys.argv[1])
    module, name = request["target"].rsplit(".", 1)
    func = getattr(importlib.import_module(module), name)
    result = func(*[_decode(a) for a in request["args"]], **{k: _decode(v) for k, v in request["kwargs"].items()})
    print(_MARK + json.dumps(_encode(result)), flush=True)
