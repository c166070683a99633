"""What a browser opens: the demo page (``/`` and its files under ``/web``), and the API's
description, ``/openapi.json`` and ``/docs``. The docs page is rendered on the server from
the OpenAPI document, self-contained (inline style, no script, nothing fetched from
elsewhere), so that its content-security policy allows nothing else.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from streamkv.entrypoints.openai.errors import APIError
from streamkv.entrypoints.server.openapi import openapi_document


def find_web_dir() -> Path | None:
    """The demo page's folder: shipped in the package as ``streamkv/web`` (pyproject.toml,
    setup.py), or the repository's ``web/`` when running from a checkout."""
    for folder in (
        Path(__file__).resolve().parents[2] / "web",
        Path(__file__).resolve().parents[3] / "web",
    ):
        if (folder / "index.html").is_file():
            return folder
    return None


WEB_DIR = find_web_dir()
_PAGE_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; connect-src 'self' ws: wss:; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
}
_DOCS_HEADERS = {
    "content-security-policy": "default-src 'none'; style-src 'unsafe-inline'",
    "x-content-type-options": "nosniff",
}


def page_routes(model_name: str, web_dir: Path | None) -> list[BaseRoute]:
    document = openapi_document(model_name)  # built once: the models do not change

    async def openapi(request: Request) -> Response:
        # Behind a proxy that routes a path prefix here (--root-path), clients call the API
        # under that prefix (FastAPI says so the same way).
        root = request.scope.get("root_path", "")
        return JSONResponse({**document, "servers": [{"url": root}]} if root else document)

    async def docs(request: Request) -> Response:
        return HTMLResponse(docs_page(document), headers=_DOCS_HEADERS)

    async def index(request: Request) -> Response:
        page = web_dir / "index.html" if web_dir else None
        if page is None or not page.exists():
            e = APIError("the demo page is not installed", 404, "not_found_error")
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
        return FileResponse(page, headers=_PAGE_HEADERS)

    routes: list[BaseRoute] = [
        Route("/", index),
        Route("/openapi.json", openapi),
        Route("/docs", docs),
    ]
    if web_dir is not None and web_dir.is_dir():
        routes.append(Mount("/web", StaticFiles(directory=web_dir), name="web"))
    return routes


def _type_of(prop: dict[str, Any]) -> str:
    if "$ref" in prop:
        return prop["$ref"].rsplit("/", 1)[-1]
    if "anyOf" in prop or "oneOf" in prop:
        kinds = [_type_of(p) for p in prop.get("anyOf", prop.get("oneOf", []))]
        return " | ".join(k for k in kinds if k != "null") or "any"
    kind = prop.get("type")
    if kind == "array":
        return f"array of {_type_of(prop.get('items', {}))}"
    if "enum" in prop or "const" in prop:
        return " | ".join(json.dumps(v) for v in prop.get("enum", [prop.get("const")]))
    return kind if isinstance(kind, str) else "any"


def _table(name: str, schema: dict[str, Any]) -> str:
    required = set(schema.get("required", ()))
    rows = []
    for field, prop in schema.get("properties", {}).items():
        default = (
            "required"
            if field in required
            else json.dumps(prop["default"])
            if "default" in prop
            else ""
        )
        # The 64-bit bounds every integer has are the JSON's, not worth a line of the table.
        limits = ", ".join(
            f"{k} {prop[k]}" for k in ("minimum", "maximum") if k in prop and abs(prop[k]) < 2**62
        )
        rows.append(
            f"<tr><td><code>{html.escape(field)}</code></td><td>{html.escape(_type_of(prop))}</td>"
            f"<td>{html.escape(default)}</td><td>{html.escape(prop.get('description', ''))}"
            f"{' (' + html.escape(limits) + ')' if limits else ''}</td></tr>"
        )
    doc = html.escape(schema.get("description", "").strip())
    return (
        f'<h3 id="{html.escape(name)}">{html.escape(name)}</h3><p>{doc}</p>'
        "<table><tr><th>field</th><th>type</th><th>default</th><th>notes</th></tr>"
        + "".join(rows)
        + "</table>"
    )


_STYLE = (
    "body{font:15px/1.5 system-ui,sans-serif;max-width:70em;margin:2em auto;padding:0 1em}"
    "table{border-collapse:collapse;width:100%}td,th{border:1px solid #ccc;padding:.2em .5em;"
    "text-align:left;vertical-align:top}code{font-size:90%}"
)


def docs_page(document: dict[str, Any]) -> str:
    info = document["info"]
    parts = [
        "<!doctype html><html><head><meta "
        f"charset='utf-8'><title>{html.escape(info['title'])}</title>"
        f"<style>{_STYLE}</style></head><body><h1>{html.escape(info['title'])}</h1>"
        f"<p>{html.escape(info['description'])} Version {html.escape(info['version'])}. "
        "The machine-readable schema: <a "
        "href='/openapi.json'>/openapi.json</a>.</p><h2>Endpoints</h2><ul>"
    ]
    for path, ops in document["paths"].items():
        for method, op in ops.items():
            parts.append(
                f"<li><code>{method.upper()} {html.escape(path)}</code>: "
                f"{html.escape(op['summary'])}"
                f"{_body_link(op)}{'' if op.get('security') == [] else ' (API key)'}"
                f"{'<br>' + html.escape(op['description']) if 'description' in op else ''}</li>"
            )
    parts.append("</ul><h2>Schemas</h2>")
    parts.extend(_table(name, schema) for name, schema in document["components"]["schemas"].items())
    parts.append("</body></html>")
    return "".join(parts)


def _body_link(op: dict[str, Any]) -> str:
    if "requestBody" not in op:
        return ""
    model = op["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
    return f" (body: <a href='#{model}'>{model}</a>)"
