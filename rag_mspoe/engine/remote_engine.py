"""An engine whose model runs on an OpenAI-compatible server: answers (streamed or not),
teacher-forced scores of answers, and the methods that need only text and log-probabilities.
The sweep (`rag-mspoe sweep --endpoint`) and the LangChain and LlamaIndex adapters use it in place
of the local engine.

    engine = RemoteEngine.connect("http://gpu-box:8000/v1", "Qwen/Qwen2.5-7B-Instruct",
                                  tokenizer="Qwen/Qwen2.5-7B-Instruct", method="invariant-reorder")
    engine.generate(messages).text                          # a GenerationResult, as Engine gives
    engine.score_prompts([(messages, ["Paris", "Rome"])])    # [[(sum of log-probs, tokens), ...]]
    ChatRagMsPoE(engine=engine)                              # LangChain; LlamaIndex's RagMsPoE alike

The chat template comes from one of two places, recorded as `template`:
- a local tokenizer of the served model renders every prompt, which goes to /v1/completions as
  text: answers are scored from the server's log-probabilities of the prompt's own tokens (echo),
  exactly the tokens the local engine scores (those after the point where the answer changes the
  prompt's tokenization), and a method that reorders documents by their question likelihood
  (`invariant-reorder`, `MethodConfig.question_likelihood_order`) ranks them the same way;
- without one, the server's /v1/chat/completions applies its own template: greedy answers only.

A method that hooks the model (RoPE rescaling, attention changes) cannot run on someone else's
server; `remote_method_problem` says which ones can, from what each method declares.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from typing import Any

from rag_mspoe.attention.reorder import document_texts, prompt_with_documents
from rag_mspoe.engine.engine_generation import with_read_order
from rag_mspoe.engine.engine_types import (
    ENGINE_DEFAULT,
    CallMethod,
    GenerationCancelled,
    GenerationResult,
    GenerationSettings,
    GenerationTimeout,
)
from rag_mspoe.engine.prefix_scoring import Score, shared_length
from rag_mspoe.engine.remote_client import (
    Endpoint,
    EndpointTimeout,
    RemoteClient,
    has_prompt_logprobs,
    prompt_logprobs,
)
from rag_mspoe.engine.text_stream import AsyncTextStream, End, TextPiece, TextStream
from rag_mspoe.methods.document_orders import QuestionLikelihoodOrder
from rag_mspoe.methods.method_config import MethodConfig, method_name
from rag_mspoe.methods.method_spec import MethodSpec, parse_method
from rag_mspoe.prompts.chat_template import DOCUMENT_SPANS, Prompt, as_messages, raw_text, render_text
from rag_mspoe.prompts.document_prompts import MissingDocumentSpans, find_document_lines, render_with_spans

# What runs on a remote model: these method specs, alone or with a document order.
REMOTE_METHODS = "none, longcontextreorder, random, invariant-reorder (score 'question', any keep/best)"
# Those that need no scores of the prompt's tokens (what a server without echo logprobs allows).
UNSCORED_METHODS = "none, longcontextreorder, random"
NEEDS_THE_MODEL = (
    "Tool calls and structured output are decoded here under a grammar of their schemas, which needs "
    "the model itself; against a remote endpoint call the server's own tools API, or use the local engine."
)
# The OpenAI API's limit on stop strings, which servers (ours included) enforce.
MAX_REMOTE_STOPS = 4


def remote_method_problem(method: MethodConfig | None, prompt_scores: bool) -> str | None:
    """Why a rescaling config cannot run against a remote model (None: it can): only a method that
    reorders documents by their question likelihood (`question_likelihood_order`) can, from the
    server's log-probabilities of prompt tokens.

    prompt_scores: whether the server gives log-probabilities of a prompt's own tokens and a
    local tokenizer renders the prompts."""
    if method is None:
        return None
    if method.question_likelihood_order() is not None:
        if prompt_scores:
            return None
        return (
            f"{method_name(method)} ranks documents by log-probabilities of prompt tokens, which this "
            f"endpoint (or the chat endpoint without --tokenizer) does not give; these can run: "
            f"{UNSCORED_METHODS}"
        )
    return (
        f"{method_name(method)} changes the model itself, which a remote server does not let us do; "
        f"against an endpoint these run: {REMOTE_METHODS if prompt_scores else UNSCORED_METHODS}"
    )


def remote_setting_problem(config: GenerationSettings) -> str | None:
    """Why a remote server cannot follow a call's settings (None: it can)."""
    if config.grammar is not None or config.tools:
        return NEEDS_THE_MODEL
    if config.logprobs is not None:
        return (
            "logprobs: the tokens' log-probabilities of a remote answer are not read back here; ask the "
            "server for them directly, or use the local engine."
        )
    if config.truncate != "error":
        return (
            "truncate='middle' cuts the prompt by the model's own tokens and context window, which "
            "the server holds; keep truncate='error' against a remote endpoint."
        )
    if config.prefix:
        return "prefix (text the answer must start with) needs the model itself; use the local engine."
    if len(config.stop) > MAX_REMOTE_STOPS:
        return (
            f"{len(config.stop)} stop strings: OpenAI-compatible servers take at most {MAX_REMOTE_STOPS}; "
            "keep the ones that matter."
        )
    return None


def load_tokenizer(source: str) -> Any:
    """The tokenizer of a model source as `load_model` finds it, without the weights."""
    from transformers import AutoTokenizer

    from rag_mspoe.models.loading import resolve_source

    folder, _ = resolve_source(source)
    return AutoTokenizer.from_pretrained(folder)


def configured_context_window(source: str) -> int | None:
    """`max_position_embeddings` of a model source's config (None where it has none)."""
    from transformers import AutoConfig

    from rag_mspoe.models.loading import resolve_source

    folder, _ = resolve_source(source)
    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError):  # a tokenizer alone, without the model's config
        return None
    value = getattr(config, "max_position_embeddings", None)
    return None if value is None else int(value)


class RemoteEngine:
    """Generation and scoring through a `RemoteClient` (see the module docstring), with the calls
    of `rag_mspoe.engine.Engine` the sweep and the LangChain and LlamaIndex adapters make.

    tokenizer: the served model's tokenizer, whose chat template renders the prompts (None: the
    server's chat endpoint renders them, and only generation works). tokenizer_name: how the run
    manifest names it. method: the default method of every call, one `remote_method_problem`
    allows. context_window: the served model's, for LlamaIndex's metadata.
    """

    def __init__(
        self,
        client: RemoteClient,
        tokenizer: Any = None,
        tokenizer_name: str | None = None,
        method: MethodSpec = None,
        context_window: int | None = None,
    ):
        self.client = client
        self.tokenizer = tokenizer
        self.name = client.endpoint.model
        self.template = (
            f"local tokenizer {tokenizer_name or getattr(tokenizer, 'name_or_path', '?')}"
            if tokenizer is not None
            else "the server's chat endpoint"
        )
        self._context_window = context_window
        self._document_scores: dict[str, float] = {}  # a one-document prompt's text -> its score
        self._scores_prompts: bool | None = None  # the probe's finding, once asked
        self._method = self.method_config(method)

    @classmethod
    def connect(
        cls,
        url: str,
        model: str,
        *,
        tokenizer: str | None = None,
        method: MethodSpec = None,
        api_key: str | None = None,
        context_window: int | None = None,
        concurrency: int = 4,
        retries: int = 4,
        timeout_s: float = 600.0,
    ) -> RemoteEngine:
        """The engine of the model `model` served at `url` (the API's base, ".../v1").

        tokenizer: the served model's tokenizer (a folder, hub id or embedded model's name),
        whose chat template renders prompts locally; needed by `invariant-reorder`, and to count
        tokens. Without it the server's chat endpoint renders chat prompts. context_window: None
        takes the tokenizer's model config's `max_position_embeddings`."""
        loaded = None if tokenizer is None else load_tokenizer(tokenizer)
        if context_window is None and tokenizer is not None:
            context_window = configured_context_window(tokenizer)
        endpoint = Endpoint(url, model, api_key, concurrency, retries, timeout_s=timeout_s)
        return cls(RemoteClient(endpoint), loaded, tokenizer, method, context_window)

    # -- facts ---------------------------------------------------------------------------------------
    @property
    def method(self) -> MethodConfig | None:
        """The default method of every call (None: the served model as it is)."""
        return self._method

    @property
    def context_window(self) -> int:
        if self._context_window is None:
            raise ValueError(
                f"The context window of {self.name} is unknown here; give it: "
                "RemoteEngine.connect(..., context_window=N), or name its tokenizer."
            )
        return self._context_window

    @property
    def scores_prompts(self) -> bool:
        """Whether scores of prompt tokens can be had: a local tokenizer renders prompts and the
        server gives log-probabilities of a prompt's own tokens (one probe request, made once)."""
        if self.tokenizer is None:
            return False
        if self._scores_prompts is None:
            self._scores_prompts = has_prompt_logprobs(self.client)
        return self._scores_prompts

    def method_config(self, spec: MethodSpec) -> MethodConfig | None:
        """The config a method spec means, refused (ValueError naming what runs) unless it runs
        against this endpoint."""
        config = parse_method(spec, self.name)
        problem = remote_method_problem(config, True) or (
            None if config is None or self.scores_prompts else remote_method_problem(config, False)
        )
        if problem is not None:
            raise ValueError(problem)
        return config

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text by the served model's tokenizer (LlamaIndex's token budgets)."""
        self._need_tokenizer("Counting tokens")
        return list(self._plain(text)["input_ids"])

    # -- what the sweep calls ------------------------------------------------------------------------
    def count_tokens(self, prompt: Prompt) -> int | None:
        """Tokens of the rendered prompt by the local tokenizer (None without one)."""
        if self.tokenizer is None:
            return None
        return len(self._plain(self.rendered(prompt))["input_ids"])

    def rewritten(
        self, prompts: Sequence[Prompt], *, method: CallMethod = ENGINE_DEFAULT, raw: bool = False
    ) -> tuple[None, list[Prompt]]:
        """The prompts the remote model reads under `method` (the remote model is always unmodified)."""
        config = self._method if method is ENGINE_DEFAULT else self.method_config(method)
        if config is None:
            return None, list(prompts)
        order = config.question_likelihood_order()
        assert order is not None  # what method_config lets through
        return None, [self._question_likelihood_order(config, order, prompt, raw) for prompt in prompts]

    def score_prompts(
        self, items: Sequence[tuple[Prompt, Sequence[str]]], *, method: Any = None
    ) -> list[list[Score]]:
        """(sum of log-probabilities, tokens) of each continuation as the reply to its prompt."""
        self._unmodified(method)
        self._need_tokenizer("Scoring answers")
        flat = [(prompt, text) for prompt, texts in items for text in texts]
        scores = iter(self.client.map(lambda pair: self._score(*pair), flat))
        return [[next(scores) for _ in texts] for _, texts in items]

    # -- what the adapters call (and the sweep's generation) -----------------------------------------
    def generate(
        self, prompt: Prompt, *, cancel: threading.Event | None = None, **settings: Any
    ) -> GenerationResult:
        """An answer, as `Engine.generate` gives it (settings: `GenerationSettings`, as far as a
        remote server takes them)."""
        return self.generate_batch([prompt], cancel=cancel, **settings)[0]

    def generate_batch(
        self, prompts: Sequence[Prompt], *, cancel: threading.Event | None = None, **settings: Any
    ) -> list[GenerationResult]:
        """Answers to several prompts, sent concurrently (`cancel`: set before they go, none go)."""
        config, method = self._call(settings)
        deadline = None if config.timeout is None else time.monotonic() + config.timeout
        _, read = self.rewritten(prompts, method=method, raw=config.raw)
        if cancel is not None and cancel.is_set():
            raise GenerationCancelled("Cancelled before the requests were sent.")
        answers = self.client.map(lambda prompt: self._answer(prompt, config, method, deadline), read)
        return [with_read_order(a, given, r) for a, given, r in zip(answers, prompts, read, strict=True)]

    async def agenerate(self, prompt: Prompt, **settings: Any) -> GenerationResult:
        return await asyncio.to_thread(self.generate, prompt, **settings)

    async def agenerate_batch(self, prompts: Sequence[Prompt], **settings: Any) -> list[GenerationResult]:
        return await asyncio.to_thread(self.generate_batch, prompts, **settings)

    def stream(self, prompt: Prompt, **settings: Any) -> TextStream:
        """The answer's text as the server streams it; `.result` once it ends (as `Engine.stream`)."""
        call = self._call(settings)  # bad settings fail here, before streaming
        return TextStream(lambda put, cancel: self._start_stream(prompt, *call, put, cancel))

    def astream(self, prompt: Prompt, **settings: Any) -> AsyncTextStream:
        """`async for piece in engine.astream(...)`; must be called inside a running event loop."""
        call = self._call(settings)
        return AsyncTextStream(lambda put, cancel: self._start_stream(prompt, *call, put, cancel))

    # -- internals -----------------------------------------------------------------------------------
    def rendered(self, prompt: Prompt) -> str:
        """The chat template's text of a prompt, the assistant turn opened."""
        self._need_tokenizer("Rendering a prompt")
        return render_text(self.tokenizer, prompt)

    def _call(self, settings: dict[str, Any]) -> tuple[GenerationSettings, MethodConfig | None]:
        """A call's settings, refused where a remote server cannot follow them, and its method."""
        config = GenerationSettings.of(settings)
        problem = remote_setting_problem(config)
        if problem is not None:
            raise ValueError(problem)
        method = self._method if config.method is ENGINE_DEFAULT else self.method_config(config.method)
        return config, method

    def _request(self, prompt: Prompt, config: GenerationSettings) -> tuple[str, dict[str, Any]]:
        """The path and body asking for an answer: the rendered (or raw) text to /completions, or
        the messages to /chat/completions when no local tokenizer renders them."""
        body: dict[str, Any] = {"max_tokens": config.max_new_tokens, "temperature": config.temperature}
        if config.temperature:
            body["top_p"] = config.top_p
        if config.seed is not None:
            body["seed"] = config.seed
        if config.stop:
            body["stop"] = list(config.stop)
        if config.raw:
            return "/completions", {"prompt": raw_text(prompt), **body}
        if self.tokenizer is None:
            messages = [{k: v for k, v in m.items() if k != DOCUMENT_SPANS} for m in as_messages(prompt)]
            return "/chat/completions", {"messages": messages, **body}
        return "/completions", {"prompt": self.rendered(prompt), **body}

    def _answer(
        self, prompt: Prompt, config: GenerationSettings, method: Any, deadline: float | None
    ) -> GenerationResult:
        path, body = self._request(prompt, config)
        try:
            answer = self.client.post(path, body, deadline=deadline)
        except EndpointTimeout as exc:
            raise GenerationTimeout(f"{exc} (timeout={config.timeout} s); raise timeout or retry.") from exc
        choice = answer["choices"][0]
        text = (choice["message"]["content"] or "") if "message" in choice else choice["text"]
        return self._result(prompt, config, method, text, choice.get("finish_reason"), answer.get("usage"))

    def _start_stream(
        self, prompt: Prompt, config: GenerationSettings, method: Any, put: Any, cancel: threading.Event
    ) -> None:
        threading.Thread(
            target=self._run_stream,
            args=(prompt, config, method, put, cancel),
            name=f"rag-mspoe-remote-stream-{self.name}",
            daemon=True,
        ).start()

    def _run_stream(
        self, prompt: Prompt, config: GenerationSettings, method: Any, put: Any, cancel: threading.Event
    ) -> None:
        """Stream one answer to `put`: its pieces, then `End(result)` or the error that ended it.
        A set `cancel` (the reader has gone) closes the connection at the next piece."""
        try:
            deadline = None if config.timeout is None else time.monotonic() + config.timeout
            _, (read,) = self.rewritten([prompt], method=method, raw=config.raw)
            path, body = self._request(read, config)
            # Servers that give usage when asked (OpenAI's stream_options) give the token counts.
            body["stream_options"] = {"include_usage": True}
            events = self.client.events(path, body, deadline=deadline)
            text, finish, usage, pieces = "", None, None, 0
            try:
                for event in events:
                    if cancel.is_set():
                        return
                    usage = event.get("usage") or usage
                    for choice in event.get("choices") or ():
                        piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                        if piece:
                            text, pieces = text + piece, pieces + 1
                            put(TextPiece(piece))
                        finish = choice.get("finish_reason") or finish
            finally:
                events.close()
            usage = usage or {"completion_tokens": pieces}  # one token a piece, as servers stream them
            result = self._result(read, config, method, text, finish, usage)
            put(End(with_read_order(result, prompt, read)))
        except EndpointTimeout as exc:
            put(GenerationTimeout(f"{exc} (timeout={config.timeout} s); raise timeout or retry."))
        except BaseException as exc:  # handed to the reader, who re-raises it
            put(exc)

    def _result(
        self,
        prompt: Prompt,
        config: GenerationSettings,
        method: Any,
        text: str,
        finish: str | None,
        usage: dict[str, Any] | None,
    ) -> GenerationResult:
        """The answer as `Engine` gives it: token counts from the server's usage (the prompt's by
        the local tokenizer where the server gave none)."""
        usage = usage or {}
        prompt_tokens = usage.get("prompt_tokens")
        if prompt_tokens is None and self.tokenizer is not None:
            text_read = raw_text(prompt) if config.raw else self.rendered(prompt)
            prompt_tokens = len(self._plain(text_read)["input_ids"])
        return GenerationResult(
            text=text,
            prompt_tokens=int(prompt_tokens or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            finish_reason="length" if finish == "length" else "stop",
            method=method_name(method),
        )

    def _score(self, prompt: Prompt, continuation: str) -> Score:
        """As `Engine.score_continuations` scores one continuation: the tokens from the first one
        the continuation changes (never the very first)."""
        context = self.rendered(prompt)
        context_ids = self._plain(context)["input_ids"]
        ids = self._plain(context + continuation)["input_ids"]
        return self._sum_of_last(
            context + continuation, len(ids), len(ids) - max(1, shared_length(context_ids, ids))
        )

    def _sum_of_last(self, text: str, tokens: int, count: int) -> Score:
        """(sum, count) of the server's log-probabilities of the last `count` tokens of `text`, which
        the local tokenizer splits into `tokens` tokens. Counted from the end: servers disagree on
        the text offsets of special tokens, not on the tokens."""
        values = prompt_logprobs(self.client, text)
        if len(values) not in (tokens, tokens + 1):  # + 1: a BOS token the server adds
            raise ValueError(
                f"{self.client.endpoint.base} splits the prompt into {len(values)} tokens, the "
                f"{self.template} into {tokens}; name the served model's own tokenizer with --tokenizer."
            )
        scored = values[len(values) - count :]
        if any(value is None for value in scored):
            raise ValueError(
                f"{self.client.endpoint.base} gave no log-probability for some prompt tokens; it does not "
                "score prompts (echo with logprobs), so use --metrics generate."
            )
        return sum(value for value in scored if value is not None), count

    def _question_likelihood_order(
        self, method: MethodConfig, order: QuestionLikelihoodOrder, prompt: Prompt, raw: bool
    ) -> Prompt:
        """The method's rewriting with each document's score from the server: the log-likelihood of
        everything after the document in a prompt that holds it alone."""
        if render_with_spans(self.tokenizer, prompt, raw=raw)[1] is None:  # as the local engine refuses it
            raise MissingDocumentSpans.of(method_name(method))
        texts = document_texts(prompt)
        if len(texts) < 2:
            return prompt
        singles = [prompt_with_documents(prompt, [k]) for k in range(len(texts))]
        scores = self.client.map(lambda single: self._document_score(single, raw), singles)
        return order.reordered(prompt, scores, raw=raw)

    def _document_score(self, single: list[dict[str, Any]], raw: bool) -> float:
        text = raw_text(single[0]["content"]) if raw else self.rendered(single)
        if text not in self._document_scores:  # the same document alone: the same prompt
            starts = [start for start, _ in self._plain(text, return_offsets_mapping=True)["offset_mapping"]]
            end = document_end(text, single)
            after = sum(1 for start in starts if start >= end)  # the tokens after the document's last one
            self._document_scores[text] = self._sum_of_last(text, len(starts), after)[0]
        return self._document_scores[text]

    def _plain(self, text: str, **options: Any) -> Any:
        # The server tokenizes the rendered text as plain text, template markers included.
        return self.tokenizer(text, add_special_tokens=False, **options)

    def _need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise ValueError(
                f"{what} needs the model's chat template here; name the served model's tokenizer "
                "with --tokenizer (a folder, hub id or embedded model name)."
            )

    def _unmodified(self, method: Any) -> None:
        if method is not None:
            raise ValueError(remote_method_problem(method, True) or f"{method_name(method)} rewrote prompts")


def document_end(rendered: str, prompt: Prompt) -> int:
    """Where the prompt's last document ends in its rendered text (a character offset)."""
    for message in reversed(as_messages(prompt)):
        spans = message.get(DOCUMENT_SPANS)
        if spans is None and message["role"] in ("user", "system"):
            spans = find_document_lines(message["content"])
        if spans:
            base = rendered.rfind(message["content"])
            if base < 0:
                raise ValueError(
                    "The chat template changed the text of the message with the documents, so where "
                    "they end cannot be found in the rendered prompt."
                )
            return base + int(spans[-1][1])
    raise ValueError("The prompt has no documents to rank.")
