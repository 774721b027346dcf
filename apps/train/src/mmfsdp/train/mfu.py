"""MFU and TFLOP/s of each step: the FLOPs of its real batch over the devices' peak.

`FlopMeter` counts each micro-batch as the trainer takes it (`count`, host-side: sample lengths from the attention
mask and `cu_seq_lens`, image patches through the family's `costs.image_patches`; `mmfsdp.model.flops` has the
formulas), the trainer sums the counts over the data-parallel group together with the token count (one
all-reduce), and `scalars` turns a step's sum into the record's numbers:

- `tflops`: achieved model TFLOP/s per device, `3 × forward FLOPs / step time / world size`;
- `mfu`: that over the peak of one device (`mmfsdp.parallel.peak`: `tools.peak_tflops`, the device table, or on a
  CPU a GEMM timed once on this machine);
- `hfu` (with `parallel.recompute`): the same with the recomputed forward of the layers counted.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from mmfsdp.config import get_logger
from mmfsdp.model.flops import ForwardFlops, count_forward, sample_lengths
from mmfsdp.parallel.dtypes import dtype_name
from mmfsdp.parallel.peak import (cached_peak, device_name, measure_gemm_tflops, measured_peak_key, peak_cache_path,
                                  store_peak, table_peak_tflops)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from mmfsdp.model import FamilyCosts

log = get_logger("mmfsdp.train")



def resolve_peak_tflops(device: torch.device, dtype: torch.dtype, configured: float | None) -> tuple[float, str]:
    """Peak TFLOP/s of one device and where it comes from. A device the table does not know is measured: rank 0's
    file of earlier measurements (`mmfsdp.parallel.peak.cached_peak`) decides for every rank (one broadcast);
    without an entry every rank times its GEMMs at the same moment and the mean of the ranks is used and stored."""
    if configured is not None:
        return configured, "tools.peak_tflops"
    name = device_name(device)
    peak = None if device.type == "cpu" else table_peak_tflops(name, dtype)
    if peak is not None:
        return peak, f"the table's {name} {dtype_name(dtype)}"
    distributed = dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    key = measured_peak_key(device, dtype, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    cached = torch.tensor([cached_peak(key) or 0.0], dtype=torch.float64, device=device)
    if distributed:
        dist.broadcast(cached, src=0)
    if (value := cached.item()) > 0:
        return value, f"measured on this machine earlier, kept in {peak_cache_path()}: delete it to measure again"
    measured = torch.tensor([measure_gemm_tflops(device, dtype)], dtype=torch.float64, device=device)
    if distributed:
        dist.all_reduce(measured)
        measured /= world
    if not distributed or dist.get_rank() == 0:
        store_peak(key, float(measured))
    return float(measured), f"measured by a 512x512 {dtype_name(dtype)} GEMM on {name}, mean of the ranks"


class FlopMeter:
    def __init__(self, costs: FamilyCosts, model_config: PretrainedConfig, *, device: torch.device, dtype: torch.dtype,
                 world_size: int, recompute: bool, peak_tflops: float | None = None):
        """`costs`: the model family's cost facet (`entry.costs`); `model_config`: the HF config of the built model;
        `dtype`: the compute dtype (the peak is per dtype)."""
        self.costs = costs
        self.model_config = model_config
        self.shape = costs.flop_shape(model_config)
        self.world_size = world_size
        self.recompute = recompute
        self.peak_tflops, source = resolve_peak_tflops(device, dtype, peak_tflops)
        log.info(f"mfu: peak {self.peak_tflops:.3g} TFLOP/s per device ({source})")

    def count(self, batch: dict[str, Any]) -> ForwardFlops:
        """Forward FLOPs of one collated micro-batch (on the host, before it moves to the device)."""
        lens = sample_lengths(batch["attention_mask"], batch.get("cu_seq_lens"))
        return count_forward(self.shape, lens, self.costs.image_patches(self.model_config, batch),
                             self.costs.audio_windows(self.model_config, batch))

    def scalars(self, flops: ForwardFlops, step_time_s: float) -> dict[str, float]:
        """`tflops`, `mfu` (and `hfu` with recompute) of a step whose data-parallel group computed `flops`."""
        per_device = flops.model / step_time_s / self.world_size / 1e12
        out = {"tflops": per_device, "mfu": per_device / self.peak_tflops}
        if self.recompute:
            out["hfu"] = flops.hardware(True) / step_time_s / self.world_size / 1e12 / self.peak_tflops
        return out
