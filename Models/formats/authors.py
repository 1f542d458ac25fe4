"""The authors' option names (their adapter_params.json, a checkpoint's `args`, their ModelArgs)
and ours: which options each of their folders has, which we refuse, which do nothing in their code.

Their release is one folder per method; a `folder` below names one: `sparse` and `soft` (MoA,
LLaMA3_sparse_moa / LLaMA3_soft_moa), `soft_moe`, `sparse_moe`, `instance` (LLaMA3_soft_moa_instance)
and `unipeft` (LLaMA3_UniPEFT), the same names as the golden files' `variant`.
"""
from Utils.settings import check_values

from ..ModelArgs import ModelArgs
from . import CheckpointError

_SOFT = ("w_bias", "lora_layers", "lora_rank", "lora_targets", "lora_alpha", "expert_num", "swi_x", "hydra_moe",
         "p_adapter_layers", "p_adapter_size", "p_adapter_hydra", "prompt_layers", "prompt_len", "expert_weight",
         "max_seq_len", "flash_attention2", "bf16")
# What each folder's extract_adapter_from_checkpoint.py writes, in its order. Their loader calls
# ModelArgs(**json), and each folder's ModelArgs knows only its own set.
AUTHORS_PARAMS = {
    "sparse": ("w_bias", "lora_layers", "lora_rank", "lora_targets", "lora_alpha", "max_threshold",
               "bool_weights", "adapter_noisy", "const_threshold", "swi_x", "p_adapter_layers",
               "p_adapter_size", "p_adapter_hydra", "prompt_layers", "prompt_len", "max_seq_len",
               "flash_attention2", "bf16"),
    "soft": _SOFT,
    "instance": _SOFT,
    "unipeft": _SOFT,
    "soft_moe": tuple(k for k in _SOFT if k != "swi_x"),
    "sparse_moe": ("w_bias", "lora_layers", "lora_rank", "lora_targets", "lora_alpha", "expert_num",
                   "noisy_router", "top_k", "adamole", "lb_loss_coeff", "p_adapter_layers", "p_adapter_size",
                   "p_adapter_hydra", "prompt_layers", "prompt_len", "expert_weight", "max_seq_len",
                   "flash_attention2", "bf16"),
}
# Their options whose effect we do not implement: a true value is an error naming it.
# adapter_noisy adds an adapter_noise_linear whose use is commented out in their code, but its
# tensors would sit in the file; noisy_router adds random noise to the top-k/AdaMoLE routers, in
# eval mode too (the paper's runs had it off).
AUTHORS_UNSUPPORTED = ("w_bias", "adapter_noisy", "noisy_router")
# Their options with no effect in their code (the code reading them is commented out):
# accepted and ignored. flash_attention2 and bf16 choose kernels and precision, not results.
AUTHORS_IGNORED = ("bool_weights", "expert_weight", "flash_attention2", "bf16")
# Their fields that are also ours (Meta's when their full ModelArgs is given). Their batch size
# is the training run's; inference picks its own.
AUTHORS_SHARED = tuple(f for f in ModelArgs.__dataclass_fields__
                       if f not in ("method", "variant", "gamma_grad", "max_batch_size"))
# Our (method, variant) of each folder; sparse_moe is topk or adamole by their `adamole` option.
FOLDER_METHOD = {"sparse": ("moa", "sparse"), "soft": ("moa", "soft"), "soft_moe": ("moe", None),
                 "instance": ("instance", None), "unipeft": ("unipeft", None)}
BASELINE_FOLDERS = ("soft_moe", "sparse_moe", "instance", "unipeft")


def authors_folder(fields: dict, source: str, hint: str = None) -> str:
    """Which of the authors' folders wrote these options. Soft MoA, instance-level MoA and UniPEFT
    share one option set: `hint` (a folder name, e.g. from a --method flag) tells them apart."""
    if "max_threshold" in fields and "expert_num" in fields:
        raise CheckpointError(f"{source}: cannot tell which of the authors' methods wrote these options: both "
                              "'max_threshold' (Sparse MoA only) and 'expert_num' (every other method) are set")
    if "max_threshold" in fields:
        folder = "sparse"
    elif "top_k" in fields or "adamole" in fields:
        folder = "sparse_moe"
    elif "expert_num" in fields:
        folder = "soft" if "swi_x" in fields else "soft_moe"
    else:
        raise CheckpointError(f"{source}: cannot tell which of the authors' methods wrote these options: "
                              "expected 'max_threshold' (Sparse MoA), 'top_k'/'adamole' (sparse MoE-LoRA) or "
                              "'expert_num' (Soft MoA, soft MoE, instance-level MoA, UniPEFT)")
    if folder == "soft" and hint in ("instance", "unipeft"):
        folder = hint
    return folder


def folder_of(args: ModelArgs) -> str:
    """The authors' folder that implements our method."""
    if args.method == "moa":
        return args.variant
    return {"moe": "soft_moe", "topk": "sparse_moe", "adamole": "sparse_moe"}.get(args.method, args.method)


def fields_from_authors(fields: dict, source: str, folder: str = None, hint: str = None) -> dict:
    """The authors' options (adapter_params.json, a checkpoint's args, their ModelArgs) ->
    our ModelArgs fields; an option we do not implement is an error naming it."""
    folder = folder or authors_folder(fields, source, hint)
    unsupported = [k for k in AUTHORS_UNSUPPORTED if fields.get(k)]
    if unsupported:
        raise CheckpointError(f"{source}: the authors' option(s) {unsupported} are set, which MoA-Jittor "
                              "does not implement")
    missing = [k for k in AUTHORS_PARAMS[folder] if k not in fields and k not in AUTHORS_IGNORED]
    if missing:
        raise CheckpointError(f"{source}: missing option(s) {missing} of the authors' {folder} folder")
    # each value by our setting's rule, naming the file (their integer lora_alpha becomes a float)
    ours = check_values(ModelArgs, {k: v for k, v in fields.items() if k in AUTHORS_SHARED}, source)
    if folder == "sparse_moe":
        # their --adamole is type=bool: any non-empty string, "False" too, switched it on
        return {**ours, "method": "adamole" if fields["adamole"] else "topk"}
    method, variant = FOLDER_METHOD[folder]
    return {**ours, "method": method, **({"variant": variant} if variant else {})}


def args_from_authors(model_args: dict, folder: str, **overrides) -> ModelArgs:
    """The authors' full ModelArgs (as a dict) of one folder -> ours."""
    return ModelArgs(**{**fields_from_authors(model_args, f"authors' {folder} ModelArgs", folder), **overrides})


def check_authors_base(args: ModelArgs):
    """The authors' LLaMA3 folders build LLaMA-3 only: an adapter of another architecture has no form there."""
    if args.architecture != "llama":
        raise CheckpointError(f"an adapter of a {args.architecture} base has no form in the authors' LLaMA3 code, "
                              f"which builds LLaMA-3 only (their MoA_Transformers is another layout: docs/hf_bases.md)")


def authors_params(args: ModelArgs) -> dict:
    """Our ModelArgs -> the authors' adapter_params.json of the folder implementing it, their types."""
    check_authors_base(args)
    folder = folder_of(args)
    if folder == "sparse" and args.expert_num > 1:
        raise CheckpointError("the authors' Sparse MoA has one expert per type; expert_num="
                              f"{args.expert_num} has no place in its adapter_params.json")
    if folder in BASELINE_FOLDERS and "FFN_GATE" in args.targets:
        raise CheckpointError(f"the authors' {folder} code builds no FFN_GATE LoRA (it ignores the target): an "
                              "adapter with one has no form their code would load")
    ours = {**args.to_dict(), "adamole": args.method == "adamole"}
    params = {}
    for k in AUTHORS_PARAMS[folder]:
        value = ours.get(k, False)  # w_bias, bool_weights, noisy_router, ...: off in every adapter of ours
        if k == "lora_alpha" and float(value).is_integer():
            value = int(value)  # their argparse type
        params[k] = value
    return params
