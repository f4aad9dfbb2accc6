"""The ``etcd-down`` drill's checks read ``kiloserve_gateway_registry_up`` per worker
(``chaos/scenarios.py``): a gateway with ``--workers 2`` has one series per worker."""

from __future__ import annotations

import asyncio

import pytest

from kiloserve.chaos import scenarios


class _Env:
    """What the checks read of a drill environment: the gateway's ``/metrics`` page."""

    def __init__(self, page: str) -> None:
        self.page = page

    async def metric(self, prefix: str) -> float:
        return sum(await self.metric_values(prefix))

    async def metric_values(self, prefix: str) -> list[float]:
        return [
            float(line.rsplit(" ", 1)[1])
            for line in self.page.splitlines()
            if line.startswith(prefix)
        ]


_ONE = "kiloserve_gateway_registry_up %d\n"
_TWO = (
    'kiloserve_gateway_registry_up{worker="0"} %d\nkiloserve_gateway_registry_up{worker="1"} %d\n'
)


@pytest.mark.parametrize(
    ("page", "down", "up"),
    [
        (_ONE % 1, False, True),
        (_ONE % 0, True, False),
        (_TWO % (1, 1), False, True),  # before: a sum of 2, never "up" (recover_s null)
        (_TWO % (0, 1), False, False),  # one worker still sees it down: not recovered
        (_TWO % (0, 0), True, False),
        ("", False, False),  # no such gauge: neither
    ],
)
def test_registry_checks_need_every_worker(page: str, down: bool, up: bool) -> None:
    env = _Env(page)
    assert asyncio.run(scenarios._registry_down(env, "v")) is down  # type: ignore[arg-type]
    assert asyncio.run(scenarios._registry_up(env, "v")) is up  # type: ignore[arg-type]
