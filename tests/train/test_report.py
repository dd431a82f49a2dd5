"""write_summary: the run report of `raggedvl train` (summary.md, report.png, the printed copy)
from the metrics log and the evaluations, including a resumed run whose pre-training evaluation
is only in the log."""

import json
import math

from raggedvl.train.report import MetricsLog, write_summary


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
                        global_batch_size=4, world_size=2, on_bad_image="skip", skipped_examples=3, rejected_pairs=1, estimated_pairs=16)
    text = (tmp_path / "summary.md").read_text()
    assert out["loss_first"] == sum(losses[:5]) / 5 and out["loss_last"] == sum(losses) / len(losses)
    assert f"ln(global batch) = {math.log(4):.3f}" in text and "world size 2" in text
    assert "examples skipped for bad images (on_bad_image='skip'): 3" in text
    assert "rejected by the size estimate (image header unreadable or out of limits): 1 of 16" in text
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
    assert "dev (after training): first relevant document's mean rank 4.3" in text and "at chance" in text
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
