"""HF safetensors <-> DCP conversion, one tensor (or one output shard) in memory at a time — the library behind
`mm-convert` (its command line: `mmfsdp.ckpt.cli`; LoRA exports: `mmfsdp.ckpt.lora`).

- `hf_to_dcp`: a HF directory -> `DCP/release/` + the tracker (= `release`), through one `dcp.save` of meta
  tensors whose planner reads (and combines) each model tensor's file tensors only when DCP writes it.
- `dcp_to_hf`: a training checkpoint or release -> HF safetensors shards in the naming and layout of
  `model_assets_dir`, validated against its headers and `config.json`, its non-weight files copied and completed
  for servers (`export_config`: `architectures`, the recorded stop tokens), and the assets' tensors the model does
  not train (the adapter's `passthrough_hf_prefixes`) copied into shards of their own.
- `export_checkpoint_hf`: `<save>/iter_N` -> `<save>/hf/iter_N` (`training.save_format: hf`).

Names and layouts are the family's state-dict adapter's (`adapters`). Outputs are written beside their final
place and published with `layout.publish_dir` (`outputs`); an output that overlaps an input is refused. The
steps and their memory bounds: docs/checkpoints.md, "Conversion: `mm-convert`".
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from tqdm import tqdm

from mmfsdp.ckpt.adapters import (
    IDENTITY,
    PlannedToHF,
    StateDictAdapter,
    plan_from_hf,
    plan_to_hf,
    resolve_state_dict_adapter,
)
from mmfsdp.ckpt.state_files import FORMAT_NAME, FORMAT_VERSION, INFO_FILENAME, MODEL_PREFIX, read_checkpoint_info
from mmfsdp.ckpt.dcp_io import (
    LazySavePlanner,
    SafeFileSystemReader,
    SafeLoadPlanner,
    quiet_single_process,
    read_dcp_metadata,
    stored_tensor_file,
    tensor_entries,
)
from mmfsdp.ckpt.errors import CheckpointError
from mmfsdp.ckpt.export_config import write_export_config
from mmfsdp.ckpt.hf import (
    INDEX_FILENAME,
    SafetensorsDir,
    SafetensorsWriter,
    TensorInfo,
    parse_size,
    plan_shards,
    read_config,
    shard_filename,
)
from mmfsdp.ckpt.layout import (
    RELEASE, _iteration_from_dirname, checkpoint_near, iteration_dirname, list_iterations, make_tmp_dir_name,
    publish_dir, resolve_checkpoint, write_tracker,
)
from mmfsdp.ckpt.outputs import (
    check_output_dir, copy_model_assets, discard_output_dir, prepare_output_dir, publish_output_dir, refuse_overlap,
)

__all__ = ["AUTO", "HF_EXPORT_DIRNAME", "export_checkpoint_hf", "hf_to_dcp", "dcp_to_hf"]

HF_EXPORT_DIRNAME = "hf"
"""Training checkpoints exported as HF directories go to `<save>/hf/iter_NNNNNNN` (`export_checkpoint_hf`)."""

AUTO = "auto"
"""The adapter argument that picks the state-dict adapter from `config.json`'s `model_type`."""


def _progress(total: int, desc: str, show: bool | None) -> tqdm:
    enabled = sys.stderr.isatty() if show is None else show
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not enabled)


@contextlib.contextmanager
def _without_zip_crc32() -> Iterator[None]:
    """Skip torch.save's CRC32 of each zip record, its slowest part; torch.load does not check it.

    The switch exists from torch 2.6 (`torch.utils.serialization.config`); elsewhere this does nothing.
    """
    try:
        from torch.utils.serialization import config  # noqa: PLC0415
    except ImportError:
        yield
        return
    save_config = getattr(config, "save", None)
    if save_config is None or not hasattr(save_config, "compute_crc32"):
        yield
        return
    previous = save_config.compute_crc32
    save_config.compute_crc32 = False
    try:
        yield
    finally:
        save_config.compute_crc32 = previous


def _adapter(adapter: StateDictAdapter | str | None, config: dict | None) -> StateDictAdapter:
    return resolve_state_dict_adapter(None if adapter == AUTO else adapter, config)


def hf_to_dcp(
    hf_dir: str | os.PathLike,
    dcp_dir: str | os.PathLike,
    *,
    force: bool = False,
    adapter: StateDictAdapter | str | None = None,
    progress: bool | None = None,
) -> Path:
    """Convert a HF safetensors directory into `dcp_dir/release/` + tracker; return the release path.

    `adapter` is a `StateDictAdapter`, a model id, or None (or "auto") for the
    one registered for `config.json`'s `model_type`. With `force`, an existing
    `release/` and tracker in `dcp_dir` are replaced; other files there are kept.
    """
    weights = SafetensorsDir(hf_dir)
    refuse_overlap(dcp_dir, "--dcp_dir", [(hf_dir, "--hf_dir")])
    plans = plan_from_hf(_adapter(adapter, weights.config),
                         {key: (info.shape, info.dtype) for key, info in weights.tensors.items()})
    dcp_dir = Path(dcp_dir)
    check_output_dir(dcp_dir, force, "--dcp_dir")
    dcp_dir.mkdir(parents=True, exist_ok=True)
    tmp_dir = dcp_dir / make_tmp_dir_name(RELEASE, uuid.uuid4().hex[:8])

    state = {"model": {name: torch.empty(plan.shape, dtype=plan.dtype, device="meta") for name, plan in plans.items()}}
    total = sum(info.nbytes for info in weights.tensors.values())
    with _progress(total, "hf_to_dcp", progress) as bar:
        def load(fqn: str) -> torch.Tensor:
            plan = plans[fqn[len(MODEL_PREFIX):]]
            tensor = plan.build(weights.read)
            bar.update(sum(weights.tensors[key].nbytes for key in plan.source.hf_keys))
            return tensor

        try:
            # One file per tensor, so DCP's writer holds one tensor at a time. No fsync per file
            # (like cp); the directory rename and the tracker are still atomic.
            writer = FileSystemWriter(tmp_dir, single_file_per_rank=False, sync_files=False)
            with quiet_single_process(), _without_zip_crc32():
                dcp.save(state, storage_writer=writer, planner=LazySavePlanner(load), no_dist=True)
            info = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "iteration": RELEASE, "world_size": None,
                    "has_optimizer": False, "source": os.fspath(Path(hf_dir).resolve())}
            (tmp_dir / INFO_FILENAME).write_text(json.dumps(info, indent=1))
        except BaseException:
            discard_output_dir(tmp_dir)
            raise
    release_dir = dcp_dir / RELEASE
    publish_dir(tmp_dir, release_dir)
    write_tracker(dcp_dir, RELEASE)
    return release_dir


def _plan_export(specs: dict[str, tuple[tuple[int, ...], torch.dtype]], adapter: StateDictAdapter,
                 asset_shapes: dict[str, tuple[int, ...]] | None) -> dict[str, PlannedToHF]:
    """Model key -> HF tensors, in the adapter's naming and layout or, when only that matches the assets' own
    weights (keys and shapes), in `state_dict()` naming and layout (assets saved in the new layout)."""

    def fits(plans: dict[str, PlannedToHF]) -> bool:
        written = {key: spec[0] for plan in plans.values() for key, spec in plan.specs.items()}
        return all(tuple(written.get(key, ())) == tuple(shape) for key, shape in asset_shapes.items())

    plans = plan_to_hf(adapter, specs)
    if asset_shapes is None or adapter is IDENTITY or fits(plans):
        return plans
    identity = plan_to_hf(IDENTITY, specs)
    return identity if fits(identity) else plans


def _tied(config: dict) -> bool:
    return bool(config.get("tie_word_embeddings", False))


_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _check_against_config(shapes: dict[str, tuple[int, ...]], config: dict, assets: Path) -> None:
    """Checks that need only config.json: embedding/lm_head shapes and layer indices."""
    text = config.get("text_config") or config
    vision = config.get("vision_config")
    problems = []
    vocab, hidden = text.get("vocab_size"), text.get("hidden_size")
    for name, shape in shapes.items():
        if vocab and hidden and (name.endswith("embed_tokens.weight") or name.endswith("lm_head.weight")):
            if shape != (vocab, hidden):
                problems.append(f"{name}: shape {shape}, config says ({vocab}, {hidden}) (vocab_size, hidden_size)")
        match = _LAYER_RE.search(name)
        if match:
            if "vision" in name and vision:
                section, what = vision, "vision_config.num_hidden_layers"
            else:
                section, what = text, "text_config.num_hidden_layers" if "text_config" in config else "num_hidden_layers"
            num_layers = section.get("num_hidden_layers")
            if num_layers is not None and int(match.group(1)) >= num_layers:
                problems.append(f"{name}: layer {match.group(1)} but {what} = {num_layers}")
    if problems:
        raise CheckpointError(
            f"checkpoint does not match {assets / 'config.json'}:\n  " + "\n  ".join(problems[:10])
            + ("\n  ..." if len(problems) > 10 else "")
            + "\nPass the --model_assets_dir of the model this checkpoint was trained from."
        )


def _check_against_assets(shapes: dict[str, tuple[int, ...]], assets_weights: SafetensorsDir,
                          expected: dict[str, tuple[int, ...]]) -> None:
    missing = [key for key in expected if key not in shapes]
    unexpected = [key for key in shapes if key not in expected]
    mismatched = [f"{key}: checkpoint {shapes[key]}, assets {expected[key]}"
                  for key in shapes if key in expected and shapes[key] != expected[key]]
    if missing or unexpected or mismatched:
        lines = []
        if missing:
            lines.append(f"{len(missing)} tensors of the assets are not in the checkpoint: {', '.join(missing[:10])}")
        if unexpected:
            lines.append(f"{len(unexpected)} checkpoint tensors are not in the assets: {', '.join(unexpected[:10])}")
        if mismatched:
            lines.append(f"{len(mismatched)} shape mismatches: {', '.join(mismatched[:10])}")
        raise CheckpointError(
            f"checkpoint does not match the weights in {assets_weights.path}:\n  " + "\n  ".join(lines)
            + "\nPass the --model_assets_dir of the model this checkpoint was trained from, "
            "or --model_id if names differ."
        )


class _Arena:
    """One reusable buffer that holds the tensors of the current output shard.

    Reusing it across shards avoids faulting in fresh pages for every shard, which
    dominates the export time on machines where page faults are expensive.
    """

    _ALIGN = 64

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def tensors(self, specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
        offsets, end = {}, 0
        for name, (shape, dtype) in specs.items():
            offsets[name] = end
            numel = 1
            for dim in shape:
                numel *= dim
            end += -(-numel * dtype.itemsize // self._ALIGN) * self._ALIGN
        if self._buffer.numel() < end:
            self._buffer = torch.empty(0, dtype=torch.uint8)  # free the old one first
            self._buffer = torch.empty(end, dtype=torch.uint8)
        views = {}
        for name, (shape, dtype) in specs.items():
            numel = 1
            for dim in shape:
                numel *= dim
            start = offsets[name]
            views[name] = self._buffer[start:start + numel * dtype.itemsize].view(dtype).view(shape)
        return views


class _DCPSource:
    """Writes output shards from a DCP checkpoint's `model.*` tensors.

    A tensor that is the only item of its data file (what `hf_to_dcp` writes) is
    copied from that file into the shard with `os.copy_file_range`, inside the
    kernel. All other tensors of the shard (FSDP-sharded or packed training
    checkpoints) are loaded with one `dcp.load` into a reusable arena and written
    from there.
    """

    def __init__(self, path: Path, metadata: Any) -> None:
        self.path = path
        self.metadata = metadata
        self.arena = _Arena()

    def write_shard(self, out: Path, plans: dict[str, PlannedToHF],
                    model_specs: dict[str, tuple[tuple[int, ...], torch.dtype]], bar: tqdm) -> None:
        """Write the HF tensors of the model tensors `plans` (model key -> plan) as one safetensors file."""
        stored = {plan.target.hf_keys[0]: stored_tensor_file(self.path, self.metadata, MODEL_PREFIX + name)
                  for name, plan in plans.items() if plan.target.split is None}
        to_load = [name for name, plan in plans.items()
                   if plan.target.split is not None or stored[plan.target.hf_keys[0]] is None]
        pieces: dict[str, torch.Tensor] = {}
        if to_load:
            loaded = self.arena.tensors({name: model_specs[name] for name in to_load})
            with quiet_single_process():
                dcp.load({"model": loaded}, storage_reader=SafeFileSystemReader(os.fspath(self.path)),
                         planner=SafeLoadPlanner(), no_dist=True)
            for name in to_load:
                pieces.update(plans[name].pieces(loaded[name]))
        specs = {key: spec for plan in plans.values() for key, spec in plan.specs.items()}
        writer = SafetensorsWriter(out, specs, {"format": "pt"})
        try:
            for key in writer.order:
                if key in pieces:
                    writer.write_tensor(key, pieces[key])
                else:
                    _copy_file_range(stored[key], writer.file)
                    writer.wrote_directly(key)
                bar.update(writer.nbytes(key))
        finally:
            writer.close()


def _copy_assets_shard(out: Path, assets_weights: SafetensorsDir, keys: list[str], bar: tqdm) -> None:
    """Write the assets' tensors `keys` as they are (same bytes) as one safetensors file, one tensor in memory."""
    specs = {key: (assets_weights.tensors[key].shape, assets_weights.tensors[key].dtype) for key in keys}
    writer = SafetensorsWriter(out, specs, {"format": "pt"})
    try:
        for key in writer.order:
            writer.write_tensor(key, assets_weights.read(key))
            bar.update(writer.nbytes(key))
    finally:
        writer.close()


def _copy_file_range(stored: tuple[Path, int, int], out: BinaryIO) -> None:
    """Append `nbytes` at `offset` of `file` to `out`, in the kernel when the OS allows it."""
    file, offset, nbytes = stored
    out.flush()
    with open(file, "rb") as src:
        done = 0
        copy = getattr(os, "copy_file_range", None)
        while copy is not None and done < nbytes:
            try:
                step = copy(src.fileno(), out.fileno(), nbytes - done, offset + done)
            except OSError:  # e.g. across filesystems on some kernels: fall back to read/write
                break
            if step == 0:
                break
            done += step
        out.seek(0, os.SEEK_END)
        src.seek(offset + done)
        while done < nbytes:
            chunk = src.read(min(64 << 20, nbytes - done))
            if not chunk:
                raise CheckpointError(f"{file} is shorter than its DCP metadata says; the checkpoint is damaged")
            out.write(chunk)
            done += len(chunk)


def dcp_to_hf(
    load_dir: str | os.PathLike,
    save_dir: str | os.PathLike,
    model_assets_dir: str | os.PathLike,
    *,
    max_shard_size: str | int = "5GB",
    force: bool = False,
    adapter: StateDictAdapter | str | None = None,
    progress: bool | None = None,
) -> Path:
    """Export the model of a DCP checkpoint as a HF directory (safetensors shards + index + assets).

    `adapter` is a `StateDictAdapter`, a model id, or None (or "auto") for the one
    registered for the `model_type` of `model_assets_dir/config.json`.
    """
    max_shard_bytes = parse_size(max_shard_size)
    try:
        path, iteration = resolve_checkpoint(load_dir)
    except CheckpointError as err:
        near = checkpoint_near(load_dir)
        if near is None:
            raise
        command = shlex.join(["mm-convert", "GenericDCPConverter", "dcp_to_hf", "--load_dir", os.fspath(near),
                              "--save_dir", os.fspath(save_dir), "--model_assets_dir", os.fspath(model_assets_dir)])
        raise CheckpointError(f"{err}; run: {command}") from None
    if read_checkpoint_info(path).get("trainable_only"):
        raise CheckpointError(
            f"{path} holds only the trainable parameters of its run (e.g. LoRA adapters), not a whole model; "
            "export adapters with `mm-convert LoraConverter dcp_to_peft` or `dcp_to_merged_hf`"
        )
    metadata = read_dcp_metadata(path)
    entries = tensor_entries(metadata, MODEL_PREFIX)
    if not entries:
        raise CheckpointError(f"{path} holds no model tensors (keys {MODEL_PREFIX}*); is it an mmfsdp checkpoint?")
    assets = Path(model_assets_dir)
    if not assets.is_dir():
        raise CheckpointError(f"--model_assets_dir {assets} does not exist; pass the original HF model directory")
    config = read_config(assets)
    if config is None:
        raise CheckpointError(f"--model_assets_dir {assets} has no config.json; pass the original HF model directory")
    has_asset_weights = any(assets.glob("*.safetensors"))
    assets_weights = SafetensorsDir(assets) if has_asset_weights else None
    family = _adapter(adapter, config)
    passthrough = [key for key in assets_weights.tensors if family.passes_through(key)] if assets_weights else []
    asset_shapes = ({key: info.shape for key, info in assets_weights.tensors.items() if key not in passthrough}
                    if assets_weights else None)
    asset_keys = set(asset_shapes) if asset_shapes is not None else None

    model_specs = {name: (tuple(entry.size), entry.properties.dtype) for name, entry in entries.items()}
    plans = _plan_export(model_specs, family, asset_shapes)
    if _tied(config):
        for name in [n for n in plans if n.endswith("lm_head.weight")]:
            if asset_keys is None or not asset_keys.intersection(plans[name].specs):
                del plans[name]  # tied to the input embedding; transformers does not store it
    shapes = {key: spec[0] for plan in plans.values() for key, spec in plan.specs.items()}
    if assets_weights is not None:
        _check_against_assets(shapes, assets_weights, asset_shapes)
    _check_against_config(shapes, config, assets)

    save_dir = Path(save_dir)
    tmp_dir = prepare_output_dir(
        save_dir, force, "--save_dir", [(load_dir, "--load_dir"), (model_assets_dir, "--model_assets_dir")]
    )

    def nbytes(name: str) -> int:
        return sum(TensorInfo(tmp_dir, *spec).nbytes for spec in plans[name].specs.values())

    shards = plan_shards([(name, nbytes(name)) for name in plans], max_shard_bytes)
    kept_shards = plan_shards([(key, assets_weights.tensors[key].nbytes) for key in passthrough], max_shard_bytes)
    weight_map: dict[str, str] = {}
    total = sum(nbytes(name) for name in plans) + sum(assets_weights.tensors[key].nbytes for key in passthrough)
    source = _DCPSource(path, metadata)
    try:
        with _progress(total, "dcp_to_hf", progress) as bar:
            for index, shard in enumerate(shards):
                filename = shard_filename(index, len(shards) + len(kept_shards))
                source.write_shard(tmp_dir / filename, {name: plans[name] for name in shard}, model_specs, bar)
                weight_map.update({key: filename for name in shard for key in plans[name].specs})
            for index, shard in enumerate(kept_shards, start=len(shards)):
                filename = shard_filename(index, len(shards) + len(kept_shards))
                _copy_assets_shard(tmp_dir / filename, assets_weights, shard, bar)
                weight_map.update({key: filename for key in shard})
        index_json = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp_dir / INDEX_FILENAME).write_text(json.dumps(index_json, indent=2) + "\n")
        copy_model_assets(assets, tmp_dir)
        write_export_config(tmp_dir, family, read_checkpoint_info(path).get("metadata"))
    except BaseException:
        discard_output_dir(tmp_dir)
        raise
    return publish_output_dir(tmp_dir, save_dir)


def export_checkpoint_hf(save_dir: str | os.PathLike, iteration: int, model_assets_dir: str | os.PathLike) -> Path:
    """Export the training checkpoint `<save_dir>/iter_N` as an HF directory `<save_dir>/hf/iter_N` (`dcp_to_hf`).

    One process (rank 0 of a run, after the checkpoint is published). Exports of iterations no longer
    under `save_dir` (pruned by `keep_last`) are removed, so the two stay in step.
    """
    save_dir = Path(save_dir)
    name = iteration_dirname(iteration)
    exports = save_dir / HF_EXPORT_DIRNAME
    out = dcp_to_hf(save_dir / name, exports / name, model_assets_dir, force=True, progress=False)
    kept = set(list_iterations(save_dir))
    for entry in exports.iterdir():
        found = _iteration_from_dirname(entry.name)
        if isinstance(found, int) and found not in kept and entry.is_dir():
            shutil.rmtree(entry)
    return out
