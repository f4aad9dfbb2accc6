"""Exact prompt tokens: a model's tokenizer and chat template, applied as vLLM does.

The gateway hashes the token ids an engine will see, so prefix-cache routing can be
exact. These are the facts of vLLM (0.32, with transformers 5) it follows:

* ``/v1/completions``: the prompt is encoded with ``add_special_tokens`` (request field,
  default true: the ``tokenizer.json`` post-processor adds BOS if it has one).
* ``/v1/chat/completions``: the messages are normalised (``parse_chat_messages``: text
  parts joined by ``"\\n"`` for a "string" template, kept as ``{"type": "text"}`` parts
  for an "openai" one, which loops over ``message.content``), the template is rendered
  to text with ``add_generation_prompt`` (default true), ``continue_final_message``,
  ``tools`` (as vLLM dumps them), ``documents``, ``reasoning_effort``,
  ``chat_template_kwargs`` and the tokenizer's named special tokens, then encoded with
  ``add_special_tokens`` (request field, default false).
* the template runs in jinja2's ``ImmutableSandboxedEnvironment`` (``trim_blocks``,
  ``lstrip_blocks``, ``loopcontrols``, a ``{% generation %}`` tag) with HF's
  ``raise_exception``, ``strftime_now`` and ``tojson``; an error there is a 400.
* the template is ``models.<name>.chat_template`` (vLLM's ``--chat-template``), else
  ``chat_template.jinja`` next to the ``tokenizer.json``, else ``chat_template`` of
  ``tokenizer_config.json`` (a list of named templates: ``tool_use`` with tools, else
  ``default``). Its named special tokens (strings or ``{"content": ...}``) are the
  template's ``bos_token``, ``eos_token``...; ``add_bos_token`` / ``add_eos_token``
  there are ignored, as transformers 5 drops them when a ``tokenizer.json`` exists: the
  tokenizer's own post-processor alone adds special tokens.

Not covered (the ids are then approximate): multimodal placeholders, a request's own
``chat_template``, the engine's ``--default-chat-template-kwargs``, processor templates,
tokenizer classes of transformers that rebuild the tokenizer in code (not from
``tokenizer.json``), and Mistral's own tokenizer format.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.parser
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kiloserve.errors import ConfigError, RequestError
from kiloserve.gateway.chat_messages import (
    ContentFormat,
    conversation,
    developer_as_system,
    request_flag,
    template_kwargs,
)
from kiloserve.gateway.exact_tokens import SELF_CHECK_EVERY, ExactTokenizer

__all__ = ["ChatTemplate", "ExactTokenizer", "load_exact_tokenizer"]

log = logging.getLogger(__name__)

_NAMED_TOKENS: tuple[str, ...] = ("bos_token", "eos_token", "unk_token", "sep_token")
_NAMED_TOKENS += ("pad_token", "cls_token", "mask_token")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


# --- the template ------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """HF's ``{% generation %}...{% endgeneration %}`` block (renders its body as is)."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's own class attribute

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render")
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# apply_chat_template's own parameters: never template variables
_HF_PARAMS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "tokenize"}
    | {"add_generation_prompt", "continue_final_message", "padding", "truncation"}
    | {"max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask"}
    | {"tokenizer_kwargs"}
)


class _Compiled:
    """One template: compiled, its content format and the variables it reads."""

    def __init__(self, source: str) -> None:
        env = _environment()
        try:
            ast = env.parse(source)
            self.template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ConfigError(f"chat template does not compile: {exc}") from exc
        self.source = source
        self.content_format: ContentFormat = _content_format(ast)
        self.variables = frozenset(jinja2.meta.find_undeclared_variables(ast))


class ChatTemplate:
    """A model's chat template (and its ``tool_use`` variant, used when a request has
    tools) with the special tokens it sees."""

    def __init__(
        self, source: str, special_tokens: Mapping[str, str], tool_use: str | None = None
    ) -> None:
        self._default = _Compiled(source)
        self._tool_use = _Compiled(tool_use) if tool_use is not None else self._default
        self._special_tokens = dict(special_tokens)

    def render(self, body: Mapping[str, Any]) -> str:
        """The prompt text of a chat body, as vLLM renders it; a bad body or a template
        error is a ``RequestError`` (400)."""
        add_generation = request_flag(body, "add_generation_prompt", True)
        cont = request_flag(body, "continue_final_message", False)
        if add_generation and cont:
            raise RequestError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                param="continue_final_message",
            )
        kw = template_kwargs(body, add_generation, cont)
        compiled = self._default if kw.get("tools") is None else self._tool_use
        messages = conversation(body.get("messages"), compiled.content_format)
        messages = developer_as_system(messages, compiled.source)
        try:
            return self._render(compiled, messages, kw)
        except RequestError:
            raise
        except Exception as exc:
            raise RequestError(_template_reason(exc), param="messages") from exc

    def _render(
        self, compiled: _Compiled, conversation: list[dict[str, Any]], kw: dict[str, Any]
    ) -> str:
        documents = kw.get("documents")
        if documents is not None and not all(isinstance(d, dict) for d in documents):
            raise RequestError("'documents' must be a list of objects", param="documents")
        own = {k: v for k, v in kw.items() if k in compiled.variables and k not in _HF_PARAMS}
        final = None
        if kw.get("continue_final_message"):
            final = _tag_final_message(conversation, compiled.source)
        text = compiled.template.render(
            **(self._special_tokens | own),
            messages=conversation,
            tools=kw.get("tools"),
            documents=documents,
            add_generation_prompt=kw.get("add_generation_prompt", False),
        )
        return text if final is None else _cut_at_tag(text, final)


def _template_reason(exc: BaseException) -> str:
    """The most specific reason in an error chain (a template's own message)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, jinja2.TemplateError):
            return str(current)
        current = current.__cause__ or current.__context__
    return str(exc)


def _tag_final_message(conversation: list[dict[str, Any]], source: str) -> str:
    """HF's continue_final_message: mark the end of the last message's text."""
    last = conversation[-1]
    final = last.get("content")
    if final is None:
        raise RequestError(
            "continue_final_message: the final message has no content", param="messages"
        )
    if "content" not in source:
        raise RequestError(
            "continue_final_message: the chat template has no 'content'", param="messages"
        )
    if isinstance(final, list):
        for part in reversed(final):
            if "text" in part:
                text = str(part["text"])
                part["text"] = text + _CONTINUE_TAG
                return text
        raise RequestError(
            "continue_final_message: no text to continue in the final message", param="messages"
        )
    last["content"] = str(final) + _CONTINUE_TAG
    return str(final)


def _cut_at_tag(rendered: str, final: str) -> str:
    if final.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
        raise RequestError(
            "continue_final_message is set but the final message does not appear in the "
            "chat after applying the chat template",
            param="messages",
        )
    at = rendered.rindex(_CONTINUE_TAG.strip())
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()


# --- content format: does the template loop over message content? (vLLM's detection)


class _NotAName(Exception):
    pass


def _content_format(ast: nodes.Template) -> ContentFormat:
    try:
        next(_content_loops(ast))
    except (StopIteration, _NotAName):  # vLLM: an unexpected AST counts as "string"
        return "string"
    return "openai"


def _is_name(node: nodes.Node, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _accesses(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """``node`` reads ``name`` (or its item ``key``), through filters, tests, slices."""
    if isinstance(node, nodes.Filter):
        return node.node is not None and _accesses(node.node, name, key)
    if isinstance(node, nodes.Test):
        return _accesses(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _accesses(node.node, name, key)
    if key is None:
        return _is_name(node, name)
    if isinstance(node, nodes.Getitem):
        return (
            _is_name(node.node, name)
            and isinstance(node.arg, nodes.Const)
            and node.arg.value == key
        )
    return isinstance(node, nodes.Getattr) and _is_name(node.node, name) and node.attr == key


def _target(node: nodes.Node) -> str:
    if not isinstance(node, nodes.Name):
        raise _NotAName
    return node.name


def _aliases(root: nodes.Template, name: str) -> list[str]:
    """``name`` and the variables ``{% set %}`` from it, transitively."""
    out, queue, seen = [name], deque([name]), {name}
    while queue:
        current = queue.popleft()
        for assign in root.find_all(nodes.Assign):
            if _accesses(assign.node, current):
                lhs = _target(assign.target)
                out.append(lhs)
                if lhs not in seen:
                    seen.add(lhs)
                    queue.append(lhs)
    return out


def _message_vars(root: nodes.Template) -> Iterator[str]:
    names = _aliases(root, "messages")
    for loop in root.find_all(nodes.For):
        if any(_accesses(loop.iter, n) for n in names):
            yield _target(loop.target)


def _macro_content_params(root: nodes.Template, message_vars: list[str]) -> dict[int, set[str]]:
    """Loop id -> the macro parameters (of the macro holding the loop) that receive a
    message's content; loops in macros with none map to an empty set."""
    by_loop: dict[int, set[str]] = {}
    for macro in root.find_all(nodes.Macro):
        params = [a.name for a in macro.args]
        found: set[str] = set()
        for call in root.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(params) and any(_accesses(arg, v, "content") for v in message_vars):
                    found.add(params[i])
            for kw in call.kwargs:
                if kw.key in params and any(
                    _accesses(kw.value, v, "content") for v in message_vars
                ):
                    found.add(kw.key)
        for loop in macro.find_all(nodes.For):
            by_loop[id(loop)] = found
    return by_loop


def _content_loops(root: nodes.Template) -> Iterator[str]:
    message_vars = list(_message_vars(root))
    in_macros = _macro_content_params(root, message_vars)
    for loop in root.find_all(nodes.For):
        if _iterates_content(loop.iter, message_vars, in_macros.get(id(loop))):
            yield _target(loop.target)


def _iterates_content(it: nodes.Node, message_vars: list[str], params: set[str] | None) -> bool:
    """A loop over ``<message>.content``, over a macro parameter bound to one, or over a
    bare ``content`` outside macros (``params`` None: the loop is in no macro)."""
    if any(_accesses(it, v, "content") for v in message_vars):
        return True
    if not isinstance(it, nodes.Name):
        return False
    return it.name in params if params is not None else it.name == "content"


# --- the tokenizer -----------------------------------------------------------------


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"models.*.tokenizer: cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _tokenizer_config(folder: Path) -> dict[str, Any]:
    """``tokenizer_config.json``, with the legacy ``special_tokens_map.json`` merged in
    when the config has no ``added_tokens_decoder`` (as transformers reads them)."""
    config = _read_json(folder / "tokenizer_config.json")
    if "added_tokens_decoder" not in config:
        config |= _read_json(folder / "special_tokens_map.json")
    return config


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens transformers passes to a chat template."""
    out = {k: t for k in _NAMED_TOKENS if (t := _token_text(config.get(k))) is not None}
    for key, value in config.items():
        is_added = isinstance(value, dict) and value.get("__type") == "AddedToken"
        if key.endswith("_token") and key not in out and (isinstance(value, str) or is_added):
            out[key] = str(_token_text(value))
    for key in ("extra_special_tokens", "model_specific_special_tokens"):
        named = config.get(key)
        if isinstance(named, dict):
            out |= {k: t for k, v in named.items() if (t := _token_text(v)) is not None}
    return out


def _template_sources(
    folder: Path, config: Mapping[str, Any], path: str | None
) -> tuple[str | None, str | None]:
    """(default template, ``tool_use`` template or None)."""
    if path is not None:
        try:
            return Path(path).read_text(encoding="utf-8"), None
        except OSError as exc:
            raise ConfigError(f"models.*.chat_template: cannot read {path}: {exc}") from exc
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), None
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        default, tool_use = named.get("default"), named.get("tool_use")
        if not isinstance(default, str):
            raise ConfigError(f"{folder}/tokenizer_config.json: no 'default' chat template")
        return default, tool_use if isinstance(tool_use, str) else None
    return (source if isinstance(source, str) else None), None


def _add_special_tokens(tok: Any, config: Mapping[str, Any], specials: Mapping[str, str]) -> None:
    """transformers 5 makes every named (and listed extra) special token an added
    special token: matched whole, before pre-tokenisation."""
    from tokenizers import AddedToken

    present = {t.content for t in tok.get_added_tokens_decoder().values()}
    extra = config.get("extra_special_tokens", config.get("additional_special_tokens"))
    listed = [t for v in extra if (t := _token_text(v))] if isinstance(extra, list) else []
    missing = [t for t in dict.fromkeys([*specials.values(), *listed]) if t not in present]
    if missing:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])


def load_exact_tokenizer(
    tokenizer_path: str,
    chat_template_path: str | None,
    name: str = "",
    self_check_every: int = SELF_CHECK_EVERY,
) -> ExactTokenizer:
    """The tokenizer at ``tokenizer_path`` and the chat template (see the module
    docstring for where it comes from); ``ConfigError`` when either cannot be loaded.
    ``name`` (the model, for logs) and ``self_check_every``: the piece cache's."""
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:  # pragma: no cover - the 'tokenizer' extra
        raise ConfigError("models.*.tokenizer needs the 'tokenizers' package") from exc
    try:
        tok = Tokenizer.from_file(tokenizer_path)
    except Exception as exc:
        raise ConfigError(f"models.*.tokenizer: cannot load {tokenizer_path}: {exc}") from exc
    folder = Path(tokenizer_path).parent
    config = _tokenizer_config(folder)
    specials = _special_tokens(config)
    _add_special_tokens(tok, config, specials)
    source, tool_use = _template_sources(folder, config, chat_template_path)
    if source is None:
        log.warning("no chat template for %s: chat prompts are counted approximately", folder)
    template = ChatTemplate(source, specials, tool_use) if source is not None else None
    return ExactTokenizer(tok, template, name=name, self_check_every=self_check_every)
