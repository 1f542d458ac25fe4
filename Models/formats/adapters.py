"""Adapter files, ours and the authors', both ways.

Every .pth goes through Models.formats.pth.load_pth, an allow-list unpickler that
never runs code named by the file; every file is written atomically.

Names: our module attributes are the authors' (`llama.layers.0.attention.lora_Q.
lora_A.weight`, `llama.layers.0.adapter_type_router.w1.weight`, `lora_Q.lora_A_l.1.weight`,
...), so their names and ours are one and the same. The files:
- ours: `adapter.pth` holding a flat {name: fp32 tensor} plus `adapter_params.json`
  (our ModelArgs, Meta's fields included);
- theirs, as their extract_adapter_from_checkpoint.py writes it: the same flat
  `adapter.pth` (every name containing lora, prompt or adapter, possibly bf16) plus
  an `adapter_params.json` of their option names, a different set per folder of
  their release (Sparse and Soft MoA, each baseline: Models/formats/authors.py),
  which their loader passes to their ModelArgs as keyword arguments;
- their training checkpoint `checkpoint-N.pth`: {"model": full state dict, "args":
  the argparse.Namespace of the run, "optimizer", "epoch", "scaler"}.
The two json files are told apart by our `variant` field, which theirs lack. `load_adapter` reads
both adapter layouts; `export_authors_adapter` writes theirs, `import_authors_adapter`
turns theirs (or their checkpoint-N.pth) into ours. Our training checkpoints are
Models/formats/training.py; base checkpoints Models/formats/base_model.py.
"""
import os

import numpy as np

import Utils.jittor_env  # noqa: F401
import jittor as jt

from Utils.file_io import read_json_object, write_json
from Utils.misc import is_main_process
from Utils.settings import check_values

from ..LLaMA_Adapter import LLaMA_adapter, is_adapter_param
from ..ModelArgs import ModelArgs
from ..kernels.bf16 import cast_to
from . import CheckpointError, peft
from .authors import authors_params, check_authors_base, fields_from_authors, folder_of
from .pth import PlainNamespace, load_pth
from .pth_writer import save_pth
from .tensor_match import check_strict

ADAPTER_WEIGHTS = "adapter.pth"
ADAPTER_PARAMS = "adapter_params.json"


class NonFiniteAdapter(CheckpointError):
    """Adapter tensors holding NaN or inf: never written, never loaded."""


class NotAnAdapter(CheckpointError):
    """A file of the tools that is not an adapter (a training checkpoint); the message says where the adapter is."""


def check_finite(arrays: dict, source: str, what: str = "adapter"):
    """Refuse tensors (an adapter's, unless `what` says) holding NaN or inf, naming the first of them."""
    bad = {name: int(np.size(a) - np.count_nonzero(np.isfinite(a))) for name, a in arrays.items()
           if np.issubdtype(np.asarray(a).dtype, np.floating) and not np.isfinite(a).all()}
    if bad:
        first = ", ".join(f"'{n}' ({k} of {np.size(arrays[n])})" for n, k in list(bad.items())[:3])
        raise NonFiniteAdapter(f"{source}: {len(bad)} {what} tensor(s) hold NaN or inf values (or values past "
                               f"float32's range): {first}{' ...' if len(bad) > 3 else ''}")


def float32_arrays(arrays: dict, source: str, what: str = "adapter") -> dict:
    """The tensors as the model holds them, fp32: refused when one is not real floating point, or not finite
    once rounded (a float64 1e300 is inf in fp32)."""
    rounded = {}
    for name, array in arrays.items():
        array = np.asarray(array)
        if not np.issubdtype(array.dtype, np.floating):
            raise CheckpointError(f"{source}: tensor '{name}' is {array.dtype}, where the {what}'s are real "
                                  "floating-point numbers")
        with np.errstate(over="ignore"):
            rounded[name] = np.ascontiguousarray(array, dtype=np.float32)
    check_finite(rounded, source, what)
    return rounded


def assign_strict(params: dict, arrays: dict, source: str, what: str):
    """Copy numpy arrays into the Vars of `params` (small: adapters, golden files), checked as above."""
    check_strict(params, {name: array.shape for name, array in arrays.items()}, source, what)
    arrays = float32_arrays({name: arrays[name] for name in params}, source, what)
    for name, var in params.items():
        var.assign(cast_to(jt.array(arrays[name]), var.dtype))  # a bf16 Var stays bf16


def adapter_arrays(model: LLaMA_adapter) -> dict:
    """The adapter's tensors as fp32 arrays, to be saved: refused when one is not finite."""
    arrays = {name: p.numpy().astype(np.float32) for name, p in model.adapter_parameters().items()}
    check_finite(arrays, "the model's adapter")
    return arrays


def save_adapter(model: LLaMA_adapter, out_dir: str):
    """adapter.pth (adapter tensors only, fp32) and adapter_params.json, each written atomically.
    Call on every rank (it fetches Vars); rank 0 writes."""
    arrays = adapter_arrays(model)
    if is_main_process():
        write_adapter(arrays, model.args.to_dict(), out_dir)


def write_adapter(arrays: dict, model_args: dict, out_dir: str):
    save_pth(arrays, os.path.join(out_dir, ADAPTER_WEIGHTS))
    write_json(model_args, os.path.join(out_dir, ADAPTER_PARAMS))


def differing_fields(saved: dict, args: ModelArgs) -> list:
    """(name, saved value, the model's) of the fields of a saved adapter config that disagree with the
    model's (runtime fields ignored)."""
    current = args.to_dict()
    skip = {"max_batch_size", "max_seq_len", "precision", "kv_cache", "recompute"}
    return [(k, saved[k], current[k]) for k in sorted(saved)
            if k in current and k not in skip and saved[k] != current[k]]


def config_differences(saved: dict, args: ModelArgs) -> list:
    """differing_fields as text."""
    return [f"{k}: adapter has {old!r}, model has {new!r}" for k, old, new in differing_fields(saved, args)]


def read_adapter(path: str) -> dict:
    """Adapter tensors from a flat adapter.pth or a {'model': ...} checkpoint (bf16 allowed)."""
    if os.path.isdir(path):
        path = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no adapter file{run_adapter_hint(path)}")
    return adapter_tensors(load_pth(path), path)


def run_adapter_hint(path: str) -> str:
    """Where the adapter is, for a training run's folder or a file in it given instead of the adapter."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    adapter = os.path.join(folder, "adapter")
    if not os.path.isfile(os.path.join(adapter, ADAPTER_WEIGHTS)):
        return ""
    return f" ({folder} is a training run's folder: its adapter is {adapter})"


def adapter_tensors(state, path: str) -> dict:
    """The adapter tensors of a loaded flat {name: tensor} or {'model': {...}, ...}."""
    if isinstance(state, dict) and {"adapter", "optimizer"} <= set(state):  # training.checkpoint_state
        raise NotAnAdapter(f"{path}: a training checkpoint (Math.py's, for --resume), not an adapter"
                           f"{run_adapter_hint(path)}")
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict) or not all(isinstance(v, np.ndarray) for v in state.values()):
        raise CheckpointError(f"{path}: expected a dict of tensor names to tensors (or {{'model': ...}})")
    return float32_arrays({name: value for name, value in state.items() if is_adapter_param(name)}, path)


def adapter_config_path(path: str) -> str:
    return os.path.join(path if os.path.isdir(path) else os.path.dirname(path), ADAPTER_PARAMS)


def settings_file(path: str) -> str:
    """The file an adapter's settings are read from, as messages name it: adapter_params.json beside it, or a
    peft folder's adapter_config.json."""
    ours = adapter_config_path(path)
    return os.path.join(path, peft.PEFT_CONFIG) if not os.path.isfile(ours) and peft.is_peft_adapter(path) else ours


def check_adapter_exists(path: str):
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such adapter file or directory")


def recorded_base(path: str, run_args: dict, run_args_path: str = None) -> str:
    """The base an adapter was trained on, where no --llama_path is given: the llama_path of its run's args.json
    (`run_args`, read from `run_args_path`), else a peft folder's base_model_name_or_path when it is a local
    folder; else a refusal saying to pass --llama_path (the demo base would not fit another base's adapter)."""
    if not isinstance(run_args.get("llama_path", ""), (str, type(None))):
        raise ValueError(f"{run_args_path}: field 'llama_path' must be a string, got {run_args['llama_path']!r}")
    if run_args.get("llama_path"):
        return run_args["llama_path"]
    if peft.is_peft_adapter(path):
        config = os.path.join(path, peft.PEFT_CONFIG)
        base = read_json_object(config, "peft adapter settings").get("base_model_name_or_path")
        if isinstance(base, str) and base and os.path.isdir(base):
            return base
        raise ValueError(f"{config}: base_model_name_or_path {base!r} is not a local folder (a hub name is not "
                         "fetched here): pass --llama_path, the base's folder")
    where = f"{run_args_path} names no llama_path" if run_args_path and os.path.isfile(run_args_path) else \
        "no run's args.json beside it names its base"
    raise ValueError(f"--adapter_path {path}: {where}: pass --llama_path, the base it was trained on")


def settings_from_flags(path: str) -> bool:
    """An adapter.pth with no adapter_params.json beside it (a bare file of the authors'): its MoA settings
    can only come from the flags given."""
    weights = os.path.join(path, ADAPTER_WEIGHTS) if os.path.isdir(path) else path
    return weights.endswith(".pth") and os.path.isfile(weights) and not os.path.isfile(adapter_config_path(path))


def read_adapter_config(path: str, hint: str = None, base: ModelArgs = None):
    """The adapter_params.json beside an adapter (ours or the authors'), or a peft LoRA folder's
    adapter_config.json, as our ModelArgs fields (Meta's fields only when ours carries them), or None
    when there is none. `hint` names the authors' folder where their option sets coincide
    (authors.authors_folder); `base`, the base's settings, which a peft folder's tensors are checked against."""
    check_adapter_exists(path)
    config_path = adapter_config_path(path)
    if not os.path.isfile(config_path):
        return peft.read_peft(path, base)[0] if peft.is_peft_adapter(path) else None
    try:
        config = read_json_object(config_path, "adapter settings")
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    if "variant" in config:
        unknown = sorted(set(config) - set(ModelArgs.__dataclass_fields__))
        if unknown:
            raise CheckpointError(f"{config_path}: unknown field(s) {unknown}")
        return check_values(ModelArgs, config, config_path)
    return fields_from_authors(config, config_path, hint=hint or tensor_names_hint(path))


def unipeft_by_names(names) -> str:
    """'unipeft' when tensor names hold UniPEFT's gates (its options are Soft MoA's), else None."""
    return "unipeft" if any(str(n).endswith(".lora_gate.weight") for n in names) else None


def tensor_names_hint(path: str):
    """unipeft_by_names of the authors' adapter.pth beside their json, read lazily: names only."""
    weights = os.path.join(path, ADAPTER_WEIGHTS) if os.path.isdir(path) else path
    if not os.path.isfile(weights):
        return None
    state = load_pth(weights, lazy=True)
    names = state["model"] if isinstance(state, dict) and isinstance(state.get("model"), dict) else state
    return unipeft_by_names(names) if isinstance(names, dict) else None


def load_adapter(model: LLaMA_adapter, path: str):
    """Load our adapter directory or file, the authors' adapter.pth, or a peft LoRA folder (peft.py) into
    `model` strictly."""
    config = read_adapter_config(path, hint=folder_of(model.args), base=model.args)
    if config is not None:
        differences = config_differences(config, model.args)
        if differences:
            raise CheckpointError(f"{settings_file(path)}: adapter from another configuration: "
                                  + "; ".join(differences))
    if peft.is_peft_adapter(path) and not os.path.isfile(adapter_config_path(path)):
        weights, arrays = os.path.join(path, peft.PEFT_WEIGHTS), peft.read_peft(path, model.args)[1]
    else:
        weights = os.path.join(path, ADAPTER_WEIGHTS) if os.path.isdir(path) else path
        arrays = read_adapter(weights)
    assign_strict(model.adapter_parameters(), arrays, weights, "adapter")


def converted_files(source: str, out: str, out_is_dir: bool) -> list:
    """The two files a conversion of `source` (an adapter file or folder) writes at `out`, refused when one
    of them is a file of the source: a conversion never writes over what it reads."""
    check_adapter_exists(source)
    if not out_is_dir and os.path.isdir(out):
        raise CheckpointError(f"{out} is a folder: name the .pth file to write (the authors' adapter_params.json "
                              "goes beside it)")
    folder = out if out_is_dir else os.path.dirname(os.path.abspath(out))
    targets = [os.path.join(folder, ADAPTER_WEIGHTS) if out_is_dir else out, os.path.join(folder, ADAPTER_PARAMS)]
    weights = os.path.join(source, ADAPTER_WEIGHTS) if os.path.isdir(source) else source
    for target in targets:
        for read in (weights, adapter_config_path(source)):
            if os.path.realpath(target) == os.path.realpath(read):
                raise CheckpointError(f"{out}: writing there would replace {read}, which this conversion reads: "
                                      "choose another folder")
    return targets


def export_authors_adapter(adapter_path: str, out_path: str, bf16: bool = False):
    """Our adapter (directory or adapter.pth with its adapter_params.json) -> the authors'
    adapter.pth at out_path (a flat dict) and their adapter_params.json beside it."""
    converted_files(adapter_path, out_path, out_is_dir=False)
    config = read_adapter_config(adapter_path)
    if config is None:
        raise FileNotFoundError(f"{adapter_config_path(adapter_path)}: no adapter_params.json beside the adapter"
                                f"{run_adapter_hint(adapter_path)}")
    args = ModelArgs(**config) if "dim" in config else None
    if args is None:
        raise CheckpointError(f"{adapter_config_path(adapter_path)}: already the authors' format")
    params = authors_params(args)
    save_pth(read_adapter(adapter_path), out_path, bf16=bf16)
    write_json(params, os.path.join(os.path.dirname(os.path.abspath(out_path)), ADAPTER_PARAMS))


def read_authors(path: str, method: str = None):
    """The authors' adapter.pth (their adapter_params.json beside it) or their training
    checkpoint-N.pth (its 'args' Namespace) -> (adapter tensors, our ModelArgs fields).
    Soft MoA and instance-level MoA write the same options and names: `method` "instance"
    says which; UniPEFT is told by its gates' names."""
    state = load_pth(path)
    arrays = adapter_tensors(state, path)
    hint = method or unipeft_by_names(arrays)
    if isinstance(state, dict) and isinstance(state.get("args"), PlainNamespace):
        fields = fields_from_authors(vars(state["args"]), f"{path} (args)", hint=hint)
    else:
        fields = read_adapter_config(path, hint=hint)
        if fields is None or "dim" in fields:
            raise CheckpointError(f"{path}: neither the authors' checkpoint-N.pth (with 'args') nor their "
                                  f"adapter.pth with their {ADAPTER_PARAMS} beside it")
    return arrays, fields


def import_authors_adapter(authors_path: str, out_dir: str, base: ModelArgs, method: str = None):
    """The authors' adapter.pth or checkpoint-N.pth -> our adapter directory, with no MoA
    setting to repeat. `base` gives Meta's fields (dim, layers, ...), which their files lack;
    `method` "instance" marks an instance-level MoA file (its options are Soft MoA's)."""
    converted_files(authors_path, out_dir, out_is_dir=True)
    arrays, fields = read_authors(authors_path, method)
    args = ModelArgs(**{**base.to_dict(), **fields})
    check_authors_base(args)
    model = LLaMA_adapter(args)
    assign_strict(model.adapter_parameters(), arrays, authors_path, "adapter")
    save_adapter(model, out_dir)
