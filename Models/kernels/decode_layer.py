"""A decode step's layer in two ops: the layer's input side (routing, Q/K/V, RoPE) and its
output side (attention over the cache and the prompt, O, the FFN, the parallel adapter).

A decode step has at most DECODE_ROWS rows, so a layer's cost is its ops, not their arithmetic:
built op by op it is about 25 ops, each a few microseconds of Python and of Jittor's executor, and on a
GPU a few kernel launches each. Here it is three: these two, and the cache write between them. On
a CPU the two ops are cpp/layer_input.cc and cpp/layer_output.cc: each projection is experts_project
(cpp/lora_project.h: a GEMV pass over the base's weights and its LoRA experts under their type weight) and
the routing is cpp/route_row.cc, as in the per-op decode kernels, so the numbers are those of the op-by-op
layer. On a GPU (switch.gpu_kernels_on) the same two ops (the same inputs and declarations) run
cuda/layer_input.cu and cuda/layer_output.cu, which launch cuda/decode_layer.cuh's kernels: one pass over
each base matrix for all the rows, the experts added in it (cuda/products.cuh), the bf16 KV cache read in
place. A Qwen3 layer norms each query and key head (q_norm, k_norm) between the projections and RoPE; its
prompt expert's keys come normed from Attention.prompt_keys_values. The layers are MoA's and the baselines':
one expert per family (LoRA, weight 1; instance and UniPEFT, gates decided on the prefill, given to the ops),
or mixtures: of LoRA experts on the projections (MoLoRA, HydraLoRA, top-k, AdaMoLE), each projection's gates
computed in its op from its input (cpp/lora_experts.h: each expert's A, B and the router as they are,
LoraExperts); of prompt experts (one softmax over all their rows, each expert's rows weighted by its share
of the row, the shares from the input side); of parallel adapters (AdapterExperts, their shares in the output
side): MoA with expert_num > 1, and the prompt and adapter MoE. The op-by-op layer is the plain side of the
Kernel (LLM.layer_step, `when` = fuses_decode_step) and serves everything else: training, scoring, and a
mixture whose routers' outputs are recorded (Infer.py --save_weights).
"""
import math
from dataclasses import dataclass
from typing import Optional

import Utils.jittor_env  # noqa: F401
import jittor as jt

from . import cpp
from .precision import STORAGES, matrix_code
from .routing import declare_router
from .switch import decoding

LAYER_HEADER = cpp.source("decode_layer.h")
LAYER_INPUT = cpp.source("layer_input.cc")
LAYER_OUTPUT = cpp.source("layer_output.cc")
GPU_LAYER_HEADER = cpp.source("decode_layer.cuh")
GPU_LAYER_INPUT = cpp.source("layer_input.cu")
GPU_LAYER_OUTPUT = cpp.source("layer_output.cu")


def declare_columns(inputs: cpp.CodeInputs, block, families: dict):
    """COL_<name> = the column of each family's weight in the layer's router (-1: not weighted, weight 1)."""
    columns = block.family_columns()
    inputs.declare(**{f"COL_{name}": columns.get(f, -1) for name, f in families.items()})


MAX_EXPERTS = cpp.constant("lora_experts.h", "MAX_EXPERTS")


@dataclass(frozen=True)
class LoraExperts:
    """A projection's LoRA experts as the decode layer takes them (cpp/lora_experts.h's struct of that name):
    one (mixing SINGLE), or E mixed per row by their router. A: E matrices [r,in], or one that every B reads
    (HydraLoRA); B: E matrices [out,r]."""
    A: list
    B: list
    scale: float  # alpha / r
    mixing: str = "SINGLE"  # or SOFTMAX (MoLoRA, HydraLoRA), TOP_K, THRESHOLD (AdaMoLE)
    router_w: Optional[jt.Var] = None  # [E,in]
    router_b: Optional[jt.Var] = None  # [E]
    threshold_w: Optional[jt.Var] = None  # [1,in]
    threshold_b: Optional[jt.Var] = None  # [1]
    top_k: int = 0


@dataclass(frozen=True)
class AdapterExperts:
    """The parallel adapter's experts as the decode layer takes them (cpp/layer_output.cc's PA_ names): one, or E
    mixed per row by a softmax router; each up(silu(down(x) + b) + b), one down projection for every up when
    down has one (p_adapter_hydra)."""
    down_w: list  # [P,D] each
    down_b: list  # [P]
    up_w: list  # E of [D,P]
    up_b: list  # [D]
    router_w: Optional[jt.Var] = None  # [E,D], a mixture's
    router_b: Optional[jt.Var] = None  # [E]


def floats(inputs: cpp.CodeInputs, var) -> str:
    """var as the op's `const float *` (None: nullptr)."""
    return "nullptr" if var is None else f"(const float *){inputs.pointer(var)}"


def float_array(inputs: cpp.CodeInputs, variables: list) -> str:
    """A C++ initializer of `const float *`s, one per var ({nullptr} for none: C++ has no empty arrays)."""
    return "{" + ", ".join(floats(inputs, var) for var in variables or [None]) + "}"


def declare_experts(inputs: cpp.CodeInputs, target: str, lora):
    """LORA_<target>: the LoraExperts of `lora` (its decode_experts()), or none when lora is None."""
    if lora is None:
        inputs.code += f"const LoraExperts LORA_{target} = {{0, 0, 1, 1.f, {{}}, {{}}, SINGLE}};\n"
        return
    ex, numbers = lora.decode_experts(), inputs.numbers
    fields = ([numbers.value(f"E_{target}", len(ex.B)), numbers.value(f"NA_{target}", len(ex.A)),
               numbers.value(f"R_{target}", ex.B[0].shape[1]), numbers.value(f"SCALE_{target}", ex.scale, "float"),
               float_array(inputs, ex.A), float_array(inputs, ex.B), ex.mixing]
              + [floats(inputs, v) for v in (ex.router_w, ex.router_b, ex.threshold_w, ex.threshold_b)]
              + [numbers.value(f"TOP_K_{target}", ex.top_k)])
    inputs.code += f"const LoraExperts LORA_{target} = {{{', '.join(fields)}}};\n"


def declare_adapters(inputs: cpp.CodeInputs, adapter):
    """PA_*: the AdapterExperts of `adapter` (its decode_experts()): PA_E experts (0: no adapter), PA_ND down
    projections, P wide."""
    ex = adapter.decode_experts() if adapter is not None else AdapterExperts([], [], [], [])
    inputs.code += "".join(f"const float *PA_{name.upper()}[] = {float_array(inputs, getattr(ex, name))};\n"
                           for name in ("down_w", "down_b", "up_w", "up_b"))
    inputs.add("PA_ROUTER_W", ex.router_w)
    inputs.add("PA_ROUTER_B", ex.router_b)
    inputs.declare(PA_E=len(ex.up_w), PA_ND=len(ex.down_w), P=ex.down_w[0].shape[0] if ex.down_w else 0)


def fuses_decode_step(block, x: jt.Var, cos, sin, mask, start_pos, record, aux) -> bool:
    """A decode step (KV cache, no gradient, few rows) of a layer with one expert per family (MoA, and the
    baselines LoRA, instance and UniPEFT, their gates given per sequence), or with mixtures of experts (MoA's
    with expert_num > 1, MoLoRA, HydraLoRA, top-k, AdaMoLE, prompt and adapter MoE) when nothing asks for
    their routers' records or load-balancing terms; on a GPU not over an nf4 base (its plain path serves it)."""
    E = block.attention.expert_num
    takes = E == 1 or (E <= MAX_EXPERTS and record is None and aux is None)
    weight = block.attention.wq.weight
    nf4_on_gpu = jt.flags.use_cuda and weight.dtype == "uint8"  # the CUDA form has no nf4 products (cuda/products.cuh)
    return start_pos is not None and takes and not nf4_on_gpu and decoding(x, weight)


def declare_matrix(inputs: cpp.CodeInputs, name: str, base):
    """`name` as the C++ BaseMatrix of the base projection `base` (a BaseLinear), and its storage as the
    constant <name>_STORAGE (the CUDA form's products are templates on it: an op compiles one storage's)."""
    inputs.code += (f"const BaseMatrix {name} = {matrix_code(inputs, base.weight, base.weight_scale)};\n"
                    f"[[maybe_unused]] constexpr Storage {name}_STORAGE = {STORAGES[str(base.weight.dtype)]};\n")


@dataclass(frozen=True)
class StepOp:
    """One of the decode layer's two ops as built for a KV cache's life (the weights, and the prompt's keys and
    values, are fixed while it lives: Block.Attention.prompt_keys_values): its text, the block's tensors, its
    numbers and its outputs' shapes and types. A step gives its own tensors (in0_p... ahead of the block's) and
    sizes: rebuilding the text at every step of every layer was a sixth to a quarter of a small model's decoding
    (docs/performance.md), and on a GPU it would be host time between launches."""
    cpu_header: str  # each text as cpp.included gives it
    cpu_src: str
    cuda_header: str
    cuda_src: str
    fixed: list  # the block's tensors, after the step's
    data: dict  # the block's numbers; a step's sizes are written over theirs
    names: tuple  # the outputs' names, in order (out0_p...)
    dims: tuple  # each output's shape as (leading dims, trailing dims) around the step's rows [B,T]
    dtypes: list

    def __call__(self, step: list, rows: tuple, **sizes) -> dict:
        """The outputs by name for the step's tensors `step`, its rows (B, T) and sizes."""
        self.data.update(sizes)
        values = jt.code([(*lead, *rows, *trail) for lead, trail in self.dims], self.dtypes, step + self.fixed,
                         cpu_header=self.cpu_header, cpu_src=self.cpu_src, cuda_header=self.cuda_header,
                         cuda_src=self.cuda_src, data=self.data)
        return dict(zip(self.names, values))


def new_step_op(inputs: cpp.CodeInputs, cpu_body: str, cuda_body: str, outputs: tuple, n_step: int) -> StepOp:
    """The StepOp of `inputs` (the step's n_step tensors first) running cpu_body or cuda_body after their
    declarations; `outputs`: (name, leading dims, trailing dims, dtype) of each, its shape [*leading, B, T,
    *trailing] (the C++ reads each as rows M = B*T of its own)."""
    texts = [inputs.header(LAYER_HEADER), inputs.code + cpu_body, GPU_LAYER_HEADER, inputs.code + cuda_body]
    names, leads, trails, dtypes = zip(*outputs)
    return StepOp(*map(cpp.included, texts), inputs.vars[n_step:], dict(inputs.numbers.data), names,
                  tuple(zip(leads, trails)), list(dtypes))


def step_op(block, key: str, build, *args) -> StepOp:
    """The block's StepOp of `key` ("input", "output"), built by build(block, *args) at the first step after the
    cache was reset."""
    ops = block.decode_ops
    if key not in ops:
        ops[key] = build(block, *args)
    return ops[key]


def input_op(block, step: list, M: int, T: int) -> StepOp:
    """The input side for the step's tensors x [M,D], cos, sin and, routed per sequence, gates [M,NW]."""
    attn, D = block.attention, block.attention_norm.weight.shape[0]
    H, Hkv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    gates = step[3] if len(step) > 3 else None
    inputs = cpp.CodeInputs()
    for name, var in zip(("x", "COS", "SIN", "GATES"), step + [gates]):
        inputs.add(name, var)
    inputs.add("ATTENTION_NORM", block.attention_norm.weight)
    routed = gates is None
    n_types = declare_router(inputs, block.adapter_type_router if routed else None,
                             block.adapter_threshold_fn if routed else None, D)
    for name, base in (("WQ", attn.wq), ("WK", attn.wk), ("WV", attn.wv)):
        declare_matrix(inputs, name, base)
    for target, lora in (("Q", attn.lora_Q), ("K", attn.lora_K), ("V", attn.lora_V)):
        declare_experts(inputs, target, lora)
    inputs.add("Q_NORM", None if attn.q_norm is None else attn.q_norm.weight)
    inputs.add("K_NORM", None if attn.k_norm is None else attn.k_norm.weight)
    prompt_router = getattr(attn, "prompt_router", None)  # a mixture of prompt experts' [E,D]
    inputs.add("PROMPT_ROUTER_W", None if prompt_router is None else prompt_router.weight)
    inputs.add("PROMPT_ROUTER_B", None if prompt_router is None else prompt_router.bias)
    n_prompts = 0 if prompt_router is None else prompt_router.weight.shape[0]
    sparse = routed and block.adapter_threshold_fn is not None
    inputs.declare(M=M, T=T, H=H, Hkv=Hkv, hd=hd, NW=n_types if routed else gates.shape[1], PROMPT_E=n_prompts)
    inputs.declare("float", eps=block.attention_norm.eps,
                   head_eps=attn.q_norm.eps if attn.q_norm is not None else 0.0)
    declare_columns(inputs, block, dict(Q="Q", K="K", V="V"))
    # the keys and values [2,M,Hkv*hd] in the cache's type (bf16 bits: rounded in the op, no rounding op a layer
    # before the cache write), as the cache holds them: one write a step
    kv = attn.cache_dtype()
    inputs.declare("bool", KV_BITS=kv == "bfloat16")
    outputs = [("q", (), (H * hd,), "float32"), ("kv", (2,), (Hkv, hd), kv),  # out0_p, out1_p, out2_p...
               ("probs", (), (max(n_types, 1),), "float32")]
    outputs += [("gamma", (), (1,), "float32")] * sparse
    outputs += [("prompt_mix", (), (n_prompts,), "float32")] * bool(n_prompts)
    names = [name for name, *_ in outputs]
    out = lambda name: f"out{names.index(name)}_p" if name in names else "nullptr"
    inputs.code += f"float *PROBS = out2_p, *GAMMAS = {out('gamma')}, *PROMPT_MIX = {out('prompt_mix')};\n"
    inputs.code += f"const float *WEIGHTS = {'PROBS' if routed else 'GATES'};\n"
    return new_step_op(inputs, LAYER_INPUT, GPU_LAYER_INPUT, tuple(outputs), len(step))


def layer_input(block, x, cos, sin, gates=None) -> dict:
    """gates [M,NC]: the families' weights given (instance-level routing), else the type router's per token."""
    # x [B,T,D] -> q [B,T,H*hd], kv [2,B,T,Hkv,hd] (the cache's type), probs [B,T,NT] (the type router's; absent
    # when gates are given), gamma [B,T,1] (Sparse), prompt_mix [B,T,E] (a prompt mixture's shares); M = B*T
    B, T, _ = x.shape
    step = [x.float32(), cos, sin] + ([] if gates is None else [gates])
    return step_op(block, "input", input_op, step, B * T, T)(step, (B, T), M=B * T, T=T)


def output_op(block, step: list, M: int, T: int, S: int, start_pos) -> StepOp:
    """The output side for the step's tensors x [M,D], q, the cache, mask, probs and a prompt mixture's shares."""
    attn, ffn, D = block.attention, block.feed_forward, block.ffn_norm.weight.shape[0]
    H, Hkv, hd = attn.n_heads, attn.n_kv_heads, attn.head_dim
    prompt_mix = step[5] if len(step) > 5 else None
    inputs = cpp.CodeInputs()
    cache_type = "const uint16_t *" if step[2].dtype == "bfloat16" else "const float *"
    for name, var in zip(("x", "q", "cache_k", "mask", "probs", "PROMPT_MIX"), step + [prompt_mix]):
        inputs.add(name, var, cache_type if name == "cache_k" else "const float *")
    L = 0
    if attn.has_prompt:
        prompt_k, prompt_v = attn.prompt_keys_values(start_pos)
        L = prompt_k.shape[0]
        inputs.add("PROMPT_K", prompt_k)
        inputs.add("PROMPT_V", prompt_v)
        inputs.add("PROMPT_GATE", attn.prompt_gate.reshape(H))
    else:
        inputs.code += "const float *PROMPT_K = nullptr, *PROMPT_V = nullptr, *PROMPT_GATE = nullptr;\n"
    declare_matrix(inputs, "WO", attn.wo)
    declare_experts(inputs, "O", attn.lora_O)
    inputs.add("FFN_NORM", block.ffn_norm.weight)
    for name, base in (("W1", ffn.w1), ("W3", ffn.w3), ("W2", ffn.w2)):
        declare_matrix(inputs, name, base)
    for target, lora in (("GATE", ffn.lora_GATE), ("UP", ffn.lora_UP), ("DOWN", ffn.lora_DOWN)):
        declare_experts(inputs, target, lora)
    declare_adapters(inputs, block.p_adapter)
    inputs.declare(M=M, T=T, S=S, D=D, H=H, Hkv=Hkv, hd=hd, n_rep=H // Hkv, L=L, F=ffn.w1.weight.shape[0],
                   NT=step[4].shape[-1], PROMPT_E=1 if prompt_mix is None else prompt_mix.shape[-1])
    inputs.code += f"{cache_type}cache_v = cache_k + M / T * S * Hkv * hd;  // the cache [2,B,S,Hkv,hd]\n"
    inputs.declare("float", eps=block.ffn_norm.eps, scale=1.0 / math.sqrt(hd), CLAMP_LIMIT=block.clamp or 0.0)
    inputs.declare("bool", CLAMP=block.clamp is not None)
    declare_columns(inputs, block, dict(PROMPT="PROMPT", O="O", GATE="FFN_GATE", UP="FFN_UP", DOWN="FFN_DOWN",
                                        PADAPTER="PADAPTER"))
    return new_step_op(inputs, LAYER_OUTPUT, GPU_LAYER_OUTPUT, (("out", (), (D,), "float32"),), len(step))


def layer_output(block, x, q, cache, mask, probs, prompt_mix, start_pos):
    # x [B,T,D], q [B,T,H*hd], cache [2,B,S,Hkv,hd] (keys, values), mask [T,S], probs [B,T,NT] or [M,NT] (the
    # families' weights), prompt_mix [B,T,E] (a prompt mixture's shares) or None -> [B,T,D]
    B, T, _ = x.shape
    S = cache.shape[2]
    step = [x.float32(), q, cache, mask, probs] + ([] if prompt_mix is None else [prompt_mix])
    op = step_op(block, "output", output_op, step, B * T, T, S, start_pos)
    return op(step, (B, T), M=B * T, T=T, S=S)["out"]


def decode_layer(block, x, cos, sin, mask, start_pos, record, aux):
    """block(x) for one decode step through the KV cache, in two ops and the cache write between them (aux: unused,
    a mixture is taken only when no load-balancing term is asked for)."""
    # x [B,T,D] -> [B,T,D]
    B, T, _ = x.shape
    gates = block.sequence_gates(x, start_pos, record).float32().reshape(B * T, -1) if block.routes_sequences else None
    side = layer_input(block, x, cos, sin, gates)
    probs, gamma, prompt_mix = side["probs"] if gates is None else gates, side.get("gamma"), side.get("prompt_mix")
    if record is not None and gates is None and block.type_names:
        record.update(type_weight=probs, threshold=gamma)
    cache = block.attention.write_cache(side["kv"], start_pos)
    return layer_output(block, x, side["q"], cache, mask, probs, prompt_mix, start_pos)

