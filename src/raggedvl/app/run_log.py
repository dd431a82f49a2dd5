"""Rank 0's record of a run as it trains: ``metrics.jsonl``, the experiment trackers
(``--report-to``) and the progress bar, with the throughput counters they report.

The training loop hands it events (the run's start, an evaluation, a trained step, a collapse,
the end); it decides what each output gets and when (``--log-every``, ``--progress-every``).
On other ranks every method is a no-op, so the loop calls it unconditionally."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from raggedvl.app.config import TrainConfig
from raggedvl.app.progress import PADDING_KEYS, Progress
from raggedvl.app.report import MetricsLog
from raggedvl.app.startup import StartupClock
from raggedvl.app.tracking import Trackers, eval_scalars, parse_report_to


class RunLog:
    """Rank 0's outputs of one run (module docstring). ``resume_step``: the step a resumed run
    continues from (``metrics.jsonl`` drops records past it), None for a new run;
    ``checkpoint_world_size``: the process count that wrote the checkpoint it resumed from."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, *, enabled: bool, resume_step: int | None,
                 world_size: int, costs: Any, checkpoint_world_size: int | None = None) -> None:
        self.cfg, self.enabled = cfg, enabled
        self.metrics: MetricsLog | None = None
        self.trackers: Trackers | None = None
        self.progress: Progress | None = None
        self.samples = self.patches = 0
        self.t_run = self.loop_start = 0.0
        self.first_step = True
        if not enabled:
            return
        self.metrics = MetricsLog(run_dir / "metrics.jsonl", resume_step=resume_step)
        if resume_step is not None:
            self.metrics.write({"event": "resume", "step": resume_step, "world_size": world_size,
                                "checkpoint_world_size": checkpoint_world_size})
        else:
            self.metrics.write({"event": "config", **cfg.to_dict(), "world_size": world_size})
            self.metrics.write({"event": "size_estimate", "pairs": len(costs.costs), "patches": int(costs.patches.sum()),
                                "rejected": [bad["name"] for bad in costs.skipped],  # never drawn
                                "kept": len(costs.costs) - len(costs.skipped)})
        self.trackers = Trackers(parse_report_to(cfg.report_to), run_dir, cfg.to_dict(), resume=resume_step is not None)

    def evaluation(self, event: str, step: int, results: dict[str, dict[str, float]]) -> None:
        """An evaluation's results: ``eval_before`` (flattened and raw) or ``eval_after`` (raw;
        written by :meth:`finish`), and the trackers' scalars."""
        if not self.enabled:
            return
        if event == "eval_before":
            flat = {f"{s}/{k}": v for s, m in results.items() for k, v in m.items() if k != "n"}
            self.metrics.write({"event": event, "step": step, **flat, "raw": results})
        self.trackers.log(eval_scalars(results), step)

    def start_loop(self, step: int, total_steps: int) -> None:
        """The training loop starts at ``step`` (0, or the resumed step)."""
        self.progress = Progress(total_steps, step, every=self.cfg.progress_every, enabled=self.enabled)
        self.loop_start, self.t_run = time.time(), time.perf_counter()

    def step(self, step: int, epoch: int, r: Any, *, clock: StartupClock, group_names: list[str],
             skipped: int, vision_balance: dict[str, Any], source: str | None, last: bool) -> None:
        """A trained step ``r`` (:class:`raggedvl.app.loop.StepResult`, every rank's statistics):
        counts its samples and patch rows, updates the progress bar, records where the time
        before the first step went, and every ``--log-every`` steps (and on the last or a
        skipped step) writes its ``train`` record and the trackers' scalars."""
        self.samples += sum(p.n_local for p in r.ranks)
        self.patches += sum(p.padding["pixel_rows"] for p in r.ranks)
        elapsed = max(1e-9, time.perf_counter() - self.t_run)
        rate = self.samples / elapsed
        if not self.enabled:
            return
        lrs, lr_groups = r.lrs, dict(zip(group_names, r.lrs))
        self.progress.update(step, loss=r.loss, lr=lrs[0], samples_per_s=rate)
        if self.first_step:  # where the time before it went (resumed runs too)
            self.first_step = False
            clock.add({"first_step": time.perf_counter() - self.t_run})
            self.metrics.write({"event": "startup", "command_start": clock.command_start, "loop_start": self.loop_start,
                                "to_loop_s": self.loop_start - clock.command_start, "phases_s": clock.phases_s})
        if not (step % self.cfg.log_every == 0 or last or not r.applied):
            return
        record = {
            "event": "train", "step": step, "epoch": epoch, "time": time.time(), "loss": r.loss,
            "lr": lrs[0], "lr_groups": lr_groups, "grad_norm": r.grad_norm,
            "global_batch_size": self.cfg.global_batch_size, "hard_negatives": r.hard_negatives,
            "false_negatives": r.false_negatives, "chance_loss": r.chance_loss(self.cfg.loss), "samples_per_s": rate,
            "patches_per_s": self.patches / elapsed, "step_s": r.step_s,
            "rank_samples": [p.n_local for p in r.ranks], "rank_encode_s": [p.encode_s for p in r.ranks],
            "peak_memory_mib": [round(p.peak_memory_mib, 1) for p in r.ranks],
            "padding": {k: sum(p.padding[k] for p in r.ranks) for k in PADDING_KEYS},
            "skipped_examples": skipped, **vision_balance,
            **({} if r.applied else {"nonfinite": True}),
        }
        if source is not None:  # one-source batches: every sample of the step is from it
            record["source"] = source
        self.metrics.write(record)
        self.trackers.log({"train/loss": r.loss, "train/grad_norm": r.grad_norm, "train/samples_per_s": rate,
                           "train/patches_per_s": record["patches_per_s"],
                           "train/peak_memory_mib": max(record["peak_memory_mib"]),
                           **{f"lr/{g}": v for g, v in lr_groups.items()}}, step)

    def write(self, record: dict[str, Any], scalars: dict[str, float] | None = None) -> None:
        """Any other event record (a collapse, a best checkpoint, a preemption), and optionally
        its ``scalars`` for the trackers at the record's ``step``."""
        if not self.enabled:
            return
        self.metrics.write(record)
        if scalars:
            self.trackers.log(scalars, record["step"])

    def close(self) -> None:
        """Stop early (a preemption): the trackers flush and close."""
        if self.enabled:
            self.trackers.close()

    def close_progress(self) -> None:
        if self.progress is not None:
            self.progress.close()

    def finish(self, step: int, after: dict[str, dict[str, float]] | None) -> list[dict[str, Any]]:
        """The run's end: the final evaluation's scalars and ``eval_after`` record, the trackers
        closed; returns the records written before it (for the summary)."""
        if not self.enabled:
            return []
        if after is not None:
            self.trackers.log(eval_scalars(after), step)
        self.trackers.close()
        records = self.metrics.read()
        if after is not None:
            self.metrics.write({"event": "eval_after", "step": step, "raw": after})
        return records
