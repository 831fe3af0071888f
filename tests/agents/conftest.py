"""One tiny tool-aware model (tests/server_helpers.build_model) for every agents test module."""
from __future__ import annotations

import pytest

from tests.server_helpers import build_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("agents-model"))
