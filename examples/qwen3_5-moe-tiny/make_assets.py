"""Write the tiny Qwen3.5 MoE run's model directory: `uv run python examples/qwen3_5-moe-tiny/make_assets.py`.

The tokenizer (with the official Qwen3.5 chat template) and the image processor are the tiny Qwen3.5 run's
(`examples/qwen3_5-tiny/make_assets.py` writes them the same way, byte for byte); `config.json` is a Qwen3.5 MoE
(`qwen3_5_moe`, from `Qwen3_5MoeTestKit.tiny_config`) with the qwen3_5-tiny dimensions and layer mix (Gated
DeltaNet, Gated DeltaNet, gated full attention) and every decoder MLP a sparse block: 8 routed experts of size 64,
top-2, and a gated shared expert of size 96 (the sizes of `write_moe_config` in tests/test_e2e_qwen3_5_parity.py),
`router_aux_loss_coef` 0.01. No weights: the run uses `model.random_init: true`.
The files are committed; this script documents how they were made and regenerates them.
"""

import importlib.util
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("qwen3_5_tiny_assets", HERE.parent / "qwen3_5-tiny" / "make_assets.py")
dense = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dense)

MOE = {
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 96,
}


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "assets"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    assets = dense.qwen3vl_assets()
    ids = dense.write_tokenizer_and_processor(out, assets)
    dense.write_model_config(out, ids, assets, "qwen3_5_moe", **MOE)
    print(f"wrote {out}: {sorted(p.name for p in out.iterdir())}")
