"""Child process of ckpt's multi-process tests: join a gloo group, run one test function, report.

Usage (by conftest's `run_ranks`): `python ckpt_worker.py TEST_FILE FUNCTION ARGS_PICKLE RESULT_PREFIX`
with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment. The
function is loaded from its file (pytest's importlib mode gives test modules
names a child cannot import) and called as `fn(rank, world_size, *args)`; its
return value or traceback is pickled to `RESULT_PREFIX.<rank>`.
"""

import importlib.util
import os
import pickle
import sys
import traceback


def main() -> None:
    test_file, name, args_path, result_prefix = sys.argv[1:5]
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        spec = importlib.util.spec_from_file_location("_ckpt_test_module", test_file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        with open(args_path, "rb") as f:
            args = pickle.load(f)
        value = getattr(module, name)(rank, world_size, *args)
        dist.barrier()
        dist.destroy_process_group()
        result = ("ok", value)
    except BaseException:
        result = ("error", traceback.format_exc())
    with open(f"{result_prefix}.{rank}", "wb") as f:
        pickle.dump(result, f)


if __name__ == "__main__":
    main()
