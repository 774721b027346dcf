"""The trainer's command line: options anywhere, help for every flag, sizes, ETA, the config-reference tool."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from mmfsdp.train import metrics
from mmfsdp.train.cli import _parse_size, _parser, main
from mmfsdp.train.metrics import MetricsWriter

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "examples" / "tiny" / "config.yaml"
GEN = ROOT / "tools" / "gen_config_reference.py"
DOC = ROOT / "docs" / "configuration.md"


def test_options_may_follow_the_config_and_the_overrides(capsys):
    code = main([str(TINY), "--nproc-per-node", "2", "training.lr=2.5e-4", "--check"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "lr: 0.00025" in captured.out
    assert "Traceback" not in captured.err


def test_options_between_overrides_keep_every_override():
    args = _parser().parse_intermixed_args(
        [str(TINY), "training.lr=1e-4", "--nproc-per-node", "2", "training.seed=7", "--check"]
    )
    assert args.config == str(TINY)
    assert args.overrides == ["training.lr=1e-4", "training.seed=7"]
    assert args.nproc_per_node == "2" and args.check


def test_help_explains_every_flag():
    text = _parser().format_help()
    for action in _parser()._actions:
        for flag in action.option_strings:
            assert flag in text
        assert action.help, f"{action.dest} has no help text"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("64GiB", 64 * 2**30), ("80GB", 80 * 10**9), ("1024", 1024), ("1.5TiB", int(1.5 * 2**40)), ("512mib", 512 * 2**20)],
)
def test_device_memory_sizes(text, expected):
    assert _parse_size(text) == expected
    assert _parser().parse_intermixed_args(["--device-memory", text]).device_memory == expected


def test_a_bad_device_memory_is_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_intermixed_args(["--device-memory", "lots"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--device-memory" in err and "64GiB" in err


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_eta_counts_the_steps_done_since_the_timer_started(tmp_path, monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(metrics.time, "perf_counter", clock)
    writer = MetricsWriter(tmp_path, total_steps=100)
    clock.now += 20.0  # 10 steps of 2 s before the first logged step (log_interval 10)
    assert writer.eta_s(10) == pytest.approx(2.0 * 90)
    clock.now += 20.0
    assert writer.eta_s(20) == pytest.approx(2.0 * 80)


def test_eta_of_a_resumed_run_counts_from_the_resumed_step(tmp_path, monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(metrics.time, "perf_counter", clock)
    writer = MetricsWriter(tmp_path, total_steps=100, start_step=60)
    clock.now += 15.0  # 5 steps of 3 s after resuming at step 60
    assert writer.eta_s(65) == pytest.approx(3.0 * 35)


def test_the_logged_line_shows_that_eta(tmp_path, monkeypatch, caplog):
    clock = _Clock()
    monkeypatch.setattr(metrics.time, "perf_counter", clock)
    writer = MetricsWriter(tmp_path, total_steps=100)
    clock.now += 40.0  # 20 steps of 2 s: 80 left = 160 s
    record = {"step": 20, "loss": 1.0, "grad_norm": 0.5, "lr": 1e-4, "num_tokens": 10, "tokens_per_s": 5.0,
              "step_time_s": 2.0, "peak_mem_gb": 0.0}
    with caplog.at_level("INFO", logger="mmfsdp.train"):
        writer.log_step(record)
    assert "ETA 02:40" in caplog.text
    assert (tmp_path / "metrics.jsonl").is_file()


def _gen(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(GEN), *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_gen_config_reference_help_does_not_write():
    before = DOC.stat().st_mtime_ns, DOC.read_bytes()
    result = _gen("-h")
    assert result.returncode == 0, result.stderr
    assert "--write" in result.stdout and "--check" in result.stdout
    assert (DOC.stat().st_mtime_ns, DOC.read_bytes()) == before


def _gen_module():
    spec = importlib.util.spec_from_file_location("gen_config_reference", GEN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_configuration_md_is_current(capsys):
    code = _gen_module().main(["--check"])
    assert code == 0, capsys.readouterr().err + "\nrun `uv run python tools/gen_config_reference.py --write`"


def test_gen_config_reference_check_names_a_stale_file(tmp_path, monkeypatch, capsys):
    module = _gen_module()
    stale = tmp_path / "configuration.md"
    stale.write_text("# old\n")
    monkeypatch.setattr(module, "DOC", stale)
    assert module.main(["--check"]) == 1
    assert "stale" in capsys.readouterr().err
    assert module.main([]) == 1  # no flag checks too, and never rewrites
    assert stale.read_text() == "# old\n"
    assert module.main(["--write"]) == 0
    assert module.main(["--check"]) == 0
