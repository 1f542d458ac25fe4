"""Convert adapter files between this project's layout and the authors' (DCDmllm/MoA).

    python scripts/authors_adapter.py export <our adapter dir> <their adapter.pth> [--bf16]
    python scripts/authors_adapter.py import <their adapter.pth | checkpoint-N.pth> <our adapter dir> --llama_path <base>
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from Models.formats.base_model import base_args  # noqa: E402
from Models.formats.adapters import converted_files, export_authors_adapter, import_authors_adapter  # noqa: E402
from Utils import output_dirs  # noqa: E402
from Utils.settings import ArgumentParser  # noqa: E402

TOOL = "scripts/authors_adapter.py"


def main(argv=None):
    """Exit codes: 0 done, 2 bad input or arguments, 4 a file could not be written (one `error:` line)."""
    p = ArgumentParser(prog="python scripts/authors_adapter.py",
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
        exporting = args.command == "export"
        targets = converted_files(args.adapter if exporting else args.authors, args.out, out_is_dir=not exporting)
        folder, names = os.path.dirname(os.path.abspath(targets[0])), [os.path.basename(t) for t in targets]
        output_dirs.check_output_dir(folder, "out")
        output_dirs.check_claimable(folder, names, "out")  # never over a file the tools did not write
        base = None if exporting else base_args(args.llama_path)
        existed = [n for n in names if os.path.lexists(os.path.join(folder, n))]  # listed: ours to replace
        try:
            if exporting:
                export_authors_adapter(args.adapter, args.out, bf16=args.bf16)
            else:
                import_authors_adapter(args.authors, args.out, base, args.method)
        finally:  # the manifest lists what the conversion wrote, also when a later write failed
            made = [n for n in names if n not in existed and os.path.lexists(os.path.join(folder, n))]
            if made:
                output_dirs.record_written(folder, TOOL, made)
    except (FileNotFoundError, ValueError) as e:  # CheckpointError and RunDirError are ValueErrors
        p.exit(2, f"error: {e}\n")
    except OSError as e:  # the inputs were found; a write failed (disk full, read-only)
        p.exit(4, f"error: cannot write {e.filename or args.out}: {e.strerror or e}\n")
    print(f"[authors_adapter] wrote {args.out}")


if __name__ == "__main__":
    main()
