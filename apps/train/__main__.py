"""`uv run apps/train [CONFIG] [key.path=value ...]`, or `torchrun --nproc-per-node N apps/train CONFIG`."""

from mmfsdp.train.cli import main

raise SystemExit(main())
