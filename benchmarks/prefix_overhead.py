"""Gateway CPU cost of exact prefix routing (KV events): per request and per event.

    .venv/bin/python benchmarks/prefix_overhead.py [--quick] [--tokenizer PATH]

Two targets (the KV-events issue), each against a baseline measured in the same run.

1. Tokenising and index lookup per request at 8k-token prompts: <= 1 ms of gateway
   CPU. Prompts: ``--tenants`` tenants, each with a 6,144-token system prompt, and a
   2,048-token tail unique to each request (8,192 tokens); the text is the standard
   library's docstrings, so it is English prose. Per request, best of ``--repeats``
   (CPU: ``time.process_time``, every thread of this process; wall: ``perf_counter``):

   (a) ``Profiler.profile`` of a /v1/completions and a /v1/chat/completions body,
       approximate (no tokenizer: the baseline) and exact (a byte-level BPE
       ``tokenizer.json`` with a ChatML template, trained here with ``tokenizers`` on
       the same docstrings; or ``--tokenizer``), with 2,048 tokens hashed into prefix
       blocks and with the whole prompt hashed (8,192, the gateway's default
       ``max_prefix_tokens``). Exact twice, both with the piece cache and its
       pre-token cuts (``gateway/exact_tokens.py``, ``gateway/pretoken_cuts.py``): the
       pieces encoded by ``tokenizers`` (before the fast encoder: the baseline) and by
       ``tiktoken`` (``gateway/fast_bpe.py``, the default where it is exact). Every
       measured request has a tail of its own (words drawn at random, new per body,
       ``per_fresh_call``), so no cache holds any of it; each tenant's system prompt
       was seen before, as a tenant's is;
   (b) the prefix lookup on an index filled by ``BlockStored`` events of 8 backends
       (each tenant's system prompt and earlier requests on 2 of them):
       ``KvEventCache.match_depths`` and ``cached_depths`` with the KV cache (what
       the policies call), against ``cached_depths`` without it (the policy's
       approximate index alone: the baseline);
   (c) a whole ``default`` policy decision on 8 and 64 backends with the KV cache in
       the snapshot, against the same decision without it;

   then (a) + (b) per body against the 1 ms target ("met" / "NOT met").

2. Event ingestion at 1,000 events/s: a publisher process (pyzmq PUB on 127.0.0.1, a
   random port per backend) sends vLLM-format batches (``kvevents.wire``, sequence
   numbers from 0 per publisher) to the gateway's own subscriber
   (``gateway.kvevents.KvEventSubscriber``, fed from a ``BackendTable``) on this
   process's asyncio loop for ``--window-s`` seconds. Printed: this process's CPU (all
   threads, libzmq's I/O thread too) as a fraction of one core over the window,
   against an idle window of the same length (subscribed, no events), and the
   difference per event (us/event). Each backend's stream repeats one request's
   life: a 32-block prefill ``BlockStored`` (16-token blocks, chained to the backend's
   shared 64-block system prompt), 8 one-block decode ``BlockStored`` (each the
   previous block's child) and a ``BlockRemoved`` of an older request's 40 blocks.

The box this was written on is a shared 2-core machine: best-of-N damps the noise,
but the figures still vary from run to run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import inspect
import itertools
import json
import math
import random
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kiloserve.gateway.config import parse_gateway_config
from kiloserve.gateway.exact_tokens import ExactTokenizer
from kiloserve.gateway.fast_bpe import fast_encoder_for
from kiloserve.gateway.profile import Profiler
from kiloserve.kvevents.feed import KvEventCache
from kiloserve.kvevents.index import KvBlockIndex
from kiloserve.kvevents.wire import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    encode_batch,
    encode_seq,
)
from kiloserve.policies import BackendState, ClusterSnapshot, RequestInfo, create_policy
from kiloserve.policies.prefix_index import PrefixIndex, cached_depths
from kiloserve.policies.scored import ScoredPolicy
from kiloserve.tokens import count_tokens, prefix_block_hashes, tokenize

TARGET_US = 1000.0
MODEL = "m"
BLOCK = 16
SYSTEM_TOKENS = 6144
TAIL_TOKENS = 2048
PROMPT_TOKENS = SYSTEM_TOKENS + TAIL_TOKENS
DEFAULT_CAP = parse_gateway_config({}).max_prefix_tokens  # the gateway's default (8,192)
CAPS = tuple(sorted({2048, DEFAULT_CAP, PROMPT_TOKENS}))
LOOKUP_BACKENDS = 8
DECISION_BACKENDS = (8, 64)
HOLDERS = 2  # backends holding each tenant's system prompt and earlier requests
EVENT_CHUNK_BLOCKS = 128  # blocks per BlockStored when filling the index (2k-token chunks)
VOCAB_SIZE = 8000
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS_MODULES = (
    "argparse", "asyncio", "base64", "collections", "contextlib", "csv", "dataclasses",
    "datetime", "decimal", "email", "enum", "functools", "heapq", "http.client", "inspect",
    "io", "itertools", "json", "logging", "math", "os", "pathlib", "pickle", "random", "re",
    "shutil", "socket", "sqlite3", "statistics", "string", "subprocess", "tempfile",
    "textwrap", "threading", "typing", "unittest", "urllib.parse", "uuid", "zipfile",
)  # fmt: skip
# the publisher's stream, per backend (see the module docstring)
TOPIC = b"kv-events"
PUB_SYSTEM_BLOCKS = 64
PUB_PREFILL_BLOCKS = 32
PUB_DECODE_EVENTS = 8
PUB_KEEP_REQUESTS = 64  # requests a backend keeps cached before it evicts the oldest
PUB_VOCAB = 32_000


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


# ------------------------------------------------------------------------ timing
@dataclass(frozen=True, slots=True)
class Timing:
    cpu_us: float
    wall_us: float


def per_call(
    fn: Callable[[Any], object], items: Sequence[Any], repeats: int, min_s: float
) -> Timing:
    """Best-of-``repeats`` mean CPU and wall microseconds per ``fn(item)``; each repeat
    runs over enough of ``items`` (and passes over them) to last about ``min_s``."""
    for item in items[:2]:
        fn(item)  # warm up
    started = time.perf_counter()
    fn(items[0])
    one_s = max(time.perf_counter() - started, 1e-7)
    count = max(1, min(len(items), math.ceil(min_s / one_s)))
    passes = max(1, math.ceil(min_s / (count * one_s)))
    batch = list(items[:count])
    calls = count * passes
    best_cpu = best_wall = math.inf
    gc.collect()
    for _ in range(repeats):
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for _ in range(passes):
            for item in batch:
                fn(item)
        cpu1, wall1 = time.process_time(), time.perf_counter()
        best_cpu = min(best_cpu, (cpu1 - cpu0) / calls)
        best_wall = min(best_wall, (wall1 - wall0) / calls)
    return Timing(best_cpu * 1e6, best_wall * 1e6)


# ------------------------------------------------------------------------ prompts
def corpus_words() -> list[str]:
    """The words of the docstrings of some standard-library modules and their public
    members (deterministic for one Python version): prompts and tokenizer training."""
    words: list[str] = []
    seen: set[str] = set()
    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        members = [getattr(module, a, None) for a in sorted(dir(module)) if a[:1] != "_"]
        for obj in (module, *members):
            doc = inspect.getdoc(obj) if obj is not None else None
            if doc and doc not in seen:
                seen.add(doc)
                words.extend(w for w in doc.split() if w.isascii() and w.isprintable())
    if len(words) < 20_000:
        raise SystemExit(f"only {len(words)} corpus words (docstrings stripped? run without -OO)")
    return words


def approx_text(head: str, words: list[str], start: int, num_tokens: int) -> str:
    """``head`` then corpus words from ``start`` (cyclically): exactly ``num_tokens``
    tokens under the approximation (words joined by single spaces add up)."""
    out: list[str] = []
    count = 0
    for word in itertools.chain(
        head.split(), itertools.islice(itertools.cycle(words), start, None)
    ):
        n = count_tokens(word)
        if count + n > num_tokens:
            word = word[: 4 * (num_tokens - count)]  # pieces are 4 characters
            n = num_tokens - count
        out.append(word)
        count += n
        if count >= num_tokens:
            return " ".join(out)
    raise AssertionError("unreachable")


def exact_cut(tok: Any, text: str, num_tokens: int) -> str:
    """The prefix of ``text`` that ``tok`` encodes to ``num_tokens`` tokens."""
    enc = tok.encode(text, add_special_tokens=False)
    if len(enc.ids) < num_tokens:
        raise SystemExit(f"text of {len(enc.ids)} tokens, {num_tokens} needed")
    return text[: enc.offsets[num_tokens - 1][1]]


def train_tokenizer(folder: Path, words: list[str]) -> Path:
    """A byte-level BPE ``tokenizer.json`` (BOS added by its post-processor) and a
    ``tokenizer_config.json`` with a ChatML template, as the tests build them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [" ".join(words[i : i + 64]) for i in range(0, len(words), 64)]
    tok.train_from_iterator(lines, trainer=trainer)
    bos = ("<s>", tok.token_to_id("<s>"))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[bos]
    )
    path = folder / "tokenizer.json"
    tok.save(str(path))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHATML}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@dataclass(slots=True)
class Prompts:
    """Per tenant: the system prompt and its request tails (the last one is measured;
    the others are earlier requests, already in the caches)."""

    systems: list[str]
    tails: list[list[str]]


def build_prompts(words: list[str], tenants: int, past: int, seed: int) -> Prompts:
    rng = random.Random(seed)
    systems, tails = [], []
    for t in range(tenants):
        start = (t * 7919) % len(words)
        systems.append(approx_text(f"You are the assistant of tenant {t:03d}.", words,
                                   start, SYSTEM_TOKENS))  # fmt: skip
        tails.append([
            approx_text(f"Request {t:03d}-{j}:", words, rng.randrange(len(words)), TAIL_TOKENS)
            for j in range(past + 1)
        ])  # fmt: skip
    return Prompts(systems, tails)


def bodies(system: str, tail: str, user: str) -> dict[str, dict[str, Any]]:
    return {
        "completions": {"model": MODEL, "prompt": f"{system} {tail}", "max_tokens": 128,
                        "user": user},
        "chat": {"model": MODEL, "max_tokens": 128, "user": user, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": tail}]},
    }  # fmt: skip


# ------------------------------------------------------------------------ part 1
@dataclass(slots=True)
class ProfileRow:
    cap: int
    body: str
    mode: str
    tokens: float
    timing: Timing


def per_fresh_call(
    fn: Callable[[Any], object], pool: Iterator[Any], repeats: int, min_s: float
) -> Timing:
    """``per_call``, but every call gets an item never used before (``pool``, drawn
    before each timed repeat): no tokenizer cache holds a request's own text."""
    for _ in range(2):
        fn(next(pool))  # warm up
    item = next(pool)
    started = time.perf_counter()
    fn(item)
    one_s = max(time.perf_counter() - started, 1e-7)
    count = max(3, math.ceil(min_s / one_s))
    best_cpu = best_wall = math.inf
    for _ in range(repeats):
        batch = [next(pool) for _ in range(count)]
        gc.collect()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for item in batch:
            fn(item)
        cpu1, wall1 = time.process_time(), time.perf_counter()
        best_cpu = min(best_cpu, (cpu1 - cpu0) / count)
        best_wall = min(best_wall, (wall1 - wall0) / count)
    return Timing(best_cpu * 1e6, best_wall * 1e6)


def fresh_bodies(
    prompts: Prompts, words: list[str], raw: Any, num_tenants: int, kind: str, seed: int
) -> Iterator[dict[str, Any]]:
    """Endless ``kind`` bodies, tenants in turn: each tenant's system prompt (shared
    by its requests) and a tail of words drawn at random from the corpus, new for
    every body (``raw``: cut both to exact token counts of that tokenizer; None: of the
    approximation)."""
    rng = random.Random(seed)
    systems = [
        exact_cut(raw, f"{system} {system}", SYSTEM_TOKENS) if raw is not None else system
        for system in prompts.systems[:num_tenants]
    ]
    for n in itertools.count():
        t = n % num_tenants
        fresh = rng.choices(words, k=2 * TAIL_TOKENS)
        tail = approx_text(f"Request {t:03d}-{n}:", fresh, 0, TAIL_TOKENS)
        if raw is not None:
            tail = exact_cut(raw, f"{tail} {tail}", TAIL_TOKENS)
        yield bodies(systems[t], tail, f"tenant-{t}")[kind]


def exact_profiler(cap: int, tokenizer_path: Path, fast: bool) -> Profiler:
    """The exact-mode profiler; ``fast=False``: its pieces are encoded by ``tokenizers``
    (before the fast encoder: the baseline)."""
    prof = Profiler(parse_gateway_config({
        "max_prefix_tokens": cap, "models": {MODEL: {"tokenizer": str(tokenizer_path)}}
    }))  # fmt: skip
    tok = prof._tokenizers[MODEL]
    if fast and tok.encoder != "tiktoken":
        raise SystemExit(f"no fast encoder for this tokenizer: {tok.describe()}")
    if not fast:  # the benchmark's own baseline, in the same run
        prof._tokenizers[MODEL] = ExactTokenizer(tok._tokenizer, tok.template, fast=False)
    return prof


MODES = ("approximate", "exact, tokenizers encodes (before)", "exact, tiktoken encodes")


def profile_rows(
    prompts: Prompts,
    words: list[str],
    tokenizer_path: Path,
    num_exact: int,
    args: argparse.Namespace,
) -> tuple[list[ProfileRow], tuple[Timing, Timing]]:
    """(a): ``Profiler.profile`` per body kind, mode and prefix cap, every request
    with a tail of its own (``per_fresh_call``); and the exact completions prompt's
    ``Tokenizer.encode`` alone (``tokenizers``, no profiler), and the fast encoder's."""
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tokenizer_path))
    rows = []
    for cap in CAPS:
        profilers = {
            MODES[0]: Profiler(parse_gateway_config({"max_prefix_tokens": cap})),
            MODES[1]: exact_profiler(cap, tokenizer_path, fast=False),
            MODES[2]: exact_profiler(cap, tokenizer_path, fast=True),
        }
        for kind in ("completions", "chat"):
            for mode, prof in profilers.items():
                exact = mode != MODES[0]
                tenants = num_exact if exact else args.tenants
                pool = fresh_bodies(prompts, words, raw if exact else None, tenants, kind,
                                    args.seed + cap)  # fmt: skip
                for _ in range(tenants):  # every tenant's system prompt seen once
                    prof.profile("r", next(pool), {})
                sample = [next(pool) for _ in range(3)]
                tokens = sum(prof.profile("r", b, {}).input_tokens for b in sample) / 3

                def run(body: dict[str, Any], prof: Profiler = prof) -> object:
                    return prof.profile("r", body, {})

                timing = per_fresh_call(run, pool, args.repeats, args.min_s)
                rows.append(ProfileRow(cap, kind, mode, tokens, timing))
    fast, why = fast_encoder_for(raw)
    if fast is None:
        raise SystemExit(f"no fast encoder for this tokenizer: {why}")
    encodes = []
    for encode in (raw.encode, fast.encode):
        pool = fresh_bodies(prompts, words, raw, num_exact, "completions", args.seed)
        texts = (body["prompt"] for body in pool)
        encodes.append(per_fresh_call(encode, texts, args.repeats, args.min_s))
    return rows, (encodes[0], encodes[1])


def stored_chain(
    ids: Sequence[int], parent: int | None, engine_hashes: Iterator[int]
) -> tuple[list[BlockStored], int | None]:
    """``BlockStored`` events (``EVENT_CHUNK_BLOCKS`` blocks each, chained) for the
    full blocks of ``ids``; and the last block's engine hash."""
    events = []
    num_blocks = len(ids) // BLOCK
    for first in range(0, num_blocks, EVENT_CHUNK_BLOCKS):
        last = min(num_blocks, first + EVENT_CHUNK_BLOCKS)
        hashes = tuple(next(engine_hashes) for _ in range(first, last))
        tokens = tuple(ids[first * BLOCK : last * BLOCK])
        events.append(BlockStored(hashes, parent, tokens, BLOCK))
        parent = hashes[-1]
    return events, parent


@dataclass(slots=True)
class TokenIds:
    systems: list[list[int]]
    tails: list[list[list[int]]]  # " " + tail: the prompt is system + " " + tail


def fill_cache(num_backends: int, ids: TokenIds) -> KvEventCache:
    """The exact index as the subscriber builds it: each tenant's system prompt and
    earlier requests (full prompts) stored on ``HOLDERS`` backends, one batch each."""
    cache = KvEventCache(KvBlockIndex(block_size=BLOCK))
    engine_hashes = itertools.count(1)
    seqs = [0] * num_backends
    for t, system in enumerate(ids.systems):
        for h in range(HOLDERS):
            b = (t + h) % num_backends
            events, last = stored_chain(system, None, engine_hashes)
            for tail in ids.tails[t][:-1]:
                events += stored_chain(tail, last, engine_hashes)[0]
            cache.feed(f"b{b}").on_batch(seqs[b], EventBatch(0.0, tuple(events)))
            seqs[b] += 1
    return cache


def backend_states(num_backends: int, seed: int) -> tuple[BackendState, ...]:
    rng = random.Random(seed)
    return tuple(
        BackendState(
            backend_id=f"b{i}", models=frozenset({MODEL}), max_num_seqs=256,
            kv_capacity_tokens=500_000, num_running=rng.randrange(2, 12), num_waiting=0,
            kv_usage=rng.uniform(0.1, 0.6), in_flight=rng.randrange(0, 8),
            outstanding_prefill_tokens=rng.randrange(0, 20_000),
            outstanding_decode_tokens=rng.randrange(0, 5_000),
            ewma_ttft_ms=rng.uniform(50.0, 150.0), ewma_tpot_ms=rng.uniform(10.0, 20.0),
            scrape_stale=False,
        )
        for i in range(num_backends)
    )  # fmt: skip


def default_policy(num_backends: int, ids: TokenIds, cap: int) -> ScoredPolicy:
    """The default policy, its approximate index holding the earlier requests where
    the KV cache has them (as the gateway's ``on_dispatch`` would have left it)."""
    policy = create_policy("default")
    assert isinstance(policy, ScoredPolicy)
    for t, system in enumerate(ids.systems):
        for tail in ids.tails[t][:-1]:
            hashes = tuple(prefix_block_hashes((system + tail)[:cap], BLOCK))
            info = RequestInfo("past", MODEL, PROMPT_TOKENS, 128, prefix_hashes=hashes)
            for h in range(HOLDERS):
                policy.on_dispatch(info, f"b{(t + h) % num_backends}")
    return policy


@dataclass(slots=True)
class LookupRow:
    cap: int
    name: str
    timing: Timing


@dataclass(slots=True)
class DecisionRow:
    num_backends: int
    cap: int
    without: Timing
    with_cache: Timing


@dataclass(slots=True)
class LookupSetup:
    blocks: int
    engine_blocks: int
    depth: int
    num_hashes: int
    holders: int


def lookup_and_decisions(
    prompts: Prompts, repeats: int, min_s: float, seed: int
) -> tuple[LookupSetup, list[LookupRow], list[DecisionRow]]:
    """(b) and (c), on the approximate token ids (the engine twin's, hashed as the
    gateway hashes them): the measured requests' ``RequestInfo`` come from the
    gateway's own ``Profiler``."""
    ids = TokenIds(
        systems=[tokenize(s) for s in prompts.systems],
        tails=[[tokenize(" " + tail) for tail in tails] for tails in prompts.tails],
    )
    caches = {n: fill_cache(n, ids) for n in DECISION_BACKENDS}
    lookups: list[LookupRow] = []
    decisions: list[DecisionRow] = []
    setup = None
    for cap in CAPS:
        prof = Profiler(parse_gateway_config({"max_prefix_tokens": cap}))
        infos = [
            prof.profile(f"r{t}", bodies(s, prompts.tails[t][-1], f"tenant-{t}")["completions"], {})
            for t, s in enumerate(prompts.systems)
        ]
        hashes = [info.prefix_hashes for info in infos]
        cache = caches[LOOKUP_BACKENDS]
        depths = cache.match_depths(hashes[0])
        expected = min(cap, SYSTEM_TOKENS) // BLOCK
        if sorted(depths.values()) != [expected] * HOLDERS:  # the hashes must agree
            raise SystemExit(f"lookup found {depths}, expected depth {expected} on {HOLDERS}")
        if cap == DEFAULT_CAP:
            index = cache.index
            engine_blocks = sum(index.num_backend_blocks(b) for b in index.backends())
            setup = LookupSetup(index.num_blocks, engine_blocks, expected, len(hashes[0]),
                                HOLDERS)  # fmt: skip
        policies = {n: default_policy(n, ids, cap) for n in DECISION_BACKENDS}
        approx_index = policies[LOOKUP_BACKENDS].index
        assert isinstance(approx_index, PrefixIndex)
        states = backend_states(LOOKUP_BACKENDS, seed)
        plain = ClusterSnapshot(now_s=0.0, backends=states)
        exact = ClusterSnapshot(now_s=0.0, backends=states, kv_cache=cache)
        for name, fn in (
            ("cached_depths, no KV cache (approximate index: baseline)",
             lambda h, i=approx_index, s=plain: cached_depths(i, s, h)),
            ("KvEventCache.match_depths", cache.match_depths),
            (f"cached_depths with the KV cache ({LOOKUP_BACKENDS} backends exact)",
             lambda h, i=approx_index, s=exact: cached_depths(i, s, h)),
        ):  # fmt: skip
            lookups.append(LookupRow(cap, name, per_call(fn, hashes, repeats, min_s)))
        for n in DECISION_BACKENDS:
            policy = policies[n]
            states = backend_states(n, seed)
            timings = []
            for kv_cache in (None, caches[n]):
                snap = ClusterSnapshot(now_s=0.0, backends=states, kv_cache=kv_cache)
                rng = random.Random(seed)

                def choose(
                    info: RequestInfo,
                    snap: ClusterSnapshot = snap,
                    policy: ScoredPolicy = policy,
                    rng: random.Random = rng,
                ) -> object:
                    return policy.choose(info, snap, rng)  # fmt: skip

                timings.append(per_call(choose, infos, repeats, min_s))
            decisions.append(DecisionRow(n, cap, timings[0], timings[1]))
    assert setup is not None
    return setup, lookups, decisions


def print_part1(
    args: argparse.Namespace,
    tokenizer_note: str,
    profiles: list[ProfileRow],
    encodes: tuple[Timing, Timing],
    setup: LookupSetup,
    lookups: list[LookupRow],
    decisions: list[DecisionRow],
) -> None:
    print(f"1. Tokenising + prefix lookup per request, {PROMPT_TOKENS:,}-token prompts "
          f"({args.tenants} tenants x {SYSTEM_TOKENS:,}-token system prompt + "
          f"{TAIL_TOKENS:,}-token tail); best of {args.repeats}; us per request")  # fmt: skip
    print(f"   exact tokenizer: {tokenizer_note}")
    print("\n(a) Profiler.profile (cap = max_prefix_tokens: tokens hashed into prefix blocks)")
    print(f"{'cap':>6} {'body':<12} {'mode':<38} {'tokens':>7} {'CPU us':>9} {'wall us':>9}"
          f" {'CPU vs approximate':>19}")  # fmt: skip
    base = {(r.cap, r.body): r.timing.cpu_us for r in profiles if r.mode == "approximate"}
    for r in profiles:
        ratio = r.timing.cpu_us / base[(r.cap, r.body)]
        print(f"{r.cap:>6} {r.body:<12} {r.mode:<38} {r.tokens:>7.0f} {r.timing.cpu_us:>9.1f}"
              f" {r.timing.wall_us:>9.1f} {ratio:>18.2f}x")  # fmt: skip
    for name, encode in zip(("tokenizers", "tiktoken"), encodes, strict=True):
        print(f"{'':>6} {'completions':<12} {'encode only, ' + name:<38} {'':>7} "
              f"{encode.cpu_us:>9.1f} {encode.wall_us:>9.1f}  (the exact prompt alone, "
              "no piece cache)")  # fmt: skip
    print(f"\n(b) prefix lookup: exact index from the KV events of {LOOKUP_BACKENDS} backends "
          f"({setup.engine_blocks:,} engine blocks, {setup.blocks:,} distinct {BLOCK}-token "
          f"blocks); each request matches {HOLDERS} backends")  # fmt: skip
    print(f"{'cap':>6} {'lookup':<62} {'CPU us':>8} {'wall us':>8} {'CPU vs baseline':>16}")
    lookup_base = {r.cap: r.timing.cpu_us for r in lookups if "baseline" in r.name}
    for lk in lookups:
        ratio = lk.timing.cpu_us / lookup_base[lk.cap]
        print(f"{lk.cap:>6} {lk.name:<62} {lk.timing.cpu_us:>8.2f} {lk.timing.wall_us:>8.2f}"
              f" {ratio:>15.2f}x")  # fmt: skip
    print("\n(c) default policy decision (policy.choose), CPU us per decision")
    print(f"{'backends':>8} {'cap':>6} {'no KV cache (baseline)':>23} {'with KV cache':>14}"
          f" {'ratio':>7} {'added us':>9}")  # fmt: skip
    for d in decisions:
        added = d.with_cache.cpu_us - d.without.cpu_us
        print(f"{d.num_backends:>8} {d.cap:>6} {d.without.cpu_us:>23.1f} "
              f"{d.with_cache.cpu_us:>14.1f} {d.with_cache.cpu_us / d.without.cpu_us:>6.2f}x"
              f" {added:>9.1f}")  # fmt: skip
    print(f"\nTarget: tokenising + index lookup <= {TARGET_US:.0f} us of gateway CPU per request:"
          " (a) exact profile + (b) cached_depths with the KV cache")  # fmt: skip
    print(f"{'cap':>6} {'body':<12} {'approximate (a)+(b)':>20} {'exact, tokenizers':>21}"
          f" {'exact, tiktoken':>15} {'added by exact':>15}  verdict (tiktoken)")  # fmt: skip
    profile = {(r.cap, r.body, r.mode): r.timing.cpu_us for r in profiles}
    with_cache = {r.cap: r.timing.cpu_us for r in lookups if "with the KV cache" in r.name}
    for cap in CAPS:
        for body in ("completions", "chat"):
            approx = profile[(cap, body, "approximate")] + lookup_base[cap]
            before = profile[(cap, body, MODES[1])] + with_cache[cap]
            exact = profile[(cap, body, MODES[2])] + with_cache[cap]
            print(f"{cap:>6} {body:<12} {approx:>20.1f} {before:>21.1f} {exact:>15.1f}"
                  f" {exact - approx:>15.1f}  {verdict(exact <= TARGET_US)} (approximate: "
                  f"{verdict(approx <= TARGET_US)})")  # fmt: skip
    lookup_only = with_cache[DEFAULT_CAP]
    print(
        f"The lookup alone (cap {DEFAULT_CAP}): {lookup_only:.1f} us "
        f"({verdict(lookup_only <= TARGET_US)}); the rest is tokenising the prompt."
    )


# ------------------------------------------------------------------------ part 2
def publisher_batches(
    backend: int, num_batches: int, events_per_batch: int, seed: int
) -> list[bytes]:
    """Encoded batches of one backend's stream (see the module docstring)."""
    rng = random.Random(seed * 1000 + backend)
    engine_hashes = itertools.count((backend << 40) + 1)

    def stored(num_blocks: int, parent: int | None, held: list[int]) -> BlockStored:
        """``num_blocks`` new blocks, chained from ``parent``; their hashes join ``held``."""
        hashes = [next(engine_hashes) for _ in range(num_blocks)]
        held += hashes
        tokens = tuple(rng.randrange(PUB_VOCAB) for _ in range(num_blocks * BLOCK))
        return BlockStored(tuple(hashes), parent, tokens, BLOCK)

    def events() -> Iterator[BlockStored | BlockRemoved]:
        system: list[int] = []  # the backend's shared system prompt: never evicted
        yield stored(PUB_SYSTEM_BLOCKS, None, system)
        live: deque[list[int]] = deque()
        while True:
            held: list[int] = []
            yield stored(PUB_PREFILL_BLOCKS, system[-1], held)  # a request's prefill
            for _ in range(PUB_DECODE_EVENTS):  # its decode: one block at a time
                yield stored(1, held[-1], held)
            live.append(held)
            if len(live) > PUB_KEEP_REQUESTS:
                yield BlockRemoved(tuple(reversed(live.popleft())))

    stream = events()
    return [
        encode_batch(EventBatch(time.time(), tuple(itertools.islice(stream, events_per_batch))))
        for _ in range(num_batches)
    ]


def publisher_main(spec: dict[str, Any]) -> int:
    """The child process: XPUB sockets (one per backend), then batches on schedule."""
    import zmq

    backends, rate, seconds = spec["backends"], spec["batches_per_s"], spec["seconds"]
    total = round(rate * seconds)
    per_backend = math.ceil(total / backends)
    payloads = [publisher_batches(b, per_backend, spec["events_per_batch"], spec["seed"])
                for b in range(backends)]  # fmt: skip
    ctx = zmq.Context()
    socks = []
    for _ in range(backends):
        sock = ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        socks.append((sock, f"tcp://127.0.0.1:{port}"))
    print(json.dumps({"endpoints": [e for _, e in socks]}), flush=True)
    for sock, endpoint in socks:  # the gateway's SUB joined: nothing sent is lost
        if not sock.poll(30_000) or sock.recv() != b"\x01":
            raise SystemExit(f"no subscriber on {endpoint}")
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "start":
        return 0
    started = time.monotonic()
    latest = 0.0
    for k in range(total):
        due = started + k / rate
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:
            latest = max(latest, -delay)
        b, seq = k % backends, k // backends
        socks[b][0].send_multipart([TOPIC, encode_seq(seq), payloads[b][seq]])
    elapsed = time.monotonic() - started
    print(json.dumps({"batches": total, "elapsed_s": elapsed, "max_late_s": latest}), flush=True)
    sys.stdin.readline()  # until the gateway side is done
    ctx.destroy(linger=0)
    return 0


@dataclass(slots=True)
class Window:
    cpu_s: float
    wall_s: float

    @property
    def fraction(self) -> float:
        return self.cpu_s / self.wall_s


async def cpu_window(until: Callable[[float], bool], poll_s: float = 0.05) -> Window:
    """This process's CPU and wall time until ``until(elapsed_s)`` holds."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    while not until(time.perf_counter() - wall0):
        await asyncio.sleep(poll_s)
    return Window(time.process_time() - cpu0, time.perf_counter() - wall0)


@dataclass(slots=True)
class IngestResult:
    idle: Window
    load: Window
    expected_events: int
    events: int
    batches: int
    gaps: int
    resyncs: int
    orphans: int
    blocks: int
    publisher: dict[str, Any]


async def ingestion(args: argparse.Namespace) -> IngestResult:
    from kiloserve.gateway.kvevents import KvEventSubscriber
    from kiloserve.gateway.metrics import GatewayMetrics
    from kiloserve.routing.table import BackendTable

    batches_per_s = args.events_per_s / args.events_per_batch
    spec = {"backends": args.event_backends, "batches_per_s": batches_per_s,
            "seconds": args.window_s, "events_per_batch": args.events_per_batch,
            "seed": args.seed}  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--publisher", json.dumps(spec),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    stdin, stdout = proc.stdin, proc.stdout
    sub = None
    try:
        endpoints = json.loads(await asyncio.wait_for(stdout.readline(), 120))["endpoints"]
        cfg = parse_gateway_config({"backends": [
            {"url": f"http://127.0.0.1:{10 + i}", "name": f"b{i}", "models": [MODEL],
             "kv_events_endpoint": endpoint}
            for i, endpoint in enumerate(endpoints)
        ]})  # fmt: skip
        table = BackendTable(cfg)
        sub = KvEventSubscriber(table, GatewayMetrics(table), block_size=BLOCK)
        sub.start()
        if (await asyncio.wait_for(stdout.readline(), 60)).strip() != b"ready":
            raise SystemExit("the publisher did not get ready")
        cache = sub.cache
        assert cache is not None

        def applied() -> tuple[int, int]:
            feeds = cache.feeds()
            return sum(f.counters.events for f in feeds), sum(f.counters.batches for f in feeds)

        await asyncio.sleep(0.5)  # settle
        gc.collect()
        idle = await cpu_window(lambda elapsed: elapsed >= args.window_s)
        total_batches = round(batches_per_s * args.window_s)
        expected = total_batches * args.events_per_batch
        stdin.write(b"start\n")
        await stdin.drain()
        done = asyncio.create_task(stdout.readline())
        limit_s = args.window_s + 30.0
        load = await cpu_window(
            lambda elapsed: (done.done() and applied()[0] >= expected) or elapsed > limit_s
        )
        publisher = json.loads(await asyncio.wait_for(done, 30))
        events, batches = applied()
        feeds = cache.feeds()
        return IngestResult(
            idle=idle, load=load, expected_events=expected, events=events, batches=batches,
            gaps=sum(f.counters.gaps for f in feeds),
            resyncs=sum(f.counters.losses + f.counters.resyncs for f in feeds),
            orphans=cache.index.counters.orphans, blocks=cache.index.num_blocks,
            publisher=publisher,
        )  # fmt: skip
    finally:
        if sub is not None:
            await sub.close()
        if not stdin.is_closing():
            stdin.write(b"exit\n")
            stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()


def print_part2(args: argparse.Namespace, r: IngestResult) -> None:
    rate = args.events_per_s / args.events_per_batch
    print(f"\n2. KV-event ingestion: {args.event_backends} backends, {rate:g} batches/s x "
          f"{args.events_per_batch} events ({args.events_per_s:,} events/s), "
          f"{args.window_s:g} s window")  # fmt: skip
    print(f"{'window':<24} {'CPU s':>7} {'wall s':>7} {'CPU fraction of one core':>25}")
    print(f"{'idle (subscribed)':<24} {r.idle.cpu_s:>7.3f} {r.idle.wall_s:>7.2f} "
          f"{r.idle.fraction:>25.4f}")  # fmt: skip
    print(f"{'events':<24} {r.load.cpu_s:>7.3f} {r.load.wall_s:>7.2f} {r.load.fraction:>25.4f}")
    added_cpu_s = r.load.cpu_s - r.idle.fraction * r.load.wall_s
    events_per_s = r.events / r.load.wall_s
    per_event_us = added_cpu_s / max(r.events, 1) * 1e6
    ratio = r.load.fraction / r.idle.fraction if r.idle.fraction > 0 else math.inf
    print(f"added by ingestion: {r.load.fraction - r.idle.fraction:.4f} of one core "
          f"({ratio:.1f}x idle), {per_event_us:.1f} us CPU per event at "
          f"{events_per_s:,.0f} events/s applied")  # fmt: skip
    print(f"applied {r.events:,} of {r.expected_events:,} events in {r.batches:,} batches; "
          f"gaps {r.gaps}, resyncs {r.resyncs}, orphans {r.orphans}; "
          f"{r.blocks:,} blocks in the index; publisher sent in "
          f"{r.publisher['elapsed_s']:.2f} s, at most {r.publisher['max_late_s'] * 1000:.1f} ms "
          "late")  # fmt: skip


# ------------------------------------------------------------------------ main
def part1(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    words = corpus_words()
    past = 2 if args.quick else 4
    prompts = build_prompts(words, args.tenants, past, args.seed)
    with tempfile.TemporaryDirectory(prefix="prefix-overhead-") as tmp:
        if args.tokenizer is not None:
            tokenizer_path = Path(args.tokenizer).resolve()
            note = str(tokenizer_path)
        else:
            tokenizer_path = train_tokenizer(Path(tmp), words)
            note = (f"byte-level BPE, {VOCAB_SIZE:,} tokens, trained here on "
                    "standard-library docstrings; ChatML template")  # fmt: skip
        num_exact = min(args.tenants, 4 if args.quick else 20)
        profiles, encodes = profile_rows(prompts, words, tokenizer_path, num_exact, args)
    setup, lookups, decisions = lookup_and_decisions(prompts, args.repeats, args.min_s, args.seed)
    print_part1(args, note, profiles, encodes, setup, lookups, decisions)
    print(f"(part 1 took {time.perf_counter() - started:.0f} s)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 tenants, 3 repeats, 3 s windows")
    parser.add_argument("--tenants", type=int, help="tenants (one measured request each)")
    parser.add_argument("--repeats", type=int, help="best of this many repeats")
    parser.add_argument("--tokenizer", help="a real tokenizer.json for the exact mode")
    parser.add_argument("--window-s", type=float, help="event ingestion window (and idle)")
    parser.add_argument("--events-per-s", type=int, default=1000)
    parser.add_argument("--events-per-batch", type=int, default=10)
    parser.add_argument("--event-backends", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-events", action="store_true", help="part 1 only")
    parser.add_argument("--publisher", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.publisher is not None:
        return publisher_main(json.loads(args.publisher))
    args.tenants = args.tenants or (10 if args.quick else 100)
    args.repeats = args.repeats or (3 if args.quick else 7)
    args.window_s = args.window_s or (3.0 if args.quick else 10.0)
    args.min_s = 0.05 if args.quick else 0.2
    part1(args)
    gc.collect()  # part 1's indexes are gone: no big heap for the collector below
    if not args.skip_events:
        print_part2(args, asyncio.run(ingestion(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
