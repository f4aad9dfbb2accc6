"""The ``kiloserve`` command line.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; only the chosen one is imported, so ``kiloserve --help`` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from kiloserve import __version__
from kiloserve.errors import KiloserveError

__all__ = ["COMMANDS", "main", "main_entry"]

# Commands that run the simulator: they use its compiled build when one matches.
SIM_COMMANDS = ("sim", "plan")
# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "engine": (
        "kiloserve.engine.cli",
        "run one engine twin (a vLLM-like server on a modelled GPU)",
    ),
    "up": ("kiloserve.launch.cli", "start a local cluster of engines (and the gateway) from YAML"),
    "gateway": ("kiloserve.gateway.cli", "run the OpenAI-compatible load-aware gateway"),
    "bench": ("kiloserve.bench.cli", "benchmark any OpenAI-compatible endpoint"),
    "compare": ("kiloserve.bench.compare", "compare routing policies on a local twin cluster"),
    "sim": ("kiloserve.sim.cli", "simulate a cluster and gateway in simulated time"),
    "plan": ("kiloserve.plan.cli", "capacity planning: memory ledger, TP and replicas"),
    "agent": ("kiloserve.agent.cli", "register one engine in etcd while it is healthy"),
    "chaos": ("kiloserve.chaos.cli", "fault-injection drills on a local twin cluster"),
    "doctor": ("kiloserve.doctor.cli", "triage a live gateway: name the probable cause"),
}


def _top_parser() -> argparse.ArgumentParser:
    lines = "\n".join(f"  {name:<9} {text}" for name, (_, text) in COMMANDS.items())
    p = argparse.ArgumentParser(
        prog="kiloserve",
        description="kiloserve: LLM inference from one GPU to a thousand.",
        epilog=f"commands:\n{lines}\n\nRun 'kiloserve COMMAND --help' for a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"kiloserve {__version__}")
    p.add_argument("command", nargs="?", choices=sorted(COMMANDS), metavar="COMMAND")
    return p


def main(argv: Sequence[str] | None = None, *, own_process: bool = False) -> int:
    """Run the CLI; returns the process exit code. ``own_process``: this call owns the
    interpreter (the console script), so the simulator commands may load the compiled
    simulator; an in-process call runs the modules already importable."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    if not args_in or args_in[0] not in COMMANDS:
        top = _top_parser()
        top.parse_args(args_in)  # handles --help / --version / bad command
        top.print_help()
        return 2
    name, rest = args_in[0], args_in[1:]
    module_name, text = COMMANDS[name]
    if name in SIM_COMMANDS and (code := _select_sim_build(name, own_process)):
        return code
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"kiloserve {name}", description=text)
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(module.run(args))
    except KiloserveError as exc:
        print(f"kiloserve {name}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _select_sim_build(name: str, own_process: bool) -> int:
    """Load the compiled simulator when it matches the sources (before the command
    imports it) and say which build runs; 2 on a bad ``KILOSERVE_SIM_BUILD``."""
    from kiloserve.sim.build import describe_loaded, select_build

    try:
        print(select_build() if own_process else describe_loaded(), file=sys.stderr)
    except KiloserveError as exc:
        print(f"kiloserve {name}: error: {exc}", file=sys.stderr)
        return 2
    return 0


def main_entry() -> None:
    """Console-script entry point."""
    sys.exit(main(own_process=True))
