"""The app's state: its attributes are found by the normal lookup (no failed lookup and AttributeError first), and
it stays a Starlette `State` by item and by attribute."""

from __future__ import annotations

import pytest

from layerserve.server import Server
from layerserve.settings import Settings
from layerserve.transports.http.app import AppState


def test_the_apps_state_is_found_by_the_normal_lookup(settings: Settings) -> None:
    state = Server(settings).app.state
    assert isinstance(state, AppState)
    assert object.__getattribute__(state, "services") is state.services  # Starlette's own State: AttributeError
    state.runtime = "runtime"
    assert object.__getattribute__(state, "runtime") == "runtime"
    assert state["runtime"] == "runtime" and state.runtime == "runtime"


def test_the_apps_state_set_and_deleted_by_item_or_attribute_stays_one() -> None:
    state = AppState()
    state["templates"] = 1
    assert state.templates == 1 and object.__getattribute__(state, "templates") == 1
    state.templates = 2
    assert state["templates"] == 2
    del state["templates"]
    with pytest.raises(AttributeError):
        _ = state.templates
    state.lane = 3
    del state.lane
    with pytest.raises(KeyError):
        _ = state["lane"]
