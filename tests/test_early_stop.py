"""Continuous batching (`upstream.Sampler.generate_rows`, under `generation.Generator`): each row stops at its own end
(stop tokens, a stop string such as `</answer>`, a block repeated back to back, its length limit) and its slot takes
the next prompt; greedy rows get the tokens the sampler's fixed batches give them."""

import re

import jax
import numpy as np
import pytest

from tunix_pipeline.config import EvaluateParams, RuntimeParams
from tunix_pipeline.generate import generation
from tunix_pipeline.upstream.generation import stop_string_table
from tunix_pipeline.upstream.rows import ends_repeating, repeating

MESH = RuntimeParams(mesh={"fsdp": 4, "tp": 2})
P, N = 64, 12  # prompt length, new tokens


@pytest.fixture(scope="module")
def lively(tiny_model_dir):
    """The tiny model with its weights scaled up, sharded over the fake mesh: its greedy rows differ from each other
    and from step to step (as built, it repeats one word)."""
    from flax import nnx

    from tunix_pipeline.models import load_model
    from tunix_pipeline.core.runtime import make_mesh

    mesh = make_mesh(MESH)
    model, _ = load_model(tiny_model_dir, mesh, "float32")
    nnx.update(model, jax.tree.map(lambda x: x * 20, nnx.state(model, nnx.Param)))
    return model, mesh


def _prompts(n: int) -> list[str]:
    return [f"<bos><start_of_turn>user\nAda has {i} pears and {3 * i + 1} figs{'.' * (i % 5)}<end_of_turn>\n"
            "<start_of_turn>model\n" for i in range(n)]


def _fixed_batches(model, tokenizer, prompts, batch: int, eos: list[int]) -> list[list[int]]:
    """The sampler's own loop (`__call__`): fixed batches, each decoding until its last row ends."""
    sampler = generation.make_sampler(model, tokenizer, P + N)
    out = []
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        tokens = sampler(chunk + [chunk[-1]] * (batch - len(chunk)), max_generation_steps=N, max_prompt_length=P,
                         eos_tokens=eos).tokens
        out += [t.tolist() for t in tokens[: len(chunk)]]
    return out


def _run_to_the_limit(model, tokenizer, prompts) -> list[list[int]]:
    never = [tokenizer.pad_token_id]  # a word greedy decoding never picks here
    rows = _fixed_batches(model, tokenizer, prompts, 8, never)
    assert all(len(r) == N for r in rows)
    return rows


@pytest.mark.slow
def test_rows_end_on_their_own_with_the_greedy_tokens_of_fixed_batches(lively, tokenizer):
    model, mesh = lively
    prompts = _prompts(14)
    with mesh:
        full = _run_to_the_limit(model, tokenizer, prompts)
        stops = sorted({full[0][3], full[1][6], full[2][9]})  # words the rows say at different steps
        expected = _fixed_batches(model, tokenizer, prompts, 4, stops)
        assert len({len(r) for r in expected}) >= 3 and N in {len(r) for r in expected}  # stops vary, some run out
        sampler = generation.make_sampler(model, tokenizer, P + 2 * N)
        moves, halvings = [], []
        shift, compact = sampler._shift_rows, sampler._compact_rows
        sampler._shift_rows = lambda rows, by: moves.append(int(by)) or shift(rows, by)

        def compacting(rows, keep):  # the old cache freed as the smaller one is made: never held at both sizes
            smaller = compact(rows, keep)
            halvings.append((len(keep), all(x.is_deleted() for x in jax.tree.leaves(rows.state.cache))))
            return smaller

        sampler._compact_rows = compacting
        # one slot at a time; three (the last lot padded); 8 slots, 2 at a time, halving to 4 at the end
        for batch, refill in ((4, 1), (4, 3), (8, 2)):
            rows = sampler.generate_rows(prompts, batch_size=batch, max_prompt_length=P, max_generation_steps=N,
                                         eos_tokens=stops, refill=refill)
            assert [r.tolist() for r in rows] == expected
    # the cache moved back to make room, the batch shrank (its old cache freed): the same greedy tokens
    assert moves and halvings == [(4, True)]


def test_a_stop_string_ends_its_row_with_the_token_that_completes_it(lively, tokenizer):
    """A stop string spelled across tokens ends the row at the token that completes it (kept), a stop token before
    it (not kept); the Generator's text ends with the string; rows that say neither run to the limit."""
    model, mesh = lively
    prompts = _prompts(6)
    ends = generation.end_tokens(tokenizer, new_turn=True)
    with mesh:
        full = _run_to_the_limit(model, tokenizer, prompts)
        stop = tokenizer.decode(full[0][4:7])[1:]  # three words' text, less its first character
        expected, by_string = [], []
        for row in full:
            at_string = next((k for k in range(1, N + 1) if stop in tokenizer.decode(row[:k])), N)
            at_end = next((i for i, token in enumerate(row) if token in ends), N)
            expected.append(row[: min(at_string, at_end)])
            by_string.append(at_string < N and at_string <= at_end)
        assert by_string[0] and any(len(r) == N for r in expected)
        sampler = generation.make_sampler(model, tokenizer, P + 2 * N)
        rows = sampler.generate_rows(prompts, batch_size=4, max_prompt_length=P, max_generation_steps=N,
                                     eos_tokens=ends, stop_strings=(stop,), refill=2)
        assert [r.tolist() for r in rows] == expected

        params = EvaluateParams(max_new_tokens=N, batch_size=4, stop_repeats=None)
        texts, lengths = generation.Generator(model, tokenizer, params, P, stop_strings=(stop,))(prompts)
    assert lengths == [len(r) for r in expected]
    assert texts == [generation.through_stop(tokenizer.decode(r), (stop,)) for r in expected]
    assert all(text.endswith(stop) for text, cut in zip(texts, by_string) if cut)


def test_the_stop_string_matcher_reads_text_whatever_the_tokenization():
    """`stop_string_table` over tokens gives the first token after which the text holds the stop string, for random
    sequences of the pieces Gemma's tokenizer spells `</answer>` with (and some that only look like them)."""
    stop = "</answer>"
    pieces = ["</", "answer", ">", " </", ">.", ">\n", "</answer>", "x</ans", "wer>", "a", "", "<", "/", "</a",
              "nswer>", "ans", "<answer>", "</answer", "r>", "answer>"]
    table = stop_string_table(pieces, stop)
    rng = np.random.default_rng(0)
    for _ in range(3000):
        seq = rng.integers(0, len(pieces), size=8)
        state, found = 0, None
        for i, token in enumerate(seq):
            state = table[token, state]
            if state == len(stop):
                found = i
                break
        text = [pieces[t] for t in seq]
        first = next((i for i in range(len(seq)) if stop in "".join(text[: i + 1])), None)
        assert found == first, text


def test_generation_stops_at_the_start_of_a_new_turn_and_grpo_at_its_end(tokenizer):
    turn_ends = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_turn>")]
    assert generation.end_tokens(tokenizer) == turn_ends
    new_turn = tokenizer.convert_tokens_to_ids("<start_of_turn>")
    assert generation.end_tokens(tokenizer, new_turn=True) == turn_ends + [new_turn]


@pytest.mark.slow
def test_sampled_rows_are_drawn_per_seed_with_one_prefill_per_group(lively, tokenizer):
    model, mesh = lively
    prompts = _prompts(3)
    params = EvaluateParams(max_new_tokens=N, batch_size=8, num_samples=4, temperature=1.0, seed=3)
    generator = generation.Generator(model, tokenizer, params, P)
    prefills = generator.sampler._prefills
    calls = []
    grouped = prefills[4]
    prefills[4] = lambda *args, **kwargs: calls.append(1) or grouped(*args, **kwargs)
    with mesh:
        texts, lengths = generator(prompts)
        again, _ = generator(prompts)
        other, _ = generation.Generator(model, tokenizer, params.model_copy(update={"seed": 4}), P)(prompts)
    assert len(texts) == len(lengths) == 12 and all(0 <= n <= N for n in lengths)
    assert all(len(set(texts[i : i + 4])) > 1 for i in range(0, 12, 4))  # a group's samples differ
    assert again == texts and other != texts  # the seed decides
    assert len(calls) == 2 * 3  # a prefill per prompt's group of 4 (refills of 4 slots), each call


def test_prompts_must_fit_and_the_cache_hold_two_generations(lively, tokenizer):
    model, mesh = lively
    sampler = generation.make_sampler(model, tokenizer, P + N)
    args = dict(batch_size=4, max_prompt_length=P, max_generation_steps=N, eos_tokens=[1])
    with pytest.raises(ValueError, match="max_prompt_length \\+ 2 x max_generation_steps"):
        sampler.generate_rows(_prompts(2), **args)
    with pytest.raises(ValueError, match="longer than max_prompt_length"):
        generation.make_sampler(model, tokenizer, P + 2 * N).generate_rows(["word " * 200], **args)
    assert sampler.generate_rows([], **args) == []


def test_sampler_states_compare_by_structure_inside_a_trace(lively, tokenizer):
    """Jit caches key on the sampler state's structure, and a key may be compared while another function is traced
    (an entry dropped then): the state's static prompt length is a plain int there, not an array whose comparison
    would be traced (Tunix's own state fails this)."""
    import jax.numpy as jnp

    sampler = generation.make_sampler(lively[0], tokenizer, P + N)

    def structure():
        return jax.tree.structure(sampler.init_sample_state(
            jnp.ones((2, P), jnp.int32), total_sampling_steps=P + N, include_logits=False, forbidden_token_ids=None,
            temperature=0.0, top_p=None, top_k=None, seed=jax.random.PRNGKey(0), beam_size=None))

    first, second = structure(), structure()
    assert int(jax.jit(lambda x: x + (first == second))(0)) == 1


def test_the_repeat_rule_on_the_device_is_the_rule_on_the_finished_row():
    """`rows.repeating` (in the decode loop, on the whole buffer) fires at the first step whose kept tokens
    `ends_repeating` says end with a block of 3 to 5 tokens twice back to back, never counting the prompt's tokens."""
    rng = np.random.default_rng(0)
    buffer = rng.integers(0, 3, size=(64, 40))  # three words: repeats happen
    buffer[:, 8:14] = np.tile([7, 8], 3)  # a loop in the prompt (before `first`) is none of the row's own
    first = np.full(64, 12)
    fired = np.stack([np.asarray(repeating(buffer, step, first, 3)) for step in range(40)], axis=1)
    for row in range(64):
        for step in range(12, 40):
            assert fired[row, step] == ends_repeating(buffer[row, 12 : step + 1], 3), (row, step)
        assert not fired[row, :12].any()
    assert 0 < fired[:, 12:].any(axis=1).sum() < 64


@pytest.mark.slow
def test_a_row_that_repeats_a_block_ends_there_and_the_others_run_on(lively, tiny_model_dir, tokenizer):
    """`evaluate.stop_repeats`: as built, the tiny model says one word over and over: its rows end (kept) once a
    block of 4 tokens has come twice, and `Generator.repeated` says so; the lively model's rows, which repeat no block
    within the limit, are the same with the rule as without it."""
    from tunix_pipeline.models import load_model

    model, mesh = lively
    prompts = _prompts(6)
    never = [tokenizer.pad_token_id]
    as_built, _ = load_model(tiny_model_dir, mesh, "float32")
    params = EvaluateParams(max_new_tokens=N, batch_size=4, stop_repeats=4)
    with mesh:
        for network, loops in ((as_built, True), (model, False)):
            full = _run_to_the_limit(network, tokenizer, prompts)
            cut = [next((k for k in range(1, N + 1) if ends_repeating(row[:k], 4)), N) for row in full]
            assert all(k < N for k in cut) if loops else all(k == N for k in cut)
            sampler = generation.make_sampler(network, tokenizer, P + 2 * N)
            rows = sampler.generate_rows(prompts, batch_size=4, max_prompt_length=P, max_generation_steps=N,
                                         eos_tokens=never, refill=2, repeats=4)
            assert [r.tolist() for r in rows] == [row[:k] for row, k in zip(full, cut)]
            generator = generation.Generator(network, tokenizer, params, P)
            _, lengths = generator(prompts)
            assert generator.repeated == [loops] * len(prompts)
            assert all(n <= k for n, k in zip(lengths, cut))  # a stop token may come first


def test_a_decode_step_updates_the_kv_cache_in_place(lively, tokenizer):
    """XLA:CPU's default fusion updates each layer's cache twice a step (for the attention, for the loop's state) and
    copies the whole cache to do it; the sampler compiles with the train step's dot fusion, which does not."""
    model, mesh = lively
    sampler = generation.make_sampler(model, tokenizer, P + 2 * N)
    decode, taken = sampler._decode_rows, {}

    def take(*args, **kwargs):  # the loop's arguments as generation passes them, then stop
        taken.update(args=args, kwargs=kwargs)
        raise StopIteration

    sampler._decode_rows = take
    with mesh, pytest.raises(StopIteration):
        sampler.generate_rows(_prompts(8), batch_size=8, max_prompt_length=P, max_generation_steps=N, eos_tokens=[1])
    hlo = decode.lower(*taken["args"], **taken["kwargs"]).compile().as_text()
    body = re.search(r"body=%([\w.\-]+)", hlo).group(1)
    start = hlo.index(f"%{body} ")
    cache = next(x for x in jax.tree.leaves(taken["args"][1].state.cache) if x.ndim == 4)
    shape = r"\[" + r",\s*".join(map(str, cache.sharding.shard_shape(cache.shape))) + r"\]"
    copies = re.findall(rf"= f32{shape}\S* copy\(", hlo[start : hlo.index("\n}", start)])
    assert not copies, f"{len(copies)} copies of a layer's KV cache each decode step"
