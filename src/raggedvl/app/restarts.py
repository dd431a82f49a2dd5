"""torchrun restarts: a restarted worker group resumes from the newest checkpoint by itself.

torchrun (``--max-restarts M``) starts the whole worker group again after a rank fails, with
``TORCHELASTIC_RESTART_COUNT`` = K > 0. The restarted ranks then continue the run instead of
refusing its folder: :func:`resume_after_restart` turns ``--resume`` on when the output
directory holds a checkpoint, and rank 0 prints one line saying which restart this is and what
the previous attempt's ranks reported (their records in torchrun's error files,
``<log dir>/attempt_<K-1>/<local rank>/error.json``; a rank that left none was most likely
killed by a signal).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from pathlib import Path

from raggedvl.app.checkpoint import list_checkpoints


def restart_count() -> int:
    """K of ``TORCHELASTIC_RESTART_COUNT`` (0 outside torchrun and on the first attempt)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def previous_attempt_failures(error_file: str | None = None) -> list[str]:
    """What the previous attempt's ranks on this node reported: each record's one line, then a
    note for each rank that left none. Empty when the error files cannot be found."""
    error_file = error_file or os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    match = re.search(r"attempt_(\d+)", error_file)
    if not match or int(match.group(1)) == 0:
        return []
    attempt = Path(error_file[: match.start()] + f"attempt_{int(match.group(1)) - 1}")
    if not attempt.is_dir():
        return []
    lines, silent = [], []
    for rank_dir in sorted((p for p in attempt.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)):
        try:
            record = json.loads((rank_dir / "error.json").read_text(encoding="utf-8"))["message"]["raggedvl"]
            lines.append((record.get("after_peer", False), record["line"]))
        except (OSError, ValueError, KeyError, TypeError):
            silent.append(rank_dir.name)
    # a rank that left no report was most likely killed, and its peers' reports are its consequence
    ordered = [f"local rank{'s' if len(silent) > 1 else ''} {', '.join(silent)} left no report (killed by a signal?)"]
    ordered = ordered if silent else []
    return ordered + [line for _, line in sorted(lines, key=lambda x: x[0])]  # own failures before peers' notes


def resume_after_restart(cfg, rank: int):
    """``cfg`` with ``resume`` on when this is a restarted attempt and the output directory holds a
    checkpoint; rank 0 prints ``raggedvl: restart K of M after ...; resuming from PATH``."""
    count = restart_count()
    if count == 0:
        return cfg
    newest = list_checkpoints(Path(cfg.output_dir) / "checkpoints")
    if rank == 0:
        failures = previous_attempt_failures()
        why = f" after: {failures[0]}" + (f" (and {len(failures) - 1} more)" if len(failures) > 1 else "") if failures else ""
        where = f"resuming from {newest[0]}" if newest else "no checkpoint yet: starting again"
        print(f"raggedvl: restart {count} of {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}{why}; {where}",
              file=sys.stderr, flush=True)
    if newest and not cfg.resume:
        return dataclasses.replace(cfg, resume=True)
    return cfg
