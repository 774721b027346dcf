"""Qwen3.5 through the real app: meta-device init from HF weights, then SIGKILL and restart.

The reference loads a `save_pretrained` tiny Qwen3.5 (several safetensors shards) eagerly with `from_pretrained`
on the CPU and trains 6 steps on 2 processes (gradient accumulation 2, 4 steps per epoch, padding-free
micro-batches: the Gated DeltaNet layers' state and conv reset at each `cu_seq_lens` boundary). The second run
builds the same model on the meta device, shards it and fills it from the same HF directory; it is SIGKILLed
(launcher and ranks) after its step-3 checkpoint and restarted with the same command. The restart must say it
resumed at step 3 and log only steps 4-6 (`apprun.kill_and_restart`), and every logged value of steps 1-6 must
equal the reference bitwise: steps 1-3 prove meta init from HF, steps 4-6 that the resume (mid-epoch, across the
epoch boundary) is exact. Rows: `qwen3_5`, and `qwen3_5_moe` with expert parallel 2 and the router aux loss (its
aux loss and expert load bitwise too). The reference is the trainer the app's ranks run, in-process
(`apprun.train_in_process`).
"""

from pathlib import Path

import pytest

import apprun
from mmfsdp.ckpt import read_tracker
from mmfsdp.data import prepare_dataset
from mmfsdp.train.config import load_config

CONFIG, ASSETS = apprun.QWEN3_5, apprun.QWEN3_5_ASSETS
STEPS = 6
ROWS = {
    "qwen3_5": ({}, ("loss", "grad_norm")),
    "qwen3_5_moe": (
        {"parallel.expert_parallel_size": 2, "features.loss_cfg.router_aux_loss_coef": 0.5},
        ("loss", "grad_norm", "aux_loss", "expert_load_max", "expert_load_mean"),
    ),
}
"""Model id -> (its overrides, the metrics that must equal the reference bitwise)."""
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _items(tmp: Path, out: Path, hf: Path, model_id: str, **extra) -> dict:
    return {
        "data.dataset_param.preprocess_parameters.model_name_or_path": ASSETS,
        "data.dataset_param.preprocess_parameters.cutoff_len": 96,
        "data.dataloader_param.padding_free": True,
        **apprun.synthetic_items(tmp),  # 8 samples per step -> 4 steps per epoch
        "model.model_id": model_id,
        "model.model_name_or_path": hf,
        "model.random_init": False,
        **ROWS[model_id][0],
        **apprun.run_items(out, steps=STEPS, accumulation=2, **{"training.lr_warmup_ratio": 0.0}),
        **extra,
    }


@pytest.fixture(scope="module", params=list(ROWS))
def setup(request, tmp_path_factory):
    import torch
    from transformers import AutoConfig

    from mmfsdp.model import get_model_entry

    model_id = request.param
    tmp = tmp_path_factory.mktemp(f"{model_id}-resume")
    config = AutoConfig.from_pretrained(ASSETS)
    if model_id == "qwen3_5_moe":
        from test_e2e_qwen3_5_parity import write_moe_config

        write_moe_config(tmp / "moe_config")
        config = AutoConfig.from_pretrained(tmp / "moe_config")
    hf = tmp / "hf"
    torch.manual_seed(5)
    get_model_entry(model_id).model_class.__bases__[-1](config).save_pretrained(hf, max_shard_size="300KB")
    assert len(list(hf.glob("*.safetensors"))) > 1
    prepare_dataset(load_config(CONFIG, apprun.overrides(_items(tmp, tmp / "prepare", hf, model_id))).data)
    return model_id, tmp, hf


def test_qwen3_5_meta_init_from_hf_then_kill_and_restart_is_exact(setup, tmp_path):
    model_id, tmp, hf = setup
    keys = ROWS[model_id][1]
    reference_out = apprun.train_in_process(CONFIG, _items(tmp, tmp_path / "eager", hf, model_id))
    reference = {r["step"]: tuple(r[k] for k in keys) for r in apprun.records(reference_out)}
    assert sorted(reference) == list(range(1, STEPS + 1))

    out = tmp_path / "meta"
    cmd = apprun.command(
        CONFIG,
        _items(
            tmp,
            out,
            hf,
            model_id,
            **{
                "training.init_model_with_meta_device": True,
                "training.save_interval": 3,
                "training.save": out / "ckpt",
                "training.load": out / "ckpt",
            },
        ),
    )
    restart, _ = apprun.kill_and_restart(cmd, out, 3, STEPS)
    assert "iter_0000003 (step 3" in restart.stdout, restart.stdout[-2000:]
    apprun.assert_steps_equal(out, reference, keys, STEPS)
    assert read_tracker(out / "ckpt") == STEPS
