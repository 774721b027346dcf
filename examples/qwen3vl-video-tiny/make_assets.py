"""Write the tiny video run's data: `uv run python examples/qwen3vl-video-tiny/make_assets.py [OUT_DIR]`.

Clips (PyAV, mpeg4, 32×32, 2 frames at 2 fps) of a red shape moving left, right, up or down from a random
start, asked "Which way does the red circle move?" -> "left" (chance 0.25; one frame alone is worth 0.44 at best),
mixed with the shapes image question ("What shape and colour is this?" -> "a red circle", 10 %) and text-only rows
("What colour is a banana?" -> "yellow", 10 %); the held-out rows are all video rows.
`mmfsdp.data.synthetic.make_motion_dataset` writes them (deterministic in its arguments; an existing directory with
the same settings is kept).
The model directory is the tiny Qwen3-VL's (`examples/qwen3vl-tiny/assets`: its byte-level tokenizer spells the
new words, and its video processor settings follow its image processor); the run starts from random weights.
"""

import sys
from pathlib import Path

from mmfsdp.data.synthetic import make_motion_dataset

ROOT = Path(__file__).resolve().parents[2]
NUM_TRAIN, NUM_EVAL, SEED = 6144, 256, 0
FRAME_SIZE, NUM_FRAMES, FPS, SHAPE_SHARE, BACKGROUND, CLIP_COLOURS, TRAVEL_PX = 32, 2, 2, 0.5, None, ("red",), (6, 8)
IMAGE_SHARE, TEXT_ONLY_SHARE = 0.1, 0.1
"""1-second clips of 2 frames of 32 × 32: one temporal patch of two frames whose 2 × 2 patches of 16 px merge
(merge 2) into ONE video token, so the patch embedding (a Conv3d over both frames) and that token see the whole
motion. A red shape of side 16 px (one patch) on a flat random grey moves 6-8 px between the two frames from a
random start; 80 % of the training rows are clips. The start keeps the path inside the frame, so one frame's
position alone is right 0.44 of the time at best (simulated, chance 0.25). The earlier 12-px shape moving 5-7 px in
70 % of the rows left the 4-way plateau at step 250-300 or never, depending on the seed and the batch layout;
this one leaves it by step 80 (README.md)."""


def main(out: Path, num_train: int = NUM_TRAIN, num_eval: int = NUM_EVAL) -> dict:
    return make_motion_dataset(
        out, num_train=num_train, num_eval=num_eval, seed=SEED, frame_size=FRAME_SIZE, num_frames=NUM_FRAMES, fps=FPS,
        shape_share=SHAPE_SHARE, noise=0, background=BACKGROUND,
        clip_colours=CLIP_COLOURS, travel_px=TRAVEL_PX, image_share=IMAGE_SHARE, text_only_share=TEXT_ONLY_SHARE,
    )


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "outputs" / "qwen3vl-video-tiny" / "data"
    meta = main(out)
    print(f"wrote {out}: {meta['num_train']} training rows, {meta['num_eval']} held-out video rows")
