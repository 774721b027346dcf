"""For every image size, the image tokens the pixtral plugin lays out equal the features the model makes.

A tiny `Mistral3ForConditionalGeneration` (Pixtral vision tower, 4-px patches, spatial
merge 2) encodes the collated `pixel_values` / `image_sizes`; per image, the number of
feature vectors must equal the number of `[IMG]` tokens in that image's block, and the
full forward (which checks tokens against features itself) must run.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmfsdp.data import BadSample, SampleEncoder
from mmfsdp.data.families.mistral.collator import PixtralCollator

SIZE = st.tuples(st.integers(1, 300), st.integers(1, 300))


def _blocks(ids: list[int], image_id: int, end_id: int) -> list[int]:
    """Number of [IMG] tokens in each image block, in order."""
    counts, current = [], 0
    for t in ids:
        current += t == image_id
        if t == end_id:
            counts.append(current)
            current = 0
    return counts


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(SIZE, min_size=1, max_size=2))
def test_image_tokens_equal_image_features(tiny_processor, tiny_model, tmp_path, h, sizes):
    cfg = h.data_config(tiny_processor.name_or_path, tmp_path)
    encoder = SampleEncoder(cfg, tiny_processor)
    plugin = encoder.plugin
    # A fixed 24x16 image goes last: HF's get_image_features squeezes away the token
    # dimension when a whole batch has exactly one feature (a lone 1x1 grid) and crashes.
    sizes = [*sizes, (24, 16)]
    paths = [h.write_image(tmp_path / f"f{i}_{w}x{hh}.png", w, hh, seed=i) for i, (w, hh) in enumerate(sizes)]
    row = {"messages": [{"role": "user", "content": "<image>" * len(paths) + "What shape and colour is this?"}, {"role": "assistant", "content": "a red circle"}], "images": paths}
    # An image whose short side would shrink below one pixel cannot be processed at all; it is a bad row.
    grids = [plugin.grid(w, hh) for w, hh in sizes]
    if any(r < 1 or c < 1 for r, c in grids):
        try:
            encoder.encode_row(row)
        except BadSample as bad:
            assert bad.reason == "corrupt_image"
            return
        raise AssertionError("an image with an empty grid was accepted")

    sample = encoder.encode_row(row)
    pixel_values, image_sizes = plugin.load_images(sample["images"], [tuple(g) for g in sample["image_grids"]])
    batch = PixtralCollator(pad_token_id=tiny_processor.pad_token_id)(
        [{"input_ids": torch.tensor(sample["input_ids"]), "labels": torch.tensor(sample["labels"]), "pixel_values": pixel_values, "image_sizes": image_sizes}]
    )
    with torch.no_grad():
        features = tiny_model.model.get_image_features(pixel_values=batch["pixel_values"], image_sizes=batch["image_sizes"])
        features = getattr(features, "pooler_output", features)  # older transformers return the per-image tuple itself
        per_image = [f.shape[0] for f in features]
        assert per_image == _blocks(sample["input_ids"], plugin.image_id, plugin.end_id) == [r * c for r, c in grids]
        out = tiny_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], pixel_values=batch["pixel_values"], image_sizes=batch["image_sizes"])
    assert torch.isfinite(out.logits).all()
