"""The data families of this package, one folder each: a family's chat template(s), image (and video) plugin and
collator. Each folder's package registers them on import and is declared in the `mmfsdp.data_families`
entry-point group, which the template, plugin and collator registries load on their first lookup (docs/families.md)."""
