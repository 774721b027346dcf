"""Importing this module imports every declared model family (`mmfsdp.model_families` entry points): a
preload for processes that fork workers, e.g. `mmfsdp.parallel.testing.preload_for_ranks`."""

from mmfsdp.model.registry import load_all_families

load_all_families()
