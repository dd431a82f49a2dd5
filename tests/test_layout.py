"""docs/DESIGN.md section 6 says where every module lives and which package may import which:
both claims are checked against the tree, so the document cannot drift from the code."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "raggedvl"


def _section6_blocks() -> list[list[str]]:
    text = (ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    section = text[text.index("## 6.") : text.index("## 7.")]
    return [block.splitlines() for block in re.findall(r"```\n(.*?)```", section, flags=re.S)]


def _documented_modules() -> set[str]:
    """Paths relative to src/raggedvl listed in the layout block (packages end with '/')."""
    listed, package = set(), ""
    inside = False
    for line in _section6_blocks()[0]:
        if not line.startswith(" "):
            inside = line.split()[0] == "src/raggedvl/"
            continue
        if not inside:
            continue
        name = line.split()[0]
        if line.startswith("    "):
            listed.add(package + name)
        else:
            package = name if name.endswith("/") else ""
            listed.add(name)
    return listed


def _tree_modules() -> set[str]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        if "/" in rel and path.name == "__init__.py":
            found.add(rel[: -len("__init__.py")])  # the package itself
        else:
            found.add(rel)
    return found


def test_design_layout_lists_every_module_and_no_other():
    documented, actual = _documented_modules(), _tree_modules()
    assert not actual - documented, f"modules missing from docs/DESIGN.md section 6: {sorted(actual - documented)}"
    assert not documented - actual, f"docs/DESIGN.md section 6 lists modules that do not exist: {sorted(documented - actual)}"


def _imports(path: Path) -> list[str]:
    """Absolute names of every raggedvl / torch.distributed import in ``path`` (any depth)."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)  # ends in the module (or __init__)
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = parts[: len(parts) - node.level] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.append(module)
            names += [f"{module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return names


def _package_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def test_imports_between_packages_follow_the_documented_direction():
    allowed = {}
    for line in _section6_blocks()[1]:
        package, deps = re.split(r"\s{2,}", line.strip(), maxsplit=1)
        allowed[package] = set() if deps.strip() == "-" else {d.strip() for d in deps.split(",")}
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        source = _package_of(path)
        if source == "__init__":
            continue
        assert source in allowed, f"package {source!r} has no imports line in docs/DESIGN.md section 6"
        for name in _imports(path):
            bits = name.split(".")
            if bits[0] != "raggedvl" or len(bits) < 2 or bits[1] in (source, "__version__"):
                continue
            target = bits[1]
            if (PACKAGE / target).is_dir() or (PACKAGE / f"{target}.py").exists():
                if target not in allowed[source]:
                    wrong.append(f"{path.relative_to(ROOT)} imports raggedvl.{target}")
    assert not wrong, "imports against the direction in docs/DESIGN.md section 6:\n" + "\n".join(sorted(set(wrong)))


LAUNCHER = ("torch.distributed.run", "torch.distributed.elastic")  # torchrun itself, for the application's agent


def test_only_parallel_imports_torch_distributed():
    """Collectives and process groups live in raggedvl.parallel; the application may start
    torchrun (its launcher modules) but talks to the process group only through parallel."""
    offenders = [
        str(path.relative_to(ROOT))
        for path in PACKAGE.rglob("*.py")
        if _package_of(path) != "parallel"
        and any(n.startswith("torch.distributed") and not (_package_of(path) == "app" and n.startswith(LAUNCHER))
                for n in _imports(path))
    ]
    assert not offenders, f"torch.distributed imported outside raggedvl.parallel: {offenders}"


def test_no_library_package_imports_the_application():
    offenders = sorted({
        str(path.relative_to(ROOT)) for path in PACKAGE.rglob("*.py")
        if _package_of(path) not in ("app", "__main__") and any(n.split(".")[:2] == ["raggedvl", "app"] for n in _imports(path))
    })
    assert not offenders, f"library modules importing raggedvl.app: {offenders}"


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def test_no_import_loop_between_modules():
    """No module imports (at any depth, function-local included) a module that imports it back,
    directly or through others. Package ``__init__`` re-exports are not edges: a loop has to
    run through the modules that hold the code."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    graph = {}
    for module, path in paths.items():
        targets = set()
        for name in _imports(path):
            while name and name not in paths:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for nxt in sorted(graph[module]):
            if state.get(nxt) == 1:
                loop = trail[trail.index(nxt):] + [module, nxt] if nxt in trail else [module, nxt]
                raise AssertionError("import loop: " + " -> ".join(loop))
            if nxt not in state:
                visit(nxt, trail + [module])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
