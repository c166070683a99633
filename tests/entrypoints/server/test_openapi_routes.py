"""/openapi.json lists every route the app serves (the list is taken from the app itself, so
a new route without an entry in entrypoints/server/openapi.py fails here), and /docs shows them."""

from __future__ import annotations

import pytest
from starlette.routing import Mount, Route, WebSocketRoute

from tests.entrypoints.fake_engine import make_client, wait_healthy


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    web = tmp_path_factory.mktemp("web")  # so that the /web mount is there too
    (web / "index.html").write_text("<!doctype html>")
    with make_client(web_dir=web) as c:
        wait_healthy(c)
        yield c


def served(app) -> set[tuple[str, str]]:
    """(method, path) of every HTTP route and the WebSocket's upgrade (a GET)."""
    out = set()
    for route in app.routes:
        if isinstance(route, Route):
            out |= {(m.lower(), route.path) for m in route.methods if m != "HEAD"}
        elif isinstance(route, WebSocketRoute):
            out.add(("get", route.path))
        elif isinstance(route, Mount):
            out.add(("get", route.path + "/{path}"))
        else:
            raise AssertionError(f"a route of a kind this test does not know: {route!r}")
    return out


def test_every_route_is_in_the_openapi_document(client):
    doc = client.get("/openapi.json").json()
    listed = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    routes = served(client.app)
    assert len(routes) >= 20 and ("get", "/web/{path}") in routes
    assert routes - listed == set(), "routes without an entry in entrypoints/server/openapi.py"
    assert listed - routes == set(), (
        "entries in entrypoints/server/openapi.py for routes the app lacks"
    )
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert op["summary"] and "\n" not in op["summary"], (method, path)


def test_request_bodies_are_the_request_models(client):
    doc = client.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]

    def body(method: str, path: str) -> str:
        ref = doc["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"][
            "$ref"
        ]
        assert ref.rsplit("/", 1)[-1] in schemas
        return ref.rsplit("/", 1)[-1]

    assert body("post", "/v1/chat/completions") == "ChatCompletionRequest"
    assert body("post", "/v1/completions") == "CompletionRequest"
    assert (
        body("post", "/tokenize") == "TokenizeRequest"
        and body("post", "/detokenize") == "DetokenizeRequest"
    )
    # The batch body is the chat request's schema with messages a list of conversations.
    batch = schemas[body("post", "/v1/chat/completions/batch")]
    chat = schemas["ChatCompletionRequest"]
    assert batch["properties"]["messages"]["items"] == chat["properties"]["messages"]
    assert set(batch["properties"]) == set(chat["properties"])
    assert {"$ref": "#/components/schemas/ChatCompletionRequest"} in schemas[
        body("post", "/invocations")
    ]["oneOf"]
    assert "prompt" in schemas[body("post", "/v1/prefixes")]["properties"]
    # Open routes say so; the others answer an OpenAI error without the key.
    assert doc["paths"]["/health"]["get"]["security"] == []
    assert "security" not in doc["paths"]["/v1/models"]["get"]
    assert (
        doc["paths"]["/v1/prefixes/{prefix_id}"]["delete"]["parameters"][0]["name"] == "prefix_id"
    )
    assert "request_id" in doc["paths"]["/v1/chat/ws"]["get"]["description"]


def test_docs_page_lists_every_route(client):
    r = client.get("/docs")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    for method, path in served(client.app):
        assert f"<code>{method.upper()} {path}</code>" in r.text, (method, path)
    assert "<script" not in r.text and "https://" not in r.text
