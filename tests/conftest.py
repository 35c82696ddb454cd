"""Shared fixtures.

``require(tool)`` is how a test asks for an outside program (MRtrix3's ``dwidenoise``...): without it the
test skips, except in CI (``MPPCA_REQUIRE_PEERS=1``, set by ``.ci/run``), where a missing peer is a failure.
"""

from __future__ import annotations

import os
import shutil

import pytest


def require(tool: str) -> str:
    """The path of the executable ``tool``; skip the test without it (fail when MPPCA_REQUIRE_PEERS=1)."""
    path = shutil.which(tool)
    if path is None:
        message = f"{tool} is not on PATH"
        if os.environ.get("MPPCA_REQUIRE_PEERS") == "1":
            pytest.fail(f"{message}, and MPPCA_REQUIRE_PEERS=1 says the tests that need it must run")
        pytest.skip(message)
    return path


@pytest.fixture
def dwidenoise() -> str:
    """MRtrix3's dwidenoise executable."""
    return require("dwidenoise")

