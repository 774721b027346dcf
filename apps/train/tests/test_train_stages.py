"""The stage registry and what each stage's objective class answers for the other components: the names
`training.stage` accepts, the one reference rule (run, memory plan, config check), checkpoint metadata, and the
held-out reward metrics the evaluator adds for DPO."""

from types import SimpleNamespace
from typing import get_args, get_type_hints

import pytest
import torch
import torch.distributed as dist

from mmfsdp.config import ConfigError
from mmfsdp.model.loss import IGNORE_INDEX
from mmfsdp.train.config import Config, TrainingConfig
from mmfsdp.train.evaluate import Evaluator
from mmfsdp.train.dpo import PreferenceObjective
from mmfsdp.train.objective import Objective, SFTObjective
from mmfsdp.train.stages import STAGE_NAMES, STAGES, objective_class


def test_training_stage_accepts_the_registered_names():
    assert get_args(get_type_hints(TrainingConfig)["stage"]) == STAGE_NAMES == ("sft", "dpo", "grpo")
    assert TrainingConfig().stage == STAGE_NAMES[0]
    for name, cls in STAGES.items():
        assert issubclass(cls, Objective) and cls.stage == name and objective_class(name) is cls
    with pytest.raises(ConfigError) as err:
        objective_class("ppo")
    assert err.value.key == "training.stage" and "'sft', 'dpo', 'grpo'" in str(err.value)


def _training(precompute: bool, lora: bool, pretrained: str | None = None):
    return SimpleNamespace(dpo=SimpleNamespace(precompute_ref_logps=precompute),
                           lora=SimpleNamespace(enable=lora, pretrained_lora_path=pretrained))


@pytest.mark.parametrize(
    ("precompute", "lora", "kind"),
    [(True, True, "precomputed"), (True, False, "precomputed"), (False, True, "lora"), (False, False, "frozen")],
)
def test_one_rule_picks_the_reference_for_the_run_the_memory_plan_and_the_checks(precompute, lora, kind):
    t = _training(precompute, lora)
    assert PreferenceObjective.reference_kind(t) == kind
    model = torch.nn.Linear(4, 3, bias=False)  # 12 parameters
    cfg = SimpleNamespace(training=t, model=SimpleNamespace(dtype="bf16"))
    terms = PreferenceObjective.memory_terms(cfg, model, shard_size=2)
    assert [(term.name, term.bytes) for term in terms] == ([("reference", 12 * 2 // 2)] if kind == "frozen" else [])
    assert SFTObjective.memory_terms(cfg, model, shard_size=2) == []
    trained_adapter = SimpleNamespace(training=_training(precompute, lora, pretrained="adapter/"))
    if kind == "lora":
        with pytest.raises(ConfigError) as err:
            PreferenceObjective.check_config(trained_adapter)
        assert err.value.key == "training.dpo.precompute_ref_logps"
    else:
        PreferenceObjective.check_config(trained_adapter)


def test_the_memory_plan_may_suggest_the_precomputed_reference_for_a_frozen_copy_only():
    frozen = Config(training=TrainingConfig(stage="dpo"))
    assert frozen.data.dataset_param.attr.ranking is True  # `configure`: a DPO run reads pairs
    ((setting, changed),) = PreferenceObjective.memory_savings(frozen)
    assert setting == "training.dpo.precompute_ref_logps: true" and changed.training.dpo.precompute_ref_logps
    assert PreferenceObjective.memory_savings(changed) == [] and SFTObjective.memory_savings(Config()) == []


def test_a_checkpoint_records_its_stage_and_only_its_stage_resumes_it():
    assert SFTObjective.checkpoint_metadata() == {"stage": "sft"}
    assert PreferenceObjective.checkpoint_metadata() == {"stage": "dpo"}
    assert SFTObjective.resumes(None) and SFTObjective.resumes({})  # from before stages were recorded: sft
    assert not PreferenceObjective.resumes({}) and PreferenceObjective.resumes({"stage": "dpo", "lora": {}})
    assert not SFTObjective.resumes(PreferenceObjective.checkpoint_metadata())
    assert Objective.recorded_stage({"stage": "dpo"}) == "dpo" and Objective.recorded_stage(None) == "sft"


@pytest.fixture
def one_process_group(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Logits(torch.nn.Module):
    """A model whose forward returns fixed logits."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = logits

    def forward(self, **inputs):
        return SimpleNamespace(logits=self.logits)


class _FixedReference:
    def __init__(self, logps: torch.Tensor):
        self.values = logps
        self.splits = []

    def for_split(self, split):
        self.splits.append(split)
        return self

    def logps(self, inputs, seq, pair_index):
        assert seq["num_sequences"] == 2 * pair_index.numel()
        return self.values


def test_the_evaluator_adds_the_dpo_reward_metrics(one_process_group, tmp_path):
    """Two pairs (padded rows chosen_0, rejected_0, chosen_1, rejected_1): reward accuracy and mean margin equal
    β · ((log π_c − log π_ref,c) − (log π_r − log π_ref,r)) computed by hand."""
    generator = torch.Generator().manual_seed(3)
    num_seq, length, vocab, beta = 4, 6, 11, 0.3
    labels = torch.full((num_seq, length), IGNORE_INDEX)
    for row, start in enumerate((2, 3, 1, 4)):
        labels[row, start:] = torch.randint(0, vocab, (length - start,), generator=generator)
    logits = torch.randn(num_seq, length, vocab, generator=generator)
    ref_logps = torch.tensor([-20.0, -14.0, -18.0, -22.5])
    batch = {"input_ids": torch.zeros(num_seq, length, dtype=torch.long), "labels": labels,
             "attention_mask": torch.ones(num_seq, length, dtype=torch.long), "pair_index": torch.tensor([0, 1])}

    cfg = SimpleNamespace(
        training=SimpleNamespace(dpo=SimpleNamespace(beta=beta, loss_type="sigmoid", label_smoothing=0.0,
                                                     rpo_alpha=0.0)),
        data=SimpleNamespace(dataset_param=SimpleNamespace(basic_parameters=SimpleNamespace(dataset_dir=str(tmp_path)))),
    )
    dims = SimpleNamespace(dp_group=None, dp_size=1, cp_size=1)
    reference = _FixedReference(ref_logps)
    objective = PreferenceObjective(cfg, dims, torch.device("cpu"), reference)
    evaluator = Evaluator(cfg, model=_Logits(logits), processor=None, dims=dims, device=torch.device("cpu"),
                          pad_multiple=1, output_dir=tmp_path, rank=0)
    evaluator.dataset = SimpleNamespace(is_preference=True)
    evaluator.batches = lambda: iter([(batch, True), (batch, False)])  # the second: a repeat, not counted
    evaluator.objective_metrics = objective.eval_metrics()
    result = evaluator.accuracy(step=7)

    targets = torch.cat([labels[:, 1:], torch.full((num_seq, 1), IGNORE_INDEX)], dim=1)
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    trained = targets != IGNORE_INDEX
    logps = (log_probs.gather(-1, targets.clamp(min=0)[..., None])[..., 0] * trained).sum(dim=1)
    ratios = logps - ref_logps.double()
    margins = beta * (ratios[0::2] - ratios[1::2])
    assert result["num_pairs"] == 2 and result["num_samples"] == 2 and result["step"] == 7
    assert result["reward_accuracy"] == float((margins > 0).double().mean())
    assert result["reward_margin"] == pytest.approx(float(margins.mean()), rel=1e-6)
    assert set(reference.splits) == {"eval"}

    evaluator.objective_metrics = None  # a stage without metrics of its own (SFT)
    assert set(evaluator.accuracy(step=7)) == {"accuracy", "chance", "num_samples", "num_correct", "step"}


@pytest.mark.parametrize("example", ["qwen3vl-tiny", "qwen3_5-tiny"])
def test_the_grpo_plan_counts_every_completion_and_the_rollout_cache(example):
    """GRPO's micro-batch holds `num_generations` sequences of prompt + completion per prompt; the hf engine's KV
    cache (every prompt of the rank's step, each row per generation) is alive before the training forwards only,
    so the plan counts the larger of it and the activations."""
    from transformers import AutoConfig

    from mmfsdp.train.config import load_config
    from mmfsdp.train.grpo import GRPOObjective
    from mmfsdp.train.memory import memory_plan, micro_batch_tokens

    root = __file__.rsplit("/apps/", 1)[0]
    items = ["training.stage=grpo", "training.micro_batch_size=2", "training.gradient_accumulation_steps=3",
             "training.grpo.num_generations=8", "training.grpo.max_completion_length=40"]
    cfg = load_config(f"{root}/examples/{example}/config.yaml", items)
    cutoff = cfg.data.dataset_param.preprocess_parameters.cutoff_len
    assert GRPOObjective.sequence_shape(cfg) == (8, cutoff + 40)
    assert micro_batch_tokens(cfg) == 2 * 8 * (cutoff + 40)

    text = AutoConfig.from_pretrained(cfg.model.model_name_or_path).text_config
    kinds = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    rows, tokens = 2 * 3 * 8, cutoff + 40
    expected = rows * tokens * 2 * kinds.count("full_attention") * text.num_key_value_heads * head_dim * 4  # fp32
    if "linear_attention" in kinds:
        key_dim, value_dim = (text.linear_num_key_heads * text.linear_key_head_dim,
                              text.linear_num_value_heads * text.linear_value_head_dim)
        per_row = (text.linear_num_value_heads * text.linear_key_head_dim * text.linear_value_head_dim * 4
                   + (2 * key_dim + value_dim) * text.linear_conv_kernel_dim * 4)
        expected += rows * kinds.count("linear_attention") * per_row
    plan = memory_plan(cfg, 2)
    (cache,) = [term for term in plan.stage_terms if term.name == "kv_cache"]
    assert cache.phase == "generation" and cache.bytes == expected
    assert plan.generation == expected and plan.before_activations == plan.parameters + plan.gradients + plan.optimizer_states
    assert plan.total == plan.before_activations + plan.compute_copies + max(plan.activations, expected)
