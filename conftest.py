"""Suite-wide test scheduling (ordering and threads only; no fixtures here).

The suite runs on two xdist workers that take whole files (`-n 2 --dist loadfile`, pyproject.toml), in
collection order. Longest first keeps the end of the run short: the files below (serial wall seconds on the
2-core machine, measured 2026-12-03) are collected first, longest first; every other file follows in its
usual order. A wrong or missing number only changes the order, never what runs.
Two workers already fill the cores, so each test process (and every rank it spawns, which inherits the
environment) computes on one thread unless OMP_NUM_THREADS says otherwise; the app's launcher does the same.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before any test module imports torch

_SERIAL_SECONDS = {
    "tests/test_e2e_resume_meta.py": 225,
    "tests/test_e2e_resume.py": 200,
    "tests/test_e2e_qwen3vl_resume.py": 190,
    "tests/test_e2e_qwen3vl_parity.py": 170,
    "tests/test_e2e_faults.py": 150,
    "tests/test_e2e_magistral_smoke.py": 146,
    "tests/test_e2e_errors.py": 125,
    "tests/test_e2e_varlen_parity.py": 125,
    "tests/test_e2e_fsdp_parity.py": 118,
    "tests/test_e2e_lora_resume.py": 101,
    "tests/test_e2e_cp.py": 100,
    "tests/test_e2e_msmm.py": 55,
    "packages/model/tests/test_model_cp_parity.py": 80,
    "packages/model/tests/test_model_qwen3vl_cp.py": 68,
    "tests/test_e2e_lora.py": 66,
    "tests/test_e2e_moe_router.py": 62,
    "packages/parallel/tests/test_parallel_fsdp.py": 60,
    "tests/test_e2e_ckpt_fsdp.py": 58,
    "packages/parallel/tests/test_parallel_mesh.py": 56,
    "packages/ckpt/tests/test_ckpt_distributed.py": 50,
    "packages/model/tests/test_model_distributed.py": 45,
    "packages/parallel/tests/test_parallel_cp_attention.py": 40,
    "tests/test_e2e_memory_measured.py": 40,
    "apps/train/tests/test_train_check.py": 32,
    "packages/model/tests/test_model_lora.py": 17,
    "apps/train/tests/test_train_start_lora.py": 8,
    "packages/ckpt/tests/test_ckpt_lora.py": 6,
    "tests/test_msmm_config.py": 23,
}


def pytest_collection_modifyitems(config, items):
    root = config.rootpath
    order = {item: i for i, item in enumerate(items)}

    def seconds(item) -> int:
        try:
            return _SERIAL_SECONDS.get(item.path.relative_to(root).as_posix(), 0)
        except ValueError:
            return 0

    items.sort(key=lambda item: (-seconds(item), order[item]))
