"""``benchmarks/vs_sentence_transformers.py`` at its smallest: uniform pages, 1 process, batch 2,
3 steps, both sides (sentence-transformers' MultiVectorEncoderTrainer and ``raggedvl train``) from
the same exported folder, through the benchmark's own monitor, tables and dev evaluation; and its
presets' arguments."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

from tests.jobs import run_job

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

pytest.importorskip("sentence_transformers")

import vs_sentence_transformers  # noqa: E402


def test_loss_curves_preset_sets_the_run_and_flags_given_override_it():
    args = vs_sentence_transformers.parse_args(["--loss-curves"])
    got = {k: getattr(args, k) for k in vs_sentence_transformers.LOSS_CURVES}
    assert got == {"workload": ["a"], "nproc_a": [1], "per_device_batch": 8, "steps": 200, "lr": 5e-4, "warmup": 3,
                   "weight_decay": 0.0, "max_grad_norm": 1.0, "eval": True, "repeats": 1, "same_batches": True}
    assert "--false-negatives keep" in args.raggedvl_args  # sentence-transformers' objective, for step-by-step losses
    assert args.dev_pairs is None  # the workload's full dev set is scored
    [s] = vs_sentence_transformers.vs_colpali.configurations(args)
    assert (s.workload, s.nproc, s.global_batch, s.steps) == ("uniform", 1, 8, 200)
    args = vs_sentence_transformers.parse_args(["--loss-curves", "--steps", "5", "--no-eval", "--nproc-a", "2",
                                                "--no-same-batches"])
    assert (args.steps, args.eval, args.nproc_a, args.workload, args.same_batches) == (5, False, [2], ["a"], False)
    args = vs_sentence_transformers.parse_args([])
    assert (args.workload, args.nproc_a, args.steps, args.eval, args.repeats) == (["a", "b"], [1, 2], 10, False, 1)
    assert not args.same_batches and "--false-negatives" not in args.raggedvl_args


def test_same_batches_refuses_more_than_one_process(capsys):
    for argv in (["--loss-curves", "--nproc-a", "2"], ["--same-batches", "--workload", "b"]):
        with pytest.raises(SystemExit):
            vs_sentence_transformers.parse_args(argv)
        assert "--same-batches runs one process" in capsys.readouterr().err


def test_lora_runs_give_both_sides_colqwen2s_recipe():
    from colpali_bench import colpali_side, raggedvl_side
    from colpali_bench.settings import LORA_DROPOUT

    args = vs_sentence_transformers.parse_args(["--workload", "b", "--lora-r", "8"])
    [s] = vs_sentence_transformers.vs_colpali.configurations(args)
    assert s.lora_r == 8 and s.label == "heavy, 2 proc x 8, LoRA r8"
    cfg = raggedvl_side.validate_argv(raggedvl_side.train_argv(s, dataset="rdocs", output_dir="/nonexistent", extra=[]))
    assert cfg.lora is True and (cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout) == (8, 8, LORA_DROPOUT)
    spec = colpali_side.spec(s, train_parquet="x.parquet", out_dir="out", save_final=False)
    assert spec["lora"] == {"r": 8, "alpha": 8, "dropout": LORA_DROPOUT}
    [full] = vs_sentence_transformers.vs_colpali.configurations(vs_sentence_transformers.parse_args(["--workload", "b"]))
    assert full.lora_r is None and colpali_side.spec(full, train_parquet="x", out_dir="o", save_final=False)["lora"] is None
    assert raggedvl_side.validate_argv(raggedvl_side.train_argv(full, dataset="rdocs", output_dir="/x", extra=[])).lora is False


@pytest.mark.slow
def test_smallest_configuration_runs_both_sides_and_prints_both_rows(tmp_path):
    out = tmp_path / "results.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "vs_sentence_transformers.py"), "--workload", "a", "--nproc-a", "1",
           "--per-device-batch", "2", "--steps", "3", "--warmup", "1", "--train-pairs", "8", "--dev-pairs", "2",
           "--eval", "--same-batches", "--work-dir", str(tmp_path / "work"), "--json", str(out), "--report", str(tmp_path / "report.md")]
    # one training process per side, run one after the other: 600 s from launch, stretched by the
    # machine's measured slowdown (tests/jobs.py)
    result = run_job(cmd, ready=None, timeout=600, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    runs = {r["side"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"sentence-transformers", "raggedvl"}
    for side, run in runs.items():
        assert run["returncode"] == 0
        assert run["settings"]["model"].endswith("-st"), run["settings"]  # the exported folder, both sides
        assert [st["step"] for st in run["steps"]] == [1, 2, 3] and all(st["samples"] == 2 for st in run["steps"])
        assert run["samples_per_s"] > 0 and run["worker_rss_mib"] > 0 and run["pss_sum_mib"] > 0, side
        assert all(math.isfinite(st["loss"]) and st["loss"] > 0 for st in run["steps"]), side
    # the same pages at the same max_pixels: a batch of 2 is the same pixel rows on both sides (the
    # first 8 uniform pairs all resize to one grid, so the sample order does not matter; the HF
    # data loader collates one batch ahead, so sentence-transformers counts 3 or 4 batches)
    st, rv = runs["sentence-transformers"]["padding"], runs["raggedvl"]["padding"]
    assert rv["batches"] == 3 and st["batches"] in (3, 4)
    assert st["pixel_rows"] / st["batches"] == rv["pixel_rows"] / rv["batches"] > 0
    table = result.stdout.split("### uniform, 1 proc x 2")[1]
    rows = [line for line in table.splitlines() if line.startswith("| samples/s, steps 3..N |")]
    st_rate, rv_rate = (float(v) for v in rows[0].split("|")[2:4])
    assert st_rate > 0 and rv_rate > 0
    assert "| uniform, 1 proc x 2 |" in result.stdout.split("### raggedvl / sentence-transformers")[1]
    # --same-batches: sentence-transformers was fed raggedvl's batches and raggedvl ran its objective,
    # so step 1 (the same start weights, the same 2 pairs) gives the same loss up to fp32 summation
    # order, amplified by the scale 1/temperature = 50 (observed ~3e-5); a different batch or
    # objective moves it by ~0.05 or more. Later steps start from weights that differ by rounding.
    st_loss, rv_loss = (runs[side]["steps"][0]["loss"] for side in ("sentence-transformers", "raggedvl"))
    assert abs(st_loss - rv_loss) < 1e-3, (st_loss, rv_loss)
    assert "| max abs loss difference |" in result.stdout
    check_eval_and_losses(json.loads(out.read_text()), tmp_path / "report_losses.json", dev_pairs=2)


def check_eval_and_losses(results: dict, losses_json: Path, dev_pairs: int) -> None:
    """Both sides scored on the dev split from the same start weights; the sentence-transformers
    side's saved folder holds its trained weights; per-step losses written next to the report."""
    [sides] = results["eval"].values()
    st, rv = sides["sentence-transformers"], sides["raggedvl"]
    assert st["before"] == rv["before"] and st["before"]["n"] == dev_pairs  # one start folder, one evaluator
    for side in (st, rv):
        assert side["after"]["n"] == dev_pairs and 0 <= side["after"]["ndcg@5"] <= 1
    # three steps at lr 5e-4 move every weight: the document embeddings of the saved folder differ
    # from the start folder's (an untrained or unsaved model would give the before value exactly)
    assert st["after"]["doc_mean_cosine"] != st["before"]["doc_mean_cosine"]
    assert rv["after"]["doc_mean_cosine"] != rv["before"]["doc_mean_cosine"]
    losses = json.loads(losses_json.read_text())
    runs = {r["side"]: [s["loss"] for s in r["steps"]] for r in results["runs"]}
    assert losses == {f"{side} uniform, 1 proc x 2 repeat 1": runs[side] for side in runs}
