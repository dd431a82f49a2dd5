"""write_summary: the run report of `raggedvl train` (summary.md, report.png, the printed copy)
from the metrics log and the evaluations, including a resumed run whose pre-training evaluation
is only in the log; loss windows that fit short runs, report.png with a
smoothed loss over the raw one, a scientific learning-rate axis, value labels on the bars, the
legend outside them, and no empty panel, table or warning without evaluation."""

import json
import math
import warnings

import matplotlib.pyplot as plt
import pytest

from raggedvl.evaluation.metrics import METRICS
from raggedvl.app.report import (MetricsLog, loss_windows, plot_run, report_figure, smooth, smoothing_window,
                                   write_summary)


def _evaluation(ndcg, mean_rank, *, queries=4, docs=8):
    metrics = {"ndcg@5": ndcg, "recall@1": ndcg / 2, "queries": queries, "documents": docs, "n": docs,
               "mean_rank": mean_rank, "random_mean_rank": 4.5, "random_mean_rank_se": 0.5,
               "doc_mean_cosine": 0.5}
    return metrics


RANDOM = {"ndcg@5": 0.3, "recall@1": 0.125}


def _log_with_training(path, losses, before=None):
    log = MetricsLog(path)
    if before is not None:
        log.write({"event": "eval_before", "step": 0, "raw": before})
    for step, loss in enumerate(losses, 1):
        log.write({"event": "train", "step": step, "loss": loss, "lr": 1e-4, "global_batch_size": 4})
    return log.read()


def test_summary_states_losses_counts_and_every_evaluation(tmp_path, capsys):
    losses = [2.0, 1.9, 1.8, 1.7, 1.6, 1.5, 1.4]
    records = _log_with_training(tmp_path / "metrics.jsonl", losses)
    before = {"train": _evaluation(0.3, 4.4), "dev": _evaluation(0.31, 4.6)}
    after = {"train": _evaluation(0.9, 1.2), "dev": _evaluation(0.35, 4.3)}
    out = write_summary(tmp_path, records, before, after, {"train": RANDOM, "dev": RANDOM}, steps=7,
                        global_batch_size=4, world_size=2, place="gloo, cpu", on_bad_image="skip", skipped_examples=3,
                        rejected_pairs=1, estimated_pairs=16)
    text = (tmp_path / "summary.md").read_text()
    assert out["loss_first"] == sum(losses[:3]) / 3 and out["loss_last"] == sum(losses[-3:]) / 3  # 7 steps: windows of 3
    assert "training loss: first 3 steps 1.900 -> last 3 steps 1.500" in text
    assert "steps 7, global batch 4, world size 2 (gloo, cpu)" in text
    # records without chance_loss (a log from before it): ln(global batch)
    assert f"chance loss (every document scoring the same): ln(4 pairs) = {math.log(4):.3f}" in text
    assert "Metrics are trec_eval's" in text  # evaluation ran: the note on the table's metrics
    assert "examples skipped for bad images (on_bad_image='skip'): 3" in text
    assert "rejected by the size estimate (image header unreadable or out of limits; never drawn): 1 of 16" in text
    assert out["rows"]["dev: random ranker (4 queries, 8 docs)"] == RANDOM
    assert list(out["rows"]) == [
        "train: random ranker (4 queries, 8 docs)", "train: before training", "train: after training",
        "dev: random ranker (4 queries, 8 docs)", "dev: before training", "dev: after training",
    ]
    header = next(line for line in text.splitlines() if line.startswith("| | "))
    row = next(line for line in text.splitlines() if line.startswith("| dev: after training |"))
    cells = dict(zip(header.strip("|").split("|")[1:], row.strip("|").split("|")[1:]))
    assert cells[" ndcg@5 "].strip() == f"{0.35:.3f}" and cells[" recall@1 "].strip() == f"{0.35 / 2:.3f}"
    assert "train (after training): first relevant document's mean rank 1.2" in text and "better than chance" in text
    assert "dev (after training): first relevant document's mean rank 4.3" in text and "not distinguishable from chance (|z| <= 3)" in text
    assert (tmp_path / "report.png").stat().st_size > 0 and out["plot"] == str(tmp_path / "report.png")
    printed = capsys.readouterr().out
    assert text.strip() in printed and "summary.md" in printed.split("run directory:")[1]


def test_resumed_run_takes_the_pre_training_evaluation_from_the_log(tmp_path):
    before = {"dev": _evaluation(0.2, 5.0)}
    records = _log_with_training(tmp_path / "metrics.jsonl", [1.0, 0.5], before=json.loads(json.dumps(before)))
    out = write_summary(tmp_path, records, None, None, {"dev": RANDOM}, steps=2, global_batch_size=4, world_size=1,
                        on_bad_image="error", skipped_examples=0, rejected_pairs=0, estimated_pairs=8)
    assert out["rows"]["dev: before training"]["ndcg@5"] == 0.2
    assert list(out["rows"]) == ["dev: random ranker (4 queries, 8 docs)", "dev: before training"]  # no train split
    assert "dev (before training): first relevant document's mean rank 5.0" in (tmp_path / "summary.md").read_text()


def _records(n):
    return [{"event": "train", "step": s, "loss": 2.0 + math.sin(s) / (1 + s / 10), "lr": 2e-4 * s / n,
             "global_batch_size": 8} for s in range(1, n + 1)]


def test_loss_windows_never_overlap():
    assert loss_windows([])[0] == "training loss: no steps"
    assert loss_windows([1.5]) == ("training loss: 1 step, 1.500", 1.5, 1.5)
    assert loss_windows([4.0, 3.0, 2.0, 1.0, 0.0]) == ("training loss: first 2 steps 3.500 -> last 2 steps 0.500", 3.5, 0.5)
    losses = [float(i) for i in range(600)]
    assert loss_windows(losses)[0] == "training loss: first 10 steps 4.500 -> last 10 steps 594.500"


def test_smooth_is_a_trailing_mean():
    assert smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert smooth([2.0, 4.0], 1) == [2.0, 4.0]


def test_the_smoothed_line_is_drawn_from_20_steps_on():
    assert [smoothing_window(n) for n in (1, 19, 20, 25, 39, 40, 100, 600)] == [1, 1, 2, 2, 2, 2, 5, 30]
    for n, drawn in ((19, False), (25, True)):
        fig = report_figure(_records(n), {})
        labels = [line.get_label() for line in fig.axes[0].get_lines()]
        assert ("mean of the last 2 steps" in labels) == drawn, labels
        plt.close(fig)


def test_without_evaluation_one_panel_no_table_and_no_warning(tmp_path, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "No artists with labels" would raise here
        write_summary(tmp_path, _records(5), None, None, {}, steps=5, global_batch_size=8, world_size=1,
                      on_bad_image="error", skipped_examples=0, rejected_pairs=0, estimated_pairs=8)
        path = tmp_path / "report.png"
        fig = report_figure(_records(5), {})
    text = (tmp_path / "summary.md").read_text()
    assert "no evaluation (--eval-before false, --eval-after false)" in text and "| |" not in text
    assert "trec_eval" not in text  # no table, no note on its metrics
    assert path.stat().st_size > 0
    assert [ax.get_title() for ax in fig.axes if ax.get_title()] == ["training"]  # loss axis (+ its lr twin) only
    plt.close(fig)


def test_bars_are_labelled_the_legend_is_outside_and_the_lr_axis_is_scientific():
    evals = {"dev: random ranker": {k: 0.003 for k in METRICS}, "dev: after training": {k: 0.9 for k in METRICS}}
    fig = report_figure(_records(100), evals)
    fig.canvas.draw()
    ax_loss, ax_bar, ax_lr = fig.axes  # subplots first, then the twin
    assert [line.get_label() for line in ax_loss.get_lines()][:2] == ["training loss", "mean of the last 5 steps"]
    assert ax_lr.yaxis.get_offset_text().get_text().replace("\u2212", "-") == "1e-4"  # 2e-4 peak: "x 1e-4" axis
    labels = [t.get_text() for t in ax_bar.texts]
    assert labels.count("0.00") == len(METRICS) and labels.count("0.90") == len(METRICS)
    legend = ax_bar.get_legend().get_window_extent()
    assert legend.x0 >= ax_bar.get_window_extent().x1  # right of the bar axes: covers no bar
    plt.close(fig)


@pytest.mark.parametrize("n", [1, 3])
def test_tiny_runs_plot(tmp_path, n):
    assert plot_run(_records(n), {}, tmp_path / "r.png").stat().st_size > 0


def test_a_resumed_runs_summary_covers_the_steps_before_the_resume(tmp_path):
    """Steps 1-6 logged, a crash after step 6, resumed from the step-4 checkpoint to step 10: the
    log keeps steps 1-4 (MetricsLog's resume), the loop logs a resume event and steps 5-10, and
    the loss windows run over steps 1-10, the line saying which steps they cover."""
    path = tmp_path / "metrics.jsonl"
    first_run = [3.0, 2.9, 2.8, 2.7, 9.0, 9.0]  # steps 5-6 are redone after the resume
    _log_with_training(path, first_run)
    log = MetricsLog(path, resume_step=4)
    log.write({"event": "resume", "step": 4})
    resumed = [2.0, 1.9, 1.8, 1.7, 1.6, 1.5]
    for step, loss in enumerate(resumed, 5):
        log.write({"event": "train", "step": step, "loss": loss, "lr": 1e-4, "global_batch_size": 4})
    out = write_summary(tmp_path, log.read(), None, None, {}, steps=10, global_batch_size=4, world_size=1,
                        on_bad_image="error", skipped_examples=0, rejected_pairs=0, estimated_pairs=8)
    losses = first_run[:4] + resumed
    assert out["loss_first"] == pytest.approx(sum(losses[:5]) / 5) and out["loss_last"] == pytest.approx(sum(losses[-5:]) / 5)
    assert ("training loss: first 5 steps 2.680 -> last 5 steps 1.700 (logged steps 1-10 of metrics.jsonl; "
            "resumed at step 4)") in (tmp_path / "summary.md").read_text()


def _negative_records(pairs):
    """Train records as the loop writes them with 2 hard negatives per pair: ``pairs`` per step."""
    return [{"event": "train", "step": s, "loss": 2.5 - 0.01 * s, "lr": 1e-4, "global_batch_size": 4,
             "rank_samples": [n // 2, n - n // 2], "hard_negatives": 2 * n, "chance_loss": math.log(3 * n)}
            for s, n in enumerate(pairs, 1)]


def test_the_chance_loss_line_counts_hard_negatives_and_says_when_steps_differ(tmp_path):
    common = dict(steps=3, global_batch_size=4, world_size=2, place="gloo, cpu", on_bad_image="error",
                  skipped_examples=0, rejected_pairs=0, estimated_pairs=12)
    write_summary(tmp_path, _negative_records([4, 4, 4]), None, None, {}, **common)
    text = (tmp_path / "summary.md").read_text()
    assert f"chance loss (every document scoring the same): ln(4 pairs + 8 hard negatives) = {math.log(12):.3f}" in text
    assert "ln(global batch)" not in text
    write_summary(tmp_path, _negative_records([4, 4, 2]), None, None, {}, **common)  # an epoch's last, smaller step
    assert (f"ln(pairs + hard negatives) of each step, {math.log(6):.3f}-{math.log(12):.3f} (metrics.jsonl chance_loss)"
            in (tmp_path / "summary.md").read_text())
    write_summary(tmp_path, _negative_records([4]), None, None, {}, **common, loss="pairwise")
    assert f"ln 2 = {math.log(2):.3f} (pairwise)" in (tmp_path / "summary.md").read_text()
    fig = report_figure(_negative_records([4, 4, 2]), {})
    chance = next(line for line in fig.axes[0].get_lines() if line.get_label() == "chance loss of each step")
    assert list(chance.get_ydata()) == pytest.approx([math.log(12), math.log(12), math.log(6)])
    plt.close(fig)


def test_report_png_has_integer_step_ticks_slanted_metric_names_and_a_header():
    evals = {"dev: before training": {k: 0.1 for k in METRICS}, "dev: after training": {k: 0.2 for k in METRICS}}
    fig = report_figure(_records(3), evals, title="run: steps 3, global batch 8, world size 1 (single process, cpu)")
    fig.canvas.draw()
    ax_loss, ax_bar = fig.axes[:2]
    ticks = [t for t in ax_loss.get_xticks() if ax_loss.get_xlim()[0] <= t <= ax_loss.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks)  # 3 steps: no 1.5 or 2.5
    names = ax_bar.get_xticklabels()
    assert [t.get_text() for t in names] == list(METRICS) and all(t.get_rotation() == 30 for t in names)
    assert fig._suptitle.get_text().endswith("world size 1 (single process, cpu)")
    plt.close(fig)
