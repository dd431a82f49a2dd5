"""The raggedvl side of the benchmark: the ``raggedvl train`` command line, what its run directory
says about the run, its token padding (replayed from its own sampler plan) and its evaluation.

raggedvl is run exactly as a user runs it (``python -m raggedvl.app.cli train FLAGS``, which starts
torchrun itself). Its ``metrics.jsonl`` gives per step the global loss, the samples of each rank
and the cumulative samples/s since the loop started, from which the time at the end of each
step (relative to the loop start) is ``samples so far / cumulative rate``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from .settings import LORA_DROPOUT, LR_SCHEDULE, RunSettings


def train_argv(s: RunSettings, *, dataset: str, output_dir: str, extra: list[str]) -> list[str]:
    """``raggedvl train`` with every setting of the comparison spelled out (flags of
    ``raggedvl.app.config.TrainConfig`` and torchrun's ``--nproc-per-node``)."""
    argv = [
        "train", "--model", s.model, "--lora", "false" if s.lora_r is None else "true", "--dataset", dataset,
        "--max-train-samples", "none", "--max-eval-samples", "none",
        "--global-batch-size", str(s.global_batch), "--max-steps", str(s.steps),
        "--lr", repr(s.lr), "--head-lr", repr(s.head_lr if s.head_lr is not None else s.lr),
        "--warmup-steps", str(s.warmup_steps), "--lr-schedule", LR_SCHEDULE, "--weight-decay", repr(s.weight_decay),
        "--max-grad-norm", repr(s.max_grad_norm), "--temperature", repr(s.temperature),
        "--max-pixels", str(s.max_pixels), "--seed", str(s.seed), "--precision", "fp32",
        "--eval-before", "false", "--eval-after", "false",
        "--output-dir", output_dir, "--checkpoint-every", str(10**9), "--keep-checkpoints", "1", "--log-every", "1",
        "--nproc-per-node", str(s.nproc),
    ]
    if s.lora_r:
        argv += ["--lora-r", str(s.lora_r), "--lora-alpha", str(s.lora_r), "--lora-dropout", repr(LORA_DROPOUT)]
    return argv + list(extra)


def command(s: RunSettings, *, dataset: str, output_dir: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "raggedvl.app.cli", *train_argv(s, dataset=dataset, output_dir=output_dir, extra=extra)]


def validate_argv(argv: list[str]) -> Any:
    """Parse ``argv`` with raggedvl's own CLI parser and config validation (no process started);
    returns the ``TrainConfig``. Raises what raggedvl raises for a bad flag or value."""
    from raggedvl.app.cli import build_parser
    from raggedvl.app.config import config_from_args

    args = build_parser().parse_args(argv)
    return config_from_args(args)


def read_run(output_dir: str | Path) -> dict[str, Any]:
    """Per-step global losses, samples and end times (seconds since the loop started)."""
    records = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps, done = [], 0
    for r in records:
        if r.get("event") != "train":
            continue
        n = sum(r["rank_samples"])
        done += n
        steps.append({"step": r["step"], "loss": r["loss"], "samples": n, "t": done / r["samples_per_s"]})
    return {"steps": steps}


def _model_prompts(model_source: str, processor):
    """The prompts ``raggedvl train`` feeds this checkpoint with (they travel with the model)."""
    from raggedvl.models import build_retriever

    return build_retriever(model_source, processor=processor, seed=0).config.prompts


def _replayed_run(s: RunSettings, dataset: str, extra: list[str]):
    """(config, processor, training split, image policy, size-estimate costs) of the ``raggedvl
    train`` run these settings and ``extra`` flags start, built as it builds them (no process
    started, no model loaded)."""
    from raggedvl.app.setup import estimate_train_costs
    from raggedvl.data import build_processor, load_retrieval_dataset
    from raggedvl.images import ImagePolicy

    cfg = validate_argv(train_argv(s, dataset=dataset, output_dir="/nonexistent", extra=list(extra)))
    processor = build_processor(cfg.model, min_pixels=cfg.min_pixels, max_pixels=cfg.resolved_max_pixels)
    train = load_retrieval_dataset(dataset, split=cfg.train_split)
    policy = ImagePolicy.from_processor(processor)
    return cfg, processor, train, policy, estimate_train_costs(cfg, train, policy)


def _rank_batches(cfg, costs, nproc: int, steps: int):
    """(step, row indices) of every rank's batch over ``steps`` optimizer steps, rank after rank,
    from raggedvl's own sampler (``raggedvl.app.setup.make_sampler``), epoch after epoch as the
    training loop draws them."""
    import torch

    from raggedvl.app.setup import make_sampler
    from raggedvl.parallel.runtime import DistInfo

    for rank in range(nproc):
        info = DistInfo(rank=rank, world_size=nproc, local_rank=rank, device=torch.device("cpu"), backend="gloo")
        sampler = make_sampler(cfg, costs, info)
        taken, epoch = 0, 0
        while taken < steps:
            sampler.set_epoch(epoch)
            for indices in sampler:
                if taken == steps:
                    break
                yield taken, list(indices)
                taken += 1
            epoch += 1


def global_batches(s: RunSettings, dataset: str, extra: list[str] = ()) -> list[list[int]]:
    """The rows (indices into the training parquet) of each of ``s.steps`` global batches that
    ``raggedvl train`` with these settings draws: every rank's batch of a step, rank after rank,
    replayed from its own cost estimate and sampler. Another library fed these batches in this
    order sees the same samples at every step."""
    cfg, _, _, _, costs = _replayed_run(s, dataset, extra)
    batches: list[list[int]] = [[] for _ in range(s.steps)]
    for step, indices in _rank_batches(cfg, costs, s.nproc, s.steps):
        batches[step] += [int(i) for i in indices]
    return batches


def token_padding(s: RunSettings, dataset: str, extra: list[str] = ()) -> dict[str, int]:
    """Real vs padded document and query tokens of every rank's batch over the run's steps,
    replayed from raggedvl's own cost estimate and sampler (``raggedvl.app.setup``'s
    ``estimate_train_costs`` and ``make_sampler`` with this run's config) and the model's prompts; pixel rows are never padded (flat ``pixel_values``).

    Doc length = template tokens + visual tokens of the image's grid (processor resize rule);
    query length = tokens of the query template. Each rank pads its batch to its longest row;
    with ``--packing true`` among ``extra`` it packs every sequence into one row (no slot padded)."""
    cfg, processor, train, policy, costs = _replayed_run(s, dataset, extra)  # patches = the collator's pixel_values rows
    prompts = _model_prompts(cfg.model, processor)
    tok = processor.tokenizer
    doc_text = len(tok(prompts.doc_template)["input_ids"]) - 1  # the one <|image_pad|> becomes the visual tokens
    patches = costs.patches.tolist()
    doc_len = [doc_text + p // policy.merge_size**2 for p in patches]
    query_len = [len(tok(prompts.query(r["query"]))["input_ids"]) for r in train.records]
    totals = {k: 0 for k in ("doc_tokens", "doc_slots", "query_tokens", "query_slots", "pixel_rows", "pixel_slots", "batches")}
    for _, indices in _rank_batches(cfg, costs, s.nproc, s.steps):
        for lengths, key in ((doc_len, "doc"), (query_len, "query")):
            ls = [lengths[i] for i in indices]
            totals[f"{key}_tokens"] += sum(ls)
            totals[f"{key}_slots"] += sum(ls) if cfg.packing else max(ls) * len(ls)
        rows = sum(patches[i] for i in indices)
        totals["pixel_rows"] += rows
        totals["pixel_slots"] += rows
        totals["batches"] += 1
    return totals


def evaluate(model_source: str, checkpoint_dir: str | None, dev_parquet: str, max_pixels: int, seed: int) -> dict[str, float]:
    """raggedvl's own evaluation (``evaluate_benchmark``: its collator with the model's prompts,
    MaxSim over valid tokens, trec_eval tie order) of the model built from ``model_source`` as
    ``raggedvl train`` builds it, with the weights of ``checkpoint_dir`` (a run directory) loaded
    when given."""
    import torch

    from raggedvl.data import RetrievalCollator, build_processor, load_retrieval_dataset
    from raggedvl.models import build_retriever
    from raggedvl.evaluation.benchmark import RetrievalBenchmark
    from raggedvl.evaluation.evaluator import evaluate_benchmark

    processor = build_processor(model_source, max_pixels=max_pixels)
    torch.manual_seed(seed)
    model = build_retriever(model_source, processor=processor, seed=seed)
    if checkpoint_dir is not None:
        from raggedvl.parallel import load_full_state_dicts
        from raggedvl.app.checkpoint import checkpoint_weights, load_checkpoint_or_latest

        ckpt = load_checkpoint_or_latest(checkpoint_dir)
        load_full_state_dicts(model, None, checkpoint_weights(ckpt.path), None)
    dev = load_retrieval_dataset(dev_parquet, split="dev")
    collate = RetrievalCollator(processor, prompts=model.config.prompts)
    metrics = evaluate_benchmark(model, collate, RetrievalBenchmark.from_pairs(dev), batch_size=8, device=torch.device("cpu"))
    metrics["n"] = metrics["queries"]  # as the colpali side counts
    return metrics


def processor_works(model_source: str, max_pixels: int) -> str | None:
    """None when raggedvl's ``build_processor(model_source)`` collates a (query, page) pair with
    raggedvl's own collator; else the error it raises."""
    from PIL import Image

    from raggedvl.data import RetrievalCollator, build_processor

    try:
        collate = RetrievalCollator(build_processor(model_source, max_pixels=max_pixels))
        collate([{"query": "probe", "image": Image.new("RGB", (56, 56), "white"), "id": "probe"}])
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def adapt_processor(model_source: str, work_dir: Path, max_pixels: int) -> tuple[str, str]:
    """The checkpoint raggedvl is given, and a note for the report.

    A colpali-engine checkpoint names ``ColQwen2Processor`` in ``processor_config.json``. Where
    transformers can build its own ``ColQwen2Processor`` (torchvision installed), raggedvl's
    ``build_processor`` returns it, and it refuses text and images in one call. When the probe
    (``processor_works``) fails, raggedvl gets a copy of the checkpoint folder (files linked,
    weights untouched) whose ``processor_class`` is ``Qwen2VLProcessor``: the same tokenizer and
    image-processor settings through the standard class. Once raggedvl loads colpali processors
    itself, the probe passes and the checkpoint is used as it is."""
    problem = processor_works(model_source, max_pixels)
    if problem is None:
        return model_source, "raggedvl's build_processor loads the checkpoint's processor as it is"
    src = Path(model_source)
    dst = Path(work_dir) / f"{src.name}-qwen2vl-processor"
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "processor_config.json" and not (dst / f.name).exists():
            (dst / f.name).symlink_to(f.resolve())
    config = json.loads((src / "processor_config.json").read_text())
    config["processor_class"] = "Qwen2VLProcessor"
    (dst / "processor_config.json").write_text(json.dumps(config, indent=2) + "\n")
    again = processor_works(str(dst), max_pixels)
    if again is not None:
        raise ValueError(f"raggedvl cannot collate with the processor of {model_source} ({problem}) nor of the "
                         f"adapted copy {dst} ({again})")
    return str(dst), (f"WORKAROUND: raggedvl's build_processor({src.name}) fails here ({problem}); raggedvl is given "
                      f"{dst} (same files, processor_class Qwen2VLProcessor)")


def head_matches_checkpoint(model_source: str, max_pixels: int) -> str:
    """Whether ``build_retriever(model_source)`` takes colpali's ``custom_text_proj`` from the
    checkpoint ("loaded") or initialises its own head ("re-initialised"), by comparing weights."""
    import torch
    from safetensors import safe_open

    from raggedvl.data import build_processor
    from raggedvl.models import build_retriever

    path = Path(model_source) / "model.safetensors"
    if not path.is_file():
        return "unknown (no model.safetensors)"
    with safe_open(str(path), "pt") as f:
        keys = [k for k in f.keys() if k.endswith("custom_text_proj.weight")]
        if not keys:
            return "unknown (checkpoint has no custom_text_proj)"
        ref = f.get_tensor(keys[0])
    model = build_retriever(model_source, processor=build_processor(model_source, max_pixels=max_pixels), seed=0)
    same = any(p.shape == ref.shape and torch.equal(p.detach().cpu(), ref) for p in model.head.parameters())
    return "loaded from the checkpoint" if same else "re-initialised by raggedvl (checkpoint's custom_text_proj not used)"
