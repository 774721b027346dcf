"""Attention backends: HF parity, packed sequences, the NPU layout conversion and call path, per-image vision attention."""

import math

import pytest
import torch

import mmfsdp.model.attention as attention
from mmfsdp.config import ConfigError
from mmfsdp.model import npu_layout, resolve_attention_backend
from mmfsdp.model.attention import NpuLayout, varlen_block_mask
from mmfsdp.model.testing import assert_close, model_inputs, model_pair
from mmfsdp.model.families.mistral3.testing import tiny_batch

TOL = 1e-5


# -- pure functions ---------------------------------------------------------------------------


def test_varlen_block_mask_is_block_diagonal_and_causal():
    cu = torch.tensor([0, 3, 5, 8], dtype=torch.int32)  # two rows of 4: [0 0 0 1 | 1 2 2 2]
    mask = varlen_block_mask(cu, cu, 2, 4, 4, causal=True)
    sequence = [0, 0, 0, 1, 1, 2, 2, 2]
    for row in range(2):
        for i in range(4):
            for j in range(4):
                same = sequence[4 * row + i] == sequence[4 * row + j]
                assert mask[row, 0, i, j].item() == (same and j <= i), (row, i, j)
    full = varlen_block_mask(cu, cu, 2, 4, 4, causal=False)
    assert full[0, 0, 0, 2].item() and not full[0, 0, 0, 3].item()


def test_varlen_block_mask_puts_the_tail_in_its_own_block():
    mask = varlen_block_mask(torch.tensor([0, 2]), torch.tensor([0, 2]), 1, 4, 4, causal=False)
    assert mask[0, 0, 3, 2].item() and not mask[0, 0, 3, 1].item()


def test_npu_layout_converts_hf_starts_to_cumulative_ends():
    layout = npu_layout(torch.tensor([0, 3, 7, 12], dtype=torch.int32), [0, 3, 7, 12], 12, 12)
    assert layout == NpuLayout("TND", (3, 7, 12), (3, 7, 12), 3)


def test_npu_layout_keeps_distinct_key_lengths():
    layout = npu_layout([0, 2, 6], [0, 4, 9], 6, 9)
    assert layout.input_layout == "TND"
    assert layout.actual_seq_qlen == (2, 6) and layout.actual_seq_kvlen == (4, 9)


def test_npu_layout_falls_back_to_dense_for_one_sequence_or_equal_lengths():
    assert npu_layout([0, 10], [0, 10], 10, 10) == NpuLayout("BSND", None, None, 1)
    assert npu_layout([0, 4, 8, 12], [0, 4, 8, 12], 12, 12) == NpuLayout("BSND", None, None, 3)


def test_npu_layout_treats_an_uncovered_tail_as_a_sequence():
    assert npu_layout([0, 4, 8], [0, 4, 8], 10, 10) == NpuLayout("TND", (4, 8, 10), (4, 8, 10), 3)
    assert npu_layout([0, 4], [0, 4], 8, 8) == NpuLayout("BSND", None, None, 2)


def test_npu_layout_drops_empty_pairs():
    assert npu_layout([0, 3, 3, 8], [0, 3, 3, 8], 8, 8) == NpuLayout("TND", (3, 8), (3, 8), 2)


@pytest.mark.parametrize(
    "cu_q, cu_k, match",
    [
        ([0, 3, 8], [0, 8], "pair up"),
        ([1, 3, 8], [1, 3, 8], "start with 0"),
        ([0, 5, 3], [0, 5, 3], "not decrease"),
        ([0, 3, 9], [0, 3, 9], "only 8 tokens"),
        ([0, 3, 8], [0, 0, 8], "no keys"),
    ],
)
def test_npu_layout_rejects_malformed_lengths(cu_q, cu_k, match):
    with pytest.raises(ValueError, match=match):
        npu_layout(cu_q, cu_k, 8, 8)


def test_backend_resolution_by_name_and_device():
    assert resolve_attention_backend("sdpa", "cpu").hf_name == "mmfsdp_sdpa"
    assert resolve_attention_backend("eager", "cuda").hf_name == "mmfsdp_eager"
    with pytest.raises(ConfigError, match="no cpu implementation"):
        resolve_attention_backend("flash_attention_2", "cpu")
    with pytest.raises(ConfigError, match="not a registered"):
        resolve_attention_backend("flash3", "cuda")
    flash = attention._BACKENDS["flash_attention_2"]
    assert flash["cuda"].hf_name == "flash_attention_2" and flash["npu"].hf_name == "mmfsdp_npu_fusion"
    if not flash["npu"].available():
        with pytest.raises(ConfigError, match="torch_npu"):
            resolve_attention_backend("flash_attention_2", "npu")


# -- a fake npu_fusion_attention that checks its arguments and computes the reference ---------


class FakeNpuFusionAttention:
    """Stands in for `torch_npu.npu_fusion_attention`: checks the call, computes attention per sequence."""

    def __init__(self):
        self.layouts = []

    def __call__(self, query, key, value, head_num, input_layout, *, scale, keep_prob, atten_mask, sparse_mode,
                 actual_seq_qlen=None, actual_seq_kvlen=None):
        assert isinstance(head_num, int) and isinstance(scale, float) and keep_prob == 1.0
        assert sparse_mode in (0, 3)
        if sparse_mode == 3:
            assert atten_mask.dtype == torch.bool and atten_mask.shape == (2048, 2048)
            assert torch.equal(atten_mask, torch.ones(2048, 2048, dtype=torch.bool).triu(1))
        else:
            assert atten_mask is None
        self.layouts.append(input_layout)
        if input_layout == "TND":
            assert query.dim() == 3 and query.shape[1] == head_num
            assert isinstance(actual_seq_qlen, list) and all(isinstance(v, int) for v in actual_seq_qlen)
            assert len(actual_seq_qlen) == len(actual_seq_kvlen) >= 2
            assert actual_seq_qlen[-1] == query.shape[0] and actual_seq_kvlen[-1] == key.shape[0]
            assert all(b > a for a, b in zip([0, *actual_seq_qlen], actual_seq_qlen))
            q_bounds = list(zip([0, *actual_seq_qlen], actual_seq_qlen))
            k_bounds = list(zip([0, *actual_seq_kvlen], actual_seq_kvlen))
            outs = [self._attend(query[a:b], key[c:d], value[c:d], scale, sparse_mode == 3) for (a, b), (c, d) in zip(q_bounds, k_bounds)]
            out = torch.cat(outs)
        else:
            assert input_layout == "BSND" and actual_seq_qlen is None and actual_seq_kvlen is None
            assert query.dim() == 4 and query.shape[2] == head_num
            out = torch.stack([self._attend(q, k, v, scale, sparse_mode == 3) for q, k, v in zip(query, key, value)])
        return out, None, None, None, 0, 0, 0

    @staticmethod
    def _attend(q_SHD, k_LKD, v_LKD, scale, causal):
        groups = q_SHD.shape[1] // k_LKD.shape[1]
        k_LHD = k_LKD.repeat_interleave(groups, dim=1)
        v_LHD = v_LKD.repeat_interleave(groups, dim=1)
        scores_HSL = torch.einsum("shd,lhd->hsl", q_SHD, k_LHD) * scale
        if causal:  # bottom-right aligned, as sparse_mode 3
            s, l = q_SHD.shape[0], k_LKD.shape[0]
            allowed = torch.ones(s, l, dtype=torch.bool).tril(diagonal=l - s)
            scores_HSL = scores_HSL.masked_fill(~allowed, -math.inf)
        probs_HSL = scores_HSL.float().softmax(-1).to(q_SHD.dtype)
        return torch.einsum("hsl,lhd->shd", probs_HSL, v_LHD)


@pytest.fixture
def fake_npu(monkeypatch):
    fake = FakeNpuFusionAttention()
    monkeypatch.setattr(attention, "_npu_fusion_attention", lambda: fake)
    return fake


BACKENDS = ["mmfsdp_sdpa", "mmfsdp_eager", "mmfsdp_npu_fusion"]


# -- model-level ------------------------------------------------------------------------------


@pytest.mark.parametrize("ours_name, hf_name", [("mmfsdp_sdpa", "sdpa"), ("mmfsdp_eager", "eager")])
def test_dense_backends_match_hf_on_padded_multimodal_batches(tiny_config, ours_name, hf_name):
    ours, reference = model_pair(tiny_config, attn=ours_name, hf_attn=hf_name)
    batch = model_inputs(tiny_batch(tiny_config, seq_len=24, lengths=(24, 17)))
    with torch.no_grad():
        mine, theirs = ours(**batch).logits, reference(**batch).logits
    keep = batch["attention_mask"].bool()
    assert_close(mine[keep], theirs[keep], TOL, "attention output (kept rows)")


def _packed_text(config, lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    samples = [torch.randint(config.image_token_index + 1, config.text_config.vocab_size, (n,), generator=generator) for n in lengths]
    return samples


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_rows_do_not_attend_across_samples(tiny_config, fake_npu, backend):
    ours, reference = model_pair(tiny_config, attn=backend)
    samples = _packed_text(tiny_config, [7, 10, 5, 9])  # rows: [7 | 10 | pad 3], [5 | 9 | pad 6]
    seq_len = 20
    input_ids = torch.zeros(2, seq_len, dtype=torch.long)
    position_ids = torch.zeros(2, seq_len, dtype=torch.long)
    starts, placed = [0], []
    for row, pair in enumerate([(0, 1), (2, 3)]):
        offset = 0
        for index in pair:
            n = len(samples[index])
            input_ids[row, offset : offset + n] = samples[index]
            position_ids[row, offset : offset + n] = torch.arange(n)
            placed.append((row, offset, index))
            offset += n
            starts.append(row * seq_len + offset)
        starts.append((row + 1) * seq_len)  # the row's padding is one more sequence
    cu_seq_lens = torch.tensor(starts, dtype=torch.int32)
    with torch.no_grad():
        packed = ours(input_ids=input_ids, position_ids=position_ids, cu_seq_lens=cu_seq_lens).logits
        for row, offset, index in placed:
            alone = reference(input_ids=samples[index][None]).logits[0]
            assert_close(packed[row, offset : offset + len(samples[index])], alone, TOL, f"{backend}: sample {index} packed vs alone")
    if backend == "mmfsdp_npu_fusion":
        # the text-only batch runs the vision placeholder (one whole image) first, then the packed decoder
        num_decoder = tiny_config.text_config.num_hidden_layers
        assert set(fake_npu.layouts[-num_decoder:]) == {"TND"}
        assert len(fake_npu.layouts) == num_decoder + tiny_config.vision_config.num_hidden_layers


def test_npu_backend_matches_sdpa_without_packing(tiny_config, fake_npu):
    ours, reference = model_pair(tiny_config, attn="mmfsdp_npu_fusion")
    batch = model_inputs(tiny_batch(tiny_config, seq_len=24))
    with torch.no_grad():
        assert_close(ours(**batch).logits, reference(**batch).logits, TOL, "logits")
    # the text runs dense (BSND); the vision tower's two images of different sizes run in TND
    assert "BSND" in fake_npu.layouts and "TND" in fake_npu.layouts


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sizes", [((64, 64), (16, 48), (48, 32)), ((32, 32), (32, 32), (32, 32))])
def test_each_image_attends_only_within_itself(tiny_config, fake_npu, backend, sizes):
    ours, _ = model_pair(tiny_config, attn=backend)
    tower = ours.model.vision_tower
    side = max(max(s) for s in sizes)
    generator = torch.Generator().manual_seed(3)
    pixel_values = torch.zeros(len(sizes), 3, side, side)
    for i, (h, w) in enumerate(sizes):
        pixel_values[i, :, :h, :w] = torch.randn(3, h, w, generator=generator)
    image_sizes = torch.tensor([list(s) for s in sizes])
    with torch.no_grad():
        together = tower(pixel_values, image_sizes=image_sizes).last_hidden_state[0]
        alone = [tower(pixel_values[i : i + 1, :, :h, :w], image_sizes=image_sizes[i : i + 1]).last_hidden_state[0] for i, (h, w) in enumerate(sizes)]
    assert together.shape[0] == sum(a.shape[0] for a in alone)
    assert_close(together, torch.cat(alone), TOL, "together vs alone")
    if backend == "mmfsdp_npu_fusion":
        expected = "BSND" if len(set(sizes)) == 1 else "TND"
        assert fake_npu.layouts[0] == expected


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("batch_size, cu", [(1, [0, 3, 8, 11, 16]), (2, [0, 5, 8, 13, 16]), (2, [0, 4, 7, 12])])
def test_sdpa_runs_each_packed_sequence_alone_as_the_block_mask_does(causal, batch_size, cu):
    """The per-sequence SDPA path (no T x T mask) against SDPA with the block-diagonal mask: values and grads,
    grouped query heads, several rows, equal-length sequences batched, and a tail after the last boundary."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from mmfsdp.model.attention import sdpa_attention

    class Attn(torch.nn.Module):
        is_causal = causal
        num_key_value_groups = 2
        training = False

    seq_len = 16 // batch_size if cu[-1] == 16 else 8
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch_size, heads, seq_len, 8, generator=generator, requires_grad=True) for heads in (4, 2, 2))
    cu_seq_lens = torch.tensor(cu, dtype=torch.int32)
    out, _ = sdpa_attention(Attn(), q, k, v, None, cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens)
    mask = varlen_block_mask(cu_seq_lens, cu_seq_lens, batch_size, seq_len, seq_len, causal=causal)
    ref, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](Attn(), q, k, v, mask, is_causal=False)
    assert out.shape == ref.shape == (batch_size, seq_len, 4, 8)
    assert_close(out, ref, TOL, "output")
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for grad, ref_grad in zip(grads, ref_grads):
        assert_close(grad, ref_grad, TOL, "gradient")


def test_compiled_packed_sdpa_is_one_graph_for_every_set_of_lengths():
    """Under `torch.compile` packed self-attention is one opaque op in the block's graph (`mmfsdp::packed_sdpa`):
    no graph break, no new graph for new sequence lengths or a new number of sequences (dimensions marked dynamic
    as `mmfsdp.parallel.compile.mark_token_dims` marks them), and the outputs and gradients of the eager path."""
    from torch._dynamo.utils import counters

    from mmfsdp.model.attention import sdpa_attention

    class Attn(torch.nn.Module):
        is_causal = True
        num_key_value_groups = 2
        training = False

    def block(q, k, v, cu):
        out, _ = sdpa_attention(Attn(), q * 1.5, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, scaling=0.3)
        return out.sin()

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(block, backend="aot_eager")
    generator = torch.Generator().manual_seed(0)
    # a tail after the last boundary, more sequences, and a sequence crossing the rows (the masked path in the op)
    for batch_size, seq_len, cu in [(2, 8, [0, 3, 8, 11]), (2, 10, [0, 2, 7, 10, 14, 20]), (2, 9, [0, 5, 12, 18])]:
        q, k, v = (torch.randn(batch_size, heads, seq_len, 8, generator=generator, requires_grad=True)
                   for heads in (4, 2, 2))
        cu_seq_lens = torch.tensor(cu, dtype=torch.int32)
        for x in (q, k, v):
            torch._dynamo.maybe_mark_dynamic(x, 2)
        torch._dynamo.maybe_mark_dynamic(cu_seq_lens, 0)
        out, ref = compiled(q, k, v, cu_seq_lens), block(q, k, v, cu_seq_lens)
        assert_close(out, ref, TOL, f"output, lengths {cu}")
        weights = torch.randn(out.shape, generator=generator)
        grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
        ref_grads = torch.autograd.grad((ref * weights).sum(), (q, k, v))
        for name, grad, ref_grad in zip("qkv", grads, ref_grads):
            assert_close(grad, ref_grad, TOL, f"d{name}, lengths {cu}")
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
