"""raggedvl vs sentence-transformers 6, side by side: the same training work through both, interleaved.

    python benchmarks/vs_sentence_transformers.py                 # (a) 1 and 2 processes, (b) 2 processes
    python benchmarks/vs_sentence_transformers.py --eval          # ... and dev retrieval before / after training
    python benchmarks/vs_sentence_transformers.py --loss-curves --report benchmarks/results/vs_sentence_transformers_loss_curves.md
                                                                  # (a) 1 x 8, 200 steps, the same batches on both sides,
                                                                  # dev retrieval, per-step losses JSON
    python benchmarks/vs_sentence_transformers.py --workload b --lora-r 32
                                                                  # ColQwen2's LoRA recipe (vision tower frozen) on both sides
    python benchmarks/vs_sentence_transformers.py --workload a --nproc-a 1 --steps 3 --per-device-batch 2 \\
        --train-pairs 8 --dev-pairs 4 --eval                      # a smoke run (a few minutes)

Both sides start from the same saved weights: ``raggedvl export MODEL --format
sentence-transformers`` of the checkpoint (default: the tiny ColQwen2 of ``colpali_bench``), a
``MultiVectorEncoder`` folder that sentence-transformers loads and ``raggedvl train --model``
loads back with the same tensors and prompts (docs/interop.md). They read the same pairs
(``colpali_bench/workloads.py``: (a) uniform pages, (b) the heavy-tailed mix) and get the same
settings: per-process and global batch, steps, AdamW learning rate, warm-up, weight decay,
gradient clipping, max_pixels, gloo, one thread per process, fp32, and the same objective:
sentence-transformers' ``MultiVectorMultipleNegativesRankingLoss(scale=1/temperature)`` with
MeanMaxSim is raggedvl's default late-interaction loss at ``temperature`` (query-length
normalisation on), with documents gathered across processes on both sides.

- sentence-transformers: its own training path (``MultiVectorEncoder``,
  ``MultiVectorEncoderTrainer``, its data collator with the folder's prompts, the multi-vector
  MNRL with ``gather_across_devices=True`` on 2 processes; ``st_bench/st_worker.py``), plain
  ``python`` for 1 process, torchrun for more. Where torchvision is missing the worker hands
  sentence-transformers raggedvl's torchvision-free processor of the same folder (the worker's
  docstring).
- raggedvl: ``python -m raggedvl.app.cli train`` with every setting as a flag (it starts torchrun);
  (b) with ``--packing true`` by default (``--raggedvl-args-b``).

Runs are interleaved (repeat r runs every configuration, the side order alternating); the tables
show medians over repeats and raggedvl / sentence-transformers ratios. The runs, the memory
monitor (peak RSS per process, whole-job summed PSS), the figures' definitions and the tables are
``vs_colpali.py``'s (``colpali_bench/procmon.py``, ``colpali_bench/summary.py``); the measuring
process imports no torch, transformers or datasets (``colpali_bench/isolated.py``).

With ``--same-batches`` (on in ``--loss-curves``; one process) sentence-transformers' trainer is
fed, through its ``batch_sampler`` argument, the global batches ``raggedvl train`` draws
(``colpali_bench.raggedvl_side.global_batches``: raggedvl's own sampler replayed for the run's
settings and seed), in order, and raggedvl runs with ``--false-negatives keep``, the objective of
sentence-transformers' MNRL (a page that two queries of a batch share stays a negative of
both). Both sides then see the same samples at every step from the same weights, so their
losses compare step by step (the report's "max abs loss difference" table).

With ``--eval`` (on in ``--loss-curves``) both sides are scored on the workload's dev split
(``--dev-pairs``, default the workload's full dev set) by the same code, raggedvl's evaluator
(``colpali_bench.raggedvl_side.evaluate``: its model loader, collator with the folder's prompts,
MaxSim and metrics, trec_eval tie order): before training, the shared start folder; after, repeat
1's final weights of each side: the folder the sentence-transformers run saved with
``MultiVectorEncoder.save_pretrained`` (raggedvl's loader reads sentence-transformers folders) and
raggedvl's run directory on the start folder. Per-step losses of every run go to
``--losses-json`` (default: next to ``--report``, else in the work directory).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import vs_colpali  # noqa: E402
from colpali_bench import isolated, summary  # noqa: E402
from colpali_bench.settings import RunSettings, default_model  # noqa: E402
from st_bench import st_side  # noqa: E402

REPO = HERE.parent
ST = "sentence-transformers"
SIDES = (ST, "raggedvl")
LOSS_CURVES = {"workload": ["a"], "nproc_a": [1], "per_device_batch": 8, "steps": 200, "lr": 5e-4, "warmup": 3,
               "weight_decay": 0.0, "max_grad_norm": 1.0, "eval": True, "repeats": 1, "same_batches": True}
DEFAULTS = {"workload": ["a", "b"], "nproc_a": [1, 2], "per_device_batch": 8, "steps": 10, "lr": 5e-4, "warmup": 3,
            "weight_decay": 0.0, "max_grad_norm": 1.0, "eval": False, "repeats": 1, "same_batches": False}
# sentence-transformers' MNRL keeps a page shared by two queries of a batch as a negative of both;
# raggedvl's default masks it. Runs that compare losses step by step give raggedvl the same objective.
SAME_OBJECTIVE = "--false-negatives keep"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", nargs="+", choices=["a", "b"], default=None,
                   help="a: uniform pages on --nproc-a processes; b: heavy-tailed mix on 2 processes (default: both)")
    p.add_argument("--loss-curves", action="store_true",
                   help="loss-curve preset: workload a, 1 process x 8, 200 steps, lr 5e-4, warm-up 3, weight decay 0, "
                        "clipping 1.0, --same-batches, dev retrieval before/after, per-step losses saved (flags given "
                        "override it)")
    p.add_argument("--same-batches", dest="same_batches", action="store_true", default=None,
                   help="one process only: sentence-transformers is fed the global batches raggedvl's sampler draws, in "
                        f"its order, and raggedvl gets {SAME_OBJECTIVE!r} (sentence-transformers' objective), so both "
                        "sides see the same samples at every step and their losses compare step by step")
    p.add_argument("--no-same-batches", dest="same_batches", action="store_false")
    p.add_argument("--model", default=None, help="checkpoint both sides start from, exported to the sentence-transformers "
                   "format first (default: the tiny ColQwen2 of colpali_bench.settings.default_model)")
    p.add_argument("--nproc-a", type=int, nargs="+", default=None, help="process counts of workload (a) (default 1 2)")
    p.add_argument("--per-device-batch", type=int, default=None, help="samples per process per step (default 8)")
    p.add_argument("--global-batch-b", type=int, default=16, help="global batch of workload (b), on 2 processes")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 10: a short run; >= 3)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved repeats of every configuration (default 1)")
    p.add_argument("--lr", type=float, default=None, help="AdamW peak lr, backbone and head (default 5e-4)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3)")
    p.add_argument("--weight-decay", type=float, default=None, help="default 0")
    p.add_argument("--max-grad-norm", type=float, default=None, help="gradient clipping (default 1.0)")
    p.add_argument("--temperature", type=float, default=0.02,
                   help="raggedvl's temperature; sentence-transformers gets scale = 1 / temperature with MeanMaxSim")
    p.add_argument("--seed", type=int, default=0, help="raggedvl's seed (init, sampler order, dropout) and the HF "
                   "Trainer's (its data order, dropout) (default 0)")
    p.add_argument("--lora-r", type=int, default=None,
                   help="LoRA of this rank on the language model, vision tower frozen (ColQwen2's recipe, on both sides; "
                        "alpha = r, dropout 0.1); default: full fine-tuning")
    p.add_argument("--raggedvl-args", default="", help="extra `raggedvl train` flags, one shell-quoted string")
    p.add_argument("--raggedvl-args-b", default="--packing true",
                   help="extra `raggedvl train` flags for workload (b) only (default: %(default)s; '' runs the padded path)")
    p.add_argument("--train-pairs", type=int, default=None, help="override the workloads' training pairs (smoke runs)")
    p.add_argument("--eval", dest="eval", action="store_true", default=None,
                   help="dev retrieval of both sides before/after training (repeat 1), by raggedvl's evaluator")
    p.add_argument("--no-eval", dest="eval", action="store_false")
    p.add_argument("--dev-pairs", type=int, default=None,
                   help="override the workloads' dev pairs, the split --eval scores (default: the full dev set)")
    p.add_argument("--work-dir", default=str(Path.home() / ".cache" / "raggedvl" / "vs_sentence_transformers"),
                   help="the exported start folder, workloads, run directories and logs (outside the repository)")
    p.add_argument("--report", default=None, help="also write the printed report (markdown) here")
    p.add_argument("--json", default=None, help="all figures as JSON (default WORK_DIR/results-<time>.json)")
    p.add_argument("--losses-json", default=None, help="per-step losses of every run (default: REPORT's name with "
                   "_losses.json next to --report, else WORK_DIR/losses-<time>.json)")
    p.add_argument("--run-timeout", type=float, default=3600.0, help="seconds before a run is killed")
    args = p.parse_args(argv)
    for key, value in (LOSS_CURVES if args.loss_curves else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.model = args.model or default_model()
    args.head_lr = None
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.lora_r is not None and args.lora_r < 1:
        p.error(f"--lora-r must be >= 1, got {args.lora_r}")
    if args.same_batches:
        if "b" in args.workload or any(n != 1 for n in args.nproc_a):
            p.error("--same-batches runs one process (workload a with --nproc-a 1): sentence-transformers' trainer "
                    "would shard the planned batches over processes its own way")
        args.raggedvl_args = f"{args.raggedvl_args} {SAME_OBJECTIVE}".strip()
    return args


def export_start(model: str, work: Path) -> Path:
    """``raggedvl export model --format sentence-transformers`` into ``work`` (reused when the
    folder for this checkpoint path is already there): the weights both sides start from."""
    out = work / f"start-{Path(model).name}-{hashlib.sha256(str(Path(model).resolve()).encode()).hexdigest()[:8]}-st"
    if not (out / "modules.json").is_file():
        cmd = [sys.executable, "-m", "raggedvl.app.cli", "export", model, "--format", "sentence-transformers", "--output", str(out)]
        subprocess.run(cmd, env=vs_colpali.child_env(), check=True, capture_output=True, text=True)
    return out


def dev_retrieval(configs: list[RunSettings], results: dict, data: dict[str, Path], start: Path) -> dict:
    """Dev metrics of both sides per configuration, all from ``raggedvl_side.evaluate``: before,
    the start folder (scored once per workload, the same weights for both sides); after, the first
    successful run's final weights of each side (the folder the sentence-transformers run saved;
    raggedvl's run directory loaded on the start folder). None for a side without a successful run."""
    def evaluate(s: RunSettings, model: str, run: str | None) -> dict:
        return isolated.call("colpali_bench.raggedvl_side.evaluate", model, run, str(data[s.workload] / "dev.parquet"),
                             s.max_pixels, s.seed, env=vs_colpali.child_env())

    evals, before = {}, {}
    for s in configs:
        first = {side: next((r for r in results[s.label][side] if r["returncode"] == 0), None) for side in SIDES}
        key = (s.workload, s.max_pixels, s.seed)
        if key not in before:
            before[key] = evaluate(s, str(start), None)
        after = {ST: first[ST] and evaluate(s, first[ST]["run_dir"] + "/final", None),
                 "raggedvl": first["raggedvl"] and evaluate(s, str(start), first["raggedvl"]["run_dir"] + "/run")}
        evals[s.label] = {side: {"before": before[key], "after": after[side]} for side in SIDES}
    return evals


def header(args) -> list[str]:
    return vs_colpali.run_header(
        "vs_sentence_transformers",
        ("torch", "torchvision", "transformers", "sentence-transformers", "accelerate", "datasets"),
        [f"objective: raggedvl temperature {args.temperature} with query-length normalisation = sentence-transformers "
         f"scale {1 / args.temperature:g} with MeanMaxSim; documents gathered across processes on both sides"], args)


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    lines = header(args)
    print("\n".join(lines), flush=True)
    start = export_start(args.model, work)
    args.raggedvl_model = str(start)  # raggedvl trains from the same exported folder
    configs = [RunSettings(**{**s.to_dict(), "model": str(start)}) for s in vs_colpali.configurations(args)]
    lines.append(f"start weights: `raggedvl export {args.model} --format sentence-transformers` -> {start} (both sides)")
    print(lines[-1], flush=True)
    data = {name: Path(isolated.call("colpali_bench.workloads.build_workload", name, work / "workloads",
                                      train_pairs=args.train_pairs, dev_pairs=args.dev_pairs, env=vs_colpali.child_env()))
            for name in sorted({s.workload for s in configs})}
    for name in sorted(data):
        lines += ["", isolated.call("colpali_bench.workloads.describe", data[name], env=vs_colpali.child_env())]
    if args.same_batches:
        args.planned_batches = {s.label: isolated.call("colpali_bench.raggedvl_side.global_batches", s,
                                                       str(data[s.workload] / "train.parquet"),
                                                       vs_colpali.raggedvl_extra(args, s), env=vs_colpali.child_env())
                                for s in configs}
        lines.append(f"same batches: sentence-transformers is fed raggedvl's global batches (its sampler, seed "
                     f"{args.seed}) in order; raggedvl runs with {SAME_OBJECTIVE} (sentence-transformers' objective)")
    results: dict[str, dict[str, list]] = {s.label: {side: [] for side in SIDES} for s in configs}
    for rep in range(args.repeats):
        for i, s in enumerate(configs):
            for side in SIDES if (rep + i) % 2 == 0 else reversed(SIDES):
                print(f"[repeat {rep + 1}/{args.repeats}] {s.label}: {side} ({vs_colpali.load_average()})", flush=True)
                run_dir = work / "runs" / stamp / f"{s.workload}-{s.nproc}x{s.per_device_batch}-{side}-r{rep}"
                rec = vs_colpali.run_one(side, s, data[s.workload], run_dir, args, incumbent=st_side)
                results[s.label][side].append(rec | {"repeat": rep})
    lines += ["", f"load at the end of the training runs: {vs_colpali.load_average()}", ""]
    summary_lines = [summary.SUMMARY_HEADER.replace("| configuration |", f"| raggedvl / {ST} |")]
    for s in configs:
        ok = {side: [r for r in results[s.label][side] if r["returncode"] == 0] for side in SIDES}
        lines += [f"### {s.label} (global batch {s.global_batch}, {s.steps} steps, max_pixels {s.max_pixels:,})", "",
                  summary.comparison_table(ok[ST], ok["raggedvl"], incumbent=ST), "",
                  summary.loss_curve(ok[ST], ok["raggedvl"], incumbent=ST), ""]
        if args.same_batches:
            lines += [summary.loss_gap(ok[ST], ok["raggedvl"], incumbent=ST), ""]
        summary_lines.append(summary.summary_row(s.label, ok[ST], ok["raggedvl"]))
    lines += [f"### raggedvl / {ST} (medians of repeats)", "", *summary_lines, ""]
    extra: dict = {}
    if args.eval:
        print(f"dev retrieval of both sides ({vs_colpali.load_average()})", flush=True)
        extra["eval"] = dev_retrieval(configs, results, data, start)
        lines += ["### dev retrieval (repeat 1; both sides scored by the same code: raggedvl's evaluator, model loader, "
                  "MaxSim and metrics, trec_eval tie order; before = the shared start folder)", "",
                  summary.eval_table(extra["eval"]), ""]
    report = "\n".join(lines)
    print("\n" + report, flush=True)
    if args.report:
        Path(args.report).write_text(report + "\n")
    all_runs = [r for sides in results.values() for runs in sides.values() for r in runs]
    Path(args.json or work / f"results-{stamp}.json").write_text(
        json.dumps({"header": lines[:6], "runs": all_runs, **extra}, default=str) + "\n")
    default_losses = Path(args.report).with_name(Path(args.report).stem + "_losses.json") if args.report else work / f"losses-{stamp}.json"
    losses_path = Path(args.losses_json or default_losses)
    losses_path.write_text(json.dumps(vs_colpali.per_step_losses(all_runs), indent=1) + "\n")
    print(f"per-step losses: {losses_path}", flush=True)
    return 1 if any(r["returncode"] != 0 for r in all_runs) else 0


if __name__ == "__main__":
    sys.exit(main())
