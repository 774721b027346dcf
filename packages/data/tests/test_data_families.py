"""Data families register through the `mmfsdp.data_families` entry points, which the registries load on their first
lookup; each piece has one name, and the older spellings users' YAML has are aliases."""

from importlib.metadata import entry_points

from mmfsdp.data import get_collator, get_plugin, get_template
from mmfsdp.data.collators import collator_names
from mmfsdp.data.plugins import plugin_names
from mmfsdp.data.templates import template_names


def test_families_are_declared_as_entry_points():
    families = {"mistral", "qwen3_5", "qwen3_omni_moe", "qwen3_vl"}
    assert {point.name for point in entry_points(group="mmfsdp.data_families")} >= families
    templates = ["mistral", "qwen3_5", "qwen3_omni", "qwen3_omni_nothink", "qwen3_vl", "qwen3_vl_nothink"]
    assert template_names() == templates
    assert plugin_names() == ["pixtral", "qwen3_omni", "qwen3_vl"]
    assert collator_names() == ["pixtral", "qwen3_omni", "qwen3_vl"]


def test_old_names_are_aliases_of_one_spelling():
    assert get_plugin("qwen2_vl") is get_plugin("qwen3_vl") and get_plugin("qwen2_vl").name == "qwen3_vl"
    assert get_collator("qwen3vl") is get_collator("qwen3_vl") and get_collator("qwen3vl").name == "qwen3_vl"
    assert get_collator("qwen3omni") is get_collator("qwen3_omni")
    assert get_template("qwen3_vl").default_plugin == "qwen3_vl" and get_template("mistral").default_plugin == "pixtral"
