"""`uv run apps/train [CONFIG] [key.path=value ...]`, or `torchrun --nproc-per-node N apps/train CONFIG`."""

from mmfsdp.train.cli import entry

if __name__ == "__main__":  # a process started by multiprocessing (spawn) re-imports this file as __mp_main__
    entry()
