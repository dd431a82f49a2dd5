"""``raggedvl export SOURCE --format colpali|transformers|sentence-transformers --output DIR [--merge-lora]``.

SOURCE: a run directory (its newest checkpoint that verifies), a checkpoint folder
(``run/checkpoints/step-N``, verified against its SHA-256 manifest; one written before
checkpoints held the retriever's settings is rebuilt from its run's config, as ``raggedvl eval``
does), or anything
``build_retriever`` loads (a saved retriever, a colpali or transformers checkpoint, an adapter:
export then converts between the layouts). The retriever and its processor are written by
:mod:`raggedvl.models.interop.export`; beside them a model card (``README.md``) with the
training config, the data, the evaluation metrics of the run and the raggedvl version.

One process, no process group and no GPU: the weights of a sharded checkpoint are consolidated
from every rank's shards (``raggedvl.app.checkpoint.as_retriever_folder``), whatever the number
of processes that wrote them; those of a checkpoint of the single-file layout come from its
safetensors file. The run's state comes from ``trainer_state.json`` and ``metrics.jsonl``; the
optimizer state and ``rng.pt`` are hashed, never loaded.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from raggedvl.app.checkpoint import MANIFEST, as_retriever_folder, find_checkpoint
from raggedvl.app.config import TRAIN_CONFIG_NAME
from raggedvl.app.rundir import check_new_folder
from raggedvl.app.wording import counted

CARD_KEYS = ("model", "head", "dim", "lora", "lora_r", "lora_alpha", "lora_dropout", "loss", "temperature",
             "global_batch_size", "max_steps", "epochs", "lr", "head_lr", "weight_decay", "warmup_steps",
             "precision", "strategy", "grad_cache", "max_pixels", "seed")
DATA_KEYS = ("dataset", "dataset_weights", "batch_sampling", "source_column", "negatives_column",
             "train_split", "eval_split", "max_train_samples", "max_eval_samples")


def resolve_source(source: str) -> tuple[str, dict[str, Any] | None, Path | None]:
    """(what to load, the checkpoint's trainer state or None, the run directory or None).

    Raises :class:`CheckpointError` for a run directory without a checkpoint that verifies, or a
    checkpoint folder that fails verification."""
    path = Path(source)
    if path.is_dir() and ((path / "checkpoints").is_dir() or (path / MANIFEST).is_file()):
        checkpoint = find_checkpoint(path)  # verified (hashed), nothing loaded
        state = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
        run_dir = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None
        return str(checkpoint), state, run_dir
    return source, None, None


def stated_lora(source: str) -> bool | None:
    """Whether the model ``source`` names has LoRA adapters, as its settings files say (nothing
    verified or loaded): a run directory's ``train_config.json``, a checkpoint's or saved
    retriever's settings (``raggedvl_retriever.json``), an older checkpoint's
    ``trainer_state.json``, a peft ``adapter_config.json`` (yes), a transformers ``config.json``
    (no); None when none says (a hub id, a preset, a config this version cannot read)."""
    from raggedvl.app.config import TrainConfig
    from raggedvl.models.saved import retriever_config_file

    path = Path(source)
    if not path.is_dir():
        return None
    settings = retriever_config_file(path)
    try:
        if (path / TRAIN_CONFIG_NAME).is_file():
            return TrainConfig.from_dict(json.loads((path / TRAIN_CONFIG_NAME).read_text(encoding="utf-8"))).use_lora
        if settings is not None:
            return bool(json.loads(settings.read_text(encoding="utf-8"))["retriever"].get("lora"))
        if (path / "trainer_state.json").is_file():
            config = json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))["config"]
            return TrainConfig.from_dict(config).use_lora
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if (path / "adapter_config.json").is_file():
        return True
    return False if (path / "config.json").is_file() else None


def _no_lora(source: str) -> ValueError:
    return ValueError(f"--merge-lora: {source} has no LoRA adapters (its weights are full): there is nothing to "
                      "merge; export it without --merge-lora")


def export(source: str, fmt: str, output: str, *, merge_lora: bool = False) -> Path:
    """Export ``source`` (module docstring) as ``fmt`` into ``output``; returns the folder.

    Raises ``ValueError`` before writing for what the format cannot hold (another ``dim`` for
    colpali, a bi-encoder, an adapter without a named base), for an ``output`` that already
    holds files and for ``merge_lora`` on a model without LoRA adapters (before anything is
    verified or loaded when its settings files say so, :func:`stated_lora`);
    :class:`CheckpointError` for a checkpoint that does not verify."""
    from raggedvl import __version__
    from raggedvl.data import build_processor
    from raggedvl.models import build_retriever
    from raggedvl.models.interop.export import check_exportable, export_colpali, export_transformers
    from raggedvl.models.interop.multi_vector_encoder import export_multi_vector_encoder
    from raggedvl.models.saved import is_saved_retriever, weights_file
    from raggedvl.app.evaluate_checkpoint import rebuild_retriever

    if merge_lora and stated_lora(source) is False:
        raise _no_lora(source)
    out = Path(output)
    check_new_folder(out, "export")
    folder, state, run_dir = resolve_source(source)
    older = []
    if state is not None and not is_saved_retriever(folder):  # written before raggedvl export existed
        model, processor, _ = rebuild_retriever(state["config"], load_file(str(weights_file(folder))))
        older.append(f"{folder} predates saved retriever settings: rebuilt from its run's config (trainer_state.json) "
                     "with the model's default prompts, as raggedvl eval scores it (raggedvl_prompts.json holds them; "
                     "runs of raggedvl before it read colpali checkpoints put 'Query: ' before each query)")
    else:
        with as_retriever_folder(folder) as loadable:  # a sharded checkpoint: consolidated in this process
            model, processor = build_retriever(loadable), None
    source_lora = model.config.lora is not None
    if merge_lora and not source_lora:  # a hub id or a preset: known once loaded
        raise _no_lora(source)
    check_exportable(model.config, model.family.name, fmt)
    processor = processor or build_processor(folder)
    if fmt == "colpali":
        notes = older + export_colpali(model, processor, out, merge_lora=merge_lora)
    elif fmt == "sentence-transformers":
        notes = older + export_multi_vector_encoder(model, processor, out)
    else:
        notes = older + export_transformers(model, processor, out)
    card = model_card(source=source, checkpoint=folder, fmt=fmt, state=state, run_dir=run_dir, version=__version__,
                      adapter=(out / "adapter_config.json").is_file(), base=model.config.base,
                      merged=source_lora and model.config.lora is None, prompts=model.config.prompts, notes=notes)
    (out / "README.md").write_text(card, encoding="utf-8")
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"wrote {fmt} checkpoint {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")
    return out


def _metrics_rows(run_dir: Path | None) -> dict[str, dict[str, float]]:
    path = None if run_dir is None else run_dir / "metrics.jsonl"
    if path is None or not path.is_file():
        return {}
    rows: dict[str, dict[str, float]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line) if line.strip() else {}
        label = {"eval_before": "before training", "eval_after": "after training"}.get(record.get("event"))
        for split, metrics in (record.get("raw") or {}).items() if label else ():
            rows[f"{split}: {label} ({counted(int(metrics.get('n', 0)), 'pair')})"] = metrics
    return rows


def model_card(*, source: str, checkpoint: str, fmt: str, state: dict | None, run_dir: Path | None, version: str,
               adapter: bool, base: str | None, merged: bool, prompts: Any, notes: list[str]) -> str:
    """The ``README.md`` of an exported folder (Hugging Face model-card layout: YAML front matter,
    then Markdown)."""
    from raggedvl.app.report import format_metrics_table

    library = {"colpali": "colpali", "sentence-transformers": "sentence-transformers"}.get(fmt, "transformers")
    lines = ["---", f"library_name: {library}", "tags:", "- raggedvl", "- colpali", "- visual-document-retrieval",
             "- late-interaction"]
    if base:
        lines.append(f"base_model: {base}")
    lines += ["---", "", f"# {Path(checkpoint).name} ({fmt} format)", "",
              f"Exported by raggedvl {version} from `{source}`"
              + (f" (checkpoint `{checkpoint}`, step {state['step']})" if state else "") + ".", ""]
    lines += ["## Use", "", "```python"]
    if fmt == "colpali":
        lines += ["from colpali_engine.models import ColQwen2, ColQwen2Processor", "",
                  'model = ColQwen2.from_pretrained("PATH").eval()'
                  + ("  # an adapter: loads its base, then the LoRA (peft)" if adapter else ""),
                  'processor = ColQwen2Processor.from_pretrained("PATH")',
                  "queries = model(**processor.process_queries([\"...\"]))",
                  "pages = model(**processor.process_images([image]))",
                  "scores = processor.score_multi_vector(queries, pages)"]
    elif fmt == "sentence-transformers":
        lines += ["from sentence_transformers import MultiVectorEncoder", "",
                  'model = MultiVectorEncoder("PATH")  # the prompts raggedvl trained with, MaxSim',
                  "queries = model.encode_query([\"...\"])",
                  "pages = model.encode_document([image])",
                  "scores = model.similarity(queries, pages)"]
    else:
        lines += ["from transformers import ColQwen2ForRetrieval, ColQwen2Processor", "",
                  'model = ColQwen2ForRetrieval.from_pretrained("PATH").eval()',
                  'processor = ColQwen2Processor.from_pretrained("PATH")',
                  "batch = processor(images=[image])",
                  "# pass the M-RoPE position ids: ColQwen2ForRetrieval calls its VLM with input_ids=None",
                  "image_tokens = (batch[\"input_ids\"] == model.config.vlm_config.image_token_id).int()",
                  "position_ids, _ = model.vlm.get_rope_index(batch[\"input_ids\"], image_tokens, batch[\"image_grid_thw\"],",
                  "                                           attention_mask=batch[\"attention_mask\"])",
                  "pages = model(**batch, position_ids=position_ids).embeddings",
                  "# or: from raggedvl.models.interop import mrope_position_ids; mrope_position_ids(model.vlm, batch)"]
    lines += ["```", "", "raggedvl loads this folder too: `raggedvl.models.build_retriever(\"PATH\")`, or "
              "`raggedvl train --model PATH` to continue training.", ""]
    lines += ["Given the same `pixel_values`, the embeddings equal raggedvl's within float32 rounding. The pixels "
              "themselves depend on the image processor: transformers' torchvision-backed processor (used when "
              "torchvision is installed) and its PIL one resize pages with different kernels, so for identical "
              "embeddings prepare pages with the processor raggedvl used (torchvision's resize, which raggedvl "
              "computes with torch) or pass the same prepared `pixel_values` to both.", ""]
    lines += ["## Prompts", "", "The retriever was trained with (`raggedvl_prompts.json`):", "",
              f"- query: `{prompts.query_template!r}`", f"- page: `{prompts.doc_template!r}`",
              f"- padding: {prompts.padding_side}", ""]
    if adapter:
        lines += [f"Weights: a peft LoRA adapter on `{base}` (language-model projections) with the projection "
                  "`custom_text_proj` saved whole (`modules_to_save`).", ""]
    elif merged:
        lines += ["Weights: full; the LoRA adapters were merged into the base weights.", ""]
    cfg = (state or {}).get("config")
    if cfg:
        lines += ["## Training", "", "| key | value |", "|---|---|"]
        lines += [f"| {k} | {cfg[k]} |" for k in CARD_KEYS if k in cfg]
        lines += [f"| steps | {state['step']} |", f"| world size | {state.get('world_size')} |", ""]
        lines += ["## Data", "", "| key | value |", "|---|---|"] + [f"| {k} | {cfg[k]} |" for k in DATA_KEYS if k in cfg]
        if run_dir is not None and (run_dir / TRAIN_CONFIG_NAME).is_file():
            lines += ["", f"Full training config: `{run_dir / TRAIN_CONFIG_NAME}` of the run."]
        lines.append("")
    else:
        lines += ["## Training", "", "Not trained by raggedvl in this export (converted from the source's layout).", ""]
    rows = _metrics_rows(run_dir)
    lines += ["## Metrics", ""]
    lines += [format_metrics_table(rows), ""] if rows else ["No evaluation was recorded for this checkpoint.", ""]
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)
