"""`raggedvl export` checked with colpali-engine's and transformers' own classes.

    # in the benchmark venv (benchmarks/vs_colpali.sh builds it: colpali-engine 0.3.18 needs
    # torchvision), from the repository root:
    PYTHONPATH=src ~/.cache/raggedvl/bench-venv/bin/python benchmarks/export_vs_colpali.py [SOURCE ...]

SOURCE: anything ``raggedvl export`` takes (a run directory, a checkpoint, a colpali or
transformers checkpoint); default: the colpali fixtures (``tests/fixtures/colqwen2-tiny``). Each
source is exported as colpali (an adapter when it has LoRA), colpali ``--merge-lora`` and
transformers into a temporary folder; each folder is loaded with ``ColQwen2.from_pretrained`` +
``ColQwen2Processor.from_pretrained`` (colpali-engine) or ``ColQwen2ForRetrieval`` (transformers,
given the M-RoPE position ids), the fixture's three pages and queries are encoded, and the table
compares token ids and embeddings (max |difference| over each row's real tokens, fp32: the
libraries pad on different sides) with the source loaded in raggedvl. transformers' processor writes queries with its own prefix, so that row
compares pages only.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "colqwen2-tiny"


def _inputs():
    pages = [Image.open(FIXTURES / "inputs" / f"page{i}.png") for i in range(3)]
    return pages, json.loads((FIXTURES / "inputs" / "queries.json").read_text())


def _raggedvl(source: str):
    from raggedvl.data import RetrievalCollator, build_processor
    from raggedvl.models import build_retriever
    from raggedvl.app.export import resolve_source

    folder = resolve_source(source)[0]  # a run directory: its newest checkpoint that verifies
    model = build_retriever(folder).eval()
    pages, queries = _inputs()
    examples = [{"id": str(i), "query": q, "image": p} for i, (q, p) in enumerate(zip(queries, pages))]
    batch = RetrievalCollator(build_processor(folder), prompts=model.config.prompts)(examples)
    with torch.no_grad():
        return batch, model(**batch["queries"]), model(**batch["docs"])


def _real(x, mask) -> list[torch.Tensor]:
    """Each row's real tokens (mask 1): the libraries pad on different sides."""
    return [row[m.bool()] for row, m in zip(x, mask)]


def _same(a, a_mask, b, b_mask) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_real(a, a_mask), _real(b, b_mask)))


def _diff(a, a_mask, b, b_mask) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(_real(a, a_mask), _real(b, b_mask)))


def _colpali_row(folder: Path, ours) -> tuple[str, str, str, str]:
    from colpali_engine.models import ColQwen2, ColQwen2Processor

    batch, q, d = ours
    model = ColQwen2.from_pretrained(str(folder), torch_dtype=torch.float32).eval()
    proc = ColQwen2Processor.from_pretrained(str(folder))
    pages, queries = _inputs()
    bd, bq = proc.process_images(pages), proc.process_queries(queries)
    with torch.no_grad():
        cd, cq = model(**bd), model(**bq)
    same_ids = _same(bq["input_ids"], bq["attention_mask"], batch["queries"]["input_ids"], q.mask) and _same(
        bd["input_ids"], bd["attention_mask"], batch["docs"]["input_ids"], d.mask)
    return (type(model).__name__ + (" + peft" if hasattr(model, "peft_config") else ""), str(same_ids),
            f"{_diff(cq, bq['attention_mask'], q.embeddings, q.mask):.1e}",
            f"{_diff(cd, bd['attention_mask'], d.embeddings, d.mask):.1e}")


def _transformers_row(folder: Path, ours) -> tuple[str, str, str, str]:
    from transformers import ColQwen2ForRetrieval, ColQwen2Processor

    from raggedvl.models.interop import mrope_position_ids

    _, _, d = ours
    model = ColQwen2ForRetrieval.from_pretrained(str(folder), dtype=torch.float32).eval()
    proc = ColQwen2Processor.from_pretrained(str(folder))
    pages, _ = _inputs()
    bd = proc(images=pages, return_tensors="pt")
    with torch.no_grad():
        emb = model(**bd, position_ids=mrope_position_ids(model.vlm, bd)).embeddings
    same_ids = _same(bd["input_ids"], bd["attention_mask"], ours[0]["docs"]["input_ids"], d.mask)
    return ("ColQwen2ForRetrieval", f"{same_ids} (pages)", "-",
            f"{_diff(emb, bd['attention_mask'], d.embeddings, d.mask):.1e}")


def main(sources: list[str]) -> None:
    from raggedvl.app.export import export

    rows = []
    for source in sources or [str(FIXTURES / "colqwen2_full"), str(FIXTURES / "colqwen2_lora")]:
        ours = _raggedvl(source)
        with tempfile.TemporaryDirectory() as tmp:
            for fmt, merge in (("colpali", False), ("colpali", True), ("transformers", False)):
                out = Path(tmp) / f"{fmt}{'-merged' if merge else ''}"
                export(source, fmt, str(out), merge_lora=merge)
                row = _colpali_row(out, ours) if fmt == "colpali" else _transformers_row(out, ours)
                rows.append((Path(source).name, out.name, *row))
    print("\n| source | export | loaded as | same token ids | max abs query diff | max abs page diff |")
    print("|---|---|---|---|---:|---:|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
