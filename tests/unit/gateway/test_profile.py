"""Request profiling: tokens, predicted output, session key, prefix hashes, speed."""

from __future__ import annotations

import base64
from pathlib import Path

import orjson
import pytest

from kiloserve.errors import ConfigError, RequestError
from kiloserve.gateway.config import parse_gateway_config
from kiloserve.gateway.profile import OutputPredictor, Profiler, jwt_subject, prompt_text
from kiloserve.tokens import count_tokens, filler_text, prefix_block_hashes, tokenize


def _profiler(**kw: object) -> Profiler:
    return Profiler(parse_gateway_config(kw))


def _jwt(claims: dict[str, object]) -> str:
    payload = base64.urlsafe_b64encode(orjson.dumps(claims)).rstrip(b"=").decode()
    return f"Bearer eyJhbGciOiJub25lIn0.{payload}.sig"


def test_prompt_text_shapes() -> None:
    assert prompt_text({"prompt": "abc"}) == "abc"
    assert prompt_text({"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert prompt_text({"prompt": [[1, 2], [3]]}) == [1, 2, 3]
    assert prompt_text({"prompt": ["a", "b"]}) == "a\nb"
    chat = {"messages": [{"content": "sys"}, {"content": [{"type": "text", "text": "u"}]}]}
    assert prompt_text(chat) == "sys\nu"
    assert prompt_text({"prompt": None}) == ""


def test_profile_counts_tokens_and_hashes_prefix() -> None:
    text = filler_text(100)
    info = _profiler(block_size=16).profile("r1", {"model": "m", "prompt": text}, {})
    assert info.request_id == "r1" and info.model == "m"
    assert info.input_tokens == count_tokens(text) == 100
    assert info.prefix_hashes == tuple(prefix_block_hashes(tokenize(text), 16))
    assert len(info.prefix_hashes) == 6
    assert info.predicted_output_tokens == 256 and info.max_tokens is None


def test_prefix_hashes_capped_but_exact_for_the_prefix() -> None:
    text = filler_text(5000)
    info = _profiler(max_prefix_tokens=1024).profile("r", {"model": "m", "prompt": text}, {})
    assert info.input_tokens == 5000
    full = prefix_block_hashes(tokenize(text), 16)
    assert info.prefix_hashes == tuple(full[:64])


def test_token_id_prompts_count_exactly() -> None:
    info = _profiler().profile("r", {"model": "m", "prompt": list(range(40))}, {})
    assert info.input_tokens == 40
    assert info.prefix_hashes == tuple(prefix_block_hashes(list(range(40)), 16))


def test_predicted_output_from_max_tokens_then_ewma_per_user_and_model() -> None:
    prof = _profiler(default_output_tokens=100)
    body = {"model": "m", "prompt": "x", "user": "alice"}
    assert prof.profile("r", {**body, "max_tokens": 7}, {}).predicted_output_tokens == 7
    assert prof.profile("r", {**body, "max_completion_tokens": 9}, {}).max_tokens == 9
    assert prof.profile("r", body, {}).predicted_output_tokens == 100
    prof.outputs.observe("alice", "m", 50)
    prof.outputs.observe("alice", "m", 100)  # 50 + 0.2 * 50
    assert prof.profile("r", body, {}).predicted_output_tokens == 60
    assert prof.profile("r", {**body, "user": "bob"}, {}).predicted_output_tokens == 100
    with pytest.raises(RequestError):
        prof.profile("r", {**body, "max_tokens": -1}, {})


def test_output_predictor_is_bounded() -> None:
    pred = OutputPredictor(default_tokens=5, max_num_keys=2)
    for user in ["a", "b", "c"]:
        pred.observe(user, "m", 10)
    assert pred.predict("a", "m") == 5  # evicted
    assert pred.predict("c", "m") == 10


def test_session_key_precedence() -> None:
    prof = _profiler()
    body = {"model": "m", "prompt": "x"}
    jwt = {"authorization": _jwt({"sub": "user-9"})}
    assert prof.profile("r", body, jwt).session_key == "user-9"
    assert prof.profile("r", {**body, "user": "u1"}, jwt).session_key == "u1"
    both = {**jwt, "x-session-id": "s1"}
    assert prof.profile("r", {**body, "user": "u1"}, both).session_key == "s1"
    assert prof.profile("r", body, {}).session_key is None


@pytest.mark.parametrize(
    "header",
    [None, "Basic abc", "Bearer sk-plainkey", "Bearer a.!!!.c", "Bearer a.bm90IGpzb24.c"],
)
def test_jwt_subject_rejects_non_jwts(header: str | None) -> None:
    assert jwt_subject(header) is None


def test_profile_of_8k_prompt_counts_and_caps_prefix_hashes() -> None:
    # Its speed (target well under 5 ms) is measured by benchmarks/profile_speed.py.
    prof = _profiler()
    body = {"model": "m", "messages": [{"role": "user", "content": filler_text(8000)}]}
    info = prof.profile("r", body, {})
    assert info.input_tokens >= 8000
    assert 0 < len(info.prefix_hashes) <= 8000 // 16


def test_real_tokenizer_when_configured(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    prof = _profiler(models={"m": {"tokenizer": str(path)}}, block_size=2)
    info = prof.profile("r", {"model": "m", "prompt": "hello world hello zzz"}, {})
    assert info.input_tokens == 4
    assert info.prefix_hashes == tuple(prefix_block_hashes([1, 2, 1, 0], 2))
    with pytest.raises(ConfigError):
        _profiler(models={"m": {"tokenizer": str(tmp_path / "missing.json")}})
