"""A Tornado app with its own handlers that serves a layerserve repository inside them.

    pip install layerserve tornado
    python examples/tornado_app.py MODELS [PORT]
    curl -s -X POST localhost:8888/predict/token_classifier -d '{"inputs": {"tokens": [[1, 2, 3, ...]]}}'

Tornado runs on asyncio, so the handlers await layerserve's data plane on Tornado's own event loop: no thread hop.
The models load once, before the server listens (a layerserve Server without doors of its own).
"""

from __future__ import annotations

import asyncio
import json
import sys

import tornado.web

from layerserve.dataplane import DataPlane
from layerserve.errors import LayerserveError
from layerserve.messages import InferRequest
from layerserve.server import Server
from layerserve.settings import Settings


class Predict(tornado.web.RequestHandler):
    """POST /predict/<model> {"inputs": {name: nested lists}, "outputs"?: [names]}."""

    def initialize(self, data: DataPlane) -> None:
        self.data = data

    async def post(self, model: str) -> None:
        body = json.loads(self.request.body)
        try:
            result = await self.data.infer(InferRequest(model, body["inputs"], body.get("outputs", ())))
        except LayerserveError as error:
            self.set_status(error.status_code)
            self.write({"error": error.message})
            return
        self.write({"version": result.version, "outputs": {k: v.tolist() for k, v in result.outputs.items()}})


async def main(repository: str, port: int) -> None:
    """Load the models, then serve until stopped."""
    server = Server(Settings(model_repository=repository, reload_interval_s=0), settle_first=True)
    await server.start()  # returns once every model has settled
    app = tornado.web.Application([(r"/predict/([A-Za-z0-9_.-]+)", Predict, {"data": server.data})])
    app.listen(port, address="127.0.0.1")
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8888))
