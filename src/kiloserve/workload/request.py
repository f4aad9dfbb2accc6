"""Plain request specs and the deterministic ``Workload`` that yields them.

A workload knows nothing about HTTP: the benchmark client turns each ``RequestSpec``
into a streaming request, the simulator turns it into an arrival event. Iterating a
``Workload`` twice yields the identical sequence (same ids, arrival times, lengths and
prompt text), which is what makes runs against different policies comparable.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import ClassVar, Final

from kiloserve.values import Value

__all__ = ["RequestSpec", "Workload"]


class RequestSpec(Value):
    """One request to send.

    ``arrival_s`` is the send time in seconds from the start of the run, or ``None``
    for closed-loop workloads (the client sends as soon as a slot frees up).
    ``prompt`` has exactly ``input_tokens`` tokens under ``kiloserve.tokens.tokenize``
    (or is empty when the workload was built with ``with_prompts=False``). A read-only
    value (``kiloserve.values.Value``); ``spec.replaced(output_tokens=2)`` copies.
    """

    _FIELDS: ClassVar[tuple[str, ...]] = (
        "request_id",
        "arrival_s",
        "input_tokens",
        "output_tokens",
        "prompt",
        "session_id",
        "user",
        "prefix_group",
    )
    __slots__ = _FIELDS

    def __init__(
        self,
        request_id: str,
        arrival_s: float | None,
        input_tokens: int,
        output_tokens: int,
        prompt: str,
        session_id: str | None = None,
        user: str | None = None,
        prefix_group: str | None = None,
    ) -> None:
        self.request_id: Final = request_id
        self.arrival_s: Final = arrival_s
        self.input_tokens: Final = input_tokens
        self.output_tokens: Final = output_tokens
        self.prompt: Final = prompt
        self.session_id: Final = session_id
        self.user: Final = user
        self.prefix_group: Final = prefix_group

    @property
    def is_closed_loop(self) -> bool:
        return self.arrival_s is None


@dataclass(frozen=True, slots=True)
class Workload:
    """A named, seeded, re-iterable sequence of ``RequestSpec``.

    ``make_iter`` builds a fresh iterator each time, so the workload can be replayed
    identically (and prompts are generated lazily: a Mooncake replay never holds all
    prompts in memory). ``num_requests`` is ``None`` when the sequence is unbounded
    (closed-loop runs limited by duration).
    """

    name: str
    seed: int
    make_iter: Callable[[], Iterator[RequestSpec]] = field(repr=False)
    num_requests: int | None = None
    params: dict[str, object] = field(default_factory=dict)

    def __iter__(self) -> Iterator[RequestSpec]:
        return self.make_iter()

    @property
    def is_bounded(self) -> bool:
        return self.num_requests is not None

    def take(self, num_requests: int) -> list[RequestSpec]:
        """The first ``num_requests`` specs (fewer if the workload is shorter)."""
        out: list[RequestSpec] = []
        for spec in self:
            if len(out) >= num_requests:
                break
            out.append(spec)
        return out

    def describe(self) -> dict[str, object]:
        """JSON-friendly description recorded in reports."""
        return {
            "name": self.name,
            "seed": self.seed,
            "num_requests": self.num_requests,
            **self.params,
        }
