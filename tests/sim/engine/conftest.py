"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest

from tests.sim.engine.engine_fixtures import WINDOW_MODELS, small_window_model


@pytest.fixture(scope="module")
def window_models(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, str], str]:
    """gpt-oss-20b and gemma-3-12b with windows of 32 and 48 tokens, by (window, model)."""
    return {(w, base): small_window_model(tmp_path_factory, w, base) for w, base in WINDOW_MODELS}
