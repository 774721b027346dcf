"""Dataset types: the registry of data sources, keyed by `data.dataset_param.dataset_type`.

A `DatasetType` makes its files exist (`prepare`, run once before training, e.g. generating synthetic data) and
lists the JSON/JSONL files of a split (`files`). `huggingface` reads the user's files (`basic_parameters.dataset`,
`eval_dataset`); `synthetic_shapes` and `synthetic_shapes_pairs` generate theirs (`mmfsdp.data.synthetic`), `synthetic_beeps`
its own (`mmfsdp.data.synthetic_audio`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mmfsdp.config import ConfigError, Registry

from mmfsdp.data.config import DataConfig
from mmfsdp.data.synthetic import prepare_synthetic, prepare_synthetic_pairs, synthetic_files, synthetic_pair_files
from mmfsdp.data.synthetic_audio import prepare_beeps

__all__ = [
    "DatasetType",
    "check_dataset",
    "check_split",
    "dataset_files",
    "dataset_type_names",
    "get_dataset_type",
    "has_eval_data",
    "register_dataset_type",
]

_KEY = "data.dataset_param"


@dataclass(frozen=True, slots=True)
class DatasetType:
    """A dataset source: `prepare(data_cfg)` makes its files exist, `files(data_cfg, split)` lists them."""

    name: str
    prepare: Callable[[DataConfig], None]
    files: Callable[[DataConfig, str], list[Path]]


_DATASET_TYPES: Registry[DatasetType] = Registry("dataset type", f"{_KEY}.dataset_type")


def register_dataset_type(dataset_type: DatasetType) -> DatasetType:
    return _DATASET_TYPES.register(dataset_type.name, dataset_type)


def dataset_type_names() -> list[str]:
    return _DATASET_TYPES.names()


def get_dataset_type(data_cfg: DataConfig) -> DatasetType:
    """The registered type `dataset_param.dataset_type` names (a `ConfigError` naming the closest one)."""
    return _DATASET_TYPES.get(data_cfg.dataset_param.dataset_type)


def check_split(split: str) -> None:
    """A `ValueError` unless `split` is "train" or "eval"."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")


def _json_files(data_cfg: DataConfig, split: str) -> list[Path]:
    basic = data_cfg.dataset_param.basic_parameters
    key = "dataset" if split == "train" else "eval_dataset"
    value = basic.dataset if split == "train" else basic.eval_dataset
    if not value:
        what = "training data" if split == "train" else "evaluation data (or turn evaluation off)"
        raise ConfigError(f"{_KEY}.basic_parameters.{key}", f"is not set; give the JSON/JSONL file(s) of the {what}")
    files = []
    for item in (p.strip() for p in value.split(",")):
        if not item:
            continue
        path = Path(item).expanduser()
        if not path.is_file() and not path.is_absolute() and (Path(basic.dataset_dir).expanduser() / path).is_file():
            path = Path(basic.dataset_dir).expanduser() / path
        if not path.is_file():
            raise ConfigError(f"{_KEY}.basic_parameters.{key}", f"{item!r} is not a file (looked for it as given and under dataset_dir {basic.dataset_dir!r}); give the path of an existing JSON/JSONL file")
        if path.suffix not in (".json", ".jsonl"):
            raise ConfigError(f"{_KEY}.basic_parameters.{key}", f"{item!r} must be a .json file (a list of rows) or a .jsonl file (one row per line); convert it to one of those")
        files.append(path.resolve())
    return files


def _nothing_to_prepare(data_cfg: DataConfig) -> None:
    """JSON/JSONL files are the user's; there is nothing to generate."""


register_dataset_type(DatasetType("huggingface", _nothing_to_prepare, _json_files))
register_dataset_type(DatasetType("synthetic_shapes", prepare_synthetic, synthetic_files))
register_dataset_type(DatasetType("synthetic_shapes_pairs", prepare_synthetic_pairs, synthetic_pair_files))
register_dataset_type(DatasetType("synthetic_beeps", prepare_beeps, synthetic_files))


def dataset_files(data_cfg: DataConfig, split: str = "train") -> list[Path]:
    """The JSON/JSONL files of `split` ("train" or "eval")."""
    check_split(split)
    return get_dataset_type(data_cfg).files(data_cfg, split)


def has_eval_data(data_cfg: DataConfig) -> bool:
    """Whether the config names evaluation data (generated datasets always have an eval split)."""
    return data_cfg.dataset_param.dataset_type != "huggingface" or bool(data_cfg.dataset_param.basic_parameters.eval_dataset)


def check_dataset(data_cfg: DataConfig) -> None:
    """Checks that read nothing but the file system, for `--check` and before any rank starts.

    The dataset type must be registered (`ConfigError` with the closest name); the files
    of a type that generates nothing (JSON/JSONL) must exist and be .json/.jsonl.
    """
    if get_dataset_type(data_cfg).prepare is _nothing_to_prepare:
        for split in ("train", "eval") if has_eval_data(data_cfg) else ("train",):
            dataset_files(data_cfg, split)
