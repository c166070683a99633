"""Per-request decoding parameters, with vLLM's field names."""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, field

from streamkv import sampling_limits as limits


class InvalidParameter(ValueError):
    """A request refused because of one parameter (``param``); ``code`` is the OpenAI error
    code the server reports, when there is one. Raised by the parameters' own checks and by
    the engine's admission (core/admission.py)."""

    def __init__(self, param: str, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code

    def __reduce__(self):  # copy and pickle: Exception's own rebuilds it from the message alone
        return type(self), (self.param, str(self), self.code)


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(slots=True)
class StructuredOutputs:
    """A constraint on the output (vLLM's ``structured_outputs``): exactly one of a JSON
    schema (a dict or its JSON text), any JSON object, a regular expression, one of several
    strings, or an EBNF grammar (GBNF, as the grammar engine reads it). The engine compiles
    it when the request arrives (engine/structured.py): a schema or pattern the grammar
    engine refuses is an InvalidParameter naming ``structured_outputs``."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        def bad(why: str) -> InvalidParameter:
            return InvalidParameter("structured_outputs", f"structured_outputs {why}.")

        set_ = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise bad(
                f"must set exactly one of {', '.join(STRUCTURED_KINDS)}, got {set_ or 'none'}"
            )
        if isinstance(self.json, str):
            try:
                schema = _json.loads(self.json)
            except ValueError as e:
                raise bad(f"json is not valid JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise bad("json must be a JSON schema (an object)")
        elif self.json is not None and not isinstance(self.json, dict):
            raise bad(
                "json must be a JSON schema (a dict or its "
                f"JSON text), got {type(self.json).__name__}"
            )
        if not isinstance(self.json_object, bool):
            raise bad("json_object must be true or false")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise bad(f"{name} must be a non-empty string")
        if self.choice is not None:
            if not isinstance(self.choice, list | tuple) or not self.choice:
                raise bad("choice must be a non-empty list of strings")
            if any(not isinstance(c, str) or not c for c in self.choice):
                raise bad("choice must hold non-empty strings")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """A hashable form, the compile cache's key; also the text the grammar engine
        compiles. A schema's key order is kept: it is the order of the output's fields."""
        kind = self.kind
        if kind == "json":
            schema = _json.loads(self.json) if isinstance(self.json, str) else self.json
            return kind, _json.dumps(schema, separators=(",", ":"))
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, _json.dumps(self.choice)
        return kind, getattr(self, kind)


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # OpenAI's logit_bias: token id -> a number in [-100, 100] added to its logit before
    # sampling (and before the returned logprobs, like the penalties). -100 in effect bans a
    # token and +100 forces it.
    logit_bias: dict[int, float] | None = None
    # A grammar the output must follow (engine/structured.py); None: unconstrained. A dict of
    # StructuredOutputs' fields is accepted too.
    structured_outputs: StructuredOutputs | None = None
    # Per prompt token, its logprob and the top ``prompt_logprobs`` (0: its own only),
    # computed in the prefill pass (RequestOutput.prompt_logprobs). Capped, like logprobs,
    # by the engine's max_logprobs.
    prompt_logprobs: int | None = None
    # vLLM's allowed_token_ids: only these tokens may be sampled (every other one's logit is
    # -inf, whatever the penalties and logit_bias; so are its logprobs); None: any token. Out
    # of the repr (the request log): up to 65,536 ids.
    allowed_token_ids: list[int] | None = field(default=None, repr=False)
    # vLLM's cache_salt: the request's prefix-cache blocks are shared only with requests of
    # the same salt (core/block_pool.root_key), so one tenant cannot probe another's prompts
    # through the cache. Not a sampling field, but carried here so that every path to the
    # engine (LLM.generate, the server, a resumed request) keeps it. A tenant's secret: out of
    # the repr (the request log).
    cache_salt: str | None = field(default=None, repr=False)
    # Set by engine/recovery.py, never by a client: the prompt's last this-many tokens are the
    # outputs of the run this request resumes after a worker restart. Seeded draws, min_tokens
    # and penalties count outputs from before them, so the request goes on as it would have.
    resumed_output_tokens: int = 0
    # Set by engine/recovery.py, never by a client: a sample of a request of several (n > 1,
    # best_of) resumed on its own keeps its index, which keys its seeded random stream.
    resumed_sample_index: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputs(**self.structured_outputs)
            except TypeError as e:
                raise InvalidParameter("structured_outputs", f"structured_outputs: {e}.") from None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias) if self.logit_bias else None
        if isinstance(self.allowed_token_ids, list | tuple):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.best_of is None:
            self.best_of = self.n
        if self.top_k == 0 and type(self.top_k) is int:
            self.top_k = -1  # vLLM's rule: 0 and -1 both mean every token
        self.verify()

    def verify(self) -> None:
        def bad(name: str, why: str) -> InvalidParameter:
            got = repr(getattr(self, name))  # a hostile value may be megabytes long
            return InvalidParameter(
                name, f"{name} {why}, got {got if len(got) <= 80 else got[:77] + '...'}."
            )

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not isinstance(self.best_of, int) or self.best_of < self.n:
            raise bad("best_of", f"must be an integer >= n ({self.n})")
        limits.check_numbers(self, bad)
        limits.check_token_counts(self, bad)
        limits.check_structured_conflicts(self, bad)
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", "must be a non-negative integer")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        limits.check_sizes(self, bad)
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int)
            or isinstance(self.prompt_logprobs, bool)
            or self.prompt_logprobs < 0
        ):
            raise bad("prompt_logprobs", "must be a non-negative integer")
        so = self.structured_outputs
        if so is not None:
            if not isinstance(so, StructuredOutputs):
                raise bad("structured_outputs", "must be a StructuredOutputs")
            so.verify()
        if self.use_beam_search:
            if so is not None:
                raise InvalidParameter(
                    "structured_outputs", "structured_outputs cannot be combined with beam search."
                )
            limits.check_beam_search(self, bad)

    def check_max_logprobs(self, max_logprobs: int) -> None:
        """Refuse logprobs / prompt_logprobs above the engine's cap (-1: no cap)."""
        if max_logprobs < 0:
            return
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and v > max_logprobs:
                raise InvalidParameter(
                    name,
                    f"{name} must be at most the engine's max_logprobs ({max_logprobs}), got {v}.",
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < limits.GREEDY_EPS


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.temperature != 0.0:
            # Beam search keeps the most likely continuations; it draws nothing at random.
            raise InvalidParameter(
                "temperature", f"temperature must be 0 for beam search, got {self.temperature!r}."
            )
        self.to_sampling_params()  # every other field is checked where it is used

    def to_sampling_params(self) -> SamplingParams:
        return SamplingParams(
            n=self.beam_width,
            best_of=self.beam_width,
            temperature=0.0,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            use_beam_search=True,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            logprobs=self.logprobs,
        )
