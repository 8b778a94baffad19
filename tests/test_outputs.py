"""Outputs are written whole or not at all: a run killed while Kedro saves a dataset leaves the old file (or none),
never a truncated one that `kedro run --only-missing-outputs` would take for a finished output."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

# A child process saves `sft_result` through the project's own catalog entry and hooks, and is killed (SIGKILL,
# as a preemption) in the middle of the JSON: well past the first 8 KiB buffer, so part of it is on disk.
KILLED_MID_SAVE = """
import json, os, signal, sys
from kedro.config import OmegaConfigLoader
from kedro.io import DataCatalog
from kedro.pipeline import node
from tunix_pipeline.run.hooks import OutputHooks
from tunix_pipeline.settings import HOOKS

conf = OmegaConfigLoader(sys.argv[1], base_env="base", default_run_env="local",
                         runtime_params={"runtime": {"output_root": sys.argv[2]}})
pattern = dict(conf["catalog"]["{stage}_result"])  # the catalog's pattern for every stage's result
entry = dict(pattern, filepath=pattern["filepath"].replace("{stage}", "sft"),
             save_args={"indent": 2, "default": lambda _: os.kill(os.getpid(), signal.SIGKILL)})
catalog = DataCatalog.from_config({"sft_result": entry})
if sys.argv[3] == "hooked":
    hook = next(h for h in HOOKS if isinstance(h, OutputHooks))
    hook.before_node_run(node(lambda: None, None, "sft_result", name="train_sft"), catalog)
catalog.save("sft_result", {"history": list(range(5000)), "unserializable": object()})
"""


@pytest.mark.slow
@pytest.mark.parametrize("hooked", [True, False])
def test_a_run_killed_mid_save_leaves_the_previous_output(tmp_path, hooked):
    target = tmp_path / "06_models" / "sft_result.json"
    target.parent.mkdir()
    target.write_text(json.dumps({"latest_step": 7}))
    child = subprocess.run([sys.executable, "-c", KILLED_MID_SAVE, str(ROOT / "conf"), str(tmp_path),
                            "hooked" if hooked else "bare"], cwd=tmp_path, capture_output=True, text=True)
    assert child.returncode == -9, child.stderr[-2000:]  # killed inside the save, as meant
    if hooked:
        assert json.loads(target.read_text()) == {"latest_step": 7}
    else:  # what Kedro alone leaves: the start of the new file, which no longer parses
        with pytest.raises(json.JSONDecodeError):
            json.loads(target.read_text())


def test_a_failed_folder_save_keeps_the_old_folder_and_leaves_nothing_beside_it(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from kedro.io import DatasetError
    from kedro_datasets.matplotlib import MatplotlibDataset

    from tunix_pipeline.upstream import atomic_saves

    out = tmp_path / "curves"
    dataset = MatplotlibDataset(filepath=str(out))  # a list of figures is saved as a folder of PNGs
    atomic_saves(dataset)
    atomic_saves(dataset)  # twice is once
    dataset.save([plt.figure(), plt.figure(), plt.figure()])
    assert sorted(p.name for p in out.iterdir()) == ["0.png", "1.png", "2.png"]
    with pytest.raises(DatasetError, match="savefig"):
        dataset.save([plt.figure(), "not a figure"])  # fails after writing 0.png
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves"]
    assert sorted(p.name for p in out.iterdir()) == ["0.png", "1.png", "2.png"]
    dataset.save([plt.figure()])  # the next save replaces the folder whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves"]
    assert sorted(p.name for p in out.iterdir()) == ["0.png"]
