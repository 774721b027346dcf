"""`python -m mmfsdp.train [CONFIG] [key.path=value ...]`."""

from mmfsdp.train.cli import entry

entry()
