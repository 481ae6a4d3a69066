"""A Flask app with its own routes that serves a layerserve repository inside them.

    pip install layerserve flask
    python examples/flask_app.py MODELS [PORT]
    curl -s -X POST localhost:5000/predict/token_classifier -H 'Content-Type: application/json' \
        -d '{"inputs": {"tokens": [[1, 2, 3, ...]]}}'

The models load once, when the app is made (in each process of a pre-fork server: make the app after the
fork, e.g. with gunicorn's default, no --preload). Concurrent views share one runtime, whose batcher merges
their requests into one model call.
"""

from __future__ import annotations

import sys
from typing import Any

from flask import Flask, request

from layerserve.blocking import BlockingRuntime
from layerserve.errors import LayerserveError
from layerserve.messages import ClassifyRequest, InferRequest
from layerserve.settings import Settings


def create_app(repository: str) -> Flask:
    """The Flask app over the models of `repository`."""
    runtime = BlockingRuntime(Settings(model_repository=repository, reload_interval_s=0))
    app = Flask(__name__)

    @app.post("/predict/<model>")
    def predict(model: str) -> dict[str, Any]:
        body = request.get_json(force=True)
        result = runtime.infer(InferRequest(model, body["inputs"], body.get("outputs", ())))
        return {"version": result.version, "outputs": {k: v.tolist() for k, v in result.outputs.items()}}

    @app.post("/classify/<model>")
    def classify(model: str) -> dict[str, Any]:
        items = [f.read() for f in request.files.getlist("image")] or request.get_json(force=True)["texts"]
        return {"predictions": runtime.classify(ClassifyRequest(model, items, top_k=3)).predictions}

    @app.errorhandler(LayerserveError)
    def refuse(error: LayerserveError) -> tuple[dict[str, str], int]:
        return {"error": error.message}, error.status_code

    return app


if __name__ == "__main__":
    port = int(sys.argv[2]) if len(sys.argv) > 2 else 5000
    create_app(sys.argv[1]).run(host="127.0.0.1", port=port, threaded=True)
