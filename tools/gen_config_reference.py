"""Generate docs/configuration.md from the config dataclasses.

`uv run python tools/gen_config_reference.py --write` regenerates the file;
`--check` exits 1 when it is stale (0 when current). Without a flag it checks
and never rewrites the file.
"""

import argparse
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/gen_config_reference.py",
        description="Generate the configuration reference docs/configuration.md from the config dataclasses "
        "(every key, its type, default and one-line docstring). With no flag: the same as --check.",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"regenerate {DOC.name} in place")
    mode.add_argument("--check", action="store_true", help=f"exit 1 if {DOC.name} is stale, 0 if it is current (the default)")
    args = parser.parse_args(argv)
    from mmfsdp.train.config import Config  # after parsing: `-h` answers without importing torch
    from mmfsdp.train.reference import render

    text = render(Config)
    if args.write:
        DOC.write_text(text)
        print(f"wrote {DOC}")
        return 0
    if not DOC.is_file() or DOC.read_text() != text:
        print(f"{DOC} is stale: run `uv run python tools/gen_config_reference.py --write`", file=sys.stderr)
        return 1
    print(f"{DOC} is current")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
