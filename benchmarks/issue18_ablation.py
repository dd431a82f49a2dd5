"""Issue 18: why raggedvl's loss sat at ln(global batch) where colpali-engine's moved; one
difference at a time, from the same colpali-saved checkpoint (BENCHMARKS.md section 12).

    # in the benchmark venv (benchmarks/vs_colpali.sh builds it), from the repository root:
    ~/.cache/raggedvl/bench-venv/bin/python benchmarks/issue18_ablation.py --rows all --stop-after 60
    ~/.cache/raggedvl/bench-venv/bin/python benchmarks/issue18_ablation.py --rows colpali main era --max-pixels 100352

Every row trains 2 gloo processes x 8 (global batch 16; the ``1x16`` row: one process x 16) on the
uniform pairs of ``colpali_bench/workloads.py`` (240 rdocs pairs) with issue 18's recipe: AdamW
lr 5e-4 for backbone and head, 3 warm-up steps, weight decay 0, clipping 1.0, temperature 0.02,
query-length normalisation, fp32, seed 0. The learning-rate schedule spans ``--schedule-steps``
(200, the issue's run) and each run stops after ``--stop-after`` steps, so the rows see the
200-step schedule at a fraction of its cost. Rows (one change from ``main`` each, except ``era``):

- ``colpali``: colpali-engine's own training path (``colpali_bench/colpali_worker.py``: HF
  Trainer, linear schedule, fused AdamW, ``ColbertLoss``, left padding, no query prefix);
- ``main``: raggedvl as it is (the checkpoint's head and prompts, cosine schedule, AdamW default
  implementation, L2 epsilon 1e-6), through ``colpali_bench/raggedvl_steps.py`` (the
  ``Trainer`` of ``raggedvl train``);
- ``linear``: ``--lr-schedule linear``; ``fused``: ``torch.optim.AdamW(fused=True)``;
  ``foreach``: ``AdamW(foreach=True)``; ``eps``: L2 epsilon 1e-12 (colpali divides by the
  norm);
- ``prompts``: ``--query-prefix "Query: " --padding-side right`` (raggedvl's prompts before issue
  14); ``prefix`` and ``right``: each of the two alone;
- ``head``: the projection head re-initialised as raggedvl did before issue 14 (``nn.Linear``'s
  default init under seed 0, written into a copy of the checkpoint);
- ``era``: ``prompts`` and ``head`` together: what issue 18 measured;
- ``1x16``: one process with the whole global batch (no gather).

Printed per row: mean loss of steps 1-5, 11-30 and the last 10, the minimum, the steps whose loss
is within 5e-4 of ln 16 (equal at 3 decimals, as the issue counted) and within 5e-5, and the steps
whose documents all embed alike: mean pairwise cosine of mean-pooled embeddings >= 0.99999 (the
rank-0 batch for raggedvl, the gathered batch for colpali-engine). Per-step losses go to
``WORK/issue18-<time>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from colpali_bench import colpali_side, raggedvl_side  # noqa: E402
from colpali_bench.settings import RunSettings, default_model  # noqa: E402
from colpali_bench.workloads import build_workload  # noqa: E402

ROWS = {
    "colpali": ("colpali-engine 0.3.18 (reference)", [], []),
    "main": ("raggedvl main", [], []),
    "linear": ("raggedvl, linear schedule (colpali's)", [], ["--lr-schedule", "linear"]),
    "fused": ("raggedvl, AdamW fused (colpali's HF default)", ["--adamw", "fused"], []),
    "foreach": ("raggedvl, AdamW foreach", ["--adamw", "foreach"], []),
    "eps": ("raggedvl, L2 epsilon 1e-12 (colpali: none)", ["--l2-eps", "1e-12"], []),
    "prompts": ("raggedvl, 'Query: ' prefix + right padding (pre-issue-14)", [],
                ["--query-prefix", "Query: ", "--padding-side", "right"]),
    "prefix": ("raggedvl, 'Query: ' prefix only", [], ["--query-prefix", "Query: "]),
    "right": ("raggedvl, right padding only", [], ["--padding-side", "right"]),
    "head": ("raggedvl, head re-initialised (pre-issue-14)", [], []),
    "era": ("raggedvl as issue 18 ran it (head re-initialised + 'Query: ' + right padding)", [],
            ["--query-prefix", "Query: ", "--padding-side", "right"]),
    "1x16": ("raggedvl, 1 process x 16 (no gather)", [], []),
}
STEPS_DRIVER = HERE / "colpali_bench" / "raggedvl_steps.py"


def reinitialised_head_copy(model: str, work: Path) -> str:
    """A copy of ``model`` whose ``custom_text_proj`` is ``nn.Linear(H, D)``'s default init under
    ``torch.manual_seed(0)``, the head raggedvl built for a colpali checkpoint before issue 14."""
    import torch
    from safetensors.torch import load_file, save_file

    dst = work / f"{Path(model).name}-head-reinit"
    if (dst / "model.safetensors").is_file():
        return str(dst)
    dst.mkdir(parents=True, exist_ok=True)
    state = load_file(str(Path(model) / "model.safetensors"))
    out_dim, hidden = state["custom_text_proj.weight"].shape
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, out_dim)
    state["custom_text_proj.weight"] = head.weight.detach().clone()
    state["custom_text_proj.bias"] = head.bias.detach().clone()
    for f in Path(model).iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def env() -> dict[str, str]:
    out = dict(os.environ)
    out.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), out.get("PYTHONPATH")]))})
    return out


def run_row(row: str, args, data: Path, work: Path) -> dict:
    label, driver_opts, flags = ROWS[row]
    nproc, per_device = (1, 16) if row == "1x16" else (2, 8)
    model = reinitialised_head_copy(args.model, work) if row in ("head", "era") else args.model
    s = RunSettings(workload="uniform", model=model, nproc=nproc, per_device_batch=per_device, steps=args.schedule_steps,
                    lr=5e-4, head_lr=5e-4, warmup_steps=3, weight_decay=0.0, max_grad_norm=1.0, temperature=0.02,
                    max_pixels=args.max_pixels, seed=0)
    run_dir = work / "runs" / row
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    train = str(data / "train.parquet")
    if row == "colpali":
        spec = colpali_side.spec(s, train_parquet=train, out_dir=str(run_dir), save_final=False) | {"stop_after": args.stop_after}
        (run_dir / "spec.json").write_text(json.dumps(spec))
        cmd = colpali_side.command(s, str(run_dir / "spec.json"))
    else:
        argv = raggedvl_side.train_argv(s, dataset=train, output_dir=str(run_dir / "run"), extra=[])[1:]
        argv = argv[: argv.index("--nproc-per-node")] + flags  # torchrun's flag is not the Trainer's
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               str(STEPS_DRIVER), "--out", str(run_dir / "steps.json"), "--stop-after", str(args.stop_after),
               *driver_opts, "--", *argv]
    t0 = time.time()
    with open(run_dir / "log.txt", "w") as log:
        code = subprocess.run(cmd, env=env(), stdout=log, stderr=subprocess.STDOUT, cwd=str(run_dir)).returncode
    if code != 0:
        raise RuntimeError(f"row {row} failed (exit {code}); log: {run_dir / 'log.txt'}")
    if row == "colpali":
        steps = json.loads((run_dir / "colpali_rank0.json").read_text())["steps"]
    else:
        steps = json.loads((run_dir / "steps.json").read_text())["steps"]
    return {"row": row, "label": label, "wall_s": time.time() - t0, "losses": [st["loss"] for st in steps],
            "doc_cosine": [st.get("doc_cosine") for st in steps]}


def summarize(r: dict, global_batch: int = 16) -> str:
    losses, cos, chance = r["losses"], r["doc_cosine"], math.log(global_batch)
    at3 = sum(abs(v - chance) < 5e-4 for v in losses)
    at4 = sum(abs(v - chance) < 5e-5 for v in losses)
    alike = sum(c >= 0.99999 for c in cos)
    return (f"| {r['label']} | {statistics.fmean(losses[:5]):.3f} | {statistics.fmean(losses[10:30]):.3f} | "
            f"{statistics.fmean(losses[-10:]):.3f} | {min(losses):.3f} | {at3} / {at4} | {alike} | {len(losses)} |")


HEADER = ("| row | loss steps 1-5 | 11-30 | last 10 | min | steps at ln 16 (3 / 4 decimals) | steps with document "
          "cosine >= 0.99999 | steps |\n|---|---:|---:|---:|---:|---:|---:|---:|")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", default=["colpali", "main"], choices=[*ROWS, "all"])
    p.add_argument("--stop-after", type=int, default=60)
    p.add_argument("--schedule-steps", type=int, default=200)
    p.add_argument("--max-pixels", type=int, default=200_704)
    p.add_argument("--model", default=default_model())
    p.add_argument("--work-dir", default=str(Path.home() / ".cache" / "raggedvl" / "issue18"))
    args = p.parse_args(argv)
    rows = list(ROWS) if "all" in args.rows else args.rows
    work = Path(args.work_dir)
    data = build_workload("uniform", work / "workloads")
    print(f"issue 18 ablation {datetime.datetime.now().isoformat(timespec='seconds')}: {args.stop_after} steps of a "
          f"{args.schedule_steps}-step schedule, max_pixels {args.max_pixels:,}, checkpoint {args.model}; load "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    results = []
    for row in rows:  # one at a time: the machine is shared
        results.append(run_row(row, args, data, work))
        print(summarize(results[-1]), f"({results[-1]['wall_s']:.0f} s)", flush=True)
    print("\n" + HEADER + "\n" + "\n".join(summarize(r) for r in results))
    out = work / f"issue18-{datetime.datetime.now():%Y%m%d-%H%M%S}.json"
    out.write_text(json.dumps({"args": vars(args), "results": results}) + "\n")
    print(f"per-step losses: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
