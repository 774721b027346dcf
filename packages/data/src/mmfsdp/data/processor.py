"""The tokenizer and image processor of `preprocess_parameters.model_name_or_path` (`MMProcessor`).

`mmfsdp.data.build.build_processor(data_cfg)` returns an `MMProcessor`: the HF tokenizer
(`AutoTokenizer`, so a `tokenizer.json` or Mistral's `tekken.json` both work), the
HF processor the image plugin builds around it (for Pixtral a `PixtralProcessor`),
and its image processor. It also owns the one way text is turned into ids:
text is encoded *literally* — a `[INST]` typed into a dataset row stays text, as in
Mistral's own encoder — and control tokens are only ever inserted by the template.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmfsdp.config import ConfigError

from mmfsdp.data.config import DataConfig

__all__ = ["MMProcessor", "load_tokenizer", "model_dir"]

_KEY = "data.dataset_param.preprocess_parameters"


@dataclass
class MMProcessor:
    """Tokenizer + image processor of one model, with the text-encoding rules the templates rely on."""

    tokenizer: Any
    """The HF tokenizer."""
    hf_processor: Any
    """The HF multimodal processor (e.g. `PixtralProcessor`) holding `tokenizer` and `image_processor`."""
    image_processor: Any
    """The HF image processor (`hf_processor.image_processor`)."""
    name_or_path: str = ""
    """Where it was loaded from."""
    _literal_kwargs: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        # Fast HF tokenizers parse special-token strings inside text unless told not to;
        # MistralCommonBackend never does and rejects the flag.
        try:
            self.tokenizer(["a"], add_special_tokens=False, split_special_tokens=True)
            self._literal_kwargs = {"split_special_tokens": True}
        except (ValueError, TypeError, NotImplementedError):
            self._literal_kwargs = {}

    def encode_texts(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, with no special tokens added and none parsed from the text."""
        nonempty = [t for t in texts if t]
        encoded = iter(self.tokenizer(nonempty, add_special_tokens=False, **self._literal_kwargs)["input_ids"] if nonempty else [])
        return [list(next(encoded)) if t else [] for t in texts]

    def token_id(self, token: str) -> int:
        """The id of a control token such as `[INST]`; a `ConfigError` if the tokenizer lacks it."""
        try:
            idx = self.tokenizer.convert_tokens_to_ids(token)
        except (KeyError, ValueError):
            idx = None
        unk = getattr(self.tokenizer, "unk_token", None)
        if idx is None or (idx == getattr(self.tokenizer, "unk_token_id", None) and token != unk):
            raise ConfigError(
                f"{_KEY}.model_name_or_path",
                f"the tokenizer in {self.name_or_path!r} has no {token!r} token; the chosen template/plugin needs it "
                "(is this the right model directory for this template?)",
            )
        return int(idx)

    @property
    def pad_token_id(self) -> int:
        """Id used to pad `input_ids`: the tokenizer's pad token, else `<pad>`, else EOS."""
        if getattr(self.tokenizer, "pad_token_id", None) is not None:
            return int(self.tokenizer.pad_token_id)
        for token in ("<pad>", "[PAD]"):
            try:
                return self.token_id(token)
            except ConfigError:
                pass
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            return int(self.tokenizer.eos_token_id)
        return self.token_id("</s>")

    def decode(self, ids: list[int]) -> str:
        """Text of `ids` with special tokens shown."""
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def model_dir(data_cfg: DataConfig) -> Path:
    """The local model directory of `preprocess_parameters.model_name_or_path`; a `ConfigError` if unset or missing."""
    path = data_cfg.dataset_param.preprocess_parameters.model_name_or_path
    if not path:
        raise ConfigError(f"{_KEY}.model_name_or_path", "is not set; point it at the local HF model directory (the one with config.json and the tokenizer)")
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise ConfigError(f"{_KEY}.model_name_or_path", f"{path!r} is not a directory; download the model first and give its local path")
    return directory


def load_tokenizer(data_cfg: DataConfig) -> Any:
    """`AutoTokenizer.from_pretrained(model_name_or_path, ...)` with the configured flags."""
    from transformers import AutoTokenizer

    pp = data_cfg.dataset_param.preprocess_parameters
    directory = model_dir(data_cfg)
    kwargs: dict[str, Any] = {"use_fast": pp.use_fast_tokenizer, "trust_remote_code": pp.trust_remote_code, "local_files_only": True}
    if pp.fix_mistral_regex is not None:
        kwargs["fix_mistral_regex"] = pp.fix_mistral_regex
    try:
        return AutoTokenizer.from_pretrained(str(directory), **kwargs)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{_KEY}.model_name_or_path", f"cannot load a tokenizer from {str(directory)!r}: {err}") from None
