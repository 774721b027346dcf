"""Context parallel through the real trainer: the tiny Mistral3 run (4 heads, 2 KV heads), fp32 on gloo.

Ulysses 2 on 2 processes gives the same per-step losses and gradient norms as
1 process with the same batches (relative difference <= 1e-5); so does Ring 2
with packing, where the trainer pads every packed sample to the multiple CP
splits by. CP ranks share one data stream, so the micro-batch is the same as
for the single process. The 1-process reference is `test_e2e_fsdp_parity.py`'s too.
"""

import pytest

from apprun import TINY
from parity import Case, PadSamplesAsRing2, assert_matches, learns, run_cases, session_dir

pytestmark = pytest.mark.slow  # runs of the trainer on spawned ranks
PACKED = {
    "data.dataset_param.basic_parameters.packing": "true",
    "data.dataset_param.preprocess_parameters.cutoff_len": 128,
    "training.micro_batch_size": 1,
}
CASES = [
    Case("single", 1, TINY, {"training.micro_batch_size": 4}, dataset="shapes64"),
    Case("single_packed", 1, TINY, PACKED, dataset="shapes64", probes=(PadSamplesAsRing2,)),
    Case("ulysses2", 2, TINY, {"training.micro_batch_size": 4, "parallel.ulysses_parallel_size": 2}, "single",
         dataset="shapes64", layout={"dp": 1, "ulysses": 2}),
    Case("ring2_packed", 2, TINY, {**PACKED, "parallel.ring_attention_size": 2}, "single_packed", dataset="shapes64",
         layout={"dp": 1, "ring": 2}),
]


def test_cp_on_two_processes_matches_one(tmp_path_factory):
    results = run_cases(CASES, tmp_path_factory.mktemp("cp"), session_dir(tmp_path_factory))
    for case in CASES[2:]:
        assert_matches(results, case)
    assert learns(results["single"]), "the run should learn"
