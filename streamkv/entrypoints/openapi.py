"""``/openapi.json`` generated from the request models, and ``/docs``: a self-contained HTML
page rendered from that schema on the server (no script, nothing fetched from elsewhere)."""

from __future__ import annotations

import html
import json
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from streamkv import __version__
from streamkv.entrypoints.openai_requests import ChatCompletionRequest, CompletionRequest
from streamkv.entrypoints.tokenize_serving import DetokenizeRequest, TokenizeRequest

# (path, request model, summary); every one is a POST with a JSON body.
ENDPOINTS: tuple[tuple[str, type[BaseModel], str], ...] = (
    ("/v1/completions", CompletionRequest, "Text completion, whole or streamed (SSE)"),
    ("/v1/chat/completions", ChatCompletionRequest, "Chat completion through the model's chat template"),
    ("/tokenize", TokenizeRequest, "Token ids of a prompt or of rendered chat messages"),
    ("/detokenize", DetokenizeRequest, "Text of token ids"),
)
_ERROR = {"type": "object", "properties": {"error": {"type": "object", "properties": {
    name: {"type": ["string", "null"]} for name in ("message", "type", "param", "code")}}}}
_REF = "#/components/schemas/{model}"


def openapi_document(model_name: str) -> dict[str, Any]:
    _, schemas = models_json_schema([(m, "validation") for _, m, _ in ENDPOINTS], ref_template=_REF)
    paths = {}
    for path, model, summary in ENDPOINTS:
        paths[path] = {"post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": _REF.format(model=model.__name__)}}}},
            "responses": {
                "200": {"description": "the result (``text/event-stream`` with ``stream: true``)"},
                "4XX": {"description": "an OpenAI error; ``param`` names the field",
                        "content": {"application/json": {"schema": {"$ref": _REF.format(model="Error")}}}},
            },
        }}
    components = {**schemas.get("$defs", {}), "Error": _ERROR}
    return {
        "openapi": "3.1.0",
        "info": {"title": f"streamkv ({model_name})", "version": __version__,
                 "description": "OpenAI-compatible API. Unknown fields are ignored (and logged)."},
        "paths": paths,
        "components": {"schemas": components, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
    }


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
        default = "required" if field in required else json.dumps(prop["default"]) if "default" in prop else ""
        # The 64-bit bounds every integer has are the JSON's, not worth a line of the table.
        limits = ", ".join(f"{k} {prop[k]}" for k in ("minimum", "maximum") if k in prop and abs(prop[k]) < 2**62)
        rows.append(f"<tr><td><code>{html.escape(field)}</code></td><td>{html.escape(_type_of(prop))}</td>"
                    f"<td>{html.escape(default)}</td><td>{html.escape(prop.get('description', ''))}"
                    f"{' (' + html.escape(limits) + ')' if limits else ''}</td></tr>")
    doc = html.escape(schema.get("description", "").strip())
    return (f'<h3 id="{html.escape(name)}">{html.escape(name)}</h3><p>{doc}</p>'
            "<table><tr><th>field</th><th>type</th><th>default</th><th>notes</th></tr>" + "".join(rows) + "</table>")


_STYLE = ("body{font:15px/1.5 system-ui,sans-serif;max-width:70em;margin:2em auto;padding:0 1em}"
          "table{border-collapse:collapse;width:100%}td,th{border:1px solid #ccc;padding:.2em .5em;"
          "text-align:left;vertical-align:top}code{font-size:90%}")


def docs_page(document: dict[str, Any]) -> str:
    info = document["info"]
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(info['title'])}</title>"
             f"<style>{_STYLE}</style></head><body><h1>{html.escape(info['title'])}</h1>"
             f"<p>{html.escape(info['description'])} Version {html.escape(info['version'])}. "
             "The machine-readable schema: <a href='/openapi.json'>/openapi.json</a>.</p><h2>Endpoints</h2><ul>"]
    for path, ops in document["paths"].items():
        op = ops["post"]
        model = op["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
        parts.append(f"<li><code>POST {html.escape(path)}</code>: {html.escape(op['summary'])} "
                     f"(body: <a href='#{model}'>{model}</a>)</li>")
    parts.append("</ul><h2>Schemas</h2>")
    parts.extend(_table(name, schema) for name, schema in document["components"]["schemas"].items())
    parts.append("</body></html>")
    return "".join(parts)
