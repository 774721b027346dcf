"""Qwen3-Omni (`qwen3_omni_moe`: the thinker's audio tower, vision tower and MoE decoder) through the real trainer:
the random-init tiny model of `examples/qwen3omni-tiny/assets`, fp32 on gloo, 4 steps, on the `audio` rows of
`tests/parity.py` (`tests/mixed_data.py`'s `make_mixed_audio_dataset`): clip rows with one or two clips of 40-160
mel frames (one or two audio chunks), some with an image, some a video whose audio track is the clip (read with
`use_audio_in_video`: the track's pads interleaved with the video's, `VideoSteps` asserts such micro-batches), shapes
image rows and text-only rows.

Every case gives its 1-process reference's per-step loss, gradient norm and tokens (relative difference <= 1e-5):

- padding-free micro-batches (the samples end to end, `cu_seq_lens`) on 1 process = padded;
- FSDP2 on 2 processes (data parallel 2, half the micro-batch): the ranks' micro-batches differ in what they hold,
  and in at least one step one rank's micro-batch has no clip while the other's has (`AudioPerRank` records it and
  the test asserts it; with this data, steps 1-3: rank 0 holds only image and text-only rows): that rank runs the
  audio tower on its placeholder clip, so the audio tower's FSDP2 collectives match and nothing hangs;
- Ulysses 2, Ring 2 (padded and padding-free): the decoder's sequence is split after the audio and image features
  are merged into `inputs_embeds`; the clips and the images are shared out among the CP ranks (audio and vision
  data parallel, `parallel.vision_dp`, on by default): each rank encodes its share, the features are gathered
  (`AudioShares` records each rank's share of every audio call: they add up to the call's clips, both ranks
  encode some, and a rank with no clip of a call encodes the placeholder);
- Ring 2 with packing (rows of several samples): the 1-process reference pads each packed sample to the multiple
  Ring 2 needs (`PadSamplesAsRing2`), so both pack the same rows;
- Ulysses 2 × Ring 2 on 4 processes;
- the router aux loss on (coefficient 0.5; off in the cases above), against its own 1-process run, with its per-step
  value too (`AuxLoss`): Ulysses 2, Ring 2, expert parallel 2, and EP 2 × Ulysses 2 on 4 processes.

The padded 1-process run's first step is also checked against plain HF: HF's
`Qwen3OmniMoeThinkerForConditionalGeneration` (the assets' `thinker_config`) with that run's initial weights, given
the first batch (clips and images) with `labels=`, has the same loss and gradient norm, so the trainer's loss
weighting, M-RoPE positions (images and clips) and audio and image paths are HF's on the processor's real batches.

CP ranks share one data stream, so a CP case's micro-batch is its reference's. The cases are a table run by
`tests/parity.py` (each world size spawned once).
"""

import pytest

from apprun import EXAMPLES, close
from parity import (
    Case, HFFirstStep, PadSamplesAsRing2, Probe, SamplesPerRow, assert_first_step_matches_hf, assert_matches, learns,
    run_cases, session_dir,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
CONFIG, ASSETS = EXAMPLES / "qwen3omni-tiny" / "config.yaml", EXAMPLES / "qwen3omni-tiny" / "assets"
STEPS = 4
COEF = 0.5
BASE = {
    "model.model_name_or_path": str(ASSETS),
    "data.dataset_param.preprocess_parameters.model_name_or_path": str(ASSETS),
    "features.loss_cfg.router_aux_loss_coef": 0.0,
    "training.micro_batch_size": 4,
    "training.train_iters": STEPS,
    # an order whose first steps hold videos with their tracks, a call of one clip (a CP rank runs the placeholder),
    # clips and images in the first micro-batch, and a DP 2 step with a clip on one rank only
    "training.seed": 1240,
}
PADDED = {"data.dataloader_param.padding_free": "false"}
MBS2 = {"training.micro_batch_size": 2}
PACKED = {
    "data.dataset_param.basic_parameters.packing": "true",
    "data.dataset_param.preprocess_parameters.cutoff_len": 256,
    "training.micro_batch_size": 1,
}
AUX = {"features.loss_cfg.router_aux_loss_coef": COEF}
U2, R2 = {"parallel.ulysses_parallel_size": 2}, {"parallel.ring_attention_size": 2}


class AuxLoss(Probe):
    """The router aux loss of every step."""

    name = "aux_loss"

    def result(self, trainer) -> list:
        return [r.stats.get("aux_loss") for r in trainer.history]


class AudioPerRank(Probe):
    """Whether each of this rank's first `STEPS` micro-batches holds a clip (read before training, loader rewound)."""

    name = "audio_per_rank"

    def attach(self, trainer) -> None:
        state = trainer.loader.state_dict()
        self.has_audio = [next(trainer.loader).get("input_features") is not None for _ in range(STEPS)]
        trainer.loader.load_state_dict(state)

    def result(self, trainer) -> list[bool]:
        return self.has_audio


class AudioShares(Probe):
    """Per audio call under audio data parallel: (clips this rank encoded, clips of the call); None when off."""

    name = "audio_dp"

    def result(self, trainer):
        audio_dp = trainer.model._audio_dp
        return None if audio_dp is None else list(audio_dp.encoded)


class VideoSteps(Probe):
    """Per micro-batch of this rank's first `STEPS` (read before training, loader rewound): its videos, and how many
    of them have their audio track interleaved (`<|vision_start|><|audio_start|>`)."""

    name = "video_steps"

    def attach(self, trainer) -> None:
        config = trainer.model.config
        state = trainer.loader.state_dict()
        self.videos = []
        for _ in range(STEPS):
            batch = next(trainer.loader)
            ids = batch["input_ids"]
            tracks = (ids[:, :-1] == config.vision_start_token_id) & (ids[:, 1:] == config.audio_start_token_id)
            grids = batch.get("video_grid_thw")
            self.videos.append((0 if grids is None else len(grids), int(tracks.sum())))
        trainer.loader.load_state_dict(state)

    def result(self, trainer) -> list[tuple[int, int]]:
        return self.videos


class HFFirstStepWithMedia(HFFirstStep):
    """`HFFirstStep` on a first batch that holds clips and images; HF told of the videos' interleaved tracks (every
    video of this data has one)."""

    hf_kwargs = {"use_audio_in_video": True}

    def result(self, trainer) -> tuple[float, float]:
        batch = self.first[0]
        assert batch.get("input_features") is not None and batch.get("pixel_values") is not None, list(batch)
        return super().result(trainer)


def _case(name, world, overrides, reference=None, layout=None, probes=()):
    return Case(name, world, CONFIG, {**BASE, **overrides}, reference, dataset="audio", probes=probes, layout=layout)


CASES = {
    case.name: case
    for case in [
        _case("single", 1, PADDED, probes=(HFFirstStepWithMedia, VideoSteps)),
        _case("single_padding_free", 1, {}, "single"),
        _case("single_packed", 1, PACKED, probes=(PadSamplesAsRing2, SamplesPerRow)),
        _case("moe_single", 1, {**PADDED, **AUX}, probes=(AuxLoss,)),
        _case("fsdp2", 2, {**PADDED, **MBS2}, "single", {"dp": 2}, (AudioPerRank,)),
        _case("ulysses2", 2, U2, "single", {"dp": 1, "ulysses": 2}, (AudioShares, VideoSteps)),
        _case("ring2", 2, {**PADDED, **R2}, "single", {"dp": 1, "ring": 2}, (AudioShares,)),
        _case("ring2_padding_free", 2, R2, "single", {"dp": 1, "ring": 2}),
        _case("ring2_packed", 2, {**PACKED, **R2}, "single_packed", {"dp": 1, "ring": 2}),
        _case("moe_ulysses2", 2, {**AUX, **U2}, "moe_single", {"dp": 1, "ulysses": 2}, (AuxLoss,)),
        _case("moe_ring2", 2, {**AUX, **R2}, "moe_single", {"dp": 1, "ring": 2}, (AuxLoss,)),
        _case("moe_ep2", 2, {**AUX, **MBS2, "parallel.expert_parallel_size": 2}, "moe_single", {"dp": 2, "ep": 2},
              (AuxLoss,)),
        _case("ulysses2_ring2", 4, {**U2, **R2}, "single", {"dp": 1, "ulysses": 2, "ring": 2}),
        _case("moe_ep2_ulysses2", 4, {**AUX, **MBS2, **U2, "parallel.expert_parallel_size": 2}, "moe_single",
              {"dp": 2, "ep": 2, "ulysses": 2}, (AuxLoss,)),
    ]
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_cases(list(CASES.values()), tmp_path_factory.mktemp("qwen3omni"), session_dir(tmp_path_factory))


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case.reference is not None])
def test_qwen3omni_layout_matches_one_process(results, name):
    case = CASES[name]
    assert_matches(results, case)
    if AuxLoss in case.probes:
        got, expected = results[name]["aux_loss"][0], results[case.reference]["aux_loss"][0]
        assert all(value is not None and value > 0 for value in expected), expected
        assert all(close(a, b, 1e-5, f"{name} aux loss") for a, b in zip(got, expected, strict=True)), (got, expected)


def test_qwen3omni_audio_dp_shares_the_clips(results):
    """Under CP each rank encoded a share of every audio call's clips; the shares add up to the call's clips; both
    ranks encoded clips of some call, and some call had a rank with none (it ran the placeholder clip)."""
    for name in ("ulysses2", "ring2"):
        per_rank = results[name]["audio_dp"]
        assert all(calls is not None for calls in per_rank), f"{name}: audio DP is on by default under CP"
        calls = list(zip(*per_rank))
        assert calls and all(len(rank_calls) == len(calls) for rank_calls in per_rank), name
        for call in calls:
            assert len({total for _, total in call}) == 1, f"{name}: the CP ranks saw different calls {call}"
            assert sum(mine for mine, _ in call) == call[0][1], f"{name}: shares {call} do not add up"
        assert any(all(mine > 0 for mine, _ in call) for call in calls), f"{name}: no call was split: {calls}"
        assert any(any(mine == 0 for mine, _ in call) for call in calls), f"{name}: no rank ran the placeholder"


def test_qwen3omni_steps_hold_videos_with_their_audio_tracks(results):
    """Some micro-batches of the runs hold videos, each with its audio track interleaved (`use_audio_in_video`), so
    the video path, its positions and the tracks' clips are in every layout's numbers."""
    for name in ("single", "ulysses2"):
        steps = results[name]["video_steps"][0]
        assert any(videos for videos, _ in steps), f"{name}: no video in the first {STEPS} steps: {steps}"
        assert all(videos == tracks for videos, tracks in steps), f"{name}: a video without its track: {steps}"


def test_qwen3omni_first_step_matches_plain_hf(results):
    assert_first_step_matches_hf(results["single"])


def test_qwen3omni_a_rank_without_audio_beside_one_with(results):
    """In some step of the DP 2 run one rank's micro-batch has no clip and the other's has."""
    rank0, rank1 = results["fsdp2"]["audio_per_rank"]
    assert any(a != b for a, b in zip(rank0, rank1)), (rank0, rank1)


def test_qwen3omni_references_pack_and_learn(results):
    assert max(results["single_packed"]["samples_per_row"][0]) > 1
    for ref in ("single", "single_packed", "moe_single"):
        assert learns(results[ref]), f"{ref} should learn"
