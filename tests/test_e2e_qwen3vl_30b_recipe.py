"""The Qwen3-VL-30B-A3B recipes of `examples/qwen3vl` (MindSpeed-MM's quickstart names) end to end.

- The memory plan on the real architecture: `config.json` written from the published dimensions
  (`tests/qwen3vl_30b_config.py`; meta device, no weights), parameter counts derived here layer by layer,
  the planner's figures against the formulas of docs/memory.md, and `apps/train ... --check --nproc-per-node 16
  --device-memory 64GiB` printing a plan that fits (the app's `main` in-process, as `--check` starts no process;
  the LoRA recipe's plan from the planner).
- The launch script runs: `bash examples/qwen3vl/finetune_qwen3vl_30B_v1.sh` with the CPU overrides its README
  documents (read from the README, paths moved to a temporary directory): exit 0, finite losses, the log in
  `LOG_DIR`.
- The Magistral PR's file names (`examples/magistral-2509/*_v1*`) are links to the recipes and load the same config.
"""

import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

import apprun
from mmfsdp.train.cli import main
from mmfsdp.train.config import load_config
from mmfsdp.train.memory import memory_plan

ROOT = apprun.ROOT
RECIPES = apprun.EXAMPLES / "qwen3vl"
FULL, LORA = RECIPES / "qwen3vl_30B_config_v1.yaml", RECIPES / "qwen3vl_30B_lora_config_v1.yaml"
SCRIPT = RECIPES / "finetune_qwen3vl_30B_v1.sh"
GiB = 2**30
DEVICE = 64 * GiB
RANKS = 16

_spec = importlib.util.spec_from_file_location("qwen3vl_30b_config", ROOT / "tests" / "qwen3vl_30b_config.py")
qwen3vl_30b_config = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(qwen3vl_30b_config)

# text: hidden 2048, 48 layers, 32 query heads and 4 KV heads of 128 (q_norm, k_norm), 128 experts of FFN 768
# (fused gate_up [E, 2I, H] and down [E, H, I]) with a router [E, H], vocabulary 151936, untied lm_head
H, LAYERS, HEADS, KV, HEAD_DIM, EXPERTS, TOP_K, EXPERT_FFN, VOCAB = 2048, 48, 32, 4, 128, 128, 8, 768, 151936
ATTENTION = 2 * H * HEADS * HEAD_DIM + 2 * H * KV * HEAD_DIM + 2 * HEAD_DIM
EXPERT_PARAMS = EXPERTS * 3 * H * EXPERT_FFN
DECODER_LAYER = ATTENTION + EXPERT_PARAMS + EXPERTS * H + 2 * H
TEXT = 2 * VOCAB * H + LAYERS * DECODER_LAYER + H
# vision: patch embedding (3 channels x 2 frames x 16 x 16), 2304 learned positions, 27 blocks of 1152 (LayerNorms
# with bias, fused qkv, MLP 4304), a 2x2 merger into 2048 and 3 DeepStack mergers normalising after the shuffle
VH, VMLP, DEPTH, MERGED = 1152, 4304, 27, 4 * 1152
BLOCK = 4 * VH + VH * 3 * VH + 3 * VH + VH * VH + VH + VH * VMLP + VMLP + VMLP * VH + VH
MERGER = MERGED * MERGED + MERGED + MERGED * H + H  # + 2 x the norm's width
VISION = VH * 3 * 2 * 16 * 16 + VH + 2304 * VH + DEPTH * BLOCK + (MERGER + 2 * VH) + 3 * (MERGER + 2 * MERGED)
P, T = TEXT + VISION, TEXT  # the vision tower (and its mergers) is frozen
TOKENS, CHUNK = 4096, 1024  # micro-batch 1 x cutoff 4096; chunk loss
FAMILY_FACTOR = 8 + 3 * KV * HEAD_DIM / H + 5 * TOP_K * EXPERT_FFN / H + 2 * EXPERTS / H  # docs/memory.md, MoE
ACTIVATIONS = LAYERS * TOKENS * H * 2 + TOKENS * H * FAMILY_FACTOR * 2 + CHUNK * VOCAB * 8
COMPUTE_COPIES = 2 * DECODER_LAYER * 2  # the largest FSDP unit, a decoder layer with its experts, bf16, twice
LORA_RANK = 16
ADAPTERS = LAYERS * LORA_RANK * ((H + HEADS * HEAD_DIM) * 2 + (H + KV * HEAD_DIM) * 2)  # q, o and k, v

# the README's laptop command writes under this directory; the test moves it to its temporary directory
LAPTOP_OUT = "outputs/qwen3vl-30b-laptop"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return qwen3vl_30b_config.write_qwen3vl_30b_config(tmp_path_factory.mktemp("qwen3vl") / "Qwen3-VL-30B-A3B-Instruct")


def _overrides(model_dir: Path, tmp: Path) -> list[str]:
    dataset = tmp / "mllm.json"
    dataset.write_text("[]\n")
    return [
        f"model.model_name_or_path={model_dir}",
        f"data.dataset_param.preprocess_parameters.model_name_or_path={model_dir}",
        f"data.dataset_param.basic_parameters.dataset={dataset}",
        f"data.dataset_param.basic_parameters.dataset_dir={tmp}",
        f"data.dataset_param.basic_parameters.cache_dir={tmp / 'cache'}",
        # no weights here: --check builds on meta for its checks, and the run it checks would random-init;
        # the host has no accelerator, so sdpa stands in for flash_attention_2
        "model.random_init=true",
        "training.load=null",
        "training.init_model_with_meta_device=false",
        "model.attn_implementation=sdpa",
        f"training.save={tmp / 'save'}",
        f"training.output_dir={tmp / 'out'}",
    ]


def test_the_hand_calculation_is_the_published_size():
    assert DECODER_LAYER == 623_120_640 and EXPERT_PARAMS == 603_979_776
    assert TEXT == 30_532_122_624 and VISION == 538_631_408 and P == 31_070_754_032  # 31.1 B on the model card
    assert ADAPTERS == 13_369_344


@pytest.mark.parametrize("recipe", [FULL, LORA], ids=["full", "lora"])
def test_recipes_hold_the_quickstart_paths(recipe):
    cfg = load_config(recipe)
    assert cfg.model.model_id == "qwen3_vl_moe"
    hf = "ckpt/Qwen3-VL-30B-A3B-Instruct"
    assert cfg.model.model_name_or_path == cfg.data.dataset_param.preprocess_parameters.model_name_or_path == hf
    assert cfg.training.init_model_with_meta_device and cfg.training.load == f"{hf}-dcp"
    basic = cfg.data.dataset_param.basic_parameters
    assert (basic.dataset_dir, basic.dataset) == ("data", "data/mllm_format_llava_instruct_data.json")


def test_full_recipe_plan_matches_the_hand_calculation_and_fits_64gb(model_dir, tmp_path):
    cfg = load_config(FULL, _overrides(model_dir, tmp_path))
    assert cfg.parallel.expert_parallel_size == RANKS and EXPERTS % RANKS == 0
    assert cfg.parallel.recompute and cfg.features.enable_chunk_loss
    plan = memory_plan(cfg, RANKS, DEVICE)
    assert (plan.num_params, plan.num_trainable) == (P, T)
    assert plan.parameters == P * 4 // RANKS
    assert plan.gradients == T * 4 // RANKS
    assert plan.optimizer_states == 2 * 4 * T // RANKS
    assert plan.compute_copies == COMPUTE_COPIES
    assert abs(plan.activations - ACTIVATIONS) <= 1e-9 * ACTIVATIONS
    assert plan.fits and plan.total < 34 * GiB, plan.total / GiB  # 33.2 GiB: ~30 GiB left for what the plan omits


def test_lora_recipe_trains_the_adapters_only(model_dir, tmp_path):
    cfg = load_config(LORA, _overrides(model_dir, tmp_path))
    assert cfg.training.lora.enable and cfg.training.lora.rank == LORA_RANK and cfg.model.dtype == "bf16"
    plan = memory_plan(cfg, RANKS, DEVICE)
    assert (plan.num_params, plan.num_trainable) == (P + ADAPTERS, ADAPTERS)
    assert plan.parameters == (P * 2 + ADAPTERS * 4) // RANKS  # bf16 base, fp32 adapters
    assert plan.gradients == ADAPTERS * 4 // RANKS and plan.optimizer_states == 2 * 4 * ADAPTERS // RANKS
    assert plan.fits and plan.total < 9 * GiB


def test_check_prints_a_plan_that_fits_16_ranks_of_64gb(model_dir, tmp_path, capsys):
    code = main([str(FULL), *_overrides(model_dir, tmp_path), "--check", "--nproc-per-node", str(RANKS),
                 "--device-memory", "64GiB"])
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert code == 0, out[-4000:]
    assert f"check passed: {RANKS} processes, model qwen3_vl_moe" in out, out[-4000:]
    total = float(re.search(r"^  total +([\d.]+) GiB", out, re.M).group(1))
    fits = re.search(r"^  fits: ([\d.]+) GiB of ([\d.]+) GiB device memory$", out, re.M)
    assert fits and float(fits.group(1)) == total and float(fits.group(2)) == 64.0, out[-2000:]
    assert total <= 64.0


def _readme_laptop_command() -> tuple[dict[str, str], list[str]]:
    """The README's laptop command: its environment assignments and its overrides."""
    readme = (RECIPES / "README.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", readme, re.S) if "NPUS_PER_NODE=2 bash" in b)
    words = shlex.split(block.replace("\\\n", " "))
    script = words.index("examples/qwen3vl/finetune_qwen3vl_30B_v1.sh")
    assert words[script - 1] == "bash"
    env = dict(word.split("=", 1) for word in words[: script - 1])
    return env, words[script + 1:]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("config", [None, LORA], ids=["full", "lora"])
def test_the_script_runs_three_steps_on_2_cpu_processes_with_the_readme_overrides(tmp_path, config):
    if shutil.which("uv") is None:
        pytest.skip("the launch script runs `uv run torchrun`; uv is not on PATH")
    env_vars, overrides = _readme_laptop_command()
    assert env_vars == {"NPUS_PER_NODE": "2"}
    overrides = [o.replace(LAPTOP_OUT, str(tmp_path / "out")) for o in overrides]
    assert "training.train_iters=3" in overrides and not any("outputs/" in o for o in overrides)
    env = {**os.environ, **env_vars, "LOG_DIR": str(tmp_path / "logs"), "MASTER_PORT": str(_free_port())}
    if config is not None:
        env["CONFIG"] = str(config.relative_to(ROOT))
    result = subprocess.run(["bash", str(SCRIPT), *overrides], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=540)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    logs = list((tmp_path / "logs").glob("finetune_qwen3vl_30B_v1_*.log"))
    assert len(logs) == 1 and "step 3/3" in logs[0].read_text()
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in records), records
    assert (tmp_path / "out" / "ckpt" / "iter_0000003").is_dir()


def test_magistral_pr_names_link_to_the_recipes():
    magistral = ROOT / "examples" / "magistral-2509"
    links = {
        "finetune_magistral_2509_v1.sh": "finetune_8card.sh",
        "finetune_magistral_2509_v1_4card.sh": "finetune_4card.sh",
        "magistral_2509_config_v1.yaml": "config_8card.yaml",
        "magistral_2509_config_v1_4card.yaml": "config_4card.yaml",
        "README_v1.md": "README.md",
    }
    for name, target in links.items():
        path = magistral / name
        assert path.is_symlink() and path.readlink() == Path(target), name  # a link in the same folder, no copy
        assert path.resolve() == (magistral / target).resolve()
    for name, target in [("magistral_2509_config_v1.yaml", "config_8card.yaml"),
                         ("magistral_2509_config_v1_4card.yaml", "config_4card.yaml")]:
        # paths in the YAML are relative to the working directory (the repository root), not to the file
        linked, original = load_config(magistral / name), load_config(magistral / target)
        assert linked == original
        assert linked.training.load == "ckpt/dcp_path/Magistral-Small-2509"
