"""The OpenAI-compatible API (and vLLM's routes beside it): the error shape, strict JSON and
the engine's errors (protocol.py), the request models (requests.py, chat_messages.py,
structured_request.py with lark_grammar.py), chat prompts and tool calls (chat_template.py,
chat_serving.py, tool_calls.py), the completions and chat handlers (serving.py) and vLLM's
extra routes, /tokenize included (vllm_routes.py). The SSE plumbing is ../streaming.py."""
