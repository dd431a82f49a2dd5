"""Continue training from colpali-engine checkpoints with `raggedvl train`, then export.

- the step-0 evaluation equals the evaluation of the source checkpoint (same weights, same
  prompts, same pixels);
- the run's checkpoints are loadable retrievers (settings + processor beside the weights); a LoRA
  run's checkpoint holds the adapters and the head, not the frozen base; the training config is
  ``train_config.json``, not ``config.json``; files are group-readable under a 022 umask;
- ``raggedvl export`` writes colpali, transformers and sentence-transformers folders that load
  back with the same embeddings, and nothing on those paths unpickles (``torch.load`` is never
  reached);
- a sentence-transformers MultiVectorEncoder folder is a starting point too (fresh LoRA or full).
"""

import json
import os
import shutil

import pytest
import torch

from raggedvl.app.cli import main
from raggedvl.models import build_retriever
from raggedvl.app.checkpoint import as_retriever_folder, checkpoint_weights
from raggedvl.app.config import TrainConfig
from raggedvl.app.loop import train
from raggedvl.app.setup import build_components
from tests.conftest import SMALL_DEV_PAIRS, SMALL_TRAIN_PAIRS
from tests.models.interop.helpers import FULL, LORA, encode, masked_max_abs

pytestmark = pytest.mark.slow  # two short runs of the tiny colpali model on the rdocs subset


def _config(model, tmp_path, cache, run="run", **extra):
    settings = dict(max_steps=2, global_batch_size=4, checkpoint_every=100, eval_train_samples=4,
                    max_train_samples=SMALL_TRAIN_PAIRS, max_eval_samples=SMALL_DEV_PAIRS)
    return TrainConfig(model=str(model), output_dir=str(tmp_path / run), data_cache=str(cache), **{**settings, **extra})


def _losses(run):
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r.get("event") == "train"}


def _no_unpickling(monkeypatch):
    """torch.load only as DCP reads tensor chunks: weights_only (tensors and plain containers)."""
    real = torch.load

    def weights_only(*args, **kwargs):
        assert kwargs.get("weights_only") is True, "torch.load reached without weights_only=True"
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", weights_only)


def _step0_equals_source(cfg, run):
    from raggedvl.parallel.runtime import DistInfo

    from raggedvl.evaluation.evaluator import evaluate_benchmark

    c = build_components(cfg, DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="none"))
    source = evaluate_benchmark(build_retriever(cfg.model).eval(), c.collate, c.eval_set, batch_size=16,
                                device=torch.device("cpu"))  # the source checkpoint, evaluated on its own
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = next(r["raw"]["dev"] for r in records if r.get("event") == "eval_before")
    assert {k: logged[k] for k in source} == pytest.approx(source, abs=1e-9)


def test_continue_from_colpali_adapter_then_export(tmp_path, small_data_cache, monkeypatch):
    old_umask = os.umask(0o022)
    try:
        cfg = _config(LORA, tmp_path, small_data_cache)
        train(cfg)
    finally:
        os.umask(old_umask)
    run = tmp_path / "run"
    _step0_equals_source(cfg, run)
    assert (run / "train_config.json").is_file() and not (run / "config.json").exists()
    step = sorted((run / "checkpoints").iterdir())[-1]
    weights = checkpoint_weights(step)
    assert weights and all("lora_" in k or k.startswith("head.") for k in weights)  # no frozen base
    assert {"raggedvl_retriever.json", "tokenizer.json", "processor_config.json"} <= {p.name for p in step.iterdir()}
    assert all(p.stat().st_mode & 0o044 == 0o044 for p in step.rglob("*"))  # group and others may read
    _no_unpickling(monkeypatch)
    with as_retriever_folder(str(step)) as folder:  # the shards consolidated in this process
        trained = build_retriever(folder)
    assert trained.config.lora.r == 8 and trained.config.base == str(FULL.resolve())
    batch, q, d = encode(trained, step)
    for fmt in ("colpali", "transformers", "sentence-transformers"):
        assert main(["export", str(run), "--format", fmt, "--output", str(tmp_path / fmt)]) == 0
        card = (tmp_path / fmt / "README.md").read_text()
        assert "raggedvl" in card and "| lora_r |" in card and "dev: after training" in card
        assert "Given the same `pixel_values`, the embeddings equal raggedvl's" in card  # the condition users need
        back = build_retriever(str(tmp_path / fmt))
        _, q2, d2 = encode(back, tmp_path / fmt)
        assert masked_max_abs(d2.embeddings, d.embeddings, d.mask) <= 1e-5
        assert masked_max_abs(q2.embeddings, q.embeddings, q.mask) <= 1e-5
    assert (tmp_path / "colpali" / "adapter_config.json").is_file()  # kept as an adapter on its base


def test_continue_from_colpali_full_with_fresh_lora_then_export_merged(tmp_path, small_data_cache, monkeypatch):
    cfg = _config(FULL, tmp_path, small_data_cache, lora_r=4, lora_alpha=4)
    train(cfg)
    run = tmp_path / "run"
    _step0_equals_source(cfg, run)
    _no_unpickling(monkeypatch)
    assert main(["export", str(run), "--format", "colpali", "--output", str(tmp_path / "merged"), "--merge-lora"]) == 0
    assert {"config.json", "model.safetensors"} <= {p.name for p in (tmp_path / "merged").iterdir()}
    step = sorted((run / "checkpoints").iterdir())[-1]
    with as_retriever_folder(str(step)) as folder:
        _, q, d = encode(build_retriever(folder), step)
    _, q2, d2 = encode(build_retriever(str(tmp_path / "merged")), tmp_path / "merged")
    assert masked_max_abs(d2.embeddings, d.embeddings, d.mask) <= 1e-5


@pytest.mark.parametrize("lora", [{"lora_r": 4, "lora_alpha": 4}, {"lora": False}], ids=["fresh-lora", "full"])
def test_continue_from_a_sentence_transformers_folder(tmp_path, small_data_cache, lora):
    assert main(["export", str(FULL), "--format", "sentence-transformers", "--output", str(tmp_path / "st")]) == 0
    card = (tmp_path / "st" / "README.md").read_text()
    assert "library_name: sentence-transformers" in card and 'MultiVectorEncoder("PATH")' in card
    cfg = _config(tmp_path / "st", tmp_path, small_data_cache, **lora)
    train(cfg)
    run = tmp_path / "run"
    _step0_equals_source(cfg, run)  # the folder's weights and prompts, as raggedvl evaluates the source
    with as_retriever_folder(str(sorted((run / "checkpoints").iterdir())[-1])) as folder:  # sharded: consolidated
        trained = build_retriever(folder)
    assert (trained.config.lora is not None) == ("lora_r" in lora)
    assert trained.config.prompts == build_retriever(str(FULL)).config.prompts


def resume_copy(run, copy, step):
    """``copy``: ``run`` as it was right after checkpoint ``step`` (newer checkpoints removed), to resume."""
    shutil.copytree(run, copy)
    for ckpt in (copy / "checkpoints").iterdir():
        if int(ckpt.name.split("-")[1]) > step:
            shutil.rmtree(ckpt)


def test_a_run_from_the_colpali_adapter_resumes_from_its_adapter_only_checkpoint_exactly(tmp_path, small_data_cache):
    settings = dict(max_steps=4, checkpoint_every=2, eval_before=False, eval_after=False)
    train(_config(LORA, tmp_path, small_data_cache, run="straight", **settings))
    resume_copy(tmp_path / "straight", tmp_path / "resumed", step=2)
    step2 = tmp_path / "resumed" / "checkpoints" / "step-000002"
    assert all("lora_" in k or k.startswith("head.") for k in checkpoint_weights(step2))  # no frozen base
    train(_config(LORA, tmp_path, small_data_cache, run="resumed", resume=True, **settings))
    straight, resumed = _losses(tmp_path / "straight"), _losses(tmp_path / "resumed")
    assert sorted(straight) == sorted(resumed) == [1, 2, 3, 4]
    assert resumed == pytest.approx(straight, rel=1e-6, abs=1e-7)  # steps 3-4 from the adapters + head of step 2


def test_export_refuses_a_dim_colpali_cannot_hold(tmp_path, capsys):
    from tests.models.helpers import tiny_tokenizer

    from raggedvl.models import TinySizes

    sizes = TinySizes(hidden_size=64, num_layers=1, intermediate_size=64, vision_depth=1, vision_embed_dim=32, vision_heads=2)
    build_retriever("tiny", processor=tiny_tokenizer(), tiny_sizes=sizes, dim=96).save_pretrained(tmp_path / "wide")
    assert main(["export", str(tmp_path / "wide"), "--format", "colpali", "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "96 dimensions" in err and "--format transformers" in err and not (tmp_path / "out").exists()
