"""The README's TLS example as a user runs it, from a folder of their own: make the certificates with the example's
script, serve with mutual TLS, ask with curl and with tritonclient.grpc as the README writes them (on ports of the
test's own instead of 8000 and 8001)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import tritonclient.grpc as tg

from tests.live_server import free_port, wait_until
from tests.models import build_mlp, save_model

ROOT = Path(__file__).resolve().parent.parent.parent


def _readme_tls_lines() -> list[str]:
    """The lines of the README's TLS example (its bash block)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## TLS and mutual TLS") :]
    block = section[section.index("```bash\n") + len("```bash\n") : section.index("```\n", 8)]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def test_the_readme_tls_example_serves_curl_and_tritonclient_with_client_certificates(tmp_path: Path) -> None:
    make, serve, ask = _readme_tls_lines()
    save_model(build_mlp(1), tmp_path / "models" / "mlp" / "1", "model.keras")
    subprocess.run(["bash", "-c", f"{ROOT}/{make}"], cwd=tmp_path, check=True, timeout=60, capture_output=True)
    port, grpc_port = free_port(), free_port()
    words = shlex.split(serve)
    assert words[:2] == ["layerserve", "serve"]
    command = [sys.executable, "-m", "layerserve", *words[1:], "--port", str(port), "--grpc-port", str(grpc_port),
               "--engine-cache-dir", str(tmp_path / "cache")]  # fmt: skip
    with (tmp_path / "server.log").open("wb") as log:
        server = subprocess.Popen(command, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        curl = shlex.split(ask.replace("localhost:8000", f"localhost:{port}"))

        def ready() -> bool:
            assert server.poll() is None, (tmp_path / "server.log").read_text()
            probe = [*curl[:-1], "--fail", curl[-1] + "/health/ready"]
            return subprocess.run(probe, check=False, cwd=tmp_path, timeout=30, capture_output=True).returncode == 0

        wait_until(ready, "the server answers curl with the client's certificate", 240)
        answer = subprocess.run(curl, check=True, cwd=tmp_path, timeout=30, capture_output=True, text=True).stdout
        assert '"name":"layerserve"' in answer
        client_files = re.compile(r"--cert|--key|tls/client\.\w+")
        without = [word for word in curl if not client_files.fullmatch(word)]
        refused = subprocess.run(without, check=False, cwd=tmp_path, timeout=30, capture_output=True, text=True)
        assert refused.returncode != 0, refused.stdout  # no client certificate: refused at the handshake
        readme = (ROOT / "README.md").read_text(encoding="utf-8")
        assert 'ssl=True,\nroot_certificates="tls/ca.crt", private_key="tls/client.key", certificate_chain=' in readme
        client = tg.InferenceServerClient(
            f"localhost:{grpc_port}", ssl=True, root_certificates=str(tmp_path / "tls/ca.crt"),
            private_key=str(tmp_path / "tls/client.key"), certificate_chain=str(tmp_path / "tls/client.crt"),
        )  # fmt: skip
        with client:
            assert client.is_server_ready() and client.is_model_ready("mlp")
    finally:
        server.terminate()
        server.wait(timeout=60)
