"""Rollout engines compared: vLLM's generation tokens/s over the hf engine's, and the weight sync against a copy.

    uv run python tools/bench/rollout.py                            # the tiny Qwen3-VL (examples/qwen3vl-tiny)
    uv run python tools/bench/rollout.py --hidden 1152 --layers 24  # a ~0.5 B random-init Qwen3-VL decoder
    uv run python tools/bench/rollout.py --smoke                    # the smallest run (CI)

Needs the vLLM environment (`uv run python tools/vllm_env/setup.py` builds it; `.ci/run` does): without it the
script says so and exits 1, in `--smoke` too. One process, fp32 on the CPU, as `tests/test_vllm_rollout.py` drives
the engines: a random-init Qwen3-VL (seed 0; the example's assets, or its decoder resized to `--hidden` x
`--layers`, heads of 64, GQA 2) is exported (`write_start_export`), a vLLM server is launched on the export
(`launch_vllm_server`) and a `VLLMRolloutEngine` connects to it; the `HFRolloutEngine` generates from the same
model in this process.

- Generation: the same two prompts (one with a 64 x 64 image, one text-only), `--generations` completions each, at
  most `--max-tokens` tokens, temperature 1, the template's stop token; one warm-up call per engine, then
  `--repeats` rounds, each timing the hf engine's `generate` then the vLLM engine's (the RL step as seed: new
  draws every round). tokens/s = completion tokens generated / seconds; `vllm_over_hf` = the ratio of the medians.
- Weight sync: `--repeats` calls of `VLLMRolloutEngine.sync_weights` (every tensor to HF names, through a
  `/dev/shm` chunk of `--chunk-mb`, loaded by the server's `load_weights`), seconds and GB/s (the engine's
  `last_sync`). The limit it is compared with, measured in the same run on the same bytes: those bytes written
  into a `/dev/shm` file through `mmap`, chunk by chunk as the sync does, and read back into a tensor (a write and
  a read of shared memory: what any sync through host memory must at least do). `sync_over_copy_time` = median
  sync seconds / median copy seconds (target <= 2.0). The server (`--time-kernels`) also reports, per sync, its
  seconds inside vLLM's reload (`server_reload_s`) and the part vLLM's CPU backend spends repacking every linear
  layer's weight into a oneDNN kernel handle (`kernel_s`: ~0.25 ms a layer however small, redone after each weight
  change). A sync must at least do the copy's work and that repacking, so `kernel_floor_over_copy_time` =
  (copy + kernel seconds) / copy seconds is the lowest `sync_over_copy_time` this engine allows, and
  `target_reachable` says whether it is under the target (the tiny model's 24 layers: not).

The last line is one JSON object: the model's size, both engines' tokens/s, the sync and copy seconds and GB/s,
the ratios, the server's reload and kernel seconds, the load average, `targets_met` and `target_reachable`.
"""

from __future__ import annotations

import json
import mmap
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _smoke import doc_parser, parse_args

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "qwen3vl-tiny" / "config.yaml"
ASSETS = ROOT / "examples" / "qwen3vl-tiny" / "assets"
SETUP = ROOT / "tools" / "vllm_env" / "setup.py"
TARGET_SYNC_OVER_COPY = 2.0


def _vllm_python(given: str | None) -> str:
    """`given`, else the vLLM environment's Python as `tools/vllm_env/setup.py --check` reports it; exit 1 (with
    the command that builds it) when it is missing or stale."""
    if given:
        if not Path(given).exists():
            sys.exit(f"rollout.py: no Python at {given} (--vllm-python)")
        return given
    check = subprocess.run([sys.executable, str(SETUP), "--check"], capture_output=True, text=True, timeout=120)
    if check.returncode != 0:
        sys.exit(f"rollout.py needs the vLLM environment: {check.stderr.strip()}")
    return check.stdout.strip()


def _model_dir(out: Path, hidden: int | None, layers: int | None) -> Path:
    """The example's assets; with `hidden` / `layers`, its decoder resized (heads of 64, GQA 2, the M-RoPE
    sections scaled to the head size)."""
    model = out / "model"
    shutil.copytree(ASSETS, model)
    if hidden is None and layers is None:
        return model
    config = json.loads((model / "config.json").read_text())
    text = config["text_config"]
    hidden = hidden or text["hidden_size"]
    heads = max(hidden // 64, 1)
    head_dim = hidden // heads
    half = head_dim // 2
    text.update(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers or text["num_hidden_layers"],
                num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1), head_dim=head_dim)
    text["rope_parameters"]["mrope_section"] = [half // 2, half // 4, half - half // 2 - half // 4]
    config["vision_config"]["out_hidden_size"] = hidden
    (model / "config.json").write_text(json.dumps(config, indent=2))
    return model


def _requests(processor, generations: int):
    """The two prompts (a 64 x 64 image, a multiple of 32 that neither processor resizes; text only)."""
    from mmfsdp.model.families.qwen3_vl.testing import rollout_probe_prompts
    from mmfsdp.model.rollout import RolloutRequest

    with_image, text_only, png = rollout_probe_prompts(processor)
    return [
        RolloutRequest(prompt_index=0, prompt_ids=with_image["input_ids"][0].tolist(), num_generations=generations,
                       images=(png,),
                       media={"pixel_values": with_image["pixel_values"], "image_grid_thw": with_image["image_grid_thw"]}),
        RolloutRequest(prompt_index=1, prompt_ids=text_only["input_ids"][0].tolist(), num_generations=generations),
    ]


def _tokens_per_s(engine, requests, sampling, step: int) -> float:
    started = time.perf_counter()
    rollouts = engine.generate(requests, sampling, step=step)
    seconds = time.perf_counter() - started
    return sum(len(r.completion_ids) for r in rollouts) / seconds


def _copy_seconds(nbytes: int, chunk_bytes: int) -> float:
    """Seconds to write `nbytes` into a fresh `/dev/shm` file through `mmap`, a chunk of at most `chunk_bytes` at a
    time (as the sync fills its chunk), and read each chunk back into a tensor."""
    import torch

    chunk = min(nbytes, chunk_bytes)
    source = torch.randint(0, 256, (chunk,), dtype=torch.uint8)
    target = torch.empty(chunk, dtype=torch.uint8)
    directory = "/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()
    path = Path(directory) / f"mmfsdp-copybench-{os.getpid()}-{secrets.token_hex(4)}"
    started = time.perf_counter()
    try:
        with open(path, "wb") as f:
            f.truncate(chunk)
        fd = os.open(path, os.O_RDWR)
        buffer = mmap.mmap(fd, chunk)
        os.close(fd)
        done = 0
        while done < nbytes:
            count = min(chunk, nbytes - done)
            shared = torch.frombuffer(buffer, dtype=torch.uint8, count=count)
            shared.copy_(source[:count])
            target[:count].copy_(shared)
            del shared
            done += count
        buffer.close()
    finally:
        path.unlink(missing_ok=True)
    return time.perf_counter() - started


def _median_of(syncs: list[dict], key: str) -> float | None:
    values = [s[key] for s in syncs if key in s]
    return statistics.median(values) if len(values) == len(syncs) else None


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _parser():
    parser = doc_parser(__doc__)
    parser.add_argument("--hidden", type=int, default=None,
                        help="decoder hidden size of a random-init Qwen3-VL (default: the tiny example's, 128)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the tiny example's, 2)")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt (default: 8)")
    parser.add_argument("--max-tokens", type=int, default=32, help="most tokens per completion (default: 32)")
    parser.add_argument("--repeats", type=int, default=3, help="measured rounds; medians are reported (default: 3)")
    parser.add_argument("--chunk-mb", type=int, default=256,
                        help="the sync's shared-memory chunk, MiB (default: 256, the engine's default)")
    parser.add_argument("--vllm-python", default=None,
                        help="the vLLM environment's Python (default: what tools/vllm_env/setup.py --check prints)")
    parser.add_argument("--work-dir", default=None, help="where the model and export are written (default: a temp dir)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = parse_args(_parser(), argv, repeats=1, generations=2, max_tokens=4)
    python = _vllm_python(args.vllm_python)

    import torch
    from transformers import AutoProcessor

    from mmfsdp.ckpt import get_state_dict_adapter
    from mmfsdp.model import get_model_entry
    from mmfsdp.model.rollout import HFRolloutEngine, SamplingParams
    from mmfsdp.model.vllm_rollout import VLLMRolloutEngine, launch_vllm_server, write_start_export
    from mmfsdp.train.config import load_config

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="mmfsdp-rollout-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = _model_dir(work, args.hidden, args.layers)
    cfg = load_config(CONFIG, [f"model.model_name_or_path={model_dir}",
                               f"data.dataset_param.preprocess_parameters.model_name_or_path={model_dir}"])
    torch.manual_seed(0)
    model = get_model_entry(cfg.model.model_id).build(cfg.model).float().eval()
    adapter = get_state_dict_adapter(cfg.model.model_id)
    processor = AutoProcessor.from_pretrained(model_dir)
    tokenizer = processor.tokenizer
    requests = _requests(processor, args.generations)
    sampling = SamplingParams(max_new_tokens=args.max_tokens, temperature=1.0,
                              stop_token_ids=(tokenizer.convert_tokens_to_ids("<|im_end|>"),))
    media_ids = frozenset(tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>"))

    export = write_start_export(model, adapter, model_dir, work / "export")
    started = time.perf_counter()
    process, address, authkey = launch_vllm_server(python, str(export), architecture=adapter.architectures[0],
                                                   max_model_len=1024, log_path=work / "server.log", time_kernels=True)
    server_start_s = time.perf_counter() - started
    vllm = VLLMRolloutEngine(address, authkey, adapter=adapter, media_token_ids=media_ids, process=process,
                             chunk_bytes=args.chunk_mb << 20)
    hf = HFRolloutEngine(model, pad_token_id=tokenizer.pad_token_id or 0)
    try:
        syncs, copies = [], []
        for version in range(1, args.repeats + 1):
            vllm.sync_weights(model, version=version)
            syncs.append(dict(vllm.last_sync))
            copies.append(_copy_seconds(int(vllm.last_sync["bytes"]), vllm.chunk_bytes))
        hf.sync_weights(model, version=vllm.weights_version)
        with torch.no_grad():
            _tokens_per_s(hf, requests, sampling, step=0)  # warm-up
            _tokens_per_s(vllm, requests, sampling, step=0)
            hf_rates, vllm_rates = [], []
            for step in range(1, args.repeats + 1):
                hf_rates.append(_tokens_per_s(hf, requests, sampling, step))
                vllm_rates.append(_tokens_per_s(vllm, requests, sampling, step))
    finally:
        vllm.close()

    nbytes = syncs[0]["bytes"]
    sync_s = statistics.median(s["seconds"] for s in syncs)
    copy_s = statistics.median(copies)
    reload_s = _median_of(syncs, "reload_s")
    kernel_s = _median_of(syncs, "kernel_s")  # None: this vLLM has no CPU kernel dispatch to time
    floor = None if kernel_s is None else (copy_s + kernel_s) / copy_s
    hf_tps, vllm_tps = statistics.median(hf_rates), statistics.median(vllm_rates)
    result = {
        "model": "tiny" if args.hidden is None and args.layers is None else f"hidden {model.config.text_config.hidden_size} x {model.config.text_config.num_hidden_layers} layers",
        "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
        "prompts": len(requests), "generations": args.generations, "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "hf_tokens_per_s": round(hf_tps, 1),
        "vllm_tokens_per_s": round(vllm_tps, 1),
        "vllm_over_hf": round(vllm_tps / hf_tps, 3),
        "sync_mb": round(nbytes / 1e6, 2),
        "sync_s": round(sync_s, 4),
        "sync_gbps": round(nbytes / sync_s / 1e9, 3),
        "copy_s": round(copy_s, 4),
        "copy_gbps": round(nbytes / copy_s / 1e9, 3),
        "sync_over_copy_time": round(sync_s / copy_s, 3),
        "server_reload_s": _rounded(reload_s, 4),
        "kernel_s": _rounded(kernel_s, 4),
        "kernel_floor_over_copy_time": _rounded(floor, 3),
        "target_reachable": floor is None or floor <= TARGET_SYNC_OVER_COPY,
        "server_start_s": round(server_start_s, 1),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "targets": {"sync_over_copy_time": TARGET_SYNC_OVER_COPY},
        "targets_met": sync_s / copy_s <= TARGET_SYNC_OVER_COPY,
    }
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
