"""pyproject.toml builds without setuptools deprecation warnings."""

import tomllib
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_applies_without_any_setuptools_warning():
    setuptools = pytest.importorskip("setuptools", minversion="77")  # what [build-system] requires
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert any(req.replace(" ", "").startswith("setuptools>=77") for req in pyproject["build-system"]["requires"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), str(ROOT / "pyproject.toml"))
    assert [str(w.message) for w in caught] == [], setuptools.__version__
    assert dist.metadata.license_expression == "Apache-2.0"
