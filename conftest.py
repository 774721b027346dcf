"""Suite-wide test set-up: ordering, threads and what distributed test ranks preload (no fixtures here).

The suite runs on two xdist workers that take whole files (`-n 2 --dist loadfile`, pyproject.toml), in
collection order. Longest first keeps the end of the run short: the files below (wall seconds of each file
inside the 2-worker run on the 2-core machine, measured 2026-12-04: 12.9 minutes in all) are collected first,
longest first; every other file follows in its usual order. A wrong or missing number only changes the order, never what runs.
Two workers already fill the cores, so each test process (and every rank it spawns, which inherits the
environment) computes on one thread unless OMP_NUM_THREADS says otherwise; the app's launcher does the same.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before any test module imports torch

from mmfsdp.parallel.testing import preload_for_ranks  # noqa: E402

# what the ranks of `run_distributed` import once, in the forkserver they fork from
preload_for_ranks("transformers", "mmfsdp.model.all_families", "mmfsdp.data", "mmfsdp.ckpt")

_FILE_SECONDS = {
    "tests/test_e2e_multinode.py": 165,
    "tests/test_e2e_launch.py": 40,
    "tests/test_e2e_text_only_parity.py": 365,  # serial, 2026-12-05, busy machine, with the 8 vision-DP runs
    "tests/test_e2e_balance.py": 145,  # serial, 2026-12-05, busy machine (10 trainers in 2 spawns, 2 app runs)
    "tests/test_e2e_resume_meta.py": 140,
    "tests/test_e2e_video_parity.py": 100,  # serial, 2026-12-05 (8 trainers: 3 on 1 process, 5 on 2)
    "tests/test_e2e_resume.py": 120,
    "tests/test_e2e_faults.py": 112,
    "tests/test_e2e_qwen3vl_30b_recipe.py": 105,  # serial, 2026-12-05 (two script runs of ~35 s, --check ~12 s)
    "tests/test_e2e_magistral_smoke.py": 93,
    "tests/test_e2e_metrics_sinks.py": 71,  # serial, 2026-12-05 (two app runs on a busy machine)
    "tests/test_e2e_errors.py": 70,
    "tests/test_e2e_lora_resume.py": 69,
    "tests/test_e2e_qwen3vl_resume.py": 68,
    "tests/test_e2e_video_resume.py": 75,  # 2026-12-05: 255 s serial on a machine shared by 7 jobs (load 11)
    "tests/test_e2e_moe_router.py": 65,
    "packages/ckpt/tests/test_ckpt_distributed.py": 58,
    "tests/test_e2e_moe_resume.py": 57,
    "tests/test_e2e_family_contract.py": 55,
    "tests/test_e2e_compile.py": 150,  # 2026-12-05: 5.5 min serial beside the CI suite (7 trainers, LoRA pair added)
    "tests/test_e2e_qwen3vl_parity.py": 42,
    "packages/ckpt/tests/test_ckpt_adapters.py": 41,
    "tests/test_e2e_varlen_parity.py": 39,
    "tests/test_e2e_fsdp_parity.py": 39,
    "apps/train/tests/test_train_check.py": 38,
    "apps/train/tests/test_train_check_video.py": 20,
    "tests/test_e2e_msmm.py": 34,
    "packages/ckpt/tests/test_ckpt_crash.py": 30,
    "packages/model/tests/test_model_cp_parity.py": 30,
    "packages/ckpt/tests/test_ckpt_memory.py": 28,
    "tests/test_tools_vision_attention_probe.py": 28,
    "tests/test_e2e_lora.py": 28,
    "packages/parallel/tests/test_parallel_expert_dispatch.py": 23,
    "apps/train/tests/test_train_check_ckpt.py": 22,
    "packages/parallel/tests/test_parallel_cp_attention.py": 17,
    "tests/test_e2e_memory_measured.py": 14,
    "tests/test_e2e_cp.py": 13,
    "packages/data/tests/test_data_mistral_exact.py": 12,
    "packages/data/tests/test_data_bad_rows.py": 11,
    "packages/parallel/tests/test_parallel_fsdp.py": 11,
    "packages/ckpt/tests/test_ckpt_convert.py": 11,
    "tests/test_e2e_meta_init.py": 8,
    "packages/model/tests/test_model_qwen3vl_cp.py": 8,
    "tests/test_msmm_config.py": 7,
    "packages/data/tests/test_data_pixtral_processor.py": 6,
    "apps/train/tests/test_train_config.py": 5,
}


def pytest_collection_modifyitems(config, items):
    root = config.rootpath
    order = {item: i for i, item in enumerate(items)}

    def seconds(item) -> int:
        try:
            return _FILE_SECONDS.get(item.path.relative_to(root).as_posix(), 0)
        except ValueError:
            return 0

    items.sort(key=lambda item: (-seconds(item), order[item]))
