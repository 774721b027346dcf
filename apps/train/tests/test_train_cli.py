"""The command line: options anywhere, sizes for --device-memory."""

import pytest

from mmfsdp.train.cli import _parse_size, _parser


def test_options_after_config_and_overrides():
    args = _parser().parse_intermixed_args(["my.yaml", "--nproc-per-node", "2", "training.lr=1e-5", "--check", "training.seed=3"])
    assert (args.config, args.nproc_per_node, args.check) == ("my.yaml", "2", True)
    assert args.overrides == ["training.lr=1e-5", "training.seed=3"]


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_intermixed_args(["-h"])
    text = capsys.readouterr().out
    for flag in ("--nproc-per-node", "--check", "--device-memory", "config", "overrides"):
        assert flag in text


@pytest.mark.parametrize("text,size", [("64GiB", 64 * 2**30), ("80GB", 80 * 10**9), ("123", 123), ("1.5KiB", 1536)])
def test_device_memory_sizes(text, size):
    assert _parse_size(text) == size
    assert _parser().parse_intermixed_args(["--device-memory", text]).device_memory == size


def test_entry_exits_with_mains_code_after_freezing_the_heap(monkeypatch):
    from mmfsdp.train import cli

    calls = []
    monkeypatch.setattr(cli, "main", lambda: calls.append("main") or 3)
    monkeypatch.setattr(cli.gc, "freeze", lambda: calls.append("freeze"))
    with pytest.raises(SystemExit) as exit_:
        cli.entry()
    assert exit_.value.code == 3 and calls == ["main", "freeze"]
