"""``raggedvl mine CHECKPOINT --dataset D --output OUT``: hard negatives for a training set,
mined by a retriever with positive-aware filtering (:mod:`raggedvl.evaluation.mining`).

The training set is read as a benchmark (each distinct query with its relevant pages, the
distinct pages as the corpus). What is written, for ``raggedvl train --dataset OUT``:

- (query, image) pairs (parquet): ``OUT/train.parquet``, the input rows with a ``negatives``
  column (each row's mined pages, encoded bytes, best first; train with
  ``--negatives-column negatives``); image paths relative to the input's folder are written
  absolute, so ``OUT`` reads the input's image files where they are;
- a BEIR layout: ``OUT`` holds the input's ``corpus`` / ``queries`` / ``qrels`` parts (linked,
  else copied) and ``negatives.parquet`` (``query-id``, ``corpus-ids``: a list, best first),
  the negatives by reference.

Rank 0 prints a summary: queries, negatives kept, candidates each filter removed, queries that
got fewer than ``k``, and a ``raggedvl train`` command that trains on ``OUT`` as printed
(:func:`train_command`: the column flags and an evaluation set)."""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path


from raggedvl.app.column_flags import flags_for_columns
from raggedvl.app.config import TrainConfig
from raggedvl.app.evaluate_checkpoint import checkpoint_collator, load_model
from raggedvl.app.rundir import check_new_folder
from raggedvl.data.columns import Columns
from raggedvl.data.dataset import source_bytes
from raggedvl.data.scan import beir_part, read_column, resolved_image_column
from raggedvl.data.source import DataSource
from raggedvl.evaluation.benchmark import RetrievalBenchmark, load_benchmark
from raggedvl.evaluation.mining import FILTERS, MinedNegatives, mine_negatives
from raggedvl.parallel import barrier, init_distributed, shutdown
from raggedvl.app.wording import counted

NEGATIVES_COLUMN = "negatives"
NEGATIVES_TABLE = "negatives.parquet"
EVAL_FRACTION = 0.1  # the printed train command's held-out share when the run had no --eval-dataset


def mine(checkpoint: str | Path, *, dataset: str, split: str, output: str | Path, k: int,
         max_positive_ratio: float = 0.95, skip_top: int = 0, batch_size: int = 16, on_bad_image: str = "error",
         columns: Columns = Columns()) -> Path:
    """Mine ``k`` hard negatives per query of ``dataset``'s ``split`` and write them to
    ``output`` (module docstring). Raises ``ValueError`` for an ``output`` that holds files, a
    source that is neither local parquet pairs nor a local BEIR layout, or a bad argument."""
    out = Path(output)
    check_new_folder(out, "mine")
    source = DataSource.of(dataset)
    if source.kind not in ("parquet", "folder", "beir") or (source.kind != "beir" and source.parquet(split) is None):
        raise ValueError(f"--dataset {dataset}: mining writes local data, so it reads local (query, image) parquet "
                         f"pairs or a local BEIR folder (corpus / queries / qrels); got a {source.kind} source")
    info = init_distributed()
    try:
        model, processor, cfg, _ = load_model(Path(checkpoint), info.device)
        with flags_for_columns(keys=False):
            bench = load_benchmark(dataset, split, on_bad_image=on_bad_image, columns=columns)
        collate = checkpoint_collator(model, processor, cfg, on_bad_image=on_bad_image)
        mined = mine_negatives(model, collate, bench, k=k, max_positive_ratio=max_positive_ratio, skip_top=skip_top,
                               batch_size=batch_size, device=info.device, progress=info.is_main)
        if info.is_main:
            out.mkdir(parents=True, exist_ok=True)
            if source.kind == "beir":
                _write_by_reference(source.path, out, bench, mined)
            else:
                _write_pairs(source, split, out, bench, mined, columns)
            print(summary(bench, mined, k, out, train_command(out, source.kind == "beir", columns, cfg)))
        barrier()
        return out
    finally:
        shutdown()


def train_command(out: Path, by_reference: bool, columns: Columns, cfg: TrainConfig | None) -> str:
    """A ``raggedvl train`` command line that trains on ``out`` as written: the column flags the
    pairs need (``columns``, those mined with, where they differ from the defaults) and
    ``--negatives-column``, and an evaluation set, since ``out`` holds no dev split: the run's
    ``--eval-dataset`` with its split and columns when ``cfg`` (the mining checkpoint's run) had
    one, else ``--eval-fraction`` :data:`EVAL_FRACTION` of the mined pairs."""
    args = ["raggedvl", "train", "--dataset", str(out)]
    given = Columns() if by_reference else Columns(query=columns.query, image=columns.image, id=columns.id)
    if not by_reference:
        args += _column_flags("", given, Columns()) + ["--negatives-column", NEGATIVES_COLUMN]
    if cfg is not None and cfg.eval_dataset is not None:
        args += ["--eval-dataset", cfg.eval_dataset]
        if cfg.eval_split != TrainConfig.eval_split:
            args += ["--eval-split", cfg.eval_split]
        args += _column_flags("eval-", cfg.eval_columns, given)
    else:
        args += ["--eval-fraction", str(EVAL_FRACTION)]
    return shlex.join(args)


def _column_flags(prefix: str, columns: Columns, defaults: Columns) -> list[str]:
    """``--<prefix>query-column Q``... for each of ``columns``' query / image / id columns that is
    not the one ``defaults`` names (``''``, no column, for an unset one that ``defaults`` sets)."""
    return [item for role in ("query", "image", "id") if getattr(columns, role) != getattr(defaults, role)
            for item in (f"--{prefix}{role}-column", getattr(columns, role) or "")]


def summary(bench: RetrievalBenchmark, mined: MinedNegatives, k: int, out: Path, train: str) -> str:
    """The command's closing lines: what was kept, what each filter removed, how to train
    (``train``: :func:`train_command`)."""
    kept = sum(len(n) for n in mined.negatives)
    removed = ", ".join(f"{name.replace('_', ' ')} {mined.removed[name]}" for name in FILTERS)
    queries = counted(len(bench.queries), "query", "queries")
    return (f"mined {counted(kept, 'hard negative')} for {queries} over {counted(len(bench.documents), 'page')} "
            f"(k = {k}; {counted(mined.short, 'query', 'queries')} got fewer); candidates removed: {removed}\n"
            f"wrote {out}; train with: {train}")


def _write_pairs(source: DataSource, split: str, out: Path, bench: RetrievalBenchmark, mined: MinedNegatives,
                 columns: Columns) -> None:
    """The input rows with a ``negatives`` column: each row's query's mined pages as bytes; image
    paths relative to the input's folder are written as absolute paths, so that the rows read
    the same files from ``out``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = source.parquet(split)
    table = pa.concat_tables([pq.read_table(f) for f in rows.files])
    if NEGATIVES_COLUMN in table.column_names:
        table = table.drop_columns([NEGATIVES_COLUMN])
    image = table.column_names.index(columns.image)
    table = table.set_column(image, columns.image,
                             resolved_image_column(table.column(image), rows.base_dir.absolute()))
    by_text = {text: q for q, text in enumerate(bench.queries)}
    pages = {}  # position -> bytes, each page read once
    negatives = []
    for text in read_column(rows, columns.query):
        q = by_text.get(text)
        row = [] if q is None else mined.negatives[q]
        for p in row:
            if p not in pages:
                pages[p] = source_bytes(bench.documents.image_sources[p])
        negatives.append([pages[p] for p in row])
    pq.write_table(table.append_column(NEGATIVES_COLUMN, pa.array(negatives, type=pa.list_(pa.binary()))),
                   out / "train.parquet")


def _write_by_reference(root: Path, out: Path, bench: RetrievalBenchmark, mined: MinedNegatives) -> None:
    """The BEIR parts linked (else copied) into ``out`` and ``negatives.parquet`` by corpus id."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for stem in ("corpus", "queries", "qrels"):
        part = beir_part(root, stem)
        target = out / part.name
        try:
            os.symlink(part.resolve(), target, target_is_directory=part.is_dir())
        except OSError:  # a file system without links
            (shutil.copytree if part.is_dir() else shutil.copy2)(part, target)
    ids = bench.doc_ids
    table = pa.table({"query-id": bench.query_ids,
                      "corpus-ids": [[ids[p] for p in row] for row in mined.negatives]})
    pq.write_table(table, out / NEGATIVES_TABLE)

