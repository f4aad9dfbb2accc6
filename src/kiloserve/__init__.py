"""kiloserve: LLM inference from one GPU to a thousand.

Gateway (load-aware OpenAI-compatible router), engine twin (a vLLM-like server on a
modelled GPU), cluster simulator, benchmark client and capacity planner.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__"]
