"""The sentence-transformers side of the benchmark: the command that runs ``st_worker.py`` (plain
``python`` for one process, torchrun for several, as for colpali-engine), its spec and what the
run wrote (the layout of ``colpali_bench.colpali_side``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from colpali_bench import colpali_side
from colpali_bench.settings import RunSettings

WORKER = Path(__file__).with_name("st_worker.py")


def spec(s: RunSettings, *, train_parquet: str, out_dir: str, save_final: bool) -> dict[str, Any]:
    """The worker's settings: colpali-engine's spec (the same run settings); ``s.model`` is a
    sentence-transformers folder. With ``save_final`` rank 0 saves the trained model to
    ``out_dir/final`` (a sentence-transformers folder, which raggedvl's model loader reads)."""
    return colpali_side.spec(s, train_parquet=train_parquet, out_dir=out_dir, save_final=save_final)


def command(s: RunSettings, spec_path: str) -> list[str]:
    return colpali_side.command(s, spec_path, worker=WORKER)


def read_run(out_dir: str | Path, global_batch: int) -> dict[str, Any]:
    """``colpali_side.read_run`` of the worker's ``st_rank*.json`` files."""
    return colpali_side.read_run(out_dir, global_batch, prefix="st")
