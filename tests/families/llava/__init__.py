"""A test-only model family, written as a user writes one: HF `LlavaForConditionalGeneration` (CLIP vision tower,
two-layer projector, Llama decoder) as model id `llava`.

Importing this package registers it (`mmfsdp.model.register_model`); nothing outside this folder names it. An
installed family would instead declare its module under the `mmfsdp.model_families` entry points of its package
(and its adapter under `mmfsdp.state_dict_adapters`), so that `registered_model_ids()` lists it without an import.

- `model.py`: the model class (`TrainingForwardMixin` + the HF class, with its vision placeholder) and the spec
  (plans, capabilities, meta init of CLIP's position ids), with its costs and test kit (`tiny_config`, `test_batch`);
- `adapter.py`: the state-dict adapter (HF files keep LLaVA's original key layout);
- `testing.py`: the synthetic batches of the test kit's `test_batch`.
"""

from families.llava.adapter import LlavaAdapter
from families.llava.model import LlavaEntry, LlavaForConditionalGenerationFSDP

__all__ = ["LlavaAdapter", "LlavaEntry", "LlavaForConditionalGenerationFSDP"]
