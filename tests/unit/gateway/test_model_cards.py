"""gateway.model_cards.merge_cards: vLLM's card fields from the backends' cards."""

from __future__ import annotations

from kiloserve.gateway.model_cards import merge_cards


def test_first_root_and_smallest_context_win() -> None:
    cards = [
        {"id": "m", "root": "/w/m", "parent": None, "max_model_len": 8192},
        {"id": "m", "root": "/other", "parent": "base", "max_model_len": 4096},
    ]
    card = merge_cards("m", cards)
    assert card["root"] == "/w/m" and card["parent"] == "base"
    assert card["max_model_len"] == 4096


def test_no_backend_card_still_has_root() -> None:
    card = merge_cards("m", [])
    assert card == {
        "id": "m", "object": "model", "created": 0, "owned_by": "kiloserve",
        "root": "m", "parent": None,
    }  # fmt: skip
