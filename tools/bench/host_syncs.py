"""Host round trips of one packed training micro-batch, per model family, and with twice the decoder layers.

For each family (`FAMILIES`: Qwen3-VL, Qwen3.5, Qwen3.5 MoE, tiny models) one packed row of three samples (text,
and images of different sizes) is trained forward + backward as the trainer runs it, under `mmfsdp.model.host_syncs.HostSyncCounter`: the calls that make the host wait for the device (`.item()`,
`.tolist()`, `.cpu()`, `if tensor:`, `nonzero`, boolean-mask indexing, `torch.tensor(list)`, ...), by kind, by call
site, and those made inside the decoder layers' forward (the goal: 0). The same with twice the layers must count the
same. On the CPU every tensor counts (what a GPU would wait for); `--device cuda` counts device tensors only.

    uv run python tools/bench/host_syncs.py                 # the three families, with their call sites
    uv run python tools/bench/host_syncs.py --smoke         # CI: Qwen3.5 only

The last line printed is one JSON object: per family the totals, the layers' count, and `grows_with_depth`.
Context parallel (Ulysses 2, Ring 2 on 2 gloo ranks) is counted by packages/model/tests/test_model_host_syncs.py.
"""

from __future__ import annotations

import argparse
import json

from _smoke import parse_args

FAMILIES = ("qwen3_vl", "qwen3_5", "qwen3_5_moe")
"""The families counted (their test kits' `packed_test_batch`: a packed row of text and images)."""


def main(argv: list[str] | None = None) -> dict:
    import mmfsdp.model.all_families  # noqa: F401  (registers the families)
    from mmfsdp.model.host_sync_probe import probe_training_step

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--device", default="cpu")
    args = parse_args(parser, argv, families=["qwen3_5"])
    result = {}
    for model_id in args.families:
        counters = {
            double: probe_training_step(model_id, double_layers=double, device=args.device,
                                        device_only=args.device != "cpu")
            for double in (False, True)
        }
        base, doubled = counters[False], counters[True]
        print(f"{model_id}: {base.report()}")
        print(f"{model_id}, twice the layers: {doubled.report()}")
        for site, n in sorted(base.sites.items(), key=lambda item: -item[1]):
            print(f"    {n} × {site}")
        result[model_id] = {
            "total": base.total,
            "in_layers": sum(base.in_layers.values()),
            "total_doubled_layers": doubled.total,
            "in_layers_doubled": sum(doubled.in_layers.values()),
            "grows_with_depth": doubled.total != base.total,
            "by_kind": dict(base.counts),
        }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
