"""``python -m kiloserve`` runs the CLI."""

from __future__ import annotations

from kiloserve.cli import main_entry

main_entry()
