"""The `model:` and `features:` config sections.

`ModelConfig` says which registered model family to build, from where, with
which attention backend and storage dtype, and which modules to freeze.
`FeaturesConfig` switches the chunked loss on and picks the loss normalisation
(the formulas are in `mmfsdp.model.loss` and docs/model.md).

Their `foreign_keys` accept MindSpeed-MM's spellings: its older configs keep the
loss, chunk-loss, offload and recompute settings under `model:` (newer ones under
`features:`, recompute included), and name the loss types `per_sample_loss` /
`per_token_loss` (docs/migration.md).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

from mmfsdp.config import Alias, ConfigError, ForeignKey, Ignored
from mmfsdp.model.registry import registered_model_ids
from mmfsdp.parallel.config import DType

ATTENTION_BACKEND_NAMES = ("sdpa", "eager", "flash_attention_2")
"""The values of `model.attn_implementation` (the backends of `mmfsdp.model.attention`)."""
USE_TRITON_GDN = Alias("model.gdn_kernel", values={True: "fla", False: "torch"})
"""MindSpeed-MM's switch for fla's Gated DeltaNet kernel (under `model:`, in older configs under `features:`)."""

__all__ = [
    "ModelConfig", "FeaturesConfig", "ChunkLossPlanConfig", "LossConfig", "ActivationOffloadPlanConfig", "CompilePlanConfig",
]


def _unknown(value: str, known: list[str], what: str) -> str:
    close = difflib.get_close_matches(value, known, n=1, cutoff=0.5)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{value!r} is not a registered {what}{hint}; registered: {', '.join(sorted(known))}"


def _model_id_of(model_dir: str | None) -> str | None:
    """The model id whose state-dict adapter claims `model_dir`/config.json's `model_type`; None without one."""
    if not model_dir or not (Path(model_dir).expanduser() / "config.json").is_file():
        return None
    from mmfsdp.ckpt.adapters import find_state_dict_adapter
    from mmfsdp.ckpt.errors import CheckpointError

    config = json.loads((Path(model_dir).expanduser() / "config.json").read_text())
    try:
        adapter = find_state_dict_adapter(config)
    except CheckpointError as err:
        raise ConfigError("model_id", f"is not set, and {err}; set it") from None
    return adapter.model_id if adapter.model_id in registered_model_ids() else None


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    model_id: str | None = None
    """Registered model family to build (see `mmfsdp.model.get_model_entry`); null = the family whose state-dict
    adapter claims the `model_type` of `model_name_or_path`'s config.json."""
    model_name_or_path: str | None = None
    """Directory with the HF config.json (and safetensors weights unless random_init)."""
    random_init: bool = False
    """Build from the config.json in model_name_or_path with random weights instead of loading them."""
    attn_implementation: str = "sdpa"
    """Attention backend: sdpa, eager or flash_attention_2 (flash-attn on CUDA, fused attention on Ascend NPU)."""
    freeze: list[str] = field(default_factory=list)
    """Module name patterns ({*} and {a-b} allowed) whose parameters are not trained."""
    trust_remote_code: bool = False
    """Passed to transformers when reading the config and weights."""
    dtype: DType = "fp32"
    """Storage dtype of the built model's parameters."""
    gdn_kernel: Literal["auto", "torch", "fla"] = "auto"
    """Gated DeltaNet delta rule (Qwen3.5 families): auto (fla's Triton kernel on CUDA where the `fla` extra is installed, else torch), torch, or fla (one warning and the torch path where it cannot run)."""

    foreign_keys: ClassVar[dict[str, ForeignKey]] = {
        **{key: Alias(f"features.{key}") for key in ("loss_cfg", "enable_chunk_loss", "chunkloss_plan", "activation_offload_plan")},
        **{key: Alias(f"parallel.{key}") for key in ("recompute", "recompute_plan")},
        "encoder_data_balance": Alias("data.dataloader_param.balance"),  # VeOmni's name, in its model section
        # MindSpeed-MM's Qwen3.5 kernel switches: the numbers are the same whichever kernel runs
        **{
            key: Ignored(
                "Gated DeltaNet runs through mmfsdp's packing-exact operator, its delta rule as model.gdn_kernel says "
                "(docs/parallelism.md)"
            )
            for key in ("gdn_implementation", "causal_conv1d_implementation")
        },
        "use_triton_gdn": USE_TRITON_GDN,
        **{
            key: Ignored("recompute re-runs every module of recompute_plan whole; no kernel's output is kept aside")
            for key in ("skip_gdn_recompute", "skip_flash_attn_recompute")
        },
        "use_grouped_expert_matmul": Ignored(
            "the experts use grouped GEMM wherever the device runs it (probed once), else a loop over the experts"
        ),
    }

    def __post_init__(self) -> None:
        ids = registered_model_ids()
        if self.model_id is None:
            self.model_id = _model_id_of(self.model_name_or_path)
        if self.model_id is not None and self.model_id not in ids:
            raise ConfigError("model_id", _unknown(self.model_id, ids, "model id"))
        names = list(ATTENTION_BACKEND_NAMES)
        if self.attn_implementation not in names:
            raise ConfigError("attn_implementation", _unknown(self.attn_implementation, names, "attention backend"))
        if self.model_name_or_path is not None and not self.model_name_or_path.strip():
            raise ConfigError("model_name_or_path", "is empty; give a directory holding config.json or leave it null")


@dataclass(kw_only=True, slots=True)
class ChunkLossPlanConfig:
    chunk_size: int = 1024
    """Tokens per chunk of the lm_head + cross-entropy computation."""

    foreign_keys: ClassVar[dict[str, ForeignKey]] = {
        "apply_module": Ignored("chunk loss always wraps the model family's lm_head", allowed=("lm_head",)),
        "total_chunk_size": Ignored("used only by dynamic chunk loss, which is not implemented"),
    }

    def __post_init__(self) -> None:
        if self.chunk_size <= 0:
            raise ConfigError("chunk_size", f"{self.chunk_size} must be a positive number of tokens")


@dataclass(kw_only=True, slots=True)
class LossConfig:
    loss_type: Literal["default", "per_sample", "per_token"] = "default"
    """default: mean over the global batch's trained tokens; per_sample: mean of per-sample means; per_token: sum / average trained tokens per micro-batch and rank."""
    router_aux_loss_coef: float = 0.0
    """MoE families: weight of the router load-balancing loss (HF's, over the global batch of each micro-batch) added to the LM loss; 0 = off (the aux loss and expert load are still logged). Must be 0 for a dense model."""

    foreign_keys: ClassVar[dict[str, ForeignKey]] = {
        "loss_type": Alias(values={"per_sample_loss": "per_sample", "per_token_loss": "per_token"}),
        "router_aux_loss_offload": Ignored("the router aux loss stays on the device", allowed=(False,)),
    }

    def __post_init__(self) -> None:
        coef = self.router_aux_loss_coef
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not coef >= 0:
            raise ConfigError("router_aux_loss_coef", f"must be a number >= 0 (0 turns it off), got {coef!r}")


@dataclass(kw_only=True, slots=True)
class ActivationOffloadPlanConfig:
    apply_modules: list[str] = field(default_factory=list)
    """Module name patterns ({*} and {a-b} allowed) whose saved activations wait in host memory for backward; empty = off (docs/parallelism.md)."""


@dataclass(kw_only=True, slots=True)
class CompilePlanConfig:
    apply_modules: list[str] | None = None
    """Module name patterns ({*} and {a-b} allowed) whose forward is compiled one by one; null = the model's decoder layers."""
    backend: str = "inductor"
    """torch.compile backend: inductor (generated kernels; a C++ compiler on the CPU), aot_eager (traced, no code generation) or eager."""
    dynamic: bool | None = None
    """null (torch.compile's default, as torchtitan compiles): the first step specialises on its shapes, and the first micro-batch of another length recompiles once with only the dimensions that changed symbolic (the sequence), then every length runs that graph; true: every dimension symbolic from the first call (hidden sizes too: several times slower to trace, and kernels that cannot specialise on them); false: specialise on every shape (a recompile per new length, eager after torch's recompile limit)."""

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str) or not self.backend:
            raise ConfigError("backend", f"must be a torch.compile backend name such as inductor, got {self.backend!r}")


@dataclass(kw_only=True, slots=True)
class FeaturesConfig:
    enable_chunk_loss: bool = False
    """Compute lm_head + loss chunk by chunk inside lm_head, never materialising the full logits."""
    chunkloss_plan: ChunkLossPlanConfig = field(default_factory=ChunkLossPlanConfig)
    """Chunked-loss settings."""
    loss_cfg: LossConfig = field(default_factory=LossConfig)
    """Loss normalisation settings."""
    activation_offload_plan: ActivationOffloadPlanConfig = field(default_factory=ActivationOffloadPlanConfig)
    """Which modules keep their saved activations in host memory during forward."""
    enable_activation_offload: bool | None = None
    """MindSpeed-MM's switch for the plan above: false turns activation offload off whatever the plan lists, true needs a plan that lists modules; null = offload whenever the plan lists modules."""
    compile: bool = False
    """torch.compile each decoder layer (per block, before FSDP2; composes with recompute, chunk loss, LoRA, context parallel); the first step compiles."""
    compile_plan: CompilePlanConfig = field(default_factory=CompilePlanConfig)
    """Which blocks are compiled and how."""

    foreign_keys: ClassVar[dict[str, ForeignKey]] = {
        **{key: Alias(f"parallel.{key}") for key in ("recompute", "recompute_plan")},
        "enable_dynamic_chunk_loss": Ignored("chunk loss uses the fixed chunkloss_plan.chunk_size", allowed=(False,)),
        # torchtitan's `compile.enable`, HF TrainingArguments' (LLaMA-Factory's) `torch_compile`
        **{key: Alias("features.compile") for key in ("torch_compile", "use_torch_compile", "enable_compile")},
        "use_triton_gdn": USE_TRITON_GDN,
        "use_grouped_expert_matmul": Ignored(
            "the experts use grouped GEMM wherever the device runs it (probed once), else a loop over the experts"
        ),
        "enable_ep_balance": Ignored("duplicating busy experts on other ranks is not implemented", allowed=(False,)),
        "ep_balance_plan": Ignored("read only with enable_ep_balance"),
        "enable_chunk_mbs": Ignored(
            "a micro-batch is not split inside the layers (the same numbers); --check's memory plan counts the whole "
            "micro-batch: lower micro_batch_size or use recompute / activation offload if it does not fit"
        ),
        "chunkmbs_plan": Ignored("read only with enable_chunk_mbs"),
    }

    def __post_init__(self) -> None:
        if self.enable_activation_offload is False:
            self.activation_offload_plan.apply_modules = []
        elif self.enable_activation_offload and not self.activation_offload_plan.apply_modules:
            raise ConfigError(
                "enable_activation_offload",
                "is true but activation_offload_plan.apply_modules lists no module: list the modules to offload, "
                "e.g. model.language_model.layers.{*}",
            )
