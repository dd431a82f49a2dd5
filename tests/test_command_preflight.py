"""``raggedvl eval`` / ``encode`` / ``search`` / ``export`` check what their checkpoint and
``--dataset`` name, and the columns of a local parquet benchmark, before torch is imported:
each mistake is one line, exit code 2, in seconds, never minutes of hub
retries; ``raggedvl train``'s evaluation set has its own column keys."""

import subprocess
import sys

import pytest

from raggedvl.app.config import TrainConfig
from raggedvl.app.setup import load_splits

from .train.test_preflight import _parquet

def test_mistyped_checkpoints_and_datasets_fail_before_torch(tmp_path):
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "train_config.json").write_text("{}")  # a run folder, as far as the name checks go
    (tmp_path / "runs" / "a" / "checkpoints" / "step-000001").mkdir(parents=True)
    (tmp_path / "runs" / "new").mkdir()
    for name in ("train_config.json", "metrics.jsonl"):  # a run stopped before its first checkpoint
        (tmp_path / "runs" / "new" / name).write_text("{}")
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "index.json").write_text("{}")
    renamed = _parquet(tmp_path / "test.parquet", names=("question", "page", "doc_id"))
    pairs = _parquet(tmp_path / "pairs.parquet")
    (tmp_path / "notes.txt").write_text("a file where an output folder would go")
    cases = [
        (["eval", "runs/new"], "checkpoint 'runs/new' is a training run with no checkpoint yet (it stopped before its "
                               "first save); train it again with raggedvl train --output-dir runs/new and its settings (without --resume"),
        (["export", "runs/new", "--format", "colpali", "--output", "out"], "source 'runs/new' is a training run with no checkpoint"),
        # outputs that cannot be written: refused before any work
        (["export", "runs/a", "--format", "colpali", "--output", "notes.txt"],
         "--output 'notes.txt': 'notes.txt' is a file, not a folder; choose another --output"),
        (["encode", "runs/a", "--dataset", pairs, "--output", "notes.txt/index"],
         "--output 'notes.txt/index': 'notes.txt' is a file, not a folder; choose another --output"),
        (["mine", "runs/a", "--dataset", pairs, "--output", "notes.txt"], "'notes.txt' is a file, not a folder"),
        # an output folder that holds other files: refused as export refuses it
        (["encode", "runs/a", "--dataset", pairs, "--output", "runs"],
         "--output 'runs' is not empty (it holds a, new); encode into a new folder"),
        (["mine", "runs/a", "--dataset", pairs, "--output", "runs"],
         "--output 'runs' is not empty (it holds a, new); mine into a new folder"),
        (["export", "runs/a", "--format", "colpali", "--output", "runs"],
         "--output 'runs' is not empty (it holds a, new); export into a new folder"),
        (["eval", "runs/a", "--dataset", pairs, "--output", "runs"],
         "--output 'runs' is a folder; give a file name, e.g. 'runs/results.json'"),
        (["eval", "runs/a", "--dataset", pairs, "--output", "notes.txt/r.json"], "'notes.txt' is a file, not a folder"),
        (["eval", "/x/y"], "checkpoint '/x/y': no such folder (no folder '/x' either)"),
        (["eval", "rnus/a"], "checkpoint 'rnus/a': no such folder; did you mean 'runs/a'?"),
        (["eval", "runs/b"], "checkpoint 'runs/b': no such folder (the folder 'runs' exists)"),
        (["export", "runs/aa", "--format", "colpali", "--output", "out"], "source 'runs/aa': no such folder; did you mean 'runs/a'?"),
        (["encode", "runs/a", "--dataset", "tset.parquet", "--output", "index"],
         "--dataset 'tset.parquet': no such file or folder; did you mean 'test.parquet'?"),
        (["search", "tyny", "--index", "index", "--query", "q"], "did you mean 'tiny'?"),
        (["search", "runs/a", "--index", "indx", "--query", "q"], "--index 'indx': no such folder; did you mean 'index'?"),
        (["search", "runs/a", "--index", "runs", "--query", "q"],
         "--index 'runs' is not an embedding index (no index.json); build one with raggedvl encode"),
        (["search", "runs/a", "--index", "index", "--query", "q", "--query", " "], "--query number 2 is empty (' ')"),
        (["search", "runs/a", "--index", "index", "--query", "q", "-k", "0"], "-k must be >= 1, got 0"),
        (["eval", "org/model"], "checkpoint 'org/model': the hub is off (HF_HUB_OFFLINE)"),
        (["eval", "runs/a", "--dataset", "org/bench"], "--dataset 'org/bench': the hub is off (HF_HUB_OFFLINE)"),
        (["eval", "runs/a", "--dataset", renamed],  # another dataset's name for the query column
         f"{renamed} split 'test' has no column 'query' (columns: ['question', 'page', 'doc_id']); "
         "did you mean 'question'? pass --query-column naming the right one"),
        (["eval", "runs/a", "--dataset", renamed, "--query-column", "question", "--image-column", "pgae"],
         "has no column 'pgae' (columns: ['question', 'page', 'doc_id']); did you mean 'page'? pass --image-column"),
        (["eval", "runs/a", "--dataset", renamed, "--query-column", "question", "--image-column", "page",
          "--id-column", "doc-id"], "has no id column 'doc-id'"),
        # encode reads documents only: no query column, and its own column flags in the fix
        (["encode", "runs/a", "--dataset", renamed, "--output", "index"],
         f"{renamed} split 'test' has no column 'image' (columns: ['question', 'page', 'doc_id']); "
         "did you mean 'page'? pass --image-column naming the right one"),
        (["encode", "runs/a", "--dataset", renamed, "--output", "index", "--image-column", "pgae"],
         "did you mean 'page'? pass --image-column"),
        (["encode", "runs/a", "--dataset", renamed, "--output", "index", "--image-column", "page",
          "--id-column", "docid"], "did you mean 'doc_id'? pass --id-column"),
    ]
    code = ("import sys, time; from raggedvl.app.cli import main\n"
            f"for argv in {[argv for argv, _ in cases]!r}:\n"
            "    start = time.perf_counter(); rc = main(argv)\n"
            "    print(rc, 'torch' in sys.modules, time.perf_counter() - start < 10, flush=True)\n"
            "    print('---', file=sys.stderr, flush=True)\n")
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": ":".join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert out.stdout.split("\n")[:-1] == ["2 False True"] * len(cases), out.stdout + out.stderr
    errors = out.stderr.split("---\n")[:-1]
    assert len(errors) == len(cases), out.stderr
    for err, (_, expected) in zip(errors, cases):
        assert err.count("\n") == 1 and err.startswith("raggedvl: error: "), err
        assert expected in err, err

def test_the_training_evaluation_set_has_its_own_columns(tmp_path):
    """``--eval-dataset`` with other column names than the training set: the message names
    ``--eval-query-column`` (not the training set's flag), and ``eval_*_column`` reads it."""
    train = _parquet(tmp_path / "train.parquet")
    dev = _parquet(tmp_path / "dev.parquet", names=("question", "page", "docid"))
    common = {"dataset": train, "eval_dataset": dev, "max_train_samples": None, "max_eval_samples": None,
              "allow_eval_overlap": True}  # the same pairs: this test is about columns
    code = ("import sys; from raggedvl.app.cli import main; "
            f"rc = main(['train', '--dataset', {train!r}, '--eval-dataset', {dev!r}, '--eval-query-column', 'question', "
            f"'--output-dir', {str(tmp_path / 'run')!r}]); print(rc, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.stdout.split() == ["2", "False"], out.stdout + out.stderr  # the launcher's check, before torch
    assert out.stderr.count("\n") == 1 and "dev.parquet split 'dev' has no column 'image' (columns: ['question', 'page', " \
        "'docid']); did you mean 'page'? pass --eval-image-column (key eval_image_column)" in out.stderr, out.stderr
    with pytest.raises(ValueError, match=r"dev.parquet split 'dev' has no column 'query' .*pass --eval-query-column "
                                         r"\(key eval_query_column\)"):
        load_splits(TrainConfig(**common))
    with pytest.raises(ValueError, match=r"has no id column 'doc_id' .*did you mean 'docid'\? pass --eval-id-column"):
        load_splits(TrainConfig(id_column="doc_id", eval_query_column="question", eval_image_column="page", **common))
    cfg = TrainConfig(id_column="doc_id", eval_query_column="question", eval_image_column="page", eval_id_column="docid",
                      **common)
    train_set, bench = load_splits(cfg, warn=False)
    assert train_set.ids() == [f"doc-{i}" for i in range(8)]
    assert bench.query_ids == [f"doc-{i}" for i in range(8)] and bench.queries[3] == "question 3"


def test_eval_refuses_an_unwritable_default_results_folder_before_loading(tmp_path, monkeypatch, capsys):
    """The writability probe is made to fail as on a read-only filesystem (the tests may run as
    root, for whom a chmod-ed folder stays writable): one line naming the folder and --output,
    before any model or data loads."""
    import errno
    import tempfile

    from raggedvl.app.cli import main
    from raggedvl.app.rundir import results_folder

    run = tmp_path / "run"
    (run / "checkpoints" / "step-000001").mkdir(parents=True)
    (run / "train_config.json").write_text("{}")
    (run / "checkpoints" / "step-000001" / "MANIFEST.json").write_text("{}")
    for given in (run, run / "checkpoints", run / "checkpoints" / "step-000001"):
        assert results_folder(given).resolve() == (run / "eval").resolve(), given
    assert results_folder(tmp_path / "model") == tmp_path / "model" / "eval"

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    assert main(["eval", str(run)]) == 2
    assert capsys.readouterr().err == (f"raggedvl: error: the default output folder {str(run / 'eval')!r}: cannot write "
                                       f"in {str(run)!r} (Read-only file system); give --output FILE in a writable "
                                       "folder\n")
