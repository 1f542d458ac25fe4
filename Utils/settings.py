"""Settings: each declared once (type, default, help, rules), the command-line flags generated from
that declaration, and the named recipes that reproduce the paper's runs.

A setting is a dataclass field made with `setting(...)`: ModelArgs (the model and its experts),
TrainArgs (the training loop) and GenerationArgs (decoding) below. `add_arguments` turns the fields
of one class into argparse flags; `resolve` builds the instance from, in rising precedence, the
dataclass defaults, a recipe, and the flags actually given on the command line.

Every value of a field, wherever it comes from (a flag, a recipe file, args.json, an
adapter_params.json, Meta's params.json, a Hugging Face config.json), passes `check_values`: its
declared type, a finite number for a float (finite in float32, which the kernels compute in, and 0 or
normal there: an lr of 1e-300 computes as 0), an integer of 64 bits for an int (what a shape holds),
its choices and its bounds; the error names where the value came from. Rules that join several settings live in each class's
__post_init__, which also checks every field again (programmatic construction included).
"""
import argparse
import os
import re
import typing
from dataclasses import MISSING, dataclass, field, fields

from Utils.file_io import read_json_object

FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # the least normal float32: below it a value computes as 0 or a subnormal
INT64_LIMIT = 2**63
MAX_POSITIONS = 2**24  # RoPE's angles take positions in float32, exact integers up to 2^24 (Models/rope.py)


class SettingError(ValueError):
    """A value that breaks its setting's declared rule; the message names where it came from."""


_BOUNDS = (("at_least", lambda v, b: v < b, "at least"), ("above", lambda v, b: v <= b, ">"),
           ("at_most", lambda v, b: v > b, "at most"), ("below", lambda v, b: v >= b, "<"))


def setting(default, help, choices=None, resumable=False, **bounds):
    """A dataclass field that is also a command-line flag. `bounds` (at_least, above, at_most, below)
    bound a number; `resumable` says a resumed run may give it another value (it does not change
    what the checkpoint's run computes)."""
    return field(default=default, metadata={**checked_field(None, **bounds).metadata, "help": help,
                                            "choices": choices, "resumable": resumable})


def checked_field(default, choices=None, **bounds):
    """A dataclass field with a rule that is not a flag (Meta's params.json fields, args.json's run fields)."""
    unknown = set(bounds) - {name for name, _, _ in _BOUNDS}
    if unknown:
        raise TypeError(f"unknown bound(s) {sorted(unknown)}")
    return field(default=default, metadata={**bounds, "choices": choices})


def setting_fields(cls) -> list:
    return [f for f in fields(cls) if "help" in f.metadata]


def _scalar_type(annotation):
    """int / float / str / bool behind an annotation such as Optional[float] or 'float'."""
    if isinstance(annotation, str):
        annotation = {"int": int, "float": float, "str": str, "bool": bool}.get(annotation.split("[")[-1].strip("]"))
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


def _optional(annotation) -> bool:
    return type(None) in typing.get_args(annotation) or str(annotation).startswith("Optional")


_KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def where(source, name: str) -> str:
    """How an error names a value: the flag (source None) or the file and its field."""
    return f"--{name}" if source is None else f"{source}: field '{name}'"


def with_sources(message: str, sources: dict) -> str:
    """`message` (a rule joining several settings was broken) followed by the value of each setting it names
    and where that came from; `sources` {name: (value, where)}, where: a flag, a recipe, a file."""
    named = [f"{name} {value!r} from {origin}" for name, (value, origin) in sources.items()
             if re.search(rf"(?<!\w){re.escape(name)}(?!\w)", message)]
    return f"{message} ({'; '.join(named)})" if named else message


def check_value(f, value, source=None, name=None):
    """`value` of field `f` by its declared type and rule, or a SettingError naming where it came from
    (`name`: the field's name there, when the file calls it otherwise). Returns it, an integer given for
    a float as a float."""
    kind, rule, label = _scalar_type(f.type), f.metadata, where(source, name or f.name)
    if value is None:
        if _optional(f.type) or kind not in _KIND_NAMES:
            return value
        raise SettingError(f"{label} must be {_KIND_NAMES[kind]}, got null")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind in _KIND_NAMES and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
        raise SettingError(f"{label} must be {_KIND_NAMES[kind]}, got {value!r}")
    if kind is float and not abs(value) <= FLOAT32_MAX:  # NaN fails every comparison
        raise SettingError(f"{label} must be a finite number, got {value!r}")
    if kind is float and 0 < abs(value) < FLOAT32_TINY:  # an lr of 1e-300 would train nothing, silently
        raise SettingError(f"{label} must be 0 or at least {FLOAT32_TINY:.4g} in size: {value!r} is 0 or a subnormal "
                           "in float32, which the kernels compute in")
    if rule.get("choices") and value not in rule["choices"]:
        raise SettingError(f"{label} must be one of {', '.join(map(str, rule['choices']))}; got {value!r}")
    for bound, broken, text in _BOUNDS:
        if rule.get(bound) is not None and broken(value, rule[bound]):
            raise SettingError(f"{label} must be {text} {rule[bound]}, got {value!r:.40}")
    if kind is int and not -INT64_LIMIT <= value < INT64_LIMIT:  # sizes and counts become int64 shapes
        raise SettingError(f"{label} must be an integer of 64 bits, got {value!r:.40}")
    return value


def check_values(cls, values: dict, source=None) -> dict:
    """The entries of `values` that are fields of `cls`, each checked by its rule (check_value)."""
    declared = {f.name: f for f in fields(cls)}
    return {k: check_value(declared[k], v, source) for k, v in values.items() if k in declared}


def check_fields(obj, source=None):
    """Check (and normalise) every field of a dataclass instance in place; for __post_init__."""
    for f in fields(obj):
        setattr(obj, f.name, check_value(f, getattr(obj, f.name), source))


def resume_fixed(values: dict, *classes) -> dict:
    """The settings in `values` that a resumed run may not change (those not declared `resumable`)."""
    fixed = {f.name for cls in classes for f in setting_fields(cls) if not f.metadata["resumable"]}
    return {k: v for k, v in values.items() if k in fixed}


@dataclass
class RunRecord:
    """What a training run's args.json records beside its settings (Math.py's run_flags), each with its rule."""
    recipe: str = checked_field(None)
    llama_path: str = checked_field(None)
    data_path: typing.Optional[str] = checked_field(None)  # null: the synthetic data
    val_data_path: typing.Optional[str] = checked_field(None)
    output_dir: str = checked_field(None)
    resume: typing.Optional[str] = checked_field(None)
    overwrite: bool = checked_field(None)
    init_adapter: typing.Optional[str] = checked_field(None)
    device: str = checked_field(None, choices=("cuda", "cpu"))
    world_size: int = checked_field(None, at_least=1)
    run_id: str = checked_field(None)
    synthetic_data: typing.Optional[str] = checked_field(None)


def check_record(path: str, recorded: dict, setting_classes):
    """A run's args.json (`recorded`, read from `path`) field by field: no field that is neither a RunRecord
    field nor a setting of `setting_classes`, each value by its rule."""
    known = {f.name for f in fields(RunRecord)} | {f.name for cls in setting_classes for f in setting_fields(cls)}
    unknown = sorted(set(recorded) - known)
    if unknown:
        raise SettingError(f"{path}: unknown field(s) {unknown}")
    for cls in (RunRecord, *setting_classes):
        check_values(cls, recorded, path)


def count_or_auto(text: str):
    """A flag's type: a positive integer, or 'auto' (the program chooses)."""
    if text == "auto" or (text.isdigit() and int(text) >= 1):
        return text if text == "auto" else int(text)
    raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {text!r}")


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the project's error contract: a bad argument is one `error:` line, exit 2."""

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} -h)\n")


def add_arguments(parser, cls, shown_defaults=None, optional=False, exclude=()):
    """One flag per setting of `cls`. Unset flags stay out of the namespace (see `resolve`), so the
    help shows `shown_defaults` (e.g. a recipe's values) or the field's default; `optional` says the
    flag only overrides something saved elsewhere (Infer.py's MoA flags over an adapter's config)."""
    shown_defaults = shown_defaults or {}
    for f in setting_fields(cls):
        if f.name in exclude:
            continue
        kind = _scalar_type(f.type)
        default = shown_defaults.get(f.name, f.default if f.default is not MISSING else None)
        text = f.metadata["help"] + ("" if optional else f" (default: {default})")
        if kind is bool:
            parser.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=text)
        else:
            parser.add_argument(f"--{f.name}", type=kind, choices=f.metadata["choices"], default=argparse.SUPPRESS,
                                help=text)


def given(namespace, cls) -> dict:
    """The settings of `cls` that the command line set, each checked by its rule."""
    names = {f.name for f in setting_fields(cls)}
    return check_values(cls, {k: v for k, v in vars(namespace).items() if k in names})


def resolve(cls, values: dict, **extra):
    """An instance of `cls` from the keys of `values` that are its settings, plus `extra`."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names}, **extra)


@dataclass
class TrainArgs:
    """The training loop's settings (Math.py, engine_finetune.py)."""
    blr: float = setting(6e-3, "base learning rate: lr = blr * batch_size * accum_iter / 256", above=0)
    lr: typing.Optional[float] = setting(None, "absolute learning rate (overrides --blr)", above=0)
    min_lr: float = setting(0.0, "lr floor of the cosine schedule", at_least=0)
    warmup_epochs: float = setting(1.0, "epochs of linear lr warm-up (fractions allowed)", at_least=0)
    warmup_steps: int = setting(0, "optimizer steps of linear lr warm-up; when > 0 it replaces --warmup_epochs",
                                at_least=0)
    lr_schedule: str = setting("cosine", "after the warm-up: cosine = half a cosine down to --min_lr at the end, "
                                         "constant = --lr to the end (the authors' code runs)",
                               choices=("cosine", "constant"))
    epochs: int = setting(2, "training epochs; a resumed run may raise it (the lr schedule then spans the new "
                             "total: README)", at_least=1, resumable=True)
    batch_size: int = setting(32, "GLOBAL batch of one micro-step, split over the MPI ranks (the authors' was "
                                  "per GPU)", at_least=1)
    accum_iter: int = setting(1, "micro-steps accumulated per optimizer step", at_least=1)
    weight_decay: float = setting(0.02, "AdamW weight decay on matrices (not on 1-D parameters or biases)",
                                  at_least=0)
    clip_grad: float = setting(0.0, "max global gradient norm; 0 = no clipping", at_least=0)
    seed: int = setting(0, "seed of the adapters' initialisation and the data order", at_least=0,
                        at_most=2**32 - 1)
    val_fraction: float = setting(0.0, "share of --data_path held out for validation when --val_data_path is "
                                       "not given; 0 = none", at_least=0, below=1)
    early_stop_patience: int = setting(0, "stop after this many validations without improvement; 0 = never",
                                       at_least=0, resumable=True)
    eval_interval: int = setting(200, "validate and save checkpoint-latest every N optimizer steps (and at "
                                      "each epoch end); 0 = epoch ends only", at_least=0, resumable=True)
    max_steps: int = setting(0, "stop after this many optimizer steps in all (lr schedule unchanged); 0 = no cap",
                             at_least=0, resumable=True)
    log_interval: int = setting(100, "a terminal and log.txt line every N optimizer steps", at_least=1,
                                resumable=True)

    def __post_init__(self):
        check_fields(self)
        if self.lr is None:
            self.lr = self.blr * self.batch_size * self.accum_iter / 256
            if not FLOAT32_TINY <= self.lr <= FLOAT32_MAX:
                raise SettingError(f"the learning rate --blr * --batch_size * --accum_iter / 256 = {self.lr} is not "
                                   "a finite normal float32 (0 or a subnormal trains nothing)")
        if self.min_lr > self.lr:
            raise SettingError(f"--min_lr {self.min_lr} is above the learning rate {self.lr}: the schedule would "
                               "rise instead of decaying")


@dataclass
class GenerationArgs:
    """Decoding settings (Infer.py; Math.py records the recipe's in args.json for it)."""
    max_gen_len: int = setting(200, "most tokens generated per example; also bounded by the model's max_seq_len "
                                    "minus the prompt, as the authors do", at_least=1, resumable=True,
                               at_most=MAX_POSITIONS)
    temperature: float = setting(0.0, "0 = greedy; the paper's runs sample with 0.1 and top_p 0.75", at_least=0,
                                 resumable=True)
    top_p: float = setting(0.75, "nucleus sampling mass when temperature > 0", above=0, at_most=1, resumable=True)
    samples_per_task: int = setting(1, "completions generated per problem of a code data set (pass@k needs k); a "
                                       "math or commonsense example gets one", at_least=1, resumable=True)

    def __post_init__(self):
        check_fields(self)


# ---- recipes -------------------------------------------------------------------------------------
# Under every recipe Math.py puts LoRA and the parallel adapter in every layer unless a recipe or flag says
# otherwise (ModelArgs' own default, '0-0', is a model without them)
EVERY_LAYER_SPANS = ("lora_layers", "p_adapter_layers")
# Each recipe: settings of ModelArgs, TrainArgs and GenerationArgs; "soft"/"sparse" hold what one
# variant adds. "all" as a layer span means every layer of the base.
_PAPER_EXPERTS = dict(lora_layers="all", lora_rank=8, lora_alpha=8.0, lora_targets="Q,K,V,O,FFN_DOWN",
                      p_adapter_layers="all", p_adapter_size=16, swi_x=4, max_threshold=0.5)
_PAPER_TRAINING = dict(precision="bf16", blr=6e-3, batch_size=32, accum_iter=1, epochs=2, warmup_epochs=1.0, weight_decay=0.02,
                       clip_grad=0.0, val_fraction=0.0, seed=0, temperature=0.1, top_p=0.75)
_SOFT_PROMPTS = dict(prompt_layers="all", prompt_len=10)
RECIPES = {
    "demo": dict(
        doc="the tiny demo: shipped base, synthetic math, 3 epochs (Math.py's default)",
        settings=dict(variant="sparse", lora_layers="all", lora_rank=16, lora_alpha=16.0,
                      lora_targets="Q,K,V,O,FFN_UP,FFN_GATE,FFN_DOWN", p_adapter_layers="all", p_adapter_size=16,
                      swi_x=4, max_threshold=0.5, blr=4e-2, batch_size=16, accum_iter=1, epochs=3,
                      warmup_epochs=0.05, weight_decay=0.02, clip_grad=1.0, val_fraction=0.05, seed=0,
                      max_seq_len=192, max_gen_len=200, temperature=0.0),
        soft=_SOFT_PROMPTS, sparse={}),
    "math": dict(
        doc="the paper's math runs: math_14k, LLaMA-3.1-8B, seeds 0, 125, 1225",
        settings=dict(variant="sparse", **_PAPER_EXPERTS, **_PAPER_TRAINING, max_seq_len=300, max_gen_len=200),
        soft=_SOFT_PROMPTS, sparse={}),
    "commonsense": dict(
        doc="the paper's commonsense runs: commonsense_15k, the math recipe's adapters",
        settings=dict(variant="sparse", **_PAPER_EXPERTS, **_PAPER_TRAINING, max_seq_len=200, max_gen_len=40),
        soft=_SOFT_PROMPTS, sparse={}),
    "code": dict(
        doc="the authors' code runs (MoA_Transformers): CodeAlpaca-20k, scored on HumanEval and MBPP by pass@k",
        settings=dict(variant="sparse", **_PAPER_EXPERTS, precision="bf16", lr=1e-4, lr_schedule="constant",
                      warmup_steps=200, warmup_epochs=0.0, batch_size=4, accum_iter=4, epochs=5, weight_decay=0.0,
                      clip_grad=0.0, val_fraction=0.0, seed=0, max_seq_len=500, max_gen_len=400, temperature=0.7,
                      top_p=0.95, samples_per_task=10),
        soft=_SOFT_PROMPTS, sparse={}),
    "bench": dict(
        doc="the speed benchmark's adapters, as ../shared/ref/ref_bench.py builds the authors' model",
        settings=dict(variant="sparse", lora_layers="all", lora_rank=8, lora_alpha=8.0,
                      lora_targets="Q,K,V,O,FFN_UP,FFN_DOWN", p_adapter_layers="all", p_adapter_size=16, swi_x=4),
        soft=_SOFT_PROMPTS, sparse={}),
}


# The paper's comparison (Compare.py): MoA's two variants and the baselines, as settings on top of
# a recipe. The LoRA baselines keep the recipe's LoRA (layers, rank, targets) and drop its other
# families, as the paper ran them; the instance-level ones keep Soft MoA's families.
_LORA_ONLY = dict(prompt_layers="0-0", p_adapter_layers="0-0")
_PAPER_MOE_EXPERTS = 8  # the paper's MoLoRA, HydraLoRA, top-k and AdaMoLE runs
METHOD_PRESETS = {
    "sparse": dict(method="moa", variant="sparse"),
    "soft": dict(method="moa", variant="soft"),
    "lora": dict(method="moe", expert_num=1, **_LORA_ONLY),
    "molora": dict(method="moe", expert_num=_PAPER_MOE_EXPERTS, **_LORA_ONLY),
    "hydralora": dict(method="moe", expert_num=_PAPER_MOE_EXPERTS, hydra_moe=True, **_LORA_ONLY),
    "topk": dict(method="topk", expert_num=_PAPER_MOE_EXPERTS, top_k=2, **_LORA_ONLY),
    "adamole": dict(method="adamole", expert_num=_PAPER_MOE_EXPERTS, **_LORA_ONLY),
    "instance": dict(method="instance", variant="soft"),
    "unipeft": dict(method="unipeft", variant="soft"),
}


def recipe_values(recipe: str, variant: str = None) -> dict:
    """The settings of a recipe (a name in RECIPES, or a JSON file of settings) for `variant`."""
    if recipe in RECIPES:
        entry = RECIPES[recipe]
        values = dict(entry["settings"])
        variant = variant or values["variant"]
        return {**values, "variant": variant, **entry.get(variant, {})}
    if not recipe.endswith(".json") or not os.path.isfile(recipe):
        raise ValueError(f"--recipe {recipe!r}: not one of {sorted(RECIPES)} nor a JSON file of settings")
    values = read_json_object(recipe, "settings")
    return {**values, **({"variant": variant} if variant else {})}


def recipes_help() -> str:
    return "recipes: " + "; ".join(f"{name} = {entry['doc']}" for name, entry in RECIPES.items())
