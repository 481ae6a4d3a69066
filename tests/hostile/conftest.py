"""The hostile-client suites' server: one `layerserve serve` process per module and transport (plaintext, TLS)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.hostile.harness import HostileServer
from tests.models import build_mlp, save_model

TRANSPORTS = ["plaintext"]  # "tls" joins once the doors speak TLS


@pytest.fixture(scope="module", params=TRANSPORTS)
def hostile_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostileServer]:
    """A server over one small model (`mlp`), on a transport of `TRANSPORTS`."""
    root = tmp_path_factory.mktemp(f"hostile-{request.param}")
    repository = root / "repository"
    save_model(build_mlp(1), repository / "mlp" / "1", "model.keras")
    flags = getattr(request.module, "SERVER_FLAGS", ())  # a suite's own settings (shorter timeouts, say)
    server = HostileServer(repository, root / "cache", None, [], flags)
    yield server
    server.stop()
