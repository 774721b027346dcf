"""FSDP2 parity through the real trainer: the tiny Mistral3 run, 5 steps, fp32 on gloo.

2 processes must give the same per-step losses, gradient norms and tokens as 1 process with the same global
batch, and gradient accumulation must match a doubled micro-batch (relative difference <= 1e-5). The 1-process
run is `test_e2e_cp.py`'s reference too (one run per session).
"""

import pytest

from apprun import TINY
from parity import Case, assert_matches, assert_steps, learns, run_cases, session_dir

pytestmark = pytest.mark.slow  # runs of the trainer on spawned ranks
CASES = [
    Case("single", 1, TINY, {"training.micro_batch_size": 4}, dataset="shapes64"),
    Case("double", 2, TINY, {"training.micro_batch_size": 2}, "single", dataset="shapes64", layout={"dp": 2}),
    Case("accumulated", 2, TINY, {"training.micro_batch_size": 1, "training.gradient_accumulation_steps": 2},
         "single", dataset="shapes64", layout={"dp": 2}),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases(CASES, tmp_path_factory.mktemp("parity"), session_dir(tmp_path_factory))


def test_two_processes_match_one_with_the_same_global_batch(results):
    assert_matches(results, CASES[1])
    assert learns(results["single"]), "the run should learn"


def test_gradient_accumulation_matches_a_doubled_micro_batch(results):
    assert results["accumulated"]["layout"] == results["double"]["layout"]
    assert_steps("accumulated", results["accumulated"]["steps"], results["double"]["steps"], what="(doubled)")
    assert_matches(results, CASES[2])
