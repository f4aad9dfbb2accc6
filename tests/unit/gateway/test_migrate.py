"""The pure parts of mid-stream failover (gateway/migrate.py): what was delivered, the
continuation request, the splice of the continuation's events, the stall timeout."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from kiloserve.errors import ConfigError
from kiloserve.gateway.config import parse_gateway_config
from kiloserve.gateway.migrate import (
    Delivered,
    MigrationConfig,
    Splicer,
    continuation_body,
    end_events,
    migratable,
    migration_requested,
    parse_delivered,
    stall_timeout_s,
)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def _ev(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _text_chunk(cid: str, text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return _ev(
        {"id": cid, "object": "text_completion", "created": 7, "model": "m", "choices": [choice]}
    )


def _chat_chunk(cid: str, delta: dict[str, Any], finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return _ev(
        {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": 9,
            "model": "m2",
            "choices": [choice],
        }
    )


def _usage_chunk(cid: str, prompt: int, completion: int) -> bytes:
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    return _ev(
        {
            "id": cid,
            "object": "text_completion",
            "created": 1,
            "model": "x",
            "choices": [],
            "usage": usage,
        }
    )


def _events(data: bytes) -> list[Any]:
    out = []
    for e in data.split(b"\n\n"):
        if e.strip():
            payload = e.removeprefix(b"data: ")
            out.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return out


def test_parse_delivered_completions_in_pieces() -> None:
    sent = [_text_chunk("a", " the") + _text_chunk("a", " of"), _text_chunk("a", " and")]
    d = parse_delivered(sent)
    assert (d.text, d.num_tokens, d.id, d.created, d.model) == (" the of and", 3, "a", 7, "m")
    assert not d.done and d.finish_reason is None and not d.role_sent


def test_parse_delivered_chat_role_finish_done() -> None:
    sent = [
        _chat_chunk("c", {"role": "assistant", "content": ""}),
        _chat_chunk("c", {"content": " hi"}),
        _chat_chunk("c", {"content": " yo"}, "length"),
        b"data: [DONE]\n\n",
    ]
    d = parse_delivered(sent)
    assert d.text == " hi yo" and d.num_tokens == 2 and d.role_sent
    assert d.finish_reason == "length" and d.done


def test_parse_delivered_sees_tool_calls() -> None:
    d = parse_delivered([_chat_chunk("c", {"tool_calls": [{"index": 0}]})])
    assert d.has_other


def test_continuation_body_completions() -> None:
    body = {"model": "m", "prompt": "hello", "max_tokens": 10, "stream": True}
    d = Delivered(text=" the of", num_tokens=2)
    out = continuation_body(COMPLETIONS, body, d)
    assert out is not None
    assert out["prompt"] == "hello the of" and out["max_tokens"] == 8
    assert out["stream_options"] == {"include_usage": True}
    assert body["prompt"] == "hello" and body["max_tokens"] == 10  # not mutated
    listed = continuation_body(COMPLETIONS, {**body, "prompt": ["hello"]}, d)
    assert listed is not None and listed["prompt"] == "hello the of"


def test_continuation_body_nothing_left() -> None:
    body = {"prompt": "p", "max_tokens": 2, "stream": True}
    assert continuation_body(COMPLETIONS, body, Delivered(text=" a b", num_tokens=2)) is None


def test_continuation_body_without_max_tokens_keeps_it_open() -> None:
    out = continuation_body(COMPLETIONS, {"prompt": "p", "stream": True}, Delivered(" a", 1))
    assert out is not None and "max_tokens" not in out


def test_continuation_body_chat() -> None:
    msgs = [{"role": "user", "content": "q"}]
    body: dict[str, Any] = {
        "messages": msgs,
        "max_completion_tokens": 5,
        "max_tokens": 50,
        "stream": True,
    }
    body["stream_options"] = {"include_usage": False, "other": 1}
    out = continuation_body(CHAT, body, Delivered(text=" a b", num_tokens=2))
    assert out is not None
    assert out["messages"] == [*msgs, {"role": "assistant", "content": " a b"}]
    assert out["continue_final_message"] is True and out["add_generation_prompt"] is False
    assert out["max_completion_tokens"] == 3 and out["max_tokens"] == 48
    assert out["stream_options"] == {"include_usage": True, "other": 1}
    assert len(body["messages"]) == 1


@pytest.mark.parametrize(
    ("path", "body", "ok"),
    [
        (COMPLETIONS, {"prompt": "p", "stream": True}, True),
        (COMPLETIONS, {"prompt": ["p"], "stream": True}, True),
        (COMPLETIONS, {"prompt": "p"}, False),
        (COMPLETIONS, {"prompt": [1, 2], "stream": True}, False),
        (COMPLETIONS, {"prompt": "p", "stream": True, "n": 2}, False),
        (COMPLETIONS, {"prompt": "p", "stream": True, "best_of": 3}, False),
        (COMPLETIONS, {"prompt": "p", "stream": True, "echo": True}, False),
        (COMPLETIONS, {"prompt": "p", "stream": True, "logprobs": 1}, False),
        (CHAT, {"messages": [{"role": "user", "content": "q"}], "stream": True}, True),
        (
            CHAT,
            {"messages": [{"role": "user", "content": "q"}], "stream": True, "tools": []},
            False,
        ),
        (CHAT, {"messages": [], "stream": True}, False),
    ],
)
def test_migratable(path: str, body: dict[str, Any], ok: bool) -> None:
    assert migratable(path, body) is ok


def test_migration_header() -> None:
    assert migration_requested(None) and migration_requested("1")
    assert not migration_requested("0") and not migration_requested(" Off ")


def test_splicer_rewrites_ids_and_usage() -> None:
    d = Delivered(text=" a b", num_tokens=2, id="first", created=7, model="m")
    sp = Splicer(d, strip_usage=False)
    data = _text_chunk("second", " c") + _text_chunk("second", " d", "length")
    data += _usage_chunk("second", 12, 2) + b"data: [DONE]\n\n"
    events = _events(sp.feed(data))
    assert [e["id"] for e in events[:-1]] == ["first"] * 3
    assert {e["created"] for e in events[:-1]} == {7} and {e["model"] for e in events[:-1]} == {"m"}
    assert events[2]["usage"] == {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14}
    assert events[-1] == "[DONE]"
    assert (sp.prompt_tokens, sp.completion_tokens) == (10, 4)


def test_splicer_strips_usage_when_not_asked() -> None:
    sp = Splicer(Delivered(num_tokens=1, id="x", created=1, model="m"), strip_usage=True)
    events = _events(
        sp.feed(_text_chunk("y", " c") + _usage_chunk("y", 5, 1) + b"data: [DONE]\n\n")
    )
    assert len(events) == 2 and events[-1] == "[DONE]" and "usage" not in events[0]


def test_splicer_drops_the_second_chat_role_chunk() -> None:
    d = Delivered(text=" a", num_tokens=1, id="c1", created=9, model="m2", role_sent=True)
    sp = Splicer(d, strip_usage=True)
    data = _chat_chunk("c2", {"role": "assistant", "content": ""}) + _chat_chunk(
        "c2", {"content": " b"}
    )
    events = _events(sp.feed(data))
    assert len(events) == 1
    assert events[0]["choices"][0]["delta"] == {"content": " b"} and events[0]["id"] == "c1"


def test_end_events() -> None:
    d = Delivered(text=" a", num_tokens=3, id="i", created=2, model="m")
    events = _events(end_events(d, 4, with_usage=True))
    assert events[0]["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    assert events[-1] == "[DONE]"
    assert _events(end_events(d, 4, with_usage=False)) == ["[DONE]"]


def test_stall_timeout() -> None:
    cfg = MigrationConfig()
    assert stall_timeout_s(cfg, None) == 5.0
    assert stall_timeout_s(cfg, 10.0) == 5.0
    assert stall_timeout_s(cfg, 500.0) == pytest.approx(10.0)
    assert stall_timeout_s(MigrationConfig(stall_timeout_s=0.5), 500.0) == 0.5


def test_config_keys() -> None:
    cfg = parse_gateway_config({"migration": {"enabled": False, "max_attempts": 1}})
    assert not cfg.migration.enabled and cfg.migration.max_attempts == 1
    assert parse_gateway_config({}).migration.enabled
    with pytest.raises(ConfigError, match="migration"):
        parse_gateway_config({"migration": {"stall_timeout": 1}})
