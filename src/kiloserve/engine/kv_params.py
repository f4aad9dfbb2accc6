"""``kv_transfer_params``: the P/D fields of a request body, as vLLM's disaggregated serving.

vLLM's P/D proxy sends a request twice. The prefill leg carries
``{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null, ...}``
(and ``max_tokens: 1``); the prefill engine runs it, keeps the prompt's KV blocks and
answers with the params the decode leg needs (:func:`prefill_answer`). The decode leg
carries those params (``do_remote_prefill: true``); the decode engine pulls the KV
and generates. :func:`parse_kv_transfer_params` turns a body's field into
:class:`RemoteDecode` (a prefill leg), :class:`RemotePrefill` (a decode leg) or
``None`` (a plain request: both flags false or the field absent), and refuses bad
params with a 400 naming the field. Pure: no I/O, no clock.

Roles (``kiloserve engine --role``): every role serves plain requests (as vLLM's
P/D instances do); a ``prefill`` engine refuses decode legs and a ``decode`` engine
refuses prefill legs, so a mis-routed leg is a clear 400 instead of a silent
colocated run.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiloserve.errors import RequestError

__all__ = [
    "FIELD",
    "ROLES",
    "RemoteDecode",
    "RemotePrefill",
    "parse_kv_transfer_params",
    "prefill_answer",
]

FIELD = "kv_transfer_params"
ROLES = ("prefill", "decode", "both")
MAX_PORT = 65535


@dataclass(frozen=True, slots=True)
class RemoteDecode:
    """A prefill leg: run the prompt, keep its KV for a remote decode engine."""


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """A decode leg: the prompt's KV is on ``remote_host:remote_port`` (engine
    ``remote_engine_id``), held under ``remote_request_id``; ``num_tokens`` is the prompt
    length the prefill engine ran (``None``: not sent, the local prompt's is used)."""

    remote_engine_id: str
    remote_block_ids: tuple[int, ...]
    remote_host: str
    remote_port: int
    remote_request_id: str
    num_tokens: int | None = None
    tp_size: int | None = None

    @property
    def release_url(self) -> str:
        """Where the decode engine tells the prefill engine to free the blocks."""
        return self._url("release")

    @property
    def pull_url(self) -> str:
        """Where the decode engine starts reading the blocks (the twin's stand-in for
        NIXL's read: 404 when the prefill engine no longer holds them)."""
        return self._url("pull")

    def _url(self, action: str) -> str:
        host = f"[{self.remote_host}]" if ":" in self.remote_host else self.remote_host
        return f"http://{host}:{self.remote_port}/kv_transfer/{action}"

    def num_transferred_tokens(self, num_prompt_tokens: int) -> int:
        """Prompt tokens whose KV arrives: all but the last (recomputed for its logits,
        as vLLM's NixlConnector), and no more than the prefill engine ran."""
        num_tokens = num_prompt_tokens
        if self.num_tokens is not None:
            num_tokens = min(num_tokens, self.num_tokens)
        return max(0, num_tokens - 1)


def _error(key: str, message: str) -> RequestError:
    return RequestError(f"{FIELD}.{key} {message}", param=f"{FIELD}.{key}")


def _flag(params: dict[str, object], key: str) -> bool:
    value = params.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _error(key, f"must be a boolean, got {type(value).__name__}")
    return value


def _text(params: dict[str, object], key: str) -> str:
    value = params.get(key)
    if not isinstance(value, str) or not value:
        raise _error(key, "must be a non-empty string (the prefill engine's answer has it)")
    return value


def _opt_int(params: dict[str, object], key: str, minimum: int, maximum: int) -> int | None:
    value = params.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise _error(key, f"must be an integer in {minimum}..{maximum}, got {value!r}")
    return value


def _block_ids(params: dict[str, object]) -> tuple[int, ...]:
    value = params.get("remote_block_ids")
    if not isinstance(value, list) or not all(
        isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in value
    ):
        raise _error("remote_block_ids", "must be a list of block ids (integers >= 0)")
    return tuple(value)


def _remote_prefill(params: dict[str, object]) -> RemotePrefill:
    port = _opt_int(params, "remote_port", 1, MAX_PORT)
    if port is None:
        raise _error("remote_port", "is required (the prefill engine's port)")
    return RemotePrefill(
        remote_engine_id=_text(params, "remote_engine_id"),
        remote_block_ids=_block_ids(params),
        remote_host=_text(params, "remote_host"),
        remote_port=port,
        remote_request_id=_text(params, "remote_request_id"),
        num_tokens=_opt_int(params, "num_tokens", 1, 2**31 - 1),
        tp_size=_opt_int(params, "tp_size", 1, 1024),
    )


def parse_kv_transfer_params(
    body: dict[str, object], role: str
) -> RemoteDecode | RemotePrefill | None:
    """The request's P/D leg (``None``: a plain request); a 400 naming the bad field.

    ``role`` is the engine's (:data:`ROLES`). A leg may not stream back its prefill
    (``stream`` with ``do_remote_decode``) nor ask for several choices (``n`` > 1).
    """
    raw = body.get(FIELD)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise RequestError(f"{FIELD} must be an object", param=FIELD)
    is_remote_decode = _flag(raw, "do_remote_decode")
    is_remote_prefill = _flag(raw, "do_remote_prefill")
    if is_remote_decode and is_remote_prefill:
        raise _error("do_remote_prefill", "and do_remote_decode cannot both be true")
    if not is_remote_decode and not is_remote_prefill:
        return None
    n = body.get("n")
    if n is not None and n != 1:
        raise RequestError(f"{FIELD} needs n = 1 (one sequence per leg)", param="n")
    if is_remote_decode:
        if role == "decode":
            raise _error(
                "do_remote_decode",
                "is a prefill leg, but this engine's role is decode (send it to a prefill"
                " or both engine)",
            )
        if body.get("stream") is True:
            raise RequestError(
                f"{FIELD}.do_remote_decode needs stream: false (the answer carries the KV handle)",
                param="stream",
            )
        return RemoteDecode()
    if role == "prefill":
        raise _error(
            "do_remote_prefill",
            "is a decode leg, but this engine's role is prefill (send it to a decode or"
            " both engine)",
        )
    return _remote_prefill(raw)


def prefill_answer(
    *,
    engine_id: str,
    block_ids: list[int],
    host: str,
    port: int,
    tp_size: int,
    request_id: str,
    num_tokens: int,
) -> dict[str, object]:
    """The ``kv_transfer_params`` of a prefill leg's answer (vLLM's NixlConnector fields,
    plus kiloserve's ``remote_request_id`` and ``num_tokens``)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_block_ids": block_ids,
        "remote_host": host,
        "remote_port": port,
        "tp_size": tp_size,
        "remote_request_id": request_id,
        "num_tokens": num_tokens,
    }
