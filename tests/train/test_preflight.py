"""`raggedvl train` checks its input in the launching process, before any rank starts: each
bad name, column, query or image is one line on stderr naming the key/row/file and the fix,
with exit code 2. Names are checked before torch is imported (seconds);
timings are in BENCHMARKS.md, not asserted here."""

import io
import os
import subprocess
import sys

import datasets
import pytest
from huggingface_hub import constants
from PIL import Image

from raggedvl.app.cli import main
from raggedvl.app.sources import resolve_source
from raggedvl.app import launch
from raggedvl.app.config import TrainConfig
from raggedvl.app.setup import load_splits


def _png(seed: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (56 + 4 * seed, 56), (10 * seed, 80, 160)).save(buffer, format="PNG")
    return buffer.getvalue()


def _parquet(path, n=8, *, names=("query", "image", "doc_id"), corrupt=(), empty=(), cut=()):
    """``corrupt`` rows: an unreadable header; ``cut`` rows: a PNG whose header is intact but whose
    data stops half way (no IEND chunk)."""
    query, image, ident = names

    def image_bytes(i: int) -> bytes:
        if i in corrupt:
            return b"\x89PNG\r\n\x1a\n cut"
        return _png(i)[: len(_png(i)) // 2] if i in cut else _png(i)

    rows = {query: ["" if i in empty else f"question {i}" for i in range(n)],
            image: [{"bytes": image_bytes(i), "path": None} for i in range(n)],
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
    code = ("import sys; from raggedvl.app.cli import main; rc = main(['train', '--model', 'tyny', '--output-dir', "
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
    code = ("import sys; from raggedvl.app.cli import main\n"
            f"for argv in {cases!r}:\n"
            f"    rc = main(['train', '--output-dir', {str(tmp_path / 'run')!r}, *argv])\n"
            "    print(rc, 'torch' in sys.modules, 'transformers' in sys.modules, flush=True)\n"
            "    print('---', file=sys.stderr, flush=True)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.stdout.split("\n")[:-1] == ["2 False False"] * len(cases), out.stdout + out.stderr
    errors = out.stderr.split("---\n")[:-1]
    assert len(errors) == len(cases) and all(e.count("\n") == 1 and e.startswith("raggedvl: error: ") for e in errors), errors
    # no entry of the folder is close to "missing" (good, renamed, corrupt): none is suggested
    assert f"--dataset '{tmp_path / 'missing.parquet'}': no such file or folder (the folder {str(tmp_path)!r} exists)" \
        in errors[0], errors[0]
    columns = "(columns: ['question', 'page', 'doc_id'])"
    assert f"{renamed} split 'train' has no column 'query' {columns}" in errors[1] and "--query-column" in errors[1]
    assert "has no column 'image'" in errors[2] and "--image-column" in errors[2]
    assert "has no id column 'id'" in errors[3] and "--id-column" in errors[3]
    for err, ident in ((errors[4], "doc-5"), (errors[5], "train-5")):
        assert f"{corrupt} split 'train' row 5 (id '{ident}'): cannot read the image header" in err, err
        assert "--on-bad-image skip" in err and "BytesIO" not in err
    assert good  # the near miss the missing path is compared with


def test_a_truncated_png_stops_the_launcher_in_one_line(capsys, tmp_path):
    """A PNG cut short (header intact, data missing: it would pass a header-only check and fail
    later, inside a rank) is found by the launcher's header scan: one line naming the row, the id,
    the file, the cause and --on-bad-image skip, exit code 2, before any rank starts."""
    path = _parquet(tmp_path / "pairs.parquet", cut=(6,))
    err = one_line_error(capsys, ["--dataset", path, "--id-column", "doc_id", "--eval-before", "false",
                                  "--eval-after", "false"], tmp_path)
    assert f"{path} split 'train' row 6 (id 'doc-6'): truncated PNG (no IEND chunk)" in err, err
    assert "--on-bad-image skip" in err and "BytesIO" not in err


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
    assert ("(columns: ['question', 'page', 'doc_id']); did you mean 'question'? pass --query-column (key query_column) "
            "naming the right one") in err
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
    # the skipped row stays reported through the hash split (select): the run warns once and
    # summary.md counts it (Trainer: empty_query_warning, "training rows left out ...: 1")
    assert [(r["row"], r["id"]) for r in train.skipped_rows] == [(3, "doc-3")]
    from raggedvl.app.loop import empty_query_warning

    rows = [{"dataset": train.where, **r} for r in train.skipped_rows]
    assert empty_query_warning(rows) == (f"warning: left out 1 training row with an empty or non-string query "
                                         f"(--on-empty-query skip): {train.where} row 3 (id 'doc-3')")
    many = [{"row": i, "id": f"d{i}"} for i in range(5)]
    assert empty_query_warning(many).endswith("row 2 (id 'd2') and 2 more") and "5 training rows" in empty_query_warning(many)


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


def test_a_missing_image_file_names_the_row_the_file_and_on_bad_image_skip(tmp_path, capsys):
    """A training row whose image file is gone, found where the held-out split reads the images'
    bytes (--eval-fraction: past the launcher's scan): one line naming the row, the file and
    ``--on-bad-image skip``; with it, the run leaves the row out and trains."""
    (tmp_path / "pages").mkdir()
    for i in range(8):
        if i != 3:
            (tmp_path / "pages" / f"p{i}.png").write_bytes(_png(i))
    data = {"query": [f"q {i}" for i in range(8)], "image": [f"pages/p{i}.png" for i in range(8)]}
    datasets.Dataset.from_dict(data).to_parquet(str(tmp_path / "pairs.parquet"))
    argv = ["--dataset", str(tmp_path / "pairs.parquet"), "--eval-fraction", "0.25", "--nproc-per-node", "1",
            "--global-batch-size", "2", "--max-steps", "1", "--eval-before", "false", "--eval-after", "false"]
    err = one_line_error(capsys, argv, tmp_path)
    assert f"pairs.parquet split 'train' row 3 (id 'train-3'), file {tmp_path / 'pages' / 'p3.png'}: cannot read the " \
           "image (FileNotFoundError: [Errno 2] No such file or directory" in err, err
    assert err.rstrip().endswith("fix or remove it, or skip such images: on_bad_image='skip' (raggedvl: --on-bad-image "
                                 "skip)"), err
    assert main(["train", "--output-dir", str(tmp_path / "skipped"), *argv, "--on-bad-image", "skip"]) == 0
    out = capsys.readouterr().out
    assert "training 1 step," in out and "(1 more left out: image unreadable)" in out, out  # row 3, and only it


def _negatives_parquet(path, n=8, *, corrupt=None, counts=None, single=False):
    """(query, image, doc_id, negs) rows, two hard negatives each (one when ``single``);
    ``corrupt``: (row, index) of a cut PNG; ``counts``: row -> how many negatives it holds."""
    cut = {"bytes": b"\x89PNG\r\n\x1a\n cut", "path": None}
    negs = []
    for i in range(n):
        cell = [cut if (i, j) == corrupt else {"bytes": _png(20 + j), "path": None}
                for j in range((counts or {}).get(i, 1 if single else 2))]
        negs.append(cell[0] if single else cell)
    rows = {"query": [f"question {i}" for i in range(n)], "image": [{"bytes": _png(i), "path": None} for i in range(n)],
            "doc_id": [f"doc-{i}" for i in range(n)], "negs": negs}
    features = datasets.Features({"query": datasets.Value("string"), "image": datasets.Image(),
                                  "doc_id": datasets.Value("string"),
                                  "negs": datasets.Image() if single else datasets.List(datasets.Image())})
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(path))
    return str(path)


def _run_launcher(tmp_path, cases, *, before=""):
    """Run ``raggedvl train`` on each argv of ``cases`` in one fresh process with an --output-dir
    of its own (torchrun's agent replaced by a line saying it would start); per case: (exit code
    or "exec", torch imported, transformers imported, stderr)."""
    code = ("import os, sys\nfrom raggedvl.app.cli import main\nfrom raggedvl.app import launch\n"
            "import raggedvl.app.gpu_driver as gpu_driver; gpu_driver.GPU_DRIVER_FILES = ('/nonexistent/gpu-driver',)\n"  # the same on a GPU machine
            "class Started(Exception): pass\n"
            "def exec_agent(cmd, env_updates=None): raise Started(' '.join(cmd[cmd.index('--nproc-per-node'):][:2]))\n"
            "launch.exec_agent = exec_agent\n" + before +
            f"for i, argv in enumerate({cases!r}):\n"
            f"    out = os.path.join({str(tmp_path)!r}, f'run{{i}}')\n"
            "    try:\n"
            "        rc = main(['train', '--output-dir', out, '--global-batch-size', '2', *argv])\n"
            "    except Started as started:\n"
            "        rc = 'exec:' + str(started).replace(' ', '=')\n"
            "    print(rc, 'torch' in sys.modules, 'transformers' in sys.modules, flush=True)\n"
            "    print('---', file=sys.stderr, flush=True)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    results = [line.split() for line in out.stdout.splitlines() if line and not line.startswith(("+", "raggedvl: loading"))]
    errors = out.stderr.split("---\n")[:-1]
    assert len(results) == len(errors) == len(cases), out.stdout + out.stderr
    return [(rc, torch == "True", transformers == "True", err) for (rc, torch, transformers), err in zip(results, errors)]


def _positives_parquet(path, counts, corrupt=None):
    """(query, image, doc_id) rows whose image cell is a list of ``counts[i]`` positives;
    ``corrupt``: (row, index) of a cut PNG."""
    cut = {"bytes": b"\x89PNG\r\n\x1a\n cut", "path": None}
    images = [[cut if (i, j) == corrupt else {"bytes": _png(10 * i + j), "path": None} for j in range(c)]
              for i, c in enumerate(counts)]
    rows = {"query": [f"question {i}" for i in range(len(counts))], "image": images,
            "doc_id": [f"doc-{i}" for i in range(len(counts))]}
    features = datasets.Features({"query": datasets.Value("string"), "image": datasets.List(datasets.Image()),
                                  "doc_id": datasets.Value("string")})
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(path))
    return str(path)


def test_negatives_eval_split_and_output_dir_fail_in_one_line_before_torch(tmp_path):
    """A corrupt hard negative (in a list, or the one image of a row), a row with an empty list
    of positives, a missing evaluation split and an output directory holding another run's
    checkpoints: each one line and exit code 2 from the launcher, with 2 processes asked for,
    in a process that never imported torch or transformers."""
    listed = _negatives_parquet(tmp_path / "listed.parquet", corrupt=(5, 1))
    single = _negatives_parquet(tmp_path / "single.parquet", corrupt=(6, 0), single=True)
    short = _positives_parquet(tmp_path / "short.parquet", [2, 1, 2, 0, 1, 1, 2, 2])
    broken = _positives_parquet(tmp_path / "broken.parquet", [2] * 8, corrupt=(4, 1))
    good = _parquet(tmp_path / "good.parquet")
    (tmp_path / "folder").mkdir()  # two splits, none of them dev
    _parquet(tmp_path / "folder" / "train.parquet")
    _parquet(tmp_path / "folder" / "test.parquet")
    (tmp_path / "run4" / "checkpoints" / "step-2").mkdir(parents=True)  # the 5th case's --output-dir
    no_eval = ["--eval-before", "false", "--eval-after", "false"]
    cases = [["--dataset", listed, "--negatives-column", "negs", "--id-column", "doc_id", "--nproc-per-node", "2", *no_eval],
             ["--dataset", single, "--negatives-column", "negs", "--nproc-per-node", "2", *no_eval],
             ["--dataset", short, "--id-column", "doc_id", "--nproc-per-node", "2", *no_eval],
             ["--dataset", good, "--eval-dataset", str(tmp_path / "folder"), "--nproc-per-node", "2"],
             ["--dataset", good, "--nproc-per-node", "2", *no_eval],
             ["--dataset", "rdocs", "--negatives-column", "negs", "--nproc-per-node", "2", *no_eval],
             ["--dataset", listed, "--negatives-column", "query", "--nproc-per-node", "2", *no_eval],
             ["--dataset", listed, "--image-column", "doc_id", "--nproc-per-node", "2", *no_eval],
             ["--dataset", good, "--eval-dataset", good, "--eval-split", "train", "--eval-image-column", "query",
              "--nproc-per-node", "2"],
             ["--dataset", broken, "--id-column", "doc_id", "--nproc-per-node", "2", *no_eval]]
    results = _run_launcher(tmp_path, cases)
    for rc, torch, transformers, err in results:
        assert (rc, torch, transformers) == ("2", False, False), (rc, torch, transformers, err)
        assert err.count("\n") == 1 and err.startswith("raggedvl: error: "), err
    errors = [r[3] for r in results]
    assert f"{listed} split 'train' row 5 (id 'doc-5'), hard negative 1: cannot read the image header" in errors[0]
    assert f"{single} split 'train' row 6 (id 'train-6'), hard negative 0: cannot read the image header" in errors[1]
    assert all("--on-bad-image skip" in e and "BytesIO" not in e for e in errors[:2])
    assert "row 3 (id 'doc-3') has no image in its list of positives in column 'image'" in errors[2]
    assert f"{tmp_path / 'folder'} has no split 'dev'; its splits: ['test', 'train']" in errors[3]
    assert "already holds checkpoints of a run (step-2); pass --resume to continue it, or choose a new --output-dir" in errors[4]
    assert "rdocs is an rdocs manifest, which has no hard-negatives column 'negs'" in errors[5]
    # a text column named as images: refused before any image is read, with the fix (not "file
    # not found ... --on-bad-image skip", which would skip every row)
    assert errors[6] == ("raggedvl: error: the hard-negatives column 'query' holds text, not images: row 0's value "
                         f"'question 0' is not an image file (it is the query column; {listed} split 'train'; columns: "
                         "['query', 'image', 'doc_id', 'negs']); pass --negatives-column (key negatives_column) naming "
                         "the right one, or none\n")
    assert errors[7].startswith("raggedvl: error: the image column 'doc_id' holds text, not images: row 0's value "
                                "'doc-0' is not an image file (no file of that name, and none of the first 5 values has "
                                "an image extension such as .png;")
    assert "pass --image-column (key image_column) naming the right one" in errors[7]
    assert errors[8].startswith("raggedvl: error: the image column 'query' holds text, not images: row 0's value "
                                "'question 0' is not an image file (it is the query column;")
    assert "pass --eval-image-column (key eval_image_column)" in errors[8]
    assert not any("--on-bad-image" in e for e in errors[6:9])
    assert f"{broken} split 'train' row 4 (id 'doc-4'), positive 1: cannot read the image header" in errors[9]


def test_a_bad_image_in_a_row_with_hard_negatives_says_what_each_image_number_is():
    from raggedvl.app.setup import negatives_label

    assert negatives_label(0) == ""
    assert negatives_label(1) == " (image 0: the document, image 1: its hard negative)"
    assert negatives_label(3) == " (image 0: the document, images 1-3: its hard negatives)"


def test_checked_data_starts_the_ranks_without_torch(tmp_path):
    """When the launcher could check everything without torch (local parquet, hard negatives,
    the rdocs preset, no --resume, no local --model folder), it starts torchrun's agent right
    after the checks: torch and transformers were never imported. The default process count
    without a GPU driver is 2, also without torch; a skipped corrupt negative is no error."""
    good = _negatives_parquet(tmp_path / "good.parquet")
    skipped = _negatives_parquet(tmp_path / "skipped.parquet", corrupt=(2, 0))
    no_eval = ["--eval-before", "false", "--eval-after", "false"]
    cases = [["--dataset", good, "--negatives-column", "negs", *no_eval],
             ["--dataset", skipped, "--negatives-column", "negs", "--on-bad-image", "skip", "--nproc-per-node", "3",
              "--global-batch-size", "3", *no_eval],
             ["--dataset", "rdocs", "--nproc-per-node", "2", "--max-train-samples", "16", "--max-eval-samples", "8"]]
    results = _run_launcher(tmp_path, cases)
    assert [r[:3] for r in results] == [("exec:--nproc-per-node=2", False, False),
                                        ("exec:--nproc-per-node=3", False, False),
                                        ("exec:--nproc-per-node=2", False, False)], results


def test_reading_local_parquet_imports_neither_pandas_nor_pyarrow_dataset(tmp_path):
    """The launcher's checks and the training set's loading read local parquet through
    ``pq.ParquetFile`` and the memory-mapped Arrow cache: ``pq.read_table`` would import
    ``pyarrow.dataset`` and with it pandas, ~50 MiB resident for the whole of a 1-process run,
    which trains in the launching process (BENCHMARKS.md, "vs colpali-engine")."""
    good = _parquet(tmp_path / "good.parquet")
    code = ("import sys\n"
            "from raggedvl.data.columns import Columns\n"
            "from raggedvl.data.dataset import load_retrieval_dataset\n"
            "from raggedvl.app import launch\n"
            "from raggedvl.app.config import TrainConfig\n"
            f"cfg = TrainConfig(dataset={good!r}, id_column='doc_id', eval_before=False, eval_after=False)\n"
            "unchecked = launch.check_data(cfg)\n"
            f"data = load_retrieval_dataset({good!r}, columns=Columns(id='doc_id'), cache_dir={str(tmp_path / 'cache')!r})\n"
            "print(unchecked, len(data), 'pyarrow.dataset' in sys.modules, 'pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.stdout.split() == ["[]", "8", "False", "False"], out.stdout + out.stderr


def test_what_the_launcher_cannot_check_without_torch_keeps_the_full_checks(tmp_path):
    """needs_torch: --resume and data check_data could not scan (a hub
    id, --eval-fraction, a BEIR folder as the evaluation set) send the launcher through the checks
    that import torch (checkpoints, datasets' loader) before any rank starts."""
    good = _parquet(tmp_path / "good.parquet")
    no_eval = {"eval_before": False, "eval_after": False}
    assert launch.check_data(TrainConfig(dataset=good, **no_eval)) == []
    assert launch.check_data(TrainConfig(dataset="rdocs")) == []
    assert launch.check_data(TrainConfig(dataset=[good, "org/pairs"], **no_eval)) == ["--dataset org/pairs (not local parquet)"]
    assert launch.check_data(TrainConfig(dataset=good, eval_fraction=0.25)) == [
        "--eval-fraction (the held-out rows depend on image digests)"]
    beir = tmp_path / "beir"
    for part in ("corpus", "queries", "qrels"):
        (beir / part).mkdir(parents=True)
    assert launch.check_data(TrainConfig(dataset=good, eval_dataset=str(beir))) == [
        f"--eval-dataset {beir} split 'dev' (not local parquet)"]
    assert launch.check_data(TrainConfig(dataset=good, eval_dataset=str(beir), **no_eval)) == []  # not read
    assert launch.needs_torch(TrainConfig(dataset=good), []) == []
    assert launch.needs_torch(TrainConfig(dataset=good, resume=True), []) == ["--resume"]
    (tmp_path / "model").mkdir()  # a local checkpoint: the ranks' loading checks its files
    assert launch.needs_torch(TrainConfig(dataset=good, model=str(tmp_path / "model")), ["x"]) == ["x"]
    assert launch.needs_torch(TrainConfig(dataset=good, model=str(tmp_path / "model")), []) == []


def test_default_nproc_without_a_gpu_driver_is_2_without_torch():
    code = ("import sys; from raggedvl.app import gpu_driver; from raggedvl.app import launch; "
            "gpu_driver.GPU_DRIVER_FILES = ('/nonexistent/gpu',); "
            "print(launch.default_nproc(), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["2", "False"], out.stdout + out.stderr


def test_the_output_dir_check_reads_only_the_folder(tmp_path):
    from raggedvl.app.checkpoint import list_checkpoints
    from raggedvl.app.rundir import check_output_dir, checkpoint_folders

    run = tmp_path / "run"
    check_output_dir(TrainConfig(output_dir=str(run)))  # no folder yet
    (run / "checkpoints" / "step-10").mkdir(parents=True)
    (run / "checkpoints" / "step-12.tmp-99").mkdir()  # an interrupted write: not a checkpoint
    (run / "best" / "step-4").mkdir(parents=True)
    assert [p.name for p in checkpoint_folders(run / "checkpoints")] == ["step-10"]
    assert list_checkpoints(run / "checkpoints") == checkpoint_folders(run / "checkpoints")
    with pytest.raises(ValueError, match=r"already holds checkpoints of a run \(step-10, step-4\); pass --resume"):
        check_output_dir(TrainConfig(output_dir=str(run)))
    check_output_dir(TrainConfig(output_dir=str(run), resume=True))


@pytest.mark.parametrize("files, message", [
    ((), "is not a model folder: it has no config.json / raggedvl_retriever.json / adapter_config.json / "
         "train_config.json (it holds nothing)"),
    (("model.safetensors",), "it holds model.safetensors"),
    (("config.json", "model.safetensors"), "has config.json but no processor"),
])
def test_an_empty_or_incomplete_model_folder_is_refused_before_any_rank(capsys, tmp_path, files, message):
    folder = tmp_path / "model"
    folder.mkdir()
    for name in files:
        (folder / name).write_text("{}")
    assert main(["train", "--model", str(folder), "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def _pairs(path, queries, images=None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    Image.new("RGB", (56, 56), "white").save(buffer, format="PNG")
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    rows = images if images is not None else [{"bytes": buffer.getvalue(), "path": None}] * len(queries)
    pq.write_table(pa.table({"query": queries, "image": pa.array(rows, type=image_type)}), str(path))
    return str(path)


def test_a_file_without_rows_is_one_line_before_launch(capsys, tmp_path):
    import pyarrow as pa

    data = _pairs(tmp_path / "empty.parquet", pa.array([], type=pa.string()), images=[])
    assert main(["train", "--dataset", data, "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{data} split 'train' has no rows" in err, err


def test_text_that_is_not_utf8_names_the_file_column_and_row(capsys, tmp_path):
    import pyarrow as pa

    raw = pa.array([b"fine", b"caf\xe9 menu", b"also fine"], type=pa.binary())
    broken = pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())  # a writer that skipped validation
    data = _pairs(tmp_path / "latin1.parquet", broken)
    assert main(["train", "--dataset", data, "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"{data}: column 'query' row 1 is not valid UTF-8 text" in err and "byte 0xe9 at position 3" in err, err


def test_a_binary_query_column_is_named_not_skipped(capsys, tmp_path):
    import pyarrow as pa

    data = _pairs(tmp_path / "binary.parquet", pa.array([b"one", b"two"], type=pa.binary()))
    for extra in ([], ["--on-empty-query", "skip"]):
        assert main(["train", "--dataset", data, "--output-dir", str(tmp_path / "run"), *extra]) == 2
        err = capsys.readouterr().err
        assert "has a query of bytes, not text (b'one')" in err and "write it as a string column" in err, err


def test_an_output_dir_below_a_file_is_one_line_before_launch(capsys, tmp_path):
    (tmp_path / "afile").write_text("x")
    assert main(["train", "--output-dir", str(tmp_path / "afile" / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a file, not a folder; choose another --output-dir" in err, err


def test_an_unwritable_output_dir_is_one_line_before_launch(capsys, tmp_path, monkeypatch):
    import tempfile

    def refuse(*args, **kwargs):  # a read-only filesystem (root ignores a folder's mode bits)
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    assert main(["train", "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write in" in err and "Read-only file system" in err, err


def test_a_full_fine_tune_that_cannot_fit_its_checkpoint_is_refused(capsys, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    from safetensors.torch import save_file
    import torch

    from raggedvl.app.launch import model_parameters

    model = tmp_path / "model"
    model.mkdir()
    save_file({"a": torch.zeros(10, 100), "b": torch.zeros(50)}, str(model / "model.safetensors"))
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("{}")
    assert model_parameters(str(model)) == 1050
    usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 0, 12 * 1050 - 1))
    assert main(["train", "--model", str(model), "--lora", "false", "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "12,599 bytes free" in err and "needs about 12,600" in err, err


class _Started(Exception):
    pass


def test_an_eval_dataset_of_one_split_is_the_evaluation_set_whatever_its_name(tmp_path, monkeypatch):
    """``--eval-dataset heldout.parquet`` (split "train" by its name) and a folder of one split
    file are evaluated on that split with the default --eval-split: the launcher checks its
    columns and starts the ranks."""
    train = _parquet(tmp_path / "pairs.parquet")
    heldout = _parquet(tmp_path / "heldout.parquet", names=("question", "image", "doc_id"))
    (tmp_path / "folder").mkdir()
    _parquet(tmp_path / "folder" / "pairs-b.parquet")

    def started(cmd, env_updates=None):
        raise _Started(cmd)

    monkeypatch.setattr(launch, "exec_agent", started)
    for eval_set, extra in [(heldout, ["--eval-query-column", "question"]), (str(tmp_path / "folder"), [])]:
        argv = ["train", "--output-dir", str(tmp_path / "run"), "--dataset", train, "--eval-dataset", eval_set,
                "--allow-eval-overlap", "--nproc-per-node", "2", *extra]
        with pytest.raises(_Started):
            main(argv)
    cfg = TrainConfig(dataset=train, eval_dataset=heldout)
    assert (cfg.eval_split, cfg.resolved_eval_split) == ("dev", "train")
    assert TrainConfig(dataset=train, eval_dataset=str(tmp_path / "folder")).resolved_eval_split == "train"
    assert TrainConfig(dataset=str(tmp_path / "folder")).resolved_eval_split == "dev"  # --dataset: its own rules


def test_an_evaluation_split_that_is_training_data_is_refused_before_any_process(capsys, tmp_path, monkeypatch):
    """The evaluation split reads the training split's file (the same file, or a folder's train
    split named by --eval-split): one line from the launcher, before torch, unless
    --allow-eval-overlap."""
    pairs = _parquet(tmp_path / "pairs.parquet")
    err = one_line_error(capsys, ["--dataset", pairs, "--eval-dataset", pairs, "--eval-split", "train",
                                  "--nproc-per-node", "2"], tmp_path)
    assert err == (f"raggedvl: error: evaluation set {pairs} split 'train' overlaps the training pairs: it reads "
                   f"{pairs}, which --dataset {pairs} split 'train' trains on; dev metrics would measure memorisation. "
                   "Evaluate on held-out data (--eval-dataset, --eval-split, --eval-fraction) or pass "
                   "--allow-eval-overlap\n"), err
    (tmp_path / "folder").mkdir()
    _parquet(tmp_path / "folder" / "train.parquet")
    _parquet(tmp_path / "folder" / "dev.parquet")
    err = one_line_error(capsys, ["--dataset", str(tmp_path / "folder"), "--eval-split", "train"], tmp_path)
    assert f"evaluation set {tmp_path / 'folder'} split 'train' overlaps the training pairs: it reads " \
           f"{tmp_path / 'folder' / 'train.parquet'}, which --dataset {tmp_path / 'folder'} split 'train'" in err, err

    def started(cmd, env_updates=None):
        raise _Started(cmd)

    monkeypatch.setattr(launch, "exec_agent", started)
    with pytest.raises(_Started):
        main(["train", "--output-dir", str(tmp_path / "run"), "--dataset", pairs, "--eval-dataset", pairs,
              "--eval-split", "train", "--allow-eval-overlap", "--nproc-per-node", "2"])


def test_a_run_the_ranks_refuse_leaves_its_output_dir_as_it_was(tmp_path, monkeypatch):
    """A refusal in a rank's setup (an evaluation set whose pairs are the training pairs', in
    another file: only the ranks' content check sees it) writes nothing: an output dir that
    holds files keeps exactly those (no train_config.json), and a missing one is not created."""
    from raggedvl.app import setup
    from raggedvl.app.loop import Trainer
    from raggedvl.parallel import init_distributed

    monkeypatch.setattr(setup, "build_cfg_processor", lambda cfg: None)  # the data is refused before it is used
    pairs, copy = _parquet(tmp_path / "pairs.parquet"), _parquet(tmp_path / "copy.parquet")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    for out in (tmp_path / "run", tmp_path / "new"):
        cfg = TrainConfig(dataset=pairs, eval_dataset=copy, output_dir=str(out), max_steps=1, global_batch_size=4)
        with pytest.raises(ValueError, match=r"'.*copy.parquet' \(split 'train'\) overlaps the training pairs: 8 of 8 "):
            Trainer(cfg, init_distributed())
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["notes.txt"]
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "new").exists()
