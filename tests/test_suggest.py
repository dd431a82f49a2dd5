"""raggedvl.suggest.closest: the "did you mean" of every message names what a typo most likely
meant, and nothing when no known name is close."""

import pytest

from raggedvl.suggest import closest

FLAGS = ["--lr", "--lora", "--lora-r", "--loss", "--head", "--help", "--temperature", "--log-every", "--eval-after",
         "--eval-batch-size", "--global-batch-size", "--model", "--dataset", "--dataset-weights", "--warmup-steps",
         "--output-dir", "--epochs", "--grad-cache", "--min-pixels", "--max-steps"]


@pytest.mark.parametrize("typo, meant", [
    ("--Loss", "--loss"),  # rule 1: case, dashes and underscores aside
    ("--los", "--loss"), ("--haed", "--head"), ("--max-step", "--max-steps"),  # 2: one edit
    ("--global-batch-sise", "--global-batch-size"), ("--outptu-dir", "--output-dir"),  # 3: similar
    ("--temp", "--temperature"), ("--warmup", "--warmup-steps"),  # 4: the only name it starts
    ("--lr-rate", "--lr"), ("--model-name", "--model"), ("--dataset-name", "--dataset"),  # 5: a name's words start it
])
def test_typos_find_what_they_meant(typo, meant):
    assert closest(typo, FLAGS) == meant


@pytest.mark.parametrize("typo", ["--wandb", "--eval-every", "--gpus", "--grad-accum", "--mix", "--learning-rate"])
def test_nothing_unrelated_is_suggested(typo):
    assert closest(typo, FLAGS) is None


def test_values_files_and_columns():
    assert closest("FSDP", ["ddp", "fsdp2", "hsdp"]) == "fsdp2" and closest("zero3", ["ddp", "fsdp2", "hsdp"]) is None
    assert closest("bi", ["late_interaction", "bi_encoder"]) == "bi_encoder"  # the first word of one choice
    # two file names with one extension compare by their stems: ".parquet" alone makes nothing close
    files = ["good.parquet", "corrupt.parquet", "renamed.parquet"]
    assert closest("missing.parquet", files) is None and closest("god.parquet", files) == "good.parquet"
    assert closest("tset.parquet", ["test.parquet", "train.parquet"]) == "test.parquet"
    assert closest("b.parquet", ["a.parquet"]) is None  # one-character stems: one edit is everything
    assert closest("negatives", ["query", "image", "negs"]) == "negs"  # 6: an abbreviation
    assert closest("docid", ["question", "page", "doc_id"]) == "doc_id"
    assert closest("query", ["question", "page", "doc_id"]) is None


def test_typos_only_keeps_the_first_three_rules():
    """Where a close name refuses a name outright (a bare --model beside a folder), prefixes and
    abbreviations do not count: ``tinyllama`` is no typo of the preset ``tiny``."""
    assert closest("tinyllama", ["tiny"]) == "tiny"  # a message's hint: the preset's name starts it
    assert closest("tinyllama", ["tiny"], typos_only=True) is None
    assert closest("tyny", ["tiny"], typos_only=True) == "tiny" and closest("rnus", ["runs"], typos_only=True) == "runs"
