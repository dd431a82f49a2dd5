"""raggedvl vs colpali-engine, side by side: the same training work through both, interleaved.

    benchmarks/vs_colpali.sh                       # everything: (a), (b), (c); builds its own venv
    benchmarks/vs_colpali.sh --workload a --steps 5 --repeats 1     # a smoke run
    benchmarks/vs_colpali.sh --loss-curves             # 200 steps, 2 x 8, both loss curves, per-step losses JSON
    benchmarks/vs_colpali.sh --workload b --lora-r 32 --no-eval   # ColQwen2's LoRA recipe (vision tower frozen), both sides
    python benchmarks/vs_colpali.py --check        # no bench venv: arguments, workloads, plan, simulation

colpali-engine needs torchvision, which does not install beside the CPU torch that ``make
install`` pins, so the measurement runs in the venv ``vs_colpali.sh`` builds (torch 2.14.1 for
both libraries). Both sides start from the same checkpoint (default: the tiny ColQwen2 that
colpali-engine saved, ``shared/interop/colqwen2-tiny/colqwen2_full``), read the same pairs (one
parquet per split, rendered from the vendored R manuals: ``colpali_bench/workloads.py``) and get
the same settings: per-process and global batch, steps, AdamW learning rate (backbone and head),
warm-up steps, weight decay, gradient clipping, temperature, query-length normalisation (both
default on), max_pixels, gloo, one thread per process (OMP_NUM_THREADS=1), fp32; full
fine-tuning, or with ``--lora-r`` LoRA on the language model with the vision tower frozen
(colpali-engine's ColQwen2 recipe, ``colpali_bench/colpali_worker.py``; raggedvl's ``--lora``).

- colpali-engine: its own training path (``ColQwen2``, ``ColQwen2Processor``,
  ``VisualRetrieverCollator``, ``ColbertLoss``, ``ContrastiveTrainer`` with HF
  ``TrainingArguments``; ``colpali_bench/colpali_worker.py``), plain ``python`` for 1 process,
  torchrun for more.
- raggedvl: ``python -m raggedvl.app.cli train`` with every setting as a flag (it starts torchrun).

Workloads: (a) uniform rdocs pages, max_pixels 200,704, per-process batch 8, 1 and 2 processes;
(b) heavy-tailed document mix, max_pixels 1,003,520, 2 processes, global batch 16; (c) W = 8 and
64 simulated from per-sample step costs measured on (b) (``colpali_bench/simulate.py``).
Runs are interleaved (repeat r runs every configuration, the side order alternating) and each
table shows medians over repeats and raggedvl / colpali-engine ratios; definitions of every
figure are in ``colpali_bench/summary.py``. Whole-job memory samples every process of the
command (launcher, torchrun, workers) with psutil (``colpali_bench/procmon.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from colpali_bench import colpali_side, isolated, raggedvl_side, summary  # noqa: E402
from colpali_bench.settings import RunSettings, default_model  # noqa: E402
from colpali_bench.workloads import WORKLOADS, build_workload, describe, load_sizes  # noqa: E402

REPO = HERE.parent
LOSS_CURVES = {"workload": ["a"], "nproc_a": [2], "per_device_batch": 8, "steps": 200, "lr": 5e-4, "warmup": 3,
           "weight_decay": 0.0, "max_grad_norm": 1.0, "eval": True, "repeats": 1}
DEFAULTS = {"workload": ["a", "b", "c"], "nproc_a": [1, 2], "per_device_batch": 8, "steps": 30, "lr": 5e-4,
            "warmup": 3, "weight_decay": 0.0, "max_grad_norm": 1.0, "eval": False, "repeats": 2}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", nargs="+", choices=["a", "b", "c", "all"], default=None,
                   help="a: uniform pages; b: heavy-tailed mix, 2 processes; c: W=8/64 simulated from (b) (default: all)")
    p.add_argument("--loss-curves", action="store_true",
                   help="loss-curve preset: workload a, 2 processes x 8, 200 steps, lr 5e-4, warm-up 3, weight decay 0, "
                        "clipping 1.0, dev nDCG before/after, per-step losses saved (flags given override it)")
    p.add_argument("--check", action="store_true", help="validate arguments, workloads, commands and the simulation "
                   "without colpali-engine, in the project's own venv (about 30 s of CPU); starts no training")
    p.add_argument("--model", default=None, help="checkpoint both sides start from (default: %(default)s -> the colpali fixture)")
    p.add_argument("--nproc-a", type=int, nargs="+", default=None, help="process counts of workload (a) (default 1 2)")
    p.add_argument("--per-device-batch", type=int, default=None, help="samples per process per step (default 8)")
    p.add_argument("--global-batch-b", type=int, default=16, help="global batch of workload (b), on 2 processes")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 30)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved repeats of every configuration (default 2)")
    p.add_argument("--lr", type=float, default=None, help="AdamW peak lr of the backbone (default 5e-4)")
    p.add_argument("--head-lr", type=float, default=None, help="of the projection head (default: --lr)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 3)")
    p.add_argument("--weight-decay", type=float, default=None, help="default 0")
    p.add_argument("--max-grad-norm", type=float, default=None, help="gradient clipping (default 1.0)")
    p.add_argument("--temperature", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0, help="raggedvl's seed (init, sampler order, dropout) and the HF "
                   "Trainer's (its data order, dropout) (default 0)")
    p.add_argument("--lora-r", type=int, default=None,
                   help="LoRA of this rank on the language model, vision tower frozen (ColQwen2's recipe, on every side; "
                        "alpha = r, dropout 0.1); default: full fine-tuning")
    p.add_argument("--eval", dest="eval", action="store_true", default=None, help="dev nDCG@5 before/after (repeat 0)")
    p.add_argument("--no-eval", dest="eval", action="store_false")
    p.add_argument("--sides", nargs="+", choices=["colpali", "raggedvl"], default=["colpali", "raggedvl"])
    p.add_argument("--raggedvl-args", default="", help="extra `raggedvl train` flags, one shell-quoted string")
    p.add_argument("--raggedvl-args-b", default="--packing true",
                   help="extra `raggedvl train` flags for workload (b) only, after --raggedvl-args (default: "
                        "%(default)s, the padding-free path BENCHMARKS.md section 11 recommends for heavy-tailed "
                        "mixes; '' runs raggedvl's default padded path)")
    p.add_argument("--sim-worlds", type=int, nargs="+", default=[2, 8, 64], help="W values of workload (c)")
    p.add_argument("--sim-steps", type=int, default=200)
    p.add_argument("--cost-pairs", type=int, default=None, help="time only the first N pairs of (b) for (c) (default all)")
    p.add_argument("--cost-repeats", type=int, default=2)
    p.add_argument("--train-pairs", type=int, default=None, help="override the workloads' training pairs (smoke runs)")
    p.add_argument("--dev-pairs", type=int, default=None, help="override the workloads' dev pairs")
    p.add_argument("--work-dir", default=str(Path.home() / ".cache" / "raggedvl" / "vs_colpali"),
                   help="workloads, run directories and logs (outside the repository)")
    p.add_argument("--report", default=None, help="also write the printed report (markdown) here")
    p.add_argument("--json", default=None, help="all figures as JSON (default WORK_DIR/results-<time>.json)")
    p.add_argument("--losses-json", default=None, help="per-step losses of every run (default WORK_DIR/losses-<time>.json)")
    p.add_argument("--run-timeout", type=float, default=3600.0, help="seconds before a run is killed")
    args = p.parse_args(argv)
    preset = LOSS_CURVES if args.loss_curves else DEFAULTS
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if "all" in args.workload:
        args.workload = ["a", "b", "c"]
    args.model = args.model or default_model()
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.lora_r is not None and args.lora_r < 1:
        p.error(f"--lora-r must be >= 1, got {args.lora_r}")
    return args


def configurations(args) -> list[RunSettings]:
    """Every trained configuration (workloads a and b) with its settings (validated)."""
    common = dict(model=args.model, steps=args.steps, lr=args.lr, head_lr=args.head_lr, warmup_steps=args.warmup,
                  weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm, temperature=args.temperature,
                  seed=args.seed, lora_r=args.lora_r)
    out = []
    if "a" in args.workload:
        for n in args.nproc_a:
            out.append(RunSettings(workload="uniform", nproc=n, per_device_batch=args.per_device_batch,
                                   max_pixels=WORKLOADS["uniform"].max_pixels, **common))
    if "b" in args.workload:
        if args.global_batch_b % 2:
            raise ValueError(f"--global-batch-b must be even (2 processes), got {args.global_batch_b}")
        out.append(RunSettings(workload="heavy", nproc=2, per_device_batch=args.global_batch_b // 2,
                               max_pixels=WORKLOADS["heavy"].max_pixels, **common))
    return out


def raggedvl_extra(args, s: RunSettings) -> list[str]:
    """The extra ``raggedvl train`` flags of configuration ``s``: ``--raggedvl-args``, then, for
    workload (b), ``--raggedvl-args-b``."""
    return shlex.split(args.raggedvl_args) + (shlex.split(args.raggedvl_args_b) if s.workload == "heavy" else [])


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "warning",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))})
    return env


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} cores"


# ----------------------------------------------------------------------------- one run
def run_one(side: str, s: RunSettings, data_dir: Path, run_dir: Path, args, incumbent=colpali_side) -> dict:
    """One monitored run of ``side`` ("raggedvl" or the other library, whose ``spec``, ``command``
    and ``read_run`` are ``incumbent``'s: ``colpali_side`` or ``st_bench.st_side``) and its figures.
    ``args.planned_batches`` (optional, configuration label -> row batches) goes into the other
    side's spec as ``batches``: the rows of every step, in order."""
    from colpali_bench.procmon import run_monitored

    run_dir.mkdir(parents=True, exist_ok=False)
    held = isolated.held_heavy_modules()
    if held:  # a page shared with this process would lower the job's PSS (colpali_bench/isolated.py)
        raise RuntimeError(f"the benchmark process has imported {held}: memory figures would be understated")
    train = str(data_dir / "train.parquet")
    if side != "raggedvl":
        spec_path = run_dir / "spec.json"
        spec = incumbent.spec(s, train_parquet=train, out_dir=str(run_dir), save_final=True)
        batches = getattr(args, "planned_batches", {}).get(s.label)  # raggedvl's batches, to feed the same samples
        spec_path.write_text(json.dumps(spec | ({"batches": batches} if batches else {})))
        cmd = incumbent.command(s, str(spec_path))
    else:
        s = dataclasses.replace(s, model=args.raggedvl_model)
        cmd = raggedvl_side.command(s, dataset=train, output_dir=str(run_dir / "run"), extra=raggedvl_extra(args, s))
    outcome = run_monitored(cmd, env=child_env(), log_path=str(run_dir / "log.txt"), timeout_s=args.run_timeout, cwd=str(run_dir))
    rec = {"side": side, "settings": s.to_dict(), "cmd": cmd, "returncode": outcome.returncode, "wall_s": outcome.wall_s,
           "run_dir": str(run_dir), "memory": outcome.memory.to_dict(), "load_after": os.getloadavg()}
    if outcome.returncode != 0:
        tail = (run_dir / "log.txt").read_text()[-3000:]
        print(f"  {side} FAILED (exit {outcome.returncode}); log tail:\n{tail}", flush=True)
        return rec
    parsed = incumbent.read_run(run_dir, s.global_batch) if side != "raggedvl" else raggedvl_side.read_run(run_dir / "run")
    steps = parsed["steps"]
    mem = outcome.memory
    rec.update({
        "steps": steps, "samples_per_s": summary.samples_per_s(steps),
        "loop_s": steps[-1]["t"] if steps else float("nan"),
        "worker_rss_mib": mem.peak_rss("worker") / 2**20,
        "launcher_rss_mib": mem.peak_rss("launcher") / 2**20 if mem.count("launcher") else float("nan"),
        "torchrun_rss_mib": mem.peak_rss("torchrun") / 2**20 if mem.count("torchrun") else float("nan"),
        "pss_sum_mib": mem.peak_pss_sum / 2**20,
        "phases": parsed.get("phases"), "optimizer": parsed.get("optimizer"),
    })
    rec["loss"] = summary.loss_summary([st["loss"] for st in steps], s.global_batch)
    rec.update({f"loss_{k}": float(v) for k, v in rec["loss"].items() if k in ("first", "first5", "last10", "min", "last", "at_chance")})
    rec["s_per_step"] = s.global_batch / rec["samples_per_s"] if rec["samples_per_s"] else float("nan")
    rec["outside_s"] = rec["wall_s"] - rec["loop_s"]
    padding = parsed.get("padding") or isolated.call("colpali_bench.raggedvl_side.token_padding", s, train,
                                                      extra=raggedvl_extra(args, s), env=child_env())
    rec["padding"] = padding
    pct = summary.padding_pct(padding)
    rec.update({"pixel_pad_pct": pct["pixel_rows"], "doc_pad_pct": pct["doc_tokens"], "query_pad_pct": pct["query_tokens"]})
    print(f"  {side}: {rec['samples_per_s']:.2f} samples/s, wall {rec['wall_s']:.1f} s, outside loop {rec['outside_s']:.1f} s, "
          f"loss {rec['loss']['first5']:.3f} -> {rec['loss']['last10']:.3f}", flush=True)
    return rec


# ----------------------------------------------------------------------------- (c)
def measure_costs(data_dir: Path, s: RunSettings, args, out: Path) -> dict:
    spec = {"settings": s.to_dict(), "train_parquet": str(data_dir / "train.parquet"), "out": str(out),
            "repeats": args.cost_repeats, "limit": args.cost_pairs}
    spec_path = out.with_suffix(".spec.json")
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, str(HERE / "colpali_bench" / "sample_costs.py"), "--spec", str(spec_path)]
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, env=child_env(), stdout=log, stderr=subprocess.STDOUT, check=True, timeout=args.run_timeout)
    return json.loads(out.read_text())


def simulation_report(costs: dict, args, source: str) -> tuple[str, list]:
    import numpy as np

    from colpali_bench.simulate import format_rows, simulate

    t, c = np.array(costs["measured_s"]), np.array(costs["estimated_cost"])
    rows = [simulate(t, c, w, args.per_device_batch, steps=args.sim_steps, seed=args.seed) for w in args.sim_worlds]
    spread = f"per-sample cost: {len(t)} pairs, median {np.median(t) * 1e3:.1f} ms, max {t.max() * 1e3:.1f} ms, max/median {t.max() / np.median(t):.1f}"
    return format_rows(rows, source) + "\n\n" + spread, [r.__dict__ | {"speedup": r.speedup} for r in rows]


# ----------------------------------------------------------------------------- check mode
def check(args) -> int:
    """Everything but training, in the project's own venv: settings, the exact command lines
    (raggedvl's through its own parser and config validation; colpali's TrainingArguments),
    both workloads at a few pairs, raggedvl's token-padding replay and the (c) simulation on the
    sampler's cost estimates standing in for measured times."""
    configs = configurations(args)
    print(f"check: {len(configs)} trained configuration(s): " + "; ".join(s.label for s in configs))
    for s in configs:
        argv = raggedvl_side.train_argv(s, dataset="train.parquet", output_dir="runs/x", extra=raggedvl_extra(args, s))
        cfg = raggedvl_side.validate_argv(argv)
        if (cfg.global_batch_size, cfg.max_steps, cfg.max_pixels) != (s.global_batch, s.steps, s.max_pixels):
            raise ValueError(f"raggedvl config {cfg} does not carry the settings {s}")
        spec = colpali_side.spec(s, train_parquet="train.parquet", out_dir=tempfile.gettempdir(), save_final=True)
        targs = colpali_side.training_arguments({**spec, "nproc": 1})  # one process here: no gloo group to join
        if (cfg.warmup_steps, cfg.lr_schedule) != (targs.warmup_steps, str(targs.lr_scheduler_type.value)):
            raise ValueError(f"raggedvl's schedule ({cfg.lr_schedule}, warm-up {cfg.warmup_steps}) differs from the HF "
                             f"Trainer's ({targs.lr_scheduler_type.value}, warm-up {targs.warmup_steps})")
        print(f"check: {s.label}: raggedvl train flags valid (global batch {cfg.global_batch_size}, lr {cfg.lr}, "
              f"head lr {cfg.head_lr}, warm-up {cfg.warmup_steps}, schedule {cfg.lr_schedule}); colpali TrainingArguments "
              f"valid (lr {targs.learning_rate}, warm-up {targs.warmup_steps}, schedule {targs.lr_scheduler_type.value})")
    root = Path(tempfile.mkdtemp(prefix="vs_colpali_check-"))
    n_train, n_dev = args.train_pairs or 12, args.dev_pairs or 4
    model_ok = Path(args.model, "config.json").is_file()
    if model_ok:
        args.model, note = raggedvl_side.adapt_processor(args.model, root, WORKLOADS["uniform"].max_pixels)
        print(f"check: raggedvl's processor: {note}")
    for name in ("uniform", "heavy"):
        t0 = time.perf_counter()
        data = build_workload(name, root, train_pairs=n_train, dev_pairs=n_dev)
        print(f"check: built workload {name} ({n_train} + {n_dev} pairs) in {time.perf_counter() - t0:.1f} s")
        print(describe(data))
        if model_ok:
            s = RunSettings(workload=name, model=args.model, nproc=2, per_device_batch=2, steps=3, lr=args.lr,
                            head_lr=args.head_lr, warmup_steps=args.warmup, weight_decay=args.weight_decay,
                            max_grad_norm=args.max_grad_norm, temperature=args.temperature,
                            max_pixels=WORKLOADS[name].max_pixels, seed=args.seed)
            pct = summary.padding_pct(raggedvl_side.token_padding(s, str(data / "train.parquet"), extra=raggedvl_extra(args, s)))
            print(f"check: raggedvl padding replay on {name}: doc tokens {pct['doc_tokens']:.1f} %, "
                  f"query tokens {pct['query_tokens']:.1f} %, pixel rows {pct['pixel_rows']:.1f} %")
    if not model_ok:
        print(f"check: {args.model} not found: padding replay skipped")
    from raggedvl.images import ImagePolicy
    from raggedvl.sampling import estimate_costs

    sizes = [(w, h) for w, h, _ in load_sizes(data)]
    est = estimate_costs(sizes, 32, policy=ImagePolicy(max_pixels=WORKLOADS["heavy"].max_pixels)).costs
    text, _ = simulation_report({"measured_s": (est / est.max()).tolist(), "estimated_cost": est.tolist()},
                                argparse.Namespace(**{**vars(args), "sim_steps": 20}), "cost estimates as stand-in times")
    print(text)
    print("check: ok")
    return 0


# ----------------------------------------------------------------------------- main
def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` ("unknown CPU" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def run_header(title: str, packages: tuple[str, ...], details: list[str], args) -> list[str]:
    """The report's first lines: the run, the machine (CPU model: the kernels differ by
    family), the ``packages``' versions, ``details``, the command and raggedvl's extra flags."""
    import importlib.metadata as md

    versions = []
    for name in packages:
        try:
            versions.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            versions.append(f"{name} missing")
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return [
        f"{title} {datetime.datetime.now().isoformat(timespec='seconds')}, raggedvl {commit or '?'} ({REPO})",
        f"machine: {platform.machine()}, {cpu_model()}, {os.cpu_count()} cores, {load_average()} at start",
        "packages: " + ", ".join(versions),
        *details,
        f"command: {' '.join(shlex.quote(a) for a in [sys.executable, *sys.argv])}",
        f"raggedvl's extra flags: (a) {args.raggedvl_args!r}, (b) {(args.raggedvl_args + ' ' + args.raggedvl_args_b).strip()!r}",
    ]


def per_step_losses(runs: list[dict]) -> dict[str, list[float]]:
    """The per-step global-batch losses of every run, keyed "SIDE CONFIGURATION repeat N" (a
    failed run has none)."""
    return {f"{r['side']} {RunSettings(**r['settings']).label} repeat {r['repeat'] + 1}": [st["loss"] for st in r.get("steps", [])]
            for r in runs}


def header(args) -> list[str]:
    return run_header("vs_colpali", ("torch", "torchvision", "transformers", "colpali-engine", "peft", "accelerate"),
                      [f"checkpoint: {args.model}"], args)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.check:
        return check(args)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    lines = header(args)
    print("\n".join(lines), flush=True)
    # everything that imports torch, transformers or datasets runs in a child process (isolated.py)
    args.raggedvl_model, note = isolated.call("colpali_bench.raggedvl_side.adapt_processor", args.model, work,
                                              WORKLOADS["uniform"].max_pixels, env=child_env())
    head = isolated.call("colpali_bench.raggedvl_side.head_matches_checkpoint", args.raggedvl_model,
                         WORKLOADS["uniform"].max_pixels, env=child_env())
    lines += [f"raggedvl's processor: {note}", f"raggedvl's projection head: {head}",
              "measuring process: holds no torch, transformers, datasets or pyarrow (no page shared with a job)"]
    print("\n".join(lines[-2:]), flush=True)
    configs = configurations(args)
    needed = {s.workload for s in configs} | ({"heavy"} if "c" in args.workload else set())
    data = {name: Path(isolated.call("colpali_bench.workloads.build_workload", name, work / "workloads",
                                      train_pairs=args.train_pairs, dev_pairs=args.dev_pairs, env=child_env()))
            for name in sorted(needed)}
    for name in sorted(needed):
        lines += ["", isolated.call("colpali_bench.workloads.describe", data[name], env=child_env())]
    results: dict[str, dict[str, list]] = {s.label: {"colpali": [], "raggedvl": []} for s in configs}
    for rep in range(args.repeats):
        for i, s in enumerate(configs):
            order = args.sides if (rep + i) % 2 == 0 else list(reversed(args.sides))
            for side in order:
                print(f"[repeat {rep + 1}/{args.repeats}] {s.label}: {side} ({load_average()})", flush=True)
                run_dir = work / "runs" / stamp / f"{s.workload}-{s.nproc}x{s.per_device_batch}-{side}-r{rep}"
                results[s.label][side].append(run_one(side, s, data[s.workload], run_dir, args) | {"repeat": rep})
    lines += ["", f"load at the end of the training runs: {load_average()}", ""]
    summary_lines = [summary.SUMMARY_HEADER]
    for s in configs:
        ok = {side: [r for r in results[s.label][side] if r["returncode"] == 0] for side in ("colpali", "raggedvl")}
        lines += [f"### {s.label} (global batch {s.global_batch}, {s.steps} steps, max_pixels {s.max_pixels:,})", "",
                  summary.comparison_table(ok["colpali"], ok["raggedvl"]), "",
                  summary.loss_curve(ok["colpali"], ok["raggedvl"]), ""]
        summary_lines.append(summary.summary_row(s.label, ok["colpali"], ok["raggedvl"]))
    lines += ["### raggedvl / colpali-engine (medians of repeats)", "", *summary_lines, ""]
    extra: dict = {}
    if args.eval:
        evals = {}
        for s in configs:
            first = {side: next((r for r in results[s.label][side] if r["returncode"] == 0), None) for side in args.sides}
            dev = str(data[s.workload] / "dev.parquet")
            row = {}
            if "colpali" in first:
                row["colpali-engine"] = {
                    "before": isolated.call("colpali_bench.colpali_side.evaluate", args.model, dev, s.max_pixels, env=child_env()),
                    "after": isolated.call("colpali_bench.colpali_side.evaluate", first["colpali"]["run_dir"] + "/final", dev,
                                           s.max_pixels, env=child_env()) if first["colpali"] else None}
            if "raggedvl" in first:
                row["raggedvl"] = {
                    "before": isolated.call("colpali_bench.raggedvl_side.evaluate", args.raggedvl_model, None, dev, s.max_pixels,
                                            s.seed, env=child_env()),
                    "after": isolated.call("colpali_bench.raggedvl_side.evaluate", args.raggedvl_model,
                                           first["raggedvl"]["run_dir"] + "/run", dev, s.max_pixels, s.seed, env=child_env())
                    if first["raggedvl"] else None}
            evals[s.label] = row
        extra["eval"] = evals
        lines += ["### dev retrieval (repeat 1; same MaxSim and metric code for both, trec_eval tie order)", "",
                  summary.eval_table(evals), ""]
    if "c" in args.workload:
        s = RunSettings(workload="heavy", model=args.raggedvl_model, nproc=1, per_device_batch=args.per_device_batch, steps=args.steps,
                        lr=args.lr, head_lr=args.head_lr, warmup_steps=args.warmup, weight_decay=args.weight_decay,
                        max_grad_norm=args.max_grad_norm, temperature=args.temperature,
                        max_pixels=WORKLOADS["heavy"].max_pixels, seed=args.seed)
        print(f"(c) measuring per-sample step costs on the heavy mix ({load_average()})", flush=True)
        costs = measure_costs(data["heavy"], s, args, work / f"costs-{stamp}.json")
        text, rows = simulation_report(costs, args, f"measured on (b), {costs['repeats']} timed calls per pair, minimum")
        extra["simulation"] = {"rows": rows, "costs": costs}
        lines += ["### (c) simulated world sizes", "", text, ""]
    report = "\n".join(lines)
    print("\n" + report, flush=True)
    if args.report:
        Path(args.report).write_text(report + "\n")
    all_runs = [r for sides in results.values() for runs in sides.values() for r in runs]
    Path(args.json or work / f"results-{stamp}.json").write_text(json.dumps({"header": lines[:6], "runs": all_runs, **extra}, default=str) + "\n")
    losses_path = Path(args.losses_json or work / f"losses-{stamp}.json")
    losses_path.write_text(json.dumps(per_step_losses(all_runs), indent=1) + "\n")
    print(f"per-step losses: {losses_path}", flush=True)
    failed = [r for r in all_runs if r["returncode"] != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
