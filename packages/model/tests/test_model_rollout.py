"""The rollout engine (`mmfsdp.model.rollout`): its sampling against transformers' warpers and the distribution it
draws from; its log-probs against a training-style forward of prompt + completion (tiny qwen3_vl with image and
text-only prompts, tiny mistral3), at temperature 1 and 0.7 (TRL: the trainer divides the logits by the
temperature) and with top-k / top-p; completions keyed by (seed, step, prompt, generation) whatever the batch;
greedy = argmax; and 2 gloo ranks under FSDP2, one with text-only prompts and one with image prompts, against one
process."""

import dataclasses
import os
import pickle

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
)

from mmfsdp.model import get_model_entry
from mmfsdp.model.registry import installed_model_ids
from mmfsdp.model.rollout import (
    HFRolloutEngine, Rollout, RolloutEngine, RolloutRequest, SamplingParams, gumbel_from_hash, gumbel_noise, row_keys,
    sample_tokens, warp_logits,
)
from mmfsdp.model.testing import assert_close
from mmfsdp.parallel.testing import run_distributed

TOL = 1e-5
FAMILIES = ("qwen3_vl", "mistral3")
"""The families of the greedy and the FSDP2 tests; the log-prob parity runs over every registered family."""
STOP = tuple(range(20, 60))
"""Stop tokens: 40 of the tiny vocabulary's 256, so that completions stop after different numbers of tokens."""


# -- sampling ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.6, 7, 0.9)]
)
def test_warp_logits_matches_transformers_warpers(temperature, top_k, top_p):
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * 3
    hf = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        hf.append(TopKLogitsWarper(top_k))
    if top_p < 1:
        hf.append(TopPLogitsWarper(top_p))
    sampling = SamplingParams(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
    assert torch.equal(warp_logits(logits, sampling), hf(None, logits.clone()))


def test_draws_follow_the_warped_distribution():
    """40000 rows (one per generation index) draw from the same logits: each token's frequency is its probability
    under temperature + top-k + top-p (4 standard deviations), and no filtered token is drawn."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -3.0]])
    sampling = SamplingParams(max_new_tokens=1, temperature=0.7, top_k=5, top_p=0.95, seed=11)
    expected = warp_logits(logits, sampling).softmax(-1)[0]
    rows = 40_000
    keys = row_keys(sampling.seed, 3, torch.zeros(rows, dtype=torch.long), torch.arange(rows))
    tokens, logprobs = sample_tokens(logits.expand(rows, -1), sampling, keys, position=2)
    frequency = torch.bincount(tokens, minlength=6).double() / rows
    bound = 4 * (expected.double() * (1 - expected.double()) / rows).sqrt() + 1e-12
    assert ((frequency - expected.double()).abs() <= bound).all(), (frequency, expected)
    assert expected[-1] == 0 and frequency[-1] == 0
    assert (logprobs - expected.log()[tokens]).abs().max() < 1e-6


def test_noise_is_a_function_of_its_keys():
    keys = row_keys(5, 7, torch.tensor([0, 1, 0, 2]), torch.tensor([0, 0, 1, 0]))
    assert len(set(keys.tolist())) == 4 and (keys >= 0).all() and (keys < 2**32).all()
    assert torch.equal(keys, row_keys(5, 7, torch.tensor([0, 1, 0, 2]), torch.tensor([0, 0, 1, 0])))
    assert not torch.equal(keys, row_keys(5, 8, torch.tensor([0, 1, 0, 2]), torch.tensor([0, 0, 1, 0])))
    assert not torch.equal(keys, row_keys(6, 7, torch.tensor([0, 1, 0, 2]), torch.tensor([0, 0, 1, 0])))
    noise = gumbel_noise(keys, 3, 1000)
    assert torch.equal(noise, gumbel_noise(keys, 3, 1000)) and torch.equal(noise[1:3], gumbel_noise(keys[1:3], 3, 1000))
    assert torch.isfinite(noise).all() and not torch.equal(noise, gumbel_noise(keys, 4, 1000))
    # standard Gumbel: mean = Euler-Mascheroni constant, variance = π² / 6
    assert abs(noise.mean().item() - 0.5772) < 0.05 and abs(noise.var().item() - 1.6449) < 0.15


def test_noise_is_finite_at_every_hash_and_a_suppressed_token_is_never_drawn():
    """The extreme hashes give finite noise (the largest used to give u = 1, G = +∞: the draw took that token
    whatever its logit, and a suppressed token's −∞ + ∞ = NaN won the argmax); a suppressed token under the largest
    noise is not sampled."""
    hashes = torch.tensor([0, 1, 2**9 - 1, 2**31, 2**32 - 2**9, 2**32 - 1], dtype=torch.int64)
    noise = gumbel_from_hash(hashes)
    assert torch.isfinite(noise).all() and noise[0] == noise[2] and noise[-2] == noise[-1] < 17.0
    scores = torch.tensor([[0.0, 5.0, -1.0]])
    sampling = SamplingParams(max_new_tokens=1, temperature=1.0, suppress_token_ids=(1,))
    warped = warp_logits(scores, sampling)
    assert (warped + gumbel_from_hash(torch.tensor([[0, 2**32 - 1, 0]]))).argmax(-1).item() == 0


def test_requests_and_results_are_plain_data():
    pixels = torch.ones(2, 3)
    request = RolloutRequest(prompt_index=3, prompt_ids=[5, 6, 7], num_generations=2, media={"pixel_values": pixels})
    again = pickle.loads(pickle.dumps(request))
    assert again.prompt_ids == request.prompt_ids and torch.equal(again.media["pixel_values"], pixels)
    rollout = Rollout(
        prompt_index=3, generation_index=1, completion_ids=[9, 2], logprobs=[-1.5, -0.25], finish_reason="stop",
        weights_version=4,
    )
    assert pickle.loads(pickle.dumps(rollout)) == rollout and dataclasses.asdict(rollout)["completion_ids"] == [9, 2]
    sampling = SamplingParams(max_new_tokens=4, stop_token_ids=[2, 3])
    assert pickle.loads(pickle.dumps(sampling)) == sampling and sampling.stop_token_ids == (2, 3)
    for bad in (dict(max_new_tokens=0), dict(max_new_tokens=1, temperature=-1), dict(max_new_tokens=1, top_p=0),
                dict(max_new_tokens=1, top_k=-1), dict(max_new_tokens=1, seed=-2)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert RolloutRequest(prompt_index=0, prompt_ids=[]).problem() is not None
    assert RolloutRequest(prompt_index=0, prompt_ids=[1], num_generations=0).problem() is not None


# -- the engine on one process -----------------------------------------------------------------------


def _model(model_id: str):
    entry = get_model_entry(model_id)
    config = entry.testkit.tiny_config()
    torch.manual_seed(0)
    return entry.model_class._from_config(config, attn_implementation="mmfsdp_sdpa")


def _pixtral(config) -> bool:
    return hasattr(config, "image_token_index")


def _request(config, index: int, length: int, images: tuple, seed: int) -> RolloutRequest:
    """A prompt of `length` tokens ending in text, with `images` ((h, w): pixels for Pixtral, patches for the
    Qwen-VL towers), as the family's test helpers lay it out."""
    if _pixtral(config):
        from mmfsdp.model.families.mistral3.testing import tiny_batch

        sample = tiny_batch(config, batch_size=1, seq_len=length, image_sizes=images, seed=seed)
        ids, media_keys = sample["input_ids"][0], ("pixel_values", "image_sizes")
    else:
        from mmfsdp.model.families.qwen3_vl.testing import qwen3_vl_sample

        sample = qwen3_vl_sample(config, length, images, seed=seed)
        ids, media_keys = sample["input_ids"], ("pixel_values", "image_grid_thw")
    media = {key: sample[key] for key in media_keys if key in sample}
    return RolloutRequest(prompt_index=index, prompt_ids=ids.tolist(), num_generations=2, media=media)


def _requests(config) -> list[RolloutRequest]:
    """Two image prompts (one and two images of different sizes) and two text-only prompts, of different lengths."""
    images = ((32, 32), (16, 48), (32, 16)) if _pixtral(config) else ((4, 4), (2, 4), (4, 2))
    return [
        _request(config, 0, 14, images[:1], seed=1),
        _request(config, 1, 9, (), seed=2),
        _request(config, 2, 21, images[1:], seed=3),
        _request(config, 3, 5, (), seed=4),
    ]


def _reference_logits(model, request: RolloutRequest, rollout: Rollout) -> torch.Tensor:
    """fp32 logits `[n, V]` predicting each completion token: one training-style forward of prompt + completion
    (no cache, no padding, positions computed on the whole sequence). Completion tokens are text (Qwen3-VL's
    `mm_token_type_ids` 0, as transformers' generation extends them): the tiny vocabulary's image token id can be
    drawn."""
    ids = torch.tensor([request.prompt_ids + rollout.completion_ids])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), **request.media}
    if hasattr(model.config, "video_token_id"):
        from mmfsdp.model.families.qwen3_vl.model import mm_token_types

        types = mm_token_types(ids, model.config.image_token_id, model.config.video_token_id)
        types[:, len(request.prompt_ids) :] = 0
        inputs["mm_token_type_ids"] = types
    with torch.no_grad():
        logits = model(**inputs).logits[0].float()
    start = len(request.prompt_ids) - 1
    return logits[start : start + len(rollout.completion_ids)]


def _gather(logprobs_NV: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    return logprobs_NV.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


@pytest.mark.parametrize("model_id", installed_model_ids())
def test_sampling_logprobs_equal_the_training_forward(model_id):
    model = _model(model_id)
    requests = _requests(model.config)
    engine = HFRolloutEngine(model)
    assert isinstance(engine, RolloutEngine)
    engine.sync_weights(model, 7)
    cases = [dict(temperature=1.0), dict(temperature=0.7), dict(temperature=0.7, top_k=20, top_p=0.9)]
    # A family that finds its media by token id alone (Qwen3-Omni's audio: no token types mark a completion's tokens
    # as text) gets a drawn placeholder read as a clip without features: its tokens are suppressed, as GRPO
    # suppresses every media token, and the trainer's log-probs are those of the distribution without them.
    suppressed = tuple(getattr(model.config, key) for key in ("audio_token_id", "audio_start_token_id", "audio_end_token_id")
                       if hasattr(model.config, key))
    for case in cases:
        sampling = SamplingParams(max_new_tokens=6, stop_token_ids=STOP, seed=1, suppress_token_ids=suppressed, **case)
        rollouts = engine.generate(requests, sampling, step=2)
        assert [(r.prompt_index, r.generation_index) for r in rollouts] == [(p, g) for p in range(4) for g in range(2)]
        assert {r.finish_reason for r in rollouts} == {"stop", "length"}
        assert {r.weights_version for r in rollouts} == {7}
        actual, trainer, processed = [], [], []
        for rollout in rollouts:
            n = len(rollout.completion_ids)
            assert len(rollout.logprobs) == n and (n == 6 or rollout.completion_ids[-1] in STOP)
            assert not set(rollout.completion_ids[:-1]) & set(STOP)
            logits = _reference_logits(model, requests[rollout.prompt_index], rollout)
            actual.append(torch.tensor(rollout.logprobs))
            scaled = (logits / sampling.temperature).index_fill(-1, torch.tensor(suppressed, dtype=torch.long), float("-inf"))
            trainer.append(_gather(scaled.log_softmax(-1), rollout.completion_ids))
            processed.append(_gather(warp_logits(logits, sampling).log_softmax(-1), rollout.completion_ids))
        actual, trainer, processed = torch.cat(actual), torch.cat(trainer), torch.cat(processed)
        assert_close(actual, processed, TOL, f"{model_id} {case}: sampling log-probs vs the training forward, warped")
        if "top_k" not in case:  # TRL's trainer log-probs: logits / T, the whole vocabulary
            assert_close(actual, trainer, TOL, f"{model_id} {case}: sampling log-probs vs logits / T")
        else:  # the truncated distribution: each kept token's log-prob rises by −log(kept mass)
            assert (actual >= trainer - 1e-6).all() and (actual > trainer + 1e-3).any()


@pytest.mark.parametrize("model_id", FAMILIES)
def test_greedy_takes_the_argmax(model_id):
    model = _model(model_id)
    requests = _requests(model.config)
    rollouts = HFRolloutEngine(model).generate(requests, SamplingParams(max_new_tokens=5, temperature=0), step=0)
    for rollout in rollouts:
        logits = _reference_logits(model, requests[rollout.prompt_index], rollout)
        assert rollout.completion_ids == logits.argmax(-1).tolist() and rollout.finish_reason == "length"
        expected = _gather(logits.log_softmax(-1), rollout.completion_ids)
        assert_close(torch.tensor(rollout.logprobs), expected, TOL, "greedy log-probs")
    by_prompt = {r.prompt_index: r.completion_ids for r in rollouts if r.generation_index == 0}
    assert all(r.completion_ids == by_prompt[r.prompt_index] for r in rollouts)


def _by_key(rollouts: list[Rollout]) -> dict[tuple[int, int], Rollout]:
    return {(r.prompt_index, r.generation_index): r for r in rollouts}


def test_completions_are_keyed_by_seed_step_prompt_and_generation():
    model = _model("qwen3_vl")
    requests = _requests(model.config)
    engine = HFRolloutEngine(model)
    sampling = SamplingParams(max_new_tokens=6, stop_token_ids=STOP, seed=5)
    full = _by_key(engine.generate(requests, sampling, step=1))
    for subset in ([requests[3], requests[0]], [requests[2]], requests[::-1], [requests[1], requests[2]]):
        for key, rollout in _by_key(engine.generate(subset, sampling, step=1)).items():
            assert rollout.completion_ids == full[key].completion_ids, key
            expected = torch.tensor(full[key].logprobs)
            assert_close(torch.tensor(rollout.logprobs), expected, TOL, f"{key} in another batch")
    # another step, seed or generation index draws other completions
    other_step = _by_key(engine.generate(requests, sampling, step=2))
    other_seed = _by_key(engine.generate(requests, dataclasses.replace(sampling, seed=6), step=1))
    for other in (other_step, other_seed):
        assert sum(other[key].completion_ids != full[key].completion_ids for key in full) >= 6
    assert all(full[(p, 0)].completion_ids != full[(p, 1)].completion_ids for p in range(4))


def test_a_rank_without_requests_returns_none_and_invalid_requests_raise():
    model = _model("mistral3")
    engine = HFRolloutEngine(model)
    assert engine.generate([], SamplingParams(max_new_tokens=3), step=0) == []
    with pytest.raises(ValueError, match="no tokens"):
        engine.generate([RolloutRequest(prompt_index=0, prompt_ids=[])], SamplingParams(max_new_tokens=3), step=0)


# -- 2 gloo ranks under FSDP2 ------------------------------------------------------------------------


FSDP_SAMPLING = SamplingParams(max_new_tokens=8, stop_token_ids=STOP, seed=9)
"""With these draws both families' text-only and image prompts stop on stop tokens after different numbers of
tokens (5 and 4 for qwen3_vl, 7 and 4 for mistral3), all before `max_new_tokens`: the ranks' all-reduced flag ends
the loop."""


def _fsdp_rollouts(rank: int, world_size: int) -> dict:
    """Per family, FSDP2 through the family's `parallelize`: round "split": rank 0 generates the text-only prompts,
    rank 1 the image prompts; round "one rank": rank 0 none, rank 1 all; then "split" again with the groups
    gathered for each forward (`gather_weights=False`), gathered once (the default), per forward. Returns the
    rollouts (as dicts), the number of model forwards and of FSDP2 all-gathers, and this rank's longest completion
    per round."""
    from mmfsdp.parallel import FSDPPlanConfig, MeshPlan, ParallelConfig, build_parallel_dims
    from mmfsdp.parallel.direct_comm import DirectAllGather

    gathers = []
    counted = DirectAllGather.__call__

    def counting(self, *args, **kwargs):
        gathers.append(1)
        return counted(self, *args, **kwargs)

    DirectAllGather.__call__ = counting  # the FSDP2 all-gather of a gloo group (`direct_cpu_comm`, the default)
    # one group per layer, as a real model's plan gives (these tiny models would otherwise be one root group, which
    # FSDP2 keeps gathered after forward anyway)
    parallel_cfg = ParallelConfig(fsdp_plan=FSDPPlanConfig(min_group_params=0))
    dims = build_parallel_dims(MeshPlan.from_config(parallel_cfg, world_size), "cpu")
    out = {}
    for model_id in FAMILIES:
        model = _model(model_id)
        requests = _requests(model.config)
        get_model_entry(model_id).parallelize(model, parallel_cfg, dims)
        forwards = []
        model.register_forward_pre_hook(lambda *_: forwards.append(1))
        split = [requests[1], requests[3]] if rank == 0 else [requests[0], requests[2]]
        rounds = [("split", True, split), ("one rank", True, [] if rank == 0 else requests),
                  ("split, per forward", False, split), ("split again", True, split),
                  ("per forward again", False, split)]
        for name, gather, subset in rounds:
            forwards.clear()
            gathers.clear()
            rollouts = HFRolloutEngine(model, gather_weights=gather).generate(subset, FSDP_SAMPLING, step=3)
            out[model_id, name] = {
                "rollouts": [dataclasses.asdict(r) for r in rollouts],
                "forwards": len(forwards),
                "gathers": len(gathers),
                "longest": max((len(r.completion_ids) for r in rollouts), default=0),
            }
    return out


@pytest.mark.slow
def test_fsdp_ranks_with_different_prompts_generate_what_one_process_does():
    per_rank = run_distributed(_fsdp_rollouts, 2, timeout=300)
    for model_id in FAMILIES:
        model = _model(model_id)
        requests = _requests(model.config)
        expected = _by_key(HFRolloutEngine(model).generate(requests, FSDP_SAMPLING, step=3))
        for name in ("split", "one rank"):
            ranks = [result[model_id, name] for result in per_rank]
            # the same number of forwards (FSDP2 all-gathers) on both ranks, though their own rows stop at other times
            # (one forward per generated token: the prefill gives the first)
            forwards = [r["forwards"] for r in ranks]
            assert forwards[0] == forwards[1] == max(r["longest"] for r in ranks), (model_id, name, forwards)
            got = _by_key([Rollout(**r) for rank in ranks for r in rank["rollouts"]])
            assert got.keys() == expected.keys()
            for key, rollout in got.items():
                assert rollout.completion_ids == expected[key].completion_ids, (model_id, name, key)
                assert rollout.finish_reason == expected[key].finish_reason
            assert_close(
                torch.tensor([lp for key in sorted(got) for lp in got[key].logprobs]),
                torch.tensor([lp for key in sorted(got) for lp in expected[key].logprobs]),
                TOL, f"{model_id} {name}: FSDP2 ranks vs one process",
            )
        split = [result[model_id, "split"]["longest"] for result in per_rank]
        assert split[0] != split[1] and max(split) < FSDP_SAMPLING.max_new_tokens, (model_id, split)
        for result in per_rank:
            names = ("split", "split, per forward", "split again", "per forward again")
            once, each, again, each_again = (result[model_id, name] for name in names)
            # the same completions; gathered once per generate, each group is all-gathered once; per forward, the
            # groups FSDP2 reshards after forward again at every decode step; the settings come back after a span
            assert once["rollouts"] == each["rollouts"] == again["rollouts"] == each_again["rollouts"], model_id
            assert once["forwards"] == each["forwards"] > 1, model_id
            assert each["gathers"] >= once["gathers"] + each["forwards"] - 1, (model_id, once, each)
            # (after a per-forward round the groups FSDP2 keeps after forward, the root and the last, are still
            # gathered: "split again" gathers the others only; every span ends with all groups resharded)
            assert again["gathers"] <= once["gathers"] and each_again["gathers"] == each["gathers"], (
                model_id, [r["gathers"] for r in (once, each, again, each_again)])


def test_the_vllm_chunk_pool_never_reuses_a_file_the_server_still_maps(tmp_path):
    """`_ChunkPool` (the vLLM engine's weight-sync files): a file the server's answer lists as still mapped is not
    handed out again until an answer no longer lists it; one still listed when the sync is over is removed; the
    files of an engine whose process is gone are removed when the next engine starts."""
    import subprocess
    import sys

    from mmfsdp.model import vllm_rollout

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"mmfsdp-vllm-{dead.pid}-abcd-1"
    mine = tmp_path / f"mmfsdp-vllm-{os.getpid()}-abcd-1"
    stale.write_bytes(b"x")
    mine.write_bytes(b"x")
    pool = vllm_rollout._ChunkPool(1 << 12, tmp_path)
    assert not stale.exists() and mine.exists()  # a live process's files are kept

    first = pool.take(0)
    pool.lend(first)
    pool.settle([str(first.path)], done=False)  # the server still holds views of it
    second = pool.take(100)
    assert second.path != first.path and pool.files == 2
    pool.lend(second)
    pool.settle([], done=False)  # both released
    assert {c.path for c in pool.free} == {first.path, second.path}
    third = pool.take(1 << 13)  # larger than a chunk: a file of its own, dropped once used
    assert third.size == 1 << 13 and pool.files == 3
    pool.lend(third)
    pool.settle([str(third.path)], done=True)  # still mapped after the sync: never reused, removed
    assert not third.path.exists() and third not in pool.free
    assert pool.held == 2 and pool.sent == 3
    pool.close()
    assert not first.path.exists() and not second.path.exists()
