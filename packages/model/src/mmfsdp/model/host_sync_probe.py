"""One packed training micro-batch of a tiny model family, its host round trips counted (`mmfsdp.model.host_syncs`).

Used by packages/model/tests/test_model_host_syncs.py (without context parallel, Ulysses 2, Ring 2), by
`tools/bench/host_syncs.py` and by `tools/bench/gpu_check.py`'s `gated_deltanet` section (on the device).
"""

from __future__ import annotations

from typing import Any

import torch

from mmfsdp.model.host_syncs import HostSyncCounter, count_host_syncs

__all__ = ["probe_training_step"]

def _probe_config(model_id: str, double_layers: bool):
    from mmfsdp.model.spec import get_model_entry

    kit = get_model_entry(model_id).testkit
    config = kit.tiny_config()
    if double_layers:
        text = config.text_config.to_dict()
        text["num_hidden_layers"] *= 2
        if text.get("layer_types"):
            text["layer_types"] = list(text["layer_types"]) * 2
        config = kit.tiny_config(text_config=text)
    return config


def probe_training_step(
    model_id: str,
    *,
    double_layers: bool = False,
    parallel_dims: Any = None,
    device: torch.device | str = "cpu",
    device_only: bool = False,
) -> HostSyncCounter:
    """One packed micro-batch (the test kit's `packed_test_batch`) of the family's tiny model, trained as the trainer
    does (experts through `experts_forward`, context parallel over `parallel_dims` when given): forward + backward
    under a `HostSyncCounter` whose `in_layers` are the decoder layers'. `double_layers`: twice the decoder layers."""
    import copy

    from mmfsdp.model.loss import compute_loss_weights, shift_labels
    from mmfsdp.model.spec import get_model_entry
    from mmfsdp.model.training_forward import model_inputs
    from mmfsdp.parallel import apply_expert_parallel

    entry = get_model_entry(model_id)
    config = _probe_config(model_id, double_layers)
    torch.manual_seed(0)
    model = entry.model_class._from_config(copy.deepcopy(config), attn_implementation="mmfsdp_sdpa")
    if entry.expert_modules:
        apply_expert_parallel(model, entry.expert_modules, None)
    if parallel_dims is not None:
        model.enable_context_parallel(parallel_dims)
    device = torch.device(device)
    model.to(device)
    batch = entry.testkit.packed_test_batch(config)
    target = shift_labels(batch["labels"], batch["cu_seq_lens"])
    (weights,) = compute_loss_weights([target], loss_type="default", cu_seq_lens=[batch["cu_seq_lens"]])
    inputs = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in model_inputs(batch).items()}
    inputs["cu_seq_lens"] = batch["cu_seq_lens"]  # HOST_INPUT_KEYS: the trainer leaves the bounds on the host
    target, weights = target.to(device), weights.to(device)
    decoder = model.get_submodule(model.decoder_name)

    def step() -> None:
        out = model(**inputs, shift_labels=target, loss_weights=weights)
        out.loss.backward()

    return count_host_syncs(step, decoder.layers, device_only=device_only)
