"""``raggedvl eval CHECKPOINT --mteb TASK``: mteb's own evaluation of a checkpoint (the ViDoRe
leaderboard's code path) through :class:`raggedvl.integrations.mteb.MtebEncoder`, with the
prompts and ``max_length`` the checkpoint was trained with; prints each task's main score and
writes mteb's results as JSON. One process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from raggedvl import __version__
from raggedvl.parallel import init_distributed, shutdown
from raggedvl.app.evaluate_checkpoint import checkpoint_collator, file_slug, load_model, results_folder

SHOWN = ("ndcg_at_10", "map_at_10", "mrr_at_10", "recall_at_10")  # printed beside each main score


def load_task(name: str):
    """The mteb task ``name`` with its data loaded. Raises ``ValueError`` for an unknown name
    (mteb's suggestion) or data that cannot be loaded (offline: not in the Hugging Face cache)."""
    import mteb
    from huggingface_hub import constants

    try:
        task = mteb.get_task(name)
    except KeyError as exc:
        raise ValueError(f"--mteb {name}: {exc.args[0]} (mteb's task names: mteb.get_tasks(); ViDoRe v1: "
                         f"VidoreArxivQARetrieval, VidoreDocVQARetrieval, ...)") from None
    try:
        task.load_data()
    except Exception as exc:  # noqa: BLE001 - whatever datasets / the hub raise: one line naming the cause and the fix
        where = task.metadata.dataset.get("path")
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        fix = ("offline (HF_HUB_OFFLINE=1) mteb reads a task's data from the Hugging Face datasets cache only: fill it "
               "by running once with network access, or copy a filled cache under HF_HOME") if constants.HF_HUB_OFFLINE else (
               "mteb downloads a task's data from the Hugging Face hub into the datasets cache: check the network and "
               "the dataset's access, or copy a filled cache under HF_HOME")
        raise ValueError(f"--mteb {name}: its data ({where}) could not be loaded ({type(exc).__name__}: {first}); "
                         f"{fix}") from exc
    return task


def evaluate_with_mteb(path: str | Path, tasks: list[str], *, batch_size: int = 16,
                       output: str | Path | None = None) -> dict[str, Any]:
    """Score the checkpoint at ``path`` (anything ``raggedvl eval`` loads: a run directory, a
    training checkpoint, a saved retriever, a colpali or transformers checkpoint) on the mteb
    ``tasks`` with ``mteb.evaluate`` (no results cache: every call runs). ``batch_size``: items
    per forward pass. Prints one line per task, split and subset (main score, nDCG@10, MAP@10,
    MRR@10, Recall@10) and writes ``output`` (default ``<run>/eval/mteb-<tasks>.json`` or
    ``<model folder>/eval/mteb-<tasks>.json``). Returns the written dict. Task data is loaded
    before the model; raises ``ValueError`` as :func:`load_task`."""
    import mteb

    from raggedvl.integrations.mteb import MtebEncoder

    loaded = [load_task(name) for name in tasks]
    info = init_distributed()
    try:
        model, processor, cfg, described = load_model(Path(path), info)
        encoder = MtebEncoder(model, collator=checkpoint_collator(model, processor, cfg),
                              name=f"raggedvl/{Path(described['path']).name}",
                              revision=str(described["step"]) if "step" in described else None, progress=True)
        result = mteb.evaluate(encoder, loaded, cache=None, encode_kwargs={"batch_size": batch_size, "show_progress_bar": False},
                               show_progress_bar=False)
    finally:
        shutdown()
    results = {"model": described, "raggedvl_version": __version__, "mteb_version": mteb.__version__,
               "tasks": {r.task_name: json.loads(r.model_dump_json()) for r in result.task_results}}
    output = Path(output) if output is not None else results_folder(described, cfg) / f"mteb-{file_slug('+'.join(tasks))}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(f"{described['path']}: mteb {mteb.__version__}")
    for task, task_result in zip(loaded, result.task_results):
        main = task.metadata.main_score
        for split, per_subset in task_result.scores.items():
            for scores in per_subset:
                extra = " ".join(f"{k} {scores[k]:.5f}" for k in SHOWN if k in scores)
                print(f"{task_result.task_name} {split} {scores['hf_subset']}: {main} {scores[main]:.5f} (main score); {extra}")
    print(f"results written to {output}")
    return results
