"""engine.sampling_fields: parsing, schema values and structured-output lengths."""

from __future__ import annotations

import pytest

from kiloserve.engine.sampling_fields import (
    SamplingFields,
    fit_pieces,
    parse_sampling_fields,
    value_for_schema,
)
from kiloserve.errors import RequestError


def test_plain_requests_stay_plain() -> None:
    assert parse_sampling_fields({"prompt": "x"}, "completion").is_plain
    fields = parse_sampling_fields({"messages": [], "tools": [{}], "tool_choice": "none"}, "chat")
    assert fields.is_plain


def test_value_for_simple_schemas() -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "array", "items": {"type": "number"}, "minItems": 2},
            "b": {"const": "k"},
            "c": {"enum": ["x", "y"]},
            "d": {"type": "null"},
        },
    }
    assert value_for_schema(schema) == {"a": [1.5, 1.5], "b": "k", "c": "x", "d": None}
    with pytest.raises(RequestError, match=r"schema\.properties\.p\.\$ref"):
        value_for_schema({"type": "object", "properties": {"p": {"$ref": "#/x"}}})


def test_structured_output_stops_after_its_last_piece() -> None:
    fields = parse_sampling_fields({"response_format": {"type": "json_object"}}, "completion")
    num = len(fields.pieces)
    assert "".join(fields.pieces) == '{"text":"the answer"}'
    assert fit_pieces(fields, None, 1000) == (num, "stop")
    assert fit_pieces(fields, 2, 1000) == (2, "length")
    assert fit_pieces(fields, None, 3) == (3, "length")


def test_chat_echo_is_the_last_assistant_message() -> None:
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The"}]
    fields = parse_sampling_fields({"messages": messages, "echo": True}, "chat")
    assert fields == SamplingFields(echo_text="The")
    fields = parse_sampling_fields({"messages": messages[:1], "echo": True}, "chat")
    assert fields.is_plain


@pytest.mark.parametrize(
    "body",
    [
        {"logprobs": 21},
        {"logprobs": True},
        {"echo": "yes"},
        {"response_format": {"type": "yaml"}},
    ],
)
def test_bad_completion_fields_are_400(body: dict[str, object]) -> None:
    with pytest.raises(RequestError):
        parse_sampling_fields({"prompt": "x", **body}, "completion")


def test_odd_schemas_are_400_not_500() -> None:
    assert value_for_schema({"type": "array", "minItems": "x"}) == ["text"]
    assert value_for_schema({"type": "array", "minItems": 10**9}) == ["text"]
    body = {
        "tools": [{"function": {"name": "f", "parameters": {"type": 3}}}],
        "tool_choice": "required",
    }
    with pytest.raises(RequestError) as info:
        parse_sampling_fields({"messages": [], **body}, "chat")
    assert info.value.param == "tools"
