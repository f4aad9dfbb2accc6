"""Build a tiny, randomly initialised Llama with a locally trained tokenizer (and a GGUF).

Runs in the real-engine venv (``.cache/real-venv``: torch, transformers, tokenizers,
gguf), with no network, in seconds, and writes the same bytes on every run::

    .cache/real-venv/bin/python scripts/make_tiny_model.py --out .cache/tiny-model

The output directory is a HuggingFace model folder (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json`` with a ChatML chat
template) that vLLM loads, plus ``tiny.gguf`` for llama.cpp's ``llama-server``. The
weights are random: the text it generates is meaningless (and often not valid UTF-8 at
token boundaries); tests assert on protocol and token accounting, never on text.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import re
from pathlib import Path
from typing import Any

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # deterministic BPE training
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SEED = 1234
VOCAB_SIZE = 2048
HIDDEN = 128
NUM_LAYERS = 2
NUM_HEADS = 2
FFN = 256
MAX_POSITIONS = 2048
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Standard-library modules whose docstrings are the tokenizer's training text.
CORPUS_MODULES = (
    "argparse", "asyncio", "base64", "collections", "contextlib", "csv", "dataclasses",
    "datetime", "decimal", "email", "enum", "functools", "heapq", "http.client", "inspect",
    "io", "itertools", "json", "logging", "math", "os", "pathlib", "pickle", "random", "re",
    "shutil", "socket", "sqlite3", "statistics", "string", "subprocess", "tempfile",
    "textwrap", "threading", "typing", "unittest", "urllib.parse", "uuid", "zipfile",
)  # fmt: skip
_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def corpus_lines() -> list[str]:
    """Docstrings of the corpus modules and their public members, in a fixed order."""
    lines: list[str] = []
    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        docs = [inspect.getdoc(module) or ""]
        for attr in sorted(a for a in dir(module) if not a.startswith("_")):
            docs.append(inspect.getdoc(getattr(module, attr, None)) or "")
        for doc in docs:
            lines.extend(_ADDRESS.sub("0x0", line) for line in doc.splitlines() if line.strip())
    return lines


def train_tokenizer(out: Path) -> Any:
    """A byte-level BPE tokenizer with ``VOCAB_SIZE`` entries, saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    return tok


def write_tokenizer_config(out: Path) -> None:
    added = {
        str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                 "normalized": False, "single_word": False}
        for i, t in enumerate(SPECIAL_TOKENS)
    }  # fmt: skip
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def build_model(out: Path, vocab_size: int, bos_id: int, eos_id: int) -> Any:
    """Random Llama weights (fixed seed) saved as config.json + model.safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    return model


def _permute_rope(weight: Any, num_heads: int) -> Any:
    """HF's rotate-half q/k layout -> GGUF's interleaved layout (as llama.cpp's converter)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _gguf_tensors(model: Any) -> list[tuple[str, Any]]:
    import numpy as np

    state = {k: v.float().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    out = [("token_embd.weight", state["model.embed_tokens.weight"])]
    hf = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
          "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}  # fmt: skip
    for layer in range(NUM_LAYERS):
        for gguf_name, hf_name in hf.items():
            w = state[f"model.layers.{layer}.{hf_name}.weight"]
            if gguf_name in ("attn_q", "attn_k"):
                w = _permute_rope(w, NUM_HEADS)
            out.append((f"blk.{layer}.{gguf_name}.weight", np.ascontiguousarray(w)))
    out.append(("output_norm.weight", state["model.norm.weight"]))
    out.append(("output.weight", state["lm_head.weight"]))
    return out


def write_gguf(path: Path, model: Any, tokenizer: Any, bos_id: int, eos_id: int) -> None:
    """The same weights and vocabulary as a GGUF file (f32) for llama.cpp."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("kiloserve-tiny")
    writer.add_context_length(MAX_POSITIONS)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(NUM_LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_HEADS)
    writer.add_rope_dimension_count(HIDDEN // NUM_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_gguf_vocab(writer, tokenizer, bos_id, eos_id)
    for name, tensor in _gguf_tensors(model):
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_gguf_vocab(writer: Any, tokenizer: Any, bos_id: int, eos_id: int) -> None:
    import gguf

    vocab = tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [
        gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens
    ]
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(bos_id)
    writer.add_eos_token_id(eos_id)
    writer.add_pad_token_id(bos_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--no-gguf", action="store_true", help="skip the GGUF file")
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(out)
    write_tokenizer_config(out)
    bos_id = tokenizer.token_to_id("<|endoftext|>")
    eos_id = tokenizer.token_to_id("<|im_end|>")
    model = build_model(out, tokenizer.get_vocab_size(), bos_id, eos_id)
    if not args.no_gguf:
        write_gguf(out / "tiny.gguf", model, tokenizer, bos_id, eos_id)
    print(f"tiny model in {out} (vocab {tokenizer.get_vocab_size()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
