"""The web console: its page at /console and its static files, served by the server itself (no CDN, no build
step); browsers asking for / are sent there. The page and its files hold no data: what it shows comes from the
API with the user's token, so they are public (see AuthMiddleware)."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from layerserve.errors import NotFoundError

CONSOLE_FOLDER = Path(__file__).parent / "console"
_NO_CACHE = {"Cache-Control": "no-cache"}  # revalidated: a new server version's page is picked up at once


async def root(request: Request) -> Response:
    """GET /: browsers are redirected to the console; other clients get a 404 naming the API's roots.

    Raises:
        NotFoundError: not a browser.
    """
    if "text/html" in request.headers.get("accept", ""):
        return RedirectResponse("/console", status_code=307)
    raise NotFoundError("no route GET /: the API is under /v2 (and /v1 for TF Serving); the console is /console")


async def console(request: Request) -> Response:
    """GET /console: the console's page."""
    return FileResponse(CONSOLE_FOLDER / "index.html", headers=_NO_CACHE)


routes = [
    Route("/", root, methods=["GET"]),
    Route("/console", console, methods=["GET"]),
    Mount("/console/static", StaticFiles(directory=CONSOLE_FOLDER), name="console-static"),
]
