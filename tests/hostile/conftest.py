"""The hostile-client suites' server: one `layerserve serve` process per module and transport (plaintext, TLS)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.hostile.harness import HostileServer
from tests.models import build_mlp, save_model
from tests.tls_files import make_authority

TRANSPORTS = ["plaintext", "tls"]


@pytest.fixture(scope="module", params=TRANSPORTS)
def hostile_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostileServer]:
    """A server over one small model (`mlp`), on a transport of `TRANSPORTS`, with the test module's
    `SERVER_FLAGS` (a tuple of CLI flags), if it has them."""
    root = tmp_path_factory.mktemp(f"hostile-{request.param}")
    repository = root / "repository"
    save_model(build_mlp(1), repository / "mlp" / "1", "model.keras")
    authority, flags = None, list(getattr(request.module, "SERVER_FLAGS", ()))
    if request.param == "tls":
        authority = make_authority(root / "ca")
        issued = authority.issue(root, "server")
        flags += ["--tls-cert-file", str(issued.cert), "--tls-key-file", str(issued.key)]
    server = HostileServer(repository, root / "cache", authority, flags)
    yield server
    server.stop()
