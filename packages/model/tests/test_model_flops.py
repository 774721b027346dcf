"""FLOP counting (`mmfsdp.model.flops`, the families' cost facets: `flop_shape` / `image_patches`) against hand
calculations from the tiny configs' numbers, for each family, on the test kits' batches (rows of different lengths,
images of different sizes in some rows)."""

import torch

from mmfsdp.model import get_model_entry
from mmfsdp.model.flops import ForwardFlops, count_forward, sample_lengths


def _causal_pairs(lengths):
    return sum(n * (n + 1) // 2 for n in lengths)


def _count(model_id):
    entry = get_model_entry(model_id)
    config = entry.testkit.tiny_config()
    batch = entry.testkit.test_batch(config, images=True)
    lens = sample_lengths(batch["attention_mask"], batch.get("cu_seq_lens"))
    patches = entry.costs.image_patches(config, batch)
    return config, lens, patches, count_forward(entry.costs.flop_shape(config), lens, patches)


def test_model_flops_mistral3_by_hand():
    config, lens, patches, flops = _count("mistral3")
    text, vision = config.text_config, config.vision_config
    assert (text.hidden_size, text.intermediate_size, text.num_hidden_layers) == (64, 128, 2)
    assert (text.num_attention_heads, text.num_key_value_heads, text.head_dim, text.vocab_size) == (4, 2, 16, 256)
    assert (vision.hidden_size, vision.intermediate_size, vision.num_hidden_layers, vision.patch_size) == (32, 64, 2, 8)
    assert lens == [32, 27, 19]  # the rows' real lengths: padding is not counted
    assert patches == [32 // 8 * (32 // 8), 16 // 8 * (48 // 8)] == [16, 12]  # images of 32x32 and 16x48 pixels
    # decoder, per token and layer: q 64x64, k and v 64x(2*16), o 64x64; MLP gate, up, down 3x64x128
    layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128
    assert layer == 36_864
    tokens = 32 + 27 + 19
    decoder = 2 * (2 * layer) * tokens + 2 * 4 * (4 * 16) * _causal_pairs([32, 27, 19])  # 2 layers, attention dim 64
    lm_head = 2 * 64 * 256 * tokens
    # Pixtral: q, k, v, o 32x32, gated MLP 3x32x64 per block; patch conv 3*8*8 -> 32; attention per image, 2 blocks
    block = 4 * 32 * 32 + 3 * 32 * 64
    vision_layers = 2 * (2 * block) * 28 + 2 * 4 * (2 * 16) * (16**2 + 12**2)
    patch_conv = 2 * (3 * 8 * 8 * 32) * 28
    # projector per merged token (2x2 patches): patch merger 128 -> 32, linear_1 32 -> 64, linear_2 64 -> 64
    projector = 2 * (4 * 32 * 32 + 32 * 64 + 64 * 64) * (16 // 4 + 12 // 4)
    assert flops == ForwardFlops(decoder + vision_layers, lm_head + patch_conv + projector)
    assert flops.model == 3 * (decoder + lm_head + vision_layers + patch_conv + projector)
    assert flops.hardware(True) == flops.model + decoder + vision_layers
    assert flops.hardware(False) == flops.model


def test_model_flops_qwen3_vl_by_hand():
    config, lens, patches, flops = _count("qwen3_vl")
    vision = config.vision_config
    assert (vision.hidden_size, vision.intermediate_size, vision.depth, vision.patch_size) == (32, 64, 2, 16)
    assert (vision.temporal_patch_size, vision.spatial_merge_size, vision.out_hidden_size) == (2, 2, 64)
    assert list(vision.deepstack_visual_indexes) == [0, 1]
    assert lens == [30, 24, 17]
    assert patches == [4 * 4, 2 * 4, 4 * 2]  # image_grid_thw rows (1, 4, 4), (1, 2, 4), (1, 4, 2)
    layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128  # the same decoder sizes as mistral3's tiny config
    tokens = 30 + 24 + 17
    decoder = 2 * (2 * layer) * tokens + 2 * 4 * 64 * _causal_pairs([30, 24, 17])
    lm_head = 2 * 64 * 256 * tokens
    # vision block: fused qkv 32 -> 96, proj 32 -> 32, fc1 32 -> 64, fc2 64 -> 32; Conv3d 3*2*16*16 -> 32
    block = 3 * 32 * 32 + 32 * 32 + 32 * 64 + 64 * 32
    vision_layers = 2 * (2 * block) * 32 + 2 * 4 * 32 * (16**2 + 8**2 + 8**2)
    patch_embed = 2 * (3 * 2 * 16 * 16 * 32) * 32
    # merger and 2 DeepStack mergers per merged token: fc1 128 -> 128, fc2 128 -> 64
    mergers = 2 * 3 * (128 * 128 + 128 * 64) * (16 // 4 + 8 // 4 + 8 // 4)
    assert flops == ForwardFlops(decoder + vision_layers, lm_head + patch_embed + mergers)


def test_model_flops_qwen3_vl_moe_counts_top_k_experts_and_the_router():
    config, lens, patches, flops = _count("qwen3_vl_moe")
    text = config.text_config
    assert (text.num_experts, text.num_experts_per_tok, text.moe_intermediate_size) == (8, 2, 48)
    assert (text.decoder_sparse_step, list(text.mlp_only_layers)) == (1, [])  # every layer sparse
    attention = 64 * 64 + 2 * 64 * 32 + 64 * 64
    moe = 64 * 8 + 2 * (3 * 64 * 48)  # router 64 -> 8, then 2 of the 8 experts (gate, up, down 64x48)
    tokens = 30 + 24 + 17
    decoder = 2 * 2 * (attention + moe) * tokens + 2 * 4 * 64 * _causal_pairs(lens)
    _, _, _, dense = _count("qwen3_vl")  # the same vision tower and attention
    dense_decoder = 2 * 2 * (attention + 3 * 64 * 128) * tokens + 2 * 4 * 64 * _causal_pairs(lens)
    assert flops.other == dense.other
    assert flops.layers - decoder == dense.layers - dense_decoder


def test_model_flops_moe_dense_layers_follow_hf_rule():
    entry = get_model_entry("qwen3_vl_moe")
    text = entry.testkit.tiny_config(text_config={"mlp_only_layers": [0]}).text_config
    assert entry.costs.decoder_mlp_params(text) == 3 * 64 * 128 + (64 * 8 + 2 * 3 * 64 * 48)


def test_model_flops_packed_lengths_come_from_cu_seq_lens_without_padding():
    # row 0: a sample of 3 tokens padded to 4 (sample multiple 2), one of 4; row 1: 5 tokens padded to 6, row padding
    mask = torch.tensor([[1, 1, 1, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0, 0]])
    cu = torch.tensor([0, 4, 8, 14, 16], dtype=torch.int32)
    assert sample_lengths(mask, cu) == [3, 4, 5]
    assert sample_lengths(mask) == [7, 5]  # unpacked: one sample per row
    assert sample_lengths(torch.zeros(2, 4, dtype=torch.long)) == []


def test_qwen3_vl_counts_each_temporal_patch_of_a_video():
    entry = get_model_entry("qwen3_vl")
    batch = {"image_grid_thw": torch.tensor([[1, 4, 6]]), "video_grid_thw": torch.tensor([[3, 2, 4], [1, 4, 4]])}
    assert entry.costs.image_patches(entry.testkit.tiny_config(), batch) == [24, 8, 8, 8, 16]
    videos = {"video_grid_thw": torch.tensor([[2, 2, 2]])}
    assert entry.costs.image_patches(entry.testkit.tiny_config(), videos) == [4, 4]
