"""MindSpeed-MM FSDP2 configs as their users have them, with only the paths and the model sizes made tiny.

Imported as `msmm_configs` by test_msmm_config.py (no processes) and test_e2e_msmm.py (training runs).

- `QWEN3VL_30B`: the layout of MindSpeed-MM's `examples/qwen3vl/qwen3vl_30B_config_v1.yaml` (Qwen3-VL-30B-A3B,
  the layout since May 2026: loss, chunk loss, offload and recompute under `features:`, cutoff and template
  under `basic_parameters:`, LLaMA-Factory's data keys, Ascend profiler options, memory snapshot settings).
  `model.model_id` stays `qwen3_vl_moe`; the model is `examples/qwen3vl-moe-tiny`.
- `QWEN3VL_30B_LORA`: the same with MindSpeed-MM's FSDP2 LoRA block (`training.lora`), its top-level anchor keys
  as in its LoRA examples. Needs `training.lora` (another branch); `lora_pending()` says whether it is known.
- `MAGISTRAL`: a Magistral-Small-2509 FSDP2 layout of MindSpeed-MM's PR #3133 (vision tower and projector
  frozen, bf16 all-gather, `fix_mistral_regex`, `mistral` template, `pixtral` collator) in the older layout
  (`recompute` under `parallel:`, loss and chunk loss under `model:`), with top-level anchor keys; the PR's
  file is not in the repository, so the layout follows its description. The model is `examples/tiny`'s Mistral3.

Placeholders `@MODEL@`, `@DATA@`, `@CACHE@` and `@SAVE@` are filled by `write_config`. `prepare(tmp)` writes the data
(shapes, `train.jsonl` / `eval.jsonl`) and the model directories with random safetensors weights, since
the configs build on the meta device and load weights (`init_model_with_meta_device: true`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

QWEN3VL_30B = """\
parallel:
  tensor_parallel_size: 1
  fully_shard_parallel_size: auto
  fsdp_plan:
    apply_modules:
      - model.visual.blocks.{*}
      - model.visual.merger
      - model.visual.deepstack_merger_list.{*}
      - model.visual
      - model.language_model.embed_tokens
      - model.language_model.layers.{*}
      - model.language_model
      - lm_head
    param_dtype: bf16
    reduce_dtype: fp32
  ring_attention_size: 1
  ulysses_parallel_size: 1
  expert_parallel_size: 1
  ep_plan:
    apply_modules:
      - model.language_model.layers.{*}.mlp.experts

data:
  dataset_param:
    dataset_type: huggingface
    attr:
      images: images
      messages: messages
      role_tag: role
      content_tag: content
      user_tag: user
      assistant_tag: assistant
    preprocess_parameters:
      model_name_or_path: &HF_MODEL_LOAD_PATH @MODEL@
      use_fast_tokenizer: true
      split_special_tokens: false
      image_max_pixels: 262144
      image_min_pixels: 1024
      video_max_pixels: 16384
      video_min_pixels: 0
      video_fps: 2.0
      video_maxlen: 64
    basic_parameters:
      cutoff_len: 1024
      template: qwen3_vl_nothink
      enable_thinking: false
      train_on_prompt: false
      mask_history: false
      dataset_dir: @DATA@
      dataset: &DATASET_PATH @DATA@/train.jsonl
      cache_dir: @CACHE@
      overwrite_cache: false
      preprocessing_batch_size: 1000
      preprocessing_num_workers: 16
      max_samples: 10000
  dataloader_param:
    pin_memory: true
    shuffle: true
    dataloader_mode: sampler
    drop_last: true
    sampler_type: BaseRandomBatchSampler
    num_workers: 8
    collate_param:
      model_name: qwen3vl
      ignore_pad_token_for_loss: true
    enable_preload: false

model:
  model_id: qwen3_vl_moe
  model_name_or_path: *HF_MODEL_LOAD_PATH
  trust_remote_code: true
  attn_implementation: flash_attention_2
  freeze:
    - model.visual

features:
  loss_cfg:
    loss_type: default
    router_aux_loss_coef: 0.0
  recompute: true
  recompute_plan:
    apply_modules:
      - model.visual.blocks.{*}
      - model.language_model.layers.{*}
  enable_chunk_loss: false
  chunkloss_plan:
    apply_module: lm_head
    chunk_size: 1024
  activation_offload_plan:
    apply_modules:
      - model.language_model.layers.{*}

training:
  micro_batch_size: 1
  gradient_accumulation_steps: 1
  seed: 42
  lr: 1.0e-5
  lr_decay_style: cosine
  lr_warmup_ratio: 0.1
  weight_decay: 0
  train_iters: 10000
  clip_grad: 0.0
  init_model_with_meta_device: true
  optimizer: adamw
  adam_fused: true
  save_interval: 10000
  use_deter_comp: false
  plugin:
    - mindspeed_mm/fsdp/models/qwen3vl
    - mindspeed_mm/fsdp/data/datasets/huggingface

tools:
  profile:
    enable: false
    profile_type: static
    ranks: [0]
    static_param:
      level: level1
      with_stack: false
      with_memory: false
      record_shapes: false
      with_cpu: true
      save_path: ./profiling
      start_step: 10
      end_step: 11
      data_simplification: false
      aic_metrics_type: PipeUtilization
  memory_profile:
    enable: false
    start_step: 1
    end_step: 2
    save_path: ./memory_snapshot
    dump_ranks: [0]
    stacks: all
    max_entries: null
    mem_info: false
"""

_LORA = """\
  lora:
    enable: true
    rank: 8
    alpha: 16
    target_modules:
      - model.language_model.layers.{*}.self_attn.q_proj
      - model.language_model.layers.{*}.self_attn.k_proj
      - model.language_model.layers.{*}.self_attn.v_proj
      - model.language_model.layers.{*}.self_attn.o_proj
    dropout: 0.0
    init_lora_weights: true
    pretrained_lora_path: null
"""

QWEN3VL_30B_LORA = (
    "HF_MODEL_LOAD_PATH: &HF_PATH @MODEL@\nDATASET_PATH: &TRAIN_DATA @DATA@/train.jsonl\n\n"
    + QWEN3VL_30B.replace(
        "      model_name_or_path: &HF_MODEL_LOAD_PATH @MODEL@\n", "      model_name_or_path: *HF_PATH\n"
    )
    .replace("  model_name_or_path: *HF_MODEL_LOAD_PATH\n", "  model_name_or_path: *HF_PATH\n")
    .replace("      dataset: &DATASET_PATH @DATA@/train.jsonl\n", "      dataset: *TRAIN_DATA\n")
    .replace("  lr: 1.0e-5\n", "  lr: 1.0e-4\n")
    .replace("  use_deter_comp: false\n", "  use_deter_comp: false\n" + _LORA)
)

MAGISTRAL = """\
HF_MODEL_LOAD_PATH: &HF_MODEL_LOAD_PATH @MODEL@
DATASET_PATH: &DATASET_PATH @DATA@/train.jsonl

parallel:
  tensor_parallel_size: 1
  fully_shard_parallel_size: auto
  fsdp_plan:
    apply_modules:
      - model.vision_tower.transformer.layers.{*}
      - model.multi_modal_projector
      - model.language_model.embed_tokens
      - model.language_model.layers.{*}
      - lm_head
    param_dtype: bf16
    reduce_dtype: fp32
    num_to_forward_prefetch: 1
    num_to_backward_prefetch: 1
  ring_attention_size: 1
  ulysses_parallel_size: 1
  recompute: true
  recompute_plan:
    apply_modules:
      - model.language_model.layers.{*}

data:
  dataset_param:
    dataset_type: huggingface
    attr:
      images: images
      messages: messages
      role_tag: role
      content_tag: content
      user_tag: user
      assistant_tag: assistant
      system_tag: system
    preprocess_parameters:
      model_name_or_path: *HF_MODEL_LOAD_PATH
      use_fast_tokenizer: true
      split_special_tokens: false
      fix_mistral_regex: true
      image_max_pixels: 1003520
    basic_parameters:
      cutoff_len: 4096
      template: mistral
      train_on_prompt: false
      mask_history: false
      dataset_dir: @DATA@
      dataset: *DATASET_PATH
      cache_dir: @CACHE@
      overwrite_cache: false
      preprocessing_batch_size: 1000
      preprocessing_num_workers: 8
      max_samples: null
  dataloader_param:
    pin_memory: true
    shuffle: true
    dataloader_mode: sampler
    drop_last: true
    sampler_type: BaseRandomBatchSampler
    num_workers: 4
    collate_param:
      model_name: pixtral
      ignore_pad_token_for_loss: true

model:
  model_id: mistral3
  model_name_or_path: *HF_MODEL_LOAD_PATH
  trust_remote_code: false
  attn_implementation: flash_attention_2
  freeze:
    - model.vision_tower
    - model.multi_modal_projector
  loss_cfg:
    loss_type: per_token_loss
  enable_chunk_loss: true
  chunkloss_plan:
    apply_module: lm_head
    chunk_size: 1024

training:
  micro_batch_size: 1
  gradient_accumulation_steps: 4
  seed: 1234
  lr: 1.0e-5
  lr_min: 1.0e-6
  lr_decay_style: cosine
  lr_warmup_ratio: 0.03
  weight_decay: 0.0
  train_iters: 5000
  clip_grad: 1.0
  init_model_with_meta_device: true
  optimizer: adamw
  adam_fused: true
  save_interval: 500
  no_save_rng: true
  use_deter_comp: false
  plugin:
    - mindspeed_mm/fsdp/models/mistral3
    - mindspeed_mm/fsdp/data/datasets/huggingface

tools:
  profile:
    enable: false
    profile_type: static
    ranks: [0]
    static_param:
      level: level1
      with_stack: false
      with_memory: false
      record_shapes: false
      with_cpu: true
      save_path: ./profiling
      start_step: 10
      end_step: 11
"""

MINDSPEED_COMMIT = "57069cd55a8ab16d5affe379a2e2c5f0a4d962b9"
"""MindSpeed-MM's own Qwen3.5 FSDP2 configs are kept byte for byte in `tests/mindspeed_mm/`: its
`examples/qwen3_5/qwen3_5_27B_config.yaml` and `qwen3_5_35B_config.yaml` at this commit of
github.com/Ascend/MindSpeed-MM (2026-08-08). Only their placeholder paths are replaced (`_MINDSPEED_PATHS`)."""
MINDSPEED_TRITON_GDN_COMMIT = "88d984dce537f1f1e5fff7bd81294de9e56a1c5d"
"""The same two files at this earlier commit (2026-04-08), kept byte for byte in `tests/mindspeed_mm/88d984d/`: their
`features.use_triton_gdn: true` (fla's Gated DeltaNet kernel, `model.gdn_kernel: fla`), recompute under
`parallel:`, and `training.load` naming the DCP conversion of the HF weights (`prepare` converts the tiny models as
a user would with `mm-convert GenericDCPConverter hf_to_dcp`)."""
_MINDSPEED_PATHS = [  # their placeholder → ours; the longer paths first
    ("./ckpt/convert_path/Qwen3-Omni-30B-A3B-Instruct", "@MODEL@-dcp"),  # qwen3omni: its DCP conversion
    ("ckpt/hf_path/Qwen3-Omni-30B-A3B-Instruct", "@MODEL@"),
    ("./ckpt/hf_path/Qwen35-xxB-dcp", "@MODEL@-dcp"),
    ("./ckpt/hf_path/Qwen35-xxB", "@MODEL@"),
    ("./data/COCO2017", "@DATA@"),
    ("./data/mllm_format_llava_instruct_data_val.json", "@DATA@/eval.jsonl"),
    ("./data/mllm_format_llava_instruct_data.json", "@DATA@/train.jsonl"),
    ("./cache_dir/", "@CACHE@/"),
    ("./save_path", "@SAVE@"),
    ("./data", "@DATA@"),  # 88d984d's dataset_dir
]


def _mindspeed(file: str) -> str:
    text = (ROOT / "tests" / "mindspeed_mm" / file).read_text()
    for theirs, ours in _MINDSPEED_PATHS:
        text = text.replace(theirs, ours)
    return text


CONFIGS = {
    "qwen3vl_30b": QWEN3VL_30B,
    "qwen3vl_30b_lora": QWEN3VL_30B_LORA,
    "magistral": MAGISTRAL,
    "qwen3_5_27b": _mindspeed("qwen3_5_27B_config.yaml"),
    "qwen3_5_35b": _mindspeed("qwen3_5_35B_config.yaml"),
    "qwen3_5_27b_88d984d": _mindspeed("88d984d/qwen3_5_27B_config.yaml"),
    "qwen3_5_35b_88d984d": _mindspeed("88d984d/qwen3_5_35B_config.yaml"),
    "qwen3omni": _mindspeed("qwen3omni/qwen3omni_config_v1.yaml"),
}
MODELS = {
    "qwen3vl_30b": "qwen3vl-moe-tiny",
    "qwen3vl_30b_lora": "qwen3vl-moe-tiny",
    "magistral": "tiny",
    "qwen3_5_27b": "qwen3_5-tiny",
    "qwen3_5_35b": "qwen3_5_moe-tiny",
    "qwen3_5_27b_88d984d": "qwen3_5-tiny",
    "qwen3_5_35b_88d984d": "qwen3_5_moe-tiny",
    "qwen3omni": "qwen3omni-tiny",
}
"""Each config's tiny model: an example's assets, or `qwen3_5_moe-tiny`, the qwen3_5-tiny example's with a MoE
decoder (`_qwen3_5_moe_config`)."""

EP_PLAN_KEY = "parallel.ep_plan"
"""Defined by the expert-parallel branch; until it is merged the 30B layouts run without it (`drop_pending`)."""
LORA_KEY = "training.lora"
"""Defined by the LoRA branch; until it is merged the LoRA variant is skipped (`lora_pending`)."""

# Where a CPU host differs from the configs' NPU cluster: what a user would pass on the command line.
CPU_OVERRIDES = [
    "model.attn_implementation=sdpa",  # flash_attention_2 needs flash-attn (CUDA) or torch_npu
    "data.dataloader_param.num_workers=0",  # 2 CPU cores for both ranks
    "data.dataset_param.basic_parameters.preprocessing_num_workers=1",
]


def known_key(dotted: str) -> bool:
    """Whether `dotted` is a key of our schema (a field, not a foreign key)."""
    import dataclasses
    from typing import get_type_hints

    from mmfsdp.train.config import Config

    cls: type | None = Config
    for part in dotted.split("."):
        if cls is None or part not in {f.name for f in dataclasses.fields(cls)}:
            return False
        tp = get_type_hints(cls)[part]
        cls = tp if dataclasses.is_dataclass(tp) else None
    return True


def lora_pending() -> bool:
    return not known_key(LORA_KEY)


_EP_PLAN = "  ep_plan:\n    apply_modules:\n      - model.language_model.layers.{*}.mlp.experts\n"


def drop_pending(text: str) -> str:
    """`text` without the keys other branches define, while they are not yet known here (see EP_PLAN_KEY)."""
    return text if known_key(EP_PLAN_KEY) else text.replace(_EP_PLAN, "")


def prepare(tmp: Path) -> dict[str, Path]:
    """The shapes data and, per tiny model, a directory with its assets and random safetensors weights."""
    from mmfsdp.data.synthetic import make_shapes_dataset

    make_shapes_dataset(tmp / "data", num_train=32, num_eval=8, image_size=64, seed=0)
    paths = {"data": tmp / "data", "cache": tmp / "cache"}
    for name in sorted(set(MODELS.values())):
        paths[name] = _weights(name, tmp / "models" / name)
    for name in ("qwen3_5-tiny", "qwen3_5_moe-tiny", "qwen3omni-tiny"):  # their configs load the DCP conversion
        _dcp(paths[name], Path(f"{paths[name]}-dcp"))
    return paths


def _dcp(hf_dir: Path, dcp_dir: Path) -> None:
    """`mm-convert GenericDCPConverter hf_to_dcp` of the tiny model, as MindSpeed-MM's README has users do."""
    from mmfsdp.ckpt.cli import main

    if not (dcp_dir / "latest_checkpointed_iteration.txt").is_file():
        assert main(["GenericDCPConverter", "hf_to_dcp", "--hf_dir", str(hf_dir), "--dcp_dir", str(dcp_dir)]) == 0


def _qwen3_5_moe_config(dense: Path):
    """The tiny Qwen3.5 example's config with a MoE decoder (4 experts, top 2, a shared expert): the same
    tokenizer, vision tower and layer types."""
    import json

    from transformers import Qwen3_5MoeConfig

    config = json.loads((dense / "config.json").read_text())
    text = {k: v for k, v in config.pop("text_config").items() if k not in ("model_type", "intermediate_size")}
    text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    vision = {k: v for k, v in config.pop("vision_config").items() if k != "model_type"}
    top = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "transformers_version")}
    return Qwen3_5MoeConfig(text_config=text, vision_config=vision, **top)


def _weights(name: str, out: Path) -> Path:
    import torch
    from transformers import (
        AutoConfig,
        Mistral3ForConditionalGeneration,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeForConditionalGeneration,
        Qwen3OmniMoeForConditionalGeneration,
        Qwen3VLMoeForConditionalGeneration,
    )

    if (out / "config.json").is_file():
        return out
    classes = {
        "qwen3_vl_moe": Qwen3VLMoeForConditionalGeneration,
        "mistral3": Mistral3ForConditionalGeneration,
        "qwen3_5": Qwen3_5ForConditionalGeneration,
        "qwen3_5_moe": Qwen3_5MoeForConditionalGeneration,
        "qwen3_omni_moe": Qwen3OmniMoeForConditionalGeneration,  # thinker, talker and code2wav
    }
    if name == "qwen3_5_moe-tiny":
        assets = ROOT / "examples" / "qwen3_5-tiny" / "assets"
        config = _qwen3_5_moe_config(assets)
    else:
        assets = ROOT / "examples" / name / "assets"
        config = AutoConfig.from_pretrained(assets)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = classes[config.model_type]._from_config(config)
    model.save_pretrained(out)
    for item in assets.iterdir():
        if item.name != "config.json":
            shutil.copy(item, out / item.name)
    return out


def write_config(name: str, paths: dict[str, Path], out: Path) -> Path:
    """The config `name` with its placeholders filled, written to `out/<name>.yaml`."""
    text = CONFIGS[name]
    for token, value in (
        ("@MODEL@", paths[MODELS[name]]),
        ("@DATA@", paths["data"]),
        ("@CACHE@", paths["cache"]),
        ("@SAVE@", out / f"{name}_save"),  # each config its own: a checkpoint found there would be resumed
    ):
        text = text.replace(token, str(value))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.yaml"
    path.write_text(drop_pending(text))
    return path
