"""`training.stage: grpo` in the config: it reads prompts, TRL's keys load, every mistake names its key before any
process group, and what is not done yet is refused by name."""

from pathlib import Path

import pytest

from mmfsdp.config import ConfigError
from mmfsdp.train.config import load_config

ROOT = Path(__file__).resolve().parents[3]
QWEN = ROOT / "examples" / "qwen3vl-tiny" / "config.yaml"


def _cfg(*overrides):
    return load_config(str(QWEN), ["training.stage=grpo", *overrides])


def test_grpo_reads_prompts_with_trl_keys():
    cfg = _cfg("training.grpo.num_generations=4", "training.grpo.epsilon_high=0.28", "training.grpo.loss_type=grpo",
               "training.grpo.scale_rewards=batch", "training.grpo.importance_sampling_level=sequence",
               "training.grpo.reward_funcs=[accuracy, {name: format, weight: 0.5}]", "training.grpo.beta=0.04")
    g = cfg.training.grpo
    assert cfg.data.dataset_param.attr.prompt_only is True and g.rollout.engine == "hf"
    assert (g.num_generations, g.epsilon_high, g.loss_type, g.scale_rewards) == (4, 0.28, "grpo", "batch")
    assert g.reward_funcs == ["accuracy", {"name": "format", "weight": 0.5}]


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("training.grpo.num_generations=1", "training.grpo.num_generations"),
        ("training.grpo.temperature=-0.5", "training.grpo.temperature"),
        ("training.grpo.top_p=0", "training.grpo.top_p"),
        ("training.grpo.delta=0.5", "training.grpo.delta"),
        ("training.grpo.loss_type=ppo", "training.grpo.loss_type"),
        ("training.grpo.num_iterations=0", "training.grpo.num_iterations"),
        ("training.grpo.reward_funcs=[]", "training.grpo.reward_funcs"),
        ("training.grpo.reward_weights=[1.0, 2.0]", "training.grpo.reward_weights"),
        ("training.grpo.reward_funcs=[acuracy]", "training.grpo.reward_funcs[0].name"),
        ("training.grpo.reward_funcs=[{name: format, options: {pattern: '('}}]",
         "training.grpo.reward_funcs[0].options.pattern"),
        ("training.grpo.rollout.engine=sglang", "training.grpo.rollout.engine"),
        ("training.grpo.rollout.vllm.launch=false", "training.grpo.rollout.vllm.url"),
        ("training.grpo.rollout.vllm.request_timeout_s=0", "training.grpo.rollout.vllm.request_timeout_s"),
        ("training.grpo.rollout.sync_interval=2", "training.grpo.rollout.sync_interval"),  # the hf engine
        ("training.grpo.max_resample_rounds=-1", "training.grpo.max_resample_rounds"),
        ("training.grpo.filter_groups={max_num_gen_batches: 0}", "training.grpo.filter_groups.max_num_gen_batches"),
        ("training.grpo.filter_groups={metric: acc}", "training.grpo.filter_groups.metric"),
        ("training.grpo.vllm_importance_sampling_mode=token", "training.grpo.vllm_importance_sampling_mode"),
        ("training.grpo.vllm_importance_sampling_clip_max=0", "training.grpo.vllm_importance_sampling_clip_max"),
        ("training.grpo.vllm_importance_sampling_clip_min=3.0", "training.grpo.vllm_importance_sampling_clip_min"),
        ("training.grpo.vllm_importance_sampling_clip_min=-1", "training.grpo.vllm_importance_sampling_clip_min"),
        ("data.dataset_param.preprocess_parameters.train_on_prompt=true",
         "data.dataset_param.preprocess_parameters.train_on_prompt"),
    ],
)
def test_mistakes_name_their_key(override, key):
    with pytest.raises(ConfigError) as err:
        _cfg(override)
    assert err.value.key == key or str(err.value).startswith(key), str(err.value)


def test_the_vllm_engine_names_its_python_and_how_to_build_it(tmp_path):
    missing = tmp_path / "no-env" / "bin" / "python"
    with pytest.raises(ConfigError) as err:
        _cfg("training.grpo.rollout.engine=vllm", f"training.grpo.rollout.vllm.python={missing}")
    assert str(err.value).startswith("training.grpo.rollout.vllm.python") and "tools/vllm_env/setup.py" in str(err.value)
    python = tmp_path / "python"
    python.write_text("")
    v = _cfg("training.grpo.rollout.engine=vllm", f"training.grpo.rollout.vllm.python={python}").training.grpo.rollout
    assert (v.engine, v.vllm.python, v.vllm.launch) == ("vllm", str(python), True)
    url = _cfg("training.grpo.rollout.engine=vllm", "training.grpo.rollout.vllm.launch=false",
               "training.grpo.rollout.vllm.url=127.0.0.1:8000").training.grpo.rollout.vllm
    assert url.url == "127.0.0.1:8000"
    vllm = ("training.grpo.rollout.engine=vllm", f"training.grpo.rollout.vllm.python={python}")
    assert _cfg(*vllm, "training.grpo.rollout.sync_interval=4").training.grpo.rollout.sync_interval == 4
    with pytest.raises(ConfigError, match="training.grpo.rollout.sync_interval: must be >= 1"):
        _cfg(*vllm, "training.grpo.rollout.sync_interval=0")


@pytest.mark.parametrize("column", ["videos", "audios"])
def test_the_vllm_engine_refuses_prompts_with_videos_or_audio(tmp_path, column):
    """It sends a prompt's images only: a run whose data reads videos or audio is refused by key before it starts,
    naming the column; with the hf engine the same data loads."""
    python = tmp_path / "python"
    python.write_text("")
    vllm = ("training.grpo.rollout.engine=vllm", f"training.grpo.rollout.vllm.python={python}")
    with pytest.raises(ConfigError) as err:
        _cfg(*vllm, f"data.dataset_param.attr.{column}={column}")
    assert str(err.value).startswith("training.grpo.rollout.engine") and f"attr.{column}" in str(err.value)
    assert getattr(_cfg(f"data.dataset_param.attr.{column}={column}").data.dataset_param.attr, column) == column


def test_sampling_correction_keys_of_trl_and_verl():
    assert _cfg().training.grpo.correction_terms() == {}  # off by default (TRL's default is on)
    g = _cfg("training.grpo.vllm_importance_sampling_correction=true").training.grpo
    assert g.correction_terms() == {"sampling_correction_mode": "sequence_mask", "sampling_clip_min": None,
                                    "sampling_clip_max": 3.0}  # TRL's defaults
    g = _cfg("training.grpo.vllm_importance_sampling_correction=true",
             "training.grpo.vllm_importance_sampling_cap=2.5").training.grpo  # TRL's deprecated name
    assert g.vllm_importance_sampling_clip_max == 2.5
    g = _cfg("training.grpo.rollout.tis_cap=2.0").training.grpo  # verl's TIS
    assert g.correction_terms() == {"sampling_correction_mode": "token_truncate", "sampling_clip_min": None,
                                    "sampling_clip_max": 2.0}
    with pytest.raises(ConfigError) as err:  # truncation with no bound
        _cfg("training.grpo.vllm_importance_sampling_mode=token_truncate",
             "training.grpo.vllm_importance_sampling_clip_max=null")
    assert str(err.value).startswith("training.grpo.vllm_importance_sampling_clip_max"), str(err.value)


@pytest.mark.parametrize("override", ["parallel.ulysses_parallel_size=2", "parallel.ring_attention_size=2",
                                      "features.enable_chunk_loss=true"])
def test_context_parallel_and_chunk_loss_load(override):
    """Ulysses, Ring and chunk loss compose with the stage (tests/test_e2e_grpo.py: parity with one process)."""
    _cfg(override)


def test_several_iterations_per_generation_batch_load():
    """TRL's `num_iterations` (μ): a batch is generated every μ steps and trained on μ times (docs/rl.md)."""
    cfg = _cfg("training.grpo.num_iterations=3", "training.grpo.epsilon_high=0.28")
    assert cfg.training.grpo.num_iterations == 3


def test_dynamic_sampling_keys_of_trl_ms_swift_and_verl():
    """DAPO's dynamic sampling: ours, ms-swift's `dynamic_sample` / `max_resample_times` (extra rounds, as ours) and
    verl's `algorithm.filter_groups` moved under training.grpo (`max_num_gen_batches` counts the first round too)."""
    assert not _cfg().training.grpo.dynamic_sampling
    for overrides in (["training.grpo.dynamic_sampling=true", "training.grpo.max_resample_rounds=9"],
                      ["training.grpo.dynamic_sample=true", "training.grpo.max_resample_times=9"],
                      ["training.grpo.filter_groups={enable: true, max_num_gen_batches: 10, metric: seq_reward}"]):
        g = _cfg(*overrides).training.grpo
        assert (g.dynamic_sampling, g.max_resample_rounds) == (True, 9), overrides


def test_check_names_the_rounds_of_dynamic_sampling():
    """`--check`'s memory plan: the rollout cache is one round's, whatever the rounds (they run one at a time)."""
    from mmfsdp.train.memory import memory_plan

    plans = [memory_plan(_cfg(*extra), 2, 64 * 2**30) for extra in ([], ["training.grpo.dynamic_sampling=true"])]
    (plain,), (dynamic,) = ([t for t in plan.stage_terms if t.name == "kv_cache"] for plan in plans)
    assert dynamic.bytes == plain.bytes and "dynamic sampling: up to 4 rounds a step, one at a time" in dynamic.note
    assert "dynamic" not in plain.note


def test_prompts_and_pairs_exclude_each_other():
    with pytest.raises(ConfigError) as err:
        _cfg("data.dataset_param.attr.ranking=true")
    assert err.value.key == "data.dataset_param.attr.ranking"


def test_memory_plan_counts_a_frozen_reference_only_with_beta():
    from mmfsdp.train.memory import memory_plan

    lora = ["training.lora.enable=true", "training.lora.target_modules=[q_proj]"]
    runs = ([], ["training.grpo.beta=0.04"], ["training.grpo.beta=0.04", *lora])
    names = [[term.name for term in memory_plan(_cfg(*extra), 2, 64 * 2**30).stage_terms] for extra in runs]
    assert names == [["kv_cache"], ["kv_cache", "reference"], ["kv_cache"]]  # the rollout cache in every run


def test_a_continued_adapter_has_no_live_reference_with_it(tmp_path):
    with pytest.raises(ConfigError) as err:
        _cfg("training.grpo.beta=0.04", "training.lora.enable=true", "training.lora.target_modules=[q_proj]",
             f"training.lora.pretrained_lora_path={tmp_path}")
    assert err.value.key == "training.grpo.beta"


def test_the_held_out_split_is_read_with_its_answers(tmp_path):
    """The training split is prompts; the held-out accuracy reads the eval rows with their answers (a prompt trains
    no token, so its exact match counted nothing: every GRPO run reported accuracy 0)."""
    from mmfsdp.data import build_dataset, build_processor, prepare_dataset
    from mmfsdp.train.grpo import GRPOObjective

    cfg = _cfg(f"data.dataset_param.basic_parameters.dataset_dir={tmp_path / 'data'}",
               f"data.dataset_param.basic_parameters.cache_dir={tmp_path / 'cache'}",
               "data.dataset_param.synthetic.num_train=8", "data.dataset_param.synthetic.num_eval=4")
    data = GRPOObjective.eval_data(cfg.data)
    assert data.dataset_param.attr.prompt_only is False and cfg.data.dataset_param.attr.prompt_only is True
    prepare_dataset(cfg.data)
    processor = build_processor(cfg.data)
    prompts, rows = build_dataset(cfg.data, processor, split="eval"), build_dataset(data, processor, split="eval")
    assert len(prompts) == len(rows) == 4
    for i in range(4):
        trained = rows[i]["labels"][rows[i]["labels"] != -100]
        assert len(trained) > 0 and (prompts[i]["labels"] == -100).all()
        answer = processor.tokenizer.decode(trained, skip_special_tokens=True).strip()
        assert answer == prompts[i]["solution"]


def test_validation_loads():
    """`val_loss` and the held-out greedy reward every N steps (tests/test_e2e_grpo.py: parity with one process)."""
    assert _cfg("training.val_interval=2").training.val_interval == 2


@pytest.mark.parametrize("setting", ["training.micro_batch_tokens=256", "data.dataloader_param.balance=true"])
def test_token_budget_and_balance_load_but_not_with_bnpo(setting):
    """The budget packs the completions after generation, balance plans them over the ranks (tests/test_e2e_grpo.py:
    parity with the run without either); `bnpo`'s loss is a mean of micro-batch means, which they decide: refused by
    key, naming the setting. The loader hands whole prompts in order either way."""
    from mmfsdp.train.grpo import GRPOObjective

    cfg = _cfg(setting)
    data, budget = GRPOObjective.loader_plan(cfg)
    assert budget is None and data.dataloader_param.balance is False
    with pytest.raises(ConfigError) as err:
        _cfg(setting, "training.grpo.loss_type=bnpo")
    assert str(err.value).startswith("training.grpo.loss_type") and setting.split("=")[0] in str(err.value)
