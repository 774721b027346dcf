"""Command line of the trainer: parse, check, launch ranks, train.

Without a config path the embedded default run is used
(`examples/tiny/config.yaml`). Outside torchrun the app launches its own ranks
(one per accelerator, or 2 on a CPU-only host) through torch's elastic launcher;
under torchrun every process is already a rank. The whole config is built and
checked against the world size before any process group exists. A finished run
(`mmfsdp.train.start.finished_run`) says so and exits 0 without starting a rank.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import re
import sys
import time
from pathlib import Path

from mmfsdp.config import ConfigError

DEFAULT_CONFIG = Path("examples/tiny/config.yaml")
CONFIG_ERROR_EXIT_CODE = 2


def _repo_root() -> Path:
    # apps/train/src/mmfsdp/train/cli.py -> repository root
    return Path(__file__).resolve().parents[5]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="apps/train",
        description=(
            "Train a multimodal model with FSDP2 from one YAML config. "
            "With no CONFIG, runs the embedded default: a tiny Mistral3 learning coloured shapes on 2 CPU processes."
        ),
        epilog=(
            "examples:\n"
            "  uv run apps/train\n"
            "  uv run apps/train my.yaml training.lr=1e-5 parallel.ulysses_parallel_size=2\n"
            "  torchrun --nproc-per-node 8 apps/train my.yaml\n"
            "Every config key is described in docs/configuration.md."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "config", nargs="?", default=None,
        help=f"path to the YAML config (default: {DEFAULT_CONFIG}, the embedded tiny run)",
    )
    parser.add_argument(
        "overrides", nargs="*", default=[],
        help="dotted overrides applied after the file, e.g. training.lr=1e-5 (values are read as YAML)",
    )
    parser.add_argument(
        "--nproc-per-node", default="auto", metavar="N",
        help="processes to launch when not started by torchrun: an integer, or 'auto' = one per GPU/NPU, 2 on a CPU-only host (ignored under torchrun)",
    )
    parser.add_argument(
        "--rank-start", choices=("auto", "fork", "exec"), default="auto",
        help=(
            "how the app's own launcher starts its ranks (ignored under torchrun): fork = forked from the launcher "
            "after it imported torch, transformers and the model family once (a rank starts in a second); exec = a "
            "fresh interpreter per rank, as torchrun does; auto = fork on a CPU-only host, exec with GPUs or NPUs "
            "(whose drivers a forked process cannot use after the launcher queried them)"
        ),
    )
    parser.add_argument(
        "--check", action="store_true",
        help=(
            "check without starting any process: the config and the world size, the model (built on the meta device) "
            "against every module pattern, registry names, weights, data and output paths; prints every problem, "
            "one line each, and exits 2, or prints the resolved config and exits 0 (see README.md, '--check')"
        ),
    )
    parser.add_argument(
        "--device-memory", default=None, type=_parse_size, metavar="SIZE",
        help="with --check: memory of one accelerator for the memory plan, e.g. 64GiB, 80GB or plain bytes",
    )
    parser.add_argument(
        "--image-token-share", default=1.0, type=_parse_share, metavar="FRACTION",
        help=(
            "with --check: the part of a micro-batch's tokens that are image tokens, which sets the vision tower's "
            "activations in the memory plan (default 1.0, the worst case; e.g. 0.3 for data a third images)"
        ),
    )
    return parser


def _parse_share(text: str) -> float:
    try:
        share = float(text)
    except ValueError:
        share = -1.0
    if not 0.0 <= share <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction between 0 and 1, got {text!r}")
    return share


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _parse_size(text: str) -> int:
    """`64GiB`, `80GB`, `1.5TiB` or plain bytes → bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 64GiB, 80GB or a number of bytes, got {text!r}")
    return int(float(match.group(1)) * _UNITS[unit])


def _resolve_config_path(args: argparse.Namespace) -> Path:
    if args.config is not None and "=" in args.config and not args.config.endswith((".yaml", ".yml")):
        args.overrides.insert(0, args.config)
        args.config = None
    if args.config is not None:
        return Path(args.config)
    for base in (Path.cwd(), _repo_root()):
        if (base / DEFAULT_CONFIG).is_file():
            return base / DEFAULT_CONFIG
    raise ConfigError("", f"no config given and the default {DEFAULT_CONFIG} was not found; pass a CONFIG path")


def _world_size(args: argparse.Namespace, under_torchrun: bool) -> int:
    if under_torchrun:
        return int(os.environ["WORLD_SIZE"])
    if args.nproc_per_node == "auto":
        return _auto_nproc()
    if args.nproc_per_node.isdigit() and int(args.nproc_per_node) >= 1:
        return int(args.nproc_per_node)
    raise ConfigError("--nproc-per-node", f"expected a positive integer or 'auto', got {args.nproc_per_node!r}")


def _print_check_report(cfg, world_size: int, device_memory: int | None, image_token_share: float = 1.0) -> None:
    """`--check` with no problems: the resolved config, one summary line, and the memory plan when available."""
    from mmfsdp.config import dump_yaml
    from mmfsdp.train.start import finished_run, plan_start

    print(dump_yaml(cfg))
    start = finished_run(cfg.training, cfg.model) or plan_start(cfg.training, cfg.model).describe()
    start = start.removeprefix("start: ")
    print(f"check passed: {world_size} processes, model {cfg.model.model_id}; {start}")
    from mmfsdp.train.check import kernel_setting_lines, media_setting_lines

    print("\n".join([*kernel_setting_lines(cfg), *media_setting_lines(cfg)]))
    try:
        from mmfsdp.train.memory import memory_plan_lines
    except ImportError:
        return
    for line in memory_plan_lines(cfg, world_size, device_memory, image_token_share=image_token_share):
        print(line)


# How long a rank other than 0 waits before exiting after the check failed: every rank finds the same
# problems, and an early exit would let the launcher stop rank 0 before it printed them.
_REPORT_GRACE_S = 20.0


def _speaks_for_the_job(under_torchrun: bool) -> bool:
    """Whether this process prints the job's start-up errors: the app's own launcher, or global rank 0 of a job
    started by torchrun (every rank of every node reads and checks the same config and finds the same problems)."""
    return not under_torchrun or os.environ.get("RANK", "0") == "0"


def _fail_once(lines: list[str], code: int, under_torchrun: bool) -> int:
    """Print a start-up error once per job and return `code`: the other ranks exit with the same code in silence,
    after a grace that lets rank 0 print before its launcher stops it."""
    if _speaks_for_the_job(under_torchrun):
        for line in lines:
            print(line, file=sys.stderr)
        sys.stderr.flush()
    else:
        time.sleep(_REPORT_GRACE_S)
    return code


def _config_errors(errors: list[ConfigError], under_torchrun: bool) -> int:
    return _fail_once([f"config error: {err}" for err in errors], CONFIG_ERROR_EXIT_CODE, under_torchrun)


def _device_type() -> str:
    from mmfsdp.parallel import detect_device_type

    return detect_device_type()


def _auto_nproc() -> int:
    from mmfsdp.parallel import detect_device_type, device_count

    device_type = detect_device_type()
    return device_count(device_type) if device_type != "cpu" else 2


def _start_log(output_dir: str) -> None:
    """The launcher's log file, named in the first line it holds (`mmfsdp.train.console`)."""
    from mmfsdp.config import get_logger
    from mmfsdp.train.console import start_console_log

    log = get_logger("mmfsdp.train")
    try:
        path = start_console_log(output_dir)
    except OSError as err:  # a run that cannot write its log file still trains; the console says why
        log.warning(f"WARNING: no log file under {output_dir}/logs: {err}")
        return
    log.info(f"log: {path} (this console: the launcher and every rank)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_intermixed_args(argv)  # options may come after CONFIG and the overrides
    under_torchrun = "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ
    from mmfsdp.train import supervise

    if under_torchrun:
        supervise.guard_rank()
    else:
        supervise.watch_launcher_parent()
    from mmfsdp.train.check import deep_check, host_check, model_check
    from mmfsdp.train.config import read_config, warn_ignored_keys

    try:
        path = _resolve_config_path(args)
        cfg, errors, translated = read_config(path, args.overrides)
        world_size = _world_size(args, under_torchrun)
    except ConfigError as err:
        return _config_errors(getattr(err, "errors", [err]), under_torchrun)
    if args.check and translated.warning() is not None:  # part of the report, whatever else the check finds
        print(f"warning: {translated.warning()}")
    # the --check report has it; a rank of the app's launcher leaves it to the launcher, which has said it already
    warns = not args.check and not (under_torchrun and supervise.LAUNCHER_PID_ENV in os.environ)
    # The app's own launcher checks what needs no model code and leaves the model checks to its ranks,
    # which import the model anyway: the launcher itself never pays for importing transformers.
    launching = not under_torchrun and not args.check and world_size > 1
    if launching:
        errors += host_check(cfg, world_size)
    elif under_torchrun and supervise.LAUNCHER_PID_ENV in os.environ:
        errors += model_check(cfg)
    else:
        errors += deep_check(cfg, world_size)
    if errors:
        if warns:
            warn_ignored_keys(translated)
        return _config_errors(errors, under_torchrun)
    if args.check:
        _print_check_report(cfg, world_size, args.device_memory, args.image_token_share)
        return 0
    if not under_torchrun:  # the app is the launcher: its console, and every rank's, also goes to a file
        _start_log(cfg.training.output_dir)
    if warns:
        warn_ignored_keys(translated)

    if not under_torchrun and cfg.training.save:
        from mmfsdp.ckpt import CheckpointError

        try:
            supervise.take_save_lock(cfg.training.save)
        except CheckpointError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        os.environ[supervise.SAVE_LOCKED_ENV] = "1"  # the ranks below run under this lock
    if cfg.training.save:
        from mmfsdp.config import get_logger
        from mmfsdp.train.start import finished_run

        finished = finished_run(cfg.training, cfg.model)
        if finished is not None:  # nothing to train: no data to prepare, no rank to start
            if _speaks_for_the_job(under_torchrun):
                get_logger("mmfsdp.train").info(finished)
            return 0
    from mmfsdp.data import DataError, prepare_dataset

    try:
        prepare_dataset(cfg.data)
    except (ConfigError, DataError) as err:
        return _fail_once([f"data error: {err}"], CONFIG_ERROR_EXIT_CODE, under_torchrun)
    if not under_torchrun and world_size > 1:
        worker_args = [str(path), *args.overrides]
        if args.rank_start == "exec" or (args.rank_start == "auto" and _device_type() != "cpu"):
            return _launch(world_size, worker_args, cfg.training.output_dir)
        return _launch_forked(world_size, worker_args, cfg.model.model_id,
                              ("peft",) if cfg.training.lora.enable else (), cfg.training.output_dir)
    from mmfsdp.train.trainer import run

    return run(cfg)


def entry() -> None:
    """The process entry of `apps/train` and `python -m mmfsdp.train`: `main`, then exit with its code. The objects
    torch and transformers made are frozen first, so the interpreter's exit does not collect them one by one (about
    2 s of CPU in the launcher and in every rank torchrun starts); the process returns their memory anyway, and
    `atexit` handlers and the flush of open files run as before."""
    code = main()
    gc.freeze()
    raise SystemExit(code)


def _launch(world_size: int, worker_args: list[str], output_dir: str | None = None) -> int:
    """Start `world_size` local ranks of this same command through torch's elastic launcher (torchrun's way:
    a fresh interpreter per rank)."""
    from torch.distributed.run import main as torchrun_main

    from mmfsdp.train import supervise

    script = sys.argv[0]
    if script in ("-c", "") or not Path(script).exists():
        script = str(Path(__file__).with_name("__main__.py"))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ[supervise.LAUNCHER_PID_ENV] = str(os.getpid())  # ranks exit when this process is gone
    launch_args = ["--standalone", f"--nproc-per-node={world_size}", "--max-restarts=0", script, *worker_args]
    return _run_agent(lambda: torchrun_main(launch_args), output_dir)


RANK_PRELOAD = (
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.tensor",
    "transformers",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.auto.processing_auto",
    "transformers.models.auto.image_processing_auto",
    "datasets",  # the token cache's arrow files (and pandas, which it imports)
    "mmfsdp.data",
    "mmfsdp.data.all_families",
    "mmfsdp.train.trainer",
    "mmfsdp.train.check",
    "mmfsdp.train.evaluate",
    "mmfsdp.model.parallelize",  # the FSDP2 plan, checkpointing and the trainer's optimizer (imported at build)
    "mmfsdp.parallel.shard_adamw",
    # a processor's class checks import it (its tokenizer may be any of the allowed classes), ~0.5 s; it needs the
    # optional mistral-common package, so a failed import is skipped
    "transformers.tokenization_mistral_common",
)
"""What the launcher imports before it forks ranks: what every rank imports anyway (its first lookups of a
tokenizer, processor, template and token cache import these lazily), so it is paid once, not once per rank; the
test suite's rank forkserver preloads the same (conftest.py). A module that fails to import is skipped (the rank
imports it itself if it needs it, as multiprocessing's forkserver preload does)."""


def _launch_forked(world_size: int, worker_args: list[str], model_id: str, extra: tuple[str, ...] = (),
                   output_dir: str | None = None) -> int:
    """Start `world_size` local ranks through torch's elastic launcher, forked from this process.

    This launcher first imports torch, transformers, the trainer, the config's model family and `extra` (PEFT
    for a LoRA run: ~0.2 s a rank), then the elastic agent (torchrun's: rendezvous, failure handling, SIGTERM to
    the ranks on a failure) forks each rank from that state: a rank starts in about a second instead of
    re-importing for ten or more.
    The ranks are this process's children, as with torchrun, so `guard_rank` and the other supervision
    hold unchanged. Used on CPU-only hosts (`--rank-start auto`): nothing has touched an accelerator
    driver there, which a forked rank could not use again.
    """
    import importlib
    import uuid

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from mmfsdp.train import supervise

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch's OpenMP runtime loads, which reads it once
    family = _family_module(model_id)
    preload_app()
    for module in (family, *extra) if family else extra:
        importlib.import_module(module)
    # the ranks fork from here: none of them scans these imports in a full collection (the launcher's own process
    # only: `fork_main` runs this in its child, never in the process that calls it, e.g. a test worker)
    from mmfsdp.parallel.device import freeze_startup_heap

    freeze_startup_heap()
    os.environ[supervise.LAUNCHER_PID_ENV] = str(os.getpid())  # ranks exit when this process is gone
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=world_size, run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, start_method="fork",
    )
    return _run_agent(lambda: elastic_launch(config, _forked_rank)(worker_args), output_dir)


def _family_module(model_id: str) -> str | None:
    """The module that registers `model_id` (its entry point), for the launcher to import before forking."""
    from importlib.metadata import entry_points

    for point in entry_points(group="mmfsdp.model_families"):
        if point.name == model_id:
            return point.module
    return None


def _forked_rank(worker_args: list[str]) -> None:
    """A rank forked by the elastic agent: `main` as a rank, its exit code kept (the agent reads it)."""
    import signal

    # The fork inherited the agent's handlers (SIGTERM raises in the agent): a rank ends as an exec'd one would.
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code = main(worker_args)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        os._exit(code)


def _hang_reports(output_dir: str | os.PathLike | None, since: float) -> list[str]:
    """The `hang_rank<r>.txt` reports ranks of this launch wrote (newer than `since`), by name."""
    if not output_dir:
        return []
    try:
        return sorted(path.name for path in Path(output_dir).glob("hang_rank*.txt") if path.stat().st_mtime >= since)
    except OSError:
        return []


def _frame_name(depth: int = 2) -> str:
    """`dynamic_rendezvous.get_method_name`'s answer (the name of the function `depth` frames above this one)
    read from the frame itself."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


def _cheap_rendezvous_event_names() -> None:
    """torch's dynamic rendezvous names every event it records after its caller, found through `inspect.stack()`:
    the source of every frame read back and `inspect.getmodule` run over all of `sys.modules` (thousands of
    modules once torch and transformers are imported), twice per event. Sampling the test suite's processes put
    ~50 CPU-seconds there, about a second per launch of a tiny run. The same name, from the frame."""
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    except ImportError:
        return
    if callable(getattr(dynamic_rendezvous, "get_method_name", None)):
        dynamic_rendezvous.get_method_name = _frame_name


def _run_agent(run, output_dir: str | os.PathLike | None = None) -> int:
    """Run the elastic agent; a failed rank is one line (the rank already printed its error). A rank that made no
    progress is named by its exit code or, where the agent saw another rank end first (the stopped rank it
    killed), by the report it wrote in `output_dir`."""
    from mmfsdp.train import supervise

    _cheap_rendezvous_event_names()
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):  # its per-rank failure report repeats what the rank printed
            logging.getLogger(name).setLevel(logging.CRITICAL)
    started = time.time() - 1.0  # file times are coarser than the clock on some filesystems
    try:
        run()
    except Exception as err:  # the failing rank already printed its error
        failures = getattr(err, "failures", None) or {}
        failed = sorted((rank, f.exitcode) for rank, f in failures.items())  # keyed by global rank
        if failed and all(code == CONFIG_ERROR_EXIT_CODE for _, code in failed):
            return CONFIG_ERROR_EXIT_CODE  # rank 0 printed the check's problems; nothing more to say
        first = [item for item in failed if item[1] > 0] or failed
        what = ", ".join(f"rank {rank} exited with code {code}" for rank, code in first) or str(err).splitlines()[0]
        hung = any(c == supervise.HANG_EXIT_CODE for _, c in first) or _hang_reports(output_dir, started)
        hang = " (no progress: see hang_rank*.txt in training.output_dir)" if hung else ""
        print(f"training failed: {what}{hang}; the other ranks were stopped; see the messages above", file=sys.stderr)
        return 1
    return 0


def preload_app() -> None:
    """Import what the launcher imports before it starts ranks (`RANK_PRELOAD`); a module that fails is skipped."""
    import importlib

    for name in RANK_PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def _forked_main(argv: list[str], cwd: str | None, log: str | None) -> None:
    """The child of `fork_main`: `main(argv)` as `apps/train ARGV` runs it, its exit status the process's."""
    import atexit

    if log is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    if cwd is not None:
        os.chdir(cwd)
    sys.argv = [str(Path(__file__).with_name("__main__.py")), *argv]  # what the torchrun path starts ranks with
    try:
        code = main(argv)
    finally:
        atexit._run_exitfuncs()  # a multiprocessing child ends with os._exit, which skips them
    sys.exit(code)


def fork_main(argv: list[str], *, cwd: str | os.PathLike | None = None, log: str | os.PathLike | None = None) -> int:
    """Run the app with `argv` (`uv run apps/train ARGV`) in a child forked from this process, after importing
    what its launcher imports (`preload_app`, once per process): a driver that runs the app several times (the
    two-stage examples, the benchmarks) starts one interpreter and imports torch and transformers once, not once
    per run. `cwd`: the child's working directory; `log`: a file that gets its stdout and stderr (else this
    process's). Nothing here touches an accelerator's driver (importing torch does not), so the app starts its
    ranks as it always does on that host. Returns the exit status (128 + N for a child killed by signal N)."""
    import multiprocessing

    preload_app()
    process = multiprocessing.get_context("fork").Process(
        target=_forked_main, args=(list(argv), None if cwd is None else os.fspath(cwd),
                                   None if log is None else os.fspath(log)), name="apps/train")
    process.start()
    process.join()
    code = process.exitcode or 0
    return code if code >= 0 else 128 - code
