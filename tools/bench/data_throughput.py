"""Throughput of mmfsdp's data preprocessing against the bare HF image processor + tokenizer.

    uv run python tools/bench/data_throughput.py [--num-samples 16] [--image-size 1024] [--workers 2]
    uv run python tools/bench/data_throughput.py --smoke    # the smallest run (CI): 2 small images, 1 short video, 2 short audio clips

Generates JPEG images (smooth gradients plus noise, `--image-size` on the long side,
4:3) and one-image conversations, and a Magistral-like processor: the real Tekken
vocabulary shipped by mistral-common with Pixtral image settings (14-px patches,
spatial merge 2, longest edge 1540). Then, in one process, alternating rounds:

- ours: `SampleEncoder.encode_row` (parse, image header, template, tokenize, expand the
  image grid) + `mmfsdp.data.families.mistral.plugin.PixtralPlugin.load_images` (decode, resize, normalize) per sample;
- baseline: `PIL.Image.open` + the HF image processor on the image and the tokenizer on
  the conversation text, i.e. the work any pipeline must do.

The best round of each gives samples/s and the ratio (target >= 0.9). Finally the
DataLoader with `--workers` workers runs one epoch over the same samples; it keeps a
training step fed if it delivers at least one micro-batch per `--step-seconds`.

The video case (`video_*` keys; `--video-clips 0` skips it) writes `--video-clips` mpeg4 clips
with PyAV (`--video-size` wide, 16:9, `--video-seconds` long at 24 fps) and one-video
conversations for the tiny Qwen3-VL (`examples/qwen3vl-tiny/assets`), sampled at 2 fps
(at most 16 frames). Alternating rounds again:

- ours: `SampleEncoder.encode_row` (headers, frame sampling, timestamps, template, tokens)
  + `Qwen2VLPlugin.video_inputs` (decode only the sampled frames, the video processor);
- baseline: transformers' own pipeline on the same clip and text: `load_video(backend="pyav")`
  with the video processor's `sample_frames` at the same fps (HF's PyAV reader; its default,
  torchcodec, is not installed), then `Qwen3VLProcessor` (video processor, timestamps, tokenizer).

The audio case (`audio_*` keys; `--audio-clips 0` skips it) writes `--audio-clips` clips of
`--audio-seconds` (a tone plus noise; WAV 44.1 kHz stereo and FLAC 48 kHz mono, alternating: what
both loaders read) and one-clip conversations for the tiny Qwen3-Omni (`examples/qwen3omni-tiny/assets`:
Qwen3-Omni's audio tokens and its published feature extractor). Alternating rounds:

- ours: `SampleEncoder.encode_row` (headers, template, the clip's token count) +
  `Qwen3OmniPlugin.audio_inputs` (decode with PyAV, resample to 16 kHz, downmix, the feature extractor);
- baseline: transformers' own pipeline: `load_audio(path, 16000)` (its `auto` backend; soundfile + soxr
  here, torchcodec where installed), then `Qwen3OmniMoeProcessor` on the rendered text and the waveform
  (the feature extractor, the placeholder expansion, the tokenizer).

The last line printed is one JSON object with all numbers.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from _smoke import parse_args
from PIL import Image


def _images(out: Path, count: int, long_side: int) -> list[str]:
    rng = np.random.default_rng(0)
    width, height = long_side, long_side * 3 // 4
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    paths = []
    for i in range(count):
        base = np.stack([x / width * 255, y / height * 255, (x + y) / (width + height) * 255], axis=-1)
        pixels = np.clip(np.roll(base, i * 37, axis=1) + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
        path = out / f"img_{i:04d}.jpg"
        Image.fromarray(pixels).save(path, quality=90)
        paths.append(str(path))
    return paths


def _model_dir(out: Path) -> Path:
    import mistral_common

    raw = json.loads((Path(mistral_common.__file__).parent / "data" / "tekken_240911.json").read_text())
    raw["config"]["version"] = "v7"
    raw["image"] = {"image_patch_size": 14, "max_image_size": 1540, "spatial_merge_size": 2}
    out.mkdir(parents=True, exist_ok=True)
    (out / "tekken.json").write_text(json.dumps(raw))
    (out / "preprocessor_config.json").write_text(
        json.dumps({"image_processor_type": "PixtralImageProcessor", "patch_size": {"height": 14, "width": 14}, "size": {"longest_edge": 1540}})
    )
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "PixtralProcessor", "patch_size": 14, "spatial_merge_size": 2}))
    return out


QUESTION = "<image>\nDescribe the colours in this picture and where they change. Be specific."
ANSWER = "The picture goes from dark in the top-left corner to bright in the bottom-right, with red growing to the right and green growing downwards."


def _clips(out: Path, count: int, width: int, seconds: float) -> list[str]:
    """mpeg4 clips of a bright square crossing a noisy gradient, `width` × 9/16 `width`, 24 fps."""
    import av

    rng = np.random.default_rng(1)
    height = width * 9 // 16 // 2 * 2
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width * 255, y / height * 255, (x + y) / (width + height) * 255], axis=-1)
    paths = []
    for i in range(count):
        path = out / f"clip_{i:03d}.mp4"
        num_frames = int(seconds * 24)
        with av.open(str(path), "w") as container:
            stream = container.add_stream("mpeg4", rate=24)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            stream.bit_rate = 2_000_000
            for f in range(num_frames):
                frame = np.clip(base + rng.normal(0, 8, base.shape), 0, 255).astype(np.uint8)
                side = height // 4
                x0 = (f * 7 + i * 50) % (width - side)
                frame[height // 3 : height // 3 + side, x0 : x0 + side] = 255
                container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
            container.mux(stream.encode())
        paths.append(str(path))
    return paths


VIDEO_QUESTION = "<video>Where does the white square go?"
VIDEO_ANSWER = "It moves to the right across the picture."
VIDEO_FPS, VIDEO_MAXLEN = 2.0, 16


def _race(kind: str, reference: str, ours, baseline, count: int, rounds: int) -> dict:
    """`ours` and `baseline` (each encodes the `count` samples and returns their tokens) in alternating rounds after
    one warm-up each; the best samples/s of each, their ratio and both token counts per sample, as `<kind>_*` keys."""
    ours_tokens, hf_tokens = ours(), baseline()  # warm up, and the same inputs give the same token counts
    best = {"ours": 0.0, "baseline": 0.0}
    for _ in range(rounds):
        for name, fn in (("ours", ours), ("baseline", baseline)):
            start = time.perf_counter()
            fn()
            best[name] = max(best[name], count / (time.perf_counter() - start))
    ratio = best["ours"] / best["baseline"]
    print(
        f"{kind}: ours {best['ours']:.2f} samples/s, {reference} {best['baseline']:.2f} samples/s, ratio "
        f"{ratio:.3f} ({ours_tokens // count} vs {hf_tokens // count} tokens per sample)"
    )
    return {
        f"{kind}_ours_samples_per_s": round(best["ours"], 3),
        f"{kind}_baseline_samples_per_s": round(best["baseline"], 3),
        f"{kind}_ratio": round(ratio, 3),
        f"{kind}_tokens_per_sample": ours_tokens // count,
        f"{kind}_hf_tokens_per_sample": hf_tokens // count,
    }


def _video_case(args, work: Path) -> dict:
    """Samples/s of ours vs. `Qwen3VLProcessor` on the same clips (module docstring), best of `args.rounds`."""
    from mmfsdp.config import build
    from transformers.video_utils import load_video

    from mmfsdp.data import DataConfig, SampleEncoder, build_processor

    model_dir = Path(__file__).resolve().parents[2] / "examples" / "qwen3vl-tiny" / "assets"
    clip_dir = work / "videos"
    clip_dir.mkdir(parents=True, exist_ok=True)
    paths = _clips(clip_dir, args.video_clips, args.video_size, args.video_seconds)
    messages = [{"role": "user", "content": VIDEO_QUESTION}, {"role": "assistant", "content": VIDEO_ANSWER}]
    rows = [{"messages": messages, "videos": [p], "images": []} for p in paths]
    cfg = build(
        DataConfig,
        {
            "dataset_param": {
                "attr": {"videos": "videos"},
                "preprocess_parameters": {
                    "model_name_or_path": str(model_dir), "template": "qwen3_vl_nothink", "image_plugin": "qwen2_vl",
                    "cutoff_len": 32768, "video_fps": VIDEO_FPS, "video_maxlen": VIDEO_MAXLEN,
                },
                "basic_parameters": {"dataset_dir": str(work), "cache_dir": str(work / "cache")},
            },
        },
        "data",
    )
    processor = build_processor(cfg)
    encoder = SampleEncoder(cfg, processor)
    plugin = encoder.plugin
    hf = processor.hf_processor
    hf.video_processor.max_frames = VIDEO_MAXLEN
    text = hf.tokenizer.apply_chat_template(
        [
            {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": VIDEO_QUESTION[7:]}]},
            {"role": "assistant", "content": [{"type": "text", "text": VIDEO_ANSWER}]},
        ],
        tokenize=False,
    )

    def ours() -> int:
        tokens = 0
        for row in rows:
            sample = encoder.encode_row(row)
            plugin.video_inputs(sample["videos"], [tuple(g) for g in sample["video_grids"]])
            tokens += len(sample["input_ids"])
        return tokens

    # the same per-frame pixel cap as ours (transformers >= 5.18 knows the keyword; it warns when it is not given)
    known = hasattr(hf.video_processor, "cap_pixels_per_frame")
    cap = {"cap_pixels_per_frame": plugin.cap_pixels_per_frame} if known else {}

    def sample(metadata, **kwargs):
        return hf.video_processor.sample_frames(metadata, fps=VIDEO_FPS)

    def baseline() -> int:
        tokens = 0
        for path in paths:
            frames, metadata = load_video(path, backend="pyav", sample_indices_fn=sample)
            out = hf(
                text=[text], videos=[frames], video_metadata=[metadata], do_sample_frames=False, return_tensors="pt",
                **cap,
            )
            tokens += out["input_ids"].shape[1]
        return tokens

    result = _race("video", "Qwen3VLProcessor", ours, baseline, len(paths), args.rounds)
    return {**result, "video_clips": len(paths), "video_size": args.video_size, "video_seconds": args.video_seconds}


AUDIO_QUESTION = "<audio>How many beeps do you hear?"
AUDIO_ANSWER = "Three beeps, the last one higher."


def _audio_clips(out: Path, count: int, seconds: float) -> list[str]:
    """Tone-plus-noise clips, WAV 44.1 kHz stereo and FLAC 48 kHz mono in turn, written with PyAV."""
    import av

    rng = np.random.default_rng(2)
    paths = []
    for i in range(count):
        wav = i % 2 == 0
        rate, channels = (44100, 2) if wav else (48000, 1)
        path = out / f"clip_{i:03d}.{'wav' if wav else 'flac'}"
        t = np.arange(int(seconds * rate)) / rate
        pcm = 0.3 * np.sin(2 * np.pi * (440 + 110 * i) * t) + rng.uniform(-0.1, 0.1, (channels, t.size))
        samples = (np.clip(pcm, -1, 1) * 32767).astype(np.int16)
        with av.open(str(path), "w") as container:
            stream = container.add_stream("pcm_s16le" if wav else "flac", rate=rate, layout="stereo" if channels == 2 else "mono")
            frame = av.AudioFrame.from_ndarray(samples.T.reshape(1, -1).copy(), format="s16", layout=stream.layout.name)
            frame.sample_rate = rate
            for packet in stream.encode(frame):
                container.mux(packet)
            for packet in stream.encode(None):
                container.mux(packet)
        paths.append(str(path))
    return paths


def _audio_case(args, work: Path) -> dict:
    """Samples/s of ours vs. transformers' `load_audio` + `Qwen3OmniMoeProcessor` on the same clips (module
    docstring), best of `args.rounds`."""
    from mmfsdp.config import build
    from transformers.audio_utils import load_audio

    from mmfsdp.data import DataConfig, SampleEncoder, build_processor

    model_dir = Path(__file__).resolve().parents[2] / "examples" / "qwen3omni-tiny" / "assets"
    clip_dir = work / "audios"
    clip_dir.mkdir(parents=True, exist_ok=True)
    paths = _audio_clips(clip_dir, args.audio_clips, args.audio_seconds)
    messages = [{"role": "user", "content": AUDIO_QUESTION}, {"role": "assistant", "content": AUDIO_ANSWER}]
    rows = [{"messages": messages, "audios": [p], "images": []} for p in paths]
    cfg = build(
        DataConfig,
        {
            "dataset_param": {
                "attr": {"audios": "audios"},
                "preprocess_parameters": {
                    "model_name_or_path": str(model_dir), "template": "qwen3_omni_nothink", "image_plugin": "qwen3_omni",
                    "cutoff_len": 32768,
                },
                "basic_parameters": {"dataset_dir": str(work), "cache_dir": str(work / "cache")},
            },
        },
        "data",
    )
    processor = build_processor(cfg)
    encoder = SampleEncoder(cfg, processor)
    plugin = encoder.plugin
    hf = processor.hf_processor
    text = hf.tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "<|audio_start|><|audio_pad|><|audio_end|>" + AUDIO_QUESTION[len("<audio>"):]},
            {"role": "assistant", "content": AUDIO_ANSWER},
        ],
        tokenize=False,
    )
    rate = hf.feature_extractor.sampling_rate

    def ours() -> int:
        tokens = 0
        for row in rows:
            sample = encoder.encode_row(row)
            plugin.audio_inputs(sample["audios"], [tuple(g) for g in sample["audio_grids"]])
            tokens += len(sample["input_ids"])
        return tokens

    def baseline() -> int:
        tokens = 0
        for path in paths:
            out = hf(text=[text], audio=[load_audio(path, sampling_rate=rate)], return_tensors="pt")
            tokens += out["input_ids"].shape[1]
        return tokens

    result = _race("audio", "load_audio + Qwen3OmniMoeProcessor", ours, baseline, len(paths), args.rounds)
    return {**result, "audio_clips": len(paths), "audio_seconds": args.audio_seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-samples", type=int, default=16, help="samples (one image each) per round (default 16)")
    parser.add_argument("--image-size", type=int, default=1024, help="long side of the generated 4:3 images in pixels (default 1024)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of ours/baseline; the best of each counts (default 3)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers for the feed check (default 2)")
    parser.add_argument("--micro-batch-size", type=int, default=1, help="samples per batch in the feed check (default 1)")
    parser.add_argument("--step-seconds", type=float, default=1.0, help="training step time the loader has to keep up with (default 1.0)")
    parser.add_argument("--video-clips", type=int, default=8, help="clips of the video case; 0 skips it (default 8)")
    parser.add_argument("--video-size", type=int, default=640, help="width of the 16:9 clips in pixels (default 640)")
    parser.add_argument("--video-seconds", type=float, default=4.0, help="length of each clip (default 4.0)")
    parser.add_argument("--work-dir", default=None, help="where to write images and caches (default: a temporary directory)")
    parser.add_argument("--audio-clips", type=int, default=8, help="clips of the audio case; 0 skips it (default 8)")
    parser.add_argument("--audio-seconds", type=float, default=10.0, help="length of each audio clip (default 10.0)")
    args = parse_args(parser, argv, num_samples=2, image_size=64, rounds=1, workers=0, video_clips=1, video_size=64,
                      video_seconds=0.5, audio_clips=2, audio_seconds=0.5)

    from mmfsdp.config import build
    from mmfsdp.data import DataConfig, SampleEncoder, build_dataloader, build_dataset, build_processor

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="mmfsdp-bench-"))
    image_dir = work / "images"
    image_dir.mkdir(parents=True, exist_ok=True)
    paths = _images(image_dir, args.num_samples, args.image_size)
    rows = [{"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": ANSWER}], "images": [p]} for p in paths]
    data_file = work / "bench.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = build(
        DataConfig,
        {
            "dataset_param": {
                "preprocess_parameters": {
                    "model_name_or_path": str(_model_dir(work / "model")), "template": "mistral", "cutoff_len": 8192,
                },
                "basic_parameters": {"dataset_dir": str(work), "dataset": str(data_file), "cache_dir": str(work / "cache"), "shuffle": False},
            },
            "dataloader_param": {
                "num_workers": args.workers, "pin_memory": False, "collate_param": {"model_name": "pixtral"},
            },
        },
        "data",
    )
    processor = build_processor(cfg)
    encoder = SampleEncoder(cfg, processor)
    plugin = encoder.plugin
    image_processor, tokenizer = processor.image_processor, processor.tokenizer
    texts = [f"<s>[INST]{QUESTION.replace('<image>', '[IMG]')}[/INST]{ANSWER}</s>" for _ in rows]

    def ours() -> int:
        tokens = 0
        for row in rows:
            sample = encoder.encode_row(row)
            plugin.load_images(sample["images"], [tuple(g) for g in sample["image_grids"]])
            tokens += len(sample["input_ids"])
        return tokens

    def baseline() -> int:
        tokens = 0
        for path, text in zip(paths, texts):
            image_processor([Image.open(path)], patch_size=plugin.cell, return_tensors="pt")
            tokens += len(tokenizer(text, add_special_tokens=False)["input_ids"])
        return tokens

    ours(), baseline()  # warm up: first-call imports and allocator growth
    best = {"ours": 0.0, "baseline": 0.0}
    tokens = 0
    for _ in range(args.rounds):
        for name, fn in (("ours", ours), ("baseline", baseline)):
            start = time.perf_counter()
            result = fn()
            best[name] = max(best[name], args.num_samples / (time.perf_counter() - start))
            if name == "ours":
                tokens = result // args.num_samples
    ratio = best["ours"] / best["baseline"]
    print(f"preprocessing: ours {best['ours']:.1f} samples/s, HF image processor + tokenizer {best['baseline']:.1f} samples/s, ratio {ratio:.3f}")

    dataset = build_dataset(cfg, processor)
    loader = build_dataloader(dataset, cfg, micro_batch_size=args.micro_batch_size, dp_rank=0, dp_size=1, seed=0)
    batches = loader.batches_per_epoch
    next(loader)  # worker start-up is paid once per epoch, not per step
    start = time.perf_counter()
    for _ in range(batches - 1):
        next(loader)
    elapsed = time.perf_counter() - start
    loader.close()
    loader_rate = (batches - 1) * args.micro_batch_size / elapsed if batches > 1 else float("nan")
    fed = loader_rate * args.step_seconds >= args.micro_batch_size
    print(f"loader with {args.workers} workers: {loader_rate:.1f} samples/s; a {args.step_seconds:g}s step needs {args.micro_batch_size / args.step_seconds:.2f} samples/s -> {'fed' if fed else 'NOT fed'}")
    video = _video_case(args, work) if args.video_clips > 0 else {}
    audio = _audio_case(args, work) if args.audio_clips > 0 else {}
    print(
        json.dumps(
            {
                **video,
                **audio,
                "ours_samples_per_s": round(best["ours"], 2),
                "baseline_samples_per_s": round(best["baseline"], 2),
                "ratio": round(ratio, 3),
                "loader_samples_per_s": round(loader_rate, 2),
                "loader_workers": args.workers,
                "step_seconds": args.step_seconds,
                "keeps_step_fed": bool(fed),
                "image_size": args.image_size,
                "num_samples": args.num_samples,
                "tokens_per_sample": tokens,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
