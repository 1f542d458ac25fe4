"""peft's LoRA adapters (adapter_config.json + adapter_model.safetensors), both ways, for plain LoRA on a
Hugging Face base: `--method moe --expert_num 1` with LoRA experts only (Compare.py's `lora`).

The one expert on a projection computes y = W x + (alpha / r) B A x in peft as here, so a plain LoRA
adapter is the same numbers under other names: ours `llama.layers.N.attention.lora_Q.lora_{A,B}.weight`,
peft's `base_model.model.model.layers.N.self_attn.q_proj.lora_{A,B}.weight` (the HF module of the
projection, hf.LAYER_NAMES). One difference in the numbers: our Q and K experts write rows in Meta's
order (hf.py undoes HF's q/k row permutation when it loads a base), peft's in HF's, so B of Q and K is
permuted on the way out (hf.to_hf_rows) and back on the way in (hf.from_hf_rows); A reads x, whose order
no loader changes.

Coming in, the tensors decide which layers and projections carry LoRA, and they must be exactly those
peft applies: the modules the config's target_modules, layers_to_transform, layers_pattern and
exclude_modules select (peft's check_target_module_exists, `excluded_by`). peft leaves a tensor on
another module unused, and puts freshly initialised LoRA on a selected module the file has no tensors
for: either disagreement is refused, naming the first tensor or module. They must form what our settings
can say: the same projections in every layer that has any, one rank. A setting that changes what the
adapter computes and has no form here (a bias, DoRA, rank or alpha patterns, modules_to_save, ...) is
refused, named; dropout does nothing at inference and is ignored; rsLoRA's scale alpha / sqrt(r) is our
alpha / r with alpha * sqrt(r).
"""
import math
import os
import re

from Utils.file_io import read_json_object

from ..ModelArgs import ModelArgs
from . import CheckpointError
from .hf import LAYER_NAMES, TOP_NAMES, from_hf_rows, to_hf_rows
from .safetensors import read_arrays

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# our target -> (the block's module holding it, our expert's attribute, the base Linear it sits beside)
TARGETS = {"Q": ("attention", "lora_Q", "wq"), "K": ("attention", "lora_K", "wk"), "V": ("attention", "lora_V", "wv"),
           "O": ("attention", "lora_O", "wo"), "FFN_UP": ("feed_forward", "lora_UP", "w3"),
           "FFN_GATE": ("feed_forward", "lora_GATE", "w1"), "FFN_DOWN": ("feed_forward", "lora_DOWN", "w2")}
PERMUTED = ("Q", "K")  # their B rows are elements of a head: Meta's pairs here, HF's halves in peft
# peft settings that change what the adapter computes and have no form here: field -> its neutral value
NO_FORM = {"bias": "none", "use_dora": False, "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None,
           "fan_in_fan_out": False, "layer_replication": None, "lora_bias": False, "use_qalora": False,
           "trainable_token_indices": None, "target_parameters": None, "alora_invocation_tokens": None,
           "arrow_config": None, "use_bdlora": None, "kasa_config": None, "monteclora_config": None,
           "velora_config": None, "megatron_config": None}
# where peft puts the LoRA: checked against the tensors (excluded_by)
TARGETING = ("target_modules", "layers_to_transform", "layers_pattern", "exclude_modules")
# what does not change the numbers at inference, or is read below
IGNORED = ("base_model_name_or_path", "revision", "task_type", "inference_mode", "lora_dropout", "peft_version",
           "auto_mapping", "megatron_core", "qalora_group_size", "ensure_weight_tying", "eva_config", "corda_config",
           "lora_ga_config", "loftq_config", "init_lora_weights", "use_rslora", "r", "lora_alpha", "peft_type")
ALL_LINEAR = "all-linear"  # peft's target_modules for every Linear but the output matrix: every projection here
# initialisations that also change the base's weights: the adapter belongs to that changed base
BASE_CHANGING_INITS = ("pissa", "olora", "loftq", "corda")


def hf_module(target: str) -> str:
    """HF's module of a target within a layer: 'Q' -> 'self_attn.q_proj'."""
    parent, _, base = TARGETS[target]
    return LAYER_NAMES[f"{parent}.{base}.weight"][:-len(".weight")]


def plain_lora_problem(args: ModelArgs):
    """Why the adapter of `args` is not plain LoRA (None when it is)."""
    if args.method != "moe" or args.expert_num != 1:
        return f"method {args.method} with expert_num {args.expert_num} is not plain LoRA (moe with expert_num 1)"
    if args.prompt_layer_set or args.p_adapter_layer_set:
        return "its prompt or parallel adapter experts have no form in peft's LoRA"
    return None


def layer_list(layers) -> list:
    return sorted(int(i) for i in layers)


# ---- out: ours -> peft ------------------------------------------------------------------------

def peft_config(args: ModelArgs, base: str) -> dict:
    """adapter_config.json of the plain LoRA adapter of `args` on the base at `base` (a path or hub id)."""
    alpha = args.lora_alpha
    layers = layer_list(args.lora_layer_set)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": args.lora_rank,
            "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha, "lora_dropout": 0.0,
            "target_modules": sorted(hf_module(t).split(".")[-1] for t in args.targets),
            "layers_to_transform": None if len(layers) == args.n_layers else layers, "bias": "none",
            "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
            "rank_pattern": {}, "alpha_pattern": {}, "init_lora_weights": True, "inference_mode": True}


def peft_tensors(arrays: dict, args: ModelArgs) -> dict:
    """Our adapter's tensors (names of LLaMA_adapter) -> peft's names, Q/K's B rows in HF's order."""
    out = {}
    for layer in layer_list(args.lora_layer_set):
        for target in args.targets:
            parent, expert, _ = TARGETS[target]
            for part in ("lora_A", "lora_B"):
                array = arrays[f"llama.layers.{layer}.{parent}.{expert}.{part}.weight"]
                if part == "lora_B" and target in PERMUTED:
                    array = to_hf_rows(array, args.head_dim)
                out[f"{PEFT_PREFIX}model.layers.{layer}.{hf_module(target)}.{part}.weight"] = array
    if len(out) != len(arrays):
        raise CheckpointError(f"the adapter holds {len(arrays)} tensors, plain LoRA on its settings {len(out)}")
    return out


# ---- in: peft -> ours -------------------------------------------------------------------------

def is_peft_adapter(path: str) -> bool:
    """A folder holding peft's adapter_config.json."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, PEFT_CONFIG))


def read_peft_config(folder: str) -> dict:
    """adapter_config.json checked: LoRA, every setting with a form here."""
    path = os.path.join(folder, PEFT_CONFIG)
    config = read_json_object(path, "peft adapter settings")
    if config.get("peft_type") != "LORA":
        raise CheckpointError(f"{path}: peft_type {config.get('peft_type')!r}: only peft's LORA adapters load here")
    for field, neutral in NO_FORM.items():
        if not is_neutral(config.get(field, neutral), neutral):
            raise CheckpointError(f"{path}: {field} {config[field]!r} changes what the adapter computes and has no "
                                  f"form in MoA-Jittor's LoRA (only {neutral!r} has)")
    unknown = sorted(k for k, v in config.items() if k not in NO_FORM and k not in IGNORED and k not in TARGETING
                     and not is_neutral(v, None))
    if unknown:
        raise CheckpointError(f"{path}: setting(s) {unknown} unknown to MoA-Jittor's peft reader: not loaded")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(BASE_CHANGING_INITS):
        raise CheckpointError(f"{path}: init_lora_weights {init!r} changes the base's weights too: the adapter "
                              "belongs to that changed base, not to the original")
    for field, kinds in (("r", int), ("lora_alpha", (int, float))):  # r sizes peft's Linear: 8.0 is refused there
        value = config.get(field)
        if not isinstance(value, kinds) or isinstance(value, bool) or not 0 < value < math.inf:
            raise CheckpointError(f"{path}: field '{field}' is {value!r}, expected a positive "
                                  f"{'integer' if field == 'r' else 'number'}")
    if not isinstance(config.get("use_rslora", False), (bool, type(None))):  # a string "false" is true
        raise CheckpointError(f"{path}: field 'use_rslora' is {config['use_rslora']!r:.40}, expected true or false")
    check_targeting(config, path)
    return config


def is_neutral(value, neutral) -> bool:
    """Whether a setting's value leaves the adapter plain LoRA: a string setting only at its neutral string
    (bias 0 is no "none"), the others absent, false or empty (use_dora 0 is no false either)."""
    if isinstance(neutral, str):
        return value == neutral
    return value is None or value is False or (isinstance(value, (dict, list)) and not value)


def check_targeting(config: dict, path: str):
    """target_modules, layers_to_transform, layers_pattern and exclude_modules of the kinds peft takes, in the
    combinations it takes; regular expressions that compile."""
    def names(field, value):
        if isinstance(value, str):
            try:
                re.compile(value)
            except re.error as e:
                raise CheckpointError(f"{path}: field '{field}' {value!r:.80} is no regular expression ({e})") from None
        elif not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise CheckpointError(f"{path}: field '{field}' is {value!r:.80}, expected a string or a list of strings")
    if config.get("target_modules") is None:  # peft would pick its own default for the model's type
        raise CheckpointError(f"{path}: field 'target_modules' is missing: which modules the LoRA is on is unknown")
    names("target_modules", config["target_modules"])
    for field in ("layers_pattern", "exclude_modules"):
        if config.get(field) is not None:
            names(field, config[field])
    layers = config.get("layers_to_transform")
    if layers is not None and not (isinstance(layers, int) and not isinstance(layers, bool) or isinstance(
            layers, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in layers)):
        raise CheckpointError(f"{path}: field 'layers_to_transform' is {layers!r:.80}, expected a layer number or a "
                              "list of them")
    if isinstance(config["target_modules"], str) and (layers is not None or config.get("layers_pattern") is not None):
        raise CheckpointError(f"{path}: layers_to_transform or layers_pattern with a target_modules string "
                              f"({config['target_modules']!r:.80}): peft refuses the combination")
    if config.get("layers_pattern") and layers is None:
        raise CheckpointError(f"{path}: layers_pattern without layers_to_transform: peft refuses it")


def excluded_by(config: dict, key: str):
    """The field of adapter_config.json that keeps peft's LoRA off the base's module `key`
    ('model.layers.3.self_attn.q_proj'), or None when peft puts it there: peft's check_target_module_exists."""
    exclude, targets = config.get("exclude_modules"), config["target_modules"]
    if exclude and (re.fullmatch(exclude, key) if isinstance(exclude, str) else suffix_match(exclude, key)):
        return "exclude_modules"
    if isinstance(targets, str):
        linear = targets.lower() == ALL_LINEAR and any(key.endswith(f".{hf_module(t)}") for t in TARGETS)
        return None if linear or re.fullmatch(targets, key) else "target_modules"
    if key in targets:  # a module named whole: no layer rule applies
        return None
    if not suffix_match(targets, key):
        return "target_modules"
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return None
    patterns = config.get("layers_pattern")  # none: the first index of a module list; peft's regular expressions
    regexes = [rf"(?:^|.*?\.){p}\.(\d+)\." for p in ([patterns] if isinstance(patterns, str) else patterns)] \
        if patterns else [r".*?\.[^.]*\.(\d+)\."]
    found = next((m for m in (re.match(r, key) for r in regexes) if m), None)
    if found is None:
        return "layers_pattern"
    return None if int(found.group(1)) in ([layers] if isinstance(layers, int) else layers) else "layers_to_transform"


def suffix_match(names: list, key: str) -> bool:
    return key in names or any(key.endswith(f".{name}") for name in names)


KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(\w+\.\w+)\.(lora_[AB])\.weight")


def read_peft(folder: str, base: ModelArgs = None):
    """(our ModelArgs fields, our tensors or None) of a peft LoRA folder; checked against the base `base` and
    converted to our tensors (whose Q/K rows depend on its head_dim) only when it is given."""
    config = read_peft_config(folder)
    config_path, path = os.path.join(folder, PEFT_CONFIG), os.path.join(folder, PEFT_WEIGHTS)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no adapter weights (peft's safetensors file; a pickled adapter_model.bin "
                                "is not read: save it with safe_serialization=True)")
    arrays = read_arrays(path)
    modules = {hf_module(t): t for t in TARGETS}
    found = {}
    for name, array in arrays.items():
        match = KEY.fullmatch(name)
        if match is None or match.group(2) not in modules:
            raise CheckpointError(f"{path}: tensor '{name}' is not LoRA on a projection of a decoder layer "
                                  f"({', '.join(modules)}): no form here")
        if array.ndim != 2:
            raise CheckpointError(f"{path}: tensor '{name}' has shape {list(array.shape)}, where a LoRA matrix has 2 "
                                  "dimensions")
        field = excluded_by(config, module_key(int(match.group(1)), modules[match.group(2)]))
        if field:
            raise CheckpointError(f"{path}: tensor '{name}' is on a module that {config_path}'s {field} "
                                  f"{config[field]!r:.80} keeps LoRA off: peft would leave it unused")
        if base is not None and int(match.group(1)) >= base.n_layers:
            raise CheckpointError(f"{path}: tensor '{name}' is on layer {match.group(1)}, past the base's "
                                  f"{base.n_layers} layers")
        found[(int(match.group(1)), modules[match.group(2)], match.group(3))] = array
    layers = sorted({layer for layer, _, _ in found})
    if not layers:
        raise CheckpointError(f"{path}: no LoRA tensors")
    targets = [t for t in TARGETS if any(key[1] == t for key in found)]
    missing = [f"layer {layer} {t} {part}" for layer in layers for t in targets for part in ("lora_A", "lora_B")
               if (layer, t, part) not in found]
    if missing:
        raise CheckpointError(f"{path}: LoRA on other projections in some layers than in others ({missing[0]} is "
                              "absent): MoA-Jittor puts one set of projections in every LoRA layer")
    ranks = {found[key].shape[0] for key in found if key[2] == "lora_A"}
    if ranks != {config["r"]}:
        raise CheckpointError(f"{path}: LoRA ranks {sorted(ranks)} where {PEFT_CONFIG} says r {config['r']}")
    rank = config["r"]
    alpha = config["lora_alpha"] * (math.sqrt(rank) if config.get("use_rslora") else 1.0)
    if not math.isfinite(alpha):
        raise CheckpointError(f"{config_path}: lora_alpha {config['lora_alpha']!r} times sqrt(r) (use_rslora) is "
                              "past float range")
    fields = {"method": "moe", "expert_num": 1, "lora_rank": rank, "lora_alpha": float(alpha),
              "lora_targets": ",".join(targets), "lora_layers": spans(layers), "prompt_layers": "0-0",
              "p_adapter_layers": "0-0"}
    if base is None:
        return fields, None
    unfilled = [module_key(layer, t) for layer in range(base.n_layers) for t in TARGETS
                if (layer, t, "lora_A") not in found and not excluded_by(config, module_key(layer, t))]
    if unfilled:  # peft would put LoRA there all the same, initialised as init_lora_weights says
        raise CheckpointError(f"{config_path}: target_modules and the fields beside it put LoRA on {unfilled[0]}, "
                              f"for which {path} holds no tensors ({len(unfilled)} such module(s))")
    other = next((key for key in other_modules(base) if not excluded_by(config, key)), None)
    if other:  # peft would put LoRA there (the embeddings, lm_head) or refuse the module (a norm, a block)
        raise CheckpointError(f"{config_path}: target_modules and the fields beside it put LoRA on {other}: no form "
                              "here, where LoRA is on the seven projections only")
    ours, shapes = {}, base.layer_shapes()
    for (layer, target, part), array in found.items():
        parent, expert, linear = TARGETS[target]
        out_features, in_features = shapes[f"{parent}.{linear}.weight"]
        expected = [rank, in_features] if part == "lora_A" else [out_features, rank]
        if list(array.shape) != expected:
            raise CheckpointError(f"{path}: tensor '{PEFT_PREFIX}{module_key(layer, target)}.{part}.weight' has shape "
                                  f"{list(array.shape)}, where LoRA of rank {rank} on the base's {hf_module(target)} "
                                  f"has {expected}")
        if part == "lora_B" and target in PERMUTED:
            array = from_hf_rows(array, base.head_dim)
        ours[f"llama.layers.{layer}.{parent}.{expert}.{part}.weight"] = array  # checked and cast as it is assigned
    return fields, ours


def other_modules(base: ModelArgs) -> list:
    """peft's names of the base's modules besides the projections: those holding weights (hf.py's names) and the
    blocks holding them."""
    per_layer = {name[:-len(".weight")] for name in LAYER_NAMES.values()} - {hf_module(t) for t in TARGETS}
    if not base.qk_norm:
        per_layer -= {"self_attn.q_norm", "self_attn.k_norm"}
    return [name[:-len(".weight")] for name in TOP_NAMES.values()] + [
        f"model.layers.{layer}{suffix}" for layer in range(base.n_layers)
        for suffix in ["", ".self_attn", ".mlp", *sorted(f".{m}" for m in per_layer)]]


def module_key(layer: int, target: str) -> str:
    """peft's name of the base module a target of a layer is: 'model.layers.3.self_attn.q_proj'."""
    return f"model.layers.{layer}.{hf_module(target)}"


def spans(layers: list) -> str:
    """[0, 1, 2, 5] -> '0-3,5-6' (ModelArgs' half-open layer spans)."""
    runs = []
    for layer in layers:
        if runs and runs[-1][1] == layer:
            runs[-1][1] = layer + 1
        else:
            runs.append([layer, layer + 1])
    return ",".join(f"{a}-{b}" for a, b in runs)
