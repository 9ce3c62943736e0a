"""The engine's boundaries: nothing above the runner reaches a device family's backend directly,
and the engine never imports the loaders above it.

Device-specific code lives in ``engine/backends/<family>/``; the rest of the serving package
(and the benchmarks) reaches it only through the interface in ``engine/backends/__init__.py``
(``backend_for``, ``sampling_kernels``, ``cpu_has_fast_bf16``). Imports are read from the
source, those inside functions included, so a lazy import cannot slip past.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "server" / "multiguess"
BACKENDS = PACKAGE / "engine" / "backends"
FAMILIES = ("multiguess.engine.backends.cpu", "multiguess.engine.backends.cuda")


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, ``from`` imports' names included as submodules."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def family_imports(path: Path) -> list[str]:
    return sorted(m for m in imported_modules(path) if any(m == f or m.startswith(f + ".") for f in FAMILIES))


def above_the_runner() -> list[Path]:
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "bench").rglob("*.py")]
    return [f for f in files if BACKENDS not in f.parents]


def test_nothing_above_the_runner_imports_a_device_family() -> None:
    crossing = {str(f.relative_to(ROOT)): family_imports(f) for f in above_the_runner()}
    assert {f: m for f, m in crossing.items() if m} == {}


def test_the_engine_does_not_import_its_loaders() -> None:
    """``models/`` loads checkpoints into what the engine runs (``engine/loaded_model.py``,
    ``engine/quantized.py``): the engine sits below its loaders and never imports them."""
    engine = PACKAGE / "engine"
    loaders = {
        str(f.relative_to(ROOT)): sorted(m for m in imported_modules(f) if m.startswith("multiguess.models"))
        for f in engine.rglob("*.py")
    }
    assert {f: m for f, m in loaders.items() if m} == {}


def test_the_check_sees_lazy_and_from_imports(tmp_path: Path) -> None:
    """The reader itself: a function-level import and a ``from backends import cpu`` are found."""
    source = tmp_path / "probe.py"
    source.write_text(
        "def f():\n"
        "    from multiguess.engine.backends.cpu import bf16_kernel\n"
        "from multiguess.engine.backends import cuda\n"
        "import multiguess.engine.backends\n"
    )
    assert family_imports(source) == [
        "multiguess.engine.backends.cpu",
        "multiguess.engine.backends.cpu.bf16_kernel",
        "multiguess.engine.backends.cuda",
    ]
