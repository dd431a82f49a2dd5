"""colpali-engine checkpoints load with colpali's token ids, embeddings and scores.

Ground truth: tests/fixtures/colqwen2-tiny, written and computed by colpali-engine 0.3.18
(``ColQwen2.save_pretrained``, ``process_queries``, ``process_images``, ``score_multi_vector``);
raggedvl encodes the same inputs through its own collator and retriever and must agree on every
real token (fp32, CPU: 1e-5). Broken or mismatched checkpoints are refused naming the file and
the tensor.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from raggedvl.losses import late_interaction_scores
from raggedvl.models import build_retriever
from raggedvl.models.interop import check_checkpoint
from raggedvl.prompts import COLPALI_PROMPTS
from tests.models.interop.helpers import FULL, LORA, encode, masked_max_abs, reference

TOL = 1e-5


@pytest.mark.parametrize("name, folder", [("full", FULL), ("lora", LORA)])
def test_fixture_gives_colpalis_token_ids_embeddings_and_scores(name, folder):
    ref = reference()
    model = build_retriever(str(folder))
    batch, q, d = encode(model, folder)
    assert model.config.prompts == COLPALI_PROMPTS
    assert torch.equal(batch["queries"]["input_ids"], ref["query_input_ids"])
    assert torch.equal(batch["docs"]["input_ids"], ref["doc_input_ids"])
    assert torch.equal(batch["docs"]["image_grid_thw"], ref["doc_image_grid_thw"])
    assert torch.equal(q.mask.long(), ref[f"{name}.query_mask"]) and torch.equal(d.mask.long(), ref[f"{name}.doc_mask"])
    q_err = masked_max_abs(q.embeddings, ref[f"{name}.query_embeddings"], q.mask)
    d_err = masked_max_abs(d.embeddings, ref[f"{name}.doc_embeddings"], d.mask)
    scores = late_interaction_scores(q.embeddings, q.mask, d.embeddings, d.mask)
    s_err = float((scores - ref[f"{name}.scores"]).abs().max())
    print(f"{name}: max |query - colpali| {q_err:.2e}, |doc - colpali| {d_err:.2e}, |scores - colpali| {s_err:.2e}")
    assert q_err <= TOL and d_err <= TOL and s_err <= 10 * TOL


def test_adapter_stays_trainable_or_merges_into_the_same_function():
    kept = build_retriever(str(LORA))
    merged = build_retriever(str(LORA), merge_lora=True)
    trainable = {n for n, p in kept.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or n.startswith("head.") for n in trainable)
    assert kept.config.lora.r == 8 and kept.config.lora.alpha == 8
    assert merged.config.lora is None and all(p.requires_grad for p in merged.parameters())
    _, q_kept, d_kept = encode(kept, LORA)
    _, q_merged, d_merged = encode(merged, LORA)
    assert masked_max_abs(q_kept.embeddings, q_merged.embeddings, q_kept.mask) <= TOL
    assert masked_max_abs(d_kept.embeddings, d_merged.embeddings, d_kept.mask) <= TOL


def test_full_checkpoint_takes_fresh_lora_on_request():
    from raggedvl.models import LoraSettings

    model = build_retriever(str(FULL), lora=LoraSettings(r=4, alpha=4, dropout=0.0))
    full = build_retriever(str(FULL))
    _, q, _ = encode(model, FULL)
    _, q_full, _ = encode(full, FULL)
    assert model.config.lora.r == 4
    assert masked_max_abs(q.embeddings, q_full.embeddings, q.mask) == 0.0  # LoRA B starts at zero


def _copy(src, dst):
    shutil.copytree(src, dst)
    for p in dst.iterdir():
        p.chmod(0o644)
    return dst


def _edit_weights(folder, edit, name="model.safetensors"):
    tensors = load_file(str(folder / name))
    edit(tensors)
    save_file(tensors, str(folder / name), metadata={"format": "pt"})


def test_missing_or_wrong_dimension_projection_is_named(tmp_path):
    missing = _copy(FULL, tmp_path / "missing")
    _edit_weights(missing, lambda t: [t.pop(k) for k in ("custom_text_proj.weight", "custom_text_proj.bias")])
    for load in (build_retriever, check_checkpoint):  # check_checkpoint: headers only, before torchrun
        with pytest.raises(ValueError, match=r"missing/model\.safetensors has no custom_text_proj\.weight"):
            load(str(missing))
    wrong = _copy(FULL, tmp_path / "wrong")
    _edit_weights(wrong, lambda t: t.update({"custom_text_proj.weight": torch.zeros(64, 64),
                                             "custom_text_proj.bias": torch.zeros(64)}))
    for load in (build_retriever, check_checkpoint):
        with pytest.raises(ValueError, match=r"wrong/model\.safetensors: tensor 'custom_text_proj\.weight' has shape \[64, 64\].*128"):
            load(str(wrong))


def test_misshapen_or_missing_backbone_tensor_is_named(tmp_path):
    bad = _copy(FULL, tmp_path / "bad")
    key = "language_model.layers.0.mlp.down_proj.weight"
    _edit_weights(bad, lambda t: t.update({key: torch.zeros(64, 128)}))
    with pytest.raises(ValueError, match=rf"bad/model\.safetensors: tensor '{key}' has shape \[64, 128\]"):
        build_retriever(str(bad))
    gone = _copy(FULL, tmp_path / "gone")
    _edit_weights(gone, lambda t: t.pop("language_model.norm.weight"))
    with pytest.raises(ValueError, match=r"gone/model\.safetensors left 1 weights.*language_model\.norm\.weight"):
        build_retriever(str(gone))


def _other_base(path):
    """A ColQwen2-layout checkpoint with hidden size 128 (the adapter was trained on hidden 64)."""
    from transformers import Qwen2VLModel

    from raggedvl.models import TinySizes, tiny_backbone_config
    from tests.models.helpers import tiny_tokenizer

    config = tiny_backbone_config(tiny_tokenizer(), "qwen2_vl", TinySizes(hidden_size=128, num_layers=2))
    config.architectures = ["ColQwen2"]
    Qwen2VLModel._from_config(config).save_pretrained(path)
    _edit_weights(path, lambda t: t.update({"custom_text_proj.weight": torch.zeros(128, 128),
                                            "custom_text_proj.bias": torch.zeros(128)}))
    return path


def test_adapter_whose_base_does_not_match_is_named(tmp_path):
    base = _other_base(tmp_path / "other_base")
    adapter = _copy(LORA, tmp_path / "adapter")
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": str(base)}))
    for load in (build_retriever, check_checkpoint):
        with pytest.raises(ValueError, match=r"adapter/adapter_model\.safetensors: tensor 'base_model\.model\.language_model\..*lora_[AB]\.weight' has shape .*the adapter was trained on another base"):
            load(str(adapter))
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": "../no_such_base"}))
    for load in (build_retriever, check_checkpoint):
        with pytest.raises(ValueError, match=r"adapter_config\.json: base_model_name_or_path '\.\./no_such_base' is not a folder"):
            load(str(adapter))


def test_adapter_features_raggedvl_cannot_reproduce_are_refused(tmp_path):
    adapter = _copy(LORA, tmp_path / "dora")
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": str(FULL), "use_dora": True}))
    with pytest.raises(ValueError, match=r"\['use_dora'\] set"):
        build_retriever(str(adapter))


def test_biqwen2_and_pickle_only_checkpoints_are_refused(tmp_path):
    bi = _copy(FULL, tmp_path / "bi")
    cfg = json.loads((bi / "config.json").read_text())
    (bi / "config.json").write_text(json.dumps({**cfg, "architectures": ["BiQwen2"]}))
    with pytest.raises(ValueError, match="BiQwen2 .* not supported"):
        build_retriever(str(bi))
    pickled = _copy(FULL, tmp_path / "pickled")
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    with pytest.raises(ValueError, match="never unpickles"):
        build_retriever(str(pickled))


def _wrong_projection(tmp_path):
    wrong = _copy(FULL, tmp_path / "wrong")
    _edit_weights(wrong, lambda t: t.update({"custom_text_proj.weight": torch.zeros(96, 64),
                                             "custom_text_proj.bias": torch.zeros(96)}))
    return wrong


def test_raggedvl_train_refuses_a_broken_checkpoint_in_one_line_before_training(tmp_path, capsys):
    """One process: the launcher (which trains in-process) checks the checkpoint's files first."""
    from raggedvl.app.cli import main

    wrong = _wrong_projection(tmp_path)
    assert main(["train", "--model", str(wrong), "--nproc-per-node", "1", "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr()
    assert "raggedvl: error:" in err.err and "custom_text_proj.weight' has shape [96, 64]" in err.err
    assert "training" not in err.out and not (tmp_path / "run" / "metrics.jsonl").exists()  # before any step


@pytest.mark.dist
def test_two_processes_report_a_broken_checkpoint_once_in_one_line(tmp_path):
    """Several processes: the launcher starts the ranks without importing torch (a local
    checkpoint is not checked twice), and the ranks' loading refuses it with the same error,
    reported once by the agent, exit code 2, no traceback."""
    import os
    import sys

    from tests.jobs import run_job

    wrong = _wrong_projection(tmp_path)
    cmd = [sys.executable, "-m", "raggedvl.app.cli", "train", "--model", str(wrong), "--nproc-per-node", "2",
           "--global-batch-size", "4", "--max-steps", "1", "--max-train-samples", "8", "--eval-before", "false",
           "--eval-after", "false", "--output-dir", str(tmp_path / "run")]
    out = run_job(cmd, ready=None, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 2, out.describe()
    lines = [line for line in out.stderr.splitlines() if line.startswith("raggedvl:")]
    assert len(lines) == 1 and "custom_text_proj.weight' has shape [96, 64]" in lines[0], out.describe()
    assert "Traceback" not in out.stderr
    assert "raggedvl.app.agent" in out.stdout  # the launcher execed the agent (it prints the command)


def test_loading_an_adapter_prints_no_future_warning():
    """peft's PeftModel reads transformers' deprecated ``is_gradient_checkpointing``: raggedvl
    hides that one FutureWarning around get_peft_model and nothing else."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = build_retriever(str(LORA))
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []
    backbone = model.backbone.get_base_model()
    with pytest.warns(FutureWarning, match="is_gradient_checkpointing"):  # still raised outside that call
        assert backbone.is_gradient_checkpointing is False
