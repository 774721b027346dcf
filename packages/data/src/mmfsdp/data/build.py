"""`build_processor(data_cfg)`: the `MMProcessor` of a data config — the tokenizer and the HF processor that the
template's (or the configured) image plugin builds around it. Apart from `processor.py` so that the plugins and
templates, which use `MMProcessor`, are not imported by the module that defines it."""

from __future__ import annotations

from mmfsdp.config import get_logger

from mmfsdp.data.config import DataConfig
from mmfsdp.data.plugins import get_plugin
from mmfsdp.data.processor import MMProcessor, load_tokenizer, model_dir
from mmfsdp.data.templates import get_template

__all__ = ["build_processor"]

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
