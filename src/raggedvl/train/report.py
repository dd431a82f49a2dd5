"""Run outputs written by rank 0: metrics as JSON lines, a PNG plot and a summary table."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from raggedvl.evaluation.metrics import METRICS


class MetricsLog:
    """Append-only JSON-lines log (one object per line, flushed per write).

    On resume the file keeps the records of steps <= ``resume_step`` (the checkpoint's) so that a
    resumed run's log has each step exactly once."""

    def __init__(self, path: str | Path, resume_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            kept = [r for r in self.read() if r.get("step", -1) <= resume_step and r.get("event") != "eval_after"]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
        elif resume_step is None:
            self.path.write_text("", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text(encoding="utf-8").splitlines() if line.strip()]


def format_metrics_table(rows: dict[str, dict[str, float]]) -> str:
    """A Markdown table: one row per named metrics dict, one column per metric in METRICS."""
    lines = ["| | " + " | ".join(METRICS) + " |", "|---|" + "---:|" * len(METRICS)]
    for name, m in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{m.get(k, float('nan')):.3f}" for k in METRICS) + " |")
    return "\n".join(lines)


def plot_run(records: list[dict[str, Any]], evals: dict[str, dict[str, float]], path: str | Path) -> Path:
    """Loss curve (with learning rate) and a bar chart of the evaluation metrics, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records if r.get("event") == "train"]
    losses = [r["loss"] for r in records if r.get("event") == "train"]
    lrs = [r["lr"] for r in records if r.get("event") == "train"]
    fig, (ax_loss, ax_bar) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax_loss.plot(steps, losses, lw=1, label="training loss")
    ax_loss.set_xlabel("optimizer step")
    ax_loss.set_ylabel("loss")
    if losses and records:
        gbs = next((r.get("global_batch_size") for r in records if r.get("global_batch_size")), None)
        if gbs:
            ax_loss.axhline(math.log(gbs), color="grey", ls="--", lw=1, label=f"ln(global batch) = {math.log(gbs):.2f}")
    ax_lr = ax_loss.twinx()
    ax_lr.plot(steps, lrs, color="tab:orange", lw=1, alpha=0.6)
    ax_lr.set_ylabel("learning rate", color="tab:orange")
    ax_loss.legend(loc="upper right")
    ax_loss.set_title("training")
    width = 0.8 / max(1, len(evals))
    for i, (name, m) in enumerate(evals.items()):
        xs = [j + i * width for j in range(len(METRICS))]
        ax_bar.bar(xs, [m.get(k, 0.0) for k in METRICS], width=width, label=name)
    ax_bar.set_xticks([j + 0.4 - width / 2 for j in range(len(METRICS))], METRICS)
    ax_bar.set_ylim(0, 1)
    ax_bar.legend(fontsize=8)
    ax_bar.set_title("retrieval metrics")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
