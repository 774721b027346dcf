"""`fork_main`: the app run in a child forked from the calling process (the two-stage examples' and the throughput
benchmark's way to run it several times with one interpreter start): its exit status, its output in `log`, its
working directory."""

from pathlib import Path

from mmfsdp.train.cli import CONFIG_ERROR_EXIT_CODE, fork_main

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "examples" / "tiny" / "config.yaml"


def test_a_check_passes_and_a_config_error_is_its_exit_status(tmp_path, capsys):
    log = tmp_path / "check.log"
    out = f"training.output_dir={tmp_path / 'out'}"
    with capsys.disabled():  # the child's descriptors 1 and 2 go to `log`: pytest's capture would hold them instead
        good = fork_main([str(TINY), "--check", out, "--nproc-per-node", "2"], cwd=ROOT, log=log)
        good_log = log.read_text()
        # a relative config path is read from `cwd`, the child's working directory
        bad = fork_main(["examples/tiny/config.yaml", "--check", out, "training.lr=-1"], cwd=ROOT, log=log)
    assert good == 0 and "check passed: 2 processes" in good_log, good_log[-2000:]
    assert bad == CONFIG_ERROR_EXIT_CODE and "training.lr" in log.read_text()
