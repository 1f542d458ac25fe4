"""The authors' option names (their adapter_params.json, a checkpoint's `args`, their ModelArgs)
and ours: which options exist per variant, which we refuse, which do nothing in their code.
"""
from .ModelArgs import ModelArgs
from .torch_io import CheckpointError


# What their extract_adapter_from_checkpoint.py writes, in its order, per variant. Their
# loader calls ModelArgs(**json), and each variant's ModelArgs knows only its own set.
AUTHORS_PARAMS = {
    "sparse": ("w_bias", "lora_layers", "lora_rank", "lora_targets", "lora_alpha", "max_threshold",
               "bool_weights", "adapter_noisy", "const_threshold", "swi_x", "p_adapter_layers",
               "p_adapter_size", "p_adapter_hydra", "prompt_layers", "prompt_len", "max_seq_len",
               "flash_attention2", "bf16"),
    "soft": ("w_bias", "lora_layers", "lora_rank", "lora_targets", "lora_alpha", "expert_num", "swi_x",
             "hydra_moe", "p_adapter_layers", "p_adapter_size", "p_adapter_hydra", "prompt_layers",
             "prompt_len", "expert_weight", "max_seq_len", "flash_attention2", "bf16"),
}
# Their options whose effect we do not implement: a true value is an error naming it.
# adapter_noisy adds an adapter_noise_linear whose use is commented out in their code,
# but its tensors would sit in the file, so it is refused rather than silently dropped.
AUTHORS_UNSUPPORTED = ("w_bias", "adapter_noisy")
# Their options with no effect in their code (the code reading them is commented out):
# accepted and ignored. flash_attention2 and bf16 choose kernels and precision, not results.
AUTHORS_IGNORED = ("bool_weights", "expert_weight", "flash_attention2", "bf16")
# Their fields that are also ours (Meta's when their full ModelArgs is given). Their batch size
# is the training run's; inference picks its own.
AUTHORS_SHARED = tuple(f for f in ModelArgs.__dataclass_fields__ if f not in ("variant", "gamma_grad", "max_batch_size"))


def authors_variant(fields: dict, source: str) -> str:
    """Soft or Sparse MoA, from which of the two option sets the authors' fields hold."""
    soft, sparse = "expert_num" in fields, "max_threshold" in fields
    if soft == sparse:
        raise CheckpointError(f"{source}: cannot tell Soft from Sparse MoA: expected exactly one of "
                              "'expert_num' (Soft) and 'max_threshold' (Sparse) among the authors' options")
    return "soft" if soft else "sparse"


def fields_from_authors(fields: dict, source: str, variant: str = None) -> dict:
    """The authors' options (adapter_params.json, a checkpoint's args, their ModelArgs) ->
    our ModelArgs fields; an option we do not implement is an error naming it."""
    variant = variant or authors_variant(fields, source)
    unsupported = [k for k in AUTHORS_UNSUPPORTED if fields.get(k)]
    if unsupported:
        raise CheckpointError(f"{source}: the authors' option(s) {unsupported} are set, which MoA-Jittor "
                              "does not implement")
    missing = [k for k in AUTHORS_PARAMS[variant] if k not in fields and k not in AUTHORS_IGNORED]
    if missing:
        raise CheckpointError(f"{source}: missing option(s) {missing} of the authors' {variant} MoA")
    ours = {k: v for k, v in fields.items() if k in AUTHORS_SHARED}
    if "lora_alpha" in ours:
        ours["lora_alpha"] = float(ours["lora_alpha"])  # their argparse reads an int
    if "rope_theta" in ours:
        ours["rope_theta"] = float(ours["rope_theta"])
    return {**ours, "variant": variant}


def args_from_authors(model_args: dict, variant: str, **overrides) -> ModelArgs:
    """The authors' full ModelArgs (as a dict) -> ours."""
    return ModelArgs(**{**fields_from_authors(model_args, f"authors' {variant} ModelArgs", variant), **overrides})


def authors_params(args: ModelArgs) -> dict:
    """Our ModelArgs -> the authors' adapter_params.json for its variant, their types."""
    ours = args.to_dict()
    if args.variant == "sparse" and args.expert_num > 1:
        raise CheckpointError("the authors' Sparse MoA has one expert per type; expert_num="
                              f"{args.expert_num} has no place in its adapter_params.json")
    params = {}
    for k in AUTHORS_PARAMS[args.variant]:
        value = ours.get(k, False)  # w_bias, bool_weights, ...: off in every adapter of ours
        if k == "lora_alpha" and float(value).is_integer():
            value = int(value)  # their argparse type
        params[k] = value
    return params
