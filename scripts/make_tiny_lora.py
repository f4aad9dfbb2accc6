"""Write a rank-2 LoRA adapter for the tiny model (scripts/make_tiny_model.py).

Usage: python scripts/make_tiny_lora.py MODEL_DIR OUT_DIR

PEFT's layout: ``adapter_config.json`` and ``adapter_model.safetensors`` with
``base_model.model.model.layers.{i}.self_attn.{q,v}_proj.lora_{A,B}.weight`` tensors
(A: rank x in, B: out x rank), seeded so every run writes the same bytes. Needs torch
and safetensors (the real-engines venv has both).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RANK = 2


def main(argv: list[str]) -> int:
    import torch
    from safetensors.torch import save_file

    model_dir, out = Path(argv[0]), Path(argv[1])
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    outs = {"q_proj": heads * head_dim, "v_proj": cfg["num_key_value_heads"] * head_dim}
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj, out_dim in outs.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, hidden, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_dim, RANK, generator=gen) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()},
        str(out / "adapter_model.safetensors"),
    )
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0, "target_modules": sorted(outs), "bias": "none",
        "fan_in_fan_out": False, "modules_to_save": None,
        "base_model_name_or_path": str(model_dir),
    }  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
