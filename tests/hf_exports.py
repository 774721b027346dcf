"""Tiny HF exports made the way a training run makes them, one per family, for the tests that load exports in
servers (transformers' `pipeline`, vLLM).

`export_example(config, out)` builds the random-init model of an example config (its family, its tiny assets),
saves it as a DCP checkpoint that records the stop tokens of the example's chat template (what `Checkpointer`
records: `generation_metadata(encoder.stop_token_ids(), pad)`), and exports it with
`mm-convert GenericDCPConverter dcp_to_hf`, the assets' files alongside.

Imported by the tests as `hf_exports` (the `tests` directory is on pytest's `pythonpath`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from apprun import EXAMPLES, MOE, QWEN, QWEN3_5, TINY

EXAMPLE_CONFIGS = {
    "mistral3": TINY,
    "qwen3_vl": QWEN,
    "qwen3_vl_moe": MOE,
    "qwen3_5": QWEN3_5,
    "qwen3_5_moe": EXAMPLES / "qwen3_5-moe-tiny" / "config.yaml",
}
"""Model id -> the example whose tiny model and tokenizer its export uses."""


@dataclass(frozen=True)
class Export:
    path: Path
    """The exported HF directory."""
    model_id: str
    stop_token_ids: list[int]
    """The example's chat template's stop tokens (`SampleEncoder.stop_token_ids`)."""


def export_example(config: Path, out: Path, *, seed: int = 0, assets: Path | None = None) -> Export:
    """The HF export (under `out`) of a random-init model of example `config` (its tiny assets, or `assets`), as a
    training save makes it."""
    from mmfsdp.ckpt import generation_metadata, save_checkpoint
    from mmfsdp.ckpt.cli import main as mm_convert
    from mmfsdp.data import build_processor
    from mmfsdp.data.encoder import SampleEncoder
    from mmfsdp.model import get_model_entry
    from mmfsdp.train.config import load_config

    assets = assets or config.parent / "assets"
    cfg = load_config(config, [f"model.model_name_or_path={assets}",
                               f"data.dataset_param.preprocess_parameters.model_name_or_path={assets}"])
    processor = build_processor(cfg.data)
    stop_token_ids = SampleEncoder(cfg.data, processor).stop_token_ids()
    torch.manual_seed(seed)
    model = get_model_entry(cfg.model.model_id).build(cfg.model)
    save_checkpoint(out / "save", 1, model=model,
                    metadata=generation_metadata(stop_token_ids, processor.pad_token_id))
    export = out / "hf"
    assert mm_convert(["GenericDCPConverter", "dcp_to_hf", "--load_dir", str(out / "save"), "--save_dir", str(export),
                       "--model_assets_dir", str(assets)]) == 0
    return Export(export, cfg.model.model_id, stop_token_ids)
