"""The sections of the training stages that have their own: `training.dpo` (preference training,
`mmfsdp.train.dpo`) and `training.grpo` (online RL, `mmfsdp.train.grpo`), composed into `TrainingConfig` by
`mmfsdp.train.config`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from mmfsdp.config import Alias, ConfigError, ForeignKey, Ignored, Translate

__all__ = ["DPOConfig", "GRPOConfig", "RolloutConfig", "VLLMConfig", "default_vllm_python"]


@dataclass(kw_only=True, slots=True)
class DPOConfig:
    beta: float = 0.1
    """β: how far the policy may move from the reference (TRL's `beta`; LLaMA-Factory's `pref_beta`)."""
    loss_type: Literal["sigmoid", "robust", "hinge", "ipo", "sigmoid_norm"] = "sigmoid"
    """The pair loss, with TRL's definitions (docs/preference.md): sigmoid (DPO), robust, hinge, ipo (length-normalised, as TRL), sigmoid_norm (DPO on length-normalised log-ratios)."""
    label_smoothing: float = 0.0
    """ε of the sigmoid (conservative DPO) and robust losses: the assumed probability that a preference label is flipped, in [0, 0.5)."""
    rpo_alpha: float = 0.0
    """Weight of the SFT term: the mean cross-entropy per chosen token of the global batch (TRL's `sft` loss term / `rpo_alpha`; LLaMA-Factory's `pref_ftx`); 0 = off."""
    precompute_ref_logps: bool = False
    """Compute the reference's log-probabilities of every pair once, before the first step, over the micro-batches the run will train on, and keep no reference model in memory (saved to `<output_dir>/ref_logps.safetensors`; a resumed run reads them). Off: with LoRA the reference is the model with its adapters off, otherwise a frozen FSDP2-sharded copy of the initial model."""

    foreign_keys: ClassVar[dict[str, ForeignKey]] = {
        "precompute_ref_log_probs": Alias("training.dpo.precompute_ref_logps"),
    }

    def __post_init__(self) -> None:
        if not self.beta > 0:
            raise ConfigError("beta", f"must be > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError("label_smoothing", f"must be in [0, 0.5), got {self.label_smoothing}")
        if self.rpo_alpha < 0:
            raise ConfigError("rpo_alpha", f"must be >= 0, got {self.rpo_alpha}")


def default_vllm_python() -> str:
    """The Python of the vLLM environment `tools/vllm_env/setup.py` builds: `$MMFSDP_VLLM_ENV`, else
    `~/.cache/mmfsdp/vllm-env` (under `$XDG_CACHE_HOME` when set)."""
    if os.environ.get("MMFSDP_VLLM_ENV"):
        return str(Path(os.environ["MMFSDP_VLLM_ENV"]).expanduser() / "bin" / "python")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return str(cache / "mmfsdp" / "vllm-env" / "bin" / "python")


@dataclass(kw_only=True, slots=True)
class VLLMConfig:
    launch: bool = True
    """Rank 0 starts the vLLM server (`mmfsdp.model.vllm_server`) with `python` on the run's starting weights and stops it when the run ends; false: use the server at `url`."""
    python: str = ""
    """The Python of an environment with vLLM; empty = the one `uv run python tools/vllm_env/setup.py` builds (`$MMFSDP_VLLM_ENV/bin/python`, else `~/.cache/mmfsdp/vllm-env/bin/python`)."""
    url: str | None = None
    """With `launch: false`: the address of a running server (`host:port` or a Unix socket path); its key is `$VLLM_SERVER_AUTHKEY` (hex)."""
    startup_timeout_s: float = 600.0
    """Most seconds a launched server may take to load its model and accept a connection."""
    request_timeout_s: float = 600.0
    """Most seconds one request (a weight chunk, a step's generations) may take; past it the run stops with an error."""

    def __post_init__(self) -> None:
        if not self.python:
            self.python = default_vllm_python()
        for key in ("startup_timeout_s", "request_timeout_s"):
            if not getattr(self, key) > 0:
                raise ConfigError(key, f"must be > 0, got {getattr(self, key)}")
        if not self.launch and not self.url:
            raise ConfigError("url", "launch: false needs the address of a running server (host:port or a socket path)")


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    engine: Literal["hf", "vllm"] = "hf"
    """Who generates the completions: hf = inside the training processes from the live FSDP2 model (`mmfsdp.model.rollout.HFRolloutEngine`); vllm = a vLLM server in its own process and environment, its weights synced every step (`mmfsdp.model.vllm_rollout`, docs/rl.md ("Rollout engines"))."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """The vLLM server (with `engine: vllm`)."""
    gather_weights: bool = True
    """hf engine: all-gather each FSDP2 group once per generation batch and keep the whole model gathered while it decodes (TRL's `ds3_gather_for_generation`, verl's hf rollout); false: gather for each forward, one group at a time as in training: one all-gather per group per generated token, for a model whose unsharded weights do not fit beside the training state."""
    sync_interval: int = 1
    """Generation batches per weight sync of an engine in another process (vllm): it receives the policy's weights before generation batches 1, 1 + k, 1 + 2k, ... and generates those between with the weights of its last sync, up to k − 1 batches older than the policy (off-policy rollouts: correct them with `tis_cap`; `rollout/weights_lag` logs the optimizer steps between the two). 1 = every batch. The hf engine generates from the live weights: 1 there."""

    foreign_keys: ClassVar[dict[str, ForeignKey]] = {
        "tis_cap": Translate(
            lambda value, section, path: {
                "training.grpo.vllm_importance_sampling_correction": True,
                "training.grpo.vllm_importance_sampling_mode": "token_truncate",
                "training.grpo.vllm_importance_sampling_clip_max": value,
            },
            "the token-level truncated correction (verl's TIS) capped at the value: `training.grpo."
            "vllm_importance_sampling_correction: true`, `_mode: token_truncate`, `_clip_max: <value>`",
        ),
    }

    def __post_init__(self) -> None:
        if self.sync_interval < 1:
            raise ConfigError("sync_interval", f"must be >= 1, got {self.sync_interval}")
        if self.engine == "hf" and self.sync_interval != 1:
            raise ConfigError("sync_interval", f"is {self.sync_interval}, but engine hf generates from the live "
                                               "weights (no copy to sync): set 1, or use engine: vllm")
        v = self.vllm
        if self.engine == "vllm" and v.launch and not Path(v.python).is_file():
            raise ConfigError("vllm.python", f"{v.python} does not exist: build the vLLM environment with `uv run "
                                             "python tools/vllm_env/setup.py`, or name an environment with vLLM")


@dataclass(kw_only=True, slots=True)
class GRPOConfig:
    num_generations: int = 8
    """Completions per prompt: one group, whose rewards give its advantages (TRL's `num_generations`); a rank's `micro_batch_size` prompts give `micro_batch_size × num_generations` training sequences."""
    max_completion_length: int = 256
    """Most tokens a completion gets (TRL's `max_completion_length`)."""
    temperature: float = 1.0
    """Sampling temperature; the trainer's log-probabilities divide the logits by it too (TRL's). 0: greedy generation (the argmax token, no draw) with the log-probabilities of the raw logits, what both engines return at 0; every completion of a prompt is then the same, so the advantages are 0: for checks (comparing engines, a deterministic run), not for learning."""
    top_p: float = 1.0
    """Nucleus sampling: keep the most likely tokens up to this probability mass; 1 = all."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 = all (TRL's `top_k: null`)."""
    beta: float = 0.0
    """Weight of the k3 KL term to the reference (TRL's `beta`, default 0: no reference model is held)."""
    epsilon: float = 0.2
    """ε_low of the clipped ratio (TRL's `epsilon`)."""
    epsilon_high: float | None = None
    """ε_high (DAPO's clip-higher); null = `epsilon`."""
    delta: float | None = None
    """Upper bound of the unclipped ratio (INTELLECT-2's two-sided clipping); null = off."""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    """How token losses are averaged (`mmfsdp.model.rl`, TRL's definitions and default)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide the centred rewards by the std of the group, of the batch, or not at all (TRL's `scale_rewards`)."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """One ratio per token, or one per sequence (GSPO)."""
    num_iterations: int = 1
    """Optimizer steps on each generation batch (TRL's μ): a batch is generated every `num_iterations` steps and the steps between take no new prompts; > 1 keeps the log-probabilities of the weights that generated it as the old policy's (clipped importance ratios, docs/rl.md)."""
    mask_truncated_completions: bool = False
    """A completion cut at `max_completion_length` trains nothing (DAPO's overlong filtering)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: a group whose rewards are all equal (zero advantages) is dropped, and the step draws and generates more prompts from the loader until it has as many groups with varying rewards as its first round had prompts, or `max_resample_rounds` extra rounds were made; the groups are chosen in one global order, so every layout keeps the same ones (docs/rl.md, "Dynamic sampling")."""
    max_resample_rounds: int = 3
    """With `dynamic_sampling`: the most extra generation rounds of a step (each the loader's next step of prompts); after the last, the step trains on the varying groups found. 0 = drop the zero-std groups, never resample (ms-swift's `max_resample_times`; verl's `max_num_gen_batches` minus 1)."""
    reward_funcs: list[str | dict[str, Any]] = field(default_factory=lambda: ["accuracy"])
    """The reward functions: registered names (accuracy, format, iou, choice), `path/file.py:function`, or mappings `{name, weight, timeout_s, options}` (`mmfsdp.data.rewards`)."""
    reward_weights: list[float] | None = None
    """Weight of each reward function in the total (TRL's `reward_weights`); null = each function's own weight (1 unless its mapping says)."""
    reward_workers: int = 1
    """Processes that score completions (each call bounded by its function's `timeout_s`)."""
    log_completions_interval: int = 0
    """Every this many steps, rank 0 appends its prompts' completions with their rewards to `<output_dir>/completions.jsonl`; 0 = never."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The rollout engine."""

    vllm_importance_sampling_correction: bool = False
    """Weight each token's policy loss by a truncated (or masked) importance weight between the old policy and the rollout engine's sampling log-probabilities, correcting their mismatch (TRL's, on by default there; verl's TIS; `mmfsdp.model.rl.sampling_correction`, docs/rl.md ("The loss")). Either engine: with hf the weight is the sampled distribution's kept mass (media tokens suppressed, top-k / top-p)."""
    vllm_importance_sampling_mode: Literal[
        "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = "sequence_mask"
    """One weight per token or per sequence (exp of the sum of the sequence's log-ratios); out-of-bounds weights clipped to the bounds (truncate) or set to 0 (mask). TRL's names and default."""
    vllm_importance_sampling_clip_max: float | None = 3.0
    """C_max: the upper bound of the weight (TRL's; verl's `tis_imp_ratio_cap`); null = none."""
    vllm_importance_sampling_clip_min: float | None = None
    """C_min: the lower bound of the weight; null = none."""

    foreign_keys: ClassVar[dict[str, ForeignKey]] = {
        "vllm_importance_sampling_cap": Alias("training.grpo.vllm_importance_sampling_clip_max"),  # TRL's old name
        "dynamic_sample": Alias("training.grpo.dynamic_sampling"),  # ms-swift's
        "max_resample_times": Alias("training.grpo.max_resample_rounds"),
        # verl's `algorithm.filter_groups`, moved here by hand (docs/migration.md)
        "filter_groups.enable": Alias("training.grpo.dynamic_sampling"),
        "filter_groups.max_num_gen_batches": Translate(
            lambda value, section, path: {"training.grpo.max_resample_rounds": _extra_rounds(value, path)},
            "`training.grpo.max_resample_rounds`: the value minus 1 (verl counts the first generation batch too)",
        ),
        "filter_groups.metric": Ignored(
            "groups are kept by their total reward (verl's seq_reward; seq_final_reward is the same without a KL "
            "penalty in the reward)", allowed=("seq_reward", "seq_final_reward"),
        ),
    }

    def __post_init__(self) -> None:
        if self.num_generations < 2:
            raise ConfigError("num_generations", f"must be at least 2 (a group's advantages compare its completions), got {self.num_generations}")
        for key in ("max_completion_length", "num_iterations", "reward_workers"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be at least 1, got {getattr(self, key)}")
        if not self.temperature >= 0:
            raise ConfigError("temperature", f"must be >= 0 (0: greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError("top_k", f"must be >= 0 (0 keeps all tokens), got {self.top_k}")
        if self.beta < 0:
            raise ConfigError("beta", f"must be >= 0, got {self.beta}")
        if not 0 <= self.epsilon < 1:
            raise ConfigError("epsilon", f"must be in [0, 1), got {self.epsilon}")
        if self.epsilon_high is not None and self.epsilon_high < 0:
            raise ConfigError("epsilon_high", f"must be >= 0, got {self.epsilon_high}")
        if self.delta is not None and not self.delta > 1:
            raise ConfigError("delta", f"must be > 1 (an upper bound of the ratio), got {self.delta}")
        if not self.reward_funcs:
            raise ConfigError("reward_funcs", "name at least one reward function")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ConfigError(
                "reward_weights", f"{len(self.reward_weights)} weights for {len(self.reward_funcs)} reward functions"
            )
        if self.log_completions_interval < 0:
            raise ConfigError("log_completions_interval", f"must be >= 0, got {self.log_completions_interval}")
        if self.max_resample_rounds < 0:
            raise ConfigError("max_resample_rounds", f"must be >= 0 (0: drop zero-std groups, never resample), got "
                                                     f"{self.max_resample_rounds}")
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None and low < 0:
            raise ConfigError("vllm_importance_sampling_clip_min", f"must be >= 0, got {low}")
        if high is not None and not high > 0:
            raise ConfigError("vllm_importance_sampling_clip_max", f"must be > 0, got {high}")
        if low is not None and high is not None and low >= high:
            raise ConfigError("vllm_importance_sampling_clip_min",
                              f"{low} must be below vllm_importance_sampling_clip_max ({high})")
        if self.vllm_importance_sampling_mode.endswith("truncate") and low is None and high is None:
            raise ConfigError("vllm_importance_sampling_clip_max",
                              "a truncate mode needs a bound (clip_max or clip_min)")

    def correction_terms(self) -> dict[str, Any]:
        """The sampling correction's keywords of `mmfsdp.model.rl.policy_terms`; empty when it is off."""
        if not self.vllm_importance_sampling_correction:
            return {}
        return {"sampling_correction_mode": self.vllm_importance_sampling_mode,
                "sampling_clip_min": self.vllm_importance_sampling_clip_min,
                "sampling_clip_max": self.vllm_importance_sampling_clip_max}


def _extra_rounds(value: Any, path: str) -> int:
    """verl's `max_num_gen_batches` (every generation batch of a step, the first included) as our extra rounds."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(path, f"{value!r}: give the most generation batches of a step, at least 1 (verl's 0, "
                                "no limit, is not done: a step whose prompts never vary would never end)")
    return value - 1
