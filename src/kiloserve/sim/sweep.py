"""Run independent simulations side by side: in this process, on a local process pool,
or on a Ray cluster (``kiloserve sim`` policies, ``kiloserve plan`` rate searches,
Pareto sizes and stages; see docs/simulator.md, "Sweeps on many cores").

``run_all(fn, items, jobs=..., ray_address=...)`` returns ``[fn(item) for item in
items]`` in the items' order, whichever way it ran:

* ``ray_address`` given: one Ray remote task per item (``ray.init(address=...)``;
  Ray is the optional ``[ray]`` extra, imported only here and only then);
* else ``jobs`` > 1 (default: the cores this process may use) and more than one item:
  a ``ProcessPoolExecutor`` with the ``spawn`` context (no forked locks or threads);
* else the plain loop in this process (``--jobs 1``, today's path).

``fn`` and the items must pickle (a module-level function or a ``functools.partial``
of one, and plain data); results must not hold instances of the compiled modules'
classes (``sim.build.COMPILED_MODULES``: return their fields). Each worker first picks
the build of the simulator the caller runs (``sim.build.select_build``: compiled when
the caller's is and the worker has it), then unpickles ``fn`` and the item. The
simulator is deterministic, so the results equal the in-process loop's except the
wall-clock keys (``WALL_CLOCK_KEYS``). One rich progress bar counts finished items.
"""

from __future__ import annotations

import argparse
import multiprocessing
import pickle
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from typing import Any, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kiloserve.cpus import usable_cpus
from kiloserve.errors import ConfigError

__all__ = [
    "WALL_CLOCK_KEYS",
    "add_sweep_arguments",
    "default_jobs",
    "run_all",
    "without_wall_clock",
]

T = TypeVar("T")
R = TypeVar("R")
WALL_CLOCK_KEYS = frozenset(
    {"sim_wall_s", "sim_cpu_s", "real_time_factor", "requests_per_wall_s"}
)  # the summary keys that measure this machine, not the simulated cluster
RAY_MISSING = (
    "--ray needs Ray, an optional extra: pip install 'kiloserve[ray]' "
    "(or pip install ray) in this environment and on the cluster"
)


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    """``--jobs N`` and ``--ray ADDRESS``, as ``kiloserve sim`` and ``plan`` take them."""
    parser.add_argument(
        "--jobs", type=_num_jobs, help="simulations at once on this machine (default: all cores; "
        "1: one after another in this process)",
    )  # fmt: skip
    parser.add_argument(
        "--ray", metavar="ADDRESS", help="run each simulation as a task on this Ray cluster "
        "(e.g. 10.0.0.5:6379 or auto; needs the [ray] extra)",
    )  # fmt: skip


def _num_jobs(text: str) -> int:
    """``--jobs``: a whole number >= 1 (argparse names the flag when it is not)."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)


def default_jobs() -> int:
    """The cores this process may run on, capped by its container's CPU limit
    (``kiloserve.cpus.usable_cpus``)."""
    return usable_cpus()


def run_all(
    fn: Callable[[T], R],
    items: Sequence[T],
    *,
    jobs: int | None = None,
    ray_address: str | None = None,
    label: str = "simulations",
    console: Console | None = None,
) -> list[R]:
    """``[fn(item) for item in items]``, on Ray, a process pool or in process (above)."""
    if jobs is not None and jobs < 1:
        raise ConfigError(f"--jobs must be >= 1, got {jobs}")
    num_jobs = min(default_jobs() if jobs is None else jobs, len(items))
    with _progress(console or Console(stderr=True), label, len(items)) as advance:
        if ray_address is not None:
            return _on_ray(fn, items, ray_address, advance)
        if num_jobs > 1:
            return _on_pool(fn, items, num_jobs, advance)
        out = []
        for item in items:
            out.append(fn(item))
            advance()
        return out


def without_wall_clock(summary: dict[str, Any]) -> dict[str, Any]:
    """``summary`` less the keys that measure the host (for comparing runs)."""
    return {k: v for k, v in summary.items() if k not in WALL_CLOCK_KEYS}


def _worker_build() -> str:
    """``auto`` when this process runs the compiled simulator, else ``pure`` (without
    importing the simulator: ``sim.build.loaded_build`` would)."""
    module = sys.modules.get("kiloserve.sim.simulator")
    file = getattr(module, "__file__", None) or ".py"
    return "pure" if file.endswith(".py") else "auto"


def _call(payload: bytes, build: str) -> Any:
    """In a worker: pick the simulator build, then unpickle and run ``fn(item)``."""
    from kiloserve.sim.build import select_build

    select_build(build)
    fn, item = pickle.loads(payload)
    return fn(item)


def _on_pool(
    fn: Callable[[T], R], items: Sequence[T], num_jobs: int, advance: Callable[[], None]
) -> list[R]:
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=num_jobs, mp_context=context) as pool:
        build = _worker_build()
        futures: dict[Future[R], int] = {
            pool.submit(_call, pickle.dumps((fn, item)), build): i for i, item in enumerate(items)
        }
        results: dict[int, R] = {}
        for future in as_completed(futures):
            results[futures[future]] = future.result()
            advance()
    return [results[i] for i in range(len(items))]


def _on_ray(
    fn: Callable[[T], R], items: Sequence[T], address: str, advance: Callable[[], None]
) -> list[R]:
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(RAY_MISSING) from exc
    was_connected = ray.is_initialized()
    if not was_connected:
        ray.init(address=address, log_to_driver=False)
    try:
        remote = ray.remote(num_cpus=1)(_call)
        build = _worker_build()
        refs = [remote.remote(pickle.dumps((fn, item)), build) for item in items]
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for _ in done:
                advance()
        return [ray.get(ref) for ref in refs]
    finally:
        if not was_connected:
            ray.shutdown()


@contextmanager
def _progress(console: Console, label: str, total: int) -> Iterator[Callable[[], None]]:
    columns = (TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda: bar.advance(task)
