"""examples/quickstart.py runs, and the README's "Using the library" code is its marked block."""

import importlib.util
import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_runs_and_readme_shows_its_code():
    spec = importlib.util.spec_from_file_location("quickstart", ROOT / "examples" / "quickstart.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = module.main()
    assert out["image_counts"] == [2, 0, 1]
    assert out["split"] == [1, 2] and out["picked_counts"] == [1, 2]
    assert sorted(out["shard_samples"]) == [1, 2] and out["loss"] > 0

    source = (ROOT / "examples" / "quickstart.py").read_text()
    block = textwrap.dedent(source.split("    # --- README: quickstart ---\n", 1)[1].split("    # --- end README ---", 1)[0])
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Using the library", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert code == block
