"""Exact prompt tokens: the gateway's ids equal the engine's (vLLM's chat and completions
rules), approximate ids equal the engine twin's, and cache_salt seeds the prefix hashes.

Each test builds its own byte-level BPE tokenizer with ``tokenizers`` in a tmp folder
(as scripts/make_tiny_model.py does for the real engines) and checks the gateway's ids
against an independent rendering: jinja2 the way HF's apply_chat_template sets it up,
encoded with the saved tokenizer. The profiler runs with ``block_size=1``, so its
prefix hashes are one per token: equal hashes mean equal ids.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kiloserve.engine.protocol import parse_chat
from kiloserve.errors import ConfigError, RequestError
from kiloserve.gateway.config import GatewayConfig, parse_gateway_config
from kiloserve.gateway.profile import Profiler
from kiloserve.tokens import cache_seed, filler_text, prefix_block_hashes, tokenize

tokenizers = pytest.importorskip("tokenizers")
jinja2 = pytest.importorskip("jinja2")
jinja2_sandbox = pytest.importorskip("jinja2.sandbox")

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "You are a helpful assistant. Answer the question in one line.",
    "Split the string on whitespace and return the list of words.",
    "The weather in Paris is sunny; the tool returns a temperature.",
] * 20
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# an "openai" template (it loops over message content) that also shows the tools
PARTS = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.content is string %}{{ message.content }}"
    "{% else %}{% for part in message.content %}[{{ part.text }}]{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
RAISING = (
    "{% for message in messages %}{% if message.role == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{{ message.content }}{% endfor %}"
)
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Split"}, {"type": "text", "text": "it"}],
    },
]


def _model_dir(tmp_path: Path, template: str | None = CHATML, **config: Any) -> Path:
    """tokenizer.json (BPE; the post-processor adds <s>) + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    bos = ("<s>", tok.token_to_id("<s>"))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[bos]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg: dict[str, Any] = {"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>"}
    if template is not None:
        cfg["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg | config))
    return tmp_path


def _encode(folder: Path, text: str, add_special_tokens: bool = False) -> list[int]:
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    return list(tok.encode(text, add_special_tokens=add_special_tokens).ids)


def _token_id(folder: Path, token: str) -> int:
    return int(tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id(token))


def _reference(template: str, messages: list[dict[str, Any]], **kw: Any) -> str:
    """HF's apply_chat_template(tokenize=False), set up independently."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = jinja2_sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    env.globals["raise_exception"] = raise_exception
    kw.setdefault("add_generation_prompt", True)
    kw.setdefault("tools", None)
    return env.from_string(template).render(
        messages=messages, bos_token="<s>", eos_token="</s>", documents=None, **kw
    )


def _profiler(folder: Path | None = None, **models: Any) -> Profiler:
    if folder is not None:
        models = {"m": {"tokenizer": str(folder / "tokenizer.json")} | models}
    cfg = {"block_size": 1, "max_prefix_tokens": 100_000, "models": models}
    return Profiler(parse_gateway_config(cfg))


def _ids_view(prof: Profiler, body: dict[str, Any]) -> tuple[int, tuple[int, ...]]:
    info = prof.profile("r", {"model": "m", **body}, {})
    return info.input_tokens, info.prefix_hashes


def _expect(ids: list[int], seed: int = 0) -> tuple[int, tuple[int, ...]]:
    return len(ids), tuple(prefix_block_hashes(ids, 1, seed))


def test_chat_ids_equal_the_template_rendered_and_encoded_without_specials(
    tmp_path: Path,
) -> None:
    folder = _model_dir(tmp_path)
    prof = _profiler(folder)
    # vLLM joins a string template's text parts with "\n"
    flat = [MESSAGES[0], {"role": "user", "content": "Split\nit"}]
    ids = _encode(folder, _reference(CHATML, flat))
    assert ids[0] != _token_id(folder, "<s>")  # neither the template nor the encoding adds it
    assert _ids_view(prof, {"messages": MESSAGES}) == _expect(ids)
    # add_special_tokens (a vLLM extension) adds the post-processor's BOS
    with_bos = _encode(folder, _reference(CHATML, flat), add_special_tokens=True)
    assert with_bos[1:] == ids
    assert _ids_view(prof, {"messages": MESSAGES, "add_special_tokens": True}) == _expect(with_bos)


def test_completion_ids_are_encoded_with_the_tokenizers_special_tokens(tmp_path: Path) -> None:
    folder = _model_dir(tmp_path)
    prof = _profiler(folder)
    prompt = "Split the string <|im_start|> on whitespace."
    ids = _encode(folder, prompt, add_special_tokens=True)
    assert ids[0] == _token_id(folder, "<s>")
    assert _ids_view(prof, {"prompt": prompt}) == _expect(ids)
    no_bos = _encode(folder, prompt)
    assert _ids_view(prof, {"prompt": prompt, "add_special_tokens": False}) == _expect(no_bos)
    # a batch: each prompt encoded on its own (each with its BOS), one after another
    batch = _encode(folder, "a b", True) + _encode(folder, prompt, True)
    assert _ids_view(prof, {"prompt": ["a b", prompt]}) == _expect(batch)
    assert _ids_view(prof, {"prompt": [5, 6, 7]}) == _expect([5, 6, 7])  # ids stay ids


def test_generation_prompt_and_continue_final_message_change_the_ids(tmp_path: Path) -> None:
    folder = _model_dir(tmp_path)
    prof = _profiler(folder)
    flat = [{"role": "user", "content": "Split it"}]
    with_prompt = _ids_view(prof, {"messages": flat})
    without = _ids_view(prof, {"messages": flat, "add_generation_prompt": False})
    assert with_prompt != without
    assert without == _expect(
        _encode(folder, _reference(CHATML, flat, add_generation_prompt=False))
    )
    # pydantic's lax booleans, as vLLM reads the field
    assert _ids_view(prof, {"messages": flat, "add_generation_prompt": "false"}) == without
    # continue_final_message: the last message is left open (no <|im_end|>)
    turn = [*flat, {"role": "assistant", "content": "The words"}]
    body = {"messages": turn, "add_generation_prompt": False, "continue_final_message": True}
    text = _reference(CHATML, turn, add_generation_prompt=False)
    open_text = text[: text.rindex("The words") + len("The words")]
    assert _ids_view(prof, body) == _expect(_encode(folder, open_text))
    # a flag that is no boolean; both flags on (the generation prompt defaults to on)
    for bad in ({"add_generation_prompt": "maybe"}, {"continue_final_message": True}):
        with pytest.raises(RequestError) as err:
            prof.profile("r", {"model": "m", "messages": turn, **bad}, {})
        assert err.value.param == next(iter(bad))


def test_openai_format_template_sees_parts_tools_and_special_tokens(tmp_path: Path) -> None:
    folder = _model_dir(tmp_path, template=PARTS)
    prof = _profiler(folder)
    tools = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
    body = {"messages": [{"role": "user", "content": "hi"}, MESSAGES[1]], "tools": tools}
    # a string content reaches a template that loops over content as one text part;
    # the tools as vLLM dumps them (description: null)
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}, MESSAGES[1]]
    function = {"name": "get", "description": None, "parameters": {"type": "object"}}
    text = _reference(PARTS, parts, tools=[{"type": "function", "function": function}])
    assert "[hi]" in text and '"description": null' in text
    assert _ids_view(prof, body) == _expect(_encode(folder, text))


def test_hf_template_helpers_generation_tag_and_tojson(tmp_path: Path) -> None:
    # HF's tojson keeps non-ASCII and "<" (jinja2's own would escape them); the
    # {% generation %} block of training templates renders its body; loop controls work
    template = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}{% endfor %}"
        "{{ strftime_now('%Y') | length }}"
    )
    folder = _model_dir(tmp_path, template=template)
    messages = [{"role": "user", "content": "é <b>"}, {"role": "user", "content": "x"}]
    text = '{"role": "user", "content": "é <b>"}4'
    assert _ids_view(_profiler(folder), {"messages": messages}) == _expect(_encode(folder, text))


def test_developer_messages_become_one_system_message_when_the_template_lacks_them(
    tmp_path: Path,
) -> None:
    folder = _model_dir(tmp_path)
    prof = _profiler(folder)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Split it"},
        {"role": "developer", "content": "Use lists."},
    ]
    merged = [{"role": "system", "content": "Be brief.\n\nUse lists."}, messages[1]]
    assert _ids_view(prof, {"messages": messages}) == _expect(
        _encode(folder, _reference(CHATML, merged))
    )


def test_a_raising_template_is_a_400_naming_messages(tmp_path: Path) -> None:
    prof = _profiler(_model_dir(tmp_path, template=RAISING))
    with pytest.raises(RequestError) as err:
        prof.profile("r", {"model": "m", "messages": MESSAGES}, {})
    assert err.value.status == 400 and err.value.param == "messages"
    assert "System role not supported" in err.value.message
    for messages in (
        [],
        ["not an object"],
        [{"content": "no role"}],
        [{"role": "user", "content": 5}],
    ):
        with pytest.raises(RequestError) as err:
            prof.profile("r", {"model": "m", "messages": messages}, {})
        assert err.value.param == "messages"


def test_cache_salt_changes_every_prefix_hash(tmp_path: Path) -> None:
    body = {"model": "m", "prompt": filler_text(40)}
    for prof in (_profiler(), _profiler(_model_dir(tmp_path))):
        plain = prof.profile("r", body, {}).prefix_hashes
        salted = prof.profile("r", {**body, "cache_salt": "tenant-a"}, {}).prefix_hashes
        again = prof.profile("r", {**body, "cache_salt": "tenant-a"}, {}).prefix_hashes
        other = prof.profile("r", {**body, "cache_salt": "tenant-b"}, {}).prefix_hashes
        assert len(plain) == len(salted) >= 40
        assert not set(plain) & set(salted) and not set(salted) & set(other)
        assert salted == again
    ids = tokenize(filler_text(40))
    seed = cache_seed(cache_salt="tenant-a")
    assert _profiler().profile("r", {**body, "cache_salt": "tenant-a"}, {}).prefix_hashes == (
        tuple(prefix_block_hashes(ids, 1, seed))
    )


@pytest.mark.parametrize("salt", [7, "", ["a"], "x" * 129, "a/b", "a@b", "a\\b", "a\x00b"])
def test_a_bad_cache_salt_is_a_400(salt: object) -> None:
    with pytest.raises(RequestError) as err:
        _profiler().profile("r", {"model": "m", "prompt": "hi", "cache_salt": salt}, {})
    assert err.value.param == "cache_salt"


def test_tokenizer_modes(tmp_path: Path) -> None:
    folder = _model_dir(tmp_path)
    prof = _profiler(folder)
    assert prof.tokenizer_modes() == {"m": "exact"}
    cfg = {"models": {"a": {"tokenizer": str(folder / "tokenizer.json")}, "b": {}}}
    assert Profiler(parse_gateway_config(cfg)).tokenizer_modes() == {
        "a": "exact",
        "b": "approximate",
    }
    assert _profiler().tokenizer_modes() == {}


TWIN_BODIES: list[dict[str, Any]] = [
    {"messages": MESSAGES},
    {"messages": [{"role": "user", "content": filler_text(50)}], "add_generation_prompt": False},
    {
        "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b c"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    {"messages": [{"role": "tool", "content": None}, {"role": "user", "content": " x  y\n"}]},
]


@pytest.mark.parametrize("body", TWIN_BODIES)
def test_approximate_chat_ids_equal_the_engine_twins(body: dict[str, Any]) -> None:
    twin_ids = parse_chat({"model": "m", **body}, tokenize).prompt_token_ids
    assert _ids_view(_profiler(), body) == _expect(twin_ids)


def test_approximate_chat_the_twin_refuses_is_still_profiled() -> None:
    body = {"model": "m", "messages": [{"content": "no role"}, {"content": "at all"}]}
    info = _profiler().profile("r", body, {})
    assert info.input_tokens == len(tokenize("no role\nat all"))


def test_template_sources_and_their_precedence(tmp_path: Path) -> None:
    folder = _model_dir(tmp_path, template=None)  # no template: the twin's text, encoded
    twin_text = "<|user|>\nSplit it\n<|assistant|>\n"
    chat = {"messages": [{"role": "user", "content": "Split it"}]}
    assert _ids_view(_profiler(folder), chat) == _expect(_encode(folder, twin_text))
    (folder / "chat_template.jinja").write_text(PARTS)
    flat = [{"role": "user", "content": [{"type": "text", "text": "Split it"}]}]
    jinja_ids = _encode(folder, _reference(PARTS, flat))
    assert _ids_view(_profiler(folder), chat) == _expect(jinja_ids)
    own = tmp_path / "own.jinja"
    own.write_text(CHATML)
    prof = _profiler(folder, chat_template=str(own))
    chatml = _encode(folder, _reference(CHATML, chat["messages"]))
    assert _ids_view(prof, chat) == _expect(chatml)


def test_add_bos_token_in_the_config_is_ignored_as_transformers_does(tmp_path: Path) -> None:
    # transformers 5 drops add_bos_token / add_eos_token when a tokenizer.json exists:
    # its post-processor alone decides (here: <s>, and no </s>)
    folder = _model_dir(tmp_path, add_bos_token=False, add_eos_token=True)
    expected = _encode(folder, "Split it", add_special_tokens=True)
    assert expected[0] == _token_id(folder, "<s>") and _token_id(folder, "</s>") not in expected
    assert _ids_view(_profiler(folder), {"prompt": "Split it"}) == _expect(expected)


def test_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="chat_template needs tokenizer"):
        parse_gateway_config({"models": {"m": {"chat_template": "t.jinja"}}})
    with pytest.raises(ConfigError, match="does not compile"):
        _profiler(_model_dir(tmp_path, template="{% for x in %}"))
    folder = _model_dir(tmp_path)
    with pytest.raises(ConfigError, match="cannot read"):
        _profiler(folder, chat_template=str(tmp_path / "missing.jinja"))


async def test_profile_async_renders_off_the_loop_with_the_same_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kiloserve.gateway import chat_template

    prof = _profiler(_model_dir(tmp_path))
    threads: list[int] = []
    encode = chat_template.ExactTokenizer.encode

    def recording(self: Any, text: str, add_special_tokens: bool) -> list[int]:
        threads.append(threading.get_ident())
        return encode(self, text, add_special_tokens)

    monkeypatch.setattr(chat_template.ExactTokenizer, "encode", recording)
    body = {"model": "m", "messages": [{"role": "user", "content": filler_text(20_000)}]}
    assert await prof.profile_async("r", body, {}) == prof.profile("r", body, {})
    assert threads[0] != threading.get_ident() and threads[1] == threading.get_ident()


@contextlib.asynccontextmanager
async def _gateway(cfg: GatewayConfig) -> AsyncIterator[str]:
    from aiohttp import web

    from kiloserve.gateway.app import create_gateway_app, make_runner

    runner = make_runner(create_gateway_app(cfg), cfg)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_the_front_door_answers_openai_style_400s(tmp_path: Path) -> None:
    folder = _model_dir(tmp_path, template=RAISING)
    cfg = parse_gateway_config(
        {
            "models": {"m": {"tokenizer": str(folder / "tokenizer.json")}},
            "backends": [{"url": "http://127.0.0.1:9", "models": ["m"]}],
        }
    )
    cases = [
        ("/v1/chat/completions", {"messages": MESSAGES}, "messages"),
        ("/v1/completions", {"prompt": "hi", "cache_salt": 5}, "cache_salt"),
    ]
    async with _gateway(cfg) as url, aiohttp.ClientSession() as session:
        for path, body, param in cases:
            async with session.post(url + path, json={"model": "m", **body}) as resp:
                answer = await resp.json()
            assert resp.status == 400, answer
            assert answer["error"]["param"] == param
            assert answer["error"]["type"] == "invalid_request_error"
