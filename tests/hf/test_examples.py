"""The example scripts run end to end on CPU with the tiny model and the embedded R-manual data,
and the README section's code is the retrieval example's code."""

from __future__ import annotations

import importlib.util
import math
import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_retrieval_example_trains_and_evaluates(tmp_path):
    out = _load("train_retriever_hf").main([
        "--max-steps", "2", "--train-pairs", "8", "--eval-pairs", "4", "--batch-size", "2",
        "--logging-steps", "1", "--max-pixels", str(224 * 224), "--output-dir", str(tmp_path), "--streaming",
    ])
    assert len(out["losses"]) == 2 and all(math.isfinite(x) for x in out["losses"])
    assert out["before"]["queries"] == out["after"]["queries"] == 4
    assert out["before"]["documents"] == out["after"]["documents"] == 4
    assert out["before"]["doc_mean_cosine"] != out["after"]["doc_mean_cosine"]  # training moved the embeddings


def test_sft_example_trains_on_two_page_samples(tmp_path):
    out = _load("sft_hf").main([
        "--max-steps", "2", "--train-pairs", "8", "--batch-size", "2", "--logging-steps", "1",
        "--max-pixels", str(224 * 224), "--output-dir", str(tmp_path),
    ])
    assert len(out["losses"]) == 2 and all(math.isfinite(x) for x in out["losses"])
    assert out["losses"][0] > 0


def test_readme_section_code_is_the_tested_example():
    readme = (ROOT / "README.md").read_text().split("## With the HF Trainer", 1)[1]
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    body = code.split("from raggedvl.models import LoraSettings, build_retriever\n\n", 1)[1]
    example = (ROOT / "examples" / "train_retriever_hf.py").read_text()
    block = example.split("# --- README: hf-trainer ---\n", 1)[1].split("    # --- end README ---", 1)[0]
    assert body == textwrap.dedent(block)
    imports = "\n".join(line for line in code.splitlines() if line.startswith(("import ", "from ")))
    names: dict = {}
    exec(imports, names)  # the README's imports bind the same objects the example uses
    module = _load("train_retriever_hf")
    for name, value in names.items():
        if name != "__builtins__":
            assert getattr(module, name) is value, name
