"""How ``raggedvl train`` (and ``eval`` / ``encode`` with ``--nproc-per-node``) starts its ranks.

From a plain shell, ``raggedvl train``:

1. checks, before importing torch or transformers, each failure one line and exit code 2: the
   config, the model and dataset names (``raggedvl.app.sources``: typos, unreachable or offline
   hub in seconds), the output directory (``raggedvl.app.rundir``), and for data in local
   parquet files (``raggedvl.data.scan``) the columns, splits (an evaluation split that reads a
   training file is refused), queries, hard-negative counts
   and every training image's header, documents and hard negatives (a corrupt image is named
   by row, id and file), then the world size against the global batch and ``--shard-degree``;
2. with several processes, when step 1 checked everything (:func:`needs_torch`: no
   ``--resume``, data in local parquet files or the rdocs preset),
   replaces itself at once (``os.execve``) with torchrun's agent
   (``python -m raggedvl.app.agent``, torchrun's options): the ranks prepare the data
   themselves, as they always do (the image sizes from step 1's cache);
3. otherwise imports torch and checks what needs it: the processor, the data the launcher
   could not scan (hub datasets, BEIR folders), overlap, with ``--resume`` that the checkpoint
   can continue with these settings and data (``raggedvl.app.resume``), a local checkpoint's
   files (with several processes and nothing else to check, the ranks find a broken checkpoint
   when they load it: the same one-line error, after their imports); then with one process on one node (``--nproc-per-node 1``, or one CUDA device) trains
   right there, reusing what it built (no torchrun, no second process), else execs the agent
   as in 2, so nothing of the launcher stays resident while the ranks run, and a failing rank
   is reported once, in one line.

``--nproc-per-node`` defaults to the number of CUDA devices, or 2 processes on a CPU-only
machine (:func:`default_nproc`: no torch import without a GPU driver); ``--standalone`` is used unless ``--nnodes``/``--rdzv-*`` say otherwise. Inside
torchrun (``TORCHELASTIC_RUN_ID`` or ``LOCAL_RANK`` set) ``raggedvl train`` runs one rank.
Multi-node jobs use torchrun's own rendezvous: run the same command on every node with
``--nnodes N --node-rank I --rdzv-endpoint HOST:PORT`` (or ``--master-addr``/``--master-port``).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any, NoReturn, Sequence

from raggedvl.app.gpu_driver import has_gpu_driver

TORCHRUN_HELP = {  # name: (metavar, help)
    "nproc_per_node": ("N", "processes on this node: a number, or gpu (one per CUDA device), auto (one per accelerator, "
                      "else one per CPU core) or cpu (one per CPU core), as torchrun reads them "
                      "(default: the number of CUDA devices, or 2 on a CPU-only machine)"),
    "nnodes": ("N", "number of nodes, or MIN:MAX for an elastic job (default: 1)"),
    "node_rank": ("RANK", "this node's rank, 0 to nnodes-1 (static rendezvous)"),
    "rdzv_backend": ("BACKEND", "torchrun rendezvous backend, e.g. c10d"),
    "rdzv_endpoint": ("HOST:PORT", "rendezvous address HOST:PORT, the same on every node"),
    "rdzv_id": ("ID", "job id shared by the nodes of one job"),
    "master_addr": ("HOST", "address of the rank-0 node (static rendezvous)"),
    "master_port": ("PORT", "port on the rank-0 node (static rendezvous)"),
    "rdzv_conf": ("KEY=VALUE,...", "torchrun rendezvous settings, e.g. join_timeout=SECONDS: how long the nodes may take "
                  "to join (default: 900 s with --node-rank, else 600 s)"),
    "max_restarts": ("N", "times torchrun restarts the workers after a failure (default: 0)"),
}
TORCHRUN_OPTIONS = tuple(TORCHRUN_HELP)


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def add_torchrun_arguments(parser) -> None:
    group = parser.add_argument_group("torchrun (passed through when raggedvl starts torchrun itself)")
    for name in TORCHRUN_OPTIONS:
        metavar, text = TORCHRUN_HELP[name]
        group.add_argument("--" + name.replace("_", "-"), dest=name, default=None, metavar=metavar, help=text)


def default_nproc() -> int:
    """The default ``--nproc-per-node``: the number of CUDA devices, else 2. Without a GPU
    driver (``raggedvl.app.gpu_driver.has_gpu_driver``) that is 2 at once, without importing torch (seconds);
    with one, torch counts the devices."""
    if not has_gpu_driver():
        return 2
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def local_world_size(nproc_per_node: str) -> int:
    """Processes torchrun starts for ``--nproc-per-node`` (a number, ``gpu``, ``auto``, ``cpu``;
    torchrun's ``determine_local_world_size`` rules). Raises ``ValueError`` for anything else,
    for a number < 1, and for ``gpu`` without a CUDA device. Imports torch only for the words."""
    if nproc_per_node.lstrip("-").isdigit():
        number = int(nproc_per_node)
        if number < 1:
            raise ValueError(f"--nproc-per-node must be >= 1, got {number}")
        return number
    import torch

    if nproc_per_node == "gpu":
        if not torch.cuda.is_available():
            raise ValueError("--nproc-per-node gpu: no CUDA device is visible; give a number of processes or auto")
        return torch.cuda.device_count()
    if nproc_per_node == "auto" and torch.accelerator.is_available():
        return torch.accelerator.device_count()
    if nproc_per_node in ("auto", "cpu"):
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    raise ValueError(f"--nproc-per-node must be a number, gpu, auto or cpu, got {nproc_per_node!r}")


def torchrun_command(args, train_argv: Sequence[str], command: str = "train") -> list[str]:
    """The ``python -m raggedvl.app.agent TORCHRUN_OPTIONS -m raggedvl.app.cli COMMAND ...``
    command line (torchrun's agent with one-line failure reports)."""
    opts = {name: getattr(args, name) for name in TORCHRUN_OPTIONS if getattr(args, name, None) is not None}
    opts.setdefault("nproc_per_node", str(default_nproc()))
    cmd = [sys.executable, "-m", "raggedvl.app.agent"]
    if not is_multi_node(opts):
        cmd.append("--standalone")
    for name, value in opts.items():
        cmd += ["--" + name.replace("_", "-"), str(value)]
    return cmd + ["-m", "raggedvl.app.cli", command, *train_argv]


def is_multi_node(options: dict[str, Any]) -> bool:
    return any(options.get(k) is not None for k in ("nnodes", "rdzv_endpoint", "master_addr"))


def world_of(cmd: Sequence[str]) -> tuple[int, bool]:
    """(processes over all nodes, whether the job spans nodes) of an agent command line;
    ``ValueError`` for a ``--nproc-per-node`` torchrun would refuse. An elastic ``--nnodes
    MIN:MAX`` counts MIN nodes."""
    def value(flag: str) -> str | None:
        return cmd[cmd.index(flag) + 1] if flag in cmd else None

    nproc = local_world_size(value("--nproc-per-node") or "1")
    nnodes = (value("--nnodes") or "1").split(":")[0]
    multi = "--standalone" not in cmd
    return nproc * (int(nnodes) if nnodes.isdigit() else 1), multi


def strip_torchrun_arguments(argv: Sequence[str]) -> list[str]:
    """``argv`` without the torchrun options (``--opt value`` and ``--opt=value`` forms)."""
    flags = {"--" + n.replace("_", "-") for n in TORCHRUN_OPTIONS}
    out: list[str] = []
    skip = False
    for tok in argv:
        if skip:
            skip = False
            continue
        if tok in flags:
            skip = True
            continue
        if tok.split("=", 1)[0] in flags:
            continue
        out.append(tok)
    return out


def exec_agent(cmd: list[str], env_updates: dict[str, str] | None = None) -> NoReturn:
    """Print ``cmd`` and replace this process with it (``os.execve``): the launcher's memory is
    released, the agent keeps its process id. ``OMP_NUM_THREADS`` defaults to 1 per rank."""
    env = dict(os.environ, **(env_updates or {}))
    env.setdefault("OMP_NUM_THREADS", "1")
    print("+ " + shlex.join(cmd), flush=True)
    sys.stderr.flush()
    os.execve(cmd[0], cmd, env)


def check_world_fits(cfg, cmd: Sequence[str]) -> tuple[int, bool]:
    """(processes, spans nodes) of the agent command ``cmd``; raises ``ValueError`` before any
    process starts when they cannot all get a sample, when ``--shard-degree`` does not divide them
    (or ``--nproc-per-node`` is not a value torchrun accepts)."""
    world, multi = world_of(cmd)
    if cfg.global_batch_size < world:
        raise ValueError(
            f"global_batch_size {cfg.global_batch_size} < {world} processes: every rank needs at least one "
            f"sample per step; use --global-batch-size {world} or more"
        )
    if cfg.shard_degree is not None and world % cfg.shard_degree:
        divisors = [k for k in range(1, world + 1) if world % k == 0]
        raise ValueError(
            f"--shard-degree {cfg.shard_degree} does not divide the {world} processes: HSDP needs groups of equal "
            f"size; use one of {divisors}"
        )
    return world, multi


def plain_output() -> None:
    """When stderr is not a terminal (a log file, a pipe): no carriage-return progress bars from
    ``datasets`` and the hub, in this process and the ranks it starts. Both libraries read the
    environment variables when first imported; one already imported is told directly. Neither is
    imported here (``datasets`` alone takes seconds, and the default data never needs it)."""
    if sys.stderr.isatty():
        return
    for name in ("HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS"):
        os.environ.setdefault(name, "1")
    for module in ("datasets", "huggingface_hub.utils"):
        if module in sys.modules:
            sys.modules[module].disable_progress_bars()


def check_names(cfg) -> None:
    """The launcher's first checks, before torch is imported: ``--report-to``'s packages, and
    what ``--model``, ``--dataset`` and ``--eval-dataset`` name (:func:`raggedvl.app.sources.resolve_source`:
    a typo, an offline or unreachable hub is a one-line ``ValueError`` in seconds)."""
    from raggedvl.app.sources import resolve_source
    from raggedvl.app.tracking import check_installed, parse_report_to

    check_installed(parse_report_to(cfg.report_to))
    resolve_source(cfg.model, repo_type="model", presets=("tiny",), what="--model")
    for flag, name in [*(("--dataset", d) for d in cfg.datasets), ("--eval-dataset", cfg.eval_dataset)]:
        if name is not None:
            resolve_source(name, repo_type="dataset", presets=("rdocs",), what=flag)


def model_parameters(model: str) -> int | None:
    """Parameters stored in a local model folder's ``*.safetensors`` files, from their headers
    (no tensor is read), or None for a preset, a hub id or a folder without safetensors."""
    import json
    import struct

    folder = Path(model).expanduser()
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    total = 0
    for path in files:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for dim in entry["shape"]:
                    count *= dim
                total += count
    return total or None


def check_output_space(cfg) -> None:
    """Raise ``ValueError`` (one line, exit 2) when the filesystem of ``--output-dir`` cannot hold
    one checkpoint of a full fine-tune of a local ``--model`` folder: its weights in float32 and
    AdamW's two float32 moments, 3 x 4 bytes per parameter (LoRA checkpoints hold only adapters
    and the head: not checked). Each save checks again (``raggedvl.app.checkpoint.check_free_space``)."""
    import shutil

    parameters = model_parameters(cfg.model) if not cfg.use_lora else None
    if parameters is None:
        return
    needed = parameters * 12
    out = Path(cfg.output_dir)
    probe = out
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise ValueError(f"--output-dir {cfg.output_dir}: {free:,} bytes free, a checkpoint of this full fine-tune "
                         f"needs about {needed:,} (weights and AdamW state, 12 bytes per parameter of {cfg.model}); "
                         "free space, choose another --output-dir, or train LoRA adapters (--lora true)")


def check_data(cfg) -> list[str]:
    """The launcher's data checks before torch is imported, for each training set held in local
    parquet files (``raggedvl.data.scan``; other sources are checked by ``prepare_run_data``):
    the columns (``--source-column`` too, with a value in every row trained on and one
    ``--dataset-weights`` entry per value when given; an image or hard-negatives column holding text, such as the queries, is refused:
    ``raggedvl.data.scan.check_image_column``), the queries (``--on-empty-query``), the
    positives (an image column of lists: every row has one), the hard negatives
    (``--negatives-column``: the column's type; any number per row), and every
    image's header, documents and hard negatives, read in parallel and cached beside the data, so the ranks' size estimate reads no
    document image; and for the evaluation set (``--eval-dataset``, else the first dataset's
    ``--eval-split``) held in local parquet files: that the split exists, its columns
    (``cfg.eval_columns``), and that it reads no file a training split reads (unless
    ``--allow-eval-overlap``; overlap by content is the ranks' check).

    Raises ``ValueError`` (a missing column, with the columns present and the flag; a missing
    split, with the splits present; an evaluation split that is training data; an empty query or an empty list of positives, with its row
    and id) or ``BadImageError`` (the first unreadable image among the rows the run trains on,
    with its row, id, file and ``--on-bad-image skip``; with ``--eval-fraction``, left to
    ``prepare_run_data``). Returns what it could NOT check here, one phrase each (empty when
    everything the ranks would refuse was checked; see :func:`needs_torch`)."""
    from raggedvl.app.column_flags import flags_for_columns
    from raggedvl.data.scan import check_columns, check_image_column
    from raggedvl.data.source import DataSource

    unchecked = []
    trained_files = {}  # resolved parquet file -> the --dataset that trains on it
    for name in cfg.datasets:
        source = DataSource.of(name)
        table = source.parquet(cfg.train_split)  # None: not local parquet
        trained_files.update({file.resolve(): name for file in table.files} if table is not None else {})
        if source.is_manifest:
            if cfg.negatives_column is not None:
                raise ValueError(f"{name} is an rdocs manifest, which has no hard-negatives column "
                                 f"{cfg.negatives_column!r}; leave out --negatives-column or train on a parquet file "
                                 "that has one")
        elif not _check_parquet_data(cfg, source):
            unchecked.append(f"--dataset {name} (not local parquet)")
    if cfg.eval_fraction is not None:
        unchecked.append("--eval-fraction (the held-out rows depend on image digests)")
    elif cfg.evaluates:
        source = DataSource.of(cfg.eval_dataset if cfg.eval_dataset is not None else cfg.datasets[0])
        flag = "--eval-dataset" if cfg.eval_dataset is not None else "--dataset"
        table = source.parquet(cfg.resolved_eval_split)  # a missing split raises
        if table is not None:  # its own columns: a missing one names --eval-query-column...
            with flags_for_columns("eval_"):
                check_columns(table.columns, table.where, cfg.eval_columns)
                check_image_column(table, "image", cfg.eval_columns)
            _check_not_trained_on(cfg, table, trained_files)
        elif source.kind != "rdocs":  # a BEIR layout, a hub id...
            unchecked.append(f"{flag} {source.name} split {cfg.resolved_eval_split!r} (not local parquet)")
    return unchecked


def _check_not_trained_on(cfg, table, trained_files: dict) -> None:
    """Refuse (``ValueError``, unless ``allow_eval_overlap``) an evaluation split that reads a
    parquet file a training split reads (``trained_files``: resolved path -> ``--dataset``): the
    ranks' content check (``raggedvl.app.setup.check_overlap``) would refuse its pairs, and the
    file paths tell it before any process starts."""
    shared = [file for file in table.files if file.resolve() in trained_files]
    if not shared or cfg.allow_eval_overlap:
        return
    dataset = trained_files[shared[0].resolve()]
    raise ValueError(f"evaluation set {table.where} overlaps the training pairs: it reads {shared[0]}, which "
                     f"--dataset {dataset} split {cfg.train_split!r} trains on; dev metrics would measure "
                     "memorisation. Evaluate on held-out data (--eval-dataset, --eval-split, --eval-fraction) or pass "
                     "--allow-eval-overlap")


def needs_torch(cfg, unchecked: Sequence[str]) -> list[str]:
    """Why the launcher must import torch and prepare the run's data itself before starting the
    ranks (empty: it may start them right after :func:`check_data`): ``--resume`` (the
    checkpoint's settings and data) and whatever ``check_data`` could not check (``unchecked``).
    Otherwise the ranks prepare the data and load the model themselves, as they always do, and
    a failure there is still one line. A local ``--model`` folder is not a reason: checking its
    files in the launcher (transformers and torch imports, 6 s of the 2-process start-up here)
    would repeat what the ranks' loading checks anyway (``raggedvl.models.interop.load``: the
    same errors, naming the file and the tensor)."""
    reasons = list(unchecked)
    if cfg.resume:
        reasons.append("--resume")
    return reasons


def _check_parquet_data(cfg, source) -> bool:
    """Check one training set (:func:`check_data`, a ``DataSource``); False when it is not local parquet."""
    from raggedvl.app.column_flags import flags_for_columns
    from raggedvl.data.dataset import check_images_type, check_positive_counts, kept_rows, source_values
    from raggedvl.data.scan import check_columns, check_image_column, image_sizes, read_column
    from raggedvl.images import BadImageError

    table = source.parquet(cfg.train_split)
    if table is None:
        return False
    with flags_for_columns():
        check_columns(table.columns, table.where, cfg.columns)
        check_image_column(table, "image", cfg.columns)
    queries = read_column(table, cfg.query_column)
    if not queries:
        raise ValueError(f"{table.where} has no rows: nothing to train on; pass a --dataset with training pairs")
    ids = ([str(v) for v in read_column(table, cfg.id_column)] if cfg.id_column
           else [f"{cfg.train_split}-{i}" for i in range(len(queries))])
    used, skipped = kept_rows(queries, ids, table.where, cfg.on_empty_query, cfg.max_train_samples)
    if not used:
        which = "its one row was" if len(skipped) == 1 else f"all {len(skipped)} rows were"
        raise ValueError(f"{table.where}: {which} left out for an empty or non-string query "
                         "(--on-empty-query skip); nothing is left to train on")
    if cfg.source_column is not None:  # a row without a source value
        values = source_values(read_column(table, cfg.source_column), used, [ids[r] for r in used],
                               cfg.source_column, table.where)
        names = sorted(set(values))
        cfg.check_source_weights(names, [values.count(name) for name in names])

    import pyarrow.parquet as pq

    schema = pq.ParquetFile(table.files[0]).schema_arrow
    several = check_images_type(schema.field(cfg.image_column).type, cfg.image_column, table.where, "image")
    negatives = None
    if cfg.negatives_column is not None:  # any number per row: only the type is checked
        check_images_type(schema.field(cfg.negatives_column).type, cfg.negatives_column, table.where)
        with flags_for_columns():
            check_image_column(table, "negatives", cfg.columns)
        negatives = image_sizes(table, cfg.negatives_column, item="hard negative")
    sizes = image_sizes(table, cfg.image_column, item="positive" if several else None)
    if several:
        check_positive_counts(sizes.counts, used, [ids[r] for r in used], cfg.image_column, table.where)
    # with --eval-fraction the rows used depend on image digests: prepare_run_data decides
    if cfg.on_bad_image != "error" or cfg.eval_fraction is not None:
        return True
    for found in (sizes, negatives) if negatives is not None else (sizes,):
        bad = next((row for row in used if row in found.errors), None)
        if bad is not None:
            label = f"{table.where} row {bad} (id {ids[bad]!r})"
            raise BadImageError(found.message(bad, label if len(table.files) == 1 else f"{label} in {table.file_of(bad)}"))
    return True


def launch_train(args, argv: Sequence[str]) -> int:
    """``raggedvl train`` (module docstring): one rank under torchrun, else check, then train
    here (one process) or exec the agent. Returns the exit code (0) or raises what the checks
    and the run raise; never returns when it starts the agent."""
    import time

    from raggedvl.app.config import config_from_args
    from raggedvl.app.startup import ENV, StartupClock, process_start_time, start_line

    rank = under_torchrun()
    clock = StartupClock.from_env() if rank else StartupClock()
    cfg = config_from_args(args)
    if rank:
        from raggedvl.app.agent import end_with_agent
        from raggedvl.parallel.faults import quiet_ranks

        if quiet_ranks():  # started by raggedvl's agent: end with it
            end_with_agent()
        plain_output()
        if ENV not in os.environ and os.environ.get("RANK", "0") == "0":  # a torchrun of its own: no launcher's line
            print(start_line(cfg, int(os.environ.get("WORLD_SIZE", "1"))), flush=True)
        from raggedvl.app.loop import train

        from raggedvl.app.restarts import resume_after_restart

        clock.add({"imports": time.time() - process_start_time()})
        cfg = resume_after_restart(cfg, int(os.environ.get("RANK", "0")))  # a torchrun restart continues the run
        from raggedvl.app.resume import RESUME_CHECKED_ENV

        # preempted: rank 0 left its line for the agent, which exits 3
        train(cfg, clock=clock, resume_checked=RESUME_CHECKED_ENV in os.environ)
        return 0
    from raggedvl.app.rundir import check_output_dir

    check_names(cfg)
    check_output_dir(cfg)
    check_output_space(cfg)
    unchecked = check_data(cfg)
    cmd = torchrun_command(args, strip_torchrun_arguments(argv))
    world, multi = check_world_fits(cfg, cmd)
    plain_output()
    print(start_line(cfg, world), flush=True)
    if (world > 1 or multi) and not needs_torch(cfg, unchecked):  # all checked: the ranks prepare the data
        clock.add({"checks": clock.since_start()})
        exec_agent(cmd, {ENV: clock.to_env()})
    from raggedvl.app.resume import (
        RESUME_CHECKED_ENV, check_resume_data, check_resume_settings, check_something_to_resume, resume_point,
    )
    from raggedvl.app.setup import check_model_checkpoint, prepare_run_data

    resumed = resume_point(cfg) if cfg.resume else None
    if cfg.resume:
        check_something_to_resume(cfg, resumed)
    if resumed is not None:  # settings the checkpoint cannot continue with: one line, before any rank
        note = check_resume_settings(cfg, world, *resumed)
        if note:
            print(note, file=sys.stderr, flush=True)
    check_model_checkpoint(cfg)  # a broken colpali / transformers checkpoint: one line, before any rank
    clock.add({"imports": clock.since_start()})
    data = prepare_run_data(cfg)
    clock.add(data.phases_s)
    if resumed is not None:
        check_resume_data(cfg, data, world, *resumed)
    if world == 1 and not multi:
        from raggedvl.app.loop import train
        from raggedvl.app.preemption import PREEMPTED_EXIT_CODE

        summary = train(cfg, data=data, clock=clock, resume_checked=resumed is not None)
        return PREEMPTED_EXIT_CODE if summary.get("preempted") else 0
    exec_agent(cmd, {ENV: clock.to_env(), **({RESUME_CHECKED_ENV: "1"} if resumed is not None else {})})
