"""Figures of one run and the printed comparison tables.

Definitions (both sides alike):
- samples/s over steps 3..N: samples of steps 3..N / (end of step N - end of step 2);
- loop time: from just before the first step to the end of step N; time outside the training
  loop: wall time of the whole command - loop time (imports, data, model, torchrun, the final
  save, teardown);
- padding: padded slots / all slots, summed over every rank's batches (pixel rows of
  ``pixel_values``; document and query tokens);
- peak RSS per process: the kernel's high-water mark (VmHWM), read at every memory sample;
  whole-job summed PSS: the largest sum over the job's processes at one sample, every 0.5 s
  (``procmon``: a peak shorter than that may be missed);
- loss: the global-batch loss per step; "at ln G" counts steps whose loss is within 5e-5 of
  ln(global batch), i.e. equal to it at 4 decimals (the collapsed value).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

CHANCE_TOL = 5e-5


def samples_per_s(steps: list[dict], first: int = 3) -> float:
    """Samples/s over steps ``first``..N (``steps``: dicts with ``t`` end time and ``samples``)."""
    if len(steps) < first:
        return float("nan")
    span = steps[-1]["t"] - steps[first - 2]["t"]
    return sum(s["samples"] for s in steps[first - 1:]) / span if span > 0 else float("nan")


def loss_summary(losses: list[float], global_batch: int) -> dict[str, float]:
    chance = math.log(global_batch)
    return {
        "first": losses[0] if losses else float("nan"),
        "last": losses[-1] if losses else float("nan"),
        "first5": statistics.fmean(losses[:5]) if losses else float("nan"),
        "last10": statistics.fmean(losses[-10:]) if losses else float("nan"),
        "min": min(losses) if losses else float("nan"),
        "at_chance": sum(abs(v - chance) < CHANCE_TOL for v in losses),
        "steps": len(losses),
        "chance": chance,
    }


def padding_pct(totals: dict[str, int]) -> dict[str, float]:
    def pct(real: str, slots: str) -> float:
        return 100.0 * (1 - totals[real] / totals[slots]) if totals.get(slots) else float("nan")

    return {"pixel_rows": pct("pixel_rows", "pixel_slots"), "doc_tokens": pct("doc_tokens", "doc_slots"),
            "query_tokens": pct("query_tokens", "query_slots")}


def _median(runs: list[dict], key: str) -> float:
    values = [r[key] for r in runs if r.get(key) is not None and not math.isnan(r[key])]
    return statistics.median(values) if values else float("nan")


def _fmt(v: float, digits: int = 2) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:,.{digits}f}"


def _ratio(a: float, b: float) -> str:
    if any(x is None or (isinstance(x, float) and math.isnan(x)) for x in (a, b)) or b == 0:
        return "-"
    return f"{a / b:.2f}"


METRICS = (  # key, label, digits
    ("samples_per_s", "samples/s, steps 3..N", 2),
    ("s_per_step", "s/step, steps 3..N", 3),
    ("wall_s", "wall time of the command (s)", 1),
    ("loop_s", "time in the training loop (s)", 1),
    ("outside_s", "time outside the training loop (s)", 1),
    ("worker_rss_mib", "peak RSS per training process (MiB, largest)", 0),
    ("launcher_rss_mib", "peak RSS of the launching process (MiB)", 0),
    ("torchrun_rss_mib", "peak RSS of torchrun (MiB)", 0),
    ("pss_sum_mib", "whole job, peak summed PSS (MiB)", 0),
    ("pixel_pad_pct", "pixel_values rows that are padding (%)", 1),
    ("doc_pad_pct", "document tokens that are padding (%)", 1),
    ("query_pad_pct", "query tokens that are padding (%)", 1),
    ("loss_first", "loss, step 1", 4),
    ("loss_first5", "loss, mean of steps 1-5", 4),
    ("loss_last10", "loss, mean of the last 10 steps", 4),
    ("loss_min", "loss, minimum", 4),
    ("loss_last", "loss, last step", 4),
    ("loss_at_chance", "steps with loss = ln(global batch) at 4 decimals", 0),
)


def comparison_table(colpali: list[dict], raggedvl: list[dict], incumbent: str = "colpali-engine") -> str:
    """One configuration: medians over repeats, per metric, and raggedvl / ``incumbent`` (the
    other library, whose runs are ``colpali``)."""
    lines = [f"| metric (median of repeats) | {incumbent} | raggedvl | raggedvl / {incumbent} |", "|---|---:|---:|---:|"]
    for key, label, digits in METRICS:
        c, r = _median(colpali, key), _median(raggedvl, key)
        if math.isnan(c) and math.isnan(r):
            continue
        ratio = "" if key.startswith("loss") else _ratio(r, c)
        lines.append(f"| {label} | {_fmt(c, digits)} | {_fmt(r, digits)} | {ratio} |")
    for side, runs in ((incumbent, colpali), ("raggedvl", raggedvl)):
        if runs:
            rates = ", ".join(_fmt(r["samples_per_s"]) for r in runs)
            lines.append(f"| samples/s per repeat, {side} | {rates} | | |")
    return "\n".join(lines)


def loss_curve(colpali: list[dict], raggedvl: list[dict], points: int = 8, incumbent: str = "colpali-engine") -> str:
    """The first repeat's per-step loss of each side at about ``points`` evenly spaced steps."""
    runs = [(side, r[0]["steps"]) for side, r in ((incumbent, colpali), ("raggedvl", raggedvl)) if r and r[0].get("steps")]
    if not runs:
        return ""
    n = max(len(steps) for _, steps in runs)
    marks = sorted({1, n, *(round(1 + i * (n - 1) / (points - 1)) for i in range(points))})
    lines = ["| loss at step | " + " | ".join(str(m) for m in marks) + " |", "|---|" + "---:|" * len(marks)]
    for side, steps in runs:
        by_step = {st["step"]: st["loss"] for st in steps}
        lines.append(f"| {side} | " + " | ".join(_fmt(by_step.get(m, float("nan")), 4) for m in marks) + " |")
    return "\n".join(lines)


def loss_gap(incumbent_runs: list[dict], raggedvl: list[dict], incumbent: str = "colpali-engine") -> str:
    """Step-by-step agreement of the first repeat's losses, for runs fed the same batches: the
    largest |raggedvl - incumbent| loss over the first k steps, and each side's mean over the second
    half and minimum. Float error model: both sides compute the same fp32 objective with different
    summation orders (padded vs ragged), so step 1 differs by rounding only; later steps start from
    weights that already differ by rounding, and the gap grows with the training dynamics' own
    sensitivity, not with a difference in objective."""
    if not (incumbent_runs and raggedvl and incumbent_runs[0].get("steps") and raggedvl[0].get("steps")):
        return ""
    a = [st["loss"] for st in incumbent_runs[0]["steps"]]
    b = [st["loss"] for st in raggedvl[0]["steps"]]
    n = min(len(a), len(b))
    gap = [abs(x - y) for x, y in zip(a[:n], b[:n])]
    marks = sorted({k for k in (1, 10, 50, n // 2, n) if 1 <= k <= n})
    half = n // 2
    lines = ["| same batches, first repeat | " + " | ".join(f"steps 1-{k}" for k in marks) + " |",
             "|---|" + "---:|" * len(marks),
             "| max abs loss difference | " + " | ".join(f"{max(gap[:k]):.2e}" for k in marks) + " |",
             "", f"| side | loss, mean of steps {half + 1}-{n} | loss, minimum |", "|---|---:|---:|"]
    for side, losses in ((incumbent, a[:n]), ("raggedvl", b[:n])):
        lines.append(f"| {side} | {_fmt(sum(losses[half:]) / max(1, n - half), 4)} | {_fmt(min(losses), 4)} |")
    return "\n".join(lines)


def summary_row(label: str, colpali: list[dict], raggedvl: list[dict]) -> str:
    def r(key):
        return _ratio(_median(raggedvl, key), _median(colpali, key))

    return (f"| {label} | {r('samples_per_s')} | {r('wall_s')} | {r('outside_s')} | {r('worker_rss_mib')} | "
            f"{r('pss_sum_mib')} |")


SUMMARY_HEADER = (
    "| configuration | samples/s | wall time | time outside the loop | peak RSS per process | whole-job summed PSS |\n"
    "|---|---:|---:|---:|---:|---:|"
)


def eval_table(rows: dict[str, dict[str, Any]]) -> str:
    lines = ["| run | side | dev nDCG@5 before | after | Recall@1 after | doc mean cosine after | dev pairs |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for label, sides in rows.items():
        for side, ev in sides.items():
            before, after = ev.get("before") or {}, ev.get("after") or {}
            lines.append(f"| {label} | {side} | {_fmt(before.get('ndcg@5'), 3)} | {_fmt(after.get('ndcg@5'), 3)} | "
                         f"{_fmt(after.get('recall@1'), 3)} | {_fmt(after.get('doc_mean_cosine'), 4)} | {after.get('n', before.get('n', '-'))} |")
    return "\n".join(lines)
