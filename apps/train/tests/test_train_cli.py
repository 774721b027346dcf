"""The command line: options anywhere, sizes for --device-memory, the launcher's one failure line."""

import os

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


class _Failure:
    def __init__(self, exitcode):
        self.exitcode = exitcode


class _AgentError(Exception):
    def __init__(self, failures):
        super().__init__("child failed")
        self.failures = {rank: _Failure(code) for rank, code in failures.items()}


@pytest.mark.parametrize("failures,report,hint", [
    ({0: 124}, False, True),  # the hung rank's own exit code
    ({1: -9}, True, True),  # the agent saw the stopped rank (killed) end first; the hang report says what happened
    ({1: -9}, False, False),  # killed, and no rank reported a hang
])
def test_the_failure_line_names_a_hang_by_its_code_or_its_report(tmp_path, capsys, failures, report, hint):
    from mmfsdp.train.cli import _run_agent

    def run():
        if report:
            (tmp_path / "hang_rank0.txt").write_text("[rank 0] no progress for 10 s\n")
        raise _AgentError(failures)

    (tmp_path / "hang_rank1.txt").write_text("an earlier run's report\n")  # older than this launch: not counted
    os.utime(tmp_path / "hang_rank1.txt", (1.0, 1.0))
    assert _run_agent(run, tmp_path) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    rank, code = next(iter(failures.items()))
    assert line.startswith(f"training failed: rank {rank} exited with code {code}")
    assert ("no progress: see hang_rank*.txt" in line) == hint, line


def test_rendezvous_events_are_named_from_the_frame_as_torch_names_them():
    """`_cheap_rendezvous_event_names` swaps torch's `get_method_name` (`inspect.stack()[depth].function`, which
    reads back every frame's source) for `_frame_name`: the same name at every depth, and the same fallback."""
    import inspect

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from mmfsdp.train.cli import _cheap_rendezvous_event_names, _frame_name

    def torchs(depth=2):  # torch's definition
        stack = inspect.stack()
        return stack[depth].function if len(stack) > depth else "no_method_name"

    def caller_of_record(depth):
        return record(depth)

    def record(depth):
        return torchs(depth), _frame_name(depth)

    for depth in (2, 3, 4):
        ours_vs_torch = caller_of_record(depth)
        assert ours_vs_torch[0] == ours_vs_torch[1], (depth, ours_vs_torch)
    assert _frame_name(10_000) == torchs(10_000) == "no_method_name"
    _cheap_rendezvous_event_names()
    assert dynamic_rendezvous.get_method_name is _frame_name
