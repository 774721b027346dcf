"""`mm-convert`: the command line of the converters (`mmfsdp.ckpt.convert`, `mmfsdp.ckpt.lora`).

Argument parsing and error reporting only: a `CheckpointError` or `ValueError` is printed as one line
(`mm-convert: error: ...`, exit code 2), never as a traceback. The sub-commands and their flags:
docs/checkpoints.md, "Conversion: `mm-convert`".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from mmfsdp.ckpt.adapters import registered_adapter_ids
from mmfsdp.ckpt.convert import AUTO, dcp_to_hf, hf_to_dcp
from mmfsdp.ckpt.errors import CheckpointError
from mmfsdp.ckpt.lora import dcp_to_merged_hf, dcp_to_peft

__all__ = ["main"]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mm-convert",
        description="Convert model weights between HF safetensors and PyTorch Distributed Checkpoint (DCP).",
    )
    converters = parser.add_subparsers(dest="converter", required=True, metavar="CONVERTER")
    generic = converters.add_parser(
        "GenericDCPConverter",
        help="HF safetensors <-> DCP for any model with a state-dict adapter (chosen by config.json model_type)",
        description="HF safetensors <-> DCP for any model; see `hf_to_dcp -h` and `dcp_to_hf -h`.",
    )
    commands = generic.add_subparsers(dest="command", required=True, metavar="COMMAND")
    model_id_help = (
        "model id of the state-dict adapter that maps {what} (registered: "
        + ", ".join(registered_adapter_ids())
        + "; identity keeps names as they are; --key_map is the old spelling). "
        "Default auto: the adapter registered for the model_type in {config}"
    )

    to_dcp = commands.add_parser(
        "hf_to_dcp",
        help="HF safetensors directory -> DCP_DIR/release + latest_checkpointed_iteration.txt",
        description="Convert a HF safetensors directory (single file or sharded with an index) into a DCP "
        "checkpoint DCP_DIR/release/ and write DCP_DIR/latest_checkpointed_iteration.txt = release. "
        "Point training.load at DCP_DIR.",
    )
    to_dcp.add_argument(
        "--hf_dir",
        required=True,
        help="HF model directory with *.safetensors (and model.safetensors.index.json when sharded)",
    )
    to_dcp.add_argument("--dcp_dir", required=True, help="output directory; release/ and the tracker are written here")
    to_dcp.add_argument(
        "--force",
        action="store_true",
        help="replace release/ and the tracker if --dcp_dir is not empty (other files are kept)",
    )
    to_dcp.add_argument(
        "--model_id",
        "--key_map",
        dest="model_id",
        default=AUTO,
        metavar="ID",
        help=model_id_help.format(
            what="HF file tensors to model state_dict tensors",
            config="--hf_dir/config.json (identity when it has none)",
        ),
    )

    to_hf = commands.add_parser(
        "dcp_to_hf",
        help="DCP checkpoint (release or iter_*) -> HF safetensors shards + index + assets",
        description="Export the model weights of a DCP checkpoint as HF safetensors shards with "
        "model.safetensors.index.json, in HF naming, dtypes preserved, and copy config, tokenizer, "
        "processor and chat-template files from --model_assets_dir.",
    )
    to_hf.add_argument(
        "--load_dir",
        required=True,
        help="a training.save / --dcp_dir directory with latest_checkpointed_iteration.txt, or an iter_NNNNNNN or "
             "release directory",
    )
    to_hf.add_argument("--save_dir", required=True, help="output HF directory (must be empty or new unless --force)")
    to_hf.add_argument(
        "--model_assets_dir",
        required=True,
        help="the original HF model directory: config.json, tokenizer, processor and chat template are copied from "
             "it, and its weights (if present) are used to validate names and shapes",
    )
    to_hf.add_argument(
        "--max_shard_size", default="5GB", help="largest output shard, e.g. 5GB, 500MB, 2GiB (default: 5GB)"
    )
    to_hf.add_argument("--force", action="store_true", help="replace --save_dir if it is not empty")
    to_hf.add_argument(
        "--model_id",
        "--key_map",
        dest="model_id",
        default=AUTO,
        metavar="ID",
        help=model_id_help.format(
            what="model state_dict tensors back to HF file tensors",
            config="--model_assets_dir/config.json; the state_dict names are "
            "kept when only they match the assets' own weights",
        ),
    )

    lora = converters.add_parser(
        "LoraConverter",
        help="LoRA training checkpoints (adapters only) -> a PEFT adapter directory, or HF weights with the adapters "
             "merged",
        description="Export the adapters of a LoRA training checkpoint; see `dcp_to_peft -h` and `dcp_to_merged_hf "
                    "-h`.",
    )
    lora_commands = lora.add_subparsers(dest="command", required=True, metavar="COMMAND")
    to_peft = lora_commands.add_parser(
        "dcp_to_peft",
        help="LoRA checkpoint -> adapter_config.json + adapter_model.safetensors (PeftModel.from_pretrained(base, "
             "OUT))",
        description="Write the adapters of a LoRA training checkpoint as a PEFT adapter directory that "
        "peft.PeftModel.from_pretrained(base_model, SAVE_DIR) loads onto the HF base model.",
    )
    to_peft.add_argument(
        "--load_dir",
        required=True,
        help="a training.save directory with latest_checkpointed_iteration.txt, or an iter_NNNNNNN directory",
    )
    to_peft.add_argument(
        "--save_dir", required=True, help="output adapter directory (must be empty or new unless --force)"
    )
    to_peft.add_argument(
        "--base_model_name_or_path",
        default=None,
        help="recorded in adapter_config.json (the base model's HF id or directory)",
    )
    to_peft.add_argument("--force", action="store_true", help="replace --save_dir if it is not empty")
    merged = lora_commands.add_parser(
        "dcp_to_merged_hf",
        help="LoRA checkpoint + base HF weights -> HF weights with W + (alpha/r)·B·A",
        description="Merge the adapters of a LoRA training checkpoint into the base HF weights of --model_assets_dir "
        "and write the result as an HF directory (the assets' shards, names and dtypes; other files copied).",
    )
    merged.add_argument(
        "--load_dir",
        required=True,
        help="a training.save directory with latest_checkpointed_iteration.txt, or an iter_NNNNNNN directory",
    )
    merged.add_argument("--save_dir", required=True, help="output HF directory (must be empty or new unless --force)")
    merged.add_argument(
        "--model_assets_dir",
        required=True,
        help="the base HF model the adapters were trained on (config.json and safetensors weights)",
    )
    merged.add_argument(
        "--model_id",
        "--key_map",
        dest="model_id",
        default=AUTO,
        metavar="ID",
        help=model_id_help.format(
            what="HF file tensors to model state_dict tensors", config="--model_assets_dir/config.json"
        ),
    )
    merged.add_argument("--force", action="store_true", help="replace --save_dir if it is not empty")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "hf_to_dcp":
            out = hf_to_dcp(args.hf_dir, args.dcp_dir, force=args.force, adapter=args.model_id)
            print(f"wrote {out} and {Path(args.dcp_dir) / 'latest_checkpointed_iteration.txt'} (release)")
        elif args.command == "dcp_to_peft":
            out = dcp_to_peft(
                args.load_dir, args.save_dir, base_model_name_or_path=args.base_model_name_or_path, force=args.force
            )
            print(f"wrote {out}")
        elif args.command == "dcp_to_merged_hf":
            out = dcp_to_merged_hf(
                args.load_dir, args.save_dir, args.model_assets_dir, adapter=args.model_id, force=args.force
            )
            print(f"wrote {out}")
        else:
            out = dcp_to_hf(
                args.load_dir,
                args.save_dir,
                args.model_assets_dir,
                max_shard_size=args.max_shard_size,
                force=args.force,
                adapter=args.model_id,
            )
            print(f"wrote {out}")
    except (CheckpointError, ValueError) as e:
        print(f"mm-convert: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
