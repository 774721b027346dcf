"""Importing this module imports every declared data family (`mmfsdp.data_families` entry points: templates, image
plugins, collators) and what they import (e.g. `mistral_common` for the Mistral tokenizer): a preload for processes
that fork workers, as `mmfsdp.model.all_families` is for the model families."""

from mmfsdp.data.templates import template_names

template_names()
