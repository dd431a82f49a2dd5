"""``benchmarks/issue18_ablation.py``'s pieces that run without colpali-engine: the re-initialised
head copy (only ``custom_text_proj`` changes, and raggedvl loads it as the head) and the
step-limited driver's command line (raggedvl's own parser, torchrun's flag left out)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import issue18_ablation  # noqa: E402

CHECKPOINT = REPO / "tests" / "fixtures" / "colqwen2-tiny" / "colqwen2_full"


def test_reinitialised_head_copy_changes_only_the_head(tmp_path):
    copy = Path(issue18_ablation.reinitialised_head_copy(str(CHECKPOINT), tmp_path))
    old, new = load_file(str(CHECKPOINT / "model.safetensors")), load_file(str(copy / "model.safetensors"))
    assert old.keys() == new.keys()
    changed = sorted(k for k in old if not torch.equal(old[k], new[k]))
    assert changed == ["custom_text_proj.bias", "custom_text_proj.weight"]
    torch.manual_seed(0)
    assert torch.equal(new["custom_text_proj.weight"], torch.nn.Linear(*reversed(old["custom_text_proj.weight"].shape)).weight)

    from raggedvl.data import build_processor
    from raggedvl.models import build_retriever

    model = build_retriever(str(copy), processor=build_processor(str(copy)), seed=1)
    assert torch.equal(model.head.proj.weight.detach(), new["custom_text_proj.weight"])  # loaded, not re-drawn


def test_every_row_is_one_change_from_main():
    from colpali_bench.raggedvl_side import validate_argv

    for row, (label, driver_opts, flags) in issue18_ablation.ROWS.items():
        assert label and isinstance(driver_opts, list)
        cfg = validate_argv(["train", "--model", str(CHECKPOINT), *flags])
        if row in ("prompts", "era"):
            assert (cfg.query_prefix, cfg.padding_side) == ("Query: ", "right")
        if row == "linear":
            assert cfg.lr_schedule == "linear"
