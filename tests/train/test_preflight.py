"""`raggedvl train` checks its input in the launching process, before any rank starts: each
bad name, column, query or image is one line on stderr naming the key/row/file and the fix,
with exit code 2 (issue 16 item 1). Names are checked before torch is imported (seconds);
timings are in BENCHMARKS.md, not asserted here."""

import io
import os
import subprocess
import sys

import datasets
import pytest
from huggingface_hub import constants
from PIL import Image

from raggedvl.cli import main
from raggedvl.sources import resolve_source
from raggedvl.train import launch
from raggedvl.train.config import TrainConfig
from raggedvl.train.setup import load_splits


def _png(seed: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (56 + 4 * seed, 56), (10 * seed, 80, 160)).save(buffer, format="PNG")
    return buffer.getvalue()


def _parquet(path, n=8, *, names=("query", "image", "doc_id"), corrupt=(), empty=()):
    query, image, ident = names
    rows = {query: ["" if i in empty else f"question {i}" for i in range(n)],
            image: [{"bytes": b"\x89PNG\r\n\x1a\n cut" if i in corrupt else _png(i), "path": None} for i in range(n)],
            ident: [f"doc-{i}" for i in range(n)]}
    features = datasets.Features({query: datasets.Value("string"), image: datasets.Image(), ident: datasets.Value("string")})
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(path))
    return str(path)


@pytest.fixture(autouse=True)
def _never_start_ranks(monkeypatch):
    """A check that let the run through must not replace the test process with torchrun's agent."""
    def refuse(cmd, env_updates=None):
        raise AssertionError(f"the launcher would have started {cmd}")

    monkeypatch.setattr(launch, "exec_agent", refuse)


def one_line_error(capsys, argv, tmp_path) -> str:
    capsys.readouterr()  # what the test's own set-up printed
    code = main(["train", "--output-dir", str(tmp_path / "run"), *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("raggedvl: error: "), err
    return err


@pytest.mark.parametrize("argv, expected", [
    (["--model", "tyny"], "--model 'tyny' is not a preset, a local path or a hub id it could be; did you mean 'tiny'?"),
    (["--dataset", "rdoc"], "did you mean 'rdocs'?"),
    (["--report-to", "tensorbord"], "unknown tracker 'tensorbord'; did you mean 'tensorboard'?"),
])
def test_names_close_to_a_preset(capsys, tmp_path, argv, expected):
    assert expected in one_line_error(capsys, argv, tmp_path)


def test_missing_local_paths_suggest_the_closest_entry(capsys, tmp_path):
    (tmp_path / "qwen2-vl-2b").mkdir()
    _parquet(tmp_path / "pairs.parquet")
    err = one_line_error(capsys, ["--model", str(tmp_path / "qwen2-vl-2c")], tmp_path)
    assert "no such file or folder; did you mean" in err and "qwen2-vl-2b" in err
    err = one_line_error(capsys, ["--dataset", str(tmp_path / "pair.parquet")], tmp_path)
    assert f"--dataset '{tmp_path / 'pair.parquet'}': no such file or folder; did you mean" in err and "pairs.parquet" in err
    err = one_line_error(capsys, ["--eval-dataset", str(tmp_path / "nowhere" / "dev.parquet")], tmp_path)
    assert "--eval-dataset" in err and "no folder" in err


def test_hub_ids_offline_or_unreachable_fail_without_retries(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    err = one_line_error(capsys, ["--model", "Qwen/Qwen2-VL-2B-Instruct"], tmp_path)
    assert "the hub is off (HF_HUB_OFFLINE)" in err and str(tmp_path / "hub") in err and "preset (tiny)" in err
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: refused at once
    err = one_line_error(capsys, ["--dataset", "vidore/colpali_train_set"], tmp_path)
    assert "--dataset 'vidore/colpali_train_set': cannot reach the hub" in err and "does not hold this dataset" in err


def test_an_unreachable_hub_falls_back_to_the_cache_for_the_whole_job(tmp_path, monkeypatch):
    commit = "a" * 40
    repo = tmp_path / "hub" / "models--org--cached"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert resolve_source("org/cached", repo_type="model") == "org/cached"
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # the ranks read the cache instead of retrying
    assert resolve_source("org/cached", repo_type="model") == "org/cached"  # offline now: the cache alone


def test_names_are_checked_before_torch_is_imported(tmp_path):
    code = ("import sys; from raggedvl.cli import main; rc = main(['train', '--model', 'tyny', '--output-dir', "
            f"{str(tmp_path)!r}]); print(rc, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["2", "False"], out.stdout + out.stderr
    assert out.stderr.count("\n") == 1 and "did you mean 'tiny'?" in out.stderr


def test_data_errors_are_one_line_before_torch_is_imported(tmp_path):
    """A missing dataset, a wrong column and a corrupt image (under the default sample limit and
    with all rows) each end the command with exit code 2 and one line, in a process that never
    imported torch or transformers: the launcher reads the table and the image headers itself."""
    good = _parquet(tmp_path / "good.parquet")
    renamed = _parquet(tmp_path / "renamed.parquet", names=("question", "page", "doc_id"))
    corrupt = _parquet(tmp_path / "corrupt.parquet", corrupt=(5,))
    cases = [["--dataset", str(tmp_path / "missing.parquet")],
             ["--dataset", renamed],
             ["--dataset", renamed, "--query-column", "question"],
             ["--dataset", renamed, "--query-column", "question", "--image-column", "page", "--id-column", "id"],
             ["--dataset", corrupt, "--id-column", "doc_id"],
             ["--dataset", corrupt, "--max-train-samples", "none"]]
    code = ("import sys; from raggedvl.cli import main\n"
            f"for argv in {cases!r}:\n"
            f"    rc = main(['train', '--output-dir', {str(tmp_path / 'run')!r}, *argv])\n"
            "    print(rc, 'torch' in sys.modules, 'transformers' in sys.modules, flush=True)\n"
            "    print('---', file=sys.stderr, flush=True)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.stdout.split("\n")[:-1] == ["2 False False"] * len(cases), out.stdout + out.stderr
    errors = out.stderr.split("---\n")[:-1]
    assert len(errors) == len(cases) and all(e.count("\n") == 1 and e.startswith("raggedvl: error: ") for e in errors), errors
    assert f"--dataset '{tmp_path / 'missing.parquet'}': no such file or folder; did you mean" in errors[0]
    assert "good.parquet" in errors[0] or "corrupt.parquet" in errors[0]
    columns = "(columns: ['question', 'page', 'doc_id'])"
    assert f"{renamed} split 'train' has no column 'query' {columns}" in errors[1] and "--query-column" in errors[1]
    assert "has no column 'image'" in errors[2] and "--image-column" in errors[2]
    assert "has no id column 'id'" in errors[3] and "--id-column" in errors[3]
    for err, ident in ((errors[4], "doc-5"), (errors[5], "train-5")):
        assert f"{corrupt} split 'train' row 5 (id '{ident}'): cannot read the image header" in err, err
        assert "--on-bad-image skip" in err and "BytesIO" not in err
    assert good  # the near miss the missing path is compared with


def test_a_corrupt_image_outside_the_training_sample_does_not_stop_the_run(tmp_path):
    """The launcher judges only the rows the run trains on (--max-train-samples keeps a stable
    sample, the ranks' own): a corrupt image left out of it is no error."""
    from raggedvl.data.dataset import kept_rows

    used, _ = kept_rows([f"q{i}" for i in range(12)], [f"train-{i}" for i in range(12)], "t", "error", 4)
    outside = min(set(range(12)) - set(used))
    path = _parquet(tmp_path / "pairs.parquet", n=12, corrupt=(outside,))
    common = {"dataset": path, "eval_before": False, "eval_after": False}
    launch.check_data(TrainConfig(max_train_samples=4, **common))
    with pytest.raises(ValueError, match=rf"row {outside} \(id 'train-{outside}'\): cannot read the image header"):
        launch.check_data(TrainConfig(max_train_samples=None, **common))
    launch.check_data(TrainConfig(max_train_samples=None, on_bad_image="skip", **common))


def test_missing_columns_name_the_flags_that_fix_them(capsys, tmp_path):
    path = _parquet(tmp_path / "pairs.parquet", names=("question", "page", "doc_id"))
    err = one_line_error(capsys, ["--dataset", path, "--eval-fraction", "0.25"], tmp_path)
    assert f"{path} split 'train' has no column 'query'" in err
    assert "(columns: ['question', 'page', 'doc_id']); pass --query-column (key query_column) naming the right one" in err
    err = one_line_error(capsys, ["--dataset", path, "--eval-fraction", "0.25", "--query-column", "question"], tmp_path)
    assert "has no column 'image'" in err and "--image-column" in err
    cfg = TrainConfig(dataset=path, query_column="question", image_column="page", id_column="doc_id",
                      eval_fraction=0.25, max_train_samples=None, max_eval_samples=None)
    train, bench = load_splits(cfg)
    assert len(train) + len(bench.queries) == 8
    assert sorted(train.ids() + bench.query_ids) == [f"doc-{i}" for i in range(8)]


def test_empty_queries_name_the_row_and_the_flag(capsys, tmp_path):
    path = _parquet(tmp_path / "pairs.parquet", empty=(3,))
    err = one_line_error(capsys, ["--dataset", path, "--eval-fraction", "0.25", "--id-column", "doc_id"], tmp_path)
    assert "row 3 (id 'doc-3') has an empty or non-string query ''" in err and "--on-empty-query skip" in err
    cfg = TrainConfig(dataset=path, id_column="doc_id", on_empty_query="skip", eval_fraction=0.25,
                      max_train_samples=None, max_eval_samples=None)
    train, bench = load_splits(cfg)
    assert "doc-3" not in train.ids() + bench.query_ids and len(train) + len(bench.queries) == 7


@pytest.mark.slow  # builds the tiny processor (the size estimate reads the headers through its policy)
def test_a_corrupt_image_is_named_by_row_id_and_file_with_the_skip_flag(capsys, tmp_path, small_data_cache):
    path = _parquet(tmp_path / "pairs.parquet", corrupt=(5,))
    err = one_line_error(capsys, ["--dataset", path, "--eval-before", "false", "--eval-after", "false", "--id-column", "doc_id",
                                  "--nproc-per-node", "2", "--data-cache", str(small_data_cache)], tmp_path)
    assert f"{path} split 'train' row 5 (id 'doc-5')" in err and "cannot read the image header" in err
    assert "--on-bad-image skip" in err


def test_an_image_file_is_named_with_its_path(tmp_path):
    (tmp_path / "pages").mkdir()
    for i in range(3):
        (tmp_path / "pages" / f"p{i}.png").write_bytes(_png(i) if i != 1 else b"not an image")
    data = {"query": [f"q {i}" for i in range(3)], "image": [f"pages/p{i}.png" for i in range(3)]}
    datasets.Dataset.from_dict(data).to_parquet(str(tmp_path / "pairs.parquet"))
    cfg = TrainConfig(dataset=str(tmp_path / "pairs.parquet"), eval_before=False, eval_after=False,
                      max_train_samples=None)
    train, _ = load_splits(cfg)
    with pytest.raises(ValueError, match=r"row 1 \(id 'train-1'\), file .*pages/p1\.png: cannot read the image header"):
        train.image_sizes()
