"""What a model or dataset name points at (a preset, a local path or a hub id), checked in seconds.

``raggedvl train`` calls :func:`resolve_source` for ``--model`` and ``--dataset`` before any
rank starts, and ``raggedvl eval`` / ``encode`` / ``search`` / ``export`` for their checkpoint
and ``--dataset`` before torch is imported, so that a typo or an unreachable hub is one line,
not minutes of retries inside torchrun or the hub client:

| name | result |
|---|---|
| a preset (``tiny``, ``rdocs``) | itself |
| an existing file or folder | itself; a ``--model`` folder must look like a checkpoint (:func:`check_model_folder`) |
| a path that does not exist (``./x``, ``/x``, ``a/b/c``, ``x.parquet``, or a parent folder that exists) | ``ValueError`` naming the closest entry of the folder it would be in, or a preset |
| ``a/b`` where ``a`` is close to a local folder holding ``b`` (``rnus/a`` beside ``runs/a``) | ``ValueError``: "did you mean 'runs/a'?" |
| a bare name close to a preset (``tyny``) | ``ValueError``: "did you mean 'tiny'?" |
| a hub id, offline (``HF_HUB_OFFLINE=1``, or ``HF_DATASETS_OFFLINE=1`` for datasets) | itself when the hub cache holds it, else ``ValueError`` naming the cache and the fixes |
| a hub id, online | one metadata request (``timeout_s``, default 10 s): itself when found; ``ValueError`` for a repository that does not exist or is gated; when the hub cannot be reached, itself if cached (and ``HF_HUB_OFFLINE=1`` is set for this process and the ranks it starts, so that no library retries), else ``ValueError`` |

Only ``huggingface_hub`` is imported (for hub ids), never torch.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from raggedvl.suggest import closest

RepoType = Literal["model", "dataset"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_TRUE = {"1", "true", "yes", "on"}


def _offline(repo_type: RepoType) -> bool:
    names = ["HF_HUB_OFFLINE"] + (["HF_DATASETS_OFFLINE"] if repo_type == "dataset" else [])
    return any(os.environ.get(n, "").strip().lower() in _TRUE for n in names)


def _closest(name: str, candidates: list[str]) -> str | None:
    """A typo's likely meaning (:func:`raggedvl.suggest.closest`, typos only: a close name here
    refuses a name that could otherwise be a hub id)."""
    return closest(name, candidates, typos_only=True)


def missing_path(name: str, presets: tuple[str, ...], what: str, kind: str) -> ValueError:
    """The error for a local ``name`` that does not exist: "no such <kind>", with "did you
    mean" the closest entry of its folder (or that folder's absence) or the closest preset."""
    path = Path(name).expanduser()
    parent = path.parent if str(path.parent) else Path(".")
    hint = ""
    if parent.is_dir():
        try:
            entries = sorted(p.name for p in parent.iterdir())
        except OSError:
            entries = []
        close = _closest(path.name, entries)
        if close is not None:
            hint = f"; did you mean {str(parent / close) if str(parent) != '.' else close!r}?"
        else:
            hint = f" (the folder {str(parent)!r} exists)"
    else:
        hint = f" (no folder {str(parent)!r} either)"
    close = _closest(name, list(presets))
    if close and not hint.startswith("; did"):
        hint += f"; did you mean the preset {close!r}?"
    return ValueError(f"{what} {name!r}: no such {kind}{hint}")


# what makes a folder a model: transformers' or raggedvl's settings, a peft adapter, or a run
MODEL_FILES = ("config.json", "raggedvl_retriever.json", "adapter_config.json", "train_config.json")
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "tokenizer_config.json", "tokenizer.json")


def check_model_folder(folder: Path, what: str = "--model") -> None:
    """Raise ``ValueError`` (one line: the folder, what it lacks, what it holds, the fix) for a
    folder that cannot be a checkpoint: none of :data:`MODEL_FILES` (and no ``checkpoints/`` of a
    run, no ``step-N`` checkpoint folders as ``--save-best`` keeps them), or a transformers model folder without its processor (:data:`PROCESSOR_FILES`), which
    the model's own image geometry and prompts would then be built without."""
    names = sorted(p.name for p in folder.iterdir())
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "") if names else "nothing"
    holds_checkpoints = "checkpoints" in names or any(re.fullmatch(r"step-\d+", n) for n in names)
    if not any(n in names for n in MODEL_FILES) and not holds_checkpoints:
        raise ValueError(f"{what} {str(folder)!r} is not a model folder: it has no {' / '.join(MODEL_FILES)} "
                         f"(it holds {shown}); pass a checkpoint folder, a run folder, a hub id or 'tiny'")
    if "config.json" in names and "adapter_config.json" not in names and not any(n in names for n in PROCESSOR_FILES):
        raise ValueError(f"{what} {str(folder)!r} has config.json but no processor ({' / '.join(PROCESSOR_FILES)}; "
                         f"it holds {shown}); save the processor beside the model (processor.save_pretrained)")


def _looks_like_path(name: str) -> bool:
    return (name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name
            or Path(name).suffix.lower() in (".parquet", ".json", ".jsonl", ".csv", ".arrow", ".yaml", ".safetensors"))


def resolve_source(name: str, *, repo_type: RepoType, presets: tuple[str, ...] = (), what: str | None = None,
                   timeout_s: float = 10.0, kind: str = "file or folder") -> str:
    """``name`` when it is a preset, an existing path or a reachable (or cached) hub id; raises
    ``ValueError`` (one line, naming the name, the cause and the fix) otherwise. Module table.
    ``what``: how messages name the argument (default ``--model`` / ``--dataset``); ``kind``: what
    a local path must be ("no such folder" for a checkpoint)."""
    what = what or ("--model" if repo_type == "model" else "--dataset")
    if name in presets:
        return name
    if Path(name).expanduser().exists():
        if repo_type == "model" and Path(name).expanduser().is_dir():
            check_model_folder(Path(name).expanduser(), what)
        return name
    if _looks_like_path(name):
        raise missing_path(name, presets, what, kind)
    first = name.split("/", 1)[0]
    if "/" in name and Path(first).is_dir():  # "runs/defualt" next to a runs/ folder: a path typo
        raise missing_path(name, presets, what, kind)
    if "/" in name:  # "rnus/a" where runs/a exists: a path typo, not a hub id
        folder, rest = _closest(first, [p.name for p in Path(".").iterdir() if p.is_dir()]), name.split("/", 1)[1]
        if folder is not None and Path(folder, rest).exists():
            raise ValueError(f"{what} {name!r}: no such {kind}; did you mean {f'{folder}/{rest}'!r}?")
    if "/" not in name:
        close = _closest(name, list(presets)) or _closest(name, [p.name for p in Path(".").iterdir()])
        if close is not None:
            raise ValueError(f"{what} {name!r} is not a preset, a local path or a hub id it could be; "
                             f"did you mean {close!r}?")
    if not _HUB_ID.match(name):
        raise ValueError(f"{what} {name!r} is neither an existing path nor a valid hub id (like 'org/name')"
                         + (f"; presets: {', '.join(presets)}" if presets else ""))
    return _check_hub(name, repo_type, what, timeout_s, presets)


def _cached(name: str, repo_type: RepoType) -> bool:
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(name, repo_type=repo_type, local_files_only=True)
        return True
    except Exception:  # noqa: BLE001 - LocalEntryNotFoundError and kin: not cached
        return False


def _check_hub(name: str, repo_type: RepoType, what: str, timeout_s: float, presets: tuple[str, ...]) -> str:
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    cache = constants.HF_HUB_CACHE
    if _offline(repo_type):
        if _cached(name, repo_type):
            return name
        raise ValueError(f"{what} {name!r}: the hub is off (HF_HUB_OFFLINE) and {cache} does not hold this {repo_type}; "
                         "download it where the hub is reachable, or pass a local folder"
                         + (f" or a preset ({', '.join(presets)})" if presets else ""))
    try:
        HfApi().repo_info(name, repo_type=repo_type, timeout=timeout_s)
        return name
    except GatedRepoError:
        raise ValueError(f"{what} {name!r} is gated on the hub: accept its terms on huggingface.co and log in "
                         "(hf auth login or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        close = _closest(name, list(presets))
        raise ValueError(f"{what} {name!r}: no such {repo_type} on the hub (or it is private: log in with hf auth login "
                         "or HF_TOKEN)" + (f"; did you mean {close!r}?" if close else "")) from None
    except Exception as exc:  # noqa: BLE001 - any transport error: the hub cannot be reached
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if _cached(name, repo_type):
            os.environ["HF_HUB_OFFLINE"] = "1"  # the ranks read the cache instead of retrying
            return name
        raise ValueError(f"{what} {name!r}: cannot reach the hub ({reason}) and {cache} does not hold this {repo_type}; "
                         "check the network, or pass a local folder"
                         + (f" or a preset ({', '.join(presets)})" if presets else "")) from None
