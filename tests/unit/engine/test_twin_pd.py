"""The twin's P/D pieces without HTTP: kv_transfer_params, held KV, the engine flags."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import pytest

from kiloserve.engine.cli import add_arguments, config_from_args
from kiloserve.engine.kv_holds import DEFAULT_HOLD_TIMEOUT_S, KvHolds
from kiloserve.engine.kv_params import (
    RemoteDecode,
    RemotePrefill,
    parse_kv_transfer_params,
    prefill_answer,
)
from kiloserve.engine.twin import TwinConfig, build_twin
from kiloserve.errors import ConfigError, RequestError

DECODE_PARAMS: dict[str, Any] = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e1",
    "remote_block_ids": [3, 4, 5], "remote_host": "10.0.0.7", "remote_port": 8100,
    "remote_request_id": "req-9", "num_tokens": 40, "tp_size": 2,
}  # fmt: skip


def test_absent_or_false_flags_are_a_plain_request() -> None:
    assert parse_kv_transfer_params({}, "both") is None
    assert parse_kv_transfer_params({"kv_transfer_params": None}, "decode") is None
    plain = {"kv_transfer_params": {"do_remote_decode": False, "do_remote_prefill": None}}
    assert parse_kv_transfer_params(plain, "prefill") is None


def test_prefill_leg_as_vllms_proxy_sends_it() -> None:
    body = {"kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
            "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
            "remote_port": None}, "stream": False}  # fmt: skip
    assert parse_kv_transfer_params(body, "prefill") == RemoteDecode()
    assert parse_kv_transfer_params(body, "both") == RemoteDecode()


def test_decode_leg_round_trips_the_prefill_answer() -> None:
    answer = prefill_answer(
        engine_id="e1", block_ids=[3, 4, 5], host="10.0.0.7", port=8100, tp_size=2,
        request_id="req-9", num_tokens=40,
    )  # fmt: skip
    assert answer == DECODE_PARAMS
    leg = parse_kv_transfer_params({"kv_transfer_params": answer}, "decode")
    assert leg == RemotePrefill("e1", (3, 4, 5), "10.0.0.7", 8100, "req-9", 40, 2)
    assert isinstance(leg, RemotePrefill)
    assert leg.release_url == "http://10.0.0.7:8100/kv_transfer/release"
    assert leg.num_transferred_tokens(40) == 39  # all but the last prompt token
    assert leg.num_transferred_tokens(60) == 39  # no more than the prefill engine ran
    assert leg.num_transferred_tokens(1) == 0


def test_ipv6_release_url_is_bracketed() -> None:
    params = {**DECODE_PARAMS, "remote_host": "::1"}
    leg = parse_kv_transfer_params({"kv_transfer_params": params}, "both")
    assert isinstance(leg, RemotePrefill)
    assert leg.release_url == "http://[::1]:8100/kv_transfer/release"


@pytest.mark.parametrize(
    ("change", "role", "param"),
    [
        ({"remote_engine_id": ""}, "decode", "kv_transfer_params.remote_engine_id"),
        ({"remote_port": 70000}, "decode", "kv_transfer_params.remote_port"),
        ({"remote_port": True}, "decode", "kv_transfer_params.remote_port"),
        ({"remote_port": None}, "decode", "kv_transfer_params.remote_port"),
        ({"remote_block_ids": [-1]}, "decode", "kv_transfer_params.remote_block_ids"),
        ({"num_tokens": 0}, "decode", "kv_transfer_params.num_tokens"),
        ({"tp_size": "2"}, "decode", "kv_transfer_params.tp_size"),
        ({}, "prefill", "kv_transfer_params.do_remote_prefill"),
    ],
)
def test_bad_decode_legs_name_the_field(change: dict[str, Any], role: str, param: str) -> None:
    with pytest.raises(RequestError) as info:
        parse_kv_transfer_params({"kv_transfer_params": {**DECODE_PARAMS, **change}}, role)
    assert info.value.param == param
    assert info.value.status == 400


class _Core:
    def __init__(self) -> None:
        self.released: list[str] = []

    def release(self, seq_id: str) -> bool:
        self.released.append(seq_id)
        return True


async def test_holds_release_once_and_expire() -> None:
    core = _Core()
    expired: list[str] = []
    holds = KvHolds(core, 0.05, lambda held: expired.append(held.request_id))
    assert holds.hold("r", "seq-1", [1, 2]) == "r"
    assert holds.hold("r", "seq-2", [3]) == "r-seq-2"  # the id is taken: made unique
    assert (holds.num_held_requests, holds.num_held_blocks) == (2, 3)
    held = holds.release("r")
    assert held is not None and held.block_ids == [1, 2]
    assert holds.release("r") is None
    assert core.released == ["seq-1"]
    await asyncio.sleep(0.15)
    assert expired == ["r-seq-2"] and core.released == ["seq-1", "seq-2"]
    assert (holds.num_released, holds.num_expired, holds.num_held_requests) == (1, 1, 0)


async def test_freeing_held_kv_wakes_the_twin_loop() -> None:
    """A request waiting for blocks held by a prefill leg is scheduled when the decode
    engine releases them, not at the loop's next idle poll (``IDLE_POLL_S``)."""
    twin = build_twin(TwinConfig(gpu="H100", model="llama-3.1-8b", role="prefill"))
    holds = twin.loop.holds
    assert holds is not None
    wake = twin.loop._wake
    for free in (lambda: holds.release("r"), holds.close):
        holds.hold("r", "seq-1", [1, 2])
        wake.clear()
        free()
        assert wake.is_set()


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--gpu", "H100", "--model", "llama-3.1-8b", "--port", "0", *argv])


def test_engine_flags_reach_the_config() -> None:
    config = config_from_args(_parse())
    assert (config.role, config.kv_cpu_gib, config.kv_remote_gib) == ("both", 0.0, 0.0)
    assert (config.kv_link, config.kv_hold_timeout_s) == ("network", DEFAULT_HOLD_TIMEOUT_S)
    config = config_from_args(
        _parse("--role", "decode", "--kv-cpu-gib", "64", "--kv-remote-gib", "1.5",
               "--kv-link", "nvlink", "--kv-hold-timeout-s", "30")
    )  # fmt: skip
    assert (config.role, config.kv_cpu_gib, config.kv_remote_gib) == ("decode", 64.0, 1.5)
    assert (config.kv_link, config.kv_hold_timeout_s) == ("nvlink", 30.0)


@pytest.mark.parametrize(
    "argv",
    [
        ("--role", "prefil"),
        ("--kv-link", "ib"),
        ("--kv-cpu-gib", "-1"),
        ("--kv-remote-gib", "nan"),
        ("--kv-hold-timeout-s", "0"),
    ],
)
def test_bad_engine_flags_exit_2(argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        _parse(*argv)
    assert info.value.code == 2
    assert argv[0] in capsys.readouterr().err


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [
        ("role", "middle", "--role"),
        ("kv_link", "ib", "--kv-link"),
        ("kv_hold_timeout_s", -1.0, "--kv-hold-timeout-s"),
        ("kv_cpu_gib", -2.0, "--kv-cpu-gib"),
    ],
)
def test_bad_twin_config_is_a_config_error_naming_the_flag(
    field: str, value: object, flag: str
) -> None:
    config = TwinConfig(gpu="H100", model="llama-3.1-8b", port=0, **{field: value})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=flag):
        build_twin(config)
