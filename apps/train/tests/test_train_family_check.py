"""`--check` ties the data pieces and the parallel layout to what the model family declares (its entry's
`data` and `capabilities`): a mismatch is one line naming the key, exit 2, before any process group."""

from pathlib import Path

from mmfsdp.train.cli import main

ROOT = Path(__file__).resolve().parents[3]
QWEN3VL = ROOT / "examples" / "qwen3vl-tiny" / "config.yaml"
COLLATOR = "data.dataloader_param.collate_param.model_name"


def _check_lines(capsys, tmp_path, config: Path, *overrides: str) -> tuple[int, list[str]]:
    code = main(
        [str(config), "--check", f"training.output_dir={tmp_path / 'out'}", *overrides, "--nproc-per-node", "2"]
    )
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, [line for line in captured.err.splitlines() if line.startswith("config error: ")]


def test_another_familys_collator_is_refused(capsys, tmp_path):
    code, lines = _check_lines(capsys, tmp_path, QWEN3VL)
    assert code == 0 and not lines
    code, lines = _check_lines(capsys, tmp_path, QWEN3VL, f"{COLLATOR}=pixtral")
    assert code == 2
    assert lines == [
        f"config error: {COLLATOR}: collator 'pixtral' is not for model_id 'qwen3_vl'; set it to 'qwen3_vl'"
    ]


def test_another_familys_template_and_its_default_plugin_are_refused(capsys, tmp_path):
    pre = "data.dataset_param.preprocess_parameters"
    code, lines = _check_lines(capsys, tmp_path, QWEN3VL, f"{pre}.template=mistral", f"{pre}.image_plugin=null")
    pre = f"config error: {pre}"
    assert code == 2 and lines == [
        f"{pre}.template: template 'mistral' is not for model_id 'qwen3_vl'; "
        "set it to 'qwen3_vl' or 'qwen3_vl_nothink'",
        f"{pre}.image_plugin: image plugin 'pixtral' is not for model_id 'qwen3_vl'; set it to 'qwen3_vl'",
    ]


def test_context_parallel_on_a_family_that_does_not_declare_it(capsys, tmp_path):
    """The test-only LLaVA family declares no capability and no data piece of mmfsdp.data: `--check` names each."""
    import families.llava  # noqa: F401  (registers model id llava)
    from mmfsdp.model import get_model_entry

    model_dir = tmp_path / "llava"
    get_model_entry("llava").testkit.tiny_config().save_pretrained(model_dir)
    code, lines = _check_lines(
        capsys,
        tmp_path,
        ROOT / "examples" / "tiny" / "config.yaml",
        "model.model_id=llava",
        f"model.model_name_or_path={model_dir}",
        "parallel.fsdp_plan.apply_modules=null",
        "parallel.ulysses_parallel_size=2",
    )
    pre = "config error: data.dataset_param.preprocess_parameters"
    assert code == 2 and lines == [
        "config error: parallel.ulysses_parallel_size: 2 needs context parallel, which model_id 'llava' does not "
        "support (its entry does not declare capabilities.context_parallel); set it to 1",
        f"{pre}.template: template 'mistral' is not for model_id 'llava'; its entry lists no templates",
        f"{pre}.image_plugin: image plugin 'pixtral' is not for model_id 'llava'; its entry lists no image_plugins",
        f"config error: {COLLATOR}: collator 'pixtral' is not for model_id 'llava'; its entry lists no collators",
    ]


def test_a_video_column_needs_a_family_with_video(capsys, tmp_path):
    """qwen3_vl declares video; mistral3 (examples/tiny) does not: asking it for videos is one line."""
    code, lines = _check_lines(capsys, tmp_path, QWEN3VL, "data.dataset_param.attr.videos=videos")
    assert code == 0 and not lines
    tiny = ROOT / "examples" / "tiny" / "config.yaml"
    code, lines = _check_lines(capsys, tmp_path, tiny, "data.dataset_param.attr.videos=videos")
    assert code == 2 and lines == [
        "config error: data.dataset_param.attr.videos: is set, but model_id 'mistral3' takes no video input (its "
        "entry does not declare capabilities.video); set it to null and drop the video rows"
    ]
