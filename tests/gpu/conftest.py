"""CUDA tests: marked ``cuda`` and skipped, saying why, where no GPU is visible. They need
pytest (and scipy, for sampling); ``make gpu-check`` (``bench/gpu_check.py``) folds their cases
in for a machine with only torch and transformers."""

from __future__ import annotations

import pytest
import torch

NO_GPU = "needs a CUDA GPU; none is visible here (torch.cuda.is_available() is False)"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/gpu/" in item.nodeid.replace("\\", "/"):
            item.add_marker(pytest.mark.cuda)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason=NO_GPU))
