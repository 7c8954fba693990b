"""``GET /docs``: the API's Swagger UI page, its scripts served by the replica itself.

FastAPI's own ``/docs`` page loads Swagger UI's script and style sheet from a CDN, so it is
blank on a machine that cannot reach one. Here the page loads them from ``/docs/assets/``, out
of the ``swagger-ui-bundle-v2`` package (Swagger UI 5: FastAPI writes OpenAPI 3.1, which
Swagger UI 4 does not render); the OpenAPI document itself stays ``/openapi.json``.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, Response
from starlette.exceptions import HTTPException
from swagger_ui_bundle import swagger_ui_path

# the files of the Swagger UI distribution the page loads, and their media types
ASSETS = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css",
          "favicon-32x32.png": "image/png"}


def add_docs(app: FastAPI) -> None:
    """``GET /docs`` and its assets on ``app`` (built with ``docs_url=None``)."""

    async def docs(request: Request) -> HTMLResponse:
        # under a route prefix, Ray's proxy sets it as the root path: the page's links take it
        root = request.scope.get("root_path", "").rstrip("/")
        return get_swagger_ui_html(
            openapi_url=root + (app.openapi_url or "/openapi.json"), title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}/docs/assets/swagger-ui-bundle.js",
            swagger_css_url=f"{root}/docs/assets/swagger-ui.css",
            swagger_favicon_url=f"{root}/docs/assets/favicon-32x32.png")

    async def asset(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in ASSETS:
            raise HTTPException(404)  # the app's own 404: it lists the routes
        return FileResponse(str(swagger_ui_path / name), media_type=ASSETS[name],
                            headers={"Cache-Control": "public, max-age=86400"})
    app.add_route("/docs", docs, include_in_schema=False)
    app.add_route("/docs/assets/{name}", asset, include_in_schema=False)
