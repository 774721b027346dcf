"""The training forward shared by every HF `*ForConditionalGeneration` family: `TrainingForwardMixin`.

A family's model class is `class XFSDP(TrainingForwardMixin, HFXForConditionalGeneration)`
that calls `self.init_training_forward()` at the end of `__init__` — we wrap, we
don't fork. The mixin adds:
- `lm_head` (`lm_head_name`) gets the `ChunkLossLinear` class (same parameters;
  called with one argument it is the same `nn.Linear`), so under chunk loss it
  can receive the loss function and return the loss;
- `forward` accepts the training keywords `shift_labels`, `loss_weights`,
  `cu_seq_lens`, `max_length`;
- one forward pre-hook on the decoder (`decoder_name`) that hands the decoder
  the keywords only it should see (the varlen lengths of packed samples) and,
  under context parallel, splits its inputs (`mmfsdp.model.context_parallel`).

The flow of `model(**batch_inputs, shift_labels=, loss_weights=)`:
1. `__call__` wraps `loss_weights` in `_Uncast`: FSDP2's root pre-forward hook
   casts every floating tensor argument to its `param_dtype`, and the weights
   must reach the loss in fp32.
2. `prepare_inputs(kwargs, cu_seq_lens)` — the family's hook, before any split —
   completes inputs computed on the whole sample (Qwen3-VL: M-RoPE positions,
   restarted per packed sample). The default changes nothing.
3. The micro-batch's plan (`mmfsdp.model.batch_plan.BatchPlan`): the sample bounds read on the host once
   (`cu_seq_lens` stays on the host in the trainer), and from them, before the decoder runs, every index tensor
   the layers need (attention segments, under context parallel the shard map and the ring's halves, the
   family's own: `plan_layers`), moved to the device without waiting. With `cu_seq_lens` the attention mask is
   dropped and the decoder receives the HF varlen keywords `cu_seq_lens_q/k`, `max_length_q/k` (the plan's):
   the cumulative lengths alone say which tokens attend to which; and the plan itself (`BATCH_PLAN_KEY`), so no
   layer reads a boundary from the device. They go to the decoder only — the vision tower keeps its own
   per-image lengths.
4. The HF forward runs an encoder once per kind of media in the call
   (`media_inputs`: Qwen3-VL's images and videos are two passes of its vision
   tower, Qwen3-Omni's audio clips one of its audio tower). For each kind a
   call lacks (a micro-batch of text-only samples, or of images but no video)
   among the kinds the run's data holds (`set_media_kinds`, told by the
   trainer from its datasets; a run without videos has no video pass) that
   kind's encoder runs once more, on its smallest input (the vision tower on
   `placeholder_vision_inputs`, at the decoder's entry; a kind named in
   `media_placeholders` through the family's own method, right after the
   token embedding, where HF merges it before the vision tower runs): the
   decoder receives `inputs_embeds + 0 · Σ features`. Every rank thus runs the
   same encoder passes in the same order, hence the same FSDP2 all-gathers and
   reduce-scatters in the same order, whatever its micro-batch holds (a rank that skipped a pass would
   pair its collectives with the wrong ones of the others: gloo aborts, NCCL
   hangs), and the placeholder contributes exactly zero to the loss and to every
   gradient (docs/model.md, "Text-only micro-batches").
5. Under context parallel, `shift_labels` and `loss_weights` are split with the
   batch's layout and the decoder runs on this rank's shard (its keywords split
   by the family's `split_decoder_kwargs`, default `split_sequence_kwargs`). With vision data parallel
   (`enable_context_parallel(..., vision_dp=True)`) the base model's `get_image_features` is replaced for
   the HF forward: the CP ranks share out the media (the family's `vision_media_patches` and
   `select_vision_media`) and all-gather the features (`mmfsdp.model.vision_dp`); a family with an audio tower
   (`placeholder_audio_inputs`) has its `get_audio_features` replaced the same way (its clips shared out).
6. Without chunk loss the HF forward computes the logits and
   `weighted_cross_entropy` the loss; with chunk loss the HF base model stops at
   the final hidden states and `lm_head` computes the loss chunk by chunk
   (`mmfsdp.model.chunk_loss`), and the output has no logits. Either way
   `.loss = Σ_t loss_weights[t] · CE(logits[t], shift_labels[t])` in fp32 over
   the local tokens.
7. Per-sequence sums (preference training): with `sequence_ids` (int `[B, S]`, the index of each token's sequence,
   -1 for none; `mmfsdp.model.loss.sample_ids`) and `num_sequences`, `.loss` is the fp32 vector
   `loss[k] = Σ_{t in sequence k} w_t · CE_t` (`sequence_cross_entropy`, or its chunked form). Under context
   parallel the shards' sums are all-reduced over the CP group with autograd (its backward sums the gradients
   over the group), so every CP rank holds the whole sequences' sums; a consumer that adds up the ranks'
   losses scales its loss by `1 / cp_size` (`mmfsdp.train.objective`).
8. Per-token values (online RL): with `per_token=True` (and `temperature`, default 1), `.loss` is the fp32
   `[B, S]` tensor `w_t · CE(logits_t / T, y_t)` (`token_cross_entropy`: with unit weights on the completion
   tokens, minus the policy's per-token log-probabilities over the whole vocabulary, TRL's) and `.entropy` the
   detached per-token entropies of `softmax(logits / T)`; given the tokens the rollout never samples
   (`suppress_token_ids`), `.kept_logmass` is the detached log of the other tokens' mass (the sampler's
   log-probability of a token is its log-probability minus it). Under context parallel each rank computes them on
   its shard and the three are all-gathered over the CP group in one collective, back in the batch's order
   (`CPBatch.gather`, with autograd: its backward sums the gradients over the group), so every CP rank holds the
   whole batch's values; a consumer that adds up the ranks' losses scales its loss by `1 / cp_size`, as for
   step 7. With chunk loss `lm_head` computes the three chunk by chunk from the hidden states
   (`mmfsdp.model.chunk_loss.chunked_linear_token_cross_entropy`; tokens that do not train hold 0).

`forward` without `loss_weights` is the upstream HF forward (after steps 2-3),
so evaluation and generation see the HF model.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from mmfsdp.model.batch_plan import BatchPlan
from mmfsdp.model.chunk_loss import LinearCrossEntropy, use_chunk_loss_head
from mmfsdp.model.context_parallel import CPBatch, ContextParallel, split_sequence_kwargs
from mmfsdp.model.loss import sequence_cross_entropy, token_cross_entropy, weighted_cross_entropy
from mmfsdp.parallel.cp import CPLayout
from mmfsdp.model.vision_dp import AudioDataParallel, VisionDataParallel

__all__ = ["TrainingForwardMixin", "NON_INPUT_KEYS", "model_inputs", "packed_attention_kwargs", "vision_features"]

NON_INPUT_KEYS = ("labels", "pair_index")
"""Keys of a collated batch that are not model inputs (the labels; a preference batch's pair indices); every other key (the family's HF inputs,
`cu_seq_lens`, `max_length`) goes to the model as it is."""


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """The model's keywords of a collated batch: every key but `NON_INPUT_KEYS`, untouched."""
    return {key: value for key, value in batch.items() if key not in NON_INPUT_KEYS}


def packed_attention_kwargs(cu_seq_lens: torch.Tensor, max_length: int | torch.Tensor | None) -> dict[str, Any]:
    """The HF varlen keywords for packed sequences over the flattened `B·S` tokens."""
    cu_seq_lens = cu_seq_lens.reshape(-1).to(torch.int32)
    if max_length is None:
        max_length = int((cu_seq_lens[1:] - cu_seq_lens[:-1]).max())
    max_length = int(max_length)
    return {"cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens, "max_length_q": max_length, "max_length_k": max_length}


class _Uncast:
    """Carries a tensor past FSDP2's input casting, which only looks into tensors and standard containers."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class _DecoderCall:
    """What the decoder's next forward receives on top of its HF keywords: varlen lengths, the CP split and
    the kinds of media whose placeholders run at its entry, and those that run after the token embedding."""

    __slots__ = ("extra_kwargs", "cp_batch", "placeholders", "embedding_placeholders")

    def __init__(self, extra_kwargs: dict[str, Any], cp_batch: CPBatch | None, placeholders: tuple[str, ...],
                 embedding_placeholders: tuple[str, ...]):
        self.extra_kwargs = extra_kwargs
        self.cp_batch = cp_batch
        self.placeholders = placeholders
        self.embedding_placeholders = embedding_placeholders


def _feature_tensors(value: Any) -> list[torch.Tensor]:
    """The floating tensors of a vision output (a tensor, or nested tuples/lists of them)."""
    if torch.is_tensor(value):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (tuple, list)):
        return [tensor for item in value for tensor in _feature_tensors(item)]
    return []


def vision_features(output: Any) -> list[torch.Tensor]:
    """The tensors of a `get_image_features` output that the merge into the sequence uses: HF's
    `pooler_output` (the per-image features) and, where present, `deepstack_features`; an output in the
    older tuple form is used whole."""
    if hasattr(output, "pooler_output"):
        return _feature_tensors(output.pooler_output) + _feature_tensors(getattr(output, "deepstack_features", None))
    return _feature_tensors(output)


class TrainingForwardMixin:
    """The training forward, chunk loss and CP split for an HF `*ForConditionalGeneration` (module docstring)."""

    decoder_name: ClassVar[str] = "model.language_model"
    """The text decoder: it receives the varlen keywords and, under CP, runs on the shard."""
    lm_head_name: ClassVar[str] = "lm_head"
    """The output projection that receives the loss function under chunk loss."""
    media_inputs: ClassVar[dict[str, str]] = {"image": "pixel_values"}
    """Kind of media (`"image"`, `"video"`, `"audio"`) -> the keyword that carries it to its encoder, one encoder
    pass each (a family with videos adds `"video": "pixel_values_videos"`, one with audio `"audio":
    "input_features"`)."""
    media_placeholders: ClassVar[dict[str, str]] = {}
    """Kind -> the name of the model's method `(device, dtype) -> list[Tensor]` that runs that kind's encoder on
    its smallest input, for the kinds whose encoder is not the vision tower (Qwen3-Omni: `"audio"`); every other
    kind's placeholder is `vision_placeholder_features`. These run right after the token embedding (HF's forward
    merges such a kind before it runs the vision tower), the vision kinds' at the decoder's entry, so that every
    rank runs its encoders in one order, real or placeholder."""
    media_input_keys: tuple[str, ...] = ("pixel_values",)
    """The keywords of the kinds the run's data holds (`set_media_kinds`; default: every kind of
    `media_inputs`): a call runs the placeholder of each of them it lacks."""

    def init_training_forward(self) -> None:
        """Call at the end of the family's `__init__`."""
        self.media_input_keys = tuple(self.media_inputs.values())
        use_chunk_loss_head(self.get_submodule(self.lm_head_name))
        self.chunk_loss_size: int | None = None
        self._context_parallel: ContextParallel | None = None
        self._vision_dp: VisionDataParallel | None = None
        self._audio_dp: AudioDataParallel | None = None
        self._decoder_call: _DecoderCall | None = None
        self.get_submodule(self.decoder_name).register_forward_pre_hook(self._decoder_pre_hook, with_kwargs=True)
        if self.media_placeholders:
            self.get_input_embeddings().register_forward_hook(self._embedding_hook)

    # -- family hooks ----------------------------------------------------------------------------
    def prepare_inputs(self, kwargs: dict[str, Any], cu_seq_lens: torch.Tensor | None) -> dict[str, Any]:
        """Inputs computed on the whole (unsplit) sample before the forward; the default changes nothing."""
        return kwargs

    def plan_layers(self, plan: BatchPlan, layout: CPLayout | None) -> None:
        """Add what the family's own layers read to the micro-batch's plan (`plan.layers`, by name), from its
        host bounds and, under context parallel, this rank's `layout`; the default adds nothing."""

    def split_decoder_kwargs(self, kwargs: dict[str, Any], batch: CPBatch) -> dict[str, Any]:
        """This CP rank's decoder keywords; the default splits `[B, S, ...]` tensors along S."""
        return split_sequence_kwargs(kwargs, batch)

    def placeholder_vision_inputs(self, device: torch.device, dtype: torch.dtype) -> dict[str, Any] | None:
        """The keywords of the smallest `get_image_features` call (one image of the fewest patches the tower
        and its merger accept), for micro-batches without media; None: the family has no vision side."""
        return None

    def vision_media_patches(self, call: dict[str, Any]) -> list[int]:
        """Vision DP: the patches of each media item (image or video) of a `get_image_features` call's keywords."""
        raise NotImplementedError(f"{type(self).__name__} does not split its vision inputs (vision DP)")

    def select_vision_media(self, call: dict[str, Any], indices: list[int]) -> dict[str, Any]:
        """Vision DP: the keywords of a `get_image_features` call that encodes the items `indices` (ascending), in
        that order, first; keywords that are not per item stay. Items after them (a family's workaround) are
        encoded and their features dropped."""
        raise NotImplementedError(f"{type(self).__name__} does not split its vision inputs (vision DP)")

    def placeholder_audio_inputs(self, device: torch.device, dtype: torch.dtype) -> dict[str, Any] | None:
        """The keywords of the smallest `get_audio_features` call (one silent clip), for audio data parallel;
        None: the family has no audio tower."""
        return None

    def audio_media_frames(self, call: dict[str, Any]) -> list[int]:
        """Audio DP: the mel frames of each clip of a `get_audio_features` call's keywords."""
        raise NotImplementedError(f"{type(self).__name__} does not split its audio inputs (audio DP)")

    def audio_media_rows(self, frames: list[int]) -> list[int]:
        """Audio DP: the feature rows (tokens) `get_audio_features` returns for clips of `frames` mel frames each
        (host numbers: no device read)."""
        raise NotImplementedError(f"{type(self).__name__} does not split its audio inputs (audio DP)")

    def select_audio_media(self, call: dict[str, Any], indices: list[int]) -> dict[str, Any]:
        """Audio DP: the keywords of a `get_audio_features` call that encodes the clips `indices` (ascending)."""
        raise NotImplementedError(f"{type(self).__name__} does not split its audio inputs (audio DP)")

    def vision_placeholder_features(self, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
        """The vision side run on `placeholder_vision_inputs`: the features the merge would use (`vision_features`)."""
        inputs = self.placeholder_vision_inputs(device, dtype)
        if inputs is None:
            return []
        return vision_features(self.get_image_features(**inputs))

    def placeholder_features(self, kind: str, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
        """The encoder of media `kind` run on its smallest input (`media_placeholders`, else the vision tower)."""
        return getattr(self, self.media_placeholders.get(kind, "vision_placeholder_features"))(device, dtype)

    # -- switches --------------------------------------------------------------------------------
    def enable_context_parallel(self, parallel_dims: Any, *, vision_dp: bool = False) -> None:
        """Split the decoder's sequence over `parallel_dims`' CP group in the training forward
        (`mmfsdp.model.context_parallel`); with `vision_dp` the CP ranks also share the encoding of the media
        (`mmfsdp.model.vision_dp`)."""
        self._context_parallel = cp = ContextParallel(self.get_submodule(self.decoder_name), parallel_dims)
        group = cp.cp_group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        if vision_dp and self.placeholder_vision_inputs(torch.device("cpu"), torch.float32) is not None:
            width = int(self.config.vision_config.hidden_size)
            self._vision_dp = VisionDataParallel(self, group, rank, size, width)
        if vision_dp and self.placeholder_audio_inputs(torch.device("cpu"), torch.float32) is not None:
            self._audio_dp = AudioDataParallel(self, group, rank, size, 0)

    def set_media_kinds(self, kinds: Iterable[str]) -> None:
        """The kinds of media (`"image"`, `"video"`, `"audio"`) the run's data holds (training and evaluation
        splits); a call runs placeholders only for these, so a run without videos pays no video pass. Every
        rank must be told the same kinds, and every call must carry only these. With none, the first kind
        (images) stays: a text-only run keeps one placeholder pass per call, as before."""
        keys = tuple(key for kind, key in self.media_inputs.items() if kind in set(kinds))
        self.media_input_keys = keys or tuple(self.media_inputs.values())[:1]

    def set_chunk_loss(self, chunk_size: int | None) -> None:
        """Compute the training loss inside `lm_head`, `chunk_size` tokens at a time (None: plain logits + CE)."""
        if chunk_size is not None and chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.chunk_loss_size = chunk_size

    # -- forward ---------------------------------------------------------------------------------
    def _missing_media(self, kwargs: dict[str, Any]) -> tuple[str, ...]:
        """The kinds of media of the run this call lacks, whose placeholders it runs (none: `()`)."""
        # a decoding step of generation (a filled cache) runs no encoder on any path
        if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            return ()
        kinds = {key: kind for kind, key in self.media_inputs.items()}
        return tuple(kinds[key] for key in self.media_input_keys if kwargs.get(key) is None)

    @contextlib.contextmanager
    def _calling_decoder(
        self, extra_kwargs: dict[str, Any], cp_batch: CPBatch | None = None, placeholders: tuple[str, ...] = ()
    ) -> Iterator[None]:
        needed = extra_kwargs or cp_batch is not None or placeholders
        own = tuple(kind for kind in placeholders if kind in self.media_placeholders)
        vision = tuple(kind for kind in placeholders if kind not in self.media_placeholders)
        self._decoder_call = _DecoderCall(extra_kwargs, cp_batch, vision, own) if needed else None
        try:
            yield
        finally:
            self._decoder_call = None

    def _with_placeholders(self, embeds: torch.Tensor, kinds: tuple[str, ...]) -> torch.Tensor:
        """`embeds + 0 · Σ` the features of the placeholders of `kinds`; `0 · Σ` is exactly zero for finite features."""
        own_pass = contextlib.ExitStack()
        for media_dp in (self._vision_dp, self._audio_dp):
            if media_dp is not None:
                own_pass.enter_context(media_dp.suspended(getattr(self, self.base_model_prefix)))
        with own_pass:
            features = [f for kind in kinds for f in self.placeholder_features(kind, embeds.device, embeds.dtype)]
        if not features:
            return embeds
        zero = sum(feature.float().mul(0).sum() for feature in features)
        return embeds + zero.to(embeds.dtype)

    def _embedding_hook(self, module: nn.Module, args: tuple, output: torch.Tensor):
        # The kinds with their own encoder (`media_placeholders`) run here, right after the token embedding, where
        # HF's forward merges them before it runs the vision tower: every rank then runs the encoders in one order.
        call = self._decoder_call
        if call is None or not call.embedding_placeholders:
            return None
        kinds, call.embedding_placeholders = call.embedding_placeholders, ()
        return self._with_placeholders(output, kinds)

    def _decoder_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]):
        call, self._decoder_call = self._decoder_call, None
        if call is None:
            return None
        assert not args, "the decoder is called with keyword arguments"
        kwargs = {**kwargs, **call.extra_kwargs}
        kinds = call.embedding_placeholders + call.placeholders  # the first: no embedding call (inputs_embeds given)
        if kinds and kwargs.get("inputs_embeds") is not None:
            # Here, after the embedding and where the real merge would have run the vision tower, so that the
            # collectives keep their order in forward and backward.
            kwargs["inputs_embeds"] = self._with_placeholders(kwargs["inputs_embeds"], kinds)
        if call.cp_batch is not None:
            kwargs = self._context_parallel.split_decoder_inputs(kwargs, call.cp_batch, self.split_decoder_kwargs)
        return args, kwargs

    def __call__(self, *args: Any, loss_weights: torch.Tensor | None = None, **kwargs: Any):
        # FSDP2's root pre-forward hook casts every floating tensor argument to its param_dtype;
        # the loss weights must reach the loss in fp32, so they pass the hooks in an opaque holder.
        if loss_weights is not None:
            kwargs["loss_weights"] = _Uncast(loss_weights)
        return super().__call__(*args, **kwargs)

    def forward(
        self,
        *args: Any,
        shift_labels: torch.Tensor | None = None,
        loss_weights: torch.Tensor | None = None,
        cu_seq_lens: torch.Tensor | None = None,
        max_length: int | torch.Tensor | None = None,
        sequence_ids: torch.Tensor | None = None,
        num_sequences: int | None = None,
        per_token: bool = False,
        temperature: float = 1.0,
        suppress_token_ids: torch.Tensor | None = None,
        **kwargs: Any,
    ):
        if isinstance(loss_weights, _Uncast):
            loss_weights = loss_weights.tensor
        if cu_seq_lens is not None and len(args) > 2:
            raise TypeError("with cu_seq_lens pass the inputs by keyword (the attention mask is replaced)")
        plan = self._batch_plan(args, kwargs, cu_seq_lens, max_length)
        decoder_kwargs: dict[str, Any] = {}
        if plan is not None:
            decoder_kwargs = plan.decoder_kwargs()
        elif cu_seq_lens is not None:
            decoder_kwargs = packed_attention_kwargs(cu_seq_lens, max_length)
        if not args:
            kwargs = self.prepare_inputs(kwargs, cu_seq_lens)
        if cu_seq_lens is not None:
            kwargs["attention_mask"] = None
        placeholders = () if args else self._missing_media(kwargs)
        if loss_weights is None:
            if shift_labels is not None:
                kwargs["shift_labels"] = shift_labels
            if plan is not None:
                self.plan_layers(plan, None)
            with self._calling_decoder(decoder_kwargs, placeholders=placeholders):
                return super().forward(*args, **kwargs)
        if args:
            raise TypeError("the training forward (with loss_weights) takes its inputs by keyword")
        if shift_labels is None:
            raise ValueError("loss_weights needs shift_labels (the next-token target of every position)")
        if kwargs.get("labels") is not None:
            raise ValueError("pass either labels (HF loss) or shift_labels + loss_weights (weighted loss), not both")
        kwargs.pop("labels", None)
        kwargs.setdefault("use_cache", False)
        if (sequence_ids is None) != (num_sequences is None):
            raise ValueError("sequence_ids and num_sequences go together (per-sequence sums)")
        if per_token and sequence_ids is not None:
            raise ValueError("per_token and sequence_ids exclude each other")
        full_shape = shift_labels.shape
        cp_batch = None
        if self._context_parallel is not None:
            if plan is None:
                raise ValueError("the training forward under context parallel needs input_ids or inputs_embeds")
            cp_batch = self._context_parallel.plan_training_batch(kwargs, plan.bounds)
            plan.plan_context_parallel(cp_batch.layout)
            shift_labels, loss_weights = cp_batch.split(shift_labels), cp_batch.split(loss_weights)
            if sequence_ids is not None:
                sequence_ids = cp_batch.split(sequence_ids)
        if plan is not None:
            self.plan_layers(plan, None if cp_batch is None else cp_batch.layout)
        media_dp = contextlib.ExitStack()
        if len(placeholders) < len(self.media_input_keys):  # the call has media: the CP ranks share it out
            for encoder_dp in (self._vision_dp, self._audio_dp):
                if encoder_dp is not None:
                    media_dp.enter_context(encoder_dp.patched(getattr(self, self.base_model_prefix)))
        with self._calling_decoder(decoder_kwargs, cp_batch, placeholders), media_dp:
            if self.chunk_loss_size is None:
                outputs = super().forward(**kwargs)
                if per_token:
                    outputs.loss, outputs.entropy, outputs.kept_logmass = self._whole_tokens(
                        token_cross_entropy(outputs.logits, shift_labels, loss_weights, temperature, suppress_token_ids),
                        cp_batch, full_shape,
                    )
                elif sequence_ids is None:
                    outputs.loss = weighted_cross_entropy(outputs.logits, shift_labels, loss_weights)
                else:
                    outputs.loss = self._whole_sequences(
                        sequence_cross_entropy(outputs.logits, shift_labels, loss_weights, sequence_ids, num_sequences)
                    )
                return outputs
            kwargs.pop("logits_to_keep", None)
            outputs = getattr(self, self.base_model_prefix)(**kwargs)
        per_token_options = {"temperature": temperature, "suppress_token_ids": suppress_token_ids} if per_token else None
        loss_function = LinearCrossEntropy(shift_labels, loss_weights, self.chunk_loss_size, sequence_ids,
                                           num_sequences or 0, per_token_options)
        loss = self.get_submodule(self.lm_head_name)(outputs.last_hidden_state, loss_function=loss_function)
        if per_token:
            loss, entropy, kept = self._whole_tokens(loss, cp_batch, full_shape)
            outputs = CausalLMOutputWithPast(loss=loss)
            outputs.entropy, outputs.kept_logmass = entropy, kept
            return outputs
        if sequence_ids is not None:
            loss = self._whole_sequences(loss)
        return CausalLMOutputWithPast(loss=loss)

    def _batch_plan(self, args: tuple, kwargs: dict[str, Any], cu_seq_lens, max_length) -> BatchPlan | None:
        """The micro-batch's plan (step 3); None for a decoding step (a filled cache) or a call without tokens."""
        if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            return None
        tokens = kwargs.get("input_ids")
        tokens = kwargs.get("inputs_embeds") if tokens is None else tokens
        tokens = args[0] if tokens is None and args and torch.is_tensor(args[0]) else tokens
        if tokens is None:
            return None
        return BatchPlan(tokens.shape[0], tokens.shape[1], tokens.device, cu_seq_lens, max_length)

    def _whole_tokens(self, values: tuple, cp_batch: CPBatch | None, full_shape: torch.Size) -> tuple:
        """Per-token values of this CP rank's shard -> the whole batch's `[B, S]` on every CP rank (step 8): the
        values (the loss with autograd, the detached entropies and kept masses) gathered in one collective."""
        if cp_batch is None:
            return values
        loss, entropy, kept = values
        local = torch.stack([loss, entropy.to(loss.dtype), (entropy if kept is None else kept).to(loss.dtype)])
        full = cp_batch.gather(local, self._context_parallel.cp_group, seq_dim=2).reshape(3, *full_shape)
        return full[0], full[1].detach(), None if kept is None else full[2].detach()

    def _whole_sequences(self, local_sums: torch.Tensor) -> torch.Tensor:
        """Per-sequence sums of this CP rank's shard -> the whole sequences' sums on every CP rank (step 7)."""
        if self._context_parallel is None or dist.get_world_size(self._context_parallel.cp_group) == 1:
            return local_sums
        from torch.distributed.nn.functional import all_reduce

        return all_reduce(local_sums, op=dist.ReduceOp.SUM, group=self._context_parallel.cp_group)
