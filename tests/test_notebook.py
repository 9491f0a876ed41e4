"""The analysis notebook runs top to bottom on a real (tiny) sweep, so it never rots."""

import base64

import nbformat
import pytest
from conftest import ROOT
from nbclient import NotebookClient

from transformer.report import build

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.xdist_group("sweep")
def test_compare_runs_notebook_executes_on_a_sweep(tiny_sweep, monkeypatch):
    monkeypatch.setenv("COMPARE_RUNS", str(tiny_sweep))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(ROOT / "notebooks" / "compare_runs.ipynb", as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    report = build(tiny_sweep)
    assert f"verdict: {report.verdict()}" in text  # the same verdict as the report
    assert "4 runs, 4 variants" in text
    images = [base64.b64decode(o["data"]["image/png"]) for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 3 and all(i[:8] == PNG and len(i) > 5000 for i in images)  # curves, layers, lr
