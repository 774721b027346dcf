"""The memory plan's per-rank peak against the peak measured in the real trainer, 2 processes on gloo.

The tiny Mistral3 run (examples/tiny) is trained for 2 steps with packing on, so every micro-batch is
`micro_batch_size` rows of `cutoff_len` tokens, the shape the plan assumes. Each rank measures the tensor
memory alive at once (`mmfsdp.parallel.tensor_memory.TensorMemory`: parameters, gradients and optimizer
states from the start, then every tensor an operator returns, until it is freed), and the plan
(`memory_plan(cfg, 2, image_token_share=...)`, from config.json on the meta device, given the largest share
of image tokens in a micro-batch the rank trained on, what `--image-token-share` tells `--check`) must be
within 25 % of that peak, for the plain run, with recompute and with chunk loss.
"""

import pytest

from apprun import TINY
from parity import Case, Probe, run_cases, session_dir

BASE = {
    "data.dataset_param.basic_parameters.packing": "true",
    "data.dataset_param.preprocess_parameters.cutoff_len": 512,
    "training.micro_batch_size": 4,
    "training.train_iters": 2,
}


class PlannedAndMeasured(Probe):
    """The plan's total for this run (given the largest image-token share of a micro-batch this rank trained on)
    and the peak of tensor memory measured while it trained."""

    name = "memory"

    def attach(self, trainer) -> None:
        from mmfsdp.parallel.tensor_memory import TensorMemory, state_tensors

        trainer.loader = _ImageShare(trainer.loader, trainer.model.config.image_token_index)
        self.memory = TensorMemory("cpu").__enter__()
        self.memory.hold(state_tensors(trainer.model, trainer.optimizer))

    def result(self, trainer) -> tuple[int, int]:
        from mmfsdp.train.memory import memory_plan

        self.memory.__exit__(None, None, None)
        share = trainer.loader.largest_share
        assert 0.2 < share < 0.8, share  # the shapes data: about half of each sample is its image
        return memory_plan(trainer.cfg, trainer.world_size, image_token_share=share).total, self.memory.peak


CASES = [
    Case(name, 2, TINY, {**BASE, **extra}, dataset="shapes256", probes=(PlannedAndMeasured,))
    for name, extra in {
        "plain": {},
        "recompute": {"parallel.recompute": "true"},
        "chunk_loss": {"features.enable_chunk_loss": "true", "features.chunkloss_plan.chunk_size": 256},
    }.items()
]


class _ImageShare:
    """The trainer's loader, noting the largest share of image tokens in a micro-batch (the plan's input)."""

    def __init__(self, loader, image_token_id: int):
        self.loader, self.image_token_id, self.largest_share = loader, image_token_id, 0.0

    def next_step(self, num_micro_batches: int):
        batches = self.loader.next_step(num_micro_batches)
        for batch in batches:
            ids = batch["input_ids"]
            self.largest_share = max(self.largest_share, float((ids == self.image_token_id).sum()) / ids.numel())
        return batches

    def __getattr__(self, name):
        return getattr(self.loader, name)


@pytest.mark.slow
def test_the_planned_peak_is_within_25_percent_of_the_measured_peak(tmp_path_factory):
    results = run_cases(CASES, tmp_path_factory.mktemp("memory"), session_dir(tmp_path_factory), 600)
    for name, result in results.items():
        for rank, (planned, measured) in enumerate(result["memory"]):
            print(f"rank {rank} {name}: planned {planned / 2**20:.2f} MiB, measured {measured / 2**20:.2f} MiB")
            assert abs(planned - measured) <= 0.25 * measured, (
                f"rank {rank}, {name}: planned {planned} bytes vs measured peak {measured} bytes")
