"""Which config changes go live (gateway/reload.py) and the move rules
(gateway/registry/moves.py), without servers."""

from __future__ import annotations

from typing import Any

import pytest

from kiloserve.errors import ConflictError, RequestError
from kiloserve.gateway.config import parse_gateway_config
from kiloserve.gateway.registry.moves import MoveLedger, new_move_id, parse_move
from kiloserve.gateway.registry.record import RegistryRecord, decode_record, encode_record
from kiloserve.gateway.reload import changed_fields, restart_fields
from kiloserve.routing.config import BackendConfig

BASE: dict[str, Any] = {"backends": [{"url": "http://127.0.0.1:9", "name": "b0"}]}


def _cfg(**kw: Any) -> Any:
    return parse_gateway_config({**BASE, **kw})


@pytest.mark.parametrize(
    ("change", "changed", "fixed"),
    [
        ({}, [], []),
        ({"policy": {"name": "canary", "params": {"splits": {"v2": 0.1}}}}, ["policy"], []),
        ({"backends": [{"url": "http://127.0.0.1:9", "name": "b0", "weight": 2}]},
         ["backends"], []),
        ({"max_in_flight": 5, "retries": 0}, ["retries", "max_in_flight"], []),
        ({"admission": {"limits": {"max_output_tokens": 100}}}, ["admission.limits"],
         ["auth.keys / admission.limits (turning flow control on or off)"]),
        ({"port": 1, "workers": _cfg().workers + 1}, ["port", "workers"], ["port", "workers"]),
        ({"admission": {"enabled": True}}, ["admission"], ["admission",
         "auth.keys / admission.limits (turning flow control on or off)"]),
        ({"registry": {"kind": "etcd", "etcd": ["127.0.0.1:2379"]}}, ["registry"], ["registry"]),
    ],
)  # fmt: skip
def test_live_and_restart_fields(
    change: dict[str, Any], changed: list[str], fixed: list[str]
) -> None:
    old, new = _cfg(), _cfg(**change)
    assert sorted(changed_fields(old, new)) == sorted(changed)
    assert restart_fields(old, new) == fixed


def test_admission_limits_change_live_once_flow_control_is_on() -> None:
    old = _cfg(admission={"limits": {"max_output_tokens": 100}})
    new = _cfg(admission={"limits": {"max_output_tokens": 50}})
    assert changed_fields(old, new) == ["admission.limits"]
    assert restart_fields(old, new) == []


def test_ledger_applies_once_and_refuses_stale() -> None:
    ledger, calls = MoveLedger(), []
    move = new_move_id()
    assert ledger.move("b0", move, 0, lambda: calls.append(1)).as_json() == {
        "applied": True, "version": 1,
    }  # fmt: skip
    assert not ledger.move("b0", move, 0, lambda: calls.append(2)).applied
    with pytest.raises(ConflictError, match="expected version 0, it is at version 1"):
        ledger.move("b0", new_move_id(), 0, lambda: calls.append(3))
    assert ledger.move("b0", None, None, lambda: calls.append(4)).version == 2
    assert calls == [1, 4] and ledger.version("other") == 0


def test_parse_move() -> None:
    move = new_move_id()
    assert parse_move(None) == (None, None)
    assert parse_move({"move_id": move.upper(), "expected_version": 3}) == (move, 3)
    for bad in ({"move_id": "nope"}, {"expected_version": True}, {"expected_version": "1"}, []):
        with pytest.raises(RequestError):
            parse_move(bad)


def test_record_keeps_its_move_ids() -> None:
    record = RegistryRecord(BackendConfig(url="http://h:1", name="b"), True, None, ("a", "b"))
    assert decode_record(encode_record(record), "k") == record
    assert decode_record(b'{"url": "http://h:1", "moves": "x"}', "k").move_ids == ()
