"""The agent-era APIs through the gateway (issue 18; docs/gateway.md, "APIs").

``POST /v1/responses`` (OpenAI Responses), ``/v1/messages`` (Anthropic Messages),
``/v1/embeddings``, ``/v1/rerank``, ``/tokenize`` and ``/detokenize`` take the same
path as completions (``gateway/app.py``'s front door: body checks, API keys, rate
limits, admission, the policy's decision, retries before the first byte). Here:

* the request profile comes from a completions- or chat-shaped *view* of the body
  (``api_view``): Responses ``instructions`` + ``input`` and Anthropic ``system`` +
  ``messages`` become chat messages (rendered as the engine twin renders them,
  ``engine/agent_protocol.py``), the output budget is ``max_output_tokens`` /
  ``max_tokens``; embeddings and rerank inputs are prompts with no output; tokenize /
  detokenize cost nothing (no prompt, no output). The body is sent on unchanged.
* stickiness: the gateway remembers which backend produced each Responses API id (a
  bounded LRU of ``MAX_RESPONSE_IDS``, learnt from the answer's first ``resp_`` id), and
  a request with a known ``previous_response_id`` goes there first while it is routable
  (``Router.pins``); otherwise the policy decides as usual (session key: the
  ``x-session-id`` header or ``user``, or Anthropic's ``metadata.user_id``). With
  ``--workers N`` the workers share the ids they learn (``routing.shared_responses``),
  so a follow-up finds its backend whichever worker takes it, and with ``peers`` on
  the gateways share them through Redis (``gateway/peers.py``).
* streams (SSE with ``event:`` lines) are relayed byte for byte; TTFT is the first
  content event (``response.output_text.delta`` / ``content_block_delta``), and the
  output tokens are the number of such events.
* a backend that does not serve the API (it answers 404 without an error of its own:
  plain text, FastAPI's ``{"detail": ...}`` or a bare "Not Found") becomes an
  OpenAI-style JSON 404 naming the path and the backend (code ``unsupported_api``).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
from aiohttp import web

from kiloserve.engine.agent_protocol import anthropic_chat_messages, responses_chat_messages
from kiloserve.errors import NotFoundError, RequestError
from kiloserve.gateway.api_hooks import HOOKS_KEY, ApiHooks
from kiloserve.gateway.headers import BACKEND_HEADER
from kiloserve.gateway.peers import PeerLoad
from kiloserve.routing.router import Router
from kiloserve.routing.shared_responses import SharedResponses, response_key

__all__ = [
    "EXTRA_API_PATHS",
    "MAX_RESPONSE_IDS",
    "OWNERS_KEY",
    "STREAM_MARKERS",
    "ResponseOwners",
    "api_view",
    "install_extra_apis",
    "is_route_missing",
    "profile_view",
]

RESPONSES_PATH = "/v1/responses"
MESSAGES_PATH = "/v1/messages"
EXTRA_API_PATHS = (
    RESPONSES_PATH, MESSAGES_PATH, "/v1/embeddings", "/v1/rerank", "/tokenize", "/detokenize",
)  # fmt: skip
MAX_RESPONSE_IDS = 100_000  # response id -> backend entries kept (LRU)
# the event that carries generated text, per streaming API (its ``event:`` line: the
# name appears once more in the data's ``type``)
STREAM_MARKERS = {
    RESPONSES_PATH: b"event: response.output_text.delta",
    MESSAGES_PATH: b"event: content_block_delta",
}
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_.:-]{1,120})"')
# bodies of a 404 that means "no such route" (aiohttp / the twin, llama.cpp)
_ROUTE_MISSING = frozenset({"Not Found", "File Not Found"})

Proxy = Callable[[web.Request, str], Awaitable[web.StreamResponse]]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ResponseOwners:
    """Response id -> the backend that produced it, at most ``max_num_ids`` (LRU), keyed
    by the id's 64-bit hash (``response_key``). With ``--workers N`` (``share``) every id
    learnt is written for the siblings, and a look-up first takes in theirs; with
    ``peers`` on, every id learnt goes to the other gateways too (``peers``), and theirs
    come in through ``take``."""

    def __init__(self, max_num_ids: int = MAX_RESPONSE_IDS) -> None:
        self._max_num_ids = max_num_ids
        self._owners: OrderedDict[int, str] = OrderedDict()
        self.share: SharedResponses | None = None  # gateway/workers.py sets it
        self.peers: Callable[[int, str], None] | None = None  # gateway/app.py sets it

    def __len__(self) -> int:
        return len(self._owners)

    def remember(self, response_id: str, backend_id: str) -> None:
        key = response_key(response_id)
        self._put(key, backend_id)
        if self.share is not None:
            self.share.publish(key, backend_id)
        if self.peers is not None:
            self.peers(key, backend_id)

    def take(self, key: int, backend_id: str) -> None:
        """An id another gateway learnt (``gateway/peers.py``)."""
        self._put(key, backend_id)

    def _put(self, key: int, backend_id: str) -> None:
        self._owners[key] = backend_id
        self._owners.move_to_end(key)
        if len(self._owners) > self._max_num_ids:
            self._owners.popitem(last=False)

    def owner(self, response_id: str) -> str | None:
        if self.share is not None:
            for key, sibling_backend_id in self.share.pull():
                self._put(key, sibling_backend_id)
        key = response_key(response_id)
        backend_id = self._owners.get(key)
        if backend_id is not None:
            self._owners.move_to_end(key)
        return backend_id


OWNERS_KEY = web.AppKey("kiloserve_response_owners", ResponseOwners)
_ROUTER_KEY = web.AppKey("kiloserve_extra_api_router", Router)


class _IdCatcher:
    """``on_data`` of a Responses request: the first ``resp_`` id of the answer (the
    response's own: first in the body, and in the stream's ``response.created``)."""

    __slots__ = ("_owners", "is_done")

    def __init__(self, owners: ResponseOwners) -> None:
        self._owners = owners
        self.is_done = False

    def __call__(self, backend_id: str, data: bytes) -> None:
        if self.is_done:
            return
        self.is_done = True
        found = _RESPONSE_ID.search(data)
        if found is not None:
            self._owners.remember(found.group(1).decode(), backend_id)


def _output_budget(value: Any) -> int | None:
    """An output-token budget for the profile (a bad one: the engine answers it)."""
    return value if type(value) is int and value >= 0 else None


def _chat_view(
    body: Mapping[str, Any], messages: list[dict[str, Any]], max_tokens: Any, user: Any
) -> dict[str, Any]:
    view: dict[str, Any] = {"model": body["model"], "messages": messages}
    budget = _output_budget(max_tokens)
    if budget is not None:
        view["max_tokens"] = budget
    if isinstance(user, str):
        view["user"] = user
    if "cache_salt" in body:
        view["cache_salt"] = body["cache_salt"]
    return view


def _prompt_view(body: Mapping[str, Any], prompt: Any) -> dict[str, Any]:
    view: dict[str, Any] = {"model": body["model"], "prompt": prompt, "max_tokens": 0}
    if isinstance(body.get("user"), str):
        view["user"] = body["user"]
    return view


def _responses_view(body: Mapping[str, Any]) -> dict[str, Any]:
    try:
        messages = responses_chat_messages(body)
    except RequestError:  # the engine answers it
        messages = []
    return _chat_view(body, messages, body.get("max_output_tokens"), body.get("user"))


def _messages_view(body: Mapping[str, Any]) -> dict[str, Any]:
    try:
        messages = anthropic_chat_messages(body)
    except RequestError:
        messages = []
    metadata = body.get("metadata")
    user = metadata.get("user_id") if isinstance(metadata, dict) else None
    return _chat_view(body, messages, body.get("max_tokens"), user)


def _embeddings_view(body: Mapping[str, Any]) -> dict[str, Any]:
    prompt = body.get("input")
    return _prompt_view(body, prompt if isinstance(prompt, str | list) else "")


def _document_text(document: Any) -> str:
    if isinstance(document, dict):
        document = document.get("text")
    return document if isinstance(document, str) else ""


def _rerank_view(body: Mapping[str, Any]) -> dict[str, Any]:
    """One query + document pair per document (what a cross-encoder scores)."""
    query = body.get("query")
    documents = body.get("documents")
    if not isinstance(query, str) or not isinstance(documents, list):
        return _prompt_view(body, "")
    return _prompt_view(body, [query + "\n" + _document_text(d) for d in documents])


def _free_view(body: Mapping[str, Any]) -> dict[str, Any]:
    """Tokenize / detokenize: no GPU work, nothing to count."""
    return _prompt_view(body, "")


_VIEWS: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
    RESPONSES_PATH: _responses_view,
    MESSAGES_PATH: _messages_view,
    "/v1/embeddings": _embeddings_view,
    "/v1/rerank": _rerank_view,
    "/tokenize": _free_view,
    "/detokenize": _free_view,
}


def profile_view(path: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """The completions- or chat-shaped view of an agent-era API body at ``path``."""
    return _VIEWS[path](body)


def api_view(request: web.Request, body: Mapping[str, Any], request_id: str) -> Mapping[str, Any]:
    """What the profiler reads: ``body`` itself for completions and chat, else its
    completions- or chat-shaped view; pins a Responses follow-up to its backend."""
    hooks: ApiHooks | None = request.get(HOOKS_KEY)
    if hooks is None:
        return body
    previous = body.get("previous_response_id")
    if hooks.path == RESPONSES_PATH and isinstance(previous, str):
        owner = request.app[OWNERS_KEY].owner(previous)
        if owner is not None:
            request.app[_ROUTER_KEY].pins[request_id] = owner
            hooks.pinned_request_id = request_id
        else:  # the proxy looks for it on the pool's backends (ApiHooks.is_elsewhere)
            hooks.seek_owner = previous.encode()
    return profile_view(hooks.path, body)


def is_route_missing(body: bytes) -> bool:
    """A 404 body that says "no such route" rather than an error of the API's own
    (an unknown model or response id: relayed as they are)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return True  # plain text
    if not isinstance(data, dict):
        return True
    if "detail" in data:  # FastAPI's (vLLM, SGLang) unknown route
        return True
    error = data.get("error")
    message = error.get("message") if isinstance(error, dict) else data.get("message")
    return not isinstance(message, str) or message in _ROUTE_MISSING


def _not_served(response: web.StreamResponse, path: str) -> web.StreamResponse:
    if response.status != 404 or not isinstance(response, web.Response):
        return response
    body = response.body
    if not isinstance(body, bytes) or not is_route_missing(body):
        return response
    backend_id = response.headers.get(BACKEND_HEADER, "")
    raise NotFoundError(
        f"`POST {path}` is not served by backend `{backend_id}` (it answered 404)",
        code="unsupported_api",
        headers={BACKEND_HEADER: backend_id},
    )


def _handler(path: str, proxy: Proxy, router: Router, owners: ResponseOwners) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        on_data = _IdCatcher(owners) if path == RESPONSES_PATH else None
        hooks = ApiHooks(path, STREAM_MARKERS.get(path), on_data)
        request[HOOKS_KEY] = hooks
        try:
            response = await proxy(request, path)
        finally:
            if hooks.pinned_request_id is not None:
                router.pins.pop(hooks.pinned_request_id, None)
        return _not_served(response, path)

    return handle


def install_extra_apis(
    app: web.Application,
    proxy: Proxy,
    router: Router,
    max_response_ids: int = MAX_RESPONSE_IDS,
    peers: PeerLoad | None = None,
) -> None:
    """Route ``EXTRA_API_PATHS`` through ``proxy`` (the front door's ``_proxy``);
    ``peers``: the other gateways learn the Responses ids and this one theirs."""
    owners = ResponseOwners(max_response_ids)
    if peers is not None:
        owners.peers = peers.publish_response
        peers.on_response = owners.take
    app[OWNERS_KEY] = owners
    app[_ROUTER_KEY] = router
    for path in EXTRA_API_PATHS:
        app.router.add_post(path, _handler(path, proxy, router, owners))
