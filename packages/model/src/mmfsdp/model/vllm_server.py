"""The vLLM rollout server: a process of the vLLM environment that generates for `VLLMRolloutEngine`.

Standalone: it imports the standard library, torch and vllm only (the vLLM environment cannot import our packages,
docs/rl.md ("The vLLM environment")); the trainer starts it by path with that environment's Python, or connects to
one started by hand:

    VLLM_SERVER_AUTHKEY=<hex> $(uv run python tools/vllm_env/setup.py --check) \\
        packages/model/src/mmfsdp/model/vllm_server.py --model DIR --address 127.0.0.1:8765 --dummy

Protocol: `multiprocessing.connection` (a TCP `host:port` or a Unix socket path) authenticated with the hex key of
`$VLLM_SERVER_AUTHKEY`; one client at a time; each message a dict of builtins (no tensors: the two sides run
different torch versions), answered by `{"ok": True, ...}` or `{"ok": False, "error": "..."}`:

- `{"op": "info"}` -> `version`, `pid`, `vllm`.
- `{"op": "load", "path": P, "tensors": [[hf_name, dtype, shape, offset], ...], "version": v | None,
  "partial": bool}`: one chunk
  of a weight sync: the named tensors lie in the shared-memory file P at byte `offset` (dtype a torch dtype name).
  The first chunk starts vLLM's in-place reload (`reload_weights`: the model's own `load_weights`, HF checkpoint
  names, then its post-load processing); each chunk is acknowledged once read (`busy`: the chunk files whose bytes
  the reload still holds, which the client must not overwrite yet), and the next one is read into the same reload;
  the chunk with `version` is the last: the reload finishes and the server's weights version becomes v. Its
  answer carries `reload_s` (seconds from the first chunk's arrival to the reload's end, waits for the client's
  next chunks included) and, with `--time-kernels`, `kernel_s` (the part vLLM's CPU backend spent preparing its
  matmul kernels: repacking each linear layer's weight into a oneDNN handle, redone after every weight change).
  `partial`: the sync leaves out whole layers the server already holds (frozen ones); vLLM keeps them, and would
  log a warning for each such layer and one listing their tensors every sync: the server mutes those two loggers'
  warnings for that reload (a first, full sync keeps them).
- `{"op": "generate", "version": v, "sampling": {...}, "requests": [...]}`: refused unless v is the server's
  weights version (a stale engine is never used silently). Each request is one completion: `prompt_token_ids`
  (media placeholders collapsed to one token per image, vLLM expands them), `images` (encoded files' bytes) and
  `seed`. Returns per request `token_ids`, `logprobs` (the sampled tokens', `processed_logprobs`),
  `finish_reason` and `prompt_token_ids` (vLLM's expansion, which the client checks against its own).
- `{"op": "close"}`: the server exits.

The listener opens only once the model is loaded: a client that connects finds the server ready. The server exits
when its parent process (the trainer that launched it, `--parent-pid`) is gone.
"""

from __future__ import annotations

import argparse
import io
import logging
import math
import mmap
import os
import sys
import threading
import time
import traceback
import weakref
from multiprocessing.connection import Listener

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
"""Map a chunk's pages in one call, not one page fault per 4 KiB page read (Linux)."""


def _address(text: str):
    if ":" in text and not text.startswith("/"):
        host, port = text.rsplit(":", 1)
        return (host, int(port))
    return text


def _watch_parent(pid: int) -> None:
    """Exit when the launching process is gone (a trainer killed with SIGKILL leaves no orphan server)."""
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os._exit(3)
        time.sleep(1.0)


def _quiet_thread_pinning() -> None:
    """vLLM's CPU worker replaces `torch.set_num_threads` with a no-op that logs a warning on every call, and the
    per-request multimodal processing calls it on every request: 216,672 warning lines in the log of a 200-step run
    of the GRPO example. Keep the no-op, without the line."""
    import torch

    if getattr(torch.set_num_threads, "__name__", "") == "skip_set_num_threads":
        torch.set_num_threads = lambda threads: None


def _time_kernel_preparation() -> list[float] | None:
    """Measurement only (`--time-kernels`, the rollout benchmark): wrap vLLM's CPU linear-kernel dispatch
    (`dispatch_cpu_unquantized_gemm`, which its linear and LM-head layers import when their weights are loaded
    and which repacks the weight into a oneDNN handle) to add its seconds to the returned counter. None when this
    vLLM has no such function (nothing is wrapped)."""
    from vllm.model_executor.layers import utils

    original = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if original is None:
        return None
    spent = [0.0]

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - started

    utils.dispatch_cpu_unquantized_gemm = timed
    return spent


class Server:
    def __init__(self, args):
        import vllm

        self.vllm = vllm
        self.kernel_seconds = _time_kernel_preparation() if args.time_kernels else None
        overrides = {"architectures": [args.architecture]} if args.architecture else None
        self.llm = vllm.LLM(
            model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=True,
            load_format="dummy" if args.dummy else "auto", hf_overrides=overrides, seed=args.seed,
            max_num_seqs=args.max_num_seqs, enable_prefix_caching=False, logprobs_mode="processed_logprobs",
            mm_processor_cache_gb=0,  # the reload resets the worker's caches; a frontend cache would still send hashes
            generation_config="vllm", limit_mm_per_prompt={"image": args.max_images}, distributed_executor_backend="uni",
        )
        self.version = 0
        _quiet_thread_pinning()

    def load(self, message, conn) -> dict:
        """One weight sync: vLLM's in-place reload (`reload_weights`: the model's `load_weights`, then its
        post-load processing, and the encoder and multimodal caches reset) over a stream of chunks: after a chunk's
        tensors are consumed it is acknowledged and the next `load` message read from `conn`, until the one that
        carries `version`.

        The tensors are views of the chunk's shared memory, not copies: `load_weights` copies each into the model
        once (the copy out of the chunk is the one read a sync needs). vLLM may hold a view until its layer is
        complete, past the chunk's acknowledgement, so every acknowledgement lists the chunk files some view still
        maps (`busy`, from a weak reference to each file's mapping, which the views keep alive): the client writes
        the next chunk into another file and reuses a busy one only once a later answer no longer lists it."""
        import torch

        mapped: dict[str, weakref.ref] = {}

        def busy() -> list[str]:
            for path in [path for path, ref in mapped.items() if ref() is None]:
                del mapped[path]
            return sorted(mapped)

        def tensors(message):
            while True:
                items = [(name, getattr(torch, dtype), shape, offset)
                         for name, dtype, shape, offset in message["tensors"]]
                sizes = [math.prod(shape) * dt.itemsize for _, dt, shape, _ in items]
                end = max((item[3] + nbytes for item, nbytes in zip(items, sizes)), default=0)
                with open(message["path"], "r+b") as f:  # writable, shared: a loader's in-place op cannot fault
                    size = os.fstat(f.fileno()).st_size
                    buffer = mmap.mmap(f.fileno(), min(size, -(-max(end, 1) // mmap.PAGESIZE) * mmap.PAGESIZE),
                                       flags=mmap.MAP_SHARED | _POPULATE)  # the bytes in use only
                mapped[message["path"]] = weakref.ref(buffer)
                data = torch.frombuffer(buffer, dtype=torch.uint8)  # keeps `buffer` alive while a view lives
                del buffer
                for (name, dt, shape, offset), nbytes in zip(items, sizes):
                    yield name, data[offset:offset + nbytes].view(dt).view(shape)
                del data
                if message.get("version") is not None:
                    return
                conn.send({"ok": True, "version": self.version, "busy": busy()})
                message = conn.recv()
                if message.get("op") != "load":
                    raise RuntimeError(f"expected the next weight chunk, got {message.get('op')!r}")
                last[0] = message

        last = [message]
        muted = [logging.getLogger(f"vllm.model_executor.model_loader.reload.{name}")
                 for name in ("layerwise", "inplace")]
        levels = [logger.level for logger in muted]
        if message.get("partial"):
            for logger in muted:
                logger.setLevel(logging.ERROR)
        started, kernel_before = time.perf_counter(), (self.kernel_seconds or [0.0])[0]
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": tensors(message),
                                                              "is_checkpoint_format": True})
        finally:
            for logger, level in zip(muted, levels):
                logger.setLevel(level)
        self.version = int(last[0]["version"])
        timing = {"reload_s": time.perf_counter() - started}
        if self.kernel_seconds is not None:
            timing["kernel_s"] = self.kernel_seconds[0] - kernel_before
        return {"version": self.version, "busy": busy(), **timing}

    def generate(self, message) -> dict:
        from PIL import Image

        if message["version"] != self.version:
            raise RuntimeError(f"stale weights: the client expects version {message['version']}, "
                               f"the server holds {self.version}")
        s = message["sampling"]
        prompts, params = [], []
        for request in message["requests"]:
            prompt = {"prompt_token_ids": list(request["prompt_token_ids"])}
            if request["images"]:
                images = [Image.open(io.BytesIO(data)).convert("RGB") for data in request["images"]]
                prompt["multi_modal_data"] = {"image": images}
            prompts.append(prompt)
            params.append(self.vllm.SamplingParams(
                n=1, temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"],
                max_tokens=s["max_tokens"], stop_token_ids=list(s["stop_token_ids"]), ignore_eos=True,
                logit_bias=dict(s["logit_bias"]) or None, logprobs=0, seed=request["seed"], detokenize=False,
            ))
        results = self.llm.generate(prompts, params, use_tqdm=False)
        outputs = []
        for result in results:
            out = result.outputs[0]
            tokens = list(out.token_ids)
            outputs.append({
                "token_ids": tokens, "prompt_token_ids": list(result.prompt_token_ids),
                "logprobs": [float(out.logprobs[i][token].logprob) for i, token in enumerate(tokens)],
                "finish_reason": "stop" if out.finish_reason == "stop" else "length",
            })
        return {"outputs": outputs}

    def serve(self, address, authkey: bytes) -> None:
        with Listener(address, authkey=authkey) as listener:
            print(f"vllm rollout server listening on {address}", flush=True)
            while True:
                with listener.accept() as conn:
                    while True:
                        try:
                            message = conn.recv()
                        except (EOFError, OSError):
                            break
                        op = message.get("op")
                        if op == "close":
                            conn.send({"ok": True})
                            return
                        try:
                            if op == "info":
                                reply = {"version": self.version, "pid": os.getpid(), "vllm": self.vllm.__version__}
                            elif op == "load":
                                reply = self.load(message, conn)
                            elif op == "generate":
                                reply = self.generate(message)
                            else:
                                raise ValueError(f"unknown op {op!r}")
                            conn.send({"ok": True, **reply})
                        except Exception as e:  # the client raises it, with our traceback's last line
                            traceback.print_exc()
                            conn.send({"ok": False, "error": f"{type(e).__name__}: {e}"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="HF model directory (config, tokenizer, processor)")
    parser.add_argument("--address", required=True, help="host:port, or a Unix socket path")
    parser.add_argument("--dummy", action="store_true", help="random weights: the client syncs every weight")
    parser.add_argument("--architecture", default=None, help="the HF class to build (config.json's architectures)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-images", type=int, default=4, help="most images per prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-kernels", action="store_true",
                        help="measurement: report the seconds vLLM spends repacking linear kernels in each sync")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    args = parser.parse_args(argv)
    authkey = bytes.fromhex(os.environ.get("VLLM_SERVER_AUTHKEY", ""))
    if not authkey:
        print("vllm_server: set VLLM_SERVER_AUTHKEY (hex)", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the model in this process: apply_model
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # vLLM's usage report (a thread that probes the CPU in a subprocess and posts to vLLM's stats server): a
    # training job's rollout server does not phone home unless the user sets VLLM_NO_USAGE_STATS=0
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    if args.parent_pid:
        threading.Thread(target=_watch_parent, args=(args.parent_pid,), daemon=True).start()
    Server(args).serve(_address(args.address), authkey)
    return 0


if __name__ == "__main__":
    sys.exit(main())
