"""The gateway's exact prompt ids equal the real stack's: vLLM's own ``/tokenize``, and
transformers' ``AutoTokenizer.apply_chat_template(tokenize=True)`` (run in the
real-engine venv through a subprocess: transformers is not a kiloserve dependency).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from conftest import SERVED_MODEL, RealEnv, http_json
from kiloserve.gateway.config import parse_gateway_config
from kiloserve.gateway.profile import Profiler
from kiloserve.launch.cluster import LocalCluster
from kiloserve.tokens import prefix_block_hashes

pytestmark = [pytest.mark.real_engine, pytest.mark.timeout(300)]

tokenizers = pytest.importorskip("tokenizers")

SYSTEM = {"role": "system", "content": "You are terse."}
USER_PARTS = {
    "role": "user",
    "content": [{"type": "text", "text": "Split the string."}, {"type": "text", "text": "ü€"}],
}
VLLM_BODIES: list[dict[str, Any]] = [
    {"messages": [SYSTEM, USER_PARTS]},
    {"messages": [SYSTEM, USER_PARTS], "add_generation_prompt": False},
    {
        "messages": [USER_PARTS, {"role": "assistant", "content": "Return a list"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    {"messages": [SYSTEM, USER_PARTS, {"role": "developer", "content": "Use commas."}]},
    {"messages": [SYSTEM, USER_PARTS], "add_special_tokens": True},
    {"prompt": "Return a list of the words <|im_start|> in the string."},
]


def _gateway_ids(prof: Profiler, body: dict[str, Any]) -> tuple[int, tuple[int, ...]]:
    """(count, hashes) with ``block_size`` 1: one hash per token, equal iff the ids are."""
    info = prof.profile("r", {"model": SERVED_MODEL, **body}, {})
    return info.input_tokens, info.prefix_hashes


def _view(ids: list[int]) -> tuple[int, tuple[int, ...]]:
    return len(ids), tuple(prefix_block_hashes(ids, 1, 0))


def _profiler(tokenizer_json: Path) -> Profiler:
    models = {SERVED_MODEL: {"tokenizer": str(tokenizer_json)}}
    cfg = {"block_size": 1, "max_prefix_tokens": 100_000, "models": models}
    return Profiler(parse_gateway_config(cfg))


@pytest.mark.parametrize("body", VLLM_BODIES)
def test_gateway_ids_equal_vllms_tokenize(
    vllm_cluster: LocalCluster, real_env: RealEnv, body: dict[str, Any]
) -> None:
    engine = next(b.url for b in vllm_cluster.backends if b.name == "vllm-a")
    reply = http_json(engine + "/tokenize", {"model": SERVED_MODEL, **body})
    prof = _profiler(Path(real_env.model_dir) / "tokenizer.json")
    assert _gateway_ids(prof, body) == _view(reply["tokens"])


# --- transformers, on a tokenizer of our own with a BOS and a richer template ----------

TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] | trim }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL = {
    "type": "function",
    "function": {"name": "split", "description": None, "parameters": {"type": "object"}},
}
# (gateway body, the conversation vLLM hands to apply_chat_template, its kwargs)
HF_CASES: list[tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]] = [
    (
        {"messages": [SYSTEM, USER_PARTS]},
        [SYSTEM, {"role": "user", "content": "Split the string.\nü€"}],
        {"add_generation_prompt": True},
    ),
    (
        {"messages": [SYSTEM], "add_generation_prompt": False, "tools": [TOOL]},
        [SYSTEM],
        {"add_generation_prompt": False, "tools": [TOOL]},
    ),
]
_HF_SCRIPT = """
import json, sys
from transformers import AutoTokenizer
folder, cases = sys.argv[1], json.loads(sys.stdin.read())
tok = AutoTokenizer.from_pretrained(folder)
out = [tok.apply_chat_template(m, tokenize=True, return_dict=False, **kw) for m, kw in cases]
out.append(tok("Split the string.").input_ids)
print(json.dumps(out))
"""


def _write_tokenizer(folder: Path) -> None:
    """A byte-level BPE without a post-processor; tokenizer_config.json asks for a BOS
    (which transformers 5 ignores), the template writes one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["Split the string on whitespace.", "You are terse."] * 50, trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": True,
        "chat_template": TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def test_gateway_ids_equal_transformers_apply_chat_template(
    real_env: RealEnv, tmp_path: Path
) -> None:
    _write_tokenizer(tmp_path)
    cases = json.dumps([[messages, kw] for _, messages, kw in HF_CASES])
    run = subprocess.run(
        [real_env.python, "-c", _HF_SCRIPT, str(tmp_path)],
        input=cases,
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
        env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    *chats, completion = json.loads(run.stdout.strip().splitlines()[-1])
    prof = _profiler(tmp_path / "tokenizer.json")
    for (body, _, _), ids in zip(HF_CASES, chats, strict=True):
        assert _gateway_ids(prof, body) == _view(ids)
    # transformers 5 ignores the config's add_bos_token (a tokenizer.json exists): no BOS
    bos = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json")).token_to_id("<s>")
    assert completion[0] != bos and bos in chats[0]
    assert _gateway_ids(prof, {"prompt": "Split the string."}) == _view(completion)
