"""What TLS costs, in one run: the demo token classifier and EfficientNet-Lite0, V2 infer of one row per request
over REST binary and gRPC, each step on a plaintext server and then on the same repository served over TLS
(`examples/tls/make-certificates.sh`'s certificates), so that a change of load hits both.

    .venv/bin/python benchmarks/tls_cost.py [--duration-s 10] [--concurrency 1 8 32] [--json PATH]

Each step is `layerserve bench URL --model M --workload tensor --no-cache --concurrency C` (with `--protocol grpc
--grpc-port P` for gRPC) against `layerserve serve REPO` (one worker), and over TLS the same with an https URL
(`--tls-ca-file ca.crt`) against `layerserve serve REPO --tls-cert-file server.crt --tls-key-file server.key`. The
load generator's connections are kept alive, so this is the cost of encrypting requests and answers, not of
handshakes. The two servers run side by side; the one not measured is idle.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from demo_server import demo_server
from layerserve.bench.generator import BenchOptions, run_bench
from results import arguments, load_parser, table, write_result
from soak_server import free_port

MODELS = ("token_classifier", "efficientnet_lite0")
PROTOCOLS = {"http": "REST binary", "grpc": "gRPC"}
MAKE_CERTIFICATES = Path(__file__).resolve().parent.parent / "examples" / "tls" / "make-certificates.sh"


def render(result: dict[str, Any]) -> str:
    """Each model, door and concurrency: req/s and p50 in plaintext and over TLS, and their ratio."""
    header = ["model", "door", "concurrency", "plaintext req/s", "TLS req/s", "TLS / plaintext", "plaintext p50 ms",
              "TLS p50 ms", "plaintext server CPU %", "TLS server CPU %"]  # fmt: skip
    rows = []
    for row in result["rows"]:
        plain, tls = row["plaintext"], row["tls"]
        rows.append([
            row["model"], PROTOCOLS[row["protocol"]], plain["concurrency"], plain["req_s"], tls["req_s"],
            tls["req_s"] / plain["req_s"], plain["p50_ms"], tls["p50_ms"], plain["server_cpu_percent"],
            tls["server_cpu_percent"],
        ])  # fmt: skip
    return table(header, rows)


def main() -> None:
    """Alternate plaintext and TLS per model, door and concurrency; print the table (and write JSON with `--json`)."""
    args = load_parser(__doc__, 8782, [1, 8, 32]).parse_args()
    certificates = Path(tempfile.mkdtemp(prefix="layerserve-tls-"))
    subprocess.run(["bash", str(MAKE_CERTIFICATES), str(certificates)], check=True, stdout=subprocess.DEVNULL)
    os.environ["SSL_CERT_FILE"] = str(certificates / "ca.crt")  # what the load generator (and its processes) trust
    cert, key = certificates / "server.crt", certificates / "server.key"
    tls_flags = ["--tls-cert-file", str(cert), "--tls-key-file", str(key)]
    plain_grpc, tls_grpc, tls_port = free_port(), free_port(), free_port()
    rows = []
    with demo_server(args.port, None, "--grpc-port", str(plain_grpc)) as (plain_url, repository):
        cache = ["--engine-cache-dir", str(repository.parent / "cache")]  # the plaintext server's exports
        with demo_server(tls_port, repository, "--grpc-port", str(tls_grpc), *cache, *tls_flags) as (tls_url, _):
            for model in MODELS:
                for protocol in PROTOCOLS:
                    for concurrency in args.concurrency:
                        steps = {}
                        for transport, url, grpc_port in (("plaintext", plain_url, plain_grpc),
                                                          ("tls", tls_url, tls_grpc)):  # fmt: skip
                            options = BenchOptions(
                                url, model, "tensor", [concurrency], args.duration_s, use_cache=False,
                                protocol=protocol, grpc_port=grpc_port,
                            )  # fmt: skip
                            steps[transport] = run_bench(options)["steps"][0]
                        rows.append({"model": model, "protocol": protocol, **steps})
    result = {"parameters": arguments(args), "models": list(MODELS), "rows": rows}
    print(render(result))
    if args.json:
        write_result(args.json, result)


if __name__ == "__main__":
    main()
