"""The HTTP server around the OpenAI routes: the app and its routes (app.py), who may connect
and how long they may take (connections.py, security.py), the SIGTERM drain (shutdown.py),
the Prometheus metrics (metrics.py, engine_metrics.py), the WebSocket chat (websocket.py),
the live KV view (kv_view.py), the reserved-prefix admin routes (prefixes.py),
/openapi.json (openapi.py) and what a browser opens: the demo page and /docs (pages.py)."""
