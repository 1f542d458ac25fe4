"""What a model takes in memory, counted from its settings before any of it is allocated, and the check
against what the machine can still give: the base's weights, its RoPE tables, the adapters (in training with
their gradients and AdamW's two moments) and, to generate, the KV cache. The counts are Python integers, exact however large a setting is, so a size no machine holds
(a vocab_size of 2^62, a head_dim of 2^22, a max_seq_len of 10^8, a lora_rank of 10^8) is refused in one line naming the
file or flag to change, where allocating it would end in a MemoryError, an overflow or a crash. On a GPU
run (Jittor's use_cuda) the memory that holds them is the GPU's, and that is what they are checked against.
"""
import ctypes
import math
import os
import sys
from collections import Counter
from dataclasses import replace

import Utils.jittor_env  # noqa: F401
import jittor as jt

from .kernels.elementwise import LAZY_CHUNKS, LOGIT_BYTES
from .ModelArgs import BF16_PRODUCTS, SPARSE_MOE_METHODS
from .kernels.nf4 import nf4_shapes

# AdamW's training state per adapter parameter: the parameter, its gradient and the two moments, each fp32
TRAINING_COPIES = 4
# LLM.LLaMA's RoPE tables at their peak (Models/rope.rope_tables): the angles, cos, sin and the copy
# of a cast, each [2 * max_seq_len, head_dim / 2] fp32
ROPE_TABLES_AT_PEAK = 4
# A training step's activations (activation_bytes): a layer keeps, per token, fp32 numbers in these many widths of dim,
# of the queries, of the keys and values and of the FFN (its gate and up, the experts' and routers' own), and its graph,
# about 4 MiB whatever the tokens. fp32: fitted to the peak RSS of steps of 2 and 6 layers at 512 and 2,048 tokens, the
# bench recipe's experts, dim 256 and 512, FFN 704 and 1408 (3-28% above what was measured); bf16 products keep the
# FFN's branches as bf16 bits: the 14B shape's profile at 300 tokens (docs/performance.md, 65 MB a layer: 83 counted)
# and dim 256. With --recompute a layer holds 2 copies of its fp32 input and its graph (4.2 MiB measured at 512, 2,048
# and 8,192 tokens)
ACTIVATION_WIDTHS = {"fp32": {"dim": 8, "q": 2, "kv": 2, "ffn": 2.5}, "bf16": {"dim": 6, "q": 2, "kv": 2, "ffn": 1.5}}
INPUTS_KEPT, LAYER_GRAPH_BYTES = 2, 4 << 20


def available_memory() -> int:
    """Bytes this run can still place its tensors in: on a GPU run its GPU's free memory (gpu_free_memory), else
    the machine's (MemAvailable; free pages where /proc/meminfo is missing)."""
    free = gpu_free_memory() if on_gpu() else None
    if free is not None:
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def on_gpu() -> bool:
    """Whether this run's tensors live on a GPU (Jittor's use_cuda)."""
    return bool(jt.flags.use_cuda)


def gpu_free_memory():
    """The free memory of the GPU this process runs on, after Jittor has given back what its allocator kept
    (cudaMemGetInfo, called in the CUDA runtime Jittor loaded); None, with a warning, where it cannot be read."""
    jt.gc()
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    try:
        runtime = ctypes.CDLL(os.path.join(jt.compiler.cuda_lib, "libcudart.so"))
        status = runtime.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total))
    except (AttributeError, OSError) as e:
        status = e
    if status != 0:
        print(f"warning: the GPU's free memory could not be read (cudaMemGetInfo: {status}); the memory checks count "
              "the host's", file=sys.stderr)
        return None
    return free.value


def ranks_sharing_memory() -> int:
    """The MPI ranks sharing the memory available_memory reads (1 outside mpirun): this host's, or on a GPU run
    those of this host's ranks that Jittor places on one GPU (rank i on GPU i modulo the GPUs)."""
    ranks = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))
    if on_gpu():
        return -(-ranks // max(1, jt.core.get_device_count()))
    return ranks


def base_bytes(args) -> int:
    """The frozen base as loaded: its matrices in the base's precision (2 bytes in bf16, 4 in fp32; in int8 1
    and an fp32 scale per row, in nf4 half a byte and a bf16 scale per 64 weights, the embedding table 2 in
    both), its vectors (the norms) in fp32; one layer counted
    and multiplied, so no table of n_layers entries is built."""
    def matrix(name, shape):
        if args.precision == "int8" and name != "tok_embeddings.weight":
            return math.prod(shape) + 4 * shape[0]
        if args.precision == "nf4" and name != "tok_embeddings.weight":  # the codes' bytes, a bf16 scale per group
            codes, scales = nf4_shapes(*shape)
            return math.prod(codes) + 2 * math.prod(scales)
        return math.prod(shape) * (4 if args.precision == "fp32" else 2)

    def size(shapes):
        return sum(matrix(name, shape) if len(shape) == 2 else 4 * math.prod(shape) for name, shape in shapes.items())
    return size(args.outer_shapes()) + args.n_layers * size(args.layer_shapes())


def rope_table_bytes(args) -> int:
    """The RoPE tables of 2 * max_seq_len positions at their peak (ROPE_TABLES_AT_PEAK)."""
    return ROPE_TABLES_AT_PEAK * 2 * args.max_seq_len * (args.head_dim // 2) * 4


def linear_parameters(n_in: int, n_out: int, bias: bool = True) -> int:
    return n_in * n_out + (n_out if bias else 0)


def layer_adapter_parameters(args, layer: int) -> int:
    """The adapter parameters of one layer, as Block.Attention, FeedForward and LLM.TransformerBlock build them."""
    D, E, F, hd = args.dim, args.expert_num, args.ffn_hidden_dim, args.head_dim
    count = 0
    if layer in args.lora_layer_set:
        sides = {"Q": (D, args.n_heads * hd), "K": (D, args.n_kv_heads * hd), "V": (D, args.n_kv_heads * hd),
                 "O": (args.n_heads * hd, D), "FFN_UP": (D, F), "FFN_GATE": (D, F), "FFN_DOWN": (F, D)}
        for n_in, n_out in (sides[target] for target in args.targets):
            r = args.lora_rank
            if args.method in SPARSE_MOE_METHODS:  # E experts, a router (AdaMoLE: and a threshold)
                count += E * r * (n_in + n_out) + linear_parameters(n_in, E) + (
                    linear_parameters(n_in, 1) if args.method == "adamole" else 0)
            elif E == 1:
                count += r * (n_in + n_out)
            else:  # a bias-free router, E B's and E A's (HydraLoRA: one)
                count += linear_parameters(n_in, E, False) + (1 if args.hydra_moe else E) * r * n_in + E * r * n_out
    if layer in args.prompt_layer_set:  # E prompts, the per-head gate, a router of several
        count += E * args.prompt_len * D + args.n_heads + (linear_parameters(D, E) if E > 1 else 0)
    if layer in args.p_adapter_layer_set:
        down, up = linear_parameters(D, args.p_adapter_size), linear_parameters(args.p_adapter_size, D)
        count += down + up if E == 1 else (linear_parameters(D, E) + (1 if args.p_adapter_hydra else E) * down
                                           + E * up)
    types = len(args.type_names(layer))
    if types:
        hidden = types * args.swi_x
        count += linear_parameters(D, types) if args.swi_x == 0 else (2 * linear_parameters(D, hidden)
                                                                       + linear_parameters(hidden, types))
        if args.method == "moa" and args.variant == "sparse" and not args.const_threshold:
            count += linear_parameters(D, 1)  # Gamma
    if args.method == "unipeft":  # lora_gate; prompt_gate (the prompt's and the adapter's); p_adapter_gate
        has = (layer in args.lora_layer_set, layer in args.prompt_layer_set, layer in args.p_adapter_layer_set)
        count += linear_parameters(D, 1) * (has[0] + (has[1] or has[2]) + has[2])
    return count


def adapter_parameters(args) -> int:
    """Every adapter parameter the settings make: each kind of layer (which of LoRA, prompt and parallel adapter it
    has) counted once and multiplied, so a base of many layers is counted in a few steps."""
    kinds = Counter()
    example = {}
    for layer in args.lora_layer_set | args.prompt_layer_set | args.p_adapter_layer_set:
        kind = (layer in args.lora_layer_set, layer in args.prompt_layer_set, layer in args.p_adapter_layer_set)
        kinds[kind] += 1
        example.setdefault(kind, layer)
    return sum(n * layer_adapter_parameters(args, example[kind]) for kind, n in kinds.items())


def kv_cache_bytes(args, batch_size: int, seq_len: int) -> int:
    """The keys and values of every layer: batch * layers * 2 * kv_heads * head_dim * seq * (4, or 2 in a
    bf16 cache: ModelArgs.kv_cache 'base' with a bf16, int8 or nf4 base)."""
    element = 2 if args.precision in BF16_PRODUCTS and args.kv_cache == "base" else 4
    return batch_size * args.n_layers * 2 * args.n_kv_heads * args.head_dim * seq_len * element


def layer_activation_bytes(args, tokens: int) -> int:
    """What one layer's training forward keeps for its backward at `tokens` positions: per position, fp32 numbers
    in ACTIVATION_WIDTHS of the residual stream (dim), the queries (heads x head_dim), the keys and values (kv heads
    x head_dim) and the FFN (ffn_dim), fewer where the base's products take bf16."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    widths = ACTIVATION_WIDTHS["bf16" if args.precision in BF16_PRODUCTS else "fp32"]
    return round(4 * tokens * (widths["dim"] * args.dim + widths["q"] * q + widths["kv"] * kv
                               + widths["ffn"] * args.ffn_hidden_dim))


def loss_bytes(args, tokens: int) -> int:
    """The loss's logits and their gradient at their peak: LAZY_CHUNKS chunks of LOGIT_BYTES, or all of them."""
    return 2 * min(LAZY_CHUNKS * LOGIT_BYTES, 4 * tokens * args.vocab_size)


def activation_bytes(args, batch_size: int, seq_len: int, recompute: bool) -> int:
    """A training step's activations for batch_size rows of seq_len tokens: every layer's (layer_activation_bytes)
    or, with `recompute`, INPUTS_KEPT copies of each layer's fp32 input [B,T,D] and one layer's; each layer's graph;
    and the loss's."""
    tokens = batch_size * seq_len
    one = layer_activation_bytes(args, tokens)
    kept = args.n_layers * INPUTS_KEPT * 4 * tokens * args.dim if recompute else (args.n_layers - 1) * one
    return kept + one + args.n_layers * LAYER_GRAPH_BYTES + loss_bytes(args, tokens)


def memory_parts(args, batch_size: int = 0, seq_len: int = 0, training: bool = False) -> list:
    """(what, bytes, what lowers it) of each part check_memory counts."""
    smaller = {"fp32": "use --precision bf16, int8 or nf4, or ", "bf16": "use --precision int8 or nf4, or ",
               "int8": "use --precision nf4, or "}.get(args.precision, "")
    parts = [(f"base weights in {args.precision}", base_bytes(args), smaller),
             (f"RoPE tables for max_seq_len {args.max_seq_len}", rope_table_bytes(args), "lower --max_seq_len, or ")]
    adapters = adapter_parameters(args)
    if adapters:
        parts.append((f"{adapters:,} adapter parameters{' with their gradients and AdamW moments' if training else ''}",
                      4 * (TRAINING_COPIES if training else 1) * adapters, "lower the adapters' sizes (--lora_rank, "
                      "--expert_num, --prompt_len, --p_adapter_size, --swi_x), or "))
    if batch_size and training:
        kept = "each layer's input and one layer's (--recompute)" if args.recompute else "every layer's"
        parts.append((f"the activations of {batch_size} rows x {seq_len} tokens a rank ({kept})",
                      activation_bytes(args, batch_size, seq_len, args.recompute),
                      ("" if args.recompute else "use --recompute, or ") + "lower --batch_size or --max_seq_len, or "))
    elif batch_size:
        parts.append((f"the KV cache for --batch_size {batch_size} x {seq_len} tokens ({args.n_layers} layers, "
                      f"{args.n_kv_heads} kv heads of {args.head_dim})", kv_cache_bytes(args, batch_size, seq_len),
                      "lower --batch_size or the sequence length (--max_seq_len; Infer.py: --max_gen_len), or "))
    return parts


def needs_recompute(args, batch_size: int, seq_len: int, available=None) -> bool:
    """Whether a training step of batch_size rows of seq_len tokens would not fit with every layer's activations
    kept (--recompute's default)."""
    stored = memory_parts(replace(args, recompute=False), batch_size, seq_len, training=True)
    return sum(size for _, size, _ in stored) * ranks_sharing_memory() > (
        available_memory() if available is None else available)


def check_memory(args, source: str, batch_size: int = 0, seq_len: int = 0, available=None, training: bool = False):
    """Refuse a model larger than the memory left (all the ranks sharing it together) before any of it is
    allocated: its base, RoPE tables and adapters (`training`: with their gradients and AdamW's moments), and
    with `batch_size` the KV cache of batch_size rows of seq_len tokens or, in `training`, a step's activations
    (per rank). `source` names what set the sizes (the base's settings file, or the flags); the message names each
    part, the base in the run's own precision, and what lowers the largest."""
    parts = memory_parts(args, batch_size, seq_len, training)
    ranks = ranks_sharing_memory()
    need = sum(size for _, size, _ in parts) * ranks
    available = available_memory() if available is None else available
    if need > available:
        detail = ", ".join(f"{what} {gib(size)}" for what, size, _ in parts)
        remedy = max(parts, key=lambda part: part[1])[2]
        raise ValueError(f"{source}: the model needs {gib(need)} ({detail}{f', {ranks} ranks' if ranks > 1 else ''})"
                         f", more than the {gib(available)} available{' on the GPU' if on_gpu() else ''}: {remedy}"
                         "use a machine that holds this model")


def gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.3g} GiB"
