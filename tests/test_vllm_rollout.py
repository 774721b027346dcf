"""The vLLM rollout engine (`mmfsdp.model.vllm_rollout`) against the hf engine on the tiny Qwen3-VL (fp32, CPU).

A server is launched with the vLLM environment's Python on an export of other random weights (seed 1); the
policy's weights reach it through `sync_weights` (shared memory, the model's `load_weights`). Greedy completions of a
prompt with an image and a text-only prompt equal the hf engine's token ids after 0, 1 and 5 optimizer steps (the
steps change the completions, so the sync is what makes them equal), and after LoRA adapters (random B) are put
on the policy: the sync sends the merged weights; the engines' per-token log-probs are compared (printed: the
numbers docs/rl.md reports). A stale version is refused, and a server killed mid-run is a
`VLLMServerError` within 60 s, its process gone.

Marked `vllm` and `slow`: it needs the vLLM environment (`uv run python tools/vllm_env/setup.py`).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import hf_exports
from apprun import QWEN
from test_vllm_env import _vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

MAX_NEW_TOKENS = 12


def _setup():
    from transformers import AutoProcessor

    from mmfsdp.ckpt import get_state_dict_adapter
    from mmfsdp.model import get_model_entry
    from mmfsdp.model.families.qwen3_vl.testing import rollout_probe_prompts
    from mmfsdp.train.config import load_config

    assets = QWEN.parent / "assets"
    cfg = load_config(QWEN, [f"model.model_name_or_path={assets}",
                             f"data.dataset_param.preprocess_parameters.model_name_or_path={assets}"])
    torch.manual_seed(0)
    model = get_model_entry(cfg.model.model_id).build(cfg.model).float()
    processor = AutoProcessor.from_pretrained(assets)
    with_image, text_only, png = rollout_probe_prompts(processor)
    return model, processor, assets, with_image, text_only, png, get_state_dict_adapter("qwen3_vl")


def _train_step(model, optimizer, inputs) -> None:
    """One AdamW step of next-token loss on the text prompt followed by a fixed answer (moves the greedy tokens)."""
    ids = torch.cat([inputs["input_ids"], torch.tensor([[100, 101, 102, 103, 104, 105, 106, 107]])], dim=1)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, :-1].float()
    loss = torch.nn.functional.cross_entropy(logits[-8:], ids[0, -8:])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_vllm_engine_greedy_equals_hf_engine_after_0_1_5_steps(tmp_path):
    from mmfsdp.model.rollout import HFRolloutEngine, RolloutRequest, SamplingParams
    from mmfsdp.model.vllm_rollout import VLLMRolloutEngine, VLLMServerError, launch_vllm_server

    model, processor, assets, with_image, text_only, png, adapter = _setup()
    stop = (processor.tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    media_ids = frozenset(processor.tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>"))
    requests = [
        RolloutRequest(prompt_index=0, prompt_ids=with_image["input_ids"][0].tolist(), images=(png,),
                       media={"pixel_values": with_image["pixel_values"], "image_grid_thw": with_image["image_grid_thw"]}),
        RolloutRequest(prompt_index=1, prompt_ids=text_only["input_ids"][0].tolist()),
    ]
    sampling = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0, stop_token_ids=stop)
    export = hf_exports.export_example(QWEN, tmp_path / "export", seed=1)  # other weights: the sync must replace them
    process, address, authkey = launch_vllm_server(
        _vllm_python(), str(export.path), architecture=adapter.architectures[0], max_model_len=512,
        log_path=tmp_path / "server.log")
    # 256 KiB chunks: every sync streams many (and one tensor larger than a chunk), so the server loads views of
    # chunk files it may still hold when it acknowledges them, which must then not be overwritten
    engine = VLLMRolloutEngine(address, authkey, adapter=adapter, media_token_ids=media_ids, process=process,
                               chunk_bytes=256 << 10)
    hf = HFRolloutEngine(model, pad_token_id=processor.tokenizer.pad_token_id or 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    try:
        with pytest.raises(VLLMServerError, match="stale"):  # random weights, then a version the server lacks
            engine._weights_version = 7
            engine.generate(requests, sampling, step=0)
        seen, steps_done = [], 0
        for steps in (0, 1, 5):
            for _ in range(steps - steps_done):
                _train_step(model, optimizer, text_only)
            steps_done = steps
            engine.sync_weights(model, version=steps)
            hf.sync_weights(model, version=steps)
            ours, theirs = engine.generate(requests, sampling, step=steps), hf.generate(requests, sampling, step=steps)
            assert [r.completion_ids for r in ours] == [r.completion_ids for r in theirs], (steps, ours, theirs)
            assert {r.weights_version for r in ours} == {steps}
            diffs = torch.cat([(torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs()
                               for a, b in zip(ours, theirs)])
            sync = engine.last_sync
            print(f"steps {steps}: sync {sync['seconds']:.3f} s, {sync['bytes'] / 1e6:.1f} MB, "
                  f"{sync['gbps']:.3f} GB/s; logprob diff mean {diffs.mean():.2e} max {diffs.max():.2e}; "
                  f"completions {[r.completion_ids for r in ours]}")
            assert diffs.max() < 1e-3
            assert 0 < sync["reload_s"] <= sync["seconds"]  # the server's share, reported with its answer
            seen.append([r.completion_ids for r in ours])
        assert seen[0] != seen[-1]  # the training moved the greedy tokens: the sync carried them
        pool = engine._chunks
        print(f"chunks: {pool.sent} sent through {pool.files} files, {pool.held} still held when acknowledged")
        assert pool.sent >= 3 * 8 and pool.files < pool.sent / 2  # streamed, and the files reused

        # LoRA: the server gets the merged weights (W + (alpha / r) B A); random B, so the adapters matter
        from mmfsdp.model.lora import LoraConfig, apply_lora, init_lora_adapters

        lora = LoraConfig(enable=True, rank=4, alpha=32.0, target_modules=["q_proj", "v_proj", "o_proj"],
                          init_lora_weights=False)
        apply_lora(model, lora)
        init_lora_adapters(model, lora, seed=3)
        engine.sync_weights(model, version=6)
        hf.sync_weights(model, version=6)
        ours, theirs = engine.generate(requests, sampling, step=6), hf.generate(requests, sampling, step=6)
        assert [r.completion_ids for r in ours] == [r.completion_ids for r in theirs], ("lora", ours, theirs)
        assert [r.completion_ids for r in ours] != seen[-1], "the adapters should change the greedy tokens"
        full = engine.last_sync
        assert full["skipped"] == 0  # the base weights froze after the last sync: sent once more, now held
        # LoRA steps: only the adapted layers' groups change (the decoder's self_attn blocks); the rest is frozen,
        # held by the server and not sent. The adapted q/v travel with their k (vLLM fuses them into qkv_proj and
        # reloads that layer whole): a k left out would be garbage in vLLM, and its tokens would differ from hf's.
        lora_optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
        for _ in range(3):
            _train_step(model, lora_optimizer, text_only)
        engine.sync_weights(model, version=7)
        hf.sync_weights(model, version=7)
        ours, theirs = engine.generate(requests, sampling, step=7), hf.generate(requests, sampling, step=7)
        assert [r.completion_ids for r in ours] == [r.completion_ids for r in theirs], ("lora steps", ours, theirs)
        lora_seen = [r.completion_ids for r in ours]
        sync = engine.last_sync
        print(f"LoRA (merged): full sync {full['bytes'] / 1e6:.2f} MB ({full['tensors']:.0f} tensors) in "
              f"{full['seconds']:.3f} s; after 3 steps {sync['bytes'] / 1e6:.2f} MB ({sync['tensors']:.0f} sent, "
              f"{sync['skipped']:.0f} held) in {sync['seconds']:.3f} s; tokens {lora_seen}")
        assert sync["skipped"] > 0 and sync["bytes"] < full["bytes"] / 2
        diffs = torch.cat([(torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs() for a, b in zip(ours, theirs)])
        assert diffs.max() < 1e-3

        os.kill(process.pid, signal.SIGKILL)  # the server dies mid-run: a clear error, quickly
        started = time.monotonic()
        with pytest.raises(VLLMServerError, match="vLLM server"):
            engine.generate(requests, sampling, step=8)
        assert time.monotonic() - started < 60
    finally:
        engine.close()
    assert process.poll() is not None
