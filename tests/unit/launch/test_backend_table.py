"""The table ``kiloserve up`` prints: a ``role`` column only for a cluster with
prefill/decode pools."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from kiloserve.launch.cli import backend_table
from kiloserve.launch.cluster import LocalCluster, describe_backend
from kiloserve.launch.config import load_cluster_config

ROOT = Path(__file__).resolve().parents[3]


def _rendered(config: Path, tmp_path: Path) -> list[str]:
    """The table's lines for ``config``'s backends (described, not started)."""
    cluster = LocalCluster(load_cluster_config(config), run_dir=tmp_path)
    cluster.backends = [
        describe_backend(item, f"http://127.0.0.1:{9000 + i}")
        for i, item in enumerate(cluster.cfg.expanded())
    ]
    console = Console(width=240, record=True, color_system=None)
    console.print(backend_table(cluster))
    return console.export_text().splitlines()


def _row(lines: list[str], name: str) -> list[str]:
    """The cells of the row whose first cell is ``name``."""
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("│┃").split("│")]
        if cells and cells[0] == name:
            return cells
    raise AssertionError(f"no row {name!r} in {lines}")


def test_pd_cluster_table_has_a_role_column(tmp_path: Path) -> None:
    lines = _rendered(ROOT / "examples" / "cluster-pd.yaml", tmp_path)
    header = next(line for line in lines if "KV capacity" in line)
    assert [c.strip() for c in header.strip().strip("┃").split("┃")][-1] == "role"
    assert _row(lines, "prefill-0")[-1] == "prefill"
    assert _row(lines, "prefill-1")[-1] == "prefill"
    assert _row(lines, "decode-0")[-1] == "decode"
    assert _row(lines, "both")[-1] == "both"


def test_colocated_cluster_table_has_no_role_column(tmp_path: Path) -> None:
    lines = _rendered(ROOT / "examples" / "cluster.yaml", tmp_path)
    header = next(line for line in lines if "KV capacity" in line)
    assert "role" not in header
    assert [c.strip() for c in header.strip().strip("┃").split("┃")][-1] == "group"
