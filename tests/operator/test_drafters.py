"""The operator's drafter names follow the server's registry (``multiguess.drafting.KINDS``).

The operator does not import the server package: its ``spec.Drafter`` literal, the sets behind
``needs_draft`` and the draft pods' environment, and the CRD's enum and rules (in ``crds/`` and
in the chart) are written out, and these tests fail when one of them differs from the registry.
"""

from __future__ import annotations

import re
import typing
from typing import Any

import pytest
import yaml
from multiguess.drafting import KINDS
from multiguess_operator import spec

from tests.operator.crd import ROOT

CRDS = [
    ROOT / "crds" / "speculativedeployment.yaml",
    ROOT / "charts" / "multiguess" / "crds" / "speculativedeployment.yaml",
]
NAMES = [kind.name for kind in KINDS]
READS_DRAFT = [kind.name for kind in KINDS if kind.reads_draft]


def schema(path: Any) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]


def test_the_spec_names_every_drafter() -> None:
    assert list(typing.get_args(spec.Drafter)) == NAMES
    assert list(spec.READS_DRAFT) == READS_DRAFT
    assert [n for n in NAMES if spec.SpeculationSpec(drafter=n).needs_draft] == READS_DRAFT  # type: ignore[arg-type]
    assert list(spec.DRAFT_SERVER_READS_TARGET) == [k.name for k in KINDS if k.server_reads_target]


@pytest.mark.parametrize("path", CRDS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_crd_names_every_drafter(path: Any) -> None:
    properties = schema(path)["properties"]["spec"]
    assert properties["properties"]["speculation"]["properties"]["drafter"]["enum"] == NAMES
    lists = [
        re.findall(r"'([a-z0-9]+)'", listed)
        for rule in properties["x-kubernetes-validations"]
        for listed in re.findall(r"drafter in \[([^\]]*)\]", rule["rule"])
    ]
    assert lists and all(names == READS_DRAFT for names in lists), lists
