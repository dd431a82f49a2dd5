"""``raggedvl eval RUN --dataset D`` and ``raggedvl mine RUN --dataset D`` read D with the run's
columns unless flags name others, and mine's closing ``raggedvl train`` command works as printed
(the launcher's checks pass and the ranks would start)."""

import shlex

import datasets
import pyarrow.parquet as pq
import pytest

from raggedvl.app import launch
from raggedvl.app.cli import main
from raggedvl.app.config import TrainConfig
from raggedvl.app.mine import train_command
from raggedvl.data.columns import Columns

from .test_eval_cli import noise_png


def _pairs(path, n, offset=0):
    rows = {"question": [f"question {offset + i}" for i in range(n)],
            "page": [{"bytes": noise_png(offset + i, (56 + 28 * (i % 3), 56)), "path": None} for i in range(n)],
            "doc_id": [f"doc-{offset + i}" for i in range(n)]}
    features = datasets.Features({"question": datasets.Value("string"), "page": datasets.Image(),
                                  "doc_id": datasets.Value("string")})
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(path))
    return str(path)


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_data_cache):
    """A one-step run of the tiny model trained on columns question / page / doc_id."""
    from raggedvl.app.loop import train

    root = tmp_path_factory.mktemp("run-columns")
    pairs = _pairs(root / "pairs.parquet", 30)
    train(TrainConfig(dataset=pairs, query_column="question", image_column="page", id_column="doc_id", max_steps=1,
                      global_batch_size=4, warmup_steps=0, eval_before=False, eval_after=False,
                      output_dir=str(root / "run"), data_cache=str(small_data_cache)))
    return root, pairs


def test_eval_with_a_dataset_reads_it_with_the_runs_columns_unless_flags_say_otherwise(run, capsys):
    root, _ = run
    dev = _pairs(root / "heldout.parquet", 5, offset=100)
    capsys.readouterr()
    assert main(["eval", str(root / "run"), "--dataset", dev, "--output", str(root / "eval.json")]) == 0, \
        capsys.readouterr().err
    assert f"{dev} split 'train', 5 queries, 5 documents" in capsys.readouterr().out
    assert main(["eval", str(root / "run"), "--dataset", dev, "--query-column", "query"]) == 2  # a flag still wins
    err = capsys.readouterr().err
    assert "'query'" in err and "--query-column" in err and "['question', 'page', 'doc_id']" in err, err


def test_mine_reads_with_the_runs_columns_and_prints_a_train_command_that_passes_the_launchers_checks(
        run, tmp_path, capsys, monkeypatch, small_data_cache):
    root, pairs = run
    capsys.readouterr()
    assert main(["mine", str(root / "run"), "--dataset", pairs, "--output", str(tmp_path / "mined"), "-k", "2",
                 "--batch-size", "8"]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out.splitlines()[-1]
    command = printed.split("train with: ", 1)[1]
    assert command == shlex.join(["raggedvl", "train", "--dataset", str(tmp_path / "mined"), "--query-column",
                                  "question", "--image-column", "page", "--id-column", "doc_id",
                                  "--negatives-column", "negatives", "--eval-fraction", "0.1"])
    assert pq.read_table(tmp_path / "mined" / "train.parquet").column_names == ["question", "page", "doc_id",
                                                                                 "negatives"]

    class Started(Exception):
        pass

    def started(cmd, env_updates=None):
        raise Started(cmd)

    monkeypatch.setattr(launch, "exec_agent", started)
    argv = shlex.split(command)[1:] + ["--output-dir", str(tmp_path / "trained"), "--data-cache",
                                       str(small_data_cache), "--nproc-per-node", "2"]
    with pytest.raises(Started):  # every check passed (data, held-out split, overlap): the ranks would start
        main(argv)


def test_the_train_command_evaluates_on_the_runs_eval_dataset_with_its_columns(tmp_path):
    cfg = TrainConfig(dataset="pairs.parquet", query_column="question", eval_dataset="dev/", eval_split="test",
                      eval_query_column="q", eval_id_column=None, id_column="doc_id")
    columns = Columns(query="question", image="image", id="doc_id")
    assert shlex.split(train_command(tmp_path / "mined", False, columns, cfg)) == [
        "raggedvl", "train", "--dataset", str(tmp_path / "mined"), "--query-column", "question", "--id-column",
        "doc_id", "--negatives-column", "negatives", "--eval-dataset", "dev/", "--eval-split", "test",
        "--eval-query-column", "q"]
    # an evaluation set without the id column the training pairs have: its id column is unset
    other = TrainConfig(dataset="pairs.parquet", eval_dataset="dev/")
    assert train_command(tmp_path / "m", False, columns, other).endswith(
        "--eval-dataset dev/ --eval-query-column query --eval-id-column ''")
    # which train reads as no evaluation id column, where none takes id_column
    assert TrainConfig(dataset="p.parquet", id_column="doc_id", eval_id_column="").eval_columns.id is None
    assert TrainConfig(dataset="p.parquet", id_column="doc_id").eval_columns.id == "doc_id"
    assert train_command(tmp_path / "m", True, columns, None) == f"raggedvl train --dataset {tmp_path / 'm'} " \
                                                                 "--eval-fraction 0.1"


def test_eval_and_mine_of_a_run_with_an_id_column_read_data_without_one_given_an_empty_id_column(run, tmp_path, capsys):
    """``--id-column none`` takes the run's (doc_id), which this data lacks: the error names
    ``--id-column ''``, and with it the rows' ids are their row numbers."""
    import pyarrow as pa

    root, _ = run
    table = pq.read_table(_pairs(tmp_path / "full.parquet", 5, offset=200)).drop_columns(["doc_id"])
    pq.write_table(table, tmp_path / "other.parquet")
    other = str(tmp_path / "other.parquet")
    capsys.readouterr()
    for command in (["eval", str(root / "run"), "--dataset", other, "--split", "train"],
                    ["mine", str(root / "run"), "--dataset", other, "--output", str(tmp_path / "refused")]):
        assert main(command + ["--id-column", "none"]) == 2
        err = capsys.readouterr().err
        assert "'doc_id'" in err and err.rstrip().endswith("pass --id-column naming the right one, or '' for no id "
                                                           "column"), err
    assert main(["eval", str(root / "run"), "--dataset", other, "--split", "train", "--id-column", "",
                 "--output", str(tmp_path / "eval.json")]) == 0, capsys.readouterr().err
    assert f"{other} split 'train', 5 queries, 5 documents" in capsys.readouterr().out
    assert main(["mine", str(root / "run"), "--dataset", other, "--id-column", "", "--output", str(tmp_path / "mined"),
                 "-k", "2", "--batch-size", "8"]) == 0, capsys.readouterr().err
    command = capsys.readouterr().out.splitlines()[-1].split("train with: ", 1)[1]
    assert "--id-column" not in command  # the mined rows have no id column either
    assert pq.read_table(tmp_path / "mined" / "train.parquet").column_names == ["question", "page", "negatives"]
    assert pa.types.is_list(pq.read_schema(tmp_path / "mined" / "train.parquet").field("negatives").type)
