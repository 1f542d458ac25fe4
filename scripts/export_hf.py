"""Export an adapter trained on a Hugging Face base (LLaMA-3.x, Qwen3) for transformers and peft.

    python scripts/export_hf.py <our adapter> <out> [--base <HF base folder>] [--base_ref <path or hub id>]

Plain LoRA (--method moe --expert_num 1, LoRA only) becomes peft's LoRA adapter (Models/formats/peft.py):
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out)
every other adapter a folder transformers loads with its own modeling code (Models/formats/hf_remote.py):
    AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
Neither copies the base: the files name it (--base_ref, by default --base's absolute path). --base defaults to
the `llama_path` of the run's args.json beside the adapter folder. An adapter of a Meta-layout base has no
Hugging Face form and is refused, as is anything else the export cannot write faithfully; nothing is written
then. The folder is written under the tools' ownership rules (Utils/output_dirs.py): names the export writes
that something else already holds there are refused, and so is a folder another tool wrote (a run's, an
evaluation's). The files are written into a staging folder beside it and moved in once all are written; an
earlier export's files this one does not write are removed then. A base whose config.json or tokenizer_config.json
has `auto_map` (code of its own) is refused: the exported folder loads the base with transformers' own classes.
The transformers folder's generation_config.json carries the run's decoding (args.json: temperature, top_p,
max_gen_len); an adapter trained on an int8 or nf4 base exports with a warning line (the folder runs it on the
full-precision base; for nf4 it names bitsandbytes' nf4 as the nearest way to load it), recorded in config.json as
moa.trained_precision (peft's adapter_config.json has no field for it: the warning alone says it).
Exit codes: 0 done, 2 bad input or arguments, 4 a file could not be written, 130 / 143 / 138 stopped by SIGINT /
SIGTERM / SIGUSR1 before the files were moved in (the folder is left as it was); one `error:` line.
"""
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import Utils.jittor_env  # noqa: E402  must precede numpy and jittor (see block_stop_signals)

if __name__ == "__main__":
    Utils.jittor_env.block_stop_signals()

from Models.formats import CheckpointError, hf_remote, peft  # noqa: E402
from Models.formats.adapters import (ADAPTER_WEIGHTS, adapter_config_path, read_adapter, read_adapter_config,  # noqa: E402
                                     run_adapter_hint)
from Models.formats.base_model import base_args, base_layout  # noqa: E402
from Models.formats.safetensors import save_safetensors  # noqa: E402
from Models.formats.tensor_match import check_strict  # noqa: E402
from Models.LLaMA_Adapter import LLaMA_adapter  # noqa: E402
from Models.ModelArgs import BASE_FIELDS, ModelArgs  # noqa: E402
from Models.formats.hf import CONFIG  # noqa: E402
from Utils import output_dirs  # noqa: E402
from Utils.jittor_env import StopFlag, Stopped, stop_exit_status  # noqa: E402
from Utils.file_io import read_json_object, write_json  # noqa: E402
from Utils.settings import ArgumentParser, GenerationArgs  # noqa: E402

TOOL = "scripts/export_hf.py"


def run_record(adapter: str) -> tuple:
    """(path, settings) of the run's args.json beside the adapter folder, or (None, {})."""
    folder = adapter if os.path.isdir(adapter) else os.path.dirname(os.path.abspath(adapter))
    path = os.path.join(os.path.dirname(os.path.abspath(folder)), "args.json")
    return (path, read_json_object(path, "run settings")) if os.path.isfile(path) else (None, {})


def run_base(adapter: str):
    """The llama_path of the run's args.json beside the adapter folder, or None."""
    path, run = run_record(adapter)
    if path is None:
        return None
    if not isinstance(run.get("llama_path"), str):
        raise ValueError(f"{path}: field 'llama_path' must be the base's path, got {run.get('llama_path')!r}: pass "
                         "--base")
    return run["llama_path"]


def generation_config(base: str, adapter: str) -> dict:
    """generation_config.json: the base's (its token ids) with the run's decoding from its args.json, as Infer.py
    decodes: greedy at temperature 0, else sampling at its temperature and top_p (no top_k), max_gen_len new
    tokens; the base's own sampling where no run's args.json is beside the adapter."""
    path = os.path.join(base, hf_remote.GENERATION_CONFIG)
    config = read_json_object(path, "generation settings") if os.path.isfile(path) else {}
    record, run = run_record(adapter)
    if record is None:
        print(f"[export_hf] no run's args.json beside {adapter}: generation_config.json keeps the base's sampling")
        return config
    try:
        decoding = GenerationArgs(**{k: run[k] for k in ("max_gen_len", "temperature", "top_p") if k in run})
    except (TypeError, ValueError) as e:
        raise ValueError(f"{record}: {e}") from None
    config = {k: v for k, v in config.items() if k not in ("do_sample", "temperature", "top_p", "top_k", "max_length")}
    sampling = dict(temperature=decoding.temperature, top_p=decoding.top_p) if decoding.temperature > 0 else {}
    return {**config, "do_sample": bool(sampling), **sampling, "max_new_tokens": decoding.max_gen_len}


# what each quantized base was, for the export's warning
QUANTIZED_BASES = {
    "int8": "an int8 base (its matrices quantized per row)",
    "nf4": "an nf4 base (QLoRA's 4-bit NormalFloat, a bf16 scale per 64 weights; transformers' BitsAndBytesConfig("
           "load_in_4bit=True, bnb_4bit_quant_type='nf4') loads the base nearest to it, its scales fp32)"}


def precision_warning(args: ModelArgs) -> str:
    """The line an adapter trained on a quantized base exports with: the folder runs it on the base's own weights."""
    if args.precision not in QUANTIZED_BASES:
        return ""
    return (f"warning: the adapter was trained on {QUANTIZED_BASES[args.precision]}; transformers runs it on the "
            "base's full-precision weights, whose logits differ from those it trained with (recorded in the "
            "folder's config)")


def adapter_settings(adapter: str) -> ModelArgs:
    """Our adapter_params.json as ModelArgs; refused when it is not ours or its base was Meta's layout."""
    config = read_adapter_config(adapter)
    if config is None:
        raise FileNotFoundError(f"{adapter_config_path(adapter)}: no adapter_params.json beside the adapter"
                                f"{run_adapter_hint(adapter)}")
    if "dim" not in config:
        raise CheckpointError(f"{adapter}: not an adapter of MoA-Jittor (the authors' or peft's files): import it "
                              "first")
    args = ModelArgs(**config)
    if args.ffn_dim is None:  # a Hugging Face config.json always sets it (intermediate_size), Meta's params.json never
        raise CheckpointError(f"{adapter_config_path(adapter)}: trained on a Meta-layout base, which has no Hugging "
                              "Face form: train on the model's Hugging Face folder to export")
    return args


def check_base(base: str, args: ModelArgs, adapter: str):
    """The base folder is a Hugging Face one, and the one the adapter was trained on."""
    if base is None:
        raise ValueError(f"{adapter}: no base named (no args.json of a run beside the adapter): pass --base")
    if base_layout(base) != "hf":
        raise CheckpointError(f"{base}: a Meta-layout base, which has no Hugging Face form: export needs the "
                              "model's Hugging Face folder (config.json, safetensors)")
    for name in (CONFIG, "tokenizer_config.json"):  # the export folder is loaded with trust_remote_code=True
        path = os.path.join(base, name)
        if os.path.isfile(path) and "auto_map" in read_json_object(path, "settings"):
            raise CheckpointError(f"{path}: has 'auto_map', code of its own that trust_remote_code would run: the "
                                  "export loads the base with transformers' own classes only; remove auto_map")
    found = base_args(base).to_dict()
    other = [f"{k}: adapter {getattr(args, k)!r}, base {found[k]!r}" for k in BASE_FIELDS
             if getattr(args, k) != found[k]]
    if other:
        raise CheckpointError(f"{adapter}: trained on another base than {base}: " + "; ".join(other))


def export_files(adapter: str, base: str, base_ref: str) -> dict:
    """{file name: (writer, content)} of the export, everything read and checked first."""
    args = adapter_settings(adapter)
    check_base(base, args, adapter)
    arrays = read_adapter(adapter)
    weights = os.path.join(adapter, ADAPTER_WEIGHTS) if os.path.isdir(adapter) else adapter
    expected = LLaMA_adapter(args).adapter_parameters()  # shapes only: Jittor runs nothing until asked
    check_strict(expected, {name: a.shape for name, a in arrays.items()}, weights, "adapter")
    if peft.plain_lora_problem(args) is None:
        return {peft.PEFT_CONFIG: (write_json, peft.peft_config(args, base_ref)),
                peft.PEFT_WEIGHTS: (save_safetensors, peft.peft_tensors(arrays, args))}
    files = {hf_remote.REMOTE_CONFIG: (write_json, hf_remote.remote_config(args, base_ref)),
             hf_remote.REMOTE_WEIGHTS: (save_safetensors, hf_remote.remote_tensors(arrays, args))}
    files.update({name: (copy, os.path.join(hf_remote.MODELING_DIR, name)) for name in hf_remote.MODELING_FILES})
    files.update({name: (copy, os.path.join(base, name)) for name in hf_remote.TOKENIZER_FILES
                  if os.path.isfile(os.path.join(base, name))})
    files[hf_remote.GENERATION_CONFIG] = (write_json, generation_config(base, adapter))
    return files


def copy(source: str, target: str):
    shutil.copyfile(source, target + ".part")
    os.replace(target + ".part", target)


def check_out(out: str, names, inputs):
    """The folder takes the export: not an input's folder, no name of it held by something the tools did not write."""
    for flag, path in inputs:
        folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
        if os.path.exists(out) and os.path.realpath(out) == os.path.realpath(folder):
            raise output_dirs.RunDirError(f"out {out} is the folder of {flag} {path}: choose another folder")
    output_dirs.check_output_dir(out, "out")
    output_dirs.check_output_dir(os.path.dirname(os.path.abspath(out)), "out's parent")  # takes the staging folder
    output_dirs.check_tool(out, TOOL, "out")
    output_dirs.check_claimable(out, names, "out")


def write_staged(out: str, files: dict, stop: StopFlag):
    """The files written into a staging folder beside `out`, then moved in, the manifest first, and what an
    earlier export wrote that this one does not removed. A stop signal, polled between the files, ends it with
    `out` as it was; the moves are not interrupted (the entry point blocks the stop signals)."""
    out = os.path.abspath(out)
    output_dirs.remove_stale_temp(os.path.dirname(out), recursive=False)  # what a killed export left
    output_dirs.remove_stale_temp(out, recursive=False)
    staging = output_dirs.staging_dir(out, os.getpid())
    output_dirs.make_staging(staging, TOOL)
    try:
        for name, (write, content) in files.items():
            if stop.poll():
                raise Stopped(stop.name)
            write(content, os.path.join(staging, name))
        if stop.poll():
            raise Stopped(stop.name)
        os.makedirs(out, exist_ok=True)
        stale = [n for n in output_dirs.written_entries(out) if n not in files]  # an earlier export's
        output_dirs.record_written(out, TOOL, list(files))
        for name in files:
            os.replace(os.path.join(staging, name), os.path.join(out, name))
        for name in stale:
            output_dirs.remove(os.path.join(out, name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def main(argv=None):
    p = ArgumentParser(prog="python scripts/export_hf.py", description="Export an adapter for transformers "
                       "(peft's LoRA format for plain LoRA, a trust_remote_code folder for MoA and the baselines).")
    p.add_argument("adapter", help="our adapter directory (adapter.pth + adapter_params.json)")
    p.add_argument("out", help="the folder to write")
    p.add_argument("--base", help="the Hugging Face base folder the adapter was trained on (default: the run's "
                   "args.json llama_path)")
    p.add_argument("--base_ref", help="how the exported files name the base: a path or a hub id (default: --base's "
                   "absolute path)")
    args = p.parse_args(argv)
    try:
        base = args.base or run_base(args.adapter)
        files = export_files(args.adapter, base, args.base_ref or os.path.abspath(base or ""))
        check_out(args.out, files, [("adapter", args.adapter), ("--base", base)])
        write_staged(args.out, files, StopFlag())
    except Stopped as e:
        p.exit(stop_exit_status(str(e)), f"error: stopped by {e} before the export was written; {args.out} is left "
               "as it was\n")
    except (FileNotFoundError, ValueError) as e:  # CheckpointError and RunDirError are ValueErrors
        p.exit(2, f"error: {e}\n")
    except OSError as e:  # the inputs were read; a write failed (disk full, read-only)
        p.exit(4, f"error: cannot write {e.filename or args.out}: {e.strerror or e}\n")
    warning = precision_warning(adapter_settings(args.adapter))
    if warning:
        print(warning, file=sys.stderr)
    form = "peft LoRA adapter" if peft.PEFT_CONFIG in files else "transformers folder (trust_remote_code)"
    print(f"[export_hf] wrote {args.out}: {form}, base {args.base_ref or os.path.abspath(base)}")


if __name__ == "__main__":
    main()
