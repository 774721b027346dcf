"""Regenerate docs/configuration.md from the config dataclasses: `uv run python tools/gen_config_reference.py`."""

from pathlib import Path

from mmfsdp.train.config import Config
from mmfsdp.train.reference import render

if __name__ == "__main__":
    out = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
    out.write_text(render(Config))
    print(f"wrote {out}")
