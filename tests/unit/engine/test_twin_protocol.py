"""Request parsing, output planning and SSE chunk encoding of the engine twin."""

from __future__ import annotations

import logging
import statistics

import orjson
import pytest

from kiloserve.engine.faults import FaultInjector, FaultSet
from kiloserve.engine.metrics import LagTracker
from kiloserve.engine.protocol import (
    DONE_EVENT,
    ChunkEncoder,
    GenerationRequest,
    chat_template_flags,
    natural_output_tokens,
    next_stream_chunks,
    output_text,
    output_word_json,
    parse_chat,
    parse_completion,
    plan_output,
    render_chat,
    render_chat_body,
)
from kiloserve.engine.sequence import output_token_id, output_word
from kiloserve.errors import RequestError
from kiloserve.tokens import tokenize


def _request(
    num_prompt: int, max_tokens: int | None, ignore_eos: bool = False
) -> GenerationRequest:
    return GenerationRequest(
        kind="completion",
        model=None,
        prompt_token_ids=list(range(num_prompt)),
        max_tokens=max_tokens,
        is_stream=False,
        include_usage=False,
        ignore_eos=ignore_eos,
    )


def test_parse_completion_fields() -> None:
    body = {
        "model": "m",
        "prompt": "the node",
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.7,
        "seed": 3,
        "n": 1,
    }
    req = parse_completion(body, tokenize)
    assert req.prompt_token_ids == tokenize("the node")
    assert (req.model, req.max_tokens, req.is_stream, req.include_usage) == ("m", 5, True, True)
    assert req.ignore_eos and req.kind == "completion"


def test_parse_completion_prompt_forms() -> None:
    assert parse_completion({"prompt": [5, 6, 7]}, tokenize).prompt_token_ids == [5, 6, 7]
    assert parse_completion({"prompt": ["the"]}, tokenize).prompt_token_ids == tokenize("the")
    assert parse_completion({"prompt": [[5, 6]]}, tokenize).prompt_token_ids == [5, 6]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
        ({"prompt": "x", "n": 129}, "n"),
        ({"prompt": "x", "model": 1}, "model"),
        (
            {"prompt": "x", "stream": True, "stream_options": {"include_usage": "y"}},
            "stream_options",
        ),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_parse_completion_rejects(body: dict[str, object], param: str) -> None:
    with pytest.raises(RequestError) as info:
        parse_completion(body, tokenize)
    assert info.value.status == 400 and info.value.param == param


def test_empty_string_prompt_is_rejected_as_empty() -> None:
    # "" tokenises to nothing: the engine would reject it, so the parser does first
    with pytest.raises(RequestError):
        parse_completion({"prompt": ""}, tokenize)


def test_parse_chat_template_and_max_completion_tokens() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "x"}],
        },
    ]
    body = {"messages": messages, "max_tokens": 9, "max_completion_tokens": 4}
    req = parse_chat(body, tokenize)
    text = "<|system|>\nbe brief\n<|user|>\nhi x\n<|assistant|>\n"
    assert render_chat(messages) == text
    assert req.prompt_token_ids == tokenize(text)
    assert req.max_tokens == 4 and req.kind == "chat"
    with pytest.raises(RequestError, match="messages"):
        parse_chat({"messages": []}, tokenize)
    with pytest.raises(RequestError):
        parse_chat({"messages": [{"role": "user", "content": 5}]}, tokenize)
    with pytest.raises(RequestError):
        parse_chat("not an object", tokenize)


def test_plan_output() -> None:
    assert plan_output(_request(10, 5), 100) == (5, "length")
    assert plan_output(_request(10, None, ignore_eos=True), 100) == (90, "length")
    natural = natural_output_tokens(list(range(10)))
    assert plan_output(_request(10, None), 10_000) == (natural, "stop")
    assert plan_output(_request(10, None), 12) == (2, "length")  # natural length capped
    with pytest.raises(RequestError, match="maximum context length is 100"):
        plan_output(_request(10, 91), 100)
    with pytest.raises(RequestError):
        plan_output(_request(100, None), 100)  # no room for even one token


def test_natural_lengths_are_deterministic_lognormal_around_150() -> None:
    lengths = [natural_output_tokens(tokenize(f"prompt number {i}")) for i in range(2000)]
    assert lengths[:50] == [
        natural_output_tokens(tokenize(f"prompt number {i}")) for i in range(50)
    ]
    assert 120 <= statistics.median(lengths) <= 180
    assert min(lengths) >= 1 and max(lengths) > 500  # a long right tail


def test_output_text_matches_engine_tokens() -> None:
    for i in range(200):
        assert orjson.loads(output_word_json(i)) == output_word(i)
    text = output_text(40)
    assert tokenize(text) == [output_token_id(i) for i in range(40)]


def _events(data: bytes) -> list[dict[str, object]]:
    parts = data.split(b"\n\n")
    assert parts[-1] == b""
    assert all(p.startswith(b"data: ") for p in parts[:-1])
    return [orjson.loads(p[6:]) for p in parts[:-1]]


def test_completion_chunks_are_openai_sse() -> None:
    enc = ChunkEncoder("completion", "cmpl-1", "m", 123)
    events = _events(enc.token_chunks(0, 3, "length") + enc.usage_chunk(4, 3))
    assert [e["choices"][0]["text"] for e in events[:3]] == [output_word(i) for i in range(3)]  # type: ignore[index]
    assert [e["choices"][0]["finish_reason"] for e in events[:3]] == [None, None, "length"]  # type: ignore[index]
    assert {e["id"] for e in events} == {"cmpl-1"}
    assert {e["object"] for e in events} == {"text_completion"}
    assert events[3]["choices"] == []
    assert events[3]["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    assert DONE_EVENT == b"data: [DONE]\n\n"


def test_chat_chunks_and_full_response() -> None:
    enc = ChunkEncoder("chat", "chatcmpl-1", "m", 123)
    events = _events(enc.role_chunk() + enc.token_chunks(0, 2, None) + enc.finish_chunk("stop"))
    deltas = [e["choices"][0]["delta"] for e in events]  # type: ignore[index]
    assert deltas == [
        {"role": "assistant", "content": ""},
        {"content": output_word(0)},
        {"content": output_word(1)},
        {"content": ""},
    ]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"  # type: ignore[index]
    assert {e["object"] for e in events} == {"chat.completion.chunk"}
    full = orjson.loads(enc.full_response(5, 2, "stop"))
    assert full["object"] == "chat.completion"
    assert full["choices"][0]["message"] == {"role": "assistant", "content": output_text(2)}
    assert full["usage"]["total_tokens"] == 7


def test_fault_set_round_trip_and_errors() -> None:
    body = {"slowdown": 4.0, "error_rate": 0.5, "status": 503, "stall_after_tokens": 5}
    assert FaultSet.from_json(body).to_json() == body
    assert FaultSet.from_json({}) == FaultSet()
    assert FaultSet.from_json({"hang": True}).to_json() == {"hang": True}
    assert FaultSet.from_json({"crash": True}).is_crash
    with pytest.raises(RequestError, match="valid keys"):
        FaultSet.from_json({"slow": 2})


def test_fault_injector_error_draws() -> None:
    never = FaultInjector(FaultSet(), seed=1)
    assert all(never.draw_error_status() is None for _ in range(100))
    always = FaultInjector(FaultSet(error_rate=1.0, error_status=429), seed=1)
    assert {always.draw_error_status() for _ in range(100)} == {429}
    a = FaultInjector(FaultSet(error_rate=0.3), seed=9)
    b = FaultInjector(FaultSet(error_rate=0.3), seed=9)
    draws = [a.draw_error_status() for _ in range(200)]
    assert draws == [b.draw_error_status() for _ in range(200)]
    assert 30 <= draws.count(500) <= 90


class _LagSink:
    def __init__(self) -> None:
        self.values: list[float] = []

    def set_loop_lag(self, lag_s: float) -> None:
        self.values.append(lag_s)


def test_lag_tracker_warns_only_when_lag_is_sustained(caplog: pytest.LogCaptureFixture) -> None:
    sink = _LagSink()
    tracker = LagTracker(sink)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="kiloserve.engine.metrics"):
        tracker.update(0.2, now_s=100.0)
        tracker.update(0.2, now_s=101.0)
        tracker.update(0.0, now_s=101.5)  # recovered: the clock restarts
        tracker.update(0.2, now_s=102.0)
        tracker.update(0.2, now_s=103.5)
        assert caplog.records == []
        tracker.update(0.2, now_s=104.1)  # 2.1 s above the threshold
        tracker.update(0.2, now_s=105.0)  # rate-limited
    assert len(caplog.records) == 1 and "lags 200 ms" in caplog.records[0].getMessage()
    assert sink.values[2] == 0.0 and sink.values[-1] == 0.2


def test_next_stream_chunks_finish_and_stall() -> None:
    enc = ChunkEncoder("completion", "cmpl-1", "m", 1)
    data, num_sent, is_stalled = next_stream_chunks(enc, 0, 3, None, None)
    assert (len(_events(data)), num_sent, is_stalled) == (3, 3, False)
    data, num_sent, _ = next_stream_chunks(enc, 3, 5, "stop", None)
    events = _events(data)
    assert num_sent == 5 and events[-1]["choices"][0]["finish_reason"] == "stop"  # type: ignore[index]
    data, _, _ = next_stream_chunks(enc, 5, 5, "length", None)  # finish with no new token
    assert _events(data)[0]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
    data, num_sent, is_stalled = next_stream_chunks(enc, 2, 9, None, 5)
    assert (len(_events(data)), num_sent, is_stalled) == (3, 5, True)
    data, num_sent, is_stalled = next_stream_chunks(enc, 0, 9, "stop", 5)  # stall wins
    assert (len(_events(data)), num_sent, is_stalled) == (5, 5, True)
    assert b'finish_reason":"stop' not in data
    data, num_sent, is_stalled = next_stream_chunks(enc, 4, 6, None, 3)  # stall set late
    assert (data, num_sent, is_stalled) == (b"", 4, True)


def test_chat_template_flags_as_vllm() -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello, wor"},
    ]
    full = "<|user|>\nhi\n<|assistant|>\nHello, wor\n"
    assert render_chat(messages) == full + "<|assistant|>\n"
    assert render_chat(messages, add_generation_prompt=False) == full
    # the final assistant message stays open: the model continues it
    assert (
        render_chat(messages, add_generation_prompt=False, continue_final_message=True)
        == "<|user|>\nhi\n<|assistant|>\nHello, wor"
    )
    body: dict[str, object] = {
        "messages": messages, "add_generation_prompt": False, "continue_final_message": True,
    }  # fmt: skip
    assert chat_template_flags(body) == (False, True)
    assert render_chat_body(body).endswith("Hello, wor")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"continue_final_message": True}, "continue_final_message"),  # both on
        ({"add_generation_prompt": "no"}, "add_generation_prompt"),
        (
            {"add_generation_prompt": False, "continue_final_message": True, "last": "user"},
            "continue_final_message",
        ),
    ],
)
def test_chat_template_flag_errors(body: dict[str, object], param: str) -> None:
    last = body.pop("last", "assistant")
    body["messages"] = [{"role": "user", "content": "q"}, {"role": last, "content": "a"}]
    with pytest.raises(RequestError) as err:
        render_chat_body(body)
    assert err.value.param == param
