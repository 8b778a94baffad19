"""XLA's own figure: the SFT train step compiled ahead of time for a mesh, no weights.

The step is Tunix's `PeftTrainer` step built from the project's pieces
(`completion_loss`, `model_inputs`, `make_optimizer`, `make_mesh`): the model
and optimizer are abstract (`nnx.eval_shape`), sharded as Tunix shards them,
the optimizer state is donated and the model is not (as in Tunix), and the
program is lowered and compiled for a mesh of the planned shape, whose
`memory_analysis()` gives the bytes per device and `cost_analysis()` the FLOPs.

The mesh is a TPU topology's when libtpu is installed (`tpu_devices`: libtpu's
compile-only devices of e.g. a v5e 2x4 or a v4 4x4x2, on any machine, no TPU) or
the attached TPU's: XLA:TPU then compiles the very program the sft node runs; for
the CPU profile, this CPU's own devices (XLA:CPU, the very program again).
Elsewhere (a GPU planned from here) it is a fake CPU mesh.

Tunix skips its activation sharding constraints on the CPU (`shard()` returns
its input there); they are switched on while tracing so the CPU program is
partitioned like the accelerator's. The CPU has no bf16 matmul (XLA computes bf16
models' matmuls in float32 there, keeping a mixture of both), so
`planning.check_against_xla` checks a bf16 run as the same step in float32.

Deep models are compiled at one and two layer periods (XLA:TPU: two and
four layers, or two and three periods) and extrapolated linearly (every
further layer adds the same weights and, mostly, the same temporaries; the
temporaries are never extrapolated downwards), which is much faster than
compiling every layer.

Run as `python -m tunix_pipeline.planning.xla` (a JSON request on stdin, the
result on stdout) when this process lacks the fake devices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import json
import logging
import math
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import topologies

from tunix_pipeline.config import LoraParams, RuntimeParams, SftParams
from tunix_pipeline.core.runtime import BATCH_AXES, make_mesh, step_compiler_options
from tunix_pipeline.data.tokenization import TOKEN_COLUMNS
from tunix_pipeline.models.architecture import Architecture, PlanError, from_hf_config
from tunix_pipeline.models.families import family_for
from tunix_pipeline.models.loading import run_config
from tunix_pipeline.models.lora import apply_lora
from tunix_pipeline.planning import compiled_figures
from tunix_pipeline.planning.memory import TrainSetup
from tunix_pipeline.train.loss import loss_fn_for, model_inputs
from tunix_pipeline.train.loop import make_optimizer
from tunix_pipeline.upstream import accelerator_sharding

log = logging.getLogger(__name__)


def _tunix_config(arch: Architecture, layers: int, remat: str, compute_dtype: str | None = None):
    hf = arch.with_layers(layers).hf_config
    family = family_for(hf)
    return family, run_config(family, hf, remat, compute_dtype)


def sft_params(setup: TrainSetup):
    """The SftParams whose train step `setup` describes (what the loss and optimizer are built from)."""
    return SftParams(
        max_steps=1000,
        per_device_batch_size=setup.per_device_batch,
        gradient_accumulation_steps=setup.grad_accum,
        optimizer=setup.optimizer,
        mu_dtype=setup.mu_dtype,
        learning_rate=1e-4,
        compute_dtype=setup.compute_dtype if setup.compute_dtype != setup.param_dtype else None,
        remat=setup.remat,
        loss_chunk_size=setup.loss_chunk,
        checkpoint_every=1000,
    )


def abstract_policy(arch: Architecture, setup: TrainSetup, layers: int, lora, devices, tx=None):
    """(mesh, model, optimizer or None, wrt): the model as the trainer builds and shards it, abstract
    (`nnx.eval_shape`, no weights), in `setup`'s parameter dtype, with LoRA/QLoRA applied; the optimizer
    over what is trained (`wrt`) when `tx` is given."""
    family, cfg = _tunix_config(arch, layers, setup.remat, setup.c_dtype)
    mesh = make_mesh(RuntimeParams(mesh=setup.mesh), list(devices)[: setup.devices])
    dtype = jnp.dtype(setup.param_dtype)
    lora_on = setup.mode != "full"
    wrt = nnx.LoRAParam if lora_on else nnx.Param

    def build():
        model = family.model_class(cfg, rngs=nnx.Rngs(0))
        nnx.update(model, jax.tree.map(lambda x: x.astype(dtype), nnx.state(model, nnx.Param)))
        if lora_on:
            model = apply_lora(model, lora)
            if setup.mode == "qlora":  # qwix's quantized LoRA draws from these in the forward pass
                model.set_attributes(qwix_rngs=nnx.Rngs(0), raise_if_not_found=False)
                model(**model.get_model_input())  # and creates some adapters on the first call
        return model, (nnx.Optimizer(model, tx, wrt=wrt) if tx is not None else None)

    model, optimizer = nnx.eval_shape(build)  # shardings come from the metadata (`abstract`)
    return mesh, model, optimizer, wrt


def abstract(state, mesh):
    """`state`'s leaves as ShapeDtypeStructs sharded by their partition metadata (replicated where it does
    not divide, e.g. Adafactor's factored moments)."""
    def leaf(x, spec):
        if isinstance(spec, jax.sharding.PartitionSpec):
            sizes = [int(np.prod([mesh.shape[a] for a in ((ax,) if isinstance(ax, str) else (ax or ()))]))
                     for ax in spec]
            if len(spec) > len(x.shape) or any(d % s for d, s in zip(x.shape, sizes)):
                spec = jax.sharding.PartitionSpec()
        else:
            spec = jax.sharding.PartitionSpec()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(mesh, spec))

    return jax.tree.map(leaf, state, nnx.get_partition_spec(state),
                        is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))


@contextlib.contextmanager
def _unpersisted():
    """Compiles under this are not written to JAX's persistent compilation cache (where one is set): a program
    compiled for compile-only devices (a TPU topology on this CPU) cannot be loaded back from it, and reading its
    entry would warn and compile again."""
    threshold = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    try:
        yield
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", threshold)


def measure(lowered, started: float, layers: int, devices, what: str) -> dict:
    """Compile `lowered` (`what` it is, for the progress lines) for `devices`: memory_analysis() (bytes per device:
    arguments + outputs - aliases + temporaries) and cost_analysis() FLOPs and bytes accessed per device (the
    program is partitioned); read back instead when the same program was compiled before (`compiled_figures`)."""
    platform = devices[0].platform
    # XLA:CPU assigns buffers before LLVM runs: skipping its optimisations changes no figure, only the wait (the GSM8K
    # CPU recipe's GRPO update: the run's 8,635,393,220 bytes of temporaries); the run's own options (which dots and
    # reductions YNNPACK fuses) do change them, so a CPU program is compiled with them
    options = None
    if platform == "cpu":
        options = {**step_compiler_options(), "xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
    entry = compiled_figures.key(lowered, options, devices)
    kept = compiled_figures.read(entry)  # raises XLA:TPU's refusal again, as compiling would
    if kept is not None:
        return {**kept, "layers": layers, "seconds": time.perf_counter() - started, "compiled_before": True}
    # a TPU program's code generation on a CPU takes a minute or more: say what is being waited for
    target = f"{len(devices)} {devices[0].device_kind} devices"
    log.info("plan: compiling %s at %d layers for %s (XLA:%s)...", what, layers, target, platform.upper())
    with _unpersisted() if platform != jax.default_backend() else contextlib.nullcontext():
        try:
            compiled = lowered.compile(compiler_options=options)
        except Exception as err:
            if compiled_figures.REFUSED in str(err):
                compiled_figures.write(entry, {"refused": str(err)})
            raise
    ma = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # one dict per program in older JAX
    out = {
        "flops": float(cost.get("flops", 0.0)),
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "argument": ma.argument_size_in_bytes,
        "output": ma.output_size_in_bytes,
        "alias": ma.alias_size_in_bytes,
        "temp": ma.temp_size_in_bytes,
        "platform": platform,
    }
    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    compiled_figures.write(entry, out)
    seconds = time.perf_counter() - started
    log.info("plan: %s at %d layers compiled in %.0f s", what, layers, seconds)
    return {**out, "layers": layers, "seconds": seconds}


def compile_step(arch: Architecture, setup: TrainSetup, layers: int | None = None, lora=None, devices=None) -> dict:
    """memory_analysis() of the compiled train step, bytes per device."""
    layers = layers or arch.num_layers
    devices = devices if devices is not None else jax.devices()[: setup.devices]
    if len(devices) < setup.devices:
        raise PlanError(f"the XLA check needs {setup.devices} devices; JAX sees {len(devices)}")
    sft = sft_params(setup)
    tx = make_optimizer(sft, sft.max_steps)
    if setup.grad_accum > 1:
        tx = optax.MultiSteps(tx, setup.grad_accum)  # as PeftTrainer wraps it
    loss_fn = loss_fn_for(sft)
    started = time.perf_counter()
    mesh, model, optimizer, wrt = abstract_policy(arch, setup, layers, lora, devices, tx)
    graph, trained, frozen = nnx.split(model, wrt, ...)
    opt_graph, opt_state = nnx.split(optimizer)
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*BATCH_AXES))
    global_batch = setup.per_device_batch * setup.data * setup.fsdp
    batch = {k: jax.ShapeDtypeStruct((global_batch, setup.seq_len), jnp.int32, sharding=rows) for k in TOKEN_COLUMNS[1:]}

    def train_step(trained, frozen, opt_state, batch):  # Tunix's PeftTrainer._train_step
        model = nnx.merge(graph, trained, frozen)
        optimizer = nnx.merge(opt_graph, opt_state)
        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt))(model, **model_inputs(batch))
        grad_norm = optax.global_norm(grads)
        optimizer.update(model, grads)
        return loss, grad_norm, nnx.state(model, wrt), nnx.state(optimizer)

    with accelerator_sharding(), mesh:
        lowered = jax.jit(train_step, donate_argnums=(2,)).lower(
            abstract(trained, mesh), abstract(frozen, mesh), abstract(opt_state, mesh), batch)
        return measure(lowered, started, layers, devices, "the SFT train step")


def xla_peak(arch: Architecture, setup: TrainSetup, max_layers: int | None = 4, lora=None, devices=None) -> dict:
    """XLA's peak bytes per device for the whole model (extrapolated from two depths when deep)."""
    period = max(arch.layer_period, 1)
    # XLA:TPU schedules a model's first layer unlike the others (Gemma-2B, 1 x 512: two layers took less
    # than one), so on a TPU the extrapolation starts from two layer periods
    tpu = devices is not None and devices[0].platform == "tpu"
    first = 2 * period if tpu else period
    # and a layer's temporaries vary from one layer to the next (Qwen2.5-0.5B with remat: the third layer adds 0.06
    # GiB, the fourth 0.13, the 24 layers 0.08 each on average), so the increment is measured over two layers at least
    step = 2 if tpu and period == 1 else period
    second = first + step
    if max_layers is None or arch.num_layers <= max(max_layers, second):
        full = compile_step(arch, setup, None, lora, devices)
        return {**full, "method": compiled_figures.method(f"compiled all {arch.num_layers} layers", full)}
    a = compile_step(arch, setup, first, lora, devices)
    b = compile_step(arch, setup, second, lora, devices)
    periods = (arch.num_layers - first) / step
    # the weights and optimizer state (arguments, outputs) grow exactly by a layer's; the temporaries
    # need not: XLA:TPU may schedule a deeper program into less (Gemma-2B, 1 x 512 without remat: 2.92
    # GB of temporaries at three layers, 3.17 at two), so the extrapolation never lets them shrink
    resident = [x["argument"] + x["output"] - x["alias"] for x in (a, b)]
    temp = b["temp"] + (periods - 1) * max(b["temp"] - a["temp"], 0.0)
    return {
        "peak": resident[0] + periods * (resident[1] - resident[0]) + temp,
        "flops": a["flops"] + periods * (b["flops"] - a["flops"]),
        "per_layer": (b["peak"] - a["peak"]) / step,
        "seconds": a["seconds"] + b["seconds"],
        "platform": a["platform"],
        "method": compiled_figures.method(f"compiled {first} and {second} layers, extrapolated to {arch.num_layers}", a, b),
    }


# ---------------------------------------------------------------- TPU topologies, compiled here
# libtpu compiles for a TPU it does not have (compile-only devices). Off a TPU VM it must not ask
# the metadata server (offline) and finds one worker; its lock guards a real TPU, which a
# compile-only topology does not use, so another JAX process holding it does not matter.
LIBTPU_OFFLINE = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
MEGACORE = ("v4", "v5p")  # JAX drives both TensorCores of a chip as one device


def libtpu_installed() -> bool:
    return importlib.util.find_spec("libtpu") is not None


@functools.lru_cache(maxsize=None)
def tpu_devices(topology: str, hosts: int = 1) -> tuple:
    """The compile-only devices of a TPU topology (e.g. `v5e:2x4`): XLA:TPU compiles for them on any machine."""
    if not libtpu_installed():
        raise PlanError(f"compiling for the TPU topology {topology} needs libtpu: pip install -e '.[tpu]'")
    generation, grid = topology.split(":")
    dims = [int(x) for x in grid.split("x")]
    # the accelerator libtpu would find on a TPU VM (it warns when it cannot tell); only read at its start
    accelerator = {"v5e": "v5litepod", "v6e": "v6e"}.get(generation, generation)
    cores = math.prod(dims) * (1 if generation in ("v5e", "v6e") else 2)
    for key, value in {**LIBTPU_OFFLINE, "TPU_ACCELERATOR_TYPE": f"{accelerator}-{cores}"}.items():
        os.environ.setdefault(key, value)

    bounds = _host_bounds(dims + [1] * (3 - len(dims)), math.prod(dims) // hosts)
    return tuple(
        topologies.get_topology_desc(
            topology,
            platform="tpu",
            chip_config_name="megacore" if generation in MEGACORE else "default",
            chips_per_host_bounds=bounds,
            num_slices=1,
        ).devices
    )


def _host_bounds(dims: list[int], per_host: int) -> tuple[int, int, int]:
    """One host's block of chips within the grid (a v5e-8 host: 2x4; a v4 host: 2x2x1)."""
    for bounds in ((1, 1, 1), (2, 1, 1), (2, 2, 1), (2, 4, 1), (4, 4, 1), (2, 2, 2), (4, 4, 2)):
        if math.prod(bounds) == per_host and all(d % b == 0 for d, b in zip(dims, bounds)):
            return bounds
    raise PlanError(f"cannot split a {'x'.join(map(str, dims))} TPU grid into hosts of {per_host} chips")


def tpu_target(hw) -> tuple[str, tuple] | None:
    """(name, devices) that XLA:TPU compiles the step for: the attached TPU's, or the profile's
    topology's through libtpu; None when neither is at hand (the CPU check stands in)."""
    if hw.kind != "tpu":
        return None
    if jax.default_backend() == "tpu" and jax.device_count() >= hw.devices:
        return f"attached {jax.devices()[0].device_kind}", tuple(jax.devices()[: hw.devices])
    if hw.topology and libtpu_installed():
        return hw.topology, tpu_devices(hw.topology, hw.hosts)
    return None


def cpu_target(hw) -> tuple[str, tuple] | None:
    """(name, devices) when the profile is the CPU this process runs on: XLA:CPU then compiles the very programs the
    run compiles (the real Gemma 3 270M's LoRA SFT step in ~15 s on 2 cores, its GRPO update in ~25 s)."""
    if hw.kind != "cpu" or jax.default_backend() != "cpu" or jax.device_count() < hw.devices:
        return None
    return "this CPU", tuple(jax.devices()[: hw.devices])


def compile_target(hw) -> tuple[str, tuple] | None:
    """(name, devices) of the compiler that will run the profile's programs, when it is at hand: XLA:TPU for a TPU
    (attached, or its topology through libtpu), XLA:CPU for this CPU; None elsewhere (a GPU from here)."""
    return tpu_target(hw) or cpu_target(hw)


# ---------------------------------------------------------------- out of process
def request(arch: Architecture, setup: TrainSetup, max_layers: int | None, lora=None) -> dict:
    return {
        "hf_config": arch.hf_config,
        "name": arch.name,
        "setup": dataclasses.asdict(setup),
        "max_layers": max_layers,
        "lora": lora.model_dump() if lora is not None else None,
    }


def run_request(req: dict) -> dict:
    arch = from_hf_config(req["hf_config"], req["name"])
    setup_dict = dict(req["setup"])
    setup_dict["lora_targets"] = tuple(setup_dict.get("lora_targets") or ())
    setup = TrainSetup(**setup_dict)
    lora = LoraParams(**req["lora"]) if req.get("lora") else None
    return xla_peak(arch, setup, req.get("max_layers"), lora)


def check(arch: Architecture, setup: TrainSetup, max_layers: int | None = 4, lora=None, timeout: float = 900) -> dict:
    """XLA's figure, compiled here when JAX has enough CPU devices, else in a child process that has them."""
    cpus = [d for d in jax.devices() if d.platform == "cpu"] if jax.default_backend() == "cpu" else []
    if len(cpus) >= setup.devices:
        return xla_peak(arch, setup, max_layers, lora, cpus[: setup.devices])
    env = dict(os.environ)
    flags = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f)
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={setup.devices}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tunix_pipeline.planning.xla"],
            input=json.dumps(request(arch, setup, max_layers, lora)),
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as err:
        raise PlanError(f"the XLA check took longer than {timeout:.0f} s") from err
    if done.returncode != 0:
        raise PlanError(f"the XLA check failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _main() -> None:
    req = json.loads(sys.stdin.read())
    print(json.dumps(run_request(req)))


if __name__ == "__main__":
    _main()
