"""The OpenAI-compatible API (and vLLM's routes beside it): the error shape and the engine's
errors (errors.py), strict JSON and validation (protocol.py), the request models (requests.py,
chat_request.py, chat_messages.py, structured_request.py with lark_grammar.py and
lark_regex.py), the completions handler and what both endpoints share (serving.py), the chat
handler (chat_serving.py, with chat_template.py and tool_calls.py), the SSE plumbing
(streaming.py), the logprobs shapes (logprobs.py) and vLLM's extra routes, /tokenize
included (vllm_routes.py)."""
