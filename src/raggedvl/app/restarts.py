"""torchrun restarts: a restarted worker group resumes from the newest checkpoint by itself.

torchrun (``--max-restarts M``) starts the whole worker group again after a rank fails, with
``TORCHELASTIC_RESTART_COUNT`` = K > 0. The restarted ranks then continue the run instead of
refusing its folder: :func:`resume_after_restart` turns ``--resume`` on when the output
directory holds a checkpoint, and rank 0 prints one line saying which restart this is and what
the previous attempt's ranks reported (their records in torchrun's error files,
``<log dir>/attempt_<K-1>/<local rank>/error.json``). Under raggedvl's agent the ranks that
torchrun found failed are known (``raggedvl.app.agent``, ``RAGGEDVL_FAILED_RANKS_FILE``): a
failed rank without a record is named with its signal or exit code, and the ranks torchrun
only stopped afterwards are not blamed. Under a plain torchrun a rank that left no record was
most likely killed by a signal.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import sys
from pathlib import Path

from raggedvl.app.agent import FAILED_RANKS_FILE_ENV, signal_name
from raggedvl.app.checkpoint import list_checkpoints


def restart_count() -> int:
    """K of ``TORCHELASTIC_RESTART_COUNT`` (0 outside torchrun and on the first attempt)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def _failed_ranks(path: str | None) -> dict[str, int] | None:
    """local rank -> exit code of the ranks torchrun found failed, from the agent's file; None
    when there is no such file (a plain torchrun)."""
    try:
        with open(path or "", encoding="utf-8") as f:
            return {str(x["local_rank"]): int(x["exitcode"]) for x in json.load(f)["failed"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def previous_attempt_failures(error_file: str | None = None, failed_file: str | None = None) -> list[str]:
    """What the previous attempt's ranks on this node reported, the cause first: a failed rank
    that left no record (with its signal or exit code), then each record's one line (a rank's
    own failure before notes about a peer). Empty when the error files cannot be found."""
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
    failed = _failed_ranks(failed_file or os.environ.get(FAILED_RANKS_FILE_ENV))
    if failed is None:  # a rank that left no report was most likely killed, its peers' reports its consequence
        ordered = [f"local rank{'s' if len(silent) > 1 else ''} {', '.join(silent)} left no report (killed by a signal?)"]
        ordered = ordered if silent else []
    else:  # the silent ranks torchrun did not find failed were stopped by it afterwards: not a cause
        # SIGTERM / SIGINT / SIGHUP are how torchrun stops ranks: a rank ended by another signal comes first
        stopped = (-signal.SIGTERM, -signal.SIGINT, -signal.SIGHUP)
        ordered = [f"local rank {r} was killed by {signal_name(failed[r])} (it left no report)" if failed[r] < 0
                   else f"local rank {r} exited with code {failed[r]} without a report"
                   for r in sorted((r for r in silent if r in failed), key=lambda r: (failed[r] in stopped, int(r)))]
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
