"""Multi-turn chat sessions: ``sessions:users=U,turns=K[,input=DIST,output=DIST,system_tokens=T]``.

Requests are dealt to users round robin: request j belongs to user ``j % U`` and is
turn ``(j // U) % K`` of that user's current session; after K turns a user starts a
new session. Turn k's prompt is turn k-1's prompt, then a stand-in for the model's
previous answer (as many tokens as turn k-1 asked for), then ``input`` new tokens, so
consecutive turns of a session share a byte-identical prefix (what session affinity
and prefix caching exploit). ``system_tokens`` adds a system prompt shared by every
session. Because turns are dealt in order, turn k of a session never arrives before
turn k-1 in an open-loop run; a closed-loop run may send them concurrently.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from kiloserve.errors import ConfigError
from kiloserve.workload.prompts import (
    NS_ANSWER,
    NS_GROUP,
    NS_UNIQUE,
    PromptBuilder,
    Segment,
    split_tokens,
)
from kiloserve.workload.request import RequestSpec
from kiloserve.workload.spec import Dist, check_keys, int_option, parse_dist
from kiloserve.workload.synthetic import STREAM_LENGTHS, sample_tokens

__all__ = ["SessionConfig", "parse_sessions", "session_requests"]

_KEYS = ("users", "turns", "input", "output", "system_tokens")


@dataclass(frozen=True, slots=True)
class SessionConfig:
    num_users: int
    num_turns: int
    input: Dist
    output: Dist
    system_tokens: int = 0


def parse_sessions(options: Mapping[str, str]) -> SessionConfig:
    """Options of a ``sessions:`` spec (defaults: input lognormal(200,0.8),
    output lognormal(150,0.5), no system prompt)."""
    check_keys("sessions", options, _KEYS)
    num_users = int_option(options, "users", 0)
    num_turns = int_option(options, "turns", 0)
    if num_users < 1 or num_turns < 1:
        raise ConfigError("sessions workload needs users=N and turns=K, both >= 1")
    return SessionConfig(
        num_users=num_users,
        num_turns=num_turns,
        input=parse_dist(options.get("input", "lognormal(200,0.8)")),
        output=parse_dist(options.get("output", "lognormal(150,0.5)")),
        system_tokens=int_option(options, "system_tokens", 0),
    )


def session_requests(
    config: SessionConfig,
    *,
    seed: int,
    arrivals: Iterator[float | None],
    builder: PromptBuilder,
    with_prompts: bool = True,
) -> Iterator[RequestSpec]:
    """Endless stream of session turns (see module docstring)."""
    rng = np.random.default_rng([seed, STREAM_LENGTHS])
    system = split_tokens((NS_GROUP, seed, 0), config.system_tokens)
    history: dict[int, tuple[list[Segment], int]] = {}  # user -> (segments, last output)
    for j, arrival_s in enumerate(arrivals):
        user = j % config.num_users
        turn = (j // config.num_users) % config.num_turns
        wave = j // (config.num_users * config.num_turns)
        session = wave * config.num_users + user
        new_text = split_tokens((NS_UNIQUE, seed, j), sample_tokens(config.input, rng))
        output_tokens = sample_tokens(config.output, rng)
        if turn == 0:
            segments = system + new_text
        else:
            previous, previous_output = history[user]
            answer = split_tokens((NS_ANSWER, seed, session, turn - 1), previous_output)
            segments = previous + answer + new_text
        history[user] = (segments, output_tokens)
        yield RequestSpec(
            request_id=f"s{session:05d}-t{turn}",
            arrival_s=arrival_s,
            input_tokens=sum(n for _, n in segments),
            output_tokens=output_tokens,
            prompt=builder.render(segments) if with_prompts else "",
            session_id=f"session-{session}",
            user=f"user-{user}",
        )
