"""The memory plans of Qwen3.5-27B and Qwen3.5-35B-A3B under MindSpeed-MM's own Qwen3.5 configs, on 8 and 16
devices of 64 GB.

`config.json` is written from the published dimensions (`tests/qwen3_5_configs.py`; meta device, no weights), the
recipes are MindSpeed-MM's `qwen3_5_27B_config.yaml` / `qwen3_5_35B_config.yaml` as `tests/msmm_configs.py` keeps
them (full fine-tune, vision tower trained, fp32 master weights, bf16 compute, recompute and activation offload of
the decoder layers, chunk loss; 2 x 16384 and 4 x 16384 tokens per micro-batch). Every figure is derived here from
the architecture, layer by layer — the 48 (27B) / 30 (35B-A3B) Gated DeltaNet layers' parameters (qkv, z, b, a
projections, the depthwise convolution, `dt_bias`, `A_log`, the gated norm, `out_proj`) and their saved values
per token (docs/memory.md) — and checked against the planner; `apps/train ... --check` prints the plan (its
`main` in-process, as `--check` starts no process).
"""

import re

import pytest

import msmm_configs
import qwen3_5_configs
from mmfsdp.train.cli import main
from mmfsdp.train.config import load_config
from mmfsdp.train.memory import memory_plan

GiB = 2**30
DEVICE = 64 * GiB
CHUNK = 64  # the delta rule's chunk (`DELTA_RULE_CHUNK`)
VOCAB = 248320
# vision (both): 27 blocks of 1152 (LayerNorms with bias, fused qkv with bias, MLP 4304), a 3x2x16x16 patch
# convolution with bias, 2304 learned positions, a 2x2 merger (LayerNorm of 1152, 4608 -> 4608 -> out)
VH, VMLP, DEPTH, MERGED = 1152, 4304, 27, 4 * 1152
BLOCK = 4 * VH + VH * 3 * VH + 3 * VH + VH * VH + VH + VH * VMLP + VMLP + VMLP * VH + VH


def vision(out: int) -> int:
    merger = 2 * VH + MERGED * MERGED + MERGED + MERGED * out + out
    return VH * 3 * 2 * 16 * 16 + VH + 2304 * VH + DEPTH * BLOCK + merger


def gated_deltanet(h: int, key_heads: int, value_heads: int, head_dim: int = 128, kernel: int = 4) -> int:
    """in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, the depthwise conv over q, k, v, dt_bias, A_log, the gated
    norm (one head's width) and out_proj."""
    key, value = key_heads * head_dim, value_heads * head_dim
    projections = h * (2 * key + value) + h * value + 2 * h * value_heads + value * h
    return projections + (2 * key + value) * kernel + 2 * value_heads + head_dim


def gated_attention(h: int, heads: int, kv_heads: int, head_dim: int = 256) -> int:
    """q_proj with its output gate (2 x heads), k_proj, v_proj, o_proj, q_norm and k_norm."""
    return h * 2 * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h + 2 * head_dim


def family_factor(h, mlp, key_heads, value_heads, kv_heads, num_linear, num_full, head_dim=128):
    """docs/memory.md's `f` for Qwen3.5: the mean over the layer mix of the values one layer saves per token."""
    key, value, kv = key_heads * head_dim, value_heads * head_dim, kv_heads * 256
    states = 2 * value * head_dim / CHUNK
    linear = 6 + (2 * (2 * key + value) + 3 * value + states) / h + mlp
    full = 10 + 3 * kv / h + mlp
    return (num_linear * linear + num_full * full) / (num_linear + num_full)


# Qwen3.5-27B: 64 layers of 5120 (48 Gated DeltaNet 16 / 48 heads, 16 gated attention 24 / 4 heads), MLP 17408
H27 = 5120
LAYER_27_MLP = 3 * H27 * 17408 + 2 * H27  # the MLP and the layer's two norms
P27 = (
    2 * VOCAB * H27
    + H27
    + 48 * (gated_deltanet(H27, 16, 48) + LAYER_27_MLP)
    + 16 * (gated_attention(H27, 24, 4) + LAYER_27_MLP)
    + vision(H27)
)
F27 = family_factor(H27, 5 * 17408 / H27, 16, 48, 4, 48, 16)
# Qwen3.5-35B-A3B: 40 layers of 2048 (30 Gated DeltaNet 16 / 32 heads, 10 gated attention 16 / 2 heads), 256
# experts of 512 (fused gate_up and down) with a router, a shared expert of 512 and its gate
H35, EXPERTS, TOP_K, EXPERT_FFN, SHARED = 2048, 256, 8, 512, 512
EXPERT_PARAMS = EXPERTS * 3 * H35 * EXPERT_FFN
LAYER_35_MLP = EXPERT_PARAMS + EXPERTS * H35 + 3 * H35 * SHARED + H35 + 2 * H35
P35 = (
    2 * VOCAB * H35
    + H35
    + 30 * (gated_deltanet(H35, 16, 32) + LAYER_35_MLP)
    + 10 * (gated_attention(H35, 16, 2) + LAYER_35_MLP)
    + vision(H35)
)
F35 = family_factor(H35, (5 * (TOP_K * EXPERT_FFN + SHARED) + 2 * EXPERTS) / H35, 16, 32, 2, 30, 10)

MODELS = {
    # recipe: (config.json, P, hidden, f, tokens per micro-batch, chunk-loss chunk, largest FSDP unit)
    "qwen3_5_27b": (qwen3_5_configs.QWEN3_5_27B, P27, H27, F27, 2 * 16384, 1024, VOCAB * H27),
    "qwen3_5_35b": (qwen3_5_configs.qwen3_5_35b_a3b(), P35, H35, F35, 4 * 16384, 512, EXPERT_PARAMS),
}


def activations(hidden: int, f: float, tokens: int, chunk: int) -> float:
    """Recompute + activation offload: one layer input and one layer's saved values on the device; chunk loss;
    the trained vision tower over `tokens` image tokens (the plan's upper bound, 4 patches each) with recompute."""
    patches = 4 * tokens
    tower = DEPTH * patches * VH * 2 + patches * VH * (8 + 5 * VMLP / VH) * 2
    return tokens * hidden * 2 + tokens * hidden * f * 2 + chunk * VOCAB * 8 + tower


@pytest.fixture(scope="module")
def recipes(tmp_path_factory):
    """recipe -> (its config file with the model directory filled in, the CPU host's overrides)."""
    tmp = tmp_path_factory.mktemp("qwen3_5_plans")
    (tmp / "data").mkdir()
    for split in ("train", "eval"):
        (tmp / "data" / f"{split}.jsonl").write_text("")
    out = {}
    for name, (config, *_) in MODELS.items():
        model_dir = qwen3_5_configs.write_config(config, tmp / name)
        paths = {"data": tmp / "data", "cache": tmp / "cache", msmm_configs.MODELS[name]: model_dir}
        out[name] = msmm_configs.write_config(name, paths, tmp / "configs")
    return out


def test_the_hand_calculation_is_the_published_size():
    assert P27 == 27_356_728_560  # "27B"; the hub's files add the multi-token-prediction layer
    assert P35 == 35_107_181_936  # "35B-A3B"
    assert gated_deltanet(H27, 16, 48) == 115_876_064 and gated_attention(H27, 24, 4) == 104_858_112


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [8, 16])
@pytest.mark.parametrize("recipe", list(MODELS))
def test_plan_matches_the_hand_calculation(recipes, recipe, ranks):
    _, params, hidden, f, tokens, chunk, unit = MODELS[recipe]
    cfg = load_config(recipes[recipe], msmm_configs.CPU_OVERRIDES)
    assert cfg.parallel.recompute and cfg.features.enable_chunk_loss and cfg.features.activation_offload_plan
    plan = memory_plan(cfg, ranks, DEVICE)
    assert (plan.num_params, plan.num_trainable) == (params, params)
    assert plan.parameters == params * 4 // ranks and plan.gradients == params * 4 // ranks
    assert plan.optimizer_states == 2 * 4 * params // ranks
    assert plan.compute_copies == 2 * unit * 2
    expected = activations(hidden, f, tokens, chunk)
    assert abs(plan.activations - expected) <= 1e-9 * expected, (plan.activations / GiB, expected / GiB)


FITS = {("qwen3_5_27b", 8): False, ("qwen3_5_27b", 16): True, ("qwen3_5_35b", 8): False, ("qwen3_5_35b", 16): False}
"""What the plans say of MindSpeed-MM's configs as written on 64 GB devices (docs/memory.md)."""


NO_WEIGHTS = ["model.random_init=true", "training.load=null", "training.init_model_with_meta_device=false"]
"""No weights here: `--check` builds on meta for its checks, and the run it checks would random-init."""


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [8, 16])
@pytest.mark.parametrize("recipe", list(MODELS))
def test_check_prints_the_plan(recipes, recipe, ranks, capsys):
    code = main(
        [
            str(recipes[recipe]),
            *msmm_configs.CPU_OVERRIDES,
            *NO_WEIGHTS,
            "--check",
            "--nproc-per-node",
            str(ranks),
            "--device-memory",
            "64GiB",
        ]
    )
    out = capsys.readouterr()
    text = out.out + out.err
    model_id = "qwen3_5_moe" if recipe == "qwen3_5_35b" else "qwen3_5"
    total = float(re.search(r"^  total +([\d.]+) GiB", text, re.M).group(1))
    # the plan informs; the check passes either way
    assert code == 0 and f"check passed: {ranks} processes, model {model_id}" in text, text[-3000:]
    if FITS[recipe, ranks]:
        assert re.search(rf"^  fits: {total} GiB of 64.0 GiB device memory$", text, re.M), text[-2000:]
    else:
        assert f"does not fit: {total} GiB > 64.0 GiB device memory" in text, text[-3000:]
        assert "would fit with:" in text, text[-2000:]
