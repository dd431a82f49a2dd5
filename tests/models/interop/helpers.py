"""The colpali-engine fixtures (tests/fixtures/colqwen2-tiny, written by colpali-engine 0.3.18
itself: see its README) and a helper that encodes their inputs with a raggedvl retriever."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from PIL import Image
from safetensors.torch import load_file

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "colqwen2-tiny"
FULL = FIXTURES / "colqwen2_full"
LORA = FIXTURES / "colqwen2_lora"


def reference() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / "reference.safetensors"))


def examples() -> list[dict]:
    queries = json.loads((FIXTURES / "inputs" / "queries.json").read_text())
    return [{"id": str(i), "query": q, "image": Image.open(FIXTURES / "inputs" / f"page{i}.png")}
            for i, q in enumerate(queries)]


def encode(model, folder: Path):
    """(collated batch, query output, document output) of the fixture inputs, the way
    ``raggedvl train`` encodes them: the checkpoint's processor and the retriever's prompts."""
    from raggedvl.data import RetrievalCollator, build_processor

    batch = RetrievalCollator(build_processor(str(folder)), prompts=model.config.prompts)(examples())
    model.eval()
    with torch.no_grad():
        return batch, model(**batch["queries"]), model(**batch["docs"])


def masked_max_abs(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """Largest |a - b| over the real tokens (mask 1)."""
    return float((a - b).abs()[mask.bool()].max())
