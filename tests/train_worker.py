"""Runs `train.sft.train` in a process of its own: for the kill -9, SIGTERM and multi-host tests.

Usage: python tests/train_worker.py '<json spec>'; writes the results and the
final weights to spec["out"] (process 0 only).
"""

import json
import logging
import os
import sys
import time

spec = json.loads(sys.argv[1])
logging.basicConfig(level=logging.INFO if spec.get("log_info") else logging.WARNING)
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={spec.get('devices', 8)}"

import jax  # noqa: E402

if spec.get("num_processes", 1) > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=spec["coordinator"], num_processes=spec["num_processes"], process_id=spec["process_id"]
    )

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from flax import nnx  # noqa: E402

from tunix_pipeline.config import RuntimeParams, SftParams  # noqa: E402
from tunix_pipeline.models import load_model  # noqa: E402
from tunix_pipeline.core import runtime  # noqa: E402
from tunix_pipeline.train import loop
from tunix_pipeline.train.sft import train

if spec.get("seconds_per_step"):  # slow steps, so that a test can interrupt the run mid-way
    fetch = loop.BatchFeed.load_next_train_batch

    def slow_fetch(self, trainer):
        open(spec["out"] + ".training", "w").close()  # training has started: a test may interrupt it now
        time.sleep(spec["seconds_per_step"])
        return fetch(self, trainer)

    loop.BatchFeed.load_next_train_batch = slow_fetch

mesh = runtime.make_mesh(RuntimeParams(mesh=spec["mesh"]))
model, _ = load_model(spec["model_dir"], mesh)
rows = pd.read_parquet(spec["rows"])
sft = SftParams(**spec["sft"])
try:
    result = train(model, rows, rows.head(0), sft, mesh)
except loop.TrainingInterrupted as err:
    print(f"interrupted: {err}", flush=True)
    sys.exit(3)
if jax.process_count() == 1:
    params = {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    np.savez(spec["out"] + ".npz", **params)
if jax.process_index() == 0:
    with open(spec["out"] + ".json", "w") as f:
        json.dump(result, f)
