"""The model families of this package, one folder each (spec, state-dict adapter, vision patches, test helpers);
each registers through the `mmfsdp.model_families` and `mmfsdp.state_dict_adapters` entry points (docs/families.md)."""
