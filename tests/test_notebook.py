"""The notebook Kaggle/Colab users run, executed top to bottom on CPU in `gpu_smoke`, so it cannot rot."""

import json
import shutil

import nbformat
import pytest
from nbclient import NotebookClient

from .conftest import ROOT


@pytest.mark.slow
def test_notebook_runs_top_to_bottom(project, tmp_path):
    shutil.copytree(ROOT / "notebooks", project / "notebooks")
    notebook = nbformat.read(project / "notebooks" / "tunix_pipeline.ipynb", as_version=4)
    (parameters,) = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
    out = tmp_path / "kaggle_working"
    parameters.source = parameters.source.replace("OUTPUT_ROOT = None", f"OUTPUT_ROOT = {str(out)!r}")
    # a shorter SFT than the smoke run's 200 steps (the notebook's point is that it runs, not the loss it reaches)
    parameters.source = parameters.source.replace("EXTRA_PARAMS = {}", 'EXTRA_PARAMS = {"sft": {"max_steps": 50}}')

    NotebookClient(notebook, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(project / "notebooks")}}).execute()

    text = "\n".join(o.get("text", "") + json.dumps(o.get("data", {})) for c in notebook.cells
                     if c.cell_type == "code" for o in c.get("outputs", []))
    assert "image/png" in text  # the loss curve
    assert "arith_gsm8k" in text and "rows_read" in text  # the data report
    assert "reference" in text or "generated" in text  # samples
    assert "FINISHED" in text  # the MLflow run
    # every output went under the chosen root, nothing into the project's data/
    assert json.loads((out / "06_models" / "sft_result.json").read_text())["latest_step"] == 50  # EXTRA_PARAMS taken
    assert (out / "mlflow.db").is_file()
    assert (out / "06_models" / "exported").is_dir()
    assert not any((project / "data").glob("0[2-8]_*/*"))
