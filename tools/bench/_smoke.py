"""The `--smoke` flag of the bench scripts: each script's smallest mode, the one CI runs (tests/test_tools_smoke.py).

A script names its smallest sizes where it parses its flags, `args = parse_args(parser, argv, repeats=1, hidden=64)`:
with `--smoke` every option the command line leaves out takes its smoke value instead of its default, so the smoke
run goes through the same code as a full run, only small, and prints the same JSON line last. Flags given on the
command line win over the smoke values; without `--smoke` nothing changes.
"""

from __future__ import annotations

import argparse


def doc_parser(doc: str) -> argparse.ArgumentParser:
    """A script's parser whose `-h` is its module docstring: the first paragraph as the description, the rest (the
    commands and what the script measures) as the epilog, laid out as written."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0], epilog=doc.split("\n\n", 1)[1],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None, **smoke: object) -> argparse.Namespace:
    """`parser.parse_args(argv)` with a `--smoke` flag that defaults the options named in `smoke` to those values."""
    sizes = " ".join(f"{name}={' '.join(map(str, v)) if isinstance(v, list) else v}" for name, v in smoke.items())
    parser.add_argument(
        "--smoke", action="store_true", help=f"smallest mode, the one CI runs ({sizes}; a flag given wins)"
    )
    args = parser.parse_args(argv)
    unknown = [name for name in smoke if not hasattr(args, name)]
    assert not unknown, f"smoke sizes for options the parser does not have: {unknown}"
    if not args.smoke:
        return args
    parser.set_defaults(**smoke)
    return parser.parse_args(argv)
