"""DPO equal to TRL's `DPOTrainer` (`trl==1.16.0`, the dev group's pin; issue 37).

For each family (tiny Qwen3-VL, tiny Mistral3; fp32, CPU) and loss setting (`sigmoid`, `ipo`, `sigmoid` with
`rpo_alpha = 0.5`, TRL's `loss_type=["sigmoid", "sft"]`, `loss_weights=[1, 0.5]`), the same three pairs (a prompt
with two images of different sizes, one with one image, a text-only one; chosen and rejected answers of different
lengths, labels on the answer only) go through both implementations from the same weights:

- TRL: a `DPOTrainer` built with the plain HF model as the policy, its unperturbed copy as `ref_model`, a
  `DPOConfig` and a one-row dataset; its `compute_loss` runs on TRL's own batch layout — TRL's
  `DataCollatorForPreference` lays out the token ids (rows chosen_0..chosen_{P-1}, rejected_0..rejected_{P-1},
  right-padded, `completion_mask` on the answers: what `DataCollatorForVisionPreference` gives after its
  `flush_left`), with the pixel inputs in that row order (every pair's images twice, as that collator repeats them)
  and Qwen3-VL's `mm_token_type_ids`;
- ours: `PreferenceObjective` with `FrozenReference` over the pairs in our layout (chosen_0, rejected_0, chosen_1, ...
  rows + `pair_index`) on our wrapper of the same weights, dims of one process.

The policy is the model with its weights perturbed away from the reference (non-zero rewards). After one backward
each, the loss, TRL's logged `rewards/*` and `logps/*` (our `stats()`) and every parameter's gradient agree within
1e-5 relative, and both sides saw the same tokens and trained targets per sequence.

Like with like, so that the bound measures the two DPO implementations and not two kernels' rounding
(docs/testing.md, "Tolerances and their margins"): both models run in float64 with the same attention function and
the same vision code path (`model_pair(..., same_kernels=True)`: HF's Pixtral tower would attend over all patches
with a dense block mask, ours per image). Measured in float32 instead, the aligned comparison comes to 2.8e-6 (a
margin of 3.6x): `rewards/margins` (0.17) is β times a difference of log-probabilities of about -35, whose one
float32 ulp (3.8e-6) is already 2.2e-6 of it, and the tiny perturbed Pixtral tower's fp32 gradients are themselves
only within ~1e-5 of their fp64 values (on either side). The float64 differences are not zero: TRL's fused LM head
computes log-probabilities in float32 whatever the model's dtype (`trl.kernels.chunked_logprob`), and HF's modules
round through float32 in places (RMSNorm casts to it); every case prints its worst difference and margin.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch
from mmfsdp.model import get_model_entry, model_inputs
from mmfsdp.model.families.mistral3.testing import image_token_count
from mmfsdp.model.families.qwen3_vl.testing import qwen3_vl_sample
from mmfsdp.model.loss import IGNORE_INDEX, sample_ids
from mmfsdp.model.preference import PAIR_STATS, pair_objective
from mmfsdp.model.testing import assert_close, model_pair, perturb, to_dtype
from mmfsdp.train.config import DPOConfig as OurDPOConfig
from mmfsdp.train.config import TrainingConfig
from mmfsdp.train.dpo import FrozenReference, PreferenceObjective

TOL = 1e-5
DTYPE = torch.float64
"""The whole-model comparison's dtype (module docstring)."""
BETA = 0.1
PAD_ID = 0
PACKED_PADDING = 3
"""Tokens of the padding segment that ends a packed row."""
SETTINGS = {
    "sigmoid": ({"loss_type": "sigmoid"}, {"loss_type": ["sigmoid"]}),
    "ipo": ({"loss_type": "ipo"}, {"loss_type": ["ipo"]}),
    "rpo": ({"loss_type": "sigmoid", "rpo_alpha": 0.5}, {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]}),
}
"""name -> (our `training.dpo`, TRL's `DPOConfig` loss keywords)."""
DEFINITIONS = {
    **SETTINGS,
    "robust": ({"loss_type": "robust", "label_smoothing": 0.1}, {"loss_type": ["robust"], "label_smoothing": 0.1}),
    "hinge": ({"loss_type": "hinge"}, {"loss_type": ["hinge"]}),
    "sigmoid_norm": ({"loss_type": "sigmoid_norm"}, {"loss_type": ["sigmoid_norm"]}),
    "ipo_rpo": ({"loss_type": "ipo", "rpo_alpha": 2.0}, {"loss_type": ["ipo", "sft"], "loss_weights": [1.0, 2.0]}),
}
"""Every loss type of ours with TRL's (not `sigmoid` with `label_smoothing > 0`: TRL 1.16's `sigmoid` ignores it,
ours is the conservative DPO of earlier releases, `mmfsdp.model.preference`)."""


@dataclass
class Pair:
    prompt: torch.Tensor
    """The prompt's token ids, image placeholders included."""
    images: list[dict[str, torch.Tensor]]
    """Each image's pixel inputs, as the family's `collate_images` takes them."""
    chosen: torch.Tensor
    rejected: torch.Tensor


# -- the families' prompts with images and pixel inputs ------------------------------------------------------------


class Qwen3VLImages:
    """Qwen3-VL: images as `(h, w)` patch grids (`qwen3_vl_sample`), `pixel_values` of all patches + `image_grid_thw`;
    the processor's `mm_token_type_ids` (1 on image tokens) go with the token ids."""

    model_id = "qwen3_vl"
    image_shapes = ([(4, 4), (2, 4)], [(4, 2)], [])

    def __init__(self, config):
        self.config = config
        self.text_low = config.vision_end_token_id + 1

    def prompt(self, grids, seed: int) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
        merge = self.config.vision_config.spatial_merge_size
        length = 2 + sum(h * w // merge**2 + 2 for h, w in grids) + 3 + seed % 2
        sample = qwen3_vl_sample(self.config, length, grids, prompt_len=2, seed=seed)
        patches = [h * w for h, w in grids]
        pixels = sample["pixel_values"].split(patches) if grids else ()
        images = [
            {"pixel_values": p, "image_grid_thw": g[None]} for p, g in zip(pixels, sample.get("image_grid_thw", []))
        ]
        return sample["input_ids"], images

    def collate_images(self, images: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {key: torch.cat([image[key] for image in images]) for key in ("pixel_values", "image_grid_thw")}

    def token_inputs(self, input_ids: torch.Tensor, segments: list[int] | None = None) -> dict[str, torch.Tensor]:
        """(M-RoPE positions are the model's own, restarted per packed sample by our wrapper.)"""
        return {"mm_token_type_ids": (input_ids == self.config.image_token_id).long()}


class Mistral3Images:
    """Mistral3 (Pixtral): images as `(height, width)` pixels, `pixel_values` padded to the largest side +
    `image_sizes`; `image_token_count` image tokens each."""

    model_id = "mistral3"
    image_shapes = ([(32, 32), (16, 48)], [(32, 16)], [])

    def __init__(self, config):
        self.config = config
        self.text_low = config.image_token_index + 1

    def prompt(self, sizes, seed: int) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
        generator = torch.Generator().manual_seed(seed)
        vocab = self.config.text_config.vocab_size
        pieces = [torch.randint(self.text_low, vocab, (2,), generator=generator)]
        images = []
        for height, width in sizes:
            count = image_token_count(self.config, height, width)
            pieces.append(torch.full((count,), self.config.image_token_index))
            channels = self.config.vision_config.num_channels
            images.append({"pixels": torch.randn(channels, height, width, generator=generator)})
        pieces.append(torch.randint(self.text_low, vocab, (3 + seed % 2,), generator=generator))
        return torch.cat(pieces), images

    def collate_images(self, images: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        side = max(max(image["pixels"].shape[1:]) for image in images)
        pixel_values = torch.zeros(len(images), self.config.vision_config.num_channels, side, side)
        for index, image in enumerate(images):
            _, height, width = image["pixels"].shape
            pixel_values[index, :, :height, :width] = image["pixels"]
        sizes = torch.tensor([list(image["pixels"].shape[1:]) for image in images])
        return {"pixel_values": pixel_values, "image_sizes": sizes}

    def token_inputs(self, input_ids: torch.Tensor, segments: list[int] | None = None) -> dict[str, torch.Tensor]:
        """Packed: `position_ids` restarting at 0 in each segment (as the `pixtral` collator gives them)."""
        if segments is None:
            return {}
        return {"position_ids": torch.cat([torch.arange(n) for n in segments])[None]}


FAMILIES = {kit.model_id: kit for kit in (Qwen3VLImages, Mistral3Images)}


def make_pairs(family) -> list[Pair]:
    """Three pairs: two images, one image, text only; answers of 3-8 tokens, chosen and rejected of different
    lengths (the longer one alternates)."""
    vocab = family.config.text_config.vocab_size
    generator = torch.Generator().manual_seed(7)
    answer_lengths = ((5, 8), (7, 3), (4, 6))
    pairs = []
    for index, (shapes, (n_chosen, n_rejected)) in enumerate(zip(family.image_shapes, answer_lengths)):
        prompt, images = family.prompt(shapes, seed=11 + index)
        chosen = torch.randint(family.text_low, vocab, (n_chosen,), generator=generator)
        rejected = torch.randint(family.text_low, vocab, (n_rejected,), generator=generator)
        pairs.append(Pair(prompt, images, chosen, rejected))
    return pairs


def our_batch(family, pairs: list[Pair], *, packed: bool) -> dict[str, torch.Tensor]:
    """Our preference micro-batch of sequences chosen_0, rejected_0, chosen_1, ...: one a row, right-padded, or
    (`packed`) padding-free in one row of `cu_seq_lens` segments ending in a padding segment; labels on the answers,
    the images in sequence order, `pair_index`."""
    sequences = [(pair.prompt, answer, pair.images) for pair in pairs for answer in (pair.chosen, pair.rejected)]
    lengths = [len(prompt) + len(answer) for prompt, answer, _ in sequences]
    if packed:
        segments = [*lengths, PACKED_PADDING]
        starts = [(0, sum(lengths[:k])) for k in range(len(sequences))]
        shape = (1, sum(segments))
    else:
        segments = None
        starts = [(k, 0) for k in range(len(sequences))]
        shape = (len(sequences), max(lengths))
    input_ids = torch.full(shape, PAD_ID, dtype=torch.long)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    attention_mask = torch.zeros_like(input_ids)
    for (row, at), (prompt, answer, _) in zip(starts, sequences):
        n, m = len(prompt), len(answer)
        input_ids[row, at : at + n + m] = torch.cat([prompt, answer])
        labels[row, at + n : at + n + m] = answer
        attention_mask[row, at : at + n + m] = 1
    images = [image for _, _, row_images in sequences for image in row_images]
    batch = {"input_ids": input_ids, "labels": labels, **family.token_inputs(input_ids, segments)}
    if packed:
        cu_seq_lens = torch.zeros(len(segments) + 1, dtype=torch.int32)
        cu_seq_lens[1:] = torch.tensor(segments).cumsum(0)
        batch.update(cu_seq_lens=cu_seq_lens, max_length=max(segments))
    else:
        batch["attention_mask"] = attention_mask
    return {**batch, **family.collate_images(images), "pair_index": torch.arange(len(pairs))}


def trl_batch(family, pairs: list[Pair]) -> dict[str, torch.Tensor]:
    """TRL's batch: its collator's rows [chosen..., rejected...] + `completion_mask`, the pixel inputs in that order."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    collate = DataCollatorForPreference(pad_token_id=PAD_ID)
    batch = collate(
        [
            {"prompt_ids": p.prompt.tolist(), "chosen_ids": p.chosen.tolist(), "rejected_ids": p.rejected.tolist()}
            for p in pairs
        ]
    )
    images = [image for pair in pairs for image in pair.images] * 2
    return {**batch, **family.token_inputs(batch["input_ids"]), **family.collate_images(images)}


# -- the models and TRL's trainer -----------------------------------------------------------------------------------


def trl_trainer(policy, reference, trl_loss: dict, tmp_path):
    """A `DPOTrainer` on the CPU in fp32 (no bf16 autocast, no checkpointing), `compute_loss` ready."""
    from datasets import Dataset
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast, ProcessorMixin
    from trl import DPOConfig, DPOTrainer

    class WordProcessor(ProcessorMixin):
        """The smallest processor: TRL reads only its tokenizer's pad and eos tokens (we pass token ids)."""

        attributes: ClassVar[list[str]] = ["tokenizer"]

        def __init__(self, tokenizer):
            super().__init__(tokenizer=tokenizer)

    vocab = {f"t{i}": i for i in range(policy.config.get_text_config().vocab_size)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t1")), pad_token=f"t{PAD_ID}", eos_token="t2"
    )
    args = DPOConfig(
        output_dir=str(tmp_path),
        beta=BETA,
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        **trl_loss,
    )
    # a vision dataset: TRL keeps it untokenised (its collator would process it; we hand compute_loss the batch)
    dataset = Dataset.from_dict({"images": [[]], "prompt": ["t3"], "chosen": ["t4"], "rejected": ["t5"]})
    return DPOTrainer(
        model=policy, ref_model=reference, args=args, train_dataset=dataset, processing_class=WordProcessor(tokenizer)
    )


def assert_same_sequences(ours: dict, seq: dict, theirs: dict, num_pairs: int) -> None:
    """Sequence k of ours (pair k // 2, chosen when k is even) is TRL's row k // 2 (+ P when rejected): the same
    tokens and the same trained next-token targets."""
    token_ids = sample_ids(ours["input_ids"].shape, ours.get("cu_seq_lens"))
    if "attention_mask" in ours:
        token_ids = token_ids.masked_fill(ours["attention_mask"] == 0, -1)
    their_targets = theirs["input_ids"].masked_fill(theirs["completion_mask"] == 0, IGNORE_INDEX)[:, 1:]
    for k in range(2 * num_pairs):
        row = k // 2 + (num_pairs if k % 2 else 0)
        their_ids = theirs["input_ids"][row][theirs["attention_mask"][row].bool()]
        assert torch.equal(ours["input_ids"][token_ids == k], their_ids), f"sequence {k}: token ids differ"
        my_targets = seq["shift_labels"][seq["sequence_ids"] == k]
        assert my_targets.numel() > 0
        assert torch.equal(my_targets, their_targets[row][their_targets[row] != IGNORE_INDEX]), f"sequence {k}: targets"


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("model_id", list(FAMILIES))
def test_dpo_equals_trl(model_id, setting, layout, tmp_path):
    our_loss, trl_loss = SETTINGS[setting]
    config = get_model_entry(model_id).testkit.tiny_config()
    family = FAMILIES[model_id](config)
    pairs = make_pairs(family)

    ours, hf = model_pair(config, same_kernels=True)
    ours.to(DTYPE)
    hf.to(DTYPE)
    our_ref, hf_ref = copy.deepcopy(ours).eval(), copy.deepcopy(hf).eval()
    for model in (our_ref, hf_ref):
        model.requires_grad_(False)
    perturb([ours, hf])
    ours.set_media_kinds(["image"])

    # TRL
    trainer = trl_trainer(hf, hf_ref, trl_loss, tmp_path)
    theirs = to_dtype(trl_batch(family, pairs), DTYPE)
    their_loss = trainer.compute_loss(trainer.model, dict(theirs))
    their_loss.backward()
    their_stats = {name: trainer._metrics["train"][name][-1] for name in PAIR_STATS}

    # ours
    batch = to_dtype(our_batch(family, pairs, packed=layout == "packed"), DTYPE)
    cfg = SimpleNamespace(training=TrainingConfig(stage="dpo", dpo=OurDPOConfig(beta=BETA, **our_loss)))
    dims = SimpleNamespace(cp_size=1, dp_size=1, dp_group=None)
    objective = PreferenceObjective(cfg, dims, torch.device("cpu"), FrozenReference(our_ref))
    objective.start_step([batch])
    _, our_loss_value = objective.micro_batch(ours, 0, model_inputs(batch))
    our_loss_value.backward()
    our_stats, pending = objective.stats()
    assert not pending

    assert_same_sequences(batch, PreferenceObjective.sequences(batch, torch.device("cpu")), theirs, len(pairs))
    assert our_loss_value.dtype == DTYPE
    diffs = {"loss": assert_close(our_loss_value, their_loss, TOL, "loss")}
    assert abs(their_stats["rewards/margins"]) > 0.05, "the policy should be well away from the reference"
    for name in PAIR_STATS:
        diffs[name] = assert_close(our_stats[name], torch.tensor(their_stats[name], dtype=DTYPE), TOL, name)
    their_params = dict(hf.named_parameters())
    our_params = dict(ours.named_parameters())
    assert our_params.keys() == their_params.keys()
    for name, param in our_params.items():
        assert param.grad is not None and their_params[name].grad is not None, f"{name}: no gradient"
        diffs[f"grad {name}"] = assert_close(param.grad, their_params[name].grad, TOL, f"grad {name}")
    worst = max(diffs, key=diffs.get)
    print(f"worst: {worst} {diffs[worst]:.3g} (bound {TOL:g}, margin {TOL / max(diffs[worst], 1e-300):.0f}x)")


class TokenLogps:
    """A stand-in for a model with TRL's fused LM head: given per-token log-probabilities `[2P, S - 1]` (zero off the
    completions, scattered from the trained tokens' values as the fused head does), with the metrics' fields TRL
    reads."""

    def __init__(self, log_probs: torch.Tensor):
        self.log_probs = log_probs

    def __call__(self, **kwargs):
        zeros = torch.zeros_like(self.log_probs.detach())
        return SimpleNamespace(log_probs=self.log_probs, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())


@pytest.mark.parametrize("setting", list(DEFINITIONS))
def test_pair_objective_equals_trl_loss(setting, tmp_path):
    """`pair_objective` against TRL's loss code (`DPOTrainer._compute_loss`) on the same per-token log-probabilities
    of 4 pairs of different answer lengths: the loss, the statistics and the gradient of each sequence's
    log-probability of each trained token."""
    our_loss, trl_loss = DEFINITIONS[setting]
    num_pairs, seq_len = 4, 12
    generator = torch.Generator().manual_seed(5)
    # TRL's rows: chosen_0..3, rejected_0..3; the prompt is the first 3 tokens
    lengths = torch.tensor([[5, 8], [7, 2], [4, 6], [9, 9]])
    completion_mask = torch.zeros(2 * num_pairs, seq_len, dtype=torch.long)
    for pair, (n_chosen, n_rejected) in enumerate(lengths.tolist()):
        completion_mask[pair, 3 : 3 + n_chosen] = 1
        completion_mask[num_pairs + pair, 3 : 3 + n_rejected] = 1
    token_mask = completion_mask[:, 1:].bool()
    values = (-3 * torch.rand(int(token_mask.sum()), generator=generator)).requires_grad_()
    policy = torch.zeros(token_mask.shape).masked_scatter(token_mask, values)
    reference = torch.zeros(token_mask.shape).masked_scatter(
        token_mask, -3 * torch.rand(values.shape, generator=generator)
    )
    inputs = {
        "input_ids": torch.randint(3, 50, (2 * num_pairs, seq_len), generator=generator),
        "attention_mask": torch.ones(2 * num_pairs, seq_len, dtype=torch.long),
        "completion_mask": completion_mask,
    }

    config = get_model_entry("mistral3").testkit.tiny_config()
    _, hf = model_pair(config)
    trainer = trl_trainer(hf, copy.deepcopy(hf), trl_loss, tmp_path)
    trainer.ref_model = TokenLogps(reference)
    their_loss = trainer._compute_loss(TokenLogps(policy), inputs, return_outputs=False)
    (their_grad,) = torch.autograd.grad(their_loss, values, retain_graph=True)
    their_stats = {name: trainer._metrics["train"][name][-1] for name in PAIR_STATS}

    # ours: sequences in pair order (chosen_0, rejected_0, ...), summed cross-entropy = -log-probability
    order = torch.stack([torch.arange(num_pairs), torch.arange(num_pairs) + num_pairs], dim=1).reshape(-1)
    sequence_ce = (-policy.sum(dim=1))[order]
    ref_logps = reference.sum(dim=1)[order]
    num_tokens = token_mask.sum(dim=1)[order].float()
    dpo = OurDPOConfig(beta=BETA, **our_loss)
    loss, terms = pair_objective(
        sequence_ce,
        ref_logps,
        num_tokens,
        num_pairs_global=num_pairs,
        num_chosen_tokens_global=num_tokens[0::2].sum(),
        loss_type=dpo.loss_type,
        beta=dpo.beta,
        label_smoothing=dpo.label_smoothing,
        rpo_alpha=dpo.rpo_alpha,
    )
    (our_grad,) = torch.autograd.grad(loss, values)

    assert_close(loss, their_loss, TOL, "loss")
    for index, name in enumerate(PAIR_STATS):
        assert_close(terms.stats[index].mean(), torch.tensor(their_stats[name]), TOL, name)
    assert their_grad.abs().max() > 0
    assert_close(our_grad, their_grad, TOL, "grad of the token log-probabilities")
