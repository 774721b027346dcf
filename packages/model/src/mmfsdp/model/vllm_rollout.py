"""`VLLMRolloutEngine`: a `RolloutEngine` whose completions come from a vLLM server in another process.

The server (`mmfsdp.model.vllm_server`, a standalone module run with the vLLM environment's Python) is launched
by rank 0 (`launch_vllm_server`) or already running; rank 0 alone talks to it over `multiprocessing.connection`
(authenticated), the other ranks through rank 0 with object collectives over `group`:

1. `sync_weights(model, version)`, every rank: for each tensor of `get_model_state_dict(model)` (clean FQNs,
   FSDP2 DTensors), `full_tensor()` (a collective every rank calls: one parameter at a time is whole, never the
   model), split and renamed to HF names by the family's state-dict adapter (`mmfsdp.ckpt.plan_to_hf`, the names
   vLLM's `load_weights` reads from a checkpoint; a LoRA model's are its merged weights, `merged_tensors`: the
   server serves the base model without adapters); rank 0 copies it into a shared-memory file (`/dev/shm`) of
   `chunk_bytes` and, when the chunk is full, sends the server the chunk's table and waits while the server loads
   it through the vLLM model's `load_weights`. The last chunk carries `version`: only then does the server's
   weights version change. Rank 0 broadcasts the outcome so every rank raises together on a failure. After the
   first sync, a group of tensors (`sync_groups`: those of one module's children, which an engine may fuse)
   none of which can change (`changing_tensors`: frozen, and held by the server since a sync) is neither
   gathered nor sent: with LoRA, only the adapted blocks' merged weights travel; with a frozen vision tower,
   not the tower.
2. `generate(requests, sampling, step)`: the ranks' requests are gathered on rank 0, which sends one completion
   per (prompt, generation) with its seed (`row_keys(seed, step, prompt, generation)`: the same key as the hf
   engine's draws, so a completion depends on its prompt and indices, not on the layout; vLLM's sampler draws
   from its own generator seeded by it, so sampled tokens differ from the hf engine's, greedy ones do not) and
   the weights version it expects; the server refuses any other version. The media placeholders of a prompt's
   ids are collapsed to one token per image (vLLM expands them from the image, with the model's own processor)
   and the expansion vLLM reports must equal our prompt ids, else the two processors disagree and it raises.
   The results are scattered back, each rank's in its request order.

Failures: a server that exits, closes the connection or does not answer within `timeout_s` is a
`VLLMServerError` on every rank (rank 0 scatters / broadcasts it); a launched server is killed by `close()`
and, should the trainer die, exits by itself when its parent is gone (`--parent-pid`).
"""

from __future__ import annotations

import mmap
import os
import secrets
import socket
import subprocess
import tempfile
import time
from multiprocessing.connection import Client, Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from mmfsdp.model.rollout import Rollout, RolloutRequest, SamplingParams, row_keys

if TYPE_CHECKING:
    from torch import nn

    from mmfsdp.ckpt.adapters import StateDictAdapter

__all__ = ["SERVER_SCRIPT", "VLLMRolloutEngine", "VLLMServerError", "collapse_media", "launch_vllm_server",
           "merged_plans", "merged_tensors", "write_start_export"]

SERVER_SCRIPT = Path(__file__).with_name("vllm_server.py")
"""The server module, run by path with the vLLM environment's Python."""


def merged_tensors(model: nn.Module, state: dict[str, torch.Tensor],
                   only: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """`state` (`get_model_state_dict(model)`) whole, one tensor at a time, under the names weights files give them
    (`mmfsdp.ckpt.lora.stored_key`): a LoRA layer's `x.base_layer.weight` as `x.weight` with its adapters merged in,
    `W + (alpha / r) · B · A` (fp32, stored in W's dtype), the adapter tensors themselves left out; with `only`,
    the tensors of those names only (the others are not gathered). Every rank must iterate it with the same
    `only`: a sharded tensor's `full_tensor()` is a collective."""
    from torch.distributed.tensor import DTensor

    from mmfsdp.ckpt.lora import ADAPTER_NAME, adapter_keys, is_adapter_key, stored_key
    from mmfsdp.model.lora import lora_layers

    def whole(value: torch.Tensor) -> torch.Tensor:
        return value.full_tensor() if isinstance(value, DTensor) else value

    layers = lora_layers(model)
    for key, value in state.items():
        if is_adapter_key(key) or (only is not None and stored_key(key) not in only):
            continue
        full = whole(value)
        module = key.removesuffix(".base_layer.weight")
        if module != key and module in layers:
            a_key, b_key = adapter_keys(module)
            a, b = whole(state[a_key]).float(), whole(state[b_key]).float()
            scale = float(layers[module].scaling[ADAPTER_NAME])
            full = (full.float() + scale * (b @ a)).to(full.dtype)
        yield stored_key(key), full


def changing_tensors(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, bool]:
    """Whether each tensor `merged_tensors` yields can change in training, by name: a parameter that requires grad,
    a LoRA layer's merged weight whose base or adapters do; a frozen parameter cannot. A name that is not a
    parameter (a buffer) counts as changing."""
    from mmfsdp.ckpt.lora import adapter_keys, stored_key
    from mmfsdp.model.lora import lora_layers

    params = dict(model.named_parameters())
    layers = lora_layers(model)
    changing: dict[str, bool] = {}
    for key in state:
        name = stored_key(key)
        if name is None:
            continue
        module = key.removesuffix(".base_layer.weight")
        keys = (key, *adapter_keys(module)) if module != key and module in layers else (key,)
        changing[name] = any(k not in params or params[k].requires_grad for k in keys)
    return changing


def sync_groups(names: Iterable[str]) -> dict[str, list[str]]:
    """Tensor names grouped by the parent of the module that owns them (`a.b.self_attn.q_proj.weight` ->
    `a.b.self_attn`): what an engine may fuse into one layer (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`,
    a MoE block's experts) lies within one group, and its in-place reload needs every tensor of a layer it loads
    (vLLM's rebuilds a layer on fresh memory: a part left out would be garbage). A partial sync sends whole groups."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(name.rsplit(".", 2)[0] if name.count(".") >= 2 else "", []).append(name)
    return groups


def merged_plans(adapter: StateDictAdapter, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The family adapter's HF plans of `merged_tensors`' names (`mmfsdp.ckpt.plan_to_hf`): shapes and dtypes from
    `state`, a LoRA layer's base weight under its own name, no adapter tensor."""
    from mmfsdp.ckpt.adapters import plan_to_hf
    from mmfsdp.ckpt.lora import stored_key

    return plan_to_hf(adapter, {stored_key(k): (tuple(v.shape), v.dtype) for k, v in state.items()
                                if stored_key(k) is not None})


class VLLMServerError(RuntimeError):
    """The vLLM server died, refused a request or did not answer in time."""


def collapse_media(prompt_ids: Sequence[int], media_token_ids: frozenset[int]) -> list[int]:
    """`prompt_ids` with every run of one repeated media token (an expanded image placeholder) cut to one token."""
    out: list[int] = []
    for token in prompt_ids:
        if not (out and token == out[-1] and token in media_token_ids):
            out.append(token)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_vllm_server(python: str, model_dir: str, *, architecture: str | None = None, dtype: str = "float32",
                       max_model_len: int = 2048, seed: int = 0, startup_timeout_s: float = 600.0, dummy: bool = False,
                       log_path: str | os.PathLike | None = None,
                       time_kernels: bool = False) -> tuple[subprocess.Popen, str, bytes]:
    """Start `vllm_server.py` with `python` on the HF directory `model_dir` and wait until it accepts a
    connection. Returns (process, address, authkey); its output goes to `log_path`. `dummy`: random weights (the
    first sync sends every checkpoint tensor) -- not for Qwen-VL on vLLM 0.32: its vision input normalisation
    (`FusedMMInputNorm`) holds mean and std as parameters no checkpoint carries, which dummy loading randomises.
    `time_kernels`: the server times vLLM's kernel repacking in each sync (measurement: `tools/bench/rollout.py`)."""
    if not Path(python).exists():
        raise VLLMServerError(f"no Python at {python}: build the vLLM environment (uv run python "
                              "tools/vllm_env/setup.py) or set rollout.vllm.python")
    address, authkey = f"127.0.0.1:{_free_port()}", secrets.token_bytes(16)
    command = [python, str(SERVER_SCRIPT), "--model", str(model_dir), "--address", address, "--dtype", dtype, "--max-model-len", str(max_model_len), "--seed", str(seed),
               "--parent-pid", str(os.getpid())]
    if architecture:
        command += ["--architecture", architecture]
    if dummy:
        command.append("--dummy")
    if time_kernels:
        command.append("--time-kernels")
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               env={**env, "VLLM_SERVER_AUTHKEY": authkey.hex()})
    deadline = time.monotonic() + startup_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise VLLMServerError(f"the vLLM server exited with code {process.returncode} while starting"
                                  + (f" (its log: {log_path})" if log_path else ""))
        try:
            Client(_parse(address), authkey=authkey).close()
            return process, address, authkey
        except (ConnectionRefusedError, FileNotFoundError):
            time.sleep(0.5)
    process.kill()
    raise VLLMServerError(f"the vLLM server did not start within {startup_timeout_s:.0f} s")


def write_start_export(model: nn.Module, adapter: StateDictAdapter, assets: Path, out: Path) -> Path:
    """An HF directory of `model`'s weights (a LoRA model's merged, `merged_tensors`) for a server to start from:
    `assets`' config and processor files, completed as an export's (`architectures`, generation config), and one
    safetensors file of the tensors in HF names. Every rank calls it (one `full_tensor` collective per tensor: one
    tensor whole at a time); rank 0 writes the tensors to the file as they come and publishes the directory; the
    others wait for it."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from mmfsdp.ckpt.export_config import write_export_config
    from mmfsdp.ckpt.outputs import copy_model_assets, prepare_output_dir, publish_output_dir

    state = get_model_state_dict(model)
    plans = merged_plans(adapter, state)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    tensors: dict[str, torch.Tensor] = {}
    for name, full in merged_tensors(model, state):  # a LoRA model's merged weights
        if rank0:
            tensors.update({k: v.detach().to("cpu").contiguous() for k, v in plans[name].pieces(full).items()})
    if rank0:
        tmp = prepare_output_dir(out, True, "rollout start export")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        copy_model_assets(assets, tmp)
        write_export_config(tmp, adapter, None)
        publish_output_dir(tmp, out)
    if dist.is_initialized():
        dist.barrier()
    return out


def _parse(address: str):
    host, sep, port = address.rpartition(":")
    return (host, int(port)) if sep and not address.startswith("/") else address


_CHUNK_PREFIX = "mmfsdp-vllm-"


def _remove_stale_chunks(directory: Path) -> None:
    """Remove the chunk files of engines whose process is gone (killed before its `close`): a file in `/dev/shm`
    holds its memory until it is removed."""
    for path in directory.glob(f"{_CHUNK_PREFIX}*"):
        pid = path.name[len(_CHUNK_PREFIX):].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except PermissionError:  # another user's live process
            pass


class _Chunk:
    """One shared-memory file a sync writes its tensors into, mapped for the whole life of the engine."""

    def __init__(self, path: Path, size: int):
        self.path, self.size = path, size
        with open(path, "wb") as f:
            f.truncate(size)
        fd = os.open(path, os.O_RDWR)
        try:  # kept from sync to sync: a page is zeroed and faulted in once, when a sync first writes it
            self.buffer = mmap.mmap(fd, size)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.buffer.close()
        self.path.unlink(missing_ok=True)


class _ChunkPool:
    """Rank 0's chunk files (`_Chunk`): a file goes back into use only once the server no longer maps any of its
    bytes (the server loads straight from the chunk, and may hold a tensor of it until the tensor's layer is
    complete: `vllm_server.Server.load`). Usually one file serves every chunk of every sync; a file the server
    still maps after a finished sync is dropped (unlinked: its memory lives as long as the server's mapping)."""

    def __init__(self, size: int, directory: Path | None = None):
        self.size = size
        self.free: list[_Chunk] = []
        self.lent: list[_Chunk] = []
        if directory is None:
            directory = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        _remove_stale_chunks(directory)
        self._prefix = directory / f"{_CHUNK_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self.files = 0
        """Files made so far."""
        self.sent = 0
        """Chunks handed to the server so far."""
        self.held = 0
        """Chunks the server still mapped when it acknowledged them."""

    def take(self, nbytes: int) -> _Chunk:
        for i, chunk in enumerate(self.free):
            if chunk.size >= nbytes:
                return self.free.pop(i)
        self.files += 1
        return _Chunk(Path(f"{self._prefix}-{self.files}"), max(self.size, nbytes))

    def put_back(self, chunk: _Chunk) -> None:
        if chunk.size > self.size:  # an outsized one-off
            chunk.close()
        else:
            self.free.append(chunk)

    def lend(self, chunk: _Chunk) -> None:
        self.lent.append(chunk)
        self.sent += 1

    def settle(self, busy: list[str], done: bool) -> None:
        """The server's answer: `busy`, the files it still maps; `done`, the sync is over."""
        held = set(busy)
        self.held += str(self.lent[-1].path) in held if self.lent else 0
        for chunk in list(self.lent):
            if str(chunk.path) not in held:
                self.lent.remove(chunk)
                self.put_back(chunk)
            elif done:
                self.lent.remove(chunk)
                chunk.close()

    def close(self) -> None:
        for chunk in self.free + self.lent:
            chunk.close()
        self.free, self.lent = [], []


class VLLMRolloutEngine:
    """Rollouts from a vLLM server (module docstring): a `RolloutEngine`. Rank 0 gives `address` and `authkey`
    (the other ranks' are unused); `process` is a server this engine launched (killed by `close`)."""

    def __init__(self, address: str | None, authkey: bytes | None, *, adapter: StateDictAdapter,
                 media_token_ids: frozenset[int] = frozenset(), process: subprocess.Popen | None = None,
                 group: dist.ProcessGroup | None = None, timeout_s: float = 600.0, chunk_bytes: int = 256 << 20):
        self.adapter = adapter
        self.media_token_ids = frozenset(media_token_ids)
        self.process = process
        self.group = group
        self.timeout_s = timeout_s
        self.chunk_bytes = chunk_bytes
        self._weights_version = 0
        self._chunks = _ChunkPool(chunk_bytes)
        self.last_sync: dict[str, float] = {}
        """Rank 0's last sync: `seconds`, `bytes`, `gbps`, `tensors` sent and `skipped` (frozen ones the server
        holds); the server's `reload_s` (and `kernel_s` from a server started with `time_kernels`) when reported."""
        self._server_timing: dict[str, float] = {}
        self._constant: set[str] = set()
        """Names of frozen tensors whose current value the server holds (after a sync, every frozen one)."""
        self._conn: Connection | None = None
        if self._rank() == 0:
            if address is None or authkey is None:
                raise ValueError("rank 0 needs the server's address and authkey")
            try:
                self._conn = Client(_parse(address), authkey=authkey)
            except OSError as e:
                raise VLLMServerError(f"cannot connect to the vLLM server at {address}: {e}") from None
            self._weights_version = self._call({"op": "info"})["version"]

    # -- plumbing ------------------------------------------------------------------------------------------------
    def _rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_available() and dist.is_initialized() else 0

    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1

    def _call(self, message: dict[str, Any]) -> dict[str, Any]:
        """Rank 0: send `message`, wait for the answer (the server alive, within `timeout_s`)."""
        assert self._conn is not None
        try:
            self._conn.send(message)
            deadline = time.monotonic() + self.timeout_s
            while not self._conn.poll(1.0):
                if self.process is not None and self.process.poll() is not None:
                    raise VLLMServerError(f"the vLLM server exited with code {self.process.returncode}")
                if time.monotonic() > deadline:
                    raise VLLMServerError(f"the vLLM server did not answer {message['op']!r} within "
                                          f"{self.timeout_s:.0f} s")
            reply = self._conn.recv()
        except (EOFError, OSError) as e:
            raise VLLMServerError(f"lost the vLLM server during {message['op']!r}: {type(e).__name__}: {e}") from None
        if not reply.get("ok"):
            raise VLLMServerError(f"the vLLM server refused {message['op']!r}: {reply.get('error')}")
        return reply

    def _share(self, error: str | None) -> None:
        """Every rank raises `error` (rank 0's) together."""
        if self._distributed():
            box = [error]
            dist.broadcast_object_list(box, src=0, group=self.group)
            error = box[0]
        if error is not None:
            raise VLLMServerError(error)

    @property
    def weights_version(self) -> int:
        return self._weights_version

    # -- weights ----------------------------------------------------------------------------------------------
    def sync_weights(self, model: nn.Module, version: int) -> None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(model)
        plans = merged_plans(self.adapter, state)
        changing = changing_tensors(model, state)
        # The server holds the current value of every frozen tensor it was sent (or skipped) at an earlier sync:
        # a group with nothing that changed since is not gathered or sent (a frozen vision tower, the layers LoRA
        # does not adapt). The first sync sends everything. Every rank decides the same (`only` is collective).
        only = {name for group in sync_groups(changing).values()
                if any(changing[n] or n not in self._constant for n in group) for name in group}
        partial = len(only) < len(changing)
        rank0, error = self._rank() == 0, None
        started, total = time.perf_counter(), 0
        self._server_timing = {}
        chunk: _Chunk | None = self._chunks.take(0) if rank0 else None
        table: list[list[Any]] = []
        offset = 0
        try:
            for name, full in merged_tensors(model, state, only):  # every rank: the collectives of `full_tensor`
                if not rank0 or error is not None:
                    continue
                for hf_name, piece in plans[name].pieces(full.detach()).items():
                    piece = piece.to("cpu").contiguous()
                    nbytes = piece.numel() * piece.element_size()
                    if offset + nbytes > chunk.size and table:
                        sent, chunk = chunk, None
                        error = self._send_chunk(sent, table, None, partial)
                        if error is not None:
                            break
                        chunk, table, offset = self._chunks.take(nbytes), [], 0
                    if nbytes > chunk.size:  # a tensor larger than a chunk: a file of its size
                        small, chunk = chunk, None
                        self._chunks.put_back(small)
                        chunk = self._chunks.take(nbytes)
                    torch.frombuffer(chunk.buffer, dtype=torch.uint8, count=nbytes, offset=offset).copy_(
                        piece.reshape(-1).view(torch.uint8))
                    table.append([hf_name, str(piece.dtype).removeprefix("torch."), list(piece.shape), offset])
                    offset, total = offset + nbytes, total + nbytes
            if rank0 and error is None:
                sent, chunk = chunk, None
                error = self._send_chunk(sent, table, version, partial)
        finally:
            if chunk is not None:  # not handed over (an error before): back into the pool
                self._chunks.put_back(chunk)
        try:
            self._share(error)
        except VLLMServerError:
            self._constant = set()  # a reload that failed part-way may have left any layer behind: resend all
            raise
        self._weights_version = version
        self._constant = {name for name, moves in changing.items() if not moves}
        seconds = time.perf_counter() - started
        self.last_sync = {"seconds": seconds, "bytes": float(total), "gbps": total / seconds / 1e9 if total else 0.0,
                          "tensors": float(len(only)), "skipped": float(len(changing) - len(only)),
                          **self._server_timing}

    def _send_chunk(self, chunk: "_Chunk", table: list[list[Any]], version: int | None,
                    partial: bool) -> str | None:
        """Hand `chunk` to the server; the files its answer lists as still mapped stay out of use (a server that
        answers without the list copies what it reads: nothing is held)."""
        self._chunks.lend(chunk)
        try:
            reply = self._call({"op": "load", "path": str(chunk.path), "tensors": table, "version": version,
                                "partial": partial})
        except VLLMServerError as e:
            return str(e)
        self._chunks.settle(reply.get("busy", []), done=version is not None)
        self._server_timing = {k: float(reply[k]) for k in ("reload_s", "kernel_s") if k in reply}
        return None

    # -- generation -----------------------------------------------------------------------------------------
    def generate(self, requests: Sequence[RolloutRequest], sampling: SamplingParams, step: int) -> list[Rollout]:
        mine = [(r.prompt_index, list(r.prompt_ids), r.num_generations, tuple(r.images)) for r in requests]
        problems = [p for p in map(RolloutRequest.problem, requests) if p is not None]
        if self._distributed():
            gathered = [None] * dist.get_world_size(self.group) if self._rank() == 0 else None
            dist.gather_object((mine, problems), gathered, dst=0, group=self.group)
        else:
            gathered = [(mine, problems)]
        results: list[Any] = []
        if self._rank() == 0:
            try:
                results = self._generate(gathered, sampling, step)
            except VLLMServerError as e:
                results = [str(e)] * len(gathered)
        if self._distributed():
            box: list[Any] = [None]
            dist.scatter_object_list(box, results if self._rank() == 0 else None, src=0, group=self.group)
            result = box[0]
        else:
            result = results[0]
        if isinstance(result, str):
            raise VLLMServerError(result)
        return result

    def _generate(self, gathered: list[Any], sampling: SamplingParams, step: int) -> list[list[Rollout] | str]:
        problems = [p for _, ps in gathered for p in ps]
        if problems:
            return [f"invalid rollout request: {problems[0]}"] * len(gathered)
        rows, payload = [], []
        for rank, (mine, _) in enumerate(gathered):
            for prompt_index, prompt_ids, count, images in mine:
                keys = row_keys(sampling.seed, step, torch.full((count,), prompt_index), torch.arange(count))
                for g, key in enumerate(keys.tolist()):
                    rows.append((rank, prompt_index, g, prompt_ids))
                    payload.append({"prompt_token_ids": collapse_media(prompt_ids, self.media_token_ids),
                                    "images": list(images), "seed": int(key) & 0x7FFFFFFF})
        spec = {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                "max_tokens": sampling.max_new_tokens, "stop_token_ids": list(sampling.stop_token_ids),
                "logit_bias": [(t, -100.0) for t in sampling.suppress_token_ids]}
        outputs = self._call({"op": "generate", "version": self._weights_version, "sampling": spec,
                              "requests": payload})["outputs"] if payload else []
        per_rank: list[list[Rollout] | str] = [[] for _ in gathered]
        for (rank, prompt_index, g, prompt_ids), out in zip(rows, outputs):
            if out["prompt_token_ids"] != prompt_ids:
                raise VLLMServerError(
                    f"prompt {prompt_index}: vLLM's processor expands the prompt to {len(out['prompt_token_ids'])} "
                    f"tokens, ours to {len(prompt_ids)}: the two processors' image settings differ")
            per_rank[rank].append(Rollout(
                prompt_index=prompt_index, generation_index=g, completion_ids=out["token_ids"],
                logprobs=out["logprobs"], finish_reason=out["finish_reason"], weights_version=self._weights_version))
        return per_rank

    def close(self) -> None:
        """Close the connection; stop a server this engine launched (waiting at most 10 s, then killing it);
        remove the chunk files."""
        self._chunks.close()
        if self._conn is not None:
            try:
                if self.process is not None:
                    self._conn.send({"op": "close"})
                self._conn.close()
            except OSError:
                pass
            self._conn = None
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

