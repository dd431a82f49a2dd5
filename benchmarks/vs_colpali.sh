#!/usr/bin/env bash
# Side-by-side benchmark raggedvl vs colpali-engine (BENCHMARKS.md, "vs colpali-engine").
#
#   benchmarks/vs_colpali.sh [vs_colpali.py arguments]      e.g.  --workload all   |  --loss-curves
#
# colpali-engine needs torchvision, which does not install beside the CPU torch 2.13.0 that
# `make install` pins, so this builds its OWN virtual environment outside the repository and
# outside `make test`, then runs benchmarks/vs_colpali.py in it:
#   - torch==2.14.1 + torchvision==0.29.1 (matching pair; a CUDA build, several GB, minutes);
#   - raggedvl's dependencies at the versions of constraints.txt (torch line dropped), psutil;
#   - colpali-engine==0.3.18 with --no-deps (its metadata caps torch < 2.14 and peft < 0.21;
#     it runs with 2.14.1 and 0.21.2, the versions its own interop fixtures were made with),
#     then exactly those of its base requirements that are still missing;
#   - raggedvl itself, editable from this checkout, --no-deps.
# Idempotent: a stamp file records what was installed; re-running reuses the environment and
# only re-points the editable raggedvl when run from another checkout.
#
# Environment: RAGGEDVL_BENCH_VENV (default $HOME/.cache/raggedvl/bench-venv), PYTHON (python3).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RAGGEDVL_BENCH_VENV:-$HOME/.cache/raggedvl/bench-venv}"
PYTHON="${PYTHON:-python3}"
TORCH_PINS=(torch==2.14.1 torchvision==0.29.1)
COLPALI_PIN=colpali-engine==0.3.18
BIN="$VENV/bin"
STAMP="$VENV/.raggedvl-bench-stamp"

# What the environment must hold; a change in any of these rebuilds it.
spec="$(printf '%s\n' "${TORCH_PINS[@]}" "$COLPALI_PIN"; grep -v '^torch==' "$REPO/constraints.txt"; \
        sed -n '/^dependencies = \[/,/^\]/p' "$REPO/pyproject.toml")"

if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$spec" ]]; then
    start=$(date +%s)
    echo "vs_colpali.sh: building the benchmark venv in $VENV" >&2
    "$PYTHON" -m venv "$VENV"
    "$BIN/pip" install -q --upgrade pip
    # 1. torch + torchvision of matching versions (registry or local wheel index).
    "$BIN/pip" install -q "${TORCH_PINS[@]}"
    # 2. raggedvl's dependencies at the project's pinned versions (torch already there).
    constraints="$VENV/constraints-no-torch.txt"
    grep -v '^torch==' "$REPO/constraints.txt" > "$constraints"
    deps="$("$BIN/python" - "$REPO/pyproject.toml" <<'EOF'
import sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
print(" ".join(d for d in deps if not d.replace(" ", "").startswith("torch")))
EOF
)"
    # shellcheck disable=SC2086
    "$BIN/pip" install -q -c "$constraints" $deps psutil "${TORCH_PINS[@]}"
    # 3. colpali-engine without its (conflicting) caps, then its base requirements still missing.
    "$BIN/pip" install -q --no-deps "$COLPALI_PIN"
    missing="$("$BIN/python" - <<'EOF'
import importlib.metadata as md
import re
out = []
for req in md.requires("colpali-engine") or []:
    if "extra ==" in req:
        continue
    name = re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0]
    try:
        md.version(name)
    except md.PackageNotFoundError:
        out.append(name)
print(" ".join(out))
EOF
)"
    if [[ -n "$missing" ]]; then
        echo "vs_colpali.sh: colpali-engine requirements not yet present: $missing" >&2
        # shellcheck disable=SC2086
        "$BIN/pip" install -q -c "$constraints" $missing "${TORCH_PINS[@]}"
    fi
    printf '%s' "$spec" > "$STAMP"
    echo "vs_colpali.sh: venv ready in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1))" >&2
fi

# 4. raggedvl from THIS checkout (editable, no dependencies); re-pointed when run from another one.
want="$REPO/src/raggedvl/__init__.py"
have="$("$BIN/python" -c 'import raggedvl; print(raggedvl.__file__)' 2>/dev/null || true)"
if [[ "$have" != "$want" ]]; then
    "$BIN/pip" install -q --no-deps -e "$REPO"
fi

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$BIN/python" "$REPO/benchmarks/vs_colpali.py" "$@"
