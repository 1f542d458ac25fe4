"""Convert adapter files between this project's layout and the authors' (DCDmllm/MoA).

    python scripts/authors_adapter.py export <our adapter dir> <their adapter.pth> [--bf16]
    python scripts/authors_adapter.py import <their adapter.pth | checkpoint-N.pth> <our adapter dir> --llama_path <base>
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from Models.formats.base_model import base_args  # noqa: E402
from Models.formats.adapters import export_authors_adapter, import_authors_adapter  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(prog="python scripts/authors_adapter.py",
                                description="Convert adapter files between our layout and the authors'.")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="our adapter -> the authors' adapter.pth + adapter_params.json")
    e.add_argument("adapter", help="our adapter directory (adapter.pth + adapter_params.json)")
    e.add_argument("out", help="the authors' adapter.pth to write (their json goes beside it)")
    e.add_argument("--bf16", action="store_true", help="store the tensors in bfloat16")
    i = sub.add_parser("import", help="the authors' adapter.pth or checkpoint-N.pth -> our adapter directory")
    i.add_argument("authors", help="their adapter.pth (with their adapter_params.json beside it) or checkpoint-N.pth")
    i.add_argument("out", help="our adapter directory to write")
    i.add_argument("--llama_path", required=True, help="the base the adapter was trained on (a Meta or Hugging Face LLaMA folder)")
    i.add_argument("--method", choices=["instance"], help="the file comes from LLaMA3_soft_moa_instance, whose "
                   "options and names are Soft MoA's (every other method is told from the file)")
    args = p.parse_args(argv)
    try:
        if args.command == "export":
            export_authors_adapter(args.adapter, args.out, bf16=args.bf16)
        else:
            import_authors_adapter(args.authors, args.out, base_args(args.llama_path), args.method)
    except (FileNotFoundError, ValueError) as e:  # CheckpointError is a ValueError
        p.exit(2, f"error: {e}\n")
    print(f"[authors_adapter] wrote {args.out}")


if __name__ == "__main__":
    main()
