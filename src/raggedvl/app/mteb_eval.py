"""``raggedvl eval CHECKPOINT --mteb TASK``: mteb's own evaluation of a checkpoint (the ViDoRe
leaderboard's code path) through :class:`raggedvl.integrations.mteb.MtebEncoder`, with the
prompts and ``max_length`` the checkpoint was trained with; prints each task's main score and
writes mteb's results as JSON. One process."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from raggedvl import __version__
from raggedvl.app.evaluate_checkpoint import checkpoint_collator, file_slug, load_model
from raggedvl.app.rundir import results_folder

SHOWN = ("ndcg_at_5", "ndcg_at_10", "map_at_10", "mrr_at_10", "recall_at_10")  # printed beside each main score
HUB_PROBE_TIMEOUT_S = 5.0  # the one metadata request that tells whether the hub can be reached


def load_tasks(name: str) -> list:
    """The mteb tasks ``name`` names (a task, or a benchmark such as ``ViDoRe(v3)``: its tasks),
    their data loaded. Raises ``ValueError`` for an unknown name (mteb's suggestion) or data that
    cannot be loaded (offline or with the hub unreachable: not in the Hugging Face cache).

    Unless offline (``HF_HUB_OFFLINE=1``), one metadata request per task (``HUB_PROBE_TIMEOUT_S``)
    first asks the hub for the task's dataset; when the hub cannot be reached, this process turns
    offline (``HF_HUB_OFFLINE=1``: the hub client's and datasets' settings too), so the data is read
    from the cache at once instead of after the hub client's retries."""
    try:
        import mteb
    except ImportError:
        raise ValueError("--mteb needs the mteb package: pip install 'raggedvl[mteb]'") from None
    try:
        tasks = [mteb.get_task(name)]
    except KeyError as exc:
        try:
            tasks = list(mteb.get_benchmark(name).tasks)
        except KeyError:
            raise ValueError(f"--mteb {name}: {exc.args[0]} (mteb's names: mteb.get_tasks(), mteb.get_benchmarks(); "
                             f"ViDoRe: VidoreArxivQARetrieval..., benchmarks ViDoRe(v1), ViDoRe(v2), ViDoRe(v3))") from None
    for task in tasks:
        _load_data(task)
    return tasks


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else ""


def _hub_unreachable(path: str | None, revision: str | None) -> str | None:
    """Why the hub cannot be reached (``"Type: message"``), from one request for the dataset
    ``path``'s metadata (``HUB_PROBE_TIMEOUT_S`` seconds, no retry); None when the hub answers,
    whatever it answers (a missing or gated dataset is the loading's own error), or when ``path``
    is a local path or not a hub id."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HFValidationError, HfHubHTTPError

    if path is None or Path(path).exists():
        return None
    try:
        HfApi().dataset_info(str(path), revision=revision, timeout=HUB_PROBE_TIMEOUT_S)
    except (HfHubHTTPError, HFValidationError):
        return None
    except Exception as exc:  # noqa: BLE001 - any transport error: the hub cannot be reached
        return f"{type(exc).__name__}: {_first_line(exc)}"
    return None


def _go_offline() -> None:
    """``HF_HUB_OFFLINE=1`` for this process: the variable, and the settings the hub client and
    datasets read from it when imported."""
    import datasets
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True


def _load_data(task) -> None:
    from huggingface_hub import constants

    name = task.metadata.name
    where = task.metadata.dataset.get("path")
    unreachable = None if constants.HF_HUB_OFFLINE else _hub_unreachable(where, task.metadata.dataset.get("revision"))
    if unreachable:
        _go_offline()
    try:
        task.load_data()
    except Exception as exc:  # noqa: BLE001 - whatever datasets / the hub raise: one line naming the cause and the fix
        if unreachable:
            fix = (f"the hub cannot be reached ({unreachable}), so mteb read the Hugging Face datasets cache only: "
                   "check the network, or copy a filled cache under HF_HOME")
        elif constants.HF_HUB_OFFLINE:
            fix = ("offline (HF_HUB_OFFLINE=1) mteb reads a task's data from the Hugging Face datasets cache only: "
                   "fill it by running once with network access, or copy a filled cache under HF_HOME")
        else:
            fix = ("mteb downloads a task's data from the Hugging Face hub into the datasets cache: check the network "
                   "and the dataset's access, or copy a filled cache under HF_HOME")
        raise ValueError(f"--mteb {name}: its data ({where}) could not be loaded ({type(exc).__name__}: {_first_line(exc)}); "
                         f"{fix}") from exc


def mteb_encoder(path: str | Path, *, device: torch.device | str | None = None, progress: bool = False):
    """A :class:`raggedvl.integrations.mteb.MtebEncoder` for the checkpoint at ``path``
    (anything ``raggedvl eval`` loads: a run directory's newest verified checkpoint, a training
    checkpoint, a saved retriever, a colpali or transformers checkpoint), on ``device`` (default:
    CUDA when available), writing inputs as it was trained (prompts, family, the run's
    ``max_length``). Named ``raggedvl/<folder>`` in mteb's results, revision the training step.
    For ``mteb.evaluate(encoder, tasks)``."""
    return _load(path, device, progress)[0]


def _load(path, device, progress):
    """(encoder, model description, run config or None) of :func:`mteb_encoder`."""
    from raggedvl.integrations.mteb import MtebEncoder

    device = device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    model, processor, cfg, described = load_model(Path(path), device)
    encoder = MtebEncoder(model, collator=checkpoint_collator(model, processor, cfg), name=f"raggedvl/{Path(described['path']).name}",
                          revision=str(described["step"]) if "step" in described else None, progress=progress)
    return encoder, described, cfg


def evaluate_with_mteb(path: str | Path, tasks: list[str], *, batch_size: int = 16,
                       output: str | Path | None = None) -> dict[str, Any]:
    """Score the checkpoint at ``path`` (as :func:`mteb_encoder` loads it) on the mteb ``tasks``
    (task or benchmark names) with ``mteb.evaluate`` (no results cache: every call runs).
    ``batch_size``: items per forward pass. Prints one line per task, split and subset (main
    score, then the others of nDCG@5/10, MAP@10, MRR@10, Recall@10) and writes ``output`` (default
    ``<run>/eval/mteb-<tasks>.json`` or ``<model folder>/eval/mteb-<tasks>.json``). Returns the
    written dict. Task data is loaded before the model; raises ``ValueError`` as
    :func:`load_tasks`."""
    import mteb

    loaded = {task.metadata.name: task for name in tasks for task in load_tasks(name)}
    encoder, described, _ = _load(path, None, progress=True)
    result = mteb.evaluate(encoder, list(loaded.values()), cache=None,
                           encode_kwargs={"batch_size": batch_size, "show_progress_bar": False}, show_progress_bar=False)
    results = {"model": described, "raggedvl_version": __version__, "mteb_version": mteb.__version__,
               "tasks": {r.task_name: json.loads(r.model_dump_json()) for r in result.task_results}}
    output = Path(output) if output is not None else (
        results_folder(described["path"]) / f"mteb-{file_slug('+'.join(tasks))}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(f"{described['path']}: mteb {mteb.__version__}")
    for task_result in result.task_results:
        main = loaded[task_result.task_name].metadata.main_score
        for split, per_subset in task_result.scores.items():
            for scores in per_subset:
                extra = " ".join(f"{k} {scores[k]:.5f}" for k in SHOWN if k in scores and k != main)
                print(f"{task_result.task_name} {split} {scores['hf_subset']}: {main} {scores[main]:.5f} (main score); {extra}")
    print(f"results written to {output}")
    return results
