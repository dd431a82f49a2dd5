"""What a training step reports besides its loss: padding, memory, and the progress display.

- :func:`batch_padding`: real tokens and the slots the model computes on, for the queries and
  the documents of one rank's batch, and its ``pixel_values`` rows (never padded: the flat
  layout), so ``metrics.jsonl`` says how much of each step was padding;
- :func:`peak_memory_mib`: this process's peak memory so far (CUDA: the caching allocator's
  peak allocation on the device; CPU: the process's peak resident set size);
- :class:`Progress`: a tqdm bar when stderr is a terminal; otherwise (a log file, a pipe, a
  batch system) one plain line every ``every`` steps and at the last one, with no carriage
  return: ``step 40/600 loss 2.0123 lr 2.00e-04 samples/s 5.3 ETA 0:12:34``.
"""

from __future__ import annotations

import resource
import sys
import time
from datetime import timedelta
from typing import Any, TextIO

import torch

PADDING_KEYS = ("query_tokens", "query_slots", "doc_tokens", "doc_slots", "pixel_rows", "pixel_slots")


def batch_padding(queries: Any, docs: Any, *, packed: bool) -> dict[str, int]:
    """Tokens and slots of one rank's batch: ``*_tokens`` real (attention mask), ``*_slots``
    what the language model runs on (``[B, L]`` padded rows; equal to the tokens when
    ``packed``, as padding-free sequences have no pad), ``pixel_rows`` = ``pixel_slots`` =
    rows of the documents' ``pixel_values`` (plus video rows). Counts, summed over the batch."""
    out = {}
    for name, batch in (("query", queries), ("doc", docs)):
        mask = batch.get("attention_mask")
        ids = batch["input_ids"]
        tokens = int(mask.sum()) if mask is not None else ids.numel()
        out[f"{name}_tokens"], out[f"{name}_slots"] = tokens, tokens if packed else ids.numel()
    rows = sum(int(t.shape[0]) for b in (queries, docs) for key in ("pixel_values", "pixel_values_videos")
               if (t := b.get(key)) is not None)
    out["pixel_rows"] = out["pixel_slots"] = rows
    return out


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory of this process so far, in MiB: ``torch.cuda.max_memory_allocated`` on a CUDA
    device, else the peak resident set size (``getrusage``; KiB on Linux)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


def eta_text(seconds: float) -> str:
    """``H:MM:SS`` for an estimate under 100 days, else the days in 3 significant digits (a
    ``timedelta`` cannot hold the estimate of an absurd step count)."""
    if seconds < 100 * 86400:
        return str(timedelta(seconds=round(seconds)))
    return f"{seconds / 86400:.3g} days"


class Progress:
    """Training progress on rank 0 (``enabled``): a tqdm bar on a terminal, else plain lines."""

    def __init__(self, total: int, initial: int, *, every: int, enabled: bool, stream: TextIO | None = None) -> None:
        self.total, self.every, self.enabled = total, every, enabled
        self.stream = stream or sys.stderr
        self.start_step, self.t0 = initial, time.perf_counter()
        self.bar = None
        if enabled and self.stream.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="train", dynamic_ncols=True, file=self.stream)

    def update(self, step: int, *, loss: float, lr: float, samples_per_s: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}", samples_s=f"{samples_per_s:.1f}")
            return
        if step % self.every and step != self.total:
            return
        done = step - self.start_step
        eta = (time.perf_counter() - self.t0) / done * (self.total - step) if done else 0.0
        print(f"step {step}/{self.total} loss {loss:.4f} lr {lr:.2e} samples/s {samples_per_s:.2f} "
              f"ETA {eta_text(eta)}", file=self.stream, flush=True)

    def write(self, message: str) -> None:
        """A message line that does not break the bar."""
        if self.bar is not None:
            self.bar.write(message, file=self.stream)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
