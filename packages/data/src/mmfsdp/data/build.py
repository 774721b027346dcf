"""`build_processor(data_cfg)`: the `MMProcessor` of a data config — the tokenizer and the HF processor that the
template's (or the configured) image plugin builds around it; `build_plugin` that plugin, set by the config, and
`media_settings` the image, video and audio settings it applies, with their sources. Apart from `processor.py` so that the
plugins and templates, which use `MMProcessor`, are not imported by the module that defines it."""

from __future__ import annotations

from mmfsdp.config import ConfigError, get_logger

from mmfsdp.data.audio import AudioOptions
from mmfsdp.data.config import DataConfig
from mmfsdp.data.plugins import ImagePlugin, MediaSetting, get_plugin
from mmfsdp.data.processor import MMProcessor, load_tokenizer, model_dir
from mmfsdp.data.templates import get_template
from mmfsdp.data.video import VideoOptions

__all__ = ["build_plugin", "build_processor", "media_settings"]

log = get_logger(__name__)


def build_processor(data_cfg: DataConfig) -> MMProcessor:
    """The tokenizer and the image plugin's HF processor for `preprocess_parameters.model_name_or_path`."""
    pp = data_cfg.dataset_param.preprocess_parameters
    directory = model_dir(data_cfg)
    template = get_template(pp.template)
    plugin_cls = get_plugin(pp.image_plugin or template.default_plugin)
    tokenizer = load_tokenizer(data_cfg)
    hf_processor = plugin_cls.load_hf_processor(directory, tokenizer, trust_remote_code=pp.trust_remote_code)
    log.info("data: loaded %s + %s from %s", type(tokenizer).__name__, type(hf_processor.image_processor).__name__, directory)
    return MMProcessor(tokenizer=tokenizer, hf_processor=hf_processor, image_processor=hf_processor.image_processor, name_or_path=str(directory))


def build_plugin(data_cfg: DataConfig, processor: MMProcessor) -> ImagePlugin:
    """The image plugin of the config (`image_plugin`, else the template's), with its image and video settings (and
    its audio settings, for a plugin with `supports_audio`)."""
    pp = data_cfg.dataset_param.preprocess_parameters
    plugin_cls = get_plugin(pp.image_plugin or get_template(pp.template).default_plugin)
    if pp.use_audio_in_video and not (plugin_cls.supports_audio and plugin_cls.supports_video):
        raise ConfigError(
            "data.dataset_param.preprocess_parameters.use_audio_in_video",
            f"image plugin {plugin_cls.name!r} (this model family) reads no audio track of a video; set it to false",
        )
    audio = {"audio": AudioOptions.from_config(pp)} if plugin_cls.supports_audio else {}
    return plugin_cls(
        processor,
        image_max_pixels=pp.image_max_pixels,
        image_min_pixels=pp.image_min_pixels,
        video=VideoOptions.from_config(pp),
        **audio,
    )


def media_settings(data_cfg: DataConfig, processor: MMProcessor | None = None) -> list[MediaSetting]:
    """The image and video settings the config's plugin applies (null keys resolved from the model directory's
    processor files, then transformers' defaults), each with where its value came from."""
    return build_plugin(data_cfg, processor or build_processor(data_cfg)).media_settings()
