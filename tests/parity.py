"""The end-to-end parity harness: cases as data, trained by the real `Trainer` on spawned gloo ranks.

A `Case` names a run: its world size, example config, dataset, overrides, the run it must match (`reference`, a
1-process run, or None for a reference itself) and the probes that record what else the test checks. A test
module lists its cases and calls `run_cases`, which

1. builds each dataset the cases name once per pytest session (`DATASETS`: the mixed image / text-only rows of
   `tests/mixed_data.py`, the variable-length rows, the video mix, the audio mix, the synthetic shapes) under the
   session's shared directory, with one tokenised cache per dataset and tokenizer;
2. takes every reference run it can from the session's cache: in memory, then on disk (the xdist workers of one
   session share the parent of their `basetemp`; a file lock per run makes a reference two files need run once);
3. spawns each world size once (`mmfsdp.parallel.testing.run_distributed`) and runs its cases in turn on every rank
   (`train_cases`): build `Trainer(load_config(config, overrides), "cpu")`, attach the probes, train, record.

A case's result: `layout` (world, dp, ring, ulysses, ep, replicate), `start` (the step it started at), `steps`
(loss, gradient norm, tokens per step, rank 0), `val` (validation loss by step), and for each probe its value on
every rank (`result[probe.name][rank]`). `assert_matches` checks a case against its reference: the same number of
steps, the same tokens exactly, loss and gradient norm within the case's relative tolerance.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import inspect
import io
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

from apprun import QWEN_ASSETS, TINY, close

STEPS = 5
"""Steps of a case unless its overrides say otherwise."""


# ---------------------------------------------------------------- datasets


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A dataset of the parity runs: how to write it into a directory, and the overrides that point a run at it."""

    build: Callable[[Path], Any]
    overrides: dict
    """Overrides of every case on it; `{dir}` is the dataset's directory."""


def _mixed(out: Path) -> None:
    from mixed_data import make_mixed_dataset

    make_mixed_dataset(out, num_train=40, num_eval=6, seed=5)


def _pairs(out: Path) -> None:
    from mixed_data import make_mixed_pairs_dataset

    make_mixed_pairs_dataset(out, num_train=40, num_eval=6, seed=5)


def _video(out: Path) -> None:
    from mixed_data import make_mixed_video_dataset

    make_mixed_video_dataset(out, num_train=30, num_eval=3, seed=7)


def _audio(out: Path) -> None:
    from mixed_data import make_mixed_audio_dataset

    make_mixed_audio_dataset(out, num_train=40, num_eval=4, seed=11)


def _varlen(min_images: int) -> Callable[[Path], None]:
    def build(out: Path) -> None:
        from mmfsdp.data.synthetic import make_varlen_dataset

        make_varlen_dataset(out, num_train=40, num_eval=0, seed=7, min_images=min_images)

    return build


def _shapes_overrides(out: str, num_train: int, num_eval: int) -> dict:
    return {
        "data.dataset_param.dataset_type": "synthetic_shapes",
        "data.dataset_param.basic_parameters.dataset_dir": out,
        "data.dataset_param.synthetic.num_train": num_train,
        "data.dataset_param.synthetic.num_eval": num_eval,
    }


def _shapes(num_train: int, num_eval: int) -> Callable[[Path], None]:
    def build(out: Path) -> None:
        from mmfsdp.data import prepare_dataset
        from mmfsdp.train.config import load_config

        overrides = {
            **_shapes_overrides(str(out), num_train, num_eval),
            "data.dataset_param.basic_parameters.cache_dir": out.with_name(f"{out.name}-raw"),
        }
        prepare_dataset(load_config(TINY, [f"{k}={v}" for k, v in overrides.items()]).data)

    return build


def _jsonl(**extra) -> dict:
    return {
        "data.dataset_param.dataset_type": "huggingface",
        "data.dataset_param.basic_parameters.dataset": "{dir}/train.jsonl",
        "data.dataset_param.basic_parameters.dataset_dir": "{dir}",
        **extra,
    }


DATASETS = {
    "mixed": Dataset(_mixed, _jsonl(**{"data.dataset_param.preprocess_parameters.cutoff_len": 160})),
    # preference pairs of the mixed rows (chosen = the row's answer, rejected = another of a different length)
    "pairs": Dataset(_pairs, _jsonl(**{
        "data.dataset_param.preprocess_parameters.cutoff_len": 160,
        "data.dataset_param.attr.ranking": "true",
        "training.stage": "dpo",
    })),
    "video": Dataset(_video, _jsonl(**{
        "data.dataset_param.attr.videos": "videos",
        "data.dataset_param.basic_parameters.shuffle": "false",  # rows in order: video, text, images, video, ...
        "data.dataset_param.preprocess_parameters.cutoff_len": 256,
        "data.dataset_param.preprocess_parameters.video_fps": 4.0,
        "data.dataset_param.preprocess_parameters.video_maxlen": 8,
    })),
    # the longest sample has 87 tokens; at this row budget padding before planning would change the rows
    "varlen": Dataset(_varlen(0), _jsonl(**{"data.dataset_param.preprocess_parameters.cutoff_len": 136})),
    "varlen_img": Dataset(_varlen(1), _jsonl(**{"data.dataset_param.preprocess_parameters.cutoff_len": 136})),
    # clip rows (1-2 clips of 40-160 mel frames, some with an image), shapes image rows and text-only rows
    # videos of 2 sampled frames (one temporal group: the Omni processor's 128+ merged patches) with their tracks
    "audio": Dataset(_audio, _jsonl(**{
        "data.dataset_param.attr.audios": "audios",
        "data.dataset_param.attr.videos": "videos",
        "data.dataset_param.preprocess_parameters.cutoff_len": 320,
        "data.dataset_param.preprocess_parameters.use_audio_in_video": "true",
        "data.dataset_param.preprocess_parameters.video_fps": 2.0,
        "data.dataset_param.preprocess_parameters.video_maxlen": 2,
    })),
    "shapes": Dataset(_shapes(32, 4), _shapes_overrides("{dir}", 32, 4)),
    "shapes64": Dataset(_shapes(64, 8), _shapes_overrides("{dir}", 64, 8)),
    "shapes256": Dataset(_shapes(256, 8), _shapes_overrides("{dir}", 256, 8)),
}
"""Every dataset of the parity runs, by the name a case gives (`mixed` is the rule: `tests/mixed_data.py`)."""


def session_dir(tmp_path_factory) -> Path:
    """The directory this pytest session's parity files share: the parent of the xdist workers' `basetemp`s, or the
    `basetemp` of a run without xdist."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "parity"


def locked(path: Path):
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(path) + ".lock")


def dataset_dir(shared: Path, name: str) -> Path:
    """The directory of dataset `name`, built on first use in this session (by whichever worker comes first)."""
    out = shared / "data" / name
    with locked(out):
        if not (out / ".done").is_file():
            DATASETS[name].build(out)
            (out / ".done").touch()
    return out


def write_tiny_hf(directory: Path) -> None:
    """A `save_pretrained` tiny Mistral3 of seed 3, written once per session (the HF directory that
    `test_e2e_text_only_parity.py`'s meta-init case and `test_e2e_lora.py` start from)."""
    import torch
    from transformers import AutoConfig, Mistral3ForConditionalGeneration

    with locked(directory):
        if not (directory / "config.json").is_file():
            partial = directory.with_suffix(".partial")
            with torch.random.fork_rng():
                torch.manual_seed(3)
                model = Mistral3ForConditionalGeneration(AutoConfig.from_pretrained(TINY.parent / "assets"))
            model.save_pretrained(partial)
            partial.rename(directory)


# ---------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    world: int
    config: Path
    overrides: dict = dataclasses.field(default_factory=dict)
    """On top of the dataset's and `STEPS`; `{tmp}` is the test module's directory, `{shared}` the session's."""
    reference: str | None = None
    """The 1-process case this one must match step by step; None for a reference (or a run checked otherwise)."""
    tol: float = 1e-5
    dataset: str = "mixed"
    probes: tuple = ()
    """`Probe` subclasses (module level, in `parity` or a test module) that record or set up more of the run."""
    layout: dict | None = None
    """What `result["layout"]` must hold (a subset of its keys), checked by `assert_matches`."""
    train: bool = True
    """False: build the trainer, attach the probes and close it (what a probe reads at the start of a run)."""


class Probe:
    """What a case records beside its steps, or changes around its trainer; one instance per case and rank.

    `__init__` runs before the trainer is built (patches, files), `attach` before training, `result` after it (a
    value `torch.save` can carry: numbers, strings, tensors and containers of them), `detach` last."""

    name = "probe"

    def __init__(self, case: dict, rank: int):
        self.case, self.rank = case, rank

    def attach(self, trainer) -> None:
        pass

    def result(self, trainer) -> Any:
        return None

    def detach(self) -> None:
        pass


def first_batch_and_weights(trainer) -> tuple[dict, dict]:
    """The trainer's first micro-batch (the loader is rewound) and a full copy of its initial weights."""
    state = trainer.loader.state_dict()
    batch = next(trainer.loader)
    trainer.loader.load_state_dict(state)
    return batch, {k: full_tensor(v) for k, v in trainer.model.state_dict().items()}


def full_tensor(tensor):
    """A detached full copy of a (possibly sharded) tensor."""
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


class HFFirstStep(Probe):
    """Loss and gradient norm of plain HF (`<class>(**inputs, labels=)`, sdpa) on the case's first batch, from its
    initial weights: the class and `config.json` are the case's model's (the part its family trains:
    `model_config`); `hf_config` edits the text config and `hf_kwargs` adds call arguments (a subclass sets them)."""

    name = "hf_step1"
    hf_config: dict = {}
    hf_kwargs: dict = {}

    def attach(self, trainer) -> None:
        self.first = first_batch_and_weights(trainer)
        self.model_class = type(trainer.model).__mro__
        self.assets = trainer.cfg.model.model_name_or_path
        self.model_id = trainer.cfg.model.model_id

    def result(self, trainer) -> tuple[float, float]:
        import torch
        import transformers

        from mmfsdp.model import get_model_entry, model_inputs

        batch, weights = self.first
        cls = next(c for c in self.model_class if c.__module__.startswith("transformers."))
        cls = getattr(transformers, cls.__name__)
        with torch.random.fork_rng():
            config = get_model_entry(self.model_id).model_config(transformers.AutoConfig.from_pretrained(self.assets))
            for key, value in self.hf_config.items():
                setattr(config.text_config, key, value)
            model = cls._from_config(config, attn_implementation="sdpa")
        model.load_state_dict(weights, strict=True)
        model.train()
        loss = model(**model_inputs(batch), labels=batch["labels"], **self.hf_kwargs).loss
        loss.backward()
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
        return float(loss), float(norm)


class SamplesPerRow(Probe):
    """How many samples each planned row of the first `STEPS` micro-batches holds (several when packing)."""

    name = "samples_per_row"

    def result(self, trainer) -> list[int]:
        steps = trainer.cfg.training.train_iters
        return [len(row) for key in trainer.loader._epoch_plan(0)[:steps] for row in key]


class PadSamplesAsRing2(Probe):
    """A 1-process packed reference that pads every packed sample to the multiple Ring 2 needs (4), as the CP run
    does, so that both pack the same rows."""

    name = "pad_as_ring2"

    def __init__(self, case: dict, rank: int):
        super().__init__(case, rank)
        import mmfsdp.train.trainer as trainer_module

        self.module, self.original = trainer_module, trainer_module.required_multiple
        trainer_module.required_multiple = lambda ring, ulysses: 4

    def detach(self) -> None:
        self.module.required_multiple = self.original


def _probe(path: str, name: str) -> type[Probe]:
    """A probe class by its file and name (test modules are imported under names a rank cannot import)."""
    if path == __file__:
        return globals()[name]
    module_name = f"_parity_probe_{hashlib.sha1(path.encode()).hexdigest()[:12]}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return getattr(sys.modules[module_name], name)


def train_cases(rank: int, world_size: int, cases: list[dict]) -> dict[str, dict]:
    """Each case on this rank, in turn (the rank function of `run_cases`)."""
    from mmfsdp.train.config import load_config
    from mmfsdp.train.trainer import Trainer

    results = {}
    for case in cases:
        probes = [_probe(*probe)(case, rank) for probe in case["probes"]]
        trainer = Trainer(load_config(case["config"], case["overrides"]), "cpu")
        for probe in probes:
            probe.attach(trainer)
        start = trainer.step
        if case["train"]:
            trainer.train()
        plan = trainer.plan
        results[case["name"]] = {
            "layout": {"world": world_size, "dp": plan.dp, "ring": plan.ring, "ulysses": plan.ulysses, "ep": plan.ep,
                       "replicate": plan.dp_replicate},
            "start": start,
            "iters": trainer.cfg.training.train_iters,
            "steps": [(r.loss, r.grad_norm, r.num_tokens) for r in trainer.history],
            "val": dict(trainer.val_losses),
            **{probe.name: probe.result(trainer) for probe in probes},
        }
        trainer.close()
        for probe in probes:
            probe.detach()
    return results


def resolve(case: Case, tmp: Path, shared: Path) -> dict:
    """What a rank needs of `case`: its overrides as `key=value` items, paths filled in."""
    data = DATASETS[case.dataset]
    data_dir = dataset_dir(shared, case.dataset)
    family = case.config.parent.name
    items = {
        **data.overrides,
        "data.dataset_param.basic_parameters.cache_dir": str(shared / "cache" / f"{case.dataset}-{family}"),
        "training.train_iters": STEPS,
        "training.lr_warmup_ratio": 0.0,
        "training.log_interval": 100,
        "training.output_dir": str(tmp / "out" / case.name),
        **case.overrides,
    }
    fill = {"dir": data_dir, "tmp": tmp, "shared": shared}
    overrides = [f"{key}={str(value).format(**fill)}" for key, value in items.items()]
    probes = [(inspect.getfile(probe), probe.__name__) for probe in case.probes]
    return {
        "name": case.name, "config": str(case.config), "overrides": overrides, "probes": probes, "train": case.train,
    }


def _key(case: Case, resolved: dict) -> str:
    """What a run's result depends on: world size, config, overrides (but where it writes its logs) and probes."""
    overrides = sorted(item for item in resolved["overrides"] if not item.startswith("training.output_dir="))
    probes = sorted(f"{Path(path).name}:{name}" for path, name in resolved["probes"])
    text = json.dumps([case.world, resolved["config"], overrides, probes, case.train])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


_CACHE: dict[str, dict] = {}
"""Reference results of this process, by `_key`."""


def _load(path: Path) -> dict | None:
    import torch

    return torch.load(io.BytesIO(path.read_bytes()), weights_only=True) if path.is_file() else None


def _save(path: Path, value: dict) -> None:
    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    partial = path.with_suffix(".partial")
    partial.write_bytes(buffer.getvalue())
    partial.replace(path)


def run_cases(cases: list[Case], tmp: Path, shared: Path, timeout: float = 900) -> dict[str, dict]:
    """Every case's result by name; each world size is spawned once (smallest first), for the cases of that size
    that no earlier run of this session computed. The reference runs (those a case names) are kept for the session:
    in this process, and on disk under `shared` for the other workers."""
    from contextlib import ExitStack

    from mmfsdp.parallel.testing import run_distributed

    names = [case.name for case in cases]
    assert len(set(names)) == len(names), names
    referenced = {case.reference for case in cases if case.reference is not None}
    assert referenced <= set(names), referenced - set(names)
    resolved = {case.name: resolve(case, tmp, shared) for case in cases}
    keys = {case.name: _key(case, resolved[case.name]) for case in cases if case.name in referenced}
    out: dict[str, dict] = {}
    for world in sorted({case.world for case in cases}):
        group = [case for case in cases if case.world == world]
        with ExitStack() as locks:
            pending = []
            for case in sorted(group, key=lambda c: keys.get(c.name, "")):
                key = keys.get(case.name)
                if key is not None and key not in _CACHE:
                    locks.enter_context(locked(shared / "runs" / key))
                    stored = _load(shared / "runs" / f"{key}.pt")
                    if stored is not None:
                        _CACHE[key] = stored
                if key is None or key not in _CACHE:
                    pending.append(case)
            pending.sort(key=lambda case: names.index(case.name))
            if pending:
                per_rank = run_distributed(train_cases, world, [resolved[c.name] for c in pending], timeout=timeout)
                for case in pending:
                    result = {**per_rank[0][case.name]}
                    for field in per_rank[0][case.name]:
                        if field not in ("layout", "start", "iters", "steps", "val"):
                            result[field] = [values[case.name][field] for values in per_rank]
                    if case.name in keys:
                        _CACHE[keys[case.name]] = result
                        _save(shared / "runs" / f"{keys[case.name]}.pt", result)
                    out[case.name] = result
        for case in group:
            if case.name in keys:
                out[case.name] = _CACHE[keys[case.name]]
    return out


# ---------------------------------------------------------------- checks


def assert_steps(name: str, got: list, expected: list, tol: float = 1e-5, what: str = "") -> None:
    """Step by step: the same tokens, loss and gradient norm within `tol` (relative to `expected`)."""
    assert len(got) == len(expected), f"{name}: {len(got)} steps vs {len(expected)} {what}"
    for step, ((loss, norm, tokens), (ref_loss, ref_norm, ref_tokens)) in enumerate(zip(got, expected), 1):
        assert tokens == ref_tokens, f"{name}, step {step}: {tokens} tokens vs {ref_tokens} {what}"
        assert close(loss, ref_loss, tol, f"{name} step {step} loss"), f"{name}, step {step}: loss {loss} vs {ref_loss} {what}"
        assert close(norm, ref_norm, tol, f"{name} step {step} grad norm"), f"{name}, step {step}: grad norm {norm} vs {ref_norm} {what}"


def assert_first_step_matches_hf(result: dict, extra_loss: float = 0.0, what: str = "loss") -> None:
    """A 1-process run's first step (its `HFFirstStep` probe's value beside it) equals plain HF's: the loss (plus
    `extra_loss`, e.g. the router's weighted aux loss, which HF's loss includes) and the gradient norm."""
    loss, norm, _ = result["steps"][0]
    hf_loss, hf_norm = result["hf_step1"][0]
    assert close(loss + extra_loss, hf_loss, what=f"step 1 {what} vs HF"), (
        f"step 1: trainer {what} {loss} + {extra_loss} vs HF {hf_loss}")
    assert close(norm, hf_norm, what="step 1 grad norm vs HF"), f"step 1: trainer grad norm {norm} vs HF {hf_norm}"


def assert_matches(results: dict, case: Case, reference_world: int = 1) -> None:
    """`case` ran as its layout says and gives its reference's steps (and validation losses, where both validated);
    the reference ran on `reference_world` processes."""
    got, expected = results[case.name], results[case.reference]
    if case.layout is not None:
        layout = {key: got["layout"][key] for key in case.layout}
        assert layout == case.layout, f"{case.name} ran as {got['layout']}"
    assert got["layout"]["world"] == case.world and expected["layout"]["world"] == reference_world
    assert len(got["steps"]) == got["iters"] >= 3, f"{case.name}: {len(got['steps'])} steps of {got['iters']}"
    assert_steps(case.name, got["steps"], expected["steps"], case.tol, f"({case.reference})")
    if got["val"] and expected["val"]:
        assert got["val"].keys() == expected["val"].keys()
        for step, value in got["val"].items():
            reference = expected["val"][step]
            assert close(value, reference, case.tol, f"{case.name} val loss at {step}"), f"{case.name}: val loss at {step} {value} vs {reference}"


def learns(result: dict) -> bool:
    """The run's last loss is below its first."""
    return result["steps"][-1][0] < result["steps"][0][0]


QWEN_SETTINGS = {
    "model.model_name_or_path": str(QWEN_ASSETS),
    "data.dataset_param.preprocess_parameters.model_name_or_path": str(QWEN_ASSETS),
}
"""The tiny Qwen3-VL's weights and tokenizer (its example's paths are relative to the repository)."""
