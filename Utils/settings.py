"""Settings: each declared once (type, default, help), the command-line flags generated from that
declaration, and the named recipes that reproduce the paper's runs.

A setting is a dataclass field made with `setting(...)`: ModelArgs (the model and its experts),
TrainArgs (the training loop) and GenerationArgs (decoding) below. `add_arguments` turns the fields
of one class into argparse flags; `resolve` builds the instance from, in rising precedence, the
dataclass defaults, a recipe, and the flags actually given on the command line.
"""
import argparse
import os
import typing
from dataclasses import MISSING, dataclass, field, fields

from Utils.misc import read_json_object


def setting(default, help, choices=None):
    """A dataclass field that is also a command-line flag."""
    return field(default=default, metadata={"help": help, "choices": choices})


def setting_fields(cls) -> list:
    return [f for f in fields(cls) if "help" in f.metadata]


def _scalar_type(annotation):
    """int / float / str / bool behind an annotation such as Optional[float] or 'float'."""
    if isinstance(annotation, str):
        annotation = {"int": int, "float": float, "str": str, "bool": bool}.get(annotation.split("[")[-1].strip("]"))
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


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
    """The settings of `cls` that the command line set."""
    names = {f.name for f in setting_fields(cls)}
    return {k: v for k, v in vars(namespace).items() if k in names}


def resolve(cls, values: dict, **extra):
    """An instance of `cls` from the keys of `values` that are its settings, plus `extra`."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in values.items() if k in names}, **extra)


@dataclass
class TrainArgs:
    """The training loop's settings (Math.py, engine_finetune.py)."""
    blr: float = setting(6e-3, "base learning rate: lr = blr * batch_size * accum_iter / 256")
    lr: typing.Optional[float] = setting(None, "absolute learning rate (overrides --blr)")
    min_lr: float = setting(0.0, "lr floor of the cosine schedule")
    warmup_epochs: float = setting(1.0, "epochs of linear lr warm-up (fractions allowed)")
    warmup_steps: int = setting(0, "optimizer steps of linear lr warm-up; when > 0 it replaces --warmup_epochs")
    lr_schedule: str = setting("cosine", "after the warm-up: cosine = half a cosine down to --min_lr at the end, "
                                         "constant = --lr to the end (the authors' code runs)",
                               choices=("cosine", "constant"))
    epochs: int = setting(2, "training epochs")
    batch_size: int = setting(32, "GLOBAL batch of one micro-step, split over the MPI ranks (the authors' was "
                                  "per GPU)")
    accum_iter: int = setting(1, "micro-steps accumulated per optimizer step")
    weight_decay: float = setting(0.02, "AdamW weight decay on matrices (not on 1-D parameters or biases)")
    clip_grad: float = setting(0.0, "max global gradient norm; 0 = no clipping")
    seed: int = setting(0, "seed of the adapters' initialisation and the data order")
    val_fraction: float = setting(0.0, "share of --data_path held out for validation when --val_data_path is "
                                       "not given; 0 = none")
    early_stop_patience: int = setting(0, "stop after this many validations without improvement; 0 = never")
    eval_interval: int = setting(200, "validate and save checkpoint-latest every N optimizer steps (and at "
                                      "each epoch end); 0 = epoch ends only")
    max_steps: int = setting(0, "stop after this many optimizer steps in all (lr schedule unchanged); 0 = no cap")
    log_interval: int = setting(100, "a terminal and log.txt line every N optimizer steps")

    def __post_init__(self):
        for name in ("batch_size", "accum_iter", "epochs", "log_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1, got {getattr(self, name)}")
        for name in ("eval_interval", "max_steps", "early_stop_patience", "warmup_epochs", "warmup_steps", "clip_grad",
                     "min_lr"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"--val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.lr is None:
            self.lr = self.blr * self.batch_size * self.accum_iter / 256
        if self.lr <= 0:
            raise ValueError(f"the learning rate must be positive, got {self.lr}")


@dataclass
class GenerationArgs:
    """Decoding settings (Infer.py)."""
    max_gen_len: int = setting(200, "most tokens generated per example; also bounded by the model's max_seq_len "
                                    "minus the prompt, as the authors do")
    temperature: float = setting(0.0, "0 = greedy; the paper's runs sample with 0.1 and top_p 0.75")
    top_p: float = setting(0.75, "nucleus sampling mass when temperature > 0")
    samples_per_task: int = setting(1, "completions generated per problem of a code data set (pass@k needs k); a "
                                       "math or commonsense example gets one")

    def __post_init__(self):
        if self.max_gen_len < 1:
            raise ValueError(f"--max_gen_len={self.max_gen_len} is too small")
        if self.samples_per_task < 1:
            raise ValueError(f"--samples_per_task must be at least 1, got {self.samples_per_task}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"--temperature must be >= 0 and --top_p in (0, 1], got {self.temperature}, {self.top_p}")


# ---- recipes -------------------------------------------------------------------------------------
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
