"""gpu_check: the prepared device check of raggedvl's GPU path, for a short window on a
bare GPU machine. One command, under 8 minutes, one table.

    python3 tools/gpu_check.py OUT_DIR [--wheels .cache/gpu-wheels] [--budget-s 450]
    python3 tools/gpu_check.py OUT_DIR --dry-run     # CPU, tiny model, 1 step each (CI)

Parts, each with its own time budget (a part that runs out records "skipped: budget" for what
is left, and the next part starts on time; the whole run stays inside ``--budget-s``):

0. env (stdlib only, before torch is imported): install the carried wheels offline
   (``tools/gpu/bootstrap.py``; ``tools/gpu/fetch_wheels.sh`` fills the folder), put
   ``src/`` on the path, report versions / pins / missing packages, the GPU(s) and
   flash-attn. A missing required package ends the run here with the list (exit 2).
1. tests (170 s): ``pytest -m gpu tests/`` in a subprocess: the tests with GPU variants
   (RaggedDataParallel on CUDA, MaxSim on CUDA, GradCache dropout replay on CUDA, NCCL gather
   parity and FSDP2-vs-DDP with NCCL when 2 GPUs exist, ``raggedvl train`` on one GPU with bf16
   autocast). Counts and every skip reason go into the table; the log is ``pytest_gpu.log``.
2. checks (60 s): ``tools/gpu/checks.py``: DataParallel scatter on 2 logical replicas of
   one device (outputs and gradients vs unsplit), ``RaggedDataParallel(device_ids=[0, 0])``,
   bf16 autocast vs fp32, sdpa (vision tower on ``cu_seqlens``) / flash-attn vs eager, packed vs
   padded rows, the patch embedding as a matrix product vs the Conv3d (values and time).
3. timing (the rest): ``tools/gpu/workload.py``: optimizer steps of the tiny and a
   mid-size ColQwen-style model (text hidden 1024 x 8 layers, vision depth 8), ragged vs
   pad-per-image batches, plain vs GradCache, padded vs packed token rows (``--packing``; with
   flash-attn also flash_attention_2 padded vs packed, its varlen path): samples/s and peak
   ``max_memory_allocated``.

``--dry-run`` (or no CUDA): the same code on CPU with the tiny model, small pages and 1 step
each; GPU-only parts print "skipped: no CUDA". Written to OUT_DIR: ``gpu_check.md`` (header +
table), ``gpu_check.log`` (everything printed), ``gpu_check.json`` (rows), ``pytest_gpu.log``.
Exit status: 0 when nothing failed, 1 when a row failed, 2 when required packages are missing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE / "gpu"))
sys.path.insert(1, str(REPO / "benchmarks"))  # patch_embed.compare, shared with the CPU benchmark

import bootstrap  # noqa: E402

PART_BUDGETS_S = {"tests": 170.0, "checks": 60.0}
GPU_SIZES = dict(batch=32, n_batches=2, max_pixels=602_112, warmup=3, steps=10, cache_budget=8192)
DRY_SIZES = dict(batch=4, n_batches=1, max_pixels=50_176, warmup=1, steps=1, cache_budget=96)


class Report:
    """Rows of the one table, plus a log that mirrors everything printed."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.rows: list[dict] = []
        self.header: list[str] = []
        self._log = open(out / "gpu_check.log", "w", encoding="utf-8")

    def log(self, msg: str) -> None:
        print(msg, flush=True)
        self._log.write(msg + "\n")
        self._log.flush()

    def row(self, part: str, item: str, result: str, detail: str = "", seconds: float | None = None, **metrics) -> None:
        r = {"part": part, "item": item, "result": result, "detail": detail, "seconds": seconds, **metrics}
        self.rows.append(r)
        self.log(f"[{part}] {item}: {result}" + (f" ({detail})" if detail else ""))

    def table(self) -> str:
        def num(v, fmt):
            return "" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)

        lines = ["| part | item | result | samples/s | peak GiB | vs ragged plain (speed, memory) | s | detail |",
                 "|---|---|---|---:|---:|---:|---:|---|"]
        for r in self.rows:
            ratio = ""
            if r.get("speed_ratio") is not None:
                ratio = f"{r['speed_ratio']:.2f}x, " + (num(r.get("memory_ratio"), ".2f") + "x" if r.get("memory_ratio") else "n/a")
            detail = str(r["detail"]).replace("|", "/").replace("\n", " ")
            lines.append(f"| {r['part']} | {r['item']} | {r['result']} | {num(r.get('samples_per_s'), '.1f')} | "
                         f"{num(r.get('peak_gib'), '.2f')} | {ratio} | {num(r['seconds'], '.1f')} | {detail} |")
        return "\n".join(lines)

    def finish(self) -> int:
        text = "\n".join(self.header) + "\n\n" + self.table() + "\n"
        (self.out / "gpu_check.md").write_text(text, encoding="utf-8")
        (self.out / "gpu_check.json").write_text(json.dumps({"header": self.header, "rows": self.rows}, indent=1, default=str))
        self.log("\n" + text)
        self._log.close()
        return 1 if any(r["result"].startswith(("FAIL", "OOM")) for r in self.rows) else 0


# ---------------------------------------------------------------------------------------- env
def part_env(rep: Report, args) -> bool:
    """Bootstrap and report; False when a required package is missing or the bootstrap failed."""
    t0 = time.perf_counter()
    try:
        wheels = bootstrap.install_wheels(Path(args.wheels), Path(args.site), rep.log) if not args.dry_run else []
        how = bootstrap.make_project_importable(REPO)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        rep.row("env", "project", "FAIL", str(exc).replace("\n", " ")[:500], time.perf_counter() - t0)
        return False
    rep.row("env", "project", "pass", f"raggedvl from {how}; carried wheels installed: {wheels or 'none'}")
    packages = bootstrap.package_report(REPO)
    present = ", ".join(f"{p['package']} {p['version']}" + (f" ({p['note']})" if p["note"] else "")
                        for p in packages if p["version"] != "missing")
    missing = bootstrap.missing_required(packages)
    optional_missing = [p["package"] for p in packages if p["group"] == "optional" and p["version"] == "missing"]
    rep.row("env", "packages", "FAIL" if missing else "pass",
            (f"MISSING required: {missing} (fetch with tools/gpu/fetch_wheels.sh, carry the folder); " if missing else "")
            + f"optional missing: {optional_missing or 'none'}; present: {present}", time.perf_counter() - t0)
    return not missing


def describe_device(rep: Report, args, torch) -> "torch.device":  # noqa: F821 - torch is imported late, passed in
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda:
        why = "--dry-run" if args.dry_run else "no CUDA device: CPU-safe parts only, at dry-run sizes"
        rep.row("env", "device", "n/a", f"cpu ({why}); torch {torch.__version__}")
        return torch.device("cpu")
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    names = "; ".join(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, "
                      f"{p.multi_processor_count} SMs" for i, p in enumerate(props))
    nccl = torch.cuda.nccl.version()
    nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    rep.row("env", "device", "pass", f"{len(props)} GPU(s): {names}; torch {torch.__version__} (CUDA {torch.version.cuda}), "
            f"NCCL {nccl}, bf16 {torch.cuda.is_bf16_supported()}")
    return torch.device("cuda", 0)


# -------------------------------------------------------------------------------------- tests
def _gpu_test_files() -> list[str]:
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                  if "mark.gpu" in p.read_text(encoding="utf-8") or "marks=[pytest.mark.gpu" in p.read_text(encoding="utf-8"))


def part_tests(rep: Report, device, deadline: float) -> None:
    files = _gpu_test_files()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log_path = rep.out / "pytest_gpu.log"
    t0 = time.perf_counter()
    if device.type != "cuda":
        cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=max(5, deadline - time.time()))
        except subprocess.TimeoutExpired:
            rep.row("tests", "pytest -m gpu", "skipped: no CUDA", "collection ran out of budget", time.perf_counter() - t0)
            return
        log_path.write_text(done.stdout + done.stderr, encoding="utf-8")
        ids = [line for line in done.stdout.splitlines() if "::" in line]
        rep.row("tests", "pytest -m gpu", "skipped: no CUDA",
                f"{len(ids)} gpu tests collected in {len(files)} files, not run", time.perf_counter() - t0)
        return
    cmd = [sys.executable, "-m", "pytest", "-q", "-ra", "-m", "gpu", "-p", "no:cacheprovider", *files]
    rep.log("+ " + " ".join(cmd))
    with open(log_path, "w", encoding="utf-8") as log_file:
        # its own session, so that on timeout the tests' torchrun children are stopped with it
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        try:
            status = proc.wait(timeout=max(5, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = "timeout"
    output = log_path.read_text(encoding="utf-8", errors="replace")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)", output.splitlines()[-1] if output else "")}
    skips = [line.split(":", 2)[-1].strip() for line in output.splitlines() if line.startswith("SKIPPED")]
    failed = [line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))]
    ok = status == 0 and counts.get("passed", 0) > 0
    result = "pass" if ok else ("incomplete: budget" if status == "timeout" else "FAIL")
    rep.row("tests", "pytest -m gpu", result,
            f"{counts or 'no summary'}; skipped: {skips or 'none'}" + (f"; failed: {failed}" if failed else ""),
            time.perf_counter() - t0)


# ------------------------------------------------------------------------------------- checks
def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"


def part_checks(rep: Report, device, deadline: float) -> None:
    import checks

    for name, fn, needs_cuda in checks.CHECKS:
        if needs_cuda and device.type != "cuda":
            rep.row("checks", name, "skipped: no CUDA")
            continue
        if time.time() > deadline:
            rep.row("checks", name, "skipped: budget")
            continue
        t0 = time.perf_counter()
        try:
            result, detail = fn(device)
        except Exception as exc:  # noqa: BLE001 - a failing check is a row, the run goes on
            rep.log(traceback.format_exc())
            result, detail = "FAIL", _first_line(exc)
        rep.row("checks", name, result, detail, time.perf_counter() - t0)
    rep.row("checks", "NCCL between processes, DDP/FSDP2 across GPUs",
            "n/a" if device.type != "cuda" else ("see tests" if _device_count() > 1 else "n/a: needs 2 GPUs"),
            "NCCL refuses two ranks on one GPU and a 1-rank group issues no collective; on 2+ GPUs the gpu "
            "tests run them; CI proves them on gloo (tests/dist)")
    rep.row("checks", "encoder rebalancing (--rebalance-vision): NCCL all-to-all of pixel rows and features",
            "n/a" if device.type != "cuda" else ("not run: no NCCL case yet" if _device_count() > 1 else "n/a: needs 2 GPUs"),
            "images move between ranks, one rank per GPU; exact gradients vs no rebalancing and one process on gloo: "
            "tests/dist/test_vision_rebalance_dist.py; simulated tower balance: benchmarks/vision_balance.py")


def _device_count() -> int:
    import torch

    return torch.cuda.device_count()


# ------------------------------------------------------------------------------------- timing
def part_timing(rep: Report, device, deadline: float, sizes: dict, dry: bool) -> None:
    import torch

    import workload
    from raggedvl.data import build_processor

    t0 = time.perf_counter()
    processor = build_processor("tiny", max_pixels=sizes["max_pixels"])
    items = workload.make_pages(sizes["batch"] * sizes["n_batches"], seed=0)
    batches = {}
    for padded in (False, True):
        cpu = workload.build_batches(processor, items, sizes["batch"], padded)
        batches[padded] = [{k: b[k].to(device) for k in ("queries", "docs")} for b in cpu]
    tokens = {p: sum(map(workload.visual_tokens, bs)) / len(bs) for p, bs in batches.items()}
    rep.log(f"[timing] batches ready in {time.perf_counter() - t0:.1f} s: {sizes['batch']} pairs per step, "
            f"visual tokens per batch ragged {tokens[False]:.0f} vs pad-per-image {tokens[True]:.0f}; "
            f"GradCache budget {sizes['cache_budget']} patches + tokens per chunk")
    pad = workload.token_padding(batches[False])
    rep.log(f"[timing] token padding of the ragged batches (queries + documents): {pad:.1%}; packed rows: 0 %")
    specs = [workload.TINY] if dry else [workload.TINY, workload.MID]
    if dry:
        rep.row("timing", workload.MID.name, "skipped: no CUDA" if device.type != "cuda" else "skipped: dry run")
    flash = _flash_available()
    last = 0.0
    for spec in specs:
        models: dict = {}
        base = None
        for mode in workload.timing_modes(flash):
            item = f"{spec.name}, {mode.label}"
            if mode.attn == "flash_attention_2" and not flash:
                rep.row("timing", item, "skipped: no CUDA" if device.type != "cuda" else "n/a: flash-attn missing")
                continue
            if time.time() + 1.5 * last > deadline:
                rep.row("timing", item, "skipped: budget")
                continue
            t1 = time.perf_counter()
            try:
                if mode.attn not in models:
                    models.clear()  # one model at a time on the device
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    models[mode.attn] = workload.build_model(spec, processor, device, attn=mode.attn)
                model, optimizer = models[mode.attn]
                model.set_packing(mode.packing)
                r = workload.time_steps(model, optimizer, batches[mode.padded_images], device, grad_cache=mode.cached,
                                        budget=sizes["cache_budget"], warmup=sizes["warmup"], steps=sizes["steps"])
            except torch.cuda.OutOfMemoryError as exc:
                rep.row("timing", item, "OOM", _first_line(exc), time.perf_counter() - t1)
                torch.cuda.empty_cache()
                continue
            except Exception as exc:  # noqa: BLE001 - a failing mode is a row, the run goes on
                rep.log(traceback.format_exc())
                rep.row("timing", item, "FAIL", _first_line(exc), time.perf_counter() - t1)
                continue
            last = time.perf_counter() - t1
            base = base or r
            mem_ratio = r["peak_gib"] / base["peak_gib"] if device.type == "cuda" else None
            padding = "" if mode.padded_images else f"{0.0 if mode.packing else pad:.1%} padding tokens, "
            rep.row("timing", item, "pass" if math.isfinite(r["loss"]) else "FAIL",
                    f"{tokens[mode.padded_images]:.0f} visual tokens/step, {padding}"
                    f"{r['step_s'] * 1000:.0f} ms/step, loss {r['loss']:.3f}",
                    last, samples_per_s=r["samples_per_s"], peak_gib=r["peak_gib"],
                    speed_ratio=r["samples_per_s"] / base["samples_per_s"], memory_ratio=mem_ratio)
        models.clear()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _flash_available() -> bool:
    import warnings

    from raggedvl.models.build import resolve_attn_implementation

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return resolve_attn_implementation("flash_attention_2") == "flash_attention_2"


# --------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", help="folder for gpu_check.md / .log / .json and pytest_gpu.log (created)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model, 1 step each; no GPU-only parts")
    p.add_argument("--wheels", default=str(REPO / ".cache" / "gpu-wheels"), help="folder of carried wheels")
    p.add_argument("--site", default="/tmp/raggedvl-site", help="where carried wheels are installed")
    p.add_argument("--budget-s", type=float, default=450.0, help="whole-run time budget in seconds")
    args = p.parse_args(argv)
    start = time.time()
    end = start + args.budget_s
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rep = Report(out)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rep.header = [f"# gpu_check {'(dry run) ' if args.dry_run else ''}{stamp}", "",
                  f"command: `python3 tools/gpu_check.py {' '.join(argv if argv is not None else sys.argv[1:])}`",
                  f"host: {platform.node()}, {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"]
    if not part_env(rep, args):
        rep.finish()
        return 2
    import torch

    device = describe_device(rep, args, torch)
    rep.header.append(f"device: {rep.rows[-1]['detail']}")
    sizes = GPU_SIZES if device.type == "cuda" else DRY_SIZES
    rep.header.append(f"timing: {sizes}")
    part_tests(rep, device, min(end, time.time() + PART_BUDGETS_S["tests"]))
    part_checks(rep, device, min(end, time.time() + PART_BUDGETS_S["checks"]))
    part_timing(rep, device, end, sizes, dry=device.type != "cuda")
    rep.header.append(f"total {time.time() - start:.0f} s of a {args.budget_s:.0f} s budget")
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
