"""``raggedvl export --merge-lora`` of a model without LoRA adapters: one line, exit code 2,
naming the model, before anything is verified or loaded when its settings files say so
(``stated_lora``), else once it is loaded; nothing is written either way."""

import json

import pytest

from raggedvl.app import export as export_module
from raggedvl.app.cli import main
from raggedvl.app.config import TRAIN_CONFIG_NAME, TrainConfig
from raggedvl.data import build_processor
from raggedvl.models import build_retriever
from tests.models.interop.helpers import FULL, LORA


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A saved tiny retriever: full weights, no LoRA."""
    folder = tmp_path_factory.mktemp("export") / "model"
    build_retriever("tiny", processor=build_processor("tiny"), seed=0).save_pretrained(folder)
    return folder


def test_what_the_settings_files_say_about_lora(saved, tmp_path):
    assert export_module.stated_lora(str(saved)) is False  # raggedvl_retriever.json: lora null
    assert export_module.stated_lora(str(FULL)) is False and export_module.stated_lora(str(LORA)) is True  # colpali's
    for lora, model, expected in ((None, "tiny", False), (None, "org/model", True), (True, "tiny", True)):
        run = tmp_path / f"run-{lora}-{model.replace('/', '-')}"
        run.mkdir()
        TrainConfig(model=model, lora=lora).save(run / TRAIN_CONFIG_NAME)
        assert export_module.stated_lora(str(run)) is expected, (lora, model)  # TrainConfig.use_lora
    (tmp_path / "old-run").mkdir()
    (tmp_path / "old-run" / TRAIN_CONFIG_NAME).write_text(json.dumps({"a_key_of_another_version": 1}))
    assert export_module.stated_lora(str(tmp_path / "old-run")) is None  # unreadable here: known once loaded
    assert export_module.stated_lora("org/model") is None and export_module.stated_lora("tiny") is None


def test_merge_lora_of_a_full_model_is_one_line_before_any_work(saved, tmp_path, capsys, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("verified or loaded a model whose settings already said it has no LoRA")

    with monkeypatch.context() as patched:
        patched.setattr(export_module, "resolve_source", no_work)
        code = main(["export", str(saved), "--format", "colpali", "--output", str(tmp_path / "out"), "--merge-lora"])
    err = capsys.readouterr().err
    assert code == 2 and err == (f"raggedvl: error: --merge-lora: {saved} has no LoRA adapters (its weights are full): "
                                 "there is nothing to merge; export it without --merge-lora\n")
    assert not (tmp_path / "out").exists()
    # settings this version cannot read: the same line once the model is loaded, still before writing
    (saved / TRAIN_CONFIG_NAME).write_text(json.dumps({"a_key_of_another_version": 1}))
    try:
        code = main(["export", str(saved), "--format", "transformers", "--output", str(tmp_path / "out"), "--merge-lora"])
    finally:
        (saved / TRAIN_CONFIG_NAME).unlink()
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and f"--merge-lora: {saved} has no LoRA adapters" in err, err
    assert not (tmp_path / "out").exists()
