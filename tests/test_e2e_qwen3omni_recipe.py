"""MindSpeed-MM's Qwen3-Omni FSDP2 config (`tests/mindspeed_mm/qwen3omni/qwen3omni_config_v1.yaml`, byte for byte)
planned for Qwen3-Omni-30B-A3B-Instruct: its `config.json` written from the published dimensions
(`tests/qwen3omni_30b_config.py`; no weights), `apps/train ... --check --nproc-per-node N --device-memory 64GiB` (the
app's `main` in-process: `--check` starts no process). The config as written (its module names MindSpeed-MM's own:
`visual.blocks.{*}`, `model.layers.{*}`, `audio_tower`, read in the model's names) at its cutoff of 262,144 tokens:
on 8 ranks of 64 GB it does not fit (the model states alone take 57 GiB); on 16 it does not fit either, and the plan
names the change that makes it fit: offloading the decoder layers' activations, which fits. The recipe training
on 2 processes with a tiny stand-in is `tests/test_e2e_msmm.py`'s `qwen3omni` case.
"""

import importlib.util
import re

import pytest
import torch

import apprun
import msmm_configs
from mmfsdp.train.cli import main

ROOT = apprun.ROOT
_spec = importlib.util.spec_from_file_location("qwen3omni_30b_config", ROOT / "tests" / "qwen3omni_30b_config.py")
qwen3omni_30b_config = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(qwen3omni_30b_config)
OFFLOAD = 'features.activation_offload_plan.apply_modules=["model.language_model.layers.{*}"]'


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qwen3omni_30b")
    model_dir = qwen3omni_30b_config.write_qwen3omni_30b_config(tmp / "Qwen3-Omni-30B-A3B-Instruct")
    paths = {"qwen3omni-tiny": model_dir, "data": tmp / "data", "cache": tmp / "cache"}
    config = msmm_configs.write_config("qwen3omni", paths, tmp / "configs")
    dataset = tmp / "data" / "train.jsonl"
    dataset.parent.mkdir(parents=True)
    dataset.write_text("")
    return config, model_dir, tmp


def _check(setup, ranks: int, *extra: str, capsys) -> tuple[int, str]:
    config, model_dir, tmp = setup
    overrides = [
        # no weights: --check builds on meta, and the run it checks would random-init; no accelerator: sdpa
        "model.random_init=true", "training.load=null", "training.init_model_with_meta_device=false",
        f"data.dataset_param.preprocess_parameters.model_name_or_path={ROOT / 'examples' / 'qwen3omni-tiny' / 'assets'}",
        *msmm_configs.CPU_OVERRIDES, *extra,
    ]
    code = main([str(config), *overrides, "--check", "--nproc-per-node", str(ranks), "--device-memory", "64GiB"])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _total(out: str) -> float:
    return float(re.search(r"^  total +([\d.]+) GiB", out, re.M).group(1))


def test_the_plan_counts_the_thinker(setup, capsys):
    from transformers import AutoConfig, Qwen3OmniMoeThinkerForConditionalGeneration

    config = AutoConfig.from_pretrained(setup[1]).thinker_config
    with torch.device("meta"):
        thinker = Qwen3OmniMoeThinkerForConditionalGeneration._from_config(config)
    total = sum(p.numel() for p in thinker.parameters())
    frozen = sum(p.numel() for name, p in thinker.named_parameters() if name.startswith(("model.visual.", "model.audio_tower.")))
    code, out = _check(setup, 16, capsys=capsys)
    assert code == 0, out[-3000:]
    header = re.search(r"\(16 processes, FSDP shard group 16; ([\d.]+) B parameters, ([\d.]+) B trainable", out)
    assert header and (float(header.group(1)), float(header.group(2))) == (round(total / 1e9, 2), round((total - frozen) / 1e9, 2))



def test_mindspeed_module_names_are_read_as_the_models(setup):
    from mmfsdp.train.config import load_config

    cfg = load_config(setup[0], ["model.attn_implementation=sdpa"])
    assert cfg.parallel.fsdp_plan.apply_modules == [
        "model.visual", "model.visual.blocks.{*}", "model.language_model", "model.language_model.embed_tokens",
        "model.language_model.layers.{*}", "lm_head",
    ]
    assert cfg.parallel.recompute_plan.apply_modules == ["model.language_model.layers.{*}"]
    assert cfg.model.freeze == [
        "model.visual.patch_embed", "model.visual.blocks", "model.visual.merger_list", "model.visual.pos_embed",
        "model.visual.merger", "model.audio_tower",
    ]


@pytest.mark.parametrize("ranks", [8, 16])
def test_as_written_it_does_not_fit_64gb_at_its_cutoff(setup, ranks, capsys):
    code, out = _check(setup, ranks, capsys=capsys)
    assert code == 0, out[-3000:]
    assert re.search(rf"^  does not fit: {_total(out)} GiB > 64.0 GiB device memory$", out, re.M), out[-2000:]
    if ranks == 16:
        assert "would fit with: features.activation_offload_plan.apply_modules: [model.language_model.layers.{*}]" in out


def test_16_ranks_fit_with_the_decoder_activations_offloaded(setup, capsys):
    code, out = _check(setup, 16, OFFLOAD, capsys=capsys)
    assert code == 0, out[-3000:]
    fits = re.search(r"^  fits: ([\d.]+) GiB of 64.0 GiB device memory$", out, re.M)
    assert fits and float(fits.group(1)) == _total(out) <= 64.0, out[-2000:]


def test_a_trained_audio_tower_adds_its_activations_by_hand(setup):
    """The recipe freezes both towers; trained, each adds its saved activations on the micro-batch's media tokens,
    and a token is an image token or an audio token, so the plan adds the larger of the two: the audio tower's
    here by the hand count of `Qwen3OmniCosts.audio_values_per_token` (one encoder position per decoder audio token;
    recompute on: each of the 32 layers keeps its input, one layer is recomputed; the three convolutions over the
    100 / 13 mel frames behind a token; the projections' inputs), in bf16 over the 262,144 tokens."""
    from mmfsdp.train.config import load_config
    from mmfsdp.train.memory import memory_plan

    config, _, _ = setup
    base = ["model.random_init=true", "training.load=null", "training.init_model_with_meta_device=false",
            *msmm_configs.CPU_OVERRIDES]
    freeze = {  # model.freeze for: both towers frozen (as written), audio only trained, both trained
        "frozen": "[model.visual, model.audio_tower]", "audio": "[model.visual]", "both": "[]",
    }
    plans = {name: memory_plan(load_config(config, [*base, f"model.freeze={value}"]), 16, 64 * 2**30)
             for name, value in freeze.items()}
    cfg = load_config(config, base)
    assert cfg.parallel.recompute and cfg.data.dataset_param.preprocess_parameters.cutoff_len == 262_144
    width, layers, ffn, mels, channels = 1280, 32, 5120, 128, 480
    convs = 2 * channels * mels * (100 / 13) * (1 / 4 + 1 / 16 + 1 / 64)
    outside = channels * 16 + 2 * width + 2 * 2048
    per_token = convs + outside + layers * width + 8 * width + 3 * ffn
    audio = int(262_144 * per_token * 2)
    assert plans["audio"].activations - plans["frozen"].activations == pytest.approx(audio, abs=2)
    assert plans["both"].activations >= plans["audio"].activations
    vision_only = memory_plan(load_config(config, [*base, "model.freeze=[model.audio_tower]"]), 16, 64 * 2**30)
    added = max(vision_only.activations, plans["audio"].activations) - plans["frozen"].activations
    assert plans["both"].activations - plans["frozen"].activations == added
