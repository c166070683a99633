"""A model-free stand-in for LLMEngine with the same surface the AsyncEngine uses: each step
appends one character per running request. Lets the async layer and the HTTP app be tested
in milliseconds, including failure modes a real model cannot be made to produce on demand.
``make_client`` serves the app over one; the openai/ and server/ tests share it."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from starlette.testclient import TestClient

from streamkv.core.admission import EngineLimits
from streamkv.engine.async_engine import AsyncEngine
from streamkv.entrypoints.server.app import ServerConfig, build_app
from streamkv.entrypoints.server.security import HostPolicy
from streamkv.sampling_params import SamplingParams
from streamkv.sequence import CompletionOutput, Logprob, RequestOutput

CRASH_TOKEN = 666  # a prompt holding this token id makes step() raise


class FakeTokenizer:
    all_special_ids: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 1000 for c in text]

    def decode(self, ids, skip_special_tokens: bool = False, **_) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(
        self,
        messages,
        tokenize=False,
        add_generation_prompt=True,
        continue_final_message=False,
        **variables,
    ) -> str:
        """Extra template variables show as ``{name=value}`` up front; without a generation
        prompt the conversation closes with ``</>``, unless its last turn is continued."""
        if any(m["role"] == "assistant" for m in messages[:1]):
            raise ValueError("conversation must start with a user or system message")
        head = "".join(f"{{{k}={v}}}" for k, v in variables.items())
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        if continue_final_message:
            return head + text
        return head + text + ("<assistant>" if add_generation_prompt else "</>")


class FakeEngine:
    def __init__(
        self,
        step_delay: float = 0.002,
        num_blocks: int = 64,
        max_model_len: int = 256,
        script: str | None = None,
    ) -> None:
        self.step_delay = step_delay
        # With a script, every sample writes its text (one character a step), then stops:
        # a model output on demand (a tool call, say).
        self.script = script
        self.tokenizer = FakeTokenizer()
        self.executor = SimpleNamespace(hf_config={"vocab_size": 1000}, check_workers=lambda: None)
        self.config = SimpleNamespace(
            scheduler=SimpleNamespace(max_num_seqs=8),
            cache=SimpleNamespace(enable_prefix_caching=False),
        )
        self.block_manager = SimpleNamespace(
            block_size=16,
            watermark_blocks=0,
            device=SimpleNamespace(num_blocks=num_blocks),
            cpu=SimpleNamespace(num_blocks=0),
        )
        self.limits = EngineLimits(
            max_model_len=max_model_len,
            vocab_size=1000,
            block_size=16,
            num_kv_blocks=num_blocks,
            num_swap_blocks=0,
            usable_kv_blocks=num_blocks,
            max_num_seqs=8,
            prefix_caching=False,
        )
        self.scheduler = SimpleNamespace(waiting=())
        self.requests: dict[str, dict] = {}
        self.aborted: list[str] = []
        self.steps = 0
        self.thread_ids: set[int] = set()

    def add_request(
        self, request_id, prompt, params: SamplingParams, prompt_token_ids=None, arrival_time=None
    ):
        self.thread_ids.add(threading.get_ident())
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.requests[request_id] = {
            "ids": prompt_token_ids,
            "params": params,
            "out": [[] for _ in range(params.n)],
        }

    def abort_request(self, request_id):
        self.thread_ids.add(threading.get_ident())
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def num_waiting(self) -> int:
        return 0

    def info(self) -> EngineLimits:
        return self.limits

    def defer_until_compiled(self, params: SamplingParams, resume) -> bool:
        return False  # no grammars here

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self, unread=(), emit=None) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        time.sleep(self.step_delay)
        self.steps += 1
        outputs = []
        for rid, r in list(self.requests.items()):
            if CRASH_TOKEN in r["ids"]:
                raise RuntimeError("simulated device failure")
            p: SamplingParams = r["params"]
            for sample in r["out"]:
                if self.script is None:
                    sample.append(97 + (len(sample) + len(r["ids"])) % 26)
                elif len(sample) < len(self.script):
                    sample.append(ord(self.script[len(sample)]))
            stopped = self.script is not None and len(r["out"][0]) >= len(self.script)
            done = stopped or len(r["out"][0]) >= (p.max_tokens or 8)
            outs = [
                CompletionOutput(
                    index=i,
                    text="".join(chr(t) for t in toks),
                    token_ids=list(toks),
                    cumulative_logprob=-1.0,
                    logprobs=[{t: Logprob(-0.5, 1), 98: Logprob(-1.5, 2)} for t in toks]
                    if p.logprobs is not None
                    else None,
                    finish_reason=("stop" if stopped else "length") if done else None,
                )
                for i, toks in enumerate(r["out"])
            ]
            outputs.append(
                RequestOutput(
                    rid,
                    None,
                    r["ids"],
                    outs,
                    finished=done,
                    prompt_logprobs=fake_prompt_logprobs(r["ids"])
                    if p.prompt_logprobs is not None
                    else None,
                )
            )
            if done:
                del self.requests[rid]
        return outputs

    def stats(self) -> dict:
        return {
            "num_running": len(self.requests),
            "num_waiting": 0,
            "num_swapped": 0,
            "num_kv_blocks": 64,
            "num_free_kv_blocks": 64 - len(self.requests),
            "num_swap_blocks": 0,
            "num_free_swap_blocks": 0,
            "num_preemptions": 0,
            "num_prompt_tokens": 0,
            "num_generation_tokens": self.steps,
        }

    def shutdown(self) -> None:
        pass


def fake_prompt_logprobs(ids: list[int]) -> list:
    """Prompt token i scores -i/100 (rank 1), beside token 999 at -5; the first scores nothing."""
    return [None] + [
        {t: Logprob(-i / 100, 1), 999: Logprob(-5.0, 2)} for i, t in enumerate(ids) if i > 0
    ]


def make_client(fake: FakeEngine | None = None, build=None, **config) -> TestClient:
    fake = fake or FakeEngine()
    engine = AsyncEngine(build or (lambda: fake))
    app = build_app(
        engine, ServerConfig(model_name="fake", hosts=HostPolicy.build("testserver"), **config)
    )
    return TestClient(app)


def wait_healthy(client: TestClient) -> None:
    for _ in range(200):
        if client.get("/health").status_code == 200:
            return
        time.sleep(0.01)
    raise AssertionError("never became healthy")


def sse_events(text: str) -> tuple[list, list[str]]:
    """The ``data:`` payloads and the ``:`` comments (keep-alives) of an SSE body."""
    events, comments = [], []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: "):
                events.append(line[6:])
            elif line.startswith(":"):
                comments.append(line)
    return events, comments
