"""Video rows under every parallel layout: parity through the real trainer, 4 steps, fp32 on gloo.

The data (`tests/mixed_data.py`, `make_mixed_video_dataset`) mixes, by row, a video clip written with PyAV
(4–12 frames, 4–8 fps, four sizes; every other one with an image beside it), rows of 1–2 images of different
sizes, and text-only rows. With one sample per micro-batch the ranks differ in what they hold: one rank a
video, the other images or text only. Every rank runs the vision tower the same number of times whatever it
holds (`TrainingForwardMixin`: a placeholder pass for each kind of media missing), so FSDP2's collectives pair
up. Every layout must give the per-step loss and gradient norm of the 1-process run with the same global batch
(relative difference <= 1e-5) on the same number of tokens:

- tiny Qwen3-VL: FSDP2 2 processes (one sample per micro-batch), Ulysses 2 and Ring 2 (one CP group: the same
  micro-batch as 1 process), packing + Ring 2 (against packed rows on 1 process);
- tiny Qwen3-VL MoE: expert parallel 2 on 2 processes (one sample per micro-batch).

The 1-process run's first step is also plain HF's: a `Qwen3VLForConditionalGeneration` with its initial
weights, given the first batch (videos, images and text) with `labels=`, has the same loss and gradient norm.
The cases are a table run by `tests/parity.py` (each world size spawned once).
"""

import pytest

from apprun import MOE, MOE_ASSETS, QWEN
from mixed_data import row_media
from parity import (
    QWEN_SETTINGS, Case, HFFirstStep, Probe, SamplesPerRow, assert_first_step_matches_hf, assert_matches, dataset_dir,
    learns, run_cases, session_dir,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
STEPS = 4


class MediaKinds(Probe):
    """Per forward of the model: what it held ("video", "image" or "text")."""

    name = "media"

    def attach(self, trainer) -> None:
        self.seen: list[str] = []

        def note(module, args, kwargs):
            video, image = kwargs.get("pixel_values_videos") is not None, kwargs.get("pixel_values") is not None
            self.seen.append("video" if video else "image" if image else "text")

        trainer.model.register_forward_pre_hook(note, with_kwargs=True)

    def result(self, trainer) -> list[str]:
        return self.seen


class HFFirstStepWithVideo(HFFirstStep):
    def result(self, trainer) -> tuple[float, float]:
        assert self.first[0].get("pixel_values_videos") is not None, "the first batch should hold a video"
        return super().result(trainer)


MBS1 = {"training.micro_batch_size": 1}
DP2 = {"world": 2, "dp": 2, "ring": 1, "ulysses": 1}
PACKED = {"data.dataset_param.basic_parameters.packing": "true"}
BASE = {"training.micro_batch_size": 2, "training.train_iters": STEPS}
MOE_SETTINGS = {
    "model.model_name_or_path": str(MOE_ASSETS),
    "data.dataset_param.preprocess_parameters.model_name_or_path": str(MOE_ASSETS),
    "parallel.expert_parallel_size": 1,
}


def _case(name: str, world: int, overrides: dict, ref: str | None = None, layout: dict | None = None, **kw) -> Case:
    config, settings = (MOE, MOE_SETTINGS) if name.startswith("moe") else (QWEN, QWEN_SETTINGS)
    probes = kw.pop("probes", (MediaKinds,))
    return Case(name, world, config, {**settings, **BASE, **overrides}, ref, dataset="video", probes=probes,
                layout=layout, **kw)


CASES = {
    case.name: case
    for case in [
        # the reference pads its micro-batches (the batch plain HF takes); the others are padding-free (the default)
        _case("ref", 1, {"data.dataloader_param.padding_free": "false"}, probes=(MediaKinds, HFFirstStepWithVideo)),
        _case("ref_packed", 1, PACKED, probes=(MediaKinds, SamplesPerRow)),
        _case("moe_ref", 1, {}),
        _case("fsdp2", 2, MBS1, "ref", {**DP2}),
        _case("ulysses2", 2, {"parallel.ulysses_parallel_size": 2}, "ref", {**DP2, "dp": 1, "ulysses": 2}),
        _case("ring2", 2, {"parallel.ring_attention_size": 2}, "ref", {**DP2, "dp": 1, "ring": 2}),
        _case("packed_ring2", 2, {**PACKED, "parallel.ring_attention_size": 2}, "ref_packed",
              {**DP2, "dp": 1, "ring": 2}),
        _case("moe_ep2", 2, {**MBS1, "parallel.expert_parallel_size": 2}, "moe_ref"),
    ]
}


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return session_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def results(tmp_path_factory, shared):
    return run_cases(list(CASES.values()), tmp_path_factory.mktemp("video"), shared)


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case.reference is not None])
def test_video_rows_match_one_process(results, name):
    assert_matches(results, CASES[name])


def test_layouts_are_what_they_say(results):
    for name, case in CASES.items():
        if case.layout is not None:
            assert results[name]["layout"].items() >= case.layout.items(), f"{name} ran as {results[name]['layout']}"
    assert max(results["ref_packed"]["samples_per_row"][0]) > 1, "the packed runs should pack several samples a row"


def test_first_step_matches_plain_hf(results):
    assert_first_step_matches_hf(results["ref"])


def test_the_data_really_mixes(shared, results):
    """Rows hold videos (some beside an image), images only, or nothing; with one sample per micro-batch some
    micro-batches hold a video, some only images, some only text, and on some steps the ranks differ."""
    media = row_media(dataset_dir(shared, "video"))
    assert {(1, 1), (1, 0), (0, 0)} <= set(media) and any(images and not videos for videos, images in media)
    for name in ("fsdp2", "moe_ep2"):
        per_rank = [kinds[:STEPS] for kinds in results[name]["media"]]
        seen = {kind for kinds in per_rank for kind in kinds}
        assert seen == {"video", "image", "text"}, f"{name}: micro-batches held only {seen}"
        assert any(len(set(step)) > 1 for step in zip(*per_rank)), f"{name}: ranks never differed: {per_rank}"
    for ref in ("ref", "ref_packed", "moe_ref"):
        assert "video" in results[ref]["media"][0], f"{ref} saw no video"
        assert learns(results[ref]), f"{ref} should learn"
