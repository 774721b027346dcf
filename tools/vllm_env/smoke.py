"""Load an HF model directory in vLLM on the CPU and generate greedily: one prompt with an image, one text-only.

Run it with the vLLM environment's Python (`tools/vllm_env/setup.py` builds it and prints that Python):

    $(uv run python tools/vllm_env/setup.py --check) tools/vllm_env/smoke.py OUT/hf/iter_0000010

Its last line on stdout (after vLLM's log) is one JSON line: the versions, the seconds to load and to generate,
and per prompt the prompt's token ids as vLLM processed them (image placeholders expanded), the completion's token
ids and text and the finish reason. `tests/test_vllm_env.py` compares those ids with transformers' greedy
generation of the same directory. Several directories (`MODEL_DIR[:DTYPE] ...`) load one after the other in the
same process (vLLM imported once; each engine shut down before the next), one JSON line each, in order.

The prompts are raw text, no chat template (`--image-prompt`, `--text-prompt` replace them): the image placeholder
written from the processor's own tokens (the image token, between the vision start and end tokens where the
processor has them), then a question. The image is a synthetic square (`--image` gives a file). A directory whose
config.json names no generating `architectures` is refused by vLLM: HF exports of mmfsdp write it
(`mmfsdp.ckpt.export_config`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _image(path: str | None):
    from PIL import Image

    if path:
        return Image.open(path).convert("RGB")
    image = Image.new("RGB", (64, 64), (235, 235, 235))
    image.paste((200, 30, 30), (16, 16, 48, 48))
    return image


def _image_placeholder(processor) -> str:
    """The text that stands for one image in a prompt: the processor's image token, between its vision start and
    end tokens where it has them (Qwen-VL's positions count images from the start token)."""
    tokens = [getattr(processor, name, None) for name in ("vision_start_token", "image_token", "vision_end_token")]
    return "".join(token for token in tokens if token)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="+",
                        help="HF model directories (mmfsdp exports, or any model vLLM supports), each optionally "
                             "`DIR:DTYPE` (e.g. `:bfloat16` for a model whose CPU kernels need it; default --dtype)")
    parser.add_argument("--image-prompt", default=None,
                        help="the prompt with the image, `{image}` where the image goes (default: a question about it)")
    parser.add_argument("--text-prompt", default="Count from one to ten:", help="the text-only prompt")
    parser.add_argument("--image", default=None, help="an image file (default: a synthetic red square)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens to generate per prompt (default 8)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="generate --max-tokens tokens whatever the stop tokens (to compare whole sequences)")
    parser.add_argument("--dtype", default="float32", help="vLLM's dtype (default float32)")
    parser.add_argument("--max-model-len", type=int, default=1024, help="the context vLLM reserves (default 1024)")
    args = parser.parse_args(argv)

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: plenty for a smoke test
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # a shared machine: do not pin cores
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: one import of vLLM
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")  # no usage report (a CPU probe in a subprocess, a post)
    import torch
    import transformers
    import vllm
    from transformers import AutoProcessor

    for spec in args.model:
        model, _, dtype = spec.partition(":") if ":" in spec and not os.path.isdir(spec) else (spec, "", "")
        print(json.dumps(_generate(vllm, AutoProcessor, args, model, dtype or args.dtype)
                         | {"vllm": vllm.__version__, "torch": torch.__version__,
                            "transformers": transformers.__version__}), flush=True)
    return 0


def _generate(vllm, auto_processor, args, model: str, dtype: str) -> dict:
    """One directory loaded in `vllm.LLM`, its greedy completions of the two prompts, the engine shut down."""
    import gc

    processor = auto_processor.from_pretrained(model)
    image_prompt = (args.image_prompt or "{image}What shape and colour is this?").replace(
        "{image}", _image_placeholder(processor)
    )
    start = time.perf_counter()
    llm = vllm.LLM(
        model=model, dtype=dtype, max_model_len=args.max_model_len, enforce_eager=True,
        limit_mm_per_prompt={"image": 1}, max_num_seqs=2, seed=0, distributed_executor_backend="uni",
    )
    loaded = time.perf_counter()
    sampling = vllm.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    prompts = [
        {"prompt": image_prompt, "multi_modal_data": {"image": _image(args.image)}},
        {"prompt": args.text_prompt},
    ]
    results = llm.generate(prompts, sampling, use_tqdm=False)
    done = time.perf_counter()
    outputs = [
        {
            "image": "multi_modal_data" in prompt, "prompt": prompt["prompt"],
            "prompt_token_ids": list(result.prompt_token_ids), "token_ids": list(result.outputs[0].token_ids),
            "text": result.outputs[0].text, "finish_reason": result.outputs[0].finish_reason,
        }
        for prompt, result in zip(prompts, results)
    ]
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if engine_core is not None:
        engine_core.shutdown()
    del llm
    gc.collect()
    return {"model": model, "dtype": dtype, "load_s": round(loaded - start, 2), "generate_s": round(done - loaded, 2),
            "outputs": outputs}


if __name__ == "__main__":
    sys.exit(main())
