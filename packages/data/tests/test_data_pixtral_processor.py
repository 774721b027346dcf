"""The `pixtral` plugin + collator give exactly the HF `PixtralProcessor`'s ids, pixels and image sizes.

Reference: `PixtralProcessor(text=rendered conversation with [IMG] per image, images=...)`
on the same tokenizer and image processor. Checked on the real Tekken tokenizer
(16-px patches, longest edge 1024, no merge) and on the tiny processor (4-px patches,
merge 2, longest edge 64) over random image sizes and aspect ratios.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from mmfsdp.data import SampleEncoder, build_processor, media_settings
from mmfsdp.data.families.mistral.collator import PixtralCollator
from mmfsdp.data.plugins import scale_to_pixel_limits
from mmfsdp.data.families.mistral.plugin import pixtral_resized_size


def _row(num_images: int) -> dict:
    user_1 = "<image>" * min(num_images, 1) + "Describe the picture, please."
    user_2 = "Now these:" + "<image>\n" * max(num_images - 1, 0) + "Which is darker?"
    return {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": user_1},
            {"role": "assistant", "content": "Noise."},
            {"role": "user", "content": user_2},
            {"role": "assistant", "content": "The first."},
        ],
    }


def _rendered(row: dict) -> str:
    """The conversation as one string, [IMG] per image, as one would hand it to PixtralProcessor."""
    m = row["messages"]
    text = f"<s>[SYSTEM_PROMPT]{m[0]['content']}[/SYSTEM_PROMPT]"
    for user, assistant in zip(m[1::2], m[2::2]):
        text += f"[INST]{user['content'].replace('<image>', '[IMG]')}[/INST]{assistant['content']}</s>"
    return text


def _compare(processor, cfg, tmp_path, h, sizes: list[tuple[int, int]]) -> None:
    paths = [h.write_image(tmp_path / f"img{i}_{w}x{hh}.png", w, hh, seed=i) for i, (w, hh) in enumerate(sizes)]
    row = {**_row(len(paths)), "images": paths}
    encoder = SampleEncoder(cfg, processor)
    sample = encoder.encode_row(row)
    pixel_values, image_sizes = encoder.plugin.load_images(sample["images"], [tuple(g) for g in sample["image_grids"]])
    batch = PixtralCollator(pad_token_id=processor.pad_token_id)(
        [{"input_ids": torch.tensor(sample["input_ids"]), "labels": torch.tensor(sample["labels"]), "pixel_values": pixel_values, "image_sizes": image_sizes}]
    )
    reference = processor.hf_processor(text=_rendered(row), images=[Image.open(p) for p in paths], add_special_tokens=False, return_tensors="pt")
    assert sample["input_ids"] == reference["input_ids"][0].tolist()
    assert torch.equal(batch["image_sizes"], torch.as_tensor(reference["image_sizes"]).long())
    assert batch["pixel_values"].dtype == torch.float32
    assert torch.equal(batch["pixel_values"], reference["pixel_values"])


@pytest.fixture(scope="module")
def tokjson_processor(tokenizer_json_dir, tmp_path_factory, h):
    return build_processor(h.data_config(tokenizer_json_dir, tmp_path_factory.mktemp("unused")))


def test_tekken_tokenizer_matches_pixtral_processor(tokjson_processor, tmp_path, h):
    cfg = h.data_config(tokjson_processor.name_or_path, tmp_path)
    _compare(tokjson_processor, cfg, tmp_path, h, [(33, 47), (1300, 700), (16, 16)])


def test_tiny_processor_matches_pixtral_processor(tiny_processor, tmp_path, h):
    cfg = h.data_config(tiny_processor.name_or_path, tmp_path)
    _compare(tiny_processor, cfg, tmp_path, h, [(64, 64), (10, 90), (200, 31)])


def test_a_directory_as_transformers_5_saves_it_loads_the_same_processor(tiny_processor, tmp_path, h):
    """transformers 5 saves the image processor as a section of processor_config.json, with no
    preprocessor_config.json; the plugin reads it there, as AutoProcessor does, not from the tekken fallback."""
    saved = tmp_path / "saved"
    tiny_processor.hf_processor.save_pretrained(str(saved))
    assert not (saved / "preprocessor_config.json").exists()
    cfg = h.data_config(saved, tmp_path)
    again = build_processor(cfg)
    assert type(again.image_processor) is type(tiny_processor.image_processor)
    assert again.image_processor.to_dict() == tiny_processor.image_processor.to_dict()
    found = {s.key: (s.value, s.source) for s in media_settings(cfg, again)}
    source = "model directory: processor_config.json (image_processor)"
    assert found["image_processor.size.longest_edge"] == (64, source)
    assert found["image_max_pixels"][0] is None
    cfg = h.data_config(tiny_processor.name_or_path, tmp_path, preprocess={"image_max_pixels": 32 * 32})
    assert {s.key: s.source for s in media_settings(cfg, tiny_processor)}["image_max_pixels"] == "config"


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.tuples(st.integers(8, 260), st.integers(8, 260)), min_size=1, max_size=3))
def test_random_sizes_match_pixtral_processor(tiny_processor, tmp_path, h, sizes):
    cfg = h.data_config(tiny_processor.name_or_path, tmp_path)
    _compare(tiny_processor, cfg, tmp_path, h, sizes)


@settings(max_examples=300, deadline=None)
@given(height=st.integers(1, 5000), width=st.integers(1, 5000), longest_edge=st.sampled_from([64, 1024, 1540]), patch=st.sampled_from([8, 16, 28]))
def test_resize_arithmetic_equals_hf(height, width, longest_edge, patch):
    from transformers.models.pixtral.image_processing_pixtral import get_resize_output_image_size

    reference = get_resize_output_image_size(np.zeros((height, width, 3)), size=(longest_edge, longest_edge), patch_size=(patch, patch), input_data_format="channels_last")
    assert pixtral_resized_size(height, width, longest_edge, patch) == tuple(reference)


def test_pixel_limits_scale_before_the_processor(tiny_dir, tmp_path, h):
    cfg = h.data_config(tiny_dir, tmp_path, preprocess={"image_max_pixels": 32 * 32, "image_min_pixels": 16 * 16})
    processor = build_processor(cfg)
    encoder = SampleEncoder(cfg, processor)
    assert scale_to_pixel_limits(100, 50, 32 * 32, None) == (45, 22)
    assert scale_to_pixel_limits(8, 4, None, 16 * 16) == (22, 11)
    for w, hh in [(100, 50), (8, 4), (20, 20)]:
        path = h.write_image(tmp_path / f"p{w}x{hh}.png", w, hh)
        sample = encoder.encode_row({**_row(1), "images": [path]})
        _, sizes = encoder.plugin.load_images(sample["images"], [tuple(g) for g in sample["image_grids"]])
        sw, sh = scale_to_pixel_limits(w, hh, 32 * 32, 16 * 16)
        rows, cols = sample["image_grids"][0]
        assert (rows, cols) == (math.ceil(sh / 8), math.ceil(sw / 8))
        assert sizes.tolist() == [[rows * 8, cols * 8]]
        # The HF processor on the pre-resized image gives the same ids.
        resized = Image.open(path).resize((sw, sh), Image.Resampling.BICUBIC)
        reference = processor.hf_processor(text=_rendered({**_row(1)}), images=[resized], add_special_tokens=False, return_tensors="pt")
        assert sample["input_ids"] == reference["input_ids"][0].tolist()
