"""Options that match another trainer's recipe exactly: the learning-rate
schedule (``--lr-schedule``), the query prefix (``--query-prefix``) and the padding side
(``--padding-side``), which replace the model's own prompts and are saved with it."""

from pathlib import Path

import pytest
import torch
from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

from raggedvl.prompts import COLPALI_PROMPTS, LEGACY_PROMPTS, QUERY_AUGMENTATION
from raggedvl.app.config import TrainConfig
from raggedvl.app.lr_schedule import make_scheduler
from raggedvl.app.setup import build_cfg_processor, build_model

CHECKPOINT = Path(__file__).resolve().parents[1] / "fixtures" / "colqwen2-tiny" / "colqwen2_full"


def _lrs(make, steps=12, warmup=3, lr=5e-4):
    """The learning rate each optimizer step runs at."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched, out = make(opt), []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("name, reference", [("linear", get_linear_schedule_with_warmup),
                                             ("cosine", get_cosine_schedule_with_warmup)])
def test_lr_schedule_is_transformers_schedule(name, reference):
    cfg = TrainConfig(lr_schedule=name, warmup_steps=3, lr=5e-4)
    got = _lrs(lambda opt: make_scheduler(opt, cfg, 12))
    assert got == _lrs(lambda opt: reference(opt, 3, 12))
    assert got[0] == 0.0 and got[3] == pytest.approx(5e-4)  # the HF Trainer's warmup: first step at lr 0
    linear, cosine = (_lrs(lambda opt, n=n: make_scheduler(opt, TrainConfig(lr_schedule=n, warmup_steps=3), 12))
                      for n in ("linear", "cosine"))
    assert linear[6] < cosine[6]  # the two decays differ after the warmup


def test_prompt_overrides_replace_the_prefix_and_padding_side():
    assert COLPALI_PROMPTS.query_prefix == "" and LEGACY_PROMPTS.query_prefix == "Query: "
    assert COLPALI_PROMPTS.with_overrides("Query: ", "right") == LEGACY_PROMPTS
    assert LEGACY_PROMPTS.with_overrides("").query_template == "{query}" + QUERY_AUGMENTATION
    assert COLPALI_PROMPTS.with_overrides() == COLPALI_PROMPTS
    with pytest.raises(ValueError, match="query_template"):
        COLPALI_PROMPTS.with_overrides("{query} twice: ")
    with pytest.raises(ValueError, match="padding_side"):
        COLPALI_PROMPTS.with_overrides(padding_side="middle")


def test_the_flags_reach_the_model_and_its_collator(tmp_path):
    cfg = TrainConfig(model=str(CHECKPOINT), lora=False, query_prefix="Query: ", padding_side="right",
                      output_dir=str(tmp_path / "run"))
    model = build_model(cfg, build_cfg_processor(cfg))
    assert model.config.prompts == LEGACY_PROMPTS  # colpali's prompts with the two overrides
    default = build_model(TrainConfig(model=str(CHECKPOINT), lora=False), build_cfg_processor(cfg))
    assert default.config.prompts == COLPALI_PROMPTS  # none: the checkpoint's own prompts
    model.save_pretrained(tmp_path / "saved")
    again = build_model(TrainConfig(model=str(tmp_path / "saved"), lora=False), build_cfg_processor(cfg))
    assert again.config.prompts == LEGACY_PROMPTS  # saved with the model
