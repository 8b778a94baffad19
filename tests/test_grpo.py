"""GRPO with Tunix on the tiny model: data feed, variants, short runs (full weights and LoRA), resume."""

import functools
import gc
import itertools
import json
import zlib

import jax
import numpy as np
import pandas as pd
import pytest
from flax import nnx

from tunix_pipeline import upstream
from tunix_pipeline.config import GrpoParams, LoraParams, RuntimeParams
from tunix_pipeline.generate import generation
from tunix_pipeline.core.runtime import make_mesh
from tunix_pipeline.train import grpo
from tunix_pipeline.train.loop import frozen_copy

MESH = RuntimeParams(mesh={"fsdp": 4, "tp": 2})


def distinct_chars(prompts, completions, **columns):
    """A custom reward (used by dotted path): varies between random completions, so advantages are not 0."""
    return [len(set(c)) / 10 for c in completions]


def sometimes_right(prompts, completions, answer, **columns):
    """A custom reward for the prompt filter: odd answers are never right, 0 always, the others score each sample's
    text in [0.5, 1) (random samples differ), so which prompts the filter keeps does not hang on what the tiny model
    writes."""
    return [0.0 if int(a) % 2 else 1.0 if a == "0" else 0.5 + zlib.crc32(c.encode()) % 997 / 1994
            for a, c in zip(answer, completions)]


@pytest.fixture(scope="module")
def formatted():
    n = 12
    return pd.DataFrame(
        {
            "id": [f"r{i}" for i in range(n)],
            "source": ["t"] * n,
            "prompt": [f"<bos><start_of_turn>user\nAda has {i} apples.<end_of_turn>\n<start_of_turn>model\n" for i in range(n)],
            "completion": [f"<reasoning>{i}</reasoning><answer>{i}</answer><end_of_turn>" for i in range(n)],
            "answer": [str(i) for i in range(n)],
        }
    )


def _params(tmp_path, **kwargs):
    defaults = dict(
        max_steps=2, batch_size=2, num_generations=2, max_prompt_length=32, max_completion_length=8,
        learning_rate=1e-2, checkpoint_every=2, checkpoint_dir=str(tmp_path / "grpo"),
        rewards=[{"fn": "tests.test_grpo:distinct_chars"}, {"fn": "format_exact", "weight": 0.5}, {"fn": "answer"}],
    )
    return GrpoParams(**{**defaults, **kwargs})


def _weights(model, kind=nnx.Param):
    return {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, kind))}


# ---------------------------------------------------------------- pieces
def test_prompt_feed_is_seeded_numpy_and_moves_the_sampling_seed(formatted):
    from tunix.rl.rollout import base_rollout

    rollout = base_rollout.RolloutConfig(seed=0)
    feed = grpo.PromptFeed(formatted, batch_size=4, seed=3, rollout_config=rollout)
    first = list(itertools.islice(feed, 5))
    again = list(itertools.islice(grpo.PromptFeed(formatted, batch_size=4, seed=3), 5))
    assert all(isinstance(v, np.ndarray) for v in first[0].values())  # Tunix splits Python lists
    assert set(first[0]) == {"prompts", "answer", "id", "source", "reference"}
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a["prompts"], b["prompts"])
    assert rollout.seed == 3 * 1_000_003 + 4  # the 5th batch's seed
    epoch = np.concatenate([b["id"] for b in first[:3]])
    assert sorted(epoch) == sorted(formatted["id"])  # an epoch is a permutation
    with pytest.raises(grpo.GrpoError, match="cannot fill one GRPO batch of 20"):
        grpo.PromptFeed(formatted, batch_size=20, seed=0)


def test_max_prompts_is_a_seeded_pool_the_feed_cycles_over(formatted):
    pool = grpo.prompt_pool(formatted, 4, seed=0)
    assert len(pool) == 4 and set(pool["id"]) <= set(formatted["id"])
    assert list(grpo.prompt_pool(formatted, 4, seed=0)["id"]) == list(pool["id"])  # same seed, same pool
    assert list(grpo.prompt_pool(formatted, 4, seed=1)["id"]) != list(pool["id"])
    assert grpo.prompt_pool(formatted, None, seed=0) is formatted and grpo.prompt_pool(formatted, 99, 0) is formatted
    batches = list(itertools.islice(grpo.PromptFeed(pool, batch_size=2, seed=0), 6))  # 3 epochs of 2 batches
    assert {i for b in batches for i in b["id"]} == set(pool["id"])
    with pytest.raises(ValueError, match=r"max_prompts \(1\) cannot fill one batch of batch_size \(2\)"):
        GrpoParams(max_steps=2, batch_size=2, max_prompts=1)


def test_prompts_that_do_not_fit_are_skipped_and_counted(formatted, tokenizer, caplog):
    long = formatted.copy()
    long.loc[0, "prompt"] += " apples" * 100
    with caplog.at_level("WARNING"):
        rows, skipped = generation.fitting_prompts(long, tokenizer, 32, setting="grpo.max_prompt_length")
    assert skipped == 1 and len(rows) == len(formatted) - 1 and "r0" not in set(rows["id"])
    assert "longer than grpo.max_prompt_length=32 tokens" in caplog.text  # the warning names the stage's setting


@pytest.mark.parametrize(
    ("variant", "beta", "estimator"),
    [("grpo", 0.04, "grpo"), ("dr-grpo", 0.0, "drgrpo"), ("dapo", 0.0, "grpo")],
)
def test_loss_variants_map_to_tunix_learners(tmp_path, variant, beta, estimator):
    config, learner = upstream.algorithm(_params(tmp_path, loss_variant=variant, beta=beta, num_generations=4))
    assert config.advantage_estimator == estimator and config.num_generations == 4
    assert config.beta == beta  # dapo: 0.0, so Tunix skips the reference pass
    assert learner.__name__ == {"grpo": "GRPOLearner", "dr-grpo": "DrGRPOLearner", "dapo": "DAPOLearner"}[variant]
    if variant == "dapo":
        assert config.epsilon_high == 0.28 and config.overlong_buffer is None


def test_frozen_copy_shares_arrays_until_the_model_changes(tiny_model_dir):
    from tunix_pipeline.models import load_model

    model, _ = load_model(tiny_model_dir, None, "float32")
    copy = frozen_copy(model)
    before = _weights(copy)
    nnx.update(model, jax.tree.map(lambda x: x + 1, nnx.state(model, nnx.Param)))
    after = _weights(copy)
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_batch_must_divide_over_the_data_devices(tiny_model_dir, tokenizer, formatted, tmp_path):
    with pytest.raises(grpo.GrpoError, match=r"= 6 completions at a time must divide over the 4 data-parallel"):
        grpo.prepare(formatted, tokenizer, _params(tmp_path, batch_size=3), make_mesh(MESH))
    with pytest.raises(grpo.GrpoError, match=r"grpo.micro_batch_size x grpo.num_generations = 2 completions at a"):
        grpo.prepare(formatted, tokenizer, _params(tmp_path, micro_batch_size=1), make_mesh(MESH))
    with pytest.raises(ValueError, match=r"micro_batch_size \(3\) must divide batch_size \(4\)"):
        _params(tmp_path, batch_size=4, micro_batch_size=3)
    from tunix_pipeline.train.skips import NothingToLearn

    with pytest.raises(NothingToLearn, match=rf"0 of {len(formatted)} training prompts fit grpo.max_prompt_length=4 "
                       rf"tokens \({len(formatted)} too long\), and one batch takes grpo.batch_size=2: raise "
                       r"grpo.max_prompt_length\Z"):
        grpo.prepare(formatted, tokenizer, _params(tmp_path, max_prompt_length=4), make_mesh(MESH))


def test_metric_listener_scope_removes_what_it_added():
    from jax._src import monitoring

    before = list(monitoring.get_scalar_listeners())

    def listener(*args, **kwargs): ...

    with upstream.scalar_listeners_scope():
        jax.monitoring.register_scalar_listener(listener)
    assert list(monitoring.get_scalar_listeners()) == before


# ---------------------------------------------------------------- short runs
@pytest.mark.slow
def test_grpo_full_weights_trains_checkpoints_and_resumes(tiny_model_dir, tokenizer, formatted, tmp_path, monkeypatch):
    from tunix_pipeline import upstream
    from tunix_pipeline.models import load_model

    mesh = make_mesh(MESH)
    model, _ = load_model(tiny_model_dir, mesh, "float32")
    start = _weights(model)
    params = _params(tmp_path)
    batches = []  # what the rollout's sampler was asked: (completions, group size, made of groups?)
    in_groups = upstream.generation.in_groups
    monkeypatch.setattr(upstream.generation, "in_groups", lambda t, g: batches.append((len(t), g, in_groups(t, g))) or batches[-1][2])
    inputs = grpo.prepare(formatted, tokenizer, params, mesh)
    result = grpo.train_grpo(model, tokenizer, inputs, params, mesh)
    # each step's G completions of a prompt arrive as G copies in a row: one prefill per prompt
    assert batches == [(params.batch_size * params.num_generations, params.num_generations, True)] * 2

    assert (result["latest_step"], result["resumed_from_step"], result["steps_this_run"]) == (2, 0, 2)
    assert result["reference_model"] and result["completions_per_step"] == 4
    assert result["rewards"] == {"distinct_chars": 1.0, "format_exact": 0.5, "answer": 1.0}
    history = result["history"]
    assert [h["step"] for h in history] == [1, 2]
    for h in history:
        assert h["reward"] > 0 and h["reward/distinct_chars"] > 0 and h["reward/format_exact"] == 0
        assert h["kl"] is not None and h["completion_length"] > 0 and h["reward_std"] >= 0
    ckpt = tmp_path / "grpo" / "actor"
    assert result["checkpoint_dir"] == str(ckpt) and (ckpt / "2").is_dir() and not (ckpt / "1").exists()
    assert json.loads((tmp_path / "grpo" / grpo.HISTORY_FILE).read_text()) == history
    trained = _weights(model)
    assert any(not np.allclose(start[k], trained[k]) for k in start)  # a step moves weights by ~lr, far past 1e-5

    # the checkpoint restores into a fresh model
    from tunix_pipeline.train.checkpoints import restore_latest

    fresh, _ = load_model(tiny_model_dir, mesh, "float32")
    assert restore_latest(fresh, ckpt) == 2
    assert all(np.array_equal(trained[k], v) for k, v in _weights(fresh).items())  # save/restore: bitwise

    # a longer budget resumes from step 2; the same budget again trains nothing
    model, _ = load_model(tiny_model_dir, mesh, "float32")
    longer = _params(tmp_path, max_steps=3)
    resumed = grpo.train_grpo(model, tokenizer, grpo.prepare(formatted, tokenizer, longer, mesh), longer, mesh)
    assert (resumed["resumed_from_step"], resumed["latest_step"], resumed["steps_this_run"]) == (2, 3, 1)
    assert [h["step"] for h in resumed["history"]] == [1, 2, 3]
    assert result["reward_trend"] is None  # 2 steps: too few to call a trend
    trend, rewards = resumed["reward_trend"], [h["reward"] for h in resumed["history"]]
    assert (trend["first_third"], trend["last_third"]) == (rewards[0], rewards[2])
    model, _ = load_model(tiny_model_dir, mesh, "float32")
    again = grpo.train_grpo(model, tokenizer, grpo.prepare(formatted, tokenizer, longer, mesh), longer, mesh)
    assert again["steps_this_run"] == 0 and len(again["history"]) == 3
    # the training time is every run's: nothing trained keeps it
    assert resumed["train_seconds"] == pytest.approx(result["train_seconds"] + resumed["seconds_this_run"])
    assert again["train_seconds"] == pytest.approx(resumed["train_seconds"] + again["seconds_this_run"])


@pytest.mark.slow
def test_grpo_with_lora_trains_only_adapters_without_a_reference(tiny_model_dir, tokenizer, formatted, tmp_path):
    from tunix_pipeline.models import apply_lora, load_model

    mesh = make_mesh(MESH)
    model, _ = load_model(tiny_model_dir, mesh, "float32")
    model = apply_lora(model, LoraParams(rank=2, alpha=4.0), mesh)
    base, adapters = _weights(model), _weights(model, nnx.LoRAParam)
    params = _params(tmp_path, loss_variant="dr-grpo", beta=0.0, max_steps=1, checkpoint_every=1, max_prompts=2)
    # rollouts over the weights gathered onto each device, as the Kaggle Gemma-2-2B recipe decodes
    inputs = grpo.prepare(formatted, tokenizer, params, mesh)
    result = grpo.train_grpo(model, tokenizer, inputs, params, mesh, decode_weights="gathered")
    assert result["latest_step"] == 1 and not result["reference_model"] and result["prompts"] == 2
    assert result["history"][0]["kl"] is None  # no KL without a reference
    new_base, new_adapters = _weights(model), _weights(model, nnx.LoRAParam)
    assert all(np.array_equal(base[k], new_base[k]) for k in base if k not in adapters)
    assert any(not np.allclose(adapters[k], new_adapters[k]) for k in adapters)  # moved by ~lr, far past 1e-5


@pytest.mark.slow
def test_grpo_with_a_reference_holds_one_copy_of_the_base_weights(tiny_model_dir, tokenizer, formatted, tmp_path,
                                                                   monkeypatch):
    """LoRA with a reference, one update a batch: the actor, its reference and the rollout read one array a base
    weight; Tunix's cluster does not keep another copy of the model for the old policy nothing asks for; on the CPU
    each update starts with the host memory the rollout freed handed back."""
    from tunix.rl import rl_cluster as rl_cluster_lib

    from tunix_pipeline.models import apply_lora, load_model

    clusters, events = [], []
    built, update, hand_back = (rl_cluster_lib.RLCluster.__init__, rl_cluster_lib.RLCluster.update_actor,
                                upstream.hand_back_host_memory)

    def kept(self, *args, **kwargs):
        built(self, *args, **kwargs)
        clusters.append(self)

    def updated(self, *args, **kwargs):
        events.append("update")
        return update(self, *args, **kwargs)

    def handed_back():
        events.append("hand back")
        hand_back()

    monkeypatch.setattr(rl_cluster_lib.RLCluster, "__init__", kept)
    monkeypatch.setattr(rl_cluster_lib.RLCluster, "update_actor", updated)
    monkeypatch.setattr(upstream, "hand_back_host_memory", handed_back)
    mesh = make_mesh(MESH)
    model, _ = load_model(tiny_model_dir, mesh, "float32")
    model = apply_lora(model, LoraParams(rank=2, alpha=4.0), mesh)
    params = _params(tmp_path, beta=0.04, max_steps=2, checkpoint_every=2, max_prompts=4)
    result = grpo.train_grpo(model, tokenizer, grpo.prepare(formatted, tokenizer, params, mesh), params, mesh)
    assert result["latest_step"] == 2 and result["reference_model"]
    (cluster,) = clusters  # still alive: whatever it holds is still live
    gc.collect()  # what earlier tests left unreferenced is not counted
    embedding = model.embedder.input_embedding[...]
    copies = [a for a in jax.live_arrays() if a.shape == embedding.shape and a is not embedding]
    assert cluster._anchor_policy_state is None and not copies, [a.sharding for a in copies]
    assert events == ["hand back", "update"] * 2


@pytest.mark.slow
def test_the_plan_compiles_the_update_the_run_compiles(tiny_model_dir, tokenizer, formatted, tmp_path, monkeypatch):
    """The plan's GRPO update (`planning.grpo_xla`) is the run's program: LoRA with a reference, the update split into
    micro-batches (accumulated by `optax.MultiSteps`), the loss's logged metrics kept (the token entropy over the whole
    vocabulary among them). XLA:CPU gives both the same temporaries; a plan that left out what the run keeps planned
    the real 270M's update 1.26 GiB short (benchmarks/RESULTS.md, section 48)."""
    from tunix_pipeline.core.runtime import step_compiler_options
    from tunix_pipeline.models import apply_lora, load_model
    from tunix_pipeline.models.architecture import from_hf_config
    from tunix_pipeline.planning import grpo_xla
    from tunix_pipeline.planning.memory import TrainSetup

    steps = []
    build = upstream.frozen_weights_in_only

    def recorded(train_step, model, optimizer):  # the run's jitted step, with what it was called on
        step = build(train_step, model, optimizer)

        def call(inputs):
            steps.append((step.func.jitted_fn, model, optimizer, inputs))
            return step(inputs)

        call.jitted_fn = step.func.jitted_fn
        return functools.partial(call)

    monkeypatch.setattr(upstream, "frozen_weights_in_only", recorded)
    mesh, lora = make_mesh(MESH), LoraParams(rank=2, alpha=4.0)
    model, _ = load_model(tiny_model_dir, mesh, "float32")
    model = apply_lora(model, lora, mesh)
    params = _params(tmp_path, beta=0.04, max_steps=1, checkpoint_every=1, max_prompts=4, num_generations=4,
                     micro_batch_size=1)
    grpo.train_grpo(model, tokenizer, grpo.prepare(formatted, tokenizer, params, mesh), params, mesh)
    jitted, actor, optimizer, inputs = steps[-1]
    _, frozen, opt_state, rest = nnx.split((actor, optimizer), upstream.FROZEN, nnx.optimizer.OptState, ...)
    with upstream.completion_logits_only(), mesh:  # as the run traced it
        run = jitted.lower(frozen, opt_state, rest, inputs).compile(compiler_options=step_compiler_options())
    arch = from_hf_config(json.loads((tiny_model_dir / "config.json").read_text()))
    setup = TrainSetup(per_device_batch=1, seq_len=params.max_prompt_length + params.max_completion_length,
                       fsdp=4, tp=2, backend="cpu", mode="lora", lora_rank=lora.rank)
    plan = grpo_xla.lower_update_step(arch, setup, params, arch.num_layers, lora, jax.devices())
    plan = plan.compile(compiler_options=step_compiler_options())
    figures = [{k: getattr(c.memory_analysis(), f"{k}_size_in_bytes") for k in ("argument", "output", "alias", "temp")}
               for c in (plan, run)]
    assert figures[0] == figures[1]


@pytest.mark.slow
def test_micro_batches_make_the_same_step_as_the_whole_batch(tiny_model_dir, tokenizer, formatted, tmp_path):
    """4 prompts x 2 completions: log-probs and gradients over micro-batches of 2 prompts, accumulated,
    against all 8 completions at once. Generation runs the whole batch either way (same completions)."""
    import orbax.checkpoint as ocp

    from tunix_pipeline.models import load_model

    mesh, runs = make_mesh(MESH), {}
    for name, micro in (("whole", None), ("micro", 2)):
        model, _ = load_model(tiny_model_dir, mesh, "float32")
        params = _params(tmp_path / name, batch_size=4, max_steps=1, checkpoint_every=1, micro_batch_size=micro)
        inputs = grpo.prepare(formatted, tokenizer, params, mesh)
        history = grpo.train_grpo(model, tokenizer, inputs, params, mesh)["history"]
        saved = ocp.PyTreeCheckpointer().restore(str(tmp_path / name / "grpo" / "actor" / "1" / "optimizer_state"))
        state = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(saved)[0]}
        # Adam's first moment after one step is 0.1 x the (clipped) gradient of the step's loss
        mu = {k.split("['mu']")[1]: v for k, v in state.items() if "['mu']" in k}
        runs[name] = history[0], mu, state

    (whole, g_whole, _), (split, g_split, state) = runs["whole"], runs["micro"]
    assert state["['opt_state']['gradient_step']['value']"] == 1  # optax.MultiSteps: 2 micro-batches, 1 update
    assert {k: whole[k] for k in whole if k != "kl"} == {k: split[k] for k in split if k != "kl"}  # same samples
    # The same sums in another order: float32 rounds each of the <= n = 8 completions x 40 positions terms of
    # a gradient entry by u = 2^-24, so the two differ by at most ~n * u of the tensor's largest entry.
    # KL is 0 at the first step (policy = reference) up to the rounding of two log-softmaxes (~u each).
    tolerance = 8 * 40 * 2.0**-24
    assert whole["kl"] == pytest.approx(split["kl"], abs=1e-6)
    assert set(g_whole) == set(g_split) and any(np.abs(g).max() > 0 for g in g_whole.values())
    for key, g in g_whole.items():
        assert np.abs(g_split[key] - g).max() <= tolerance * np.abs(g).max(), key


def test_reward_trend_needs_a_rising_slope_and_a_higher_last_third():
    def trend(*rewards):
        return grpo.reward_trend([{"step": i + 1, "reward": r} for i, r in enumerate(rewards)])

    rising = trend(1.0, 1.5, 1.2, 2.0, 1.8, 2.4)  # thirds of two steps: 1.25 -> 2.1
    assert rising["rises"] and rising["slope_per_step"] == pytest.approx(0.248571, abs=1e-6)
    assert (rising["first_third"], rising["last_third"]) == pytest.approx((1.25, 2.1))
    assert "rises over 6 steps" in rising["summary"]
    # a higher last third on a falling slope is no rise
    dip = trend(2.0, 1.0, 0.2, 0.2, 2.5, 1.0)
    assert dip["last_third"] > dip["first_third"] and dip["slope_per_step"] < 0 and not dip["rises"]
    assert not trend(1.34, 0.75, 1.59, 1.44, 0.84)["rises"]  # the old recipe's five steps
    assert trend(1.0, 2.0) is None


def test_export_ships_grpo_only_when_it_ran_from_the_current_sft_checkpoint(caplog):
    from tunix_pipeline.pipelines.export.nodes import final_checkpoint

    sft = {"checkpoint_dir": "/c/sft", "latest_step": 200}
    ran = {"enabled": True, "checkpoint_dir": "/c/grpo/actor", "start_checkpoint_dir": "/c/sft", "start_step": 200}
    assert final_checkpoint({"sft": sft, "grpo": ran}) == ("grpo", "/c/grpo/actor")
    off = {"enabled": False, "checkpoint_dir": "/c/sft", "start_checkpoint_dir": "/c/sft", "start_step": 200}
    assert final_checkpoint({"sft": sft, "grpo": off}) == ("sft", "/c/sft")
    # SFT trained on after GRPO ran: the GRPO policy is stale, ship SFT and say so
    assert final_checkpoint({"sft": {**sft, "latest_step": 210}, "grpo": ran}) == ("sft", "/c/sft")
    assert "grpo_result is from SFT step 200" in caplog.text


def test_grpo_weight_decay_reaches_matrices_only(tiny_model_dir, tmp_path):
    """GRPO builds the SFT optimizer: with weight_decay > 0 a zero gradient moves matrices, never norms."""
    from tunix_pipeline.models import load_model
    from tunix_pipeline.train.loop import make_optimizer

    model, _ = load_model(tiny_model_dir, None)
    # every weight away from 0, so decay would move any leaf it reached (Gemma's norm scales start at 0)
    params = jax.tree.map(lambda p: p + 1.0, nnx.state(model, nnx.Param))
    grpo = _params(tmp_path, weight_decay=0.1, learning_rate=1e-2)
    tx = make_optimizer(grpo, grpo.max_steps)
    updates, _ = tx.update(jax.tree.map(np.zeros_like, params), tx.init(params), params)
    moved = {
        jax.tree_util.keystr(path): (leaf.ndim, float(np.abs(leaf).max()))
        for path, leaf in jax.tree_util.tree_leaves_with_path(updates)
    }
    vectors = {k: m for k, (ndim, m) in moved.items() if ndim < 2}
    matrices = {k: m for k, (ndim, m) in moved.items() if ndim >= 2}
    assert vectors and matrices
    assert all(m == 0 for m in vectors.values()), vectors
    assert all(m > 0 for m in matrices.values()), matrices


@pytest.mark.slow
def test_grpo_dev_eval_keeps_the_best_step(tiny_model_dir, tokenizer, formatted, tmp_path, monkeypatch):
    from tunix_pipeline.evaluate import evaluation
    from tunix_pipeline.evaluate.dev_eval import DevEval
    from tunix_pipeline.models import load_model
    from tunix_pipeline.stages import selected_step
    from tunix_pipeline.train.checkpoints import restore_required

    mesh = make_mesh(MESH)
    model, _ = load_model(tiny_model_dir, mesh, "float32")
    scripted, at_step = [0.5, 0.25], []  # steps 1 and 2 (the tiny random model answers nothing right)
    real_score = evaluation.score

    def score(*args, **kwargs):
        metrics, samples = real_score(*args, **kwargs)
        at_step.append(_weights(model))
        return {**metrics, "lenient_accuracy": scripted[len(at_step) - 1]}, samples

    monkeypatch.setattr(evaluation, "score", score)
    params = _params(tmp_path, keep_checkpoints=1, dev_eval={"every": 1, "prompts": 2, "max_new_tokens": 4,
                                                              "batch_size": 4})
    inputs = grpo.prepare(formatted, tokenizer, params, mesh)
    dev = DevEval(params.dev_eval, tokenizer, formatted.tail(3), "grpo")
    result = grpo.train_grpo(model, tokenizer, inputs, params, mesh, dev=dev)
    assert [(p["step"], p["lenient_accuracy"]) for p in result["dev_curve"]] == [(1, 0.5), (2, 0.25)]
    assert (result["best_step"], result["selected_step"], result["latest_step"]) == (1, 1, 2)
    ckpt = tmp_path / "grpo" / "actor"
    assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == ["1", "2"]  # the best outlives pruning
    fresh, _ = load_model(tiny_model_dir, mesh, "float32")
    assert restore_required(fresh, ckpt, "grpo", "export", selected_step(result)) == 1
    assert all(np.array_equal(at_step[0][k], v) for k, v in _weights(fresh).items())
    assert not all(np.array_equal(at_step[1][k], v) for k, v in _weights(fresh).items())


@pytest.mark.slow
def test_the_prompt_filter_keeps_the_prompts_whose_samples_score_differently(tiny_model_dir, tokenizer, formatted,
                                                                            tmp_path, monkeypatch):
    from tunix_pipeline.core.paths import storage_path
    from tunix_pipeline.models import load_model
    from tunix_pipeline.train.skips import NothingToLearn

    mesh = make_mesh(MESH)
    model, _ = load_model(tiny_model_dir, mesh, "float32")
    screens = []  # each time the policy is sampled
    sample = grpo._Screen.__call__
    monkeypatch.setattr(grpo._Screen, "__call__", lambda *a, **k: screens.append(1) or sample(*a, **k))

    def screened(**settings):
        screen = {"samples": 4, "reward": "sometimes_right", "right_at": None, "batch_size": 8}
        params = _params(tmp_path, rewards=[{"fn": "tests.test_grpo:sometimes_right"}, {"fn": "answer"}],
                         **{"prompt_filter": screen, **settings})
        inputs = grpo.prepare(formatted, tokenizer, params, mesh)
        root = storage_path(params.checkpoint_dir)
        return (*grpo.filtered_prompts(model, tokenizer, inputs.prompts, inputs.rewards, params, mesh, root), root)

    rows, summary, root = screened()
    assert sorted(rows["answer"], key=int) == ["2", "4", "6", "8", "10"]  # odd: never right; 0: always
    assert {k: v for k, v in summary.items() if k != "seconds"} == {
        "samples": 4, "reward": "sometimes_right", "right_at": None, "screened": 12, "kept": 5, "none_right": 6,
        "all_right": 6, "reused": 0}  # right_at null: right is above 0, as every sample of 0 and the even ones
    saved = json.loads((root / grpo.FILTER_FILE).read_text())
    assert len(saved["scores"]) == 12 and all(len(s) == 4 for s in saved["scores"].values())
    # a resumed run reads the scores back; other settings sample again
    again, summary, _ = screened()
    assert summary["reused"] == 12 and again.equals(rows) and len(screens) == 1
    assert screened(temperature=0.5)[1]["reused"] == 0 and len(screens) == 2
    # a screen killed part-way keeps the parts it finished; the rerun samples the rest, as one run would have
    monkeypatch.setattr(grpo, "SCREEN_PART_BATCHES", 1)  # parts of 2 prompts (8 rows at a time, 4 samples each)
    (root / grpo.FILTER_FILE).unlink()
    whole, scores = screened()[0], json.loads((root / grpo.FILTER_FILE).read_text())["scores"]
    kills = len(screens) + 2

    def killed(*a, **k):
        if len(screens) == kills:
            raise KeyboardInterrupt
        return screens.append(1) or sample(*a, **k)

    monkeypatch.setattr(grpo._Screen, "__call__", killed)
    (root / grpo.FILTER_FILE).unlink()
    with pytest.raises(KeyboardInterrupt):
        screened()
    assert len(json.loads((root / grpo.FILTER_FILE).read_text())["scores"]) == 4  # 2 parts of 2 prompts
    kills, before = None, len(screens)
    resumed, summary, _ = screened()
    assert summary["reused"] == 4 and len(screens) - before == 4 and resumed.equals(whole)  # the 4 parts left
    assert json.loads((root / grpo.FILTER_FILE).read_text())["scores"] == scores
    # too few kept for one batch: nothing to learn (the node skips the stage and says why)
    with pytest.raises(NothingToLearn, match=r"5 of 12 prompts score differently on 'sometimes_right' across their 4 "
                                             r"samples \(6 never right, 6 always right\), and one batch takes "
                                             r"grpo.batch_size=6: screen more prompts"):
        screened(batch_size=6)
    with pytest.raises(ValueError, match="prompt_filter.reward 'correct' names none of the rewards"):
        _params(tmp_path, prompt_filter={"reward": "correct"})
    with pytest.raises(grpo.GrpoError, match="prompt_filter.batch_size = 6 rows at a time must divide over the 4"):
        screened(prompt_filter={"batch_size": 6, "reward": "sometimes_right"})


def test_a_prompt_is_kept_when_some_samples_are_right_and_some_not():
    scores = np.array([[0, 0, 0], [1, 0, 0.5], [1, 1, 1], [0.5, 0.5, 0.2], [0.2, 0.2, 0.2]])
    kept, never, always = grpo.screened_groups(scores, right_at=1.0)  # near misses (partial credit) are not right
    assert (kept.tolist(), never.tolist(), always.tolist()) == (
        [False, True, False, False, False], [True, False, False, True, True], [False, False, True, False, False])
    kept, never, always = grpo.screened_groups(scores, right_at=0.5)
    assert kept.tolist() == [False, True, False, True, False] and always.tolist() == [False, False, True, False, False]
    kept, never, always = grpo.screened_groups(scores, right_at=None)  # any difference: partial credit too
    assert kept.tolist() == [False, True, False, True, False] and never.tolist() == [True, False, False, False, False]


@pytest.mark.slow
def test_grpo_trains_on_the_prompts_the_filter_kept(tiny_model_dir, tokenizer, formatted, tmp_path):
    from tunix_pipeline.models import load_model

    mesh = make_mesh(MESH)
    model, _ = load_model(tiny_model_dir, mesh, "float32")
    params = _params(tmp_path, max_steps=1, checkpoint_every=1,
                     rewards=[{"fn": "tests.test_grpo:sometimes_right"}, {"fn": "answer"}],
                     prompt_filter={"samples": 2, "reward": "sometimes_right", "right_at": None, "batch_size": 8})
    result = grpo.train_grpo(model, tokenizer, grpo.prepare(formatted, tokenizer, params, mesh), params, mesh)
    assert result["latest_step"] == 1 and result["prompts"] == result["prompt_filter"]["kept"] == 5
    assert result["history"][0]["reward/sometimes_right"] > 0  # no batch of never-right prompts


@pytest.mark.slow  # the smoke run's SFT policy
def test_a_filter_that_keeps_too_few_prompts_skips_the_stage(smoke_run, formatted, tmp_path, monkeypatch):
    """The GRPO node over the smoke run's SFT policy: the tiny model answers nothing right, so no prompt is kept; the
    stage is skipped with the screen's counts as its reason and SFT's policy passes on."""
    from kedro.config import OmegaConfigLoader

    from tunix_pipeline.config import ModelParams, RuntimeParams, TrackingParams
    from tunix_pipeline.pipelines.grpo.nodes import run_grpo

    project = smoke_run.project
    monkeypatch.chdir(project)  # the results' folders are the project's
    conf = OmegaConfigLoader(conf_source=str(project / "conf"), base_env="base", default_run_env="gpu_smoke")
    settings = conf["parameters"]
    base = json.loads((project / "data" / "02_intermediate" / "base_model.json").read_text())
    sft = json.loads((project / "data" / "06_models" / "sft_result.json").read_text())
    params = _params(tmp_path, enabled=True, prompt_filter={"samples": 2, "reward": "answer", "batch_size": 8})
    result = run_grpo(formatted, formatted, base, sft, ModelParams(**settings["model"]), params,
                      RuntimeParams(**settings["runtime"]), TrackingParams(**settings["tracking"]))
    assert result["skipped"] and not result["enabled"] and result["checkpoint_dir"] == sft["checkpoint_dir"]
    assert result["skip_reason"].startswith("grpo.prompt_filter: 0 of 12 prompts are right ('answer' at 1 or more) in "
                                            "some but not all of their 2 samples (12 never right, 0 always right)")
    assert not (tmp_path / "grpo" / "actor").exists()  # nothing trained
