"""The MoE family through the real trainer at expert parallel 1: qwen3vl-moe-tiny, fp32 on gloo, 3 steps,
`features.loss_cfg.router_aux_loss_coef` on.

- FSDP2 on 2 processes (data parallel 2, half the micro-batch) gives the 1-process run's per-step LM loss,
  router aux loss, gradient norm and expert load (relative difference <= 1e-5; the loads are counts, equal).
- Step 1 of the 1-process run equals plain HF: `Qwen3VLMoeForConditionalGeneration` with that run's initial
  weights, given the first batch with `labels=` and `output_router_logits=True`, returns as `loss` the LM loss
  plus coef × aux loss, and the same gradient norm.
- A dense model with a non-zero coefficient is refused by the check, naming the key.
"""

from pathlib import Path

import pytest

from mmfsdp.data import prepare_dataset
from mmfsdp.parallel.testing import run_distributed
from mmfsdp.train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "qwen3vl-moe-tiny" / "config.yaml"
ASSETS = ROOT / "examples" / "qwen3vl-moe-tiny" / "assets"
STEPS = 3
COEF = 0.5
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _overrides(tmp: Path, name: str, **extra) -> list[str]:
    items = {
        "data.dataset_param.basic_parameters.dataset_dir": str(tmp / "data"),
        "data.dataset_param.basic_parameters.cache_dir": str(tmp / "cache"),
        "data.dataset_param.synthetic.num_train": 32,
        "data.dataset_param.synthetic.num_eval": 4,
        "data.dataset_param.preprocess_parameters.cutoff_len": 96,
        "features.loss_cfg.router_aux_loss_coef": COEF,
        "training.micro_batch_size": 4,
        "training.train_iters": STEPS,
        "training.lr_warmup_ratio": 0.0,
        "training.log_interval": 100,
        "training.output_dir": str(tmp / "out" / name),
        **extra,
    }
    return [f"{k}={v}" for k, v in items.items()]


def _hf_step(batch, weights) -> tuple[float, float]:
    import torch
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    from mmfsdp.model import model_inputs

    with torch.random.fork_rng():
        config = Qwen3VLMoeConfig.from_pretrained(ASSETS)
        config.text_config.router_aux_loss_coef = COEF
        model = Qwen3VLMoeForConditionalGeneration._from_config(config, attn_implementation="sdpa")
    model.load_state_dict(weights, strict=True)
    model.train()
    loss = model(**model_inputs(batch), labels=batch["labels"], output_router_logits=True).loss
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    return float(loss), float(norm)


def _train(rank, world_size, tmp, name, extra):
    from torch.distributed.tensor import DTensor

    from mmfsdp.train.trainer import Trainer

    trainer = Trainer(load_config(CONFIG, _overrides(Path(tmp), name, **extra)), "cpu")
    first = None
    if world_size == 1:
        state = trainer.loader.state_dict()
        batch = next(trainer.loader)
        trainer.loader.load_state_dict(state)
        weights = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                   for k, v in trainer.model.state_dict().items()}
        first = (batch, weights)
    trainer.train()
    out = {"steps": [(r.loss, r.aux_loss, r.grad_norm, r.expert_load) for r in trainer.history],
           "dp": trainer.dims.dp_size}
    if first is not None:
        out["hf_step1"] = _hf_step(*first)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe")
    prepare_dataset(load_config(CONFIG, _overrides(tmp, "prepare")).data)
    return {
        "ref": run_distributed(_train, 1, str(tmp), "ref", {}, timeout=600)[0],
        "fsdp2": run_distributed(_train, 2, str(tmp), "fsdp2", {"training.micro_batch_size": 2}, timeout=600)[0],
    }


def _close(value: float, reference: float) -> bool:
    return abs(value - reference) <= 1e-5 * abs(reference)


def test_fsdp2_with_router_aux_loss_matches_one_process(results):
    got, expected = results["fsdp2"], results["ref"]
    assert got["dp"] == 2 and expected["dp"] == 1
    assert len(got["steps"]) == len(expected["steps"]) == STEPS
    for step, (mine, theirs) in enumerate(zip(got["steps"], expected["steps"]), 1):
        (loss, aux, norm, load), (ref_loss, ref_aux, ref_norm, ref_load) = mine, theirs
        assert aux is not None and ref_aux > 0, f"step {step}: no router aux loss logged"
        assert _close(loss, ref_loss), f"step {step}: LM loss {loss} vs {ref_loss}"
        assert _close(aux, ref_aux), f"step {step}: aux loss {aux} vs {ref_aux}"
        assert _close(norm, ref_norm), f"step {step}: grad norm {norm} vs {ref_norm}"
        assert load == ref_load, f"step {step}: expert load {load} vs {ref_load}"


def test_first_step_lm_plus_aux_loss_matches_plain_hf(results):
    loss, aux, norm, load = results["ref"]["steps"][0]
    hf_loss, hf_norm = results["ref"]["hf_step1"]
    assert _close(loss + COEF * aux, hf_loss), f"step 1: {loss} + {COEF} x {aux} vs HF {hf_loss}"
    assert _close(norm, hf_norm), f"step 1: grad norm {norm} vs HF {hf_norm}"
    assert load["max"] >= load["mean"] > 0


def test_router_aux_loss_on_a_dense_model_is_a_config_error():
    from mmfsdp.train.check import model_check

    cfg = load_config(ROOT / "examples" / "tiny" / "config.yaml", ["features.loss_cfg.router_aux_loss_coef=0.01"])
    errors = [e for e in model_check(cfg) if "router_aux_loss_coef" in str(e)]
    assert len(errors) == 1 and "features.loss_cfg.router_aux_loss_coef" in str(errors[0]), errors
    assert "dense" in str(errors[0])
