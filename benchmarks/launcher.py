"""What ``raggedvl train`` costs around the training loop: start-up time and the memory of the
processes that are not ranks (the launching process, torchrun), for 1 and 2 processes.

    python benchmarks/launcher.py                          # 1 and 2 processes, 2 repeats
    python benchmarks/launcher.py --before /tmp/base/src   # interleaved with another source tree

Each run is a short tiny job on the cached rdocs subset (``--steps`` steps, no evaluation, no
intermediate checkpoint). Every ``--interval`` seconds the process tree of the command is
sampled with psutil: RSS and PSS (``/proc/PID/smaps_rollup``; PSS splits shared pages among the
processes that map them, so its sum is the job's footprint) of each process. Processes with
children are the launch machinery (the launcher, torchrun's agent); leaves are the ranks.

Figures per run: wall time; CPU time of the whole tree (``wait4`` rusage of the command,
which includes its waited-for descendants); time outside the training loop (wall minus the
loop's span as ``metrics.jsonl`` gives it: samples done / cumulative samples/s at the last
step, the definition ``benchmarks/vs_colpali.py`` uses); peak summed PSS; peak RSS and PSS of
the launch machinery while a rank runs; the most processes seen at once. With ``--before``
the same command runs with ``PYTHONPATH=DIR`` (another checkout's ``src``), interleaved
(repeat r runs before and after for every process count, the order alternating), and the
table shows medians and after / before ratios. The load average is printed with each run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from colpali_bench.procmon import process_tree  # benchmarks/ is sys.path[0] when run as a script

MiB = 2**20
TRAIN, DEV = 16, 8  # rdocs pairs of the job (the test suite's small subset)


class TreeSampler(threading.Thread):
    """Samples RSS / PSS of ``root_pid`` and its descendants every ``interval_s`` seconds."""

    def __init__(self, root_pid: int, interval_s: float) -> None:
        super().__init__(daemon=True)
        self.root_pid, self.interval_s = root_pid, interval_s
        self.stop_event = threading.Event()
        self.peak_pss_sum = 0
        self.peak_machinery_rss = 0  # summed over processes with children, while a rank runs
        self.peak_machinery_pss = 0
        self.max_procs = 0
        self.samples = 0

    def sample(self) -> None:
        procs = process_tree(self.root_pid)
        parents, mem = set(), {}
        for proc in procs:
            try:
                parents.add(proc.ppid())
                info = proc.memory_full_info()
                mem[proc.pid] = (info.rss, getattr(info, "pss", info.rss))
            except psutil.Error:
                continue
        if not mem:
            return
        self.samples += 1
        self.max_procs = max(self.max_procs, len(mem))
        self.peak_pss_sum = max(self.peak_pss_sum, sum(p for _, p in mem.values()))
        machinery = [pid for pid in mem if pid in parents]
        if machinery:  # some process has children: ranks are running under it
            self.peak_machinery_rss = max(self.peak_machinery_rss, sum(mem[p][0] for p in machinery))
            self.peak_machinery_pss = max(self.peak_machinery_pss, sum(mem[p][1] for p in machinery))

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.sample()
            self.stop_event.wait(self.interval_s)


def loop_span_s(run_dir: Path) -> float:
    """Seconds from the loop's start to the end of the last step (samples / cumulative rate)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if r.get("event") == "train"]
    done = sum(sum(r["rank_samples"]) for r in steps)
    return done / steps[-1]["samples_per_s"]


def startup_phases(run_dir: Path) -> dict[str, float] | None:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return next((r["phases_s"] for r in records if r.get("event") == "startup"), None)


def run_job(variant: str, pythonpath: str | None, nproc: int, args, work: Path, index: int) -> dict:
    run_dir = work / f"{variant}-{nproc}-{index}"
    cmd = [sys.executable, "-m", "raggedvl.app.cli", "train", "--max-steps", str(args.steps),
           "--max-train-samples", str(TRAIN), "--max-eval-samples", str(DEV), "--global-batch-size", "4",
           "--eval-before", "false", "--eval-after", "false", "--checkpoint-every", "1000000",
           "--output-dir", str(run_dir), "--data-cache", args.data_cache, "--nproc-per-node", str(nproc)]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    log = open(work / f"{run_dir.name}.log", "w")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    sampler = TreeSampler(proc.pid, args.interval)
    sampler.start()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    sampler.stop_event.set()
    sampler.join()
    log.close()
    if proc.returncode != 0:
        raise SystemExit(f"{variant} nproc {nproc} failed ({proc.returncode}); see {log.name}")
    loop = loop_span_s(run_dir)
    return {"variant": variant, "nproc": nproc, "wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            "outside_s": wall - loop, "pss_sum_mib": sampler.peak_pss_sum / MiB,
            "machinery_rss_mib": sampler.peak_machinery_rss / MiB, "machinery_pss_mib": sampler.peak_machinery_pss / MiB,
            "procs": sampler.max_procs, "samples": sampler.samples, "phases": startup_phases(run_dir),
            "load": os.getloadavg()[0]}


COLUMNS = (("wall_s", "wall (s)", 1), ("cpu_s", "CPU, all processes (s)", 1), ("outside_s", "outside the loop (s)", 1),
           ("pss_sum_mib", "peak summed PSS (MiB)", 0), ("machinery_rss_mib", "launcher + torchrun RSS while ranks run (MiB)", 0),
           ("machinery_pss_mib", "launcher + torchrun PSS while ranks run (MiB)", 0), ("procs", "processes", 0))


def table(results: list[dict], variants: list[str]) -> str:
    nprocs = sorted({r["nproc"] for r in results})
    head = "| metric (median) | " + " | ".join(f"{v}, {n} proc" for n in nprocs for v in variants)
    if len(variants) == 2:
        head += " | " + " | ".join(f"{variants[1]} / {variants[0]}, {n} proc" for n in nprocs)
    lines = [head + " |", "|---|" + "---:|" * (head.count("|") - 2)]
    for key, label, digits in COLUMNS:
        med = {(v, n): statistics.median([r[key] for r in results if r["variant"] == v and r["nproc"] == n])
               for v in variants for n in nprocs}
        cells = [f"{med[v, n]:,.{digits}f}" for n in nprocs for v in variants]
        if len(variants) == 2:
            cells += [f"{med[variants[1], n] / med[variants[0], n]:.2f}" if med[variants[0], n] else "-" for n in nprocs]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--interval", type=float, default=0.2, help="memory sampling interval (s)")
    parser.add_argument("--before", default=None, metavar="SRC", help="another checkout's src folder, run interleaved")
    parser.add_argument("--data-cache", default=None, help="rdocs cache (default: a fresh one, built first)")
    parser.add_argument("--output", default=None, help="write every run's figures as JSON")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="raggedvl-launcher-"))
    if args.data_cache is None:
        args.data_cache = str(work / "cache")
        from raggedvl.app.config import TrainConfig
        from raggedvl.app.setup import prepare_data

        prepare_data(TrainConfig(max_train_samples=TRAIN, max_eval_samples=DEV, data_cache=args.data_cache))
    variants = [("before", args.before), ("after", None)] if args.before else [("this tree", None)]
    print(f"# {platform.node()}: {os.cpu_count()} cores, python {platform.python_version()}; runs in {work}")
    results = []
    for r in range(args.repeats):
        order = variants if r % 2 == 0 else variants[::-1]
        for nproc in args.nproc:
            for name, path in order:
                res = run_job(name, path, nproc, args, work, r)
                results.append(res)
                print(f"repeat {r} {name:>9} {nproc} proc: wall {res['wall_s']:.1f} s, CPU {res['cpu_s']:.1f} s, "
                      f"outside loop {res['outside_s']:.1f} s, PSS sum {res['pss_sum_mib']:.0f} MiB, launcher+torchrun "
                      f"RSS {res['machinery_rss_mib']:.0f} MiB while ranks run, {res['procs']} processes, "
                      f"load {res['load']:.1f}" + (f", phases {res['phases']}" if res["phases"] else ""), flush=True)
    print()
    print(table(results, [name for name, _ in variants]))
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
