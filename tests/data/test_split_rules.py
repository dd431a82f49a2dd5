"""raggedvl.data.split_rules: a local folder's splits by datasets' default rules without
importing datasets; whenever it decides, the same splits and files, in the same order, as
``DataFilesDict.from_patterns(get_data_patterns(folder))``."""

import os
import random
import subprocess
import sys
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import data_files as hf
from packaging import version

from raggedvl.data import split_rules
from raggedvl.data.scan import file_split, folder_splits, parquet_split
from raggedvl.data.split_rules import resolve_splits

ROOT = Path(__file__).resolve().parents[2]


def _datasets_splits(folder: Path) -> dict[str, list[str]] | None:
    base = str(folder.resolve())
    try:
        found = hf.DataFilesDict.from_patterns(
            hf.get_data_patterns(base), base_path=base
        )
    except (FileNotFoundError, ValueError):  # no data file; a bad split name
        return None
    return {str(name): list(files) for name, files in found.items()}


def _items(splits):
    """A resolution as an ordered list: the splits' order counts too (dict equality ignores it)."""
    return (
        splits if splits is None or isinstance(splits, type) else list(splits.items())
    )


def _outcome(resolve, folder):
    """``resolve(folder)``, or the type of what it raised."""
    try:
        return resolve(folder)
    except Exception as exc:  # noqa: BLE001 - compared, not hidden
        return type(exc)


def test_the_constants_are_datasets_own():
    ours = split_rules.SPLIT_KEYWORDS
    assert {str(k): tuple(v) for k, v in hf.SPLIT_KEYWORDS.items()} == ours
    # in the order file_split tries them
    assert list(map(str, hf.SPLIT_KEYWORDS)) == list(ours)
    assert hf.NON_WORDS_CHARS == split_rules.NON_WORDS_CHARS
    assert hf.SPLIT_PATTERN_SHARDED == split_rules.SPLIT_PATTERN_SHARDED
    assert hf.ALL_SPLIT_PATTERNS == [hf.SPLIT_PATTERN_SHARDED]
    assert (
        tuple(hf.KEYWORDS_IN_FILENAME_BASE_PATTERNS)
        == split_rules.KEYWORDS_IN_FILENAME_BASE_PATTERNS
    )
    assert tuple(hf.FILES_TO_IGNORE) == split_rules.FILES_TO_IGNORE
    assert [str(s) for s in hf.DEFAULT_SPLITS] == list(split_rules.DEFAULT_SPLITS)
    # the default layouts, in the order datasets tries them: the rules copy the last three;
    # a folder holding a file of the first two ("logs", "harbor") is undecided
    assert hf.ALL_DEFAULT_PATTERNS == [
        hf.DEFAULT_PATTERNS_LOGS,
        hf.DEFAULT_PATTERNS_HARBOR,
        hf.DEFAULT_PATTERNS_SPLIT_IN_DIR_NAME,
        hf.DEFAULT_PATTERNS_SPLIT_IN_FILENAME,
        hf.DEFAULT_PATTERNS_ALL,
    ]
    assert hf.DEFAULT_PATTERNS_LOGS == {"logs": ["**/*.eval"]}
    assert hf.DEFAULT_PATTERNS_HARBOR == {
        "test": ["**/" + name for name in split_rules.OTHER_LAYOUT_NAMES]
    }
    assert hf.DEFAULT_PATTERNS_ALL == {"train": ["**"]}
    assert version.parse(hf.config.FSSPEC_VERSION.base_version) >= version.parse(
        "2023.12.0"
    )
    assert (
        version.parse(datasets.__version__).major == split_rules.VERIFIED_DATASETS_MAJOR
    )
    assert split_rules._versions_verified()


KEYWORDS = [k for keywords in split_rules.SPLIT_KEYWORDS.values() for k in keywords]
WORDS = [
    "pairs",
    "data",
    "docs",
    "x",
    "shard",
    "validate",
    "trainer",
    "tests",
    "v2",
    "_",
    "__x",
    "eval2",
    "dev0",
]
SEPARATORS = ["-", ".", "_", " ", "", "0", "12"]
EXTENSIONS = [".parquet", ".parquet", ".json", ".csv", ""]


def _keyword(rng: random.Random) -> str:
    word = rng.choice(KEYWORDS)
    return rng.choice([word, word, word.upper(), word.capitalize()])


def _name(rng: random.Random) -> str:
    parts = [
        _keyword(rng) if rng.random() < 0.55 else rng.choice(WORDS)
        for _ in range(rng.choice([1, 1, 2, 3]))
    ]
    name = parts[0]
    for part in parts[1:]:
        name += rng.choice(SEPARATORS) + part
    if rng.random() < 0.4:
        name += rng.choice(SEPARATORS) + f"{rng.randrange(100):05d}"
    if rng.random() < 0.1:
        name = rng.choice([".", "_", "__"]) + name
    return name + rng.choice(EXTENSIONS)


def _shard(rng: random.Random) -> str:
    split = rng.choice(
        ["train", "validation", "test", "dev", "other_1", "Train", "a.b", "x-y", ""]
    )
    total = rng.randrange(1, 4)
    tail = rng.choice(
        [".parquet", ".parquet", ".json", ".parquet.gz", "-extra.parquet", ""]
    )
    return f"{split}-{rng.randrange(total):05d}-of-{total:05d}{tail}"


def _build(folder: Path, rng: random.Random) -> None:
    folder.mkdir()
    names = {_name(rng) for _ in range(rng.randrange(0, 6))}
    names |= set(
        rng.sample(
            [
                "README.md",
                "workload.json",
                "config.json",
                "dataset_info.json",
                "dummy_data.zip",
                "dataset_dict.json",
                "x.eval",
                "task.toml",
                "notes.txt",
            ],
            rng.randrange(0, 3),
        )
    )
    for name in names:
        if name.strip():
            (folder / name).write_bytes(b"")
    data = folder / "data"
    if rng.random() < 0.4 and not data.exists():  # (a file may be named "data")
        data.mkdir()
        makers = [_shard, _shard, _name] if rng.random() < 0.7 else [_name]
        for _ in range(rng.randrange(0, 5)):
            name = rng.choice(makers)(rng)
            if name.strip():
                (data / name).write_bytes(b"")
    extra = rng.random()
    if extra < 0.15:  # the scan cache's hidden folder, with a keyword in a name inside
        (folder / ".raggedvl").mkdir()
        (folder / ".raggedvl" / "sizes-train.npz").write_bytes(b"")
    elif extra < 0.2:
        (folder / "__pycache__").mkdir()
        (folder / "__pycache__" / "train.pyc").write_bytes(b"")
    elif extra < 0.25:
        sub = folder / rng.choice(["train", "other", "test_dir"])
        sub.mkdir(exist_ok=True)
        (sub / _name(rng)).write_bytes(b"")
    elif extra < 0.3:
        target = folder / "pairs.parquet"
        target.write_bytes(b"")
        (folder / f"{_keyword(rng)}-link.parquet").symlink_to(target)


def test_whenever_the_rules_decide_they_give_datasets_splits_and_order(tmp_path):
    rng = random.Random(20261202)
    decided = undecided = 0
    for i in range(400):
        folder = tmp_path / f"f{i}"
        _build(folder, rng)
        ours = resolve_splits(folder)
        if ours is None:
            undecided += 1
            continue
        decided += 1
        listing = sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
        assert _items(ours) == _items(_datasets_splits(folder)), listing
        assert _items(folder_splits(folder)) == _items(ours)
    assert decided >= 150 and undecided >= 40, (
        decided,
        undecided,
    )  # both sides exercised


@pytest.mark.parametrize(
    "layout",
    [
        ["train.parquet", "dev.parquet"],
        ["train.parquet", "dev.parquet", "workload.json"],
        ["train.parquet", "dev.parquet", "README.md"],
        [
            "train-00001.parquet",
            "train-00000.parquet",
            "train-00010.parquet",
            "test-00000.parquet",
            "notes.txt",
        ],
        ["pairs.parquet"],
        ["pairs.parquet", "workload.json"],
        [
            "TRAIN.parquet",
            "test.parquet",
        ],  # datasets' keywords are case-sensitive: TRAIN.parquet is in no split
        [
            "my-validation-pairs.parquet",
            "train_0.parquet",
            "train_1.parquet",
            "training.parquet",
            "eval.parquet",
            "__train.parquet",
        ],
        [
            "data/train-00001-of-00002.parquet",
            "data/train-00000-of-00002.parquet",
            "data/dev-00000-of-00001.parquet",
            "data/extra-00000-of-00001.parquet",
            "data/a_b-00000-of-00001.parquet",
            "train.parquet",
        ],
        ["data/train.parquet", "data/test.parquet", "dev.parquet"],
        [
            "train.parquet",
            ".raggedvl/sizes-0.npz",
            "__pycache__/test.pyc",
            ".hidden-test.parquet",
        ],
        ["data/test-00000-of-00001.parquet", "data/.raggedvl/sizes-train.npz"],
    ],
)
def test_the_plain_layouts_are_decided_as_datasets_decides(tmp_path, layout):
    for name in layout:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    ours = resolve_splits(tmp_path)
    assert ours is not None
    assert _items(ours) == _items(_datasets_splits(tmp_path))


def test_the_decided_order_is_the_pattern_order_then_names(tmp_path):
    for name in [
        "b-train.parquet",
        "train-1.parquet",
        "a-train.parquet",
        "train-0.parquet",
        "dev.parquet",
    ]:
        (tmp_path / name).write_bytes(b"")
    base = str(tmp_path.resolve())
    assert resolve_splits(tmp_path) == {
        "train": [
            f"{base}/{n}"
            for n in [
                "train-0.parquet",
                "train-1.parquet",
                "a-train.parquet",
                "b-train.parquet",
            ]
        ],
        "validation": [f"{base}/dev.parquet"],
    }


@pytest.mark.parametrize(
    "layout",
    [
        ["train-test.parquet", "dev.parquet"],  # two splits
        ["train_train.parquet"],  # two patterns of one split: datasets lists it twice
        ["train.parquet", "other/test.parquet"],  # another folder
        ["data/train-00000-of-00001.parquet", "data/more/x.parquet"],
        ["data/-00000-of-00001.parquet"],  # datasets fails on it
        ["data/x-y-00000-of-00001.parquet"],
        ["train.parquet", "run.eval"],  # datasets' "logs" layout
        ["train.parquet", "task.toml"],  # its "harbor" layout
        [],
        [".only-hidden.parquet"],
    ],
)
def test_other_layouts_are_left_to_datasets(tmp_path, layout):
    tmp_path.joinpath("x").mkdir()
    for name in layout:
        (tmp_path / "x" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "x" / name).write_bytes(b"")
    assert resolve_splits(tmp_path / "x") is None
    assert _items(_outcome(folder_splits, tmp_path / "x")) == _items(
        _outcome(_datasets_splits, tmp_path / "x")
    )


def test_a_link_to_a_folder_and_glob_characters_are_left_to_datasets(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "train.parquet").write_bytes(b"")
    (tmp_path / "a" / "test").symlink_to(tmp_path)
    assert resolve_splits(tmp_path / "a") is None
    (tmp_path / "b[1]").mkdir()
    (tmp_path / "b[1]" / "train.parquet").write_bytes(b"")
    assert resolve_splits(tmp_path / "b[1]") is None


def test_an_unverified_datasets_leaves_every_folder_to_datasets(tmp_path, monkeypatch):
    (tmp_path / "train.parquet").write_bytes(b"")
    monkeypatch.setattr(split_rules, "_versions_verified", lambda: False)
    assert resolve_splits(tmp_path) is None


@pytest.mark.parametrize(
    "name,split",
    [
        ("dev.parquet", "validation"),
        ("my-validation-pairs.parquet", "validation"),
        ("test_00.parquet", "test"),
        ("pairs.parquet", "train"),
        ("TRAIN.parquet", "train"),
        ("Eval-set.parquet", "test"),
    ],
)
def test_a_single_file_is_named_by_the_keywords(name, split):
    assert file_split(name) == split


def test_a_flat_folder_split_imports_no_datasets(tmp_path):
    for name, rows in [
        ("train-00000.parquet", 3),
        ("train-00001.parquet", 2),
        ("dev.parquet", 1),
    ]:
        pq.write_table(
            pa.table({"query": ["q"] * rows, "image": ["a.png"] * rows}),
            str(tmp_path / name),
        )
    code = (
        "import sys\n"
        "from raggedvl.data.scan import file_split, parquet_split\n"
        f"train = parquet_split({str(tmp_path)!r}, 'train')\n"
        f"dev = parquet_split({str(tmp_path)!r}, 'dev')\n"
        "assert [f.name for f in train.files] == ['train-00000.parquet', 'train-00001.parquet'], train.files\n"
        "assert train.file_rows == (3, 2) and dev.num_rows == 1\n"
        "assert file_split('my-dev.parquet') == 'validation'\n"
        "assert 'datasets' not in sys.modules, 'datasets was imported'\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    # and the same files as datasets' own resolution
    files = parquet_split(tmp_path, "train").files
    assert [str(f) for f in files] == _datasets_splits(tmp_path)["train"]
