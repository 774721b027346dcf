"""The parts of `tools/bench/gpu_check.py` (its docstring describes the run): one module per section, each
holding that section's function `section_<name>(ctx) -> dict` (and the helpers only it uses); `common` holds
the tolerances and the helpers of the JSON line, `context` the sizes of a mode, the trainer runs and the run's
`Context`. A new section is a new module here and one row of `gpu_check.SECTIONS`."""
