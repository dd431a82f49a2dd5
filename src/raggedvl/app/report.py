"""Run outputs written by rank 0: metrics as JSON lines, a PNG plot and the Markdown summary
(``summary.md``, also printed) of a ``raggedvl train`` run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Sequence

from raggedvl.evaluation.evaluator import chance_verdict
from raggedvl.evaluation.metrics import METRICS
from raggedvl.app.collapse import chance_loss, doc_cosine_warning
from raggedvl.app.wording import counted


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


def loss_windows(losses: list[float]) -> tuple[str, float, float]:
    """The summary's loss line and the means of the first and of the last ``w`` steps, with
    ``w = min(10, n // 2)`` so that the two windows never overlap (one step: its loss twice;
    none: NaN)."""
    if not losses:
        return "training loss: no steps", math.nan, math.nan
    if len(losses) == 1:
        return f"training loss: 1 step, {losses[0]:.3f}", losses[0], losses[0]
    w = min(10, len(losses) // 2)
    first, last = sum(losses[:w]) / w, sum(losses[-w:]) / w
    return f"training loss: first {counted(w, 'step')} {first:.3f} -> last {counted(w, 'step')} {last:.3f}", first, last


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` points (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def smoothing_window(steps: int) -> int:
    """The report's smoothed-loss window: ~5 % of the steps, at least 2, from 20 steps on (1, no
    smoothed line, below; ``steps // 20`` alone drew none before 40 steps)."""
    return max(2, round(steps / 20)) if steps >= 20 else 1


def step_chances(records: list[dict[str, Any]], loss: str = "late_interaction") -> list[float]:
    """Per ``train`` record, the step's chance loss: its ``chance_loss`` (ln(pairs + hard
    negatives), ``raggedvl.app.collapse``), or, in a log written before that field existed,
    :func:`~raggedvl.app.collapse.chance_loss` of ``loss`` over its ``global_batch_size``
    (NaN without one)."""
    out = []
    for r in records:
        if r.get("event") != "train":
            continue
        if r.get("chance_loss") is not None:
            out.append(float(r["chance_loss"]))
        else:
            out.append(chance_loss(loss, r["global_batch_size"]) if r.get("global_batch_size") else math.nan)
    return out


def chance_line(records: list[dict[str, Any]], loss: str, global_batch_size: int) -> str:
    """The summary's chance-loss line (the loss when every document scores the same, what the
    collapse check compares with): one value with its pairs and hard negatives, or the range
    over the logged steps when they differ (a last, smaller step; skipped pairs)."""
    train = [r for r in records if r.get("event") == "train"]
    values = [c for c in step_chances(records, loss) if not math.isnan(c)]
    if loss == "pairwise":
        return f"chance loss (every document scoring the same): ln 2 = {math.log(2):.3f} (pairwise)"
    if not values:
        value = chance_loss(loss, global_batch_size)
        return f"chance loss (every document scoring the same): ln({counted(global_batch_size, 'pair')}) = {value:.3f}"
    if max(values) - min(values) > 1e-9:
        return (f"chance loss (every document scoring the same): ln(pairs + hard negatives) of each step, "
                f"{min(values):.3f}-{max(values):.3f} (metrics.jsonl chance_loss)")
    last = next(r for r in reversed(train) if r.get("chance_loss") is not None or r.get("global_batch_size"))
    logged = last.get("chance_loss") is not None and last.get("rank_samples")  # else: a log from before chance_loss
    pairs = sum(last["rank_samples"]) if logged else last.get("global_batch_size", global_batch_size)
    negatives = last.get("hard_negatives", 0) if logged else 0
    terms = counted(pairs, "pair") + (f" + {counted(negatives, 'hard negative')}" if negatives else "")
    return f"chance loss (every document scoring the same): ln({terms}) = {values[-1]:.3f}"


def report_figure(records: list[dict[str, Any]], evals: dict[str, dict[str, float]], *, title: str | None = None,
                  loss: str = "late_interaction"):
    """The report's matplotlib figure, under ``title`` when given: the training loss (raw, and
    smoothed over ~5 % of the steps when there are 20 or more) against integer step ticks, the
    chance loss of each step (:func:`step_chances`; one dashed line when it is constant) and
    the learning rate on a scientific axis; and, only when ``evals`` holds results, their
    metrics as bars with value labels, slanted metric names and the legend outside the bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    train = [r for r in records if r.get("event") == "train"]
    steps, losses, lrs = [r["step"] for r in train], [r["loss"] for r in train], [r["lr"] for r in train]
    fig, axes = plt.subplots(1, 2 if evals else 1, figsize=(14 if evals else 7, 4.5), squeeze=False)
    ax_loss = axes[0][0]
    window = smoothing_window(len(losses))
    ax_loss.plot(steps, losses, lw=1, color="tab:blue", alpha=0.35 if window > 1 else 1.0, label="training loss")
    if window > 1:
        ax_loss.plot(steps, smooth(losses, window), lw=2, color="tab:blue", label=f"mean of the last {window} steps")
    ax_loss.set_xlabel("optimizer step")
    ax_loss.set_ylabel("loss")
    ax_loss.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers: no 1.5, 2.5 ticks
    chances = step_chances(records, loss)
    known = [c for c in chances if not math.isnan(c)]
    if known and max(known) - min(known) <= 1e-9:
        ax_loss.axhline(known[0], color="grey", ls="--", lw=1, label=f"chance loss = {known[0]:.2f}")
    elif known:
        ax_loss.plot(steps, chances, color="grey", ls="--", lw=1, drawstyle="steps-mid", label="chance loss of each step")
    ax_lr = ax_loss.twinx()
    ax_lr.plot(steps, lrs, color="tab:orange", lw=1, alpha=0.6)
    ax_lr.set_ylabel("learning rate", color="tab:orange")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    if train:
        # below the axes: inside, it covered the curves (loss and learning rate share the panel)
        ax_loss.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3, fontsize=8, frameon=False)
    ax_loss.set_title("training")
    if evals:
        ax_bar = axes[0][1]
        width = 0.8 / len(evals)
        for i, (name, m) in enumerate(evals.items()):
            bars = ax_bar.bar([j + i * width for j in range(len(METRICS))], [m.get(k, 0.0) for k in METRICS],
                              width=width, label=name)
            ax_bar.bar_label(bars, fmt="%.2f", fontsize=6, rotation=90, padding=2)  # near-zero bars stay visible
        # slanted: eight names such as "recall@10" overlap when set straight under narrow bars
        ax_bar.set_xticks([j + 0.4 - width / 2 for j in range(len(METRICS))], METRICS, fontsize=8, rotation=30,
                          ha="right", rotation_mode="anchor")
        ax_bar.set_ylim(0, 1.15)
        ax_bar.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        ax_bar.set_title("retrieval metrics")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_run(records: list[dict[str, Any]], evals: dict[str, dict[str, float]], path: str | Path, *,
             title: str | None = None, loss: str = "late_interaction") -> Path:
    """Write :func:`report_figure` as a PNG at ``path``; returns it."""
    import matplotlib.pyplot as plt

    fig = report_figure(records, evals, title=title, loss=loss)
    path = Path(path)
    fig.savefig(path, dpi=100, bbox_inches="tight")  # "tight": the legend outside the bars is kept
    plt.close(fig)
    return path


def write_summary(
    run_dir: Path,
    records: list[dict[str, Any]],
    before: dict[str, dict[str, Any]] | None,
    after: dict[str, dict[str, Any]] | None,
    random: dict[str, dict[str, float]],
    *,
    steps: int,
    global_batch_size: int,
    world_size: int,
    place: str | None = None,
    loss: str = "late_interaction",
    on_bad_image: str,
    skipped_examples: int,
    rejected_pairs: int,
    estimated_pairs: int,
    notes: Sequence[str] = (),
) -> dict[str, Any]:
    """Write ``run_dir/summary.md`` and ``run_dir/report.png``, print the summary and the run
    directory's files; rank 0 only, no collective.

    ``place``: where it ran, shown after the world size (``raggedvl.app.loop.run_place``:
    ``"single process, cpu"``, ``"gloo, cpu"``); ``loss``: the loss in use, for the chance value
    when the records carry none (:func:`chance_line`).
    ``records``: the run's ``metrics.jsonl`` records, all of them: a resumed run's log keeps the
    steps before its checkpoint, so the loss windows span the whole run (the line names the
    logged steps and each ``resume`` event's step); the pre-training evaluation is taken from
    them when ``before`` is None, as after a resume. ``before`` / ``after``: evaluations
    per split (``"train"``, ``"dev"``; a split without a benchmark is absent), each the evaluator's
    metrics plus ``"n"`` (documents ranked), or None when not run. ``random``: per split, a random
    ranker's expected metrics on that benchmark (``evaluator.random_baseline``).
    ``skipped_examples``: examples the collator dropped (``on_bad_image="skip"``);
    ``rejected_pairs`` of ``estimated_pairs``: pairs the size estimate rejected. ``notes``: lines
    shown under the training loss (e.g. the collapse check's verdict).
    Returns ``{"rows", "loss_first", "loss_last", "plot"}``: the table's rows, the mean loss of
    the first and of the last ``w`` logged steps (:func:`loss_windows`), and the plot's path.
    """
    if before is None:  # resumed: take the pre-training evaluation from the log
        before = next((r["raw"] for r in records if r.get("event") == "eval_before"), None)
    rows: dict[str, dict[str, float]] = {}
    for split in ("train", "dev"):
        ref = (after or before or {}).get(split)
        if ref:
            sizes = f"{counted(ref['queries'], 'query', 'queries')}, {counted(ref['n'], 'doc')}"
            rows[f"{split}: random ranker ({sizes})"] = random[split]
        if before and split in before:
            rows[f"{split}: before training"] = before[split]
        if after and split in after:
            rows[f"{split}: after training"] = after[split]
    train = [r for r in records if r.get("event") == "train"]
    loss_line, first, last = loss_windows([r["loss"] for r in train])
    if train:  # the windows cover the whole log, resumed runs included: say which steps it holds
        resumes = [str(r["step"]) for r in records if r.get("event") == "resume"]
        loss_line += (f" (logged steps {train[0]['step']}-{train[-1]['step']} of metrics.jsonl"
                      + (f"; resumed at step {', '.join(resumes)}" if resumes else "") + ")")
    table = format_metrics_table(rows) if rows else "no evaluation (--eval-before false, --eval-after false)"
    header = f"steps {steps}, global batch {global_batch_size}, world size {world_size}" + (f" ({place})" if place else "")
    plot = plot_run(records, {k: v for k, v in rows.items() if "dev" in k or "train" in k}, run_dir / "report.png",
                    title=f"raggedvl run {run_dir.name}: {header}", loss=loss)
    lines = [
        f"# raggedvl run: {run_dir}",
        "",
        header,
        chance_line(records, loss, global_batch_size),
        loss_line,
        *notes,
        f"examples skipped for bad images (on_bad_image={on_bad_image!r}): {skipped_examples}",
        f"training pairs rejected by the size estimate (image header unreadable or out of limits; never drawn): "
        f"{rejected_pairs} of {estimated_pairs}",
        "",
        table,
        "",
    ]
    for split in ("train", "dev"):
        result = (after or before or {}).get(split, {})
        cos = result.get("doc_mean_cosine")
        if cos is not None:
            warning = doc_cosine_warning(cos)
            lines.append(f"{split} documents: mean pairwise cosine {cos:.4f}" + (f"; {warning}" if warning else ""))
        if "mean_rank" in result:
            lines.append(f"{split} ({'after' if after else 'before'} training): {chance_verdict(result)}")
        skipped = result.get("skipped_documents")
        if skipped:
            which = ("1 document with an unreadable image is" if skipped == 1
                     else f"{skipped} documents with unreadable images are")
            lines.append(f"{split}: {which} never retrieved")
    if rows:  # the note explains the table's metrics: no table, no note
        lines += ["", "Metrics are trec_eval's (pytrec_eval, as BEIR / mteb / ViDoRe report them): distinct images "
                      "are the corpus, equal scores rank by document id, graded gains; see docs/EVALUATION.md."]
    (run_dir / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines), flush=True)
    print("run directory:", flush=True)
    for p in sorted(run_dir.rglob("*")):
        if p.is_file():
            print(f"  {p.relative_to(run_dir)}  ({p.stat().st_size:,} bytes)", flush=True)
    return {"rows": rows, "loss_first": first, "loss_last": last, "plot": str(plot)}
