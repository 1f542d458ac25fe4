"""The one configuration dataclass: the base's shape (Meta's params.json, or a Hugging Face config.json
read by Models/formats/hf.py) plus the PEFT/MoA fields."""
import os
from dataclasses import asdict, dataclass
from typing import Optional

from Utils.file_io import read_json_object
from Utils.settings import check_fields, check_values, checked_field, setting

LORA_TARGETS = ("Q", "K", "V", "O", "FFN_UP", "FFN_GATE", "FFN_DOWN")
# The router's column order is fixed by the authors' code, whatever order lora_targets lists.
TYPE_ORDER = ("Q", "K", "V", "PROMPT", "O", "FFN_UP", "FFN_GATE", "FFN_DOWN", "PADAPTER")
VARIANTS = ("soft", "sparse")
# moa: the heterogeneous type router (Soft or Sparse, `variant`); the paper's baselines, each the
# authors' folder of that name: moe = LLaMA3_soft_moe (LoRA, MoLoRA, HydraLoRA, prompt/adapter MoE:
# families simply added), topk / adamole = LLaMA3_sparse_moe, instance = LLaMA3_soft_moa_instance,
# unipeft = LLaMA3_UniPEFT. docs/baselines.md says what each computes.
METHODS = ("moa", "moe", "topk", "adamole", "instance", "unipeft")
SPARSE_MOE_METHODS = ("topk", "adamole")
INSTANCE_METHODS = ("instance", "unipeft")  # routed once per sequence, from its mean
GAMMA_GRADS = ("authors", "ste")
PRECISIONS = ("bf16", "fp32", "int8", "nf4")
BF16_PRODUCTS = ("bf16", "int8", "nf4")  # the precisions whose base products (and attention's) take bf16 operands
KV_CACHE_PRECISIONS = ("base", "fp32")
PRECISION_HELP = ("storage of the frozen base's matrices. bf16 halves the base's memory (what an 8B model needs), "
                  "runs on the CPU's bf16 units (avx512_bf16/AMX) or the GPU's half matmul, and loses nothing on "
                  "Meta's bf16 checkpoints; int8 stores the projections and the output matrix as int8 with a scale "
                  "per row, quantized as the checkpoint loads (a quarter of fp32: what a 14B model needs), the "
                  "embedding in bf16; nf4 stores them as QLoRA's 4-bit NormalFloat with a bf16 scale per 64 weights "
                  "(4.25 bits a weight: what a 32B model needs), the embedding in bf16; fp32 gives the authors' fp32 numbers. Adapters, routers, norms, softmax, loss "
                  "and optimizer are fp32 either way; in bf16, int8 and nf4 the base's products and, in training and "
                  "prefill, attention's take bf16 operands with fp32 sums, as autocast does")
META_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of",
               "ffn_dim_multiplier", "norm_eps", "rope_theta", "use_scaled_rope")
# What a base decides beyond Meta's params.json (a Hugging Face config.json sets them; Meta's bases
# keep the defaults). An adapter records them all and loads onto the same values only.
BASE_FIELDS = ("architecture",) + META_FIELDS + ("head_dim", "ffn_dim", "qk_norm", "tied_embeddings",
                                                "rope_scale_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                                                "rope_original_context")
ARCHITECTURES = ("llama", "qwen3")
SPANS = "half-open spans: '0-2' is layers 0 and 1, '0-8,24-32' sixteen layers, 'all' every one, '0-0' none"


def _sparse_moa(a) -> bool:
    return a.method == "moa" and a.variant == "sparse"


def _any_experts(a) -> bool:
    return bool(a.lora_layer_set or a.prompt_layer_set or a.p_adapter_layer_set)


_NO_THRESHOLD = "only Sparse MoA (--method moa --variant sparse) has a threshold"
_NO_LORA, _NO_ADAPTER = "no layer has LoRA (--lora_layers)", "no layer has a parallel adapter (--p_adapter_layers)"
# Settings that do nothing under the others' values: (setting, whether it does nothing in a model, why); the first
# row that holds names the reason. A flag given for one of them is refused (Math.py, Infer.py): it would pass
# silently. A recipe's own values are not checked, and Compare.py passes a flag after `--` only to the methods it
# does something in.
IDLE_SETTINGS = (
    ("max_threshold", lambda a: not _sparse_moa(a), _NO_THRESHOLD),
    ("const_threshold", lambda a: not _sparse_moa(a), _NO_THRESHOLD),
    ("gamma_grad", lambda a: not _sparse_moa(a), _NO_THRESHOLD),
    ("top_k", lambda a: a.method != "topk", "only --method topk keeps the top k experts"),
    ("lb_loss_coeff", lambda a: a.method not in SPARSE_MOE_METHODS,
     "only --method topk and adamole add a load-balancing loss"),
    ("expert_num", lambda a: not _any_experts(a), "no layer has experts"),
    ("lora_rank", lambda a: not a.lora_layer_set, _NO_LORA),
    ("lora_alpha", lambda a: not a.lora_layer_set, _NO_LORA),
    ("lora_targets", lambda a: not a.lora_layer_set, _NO_LORA),
    ("hydra_moe", lambda a: not a.lora_layer_set, _NO_LORA),
    ("hydra_moe", lambda a: a.expert_num == 1, "one LoRA expert (--expert_num 1) has no A to share"),
    ("hydra_moe", lambda a: a.method in SPARSE_MOE_METHODS,
     "the experts of --method topk and adamole keep their own A"),
    ("prompt_len", lambda a: not a.prompt_layer_set, "no layer has prompt tuning (--prompt_layers)"),
    ("p_adapter_size", lambda a: not a.p_adapter_layer_set, _NO_ADAPTER),
    ("p_adapter_hydra", lambda a: not a.p_adapter_layer_set, _NO_ADAPTER),
    ("p_adapter_hydra", lambda a: a.expert_num == 1,
     "one parallel adapter (--expert_num 1) has no down projection to share"),
    ("swi_x", lambda a: a.method not in ("moa", "instance") or not _any_experts(a),
     "no layer has a type router (--method moa or instance, with experts)"),
)


def idle_settings(args) -> dict:
    """{setting: why it does nothing} in the model `args` describes (IDLE_SETTINGS)."""
    idle = {}
    for name, does_nothing, why in IDLE_SETTINGS:
        if name not in idle and does_nothing(args):
            idle[name] = why
    return idle


def check_flags_do_something(args, flags: dict):
    """Refuse the first of the settings `flags` ({name: value} the user gave) that does nothing in the model `args`."""
    idle = idle_settings(args)
    for name, value in flags.items():
        if name in idle:
            flag = f"--{'' if value else 'no-'}{name}" if isinstance(value, bool) else f"--{name} {value}"
            raise ValueError(f"{flag} does nothing here: {idle[name]}; leave it out")


def parse_layer_span(spec: str, n_layers: int, field: str = "layers") -> frozenset:
    """'0-8,24-32' -> {0..7, 24..31}; spans are half-open, '0-0' means none, 'all' every layer."""
    if str(spec).strip() == "all":
        return frozenset(range(n_layers))
    layers = set()
    for part in str(spec).replace(" ", "").split(","):
        if not part:
            continue
        bounds = part.split("-")
        if len(bounds) != 2 or not all(b.isdigit() for b in bounds):
            raise ValueError(f"{field}={spec!r}: '{part}' is not a span 'start-end' of two integers")
        start, end = map(int, bounds)
        if start > end:
            raise ValueError(f"{field}={spec!r}: span '{part}' ends before it starts")
        if end > n_layers:
            raise ValueError(f"{field}={spec!r}: span '{part}' reaches past the model's {n_layers} layers")
        layers.update(range(start, end))
    return frozenset(layers)


@dataclass
class ModelArgs:
    # Meta's params.json
    dim: int = checked_field(4096, at_least=1)
    n_layers: int = checked_field(32, at_least=1)
    n_heads: int = checked_field(32, at_least=1)
    n_kv_heads: Optional[int] = checked_field(None, at_least=1)
    vocab_size: int = checked_field(128256, at_least=1)
    multiple_of: int = checked_field(256, at_least=1)
    ffn_dim_multiplier: Optional[float] = checked_field(None, above=0)
    norm_eps: float = checked_field(1e-5, above=0, at_most=1)
    rope_theta: float = checked_field(500000.0, above=0)
    use_scaled_rope: bool = False  # LLaMA-3.1's RoPE scaling, with the four rope_* parameters below
    # the rest of the base's shape (Hugging Face config.json; Meta's bases keep these defaults)
    architecture: str = "llama"  # llama (Meta's layout or HF LlamaForCausalLM) or qwen3 (Qwen3ForCausalLM)
    head_dim: Optional[int] = checked_field(None, at_least=1)  # one attention head's width; None: dim // n_heads
    ffn_dim: Optional[int] = checked_field(None, at_least=1)  # the FFN's hidden width (HF intermediate_size);
    # None: Meta's rule from dim, multiple_of and ffn_dim_multiplier (ffn_hidden_dim)
    qk_norm: bool = False  # an RMSNorm over each query and key head before RoPE (Qwen3's q_norm, k_norm)
    tied_embeddings: bool = False  # the output matrix is the embedding table (LLaMA-3.2 1B/3B, Qwen3 up to 4B)
    rope_scale_factor: float = checked_field(8.0, above=0)  # scaled RoPE: wavelengths above original_context /
    rope_low_freq_factor: float = checked_field(1.0, above=0)  # low_freq_factor are divided by the factor, those
    rope_high_freq_factor: float = checked_field(4.0, above=0)  # below original_context / high_freq_factor kept,
    rope_original_context: int = checked_field(8192, at_least=1)  # the ones between blended (LLaMA-3.1's values)
    # runtime
    max_batch_size: int = checked_field(32, at_least=1)
    max_seq_len: int = setting(2048, "tokens per sequence: training examples are cut to it; the KV cache holds it",
                               at_least=1)
    # fp32 by default: it matches the authors' fp32 outputs to 1e-6, and on a CPU without bf16 units
    # bf16 trains slower (the weights are widened for every product). Where the CPU has bf16 units
    # bf16 is faster; the paper's recipes (LLaMA-3.1-8B) choose it, as the authors' bf16=True does:
    # their base does not fit a 24 GB machine in fp32. Models/kernels/precision.py does the work.
    precision: str = setting("fp32", PRECISION_HELP, PRECISIONS)
    kv_cache: str = setting("base", "precision of the KV cache's keys and values: 'base' stores them as the base's "
                                    "products take them (bf16 with --precision bf16 or int8: half the cache's memory "
                                    "and of what each decode step reads), 'fp32' in fp32 whatever the base",
                            KV_CACHE_PRECISIONS, resumable=True)
    recompute: Optional[bool] = setting(None, "training: each layer keeps only its input for the backward, which "
                                              "runs the layer's forward again to rebuild its activations (a step's "
                                              "activations cut to one layer's, the same gradients; the forward, "
                                              "about half a frozen base's step, runs twice). Default: on where the "
                                              "memory check finds the step would not fit with every layer's "
                                              "activations kept, off otherwise", resumable=True)
    method: str = setting("moa", "the mixture: moa (the heterogeneous type router, see --variant), or a baseline: "
                                 "moe (LoRA / MoLoRA / HydraLoRA / prompt and adapter MoE, by --expert_num and "
                                 "--hydra_moe), topk (sparse MoE-LoRA), adamole (threshold MoE-LoRA), instance "
                                 "(Soft MoA routed per sequence), unipeft (one gate per family per sequence)",
                          METHODS)
    # MoA: experts (layer spans are half-open, e.g. '0-32' or '0-8,24-32'; 'all' = every layer, '0-0' = none)
    variant: str = setting("sparse", "method moa: Soft MoA (every expert, sigmoid-weighted) or Sparse MoA (a learned "
                                     "per-token threshold switches experts off)", VARIANTS)
    lora_layers: str = setting("0-0", f"the layers with LoRA experts, {SPANS}")
    lora_rank: int = setting(8, "LoRA rank r", at_least=1)
    lora_targets: str = setting("Q,K,V,O,FFN_DOWN",
                                f"comma list of distinct LoRA targets from {','.join(LORA_TARGETS)}")
    lora_alpha: float = setting(8.0, "LoRA scaling numerator (scale = alpha / r)", above=0)
    expert_num: int = setting(1, "experts per LoRA target, prompt and parallel adapter (MoE-LoRA when > 1)",
                              at_least=1)
    hydra_moe: bool = setting(False, "the LoRA experts share one A (HydraLoRA)")
    p_adapter_layers: str = setting("0-0", f"the layers with the parallel adapter, {SPANS}")
    p_adapter_size: int = setting(16, "parallel adapter bottleneck width", at_least=1)
    p_adapter_hydra: bool = setting(False, "the parallel adapter's experts share one down projection")
    prompt_layers: str = setting("0-0", f"the layers with prompt tuning (Soft MoA only), {SPANS}")
    prompt_len: int = setting(10, "prompt tokens per layer", at_least=1)
    # MoA: routing
    swi_x: int = setting(4, "type router hidden width multiplier (SwiGLU); 0 = a Linear router", at_least=0)
    max_threshold: float = setting(0.5, "Sparse MoA: upper bound of the learned threshold Gamma", above=0,
                                   at_most=1)
    const_threshold: bool = setting(False, "Sparse MoA: a constant threshold instead of a learned one")
    top_k: int = setting(2, "topk: experts each token uses, weights renormalised over them", at_least=1)
    lb_loss_coeff: float = setting(0.001, "topk/adamole: weight of the load-balancing loss added to the training "
                                          "loss (the paper's final runs: 0)", at_least=0)
    gamma_grad: str = setting("authors", "gradient through the Sparse selection: 'authors' (none reaches "
                                         "Gamma, as in their code) or 'ste' (straight-through)", GAMMA_GRADS)

    def __post_init__(self):
        """Each field by its declared rule (Utils/settings.check_value), then the rules joining several."""
        check_fields(self, "ModelArgs")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
            self.head_dim = self.dim // self.n_heads
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture={self.architecture!r}: choose one of {ARCHITECTURES}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        targets = self.targets
        unknown = [t for t in targets if t not in LORA_TARGETS]
        repeated = sorted({t for t in targets if targets.count(t) > 1})
        if unknown or repeated or not targets:
            problem = (f"unknown target(s) {unknown}" if unknown else f"repeated target(s) {repeated}" if repeated
                       else "no target")
            raise ValueError(f"lora_targets={self.lora_targets!r}: {problem}; give distinct targets from "
                             f"{','.join(LORA_TARGETS)} (no LoRA at all: lora_layers='0-0')")
        for name in ("lora_layers", "p_adapter_layers", "prompt_layers"):
            if str(getattr(self, name)).strip() == "all":  # saved configs name the span itself
                setattr(self, name, f"0-{self.n_layers}")
        self.lora_layer_set = parse_layer_span(self.lora_layers, self.n_layers, "lora_layers")
        self.p_adapter_layer_set = parse_layer_span(self.p_adapter_layers, self.n_layers, "p_adapter_layers")
        self.prompt_layer_set = parse_layer_span(self.prompt_layers, self.n_layers, "prompt_layers")
        if self.method == "moa" and self.variant == "sparse" and self.prompt_layer_set:
            raise ValueError("prompt tuning is not a token-level expert: Sparse MoA needs prompt_layers='0-0'")
        self.check_baseline()

    def check_baseline(self):
        """Refuse the baseline settings the authors' code has no working form of."""
        if self.method in SPARSE_MOE_METHODS:
            if self.expert_num < 2:
                raise ValueError(f"method={self.method} mixes LoRA experts: expert_num must be >= 2")
            if self.prompt_layer_set or self.p_adapter_layer_set:
                raise ValueError(f"method={self.method} is a mixture of LoRA experts only (as the paper ran it): "
                                 "set prompt_layers and p_adapter_layers to '0-0'")
            if self.method == "topk" and not 1 <= self.top_k <= self.expert_num:
                raise ValueError(f"top_k={self.top_k} must be between 1 and expert_num={self.expert_num}")
            if self.method == "topk" and self.top_k == 1 and self.lb_loss_coeff == 0:
                raise ValueError("top_k=1 gives every chosen expert weight 1, so only the load-balancing loss "
                                 "trains the router: with lb_loss_coeff=0 it never learns; use top_k >= 2")
        if self.method == "unipeft" and not self.p_adapter_layer_set <= self.prompt_layer_set:
            # the authors weight the adapter by the prompt's gate (their p_adapter_gate is never read)
            raise ValueError("method=unipeft weights the parallel adapter by the layer's prompt gate, as the "
                             "authors' code does: every p_adapter layer needs prompt tuning too")

    @property
    def targets(self) -> tuple:
        return tuple(t.strip() for t in self.lora_targets.split(",") if t.strip())

    @property
    def ffn_hidden_dim(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @property
    def rope_scaling(self):
        """(factor, low_freq_factor, high_freq_factor, original_context) of scaled RoPE, or None."""
        if not self.use_scaled_rope:
            return None
        return (self.rope_scale_factor, self.rope_low_freq_factor, self.rope_high_freq_factor,
                self.rope_original_context)

    def layer_shapes(self) -> dict:
        """The base tensors of one layer: {name under 'layers.<i>.' (Meta's, our attributes'): shape}."""
        D, F, hd = self.dim, self.ffn_hidden_dim, self.head_dim
        shapes = {"attention.wq.weight": (self.n_heads * hd, D), "attention.wk.weight": (self.n_kv_heads * hd, D),
                  "attention.wv.weight": (self.n_kv_heads * hd, D), "attention.wo.weight": (D, self.n_heads * hd),
                  "feed_forward.w1.weight": (F, D), "feed_forward.w2.weight": (D, F), "feed_forward.w3.weight": (F, D),
                  "attention_norm.weight": (D,), "ffn_norm.weight": (D,)}
        if self.qk_norm:
            shapes.update({"attention.q_norm.weight": (hd,), "attention.k_norm.weight": (hd,)})
        return shapes

    def outer_shapes(self) -> dict:
        """The base tensors outside the layers (the output matrix only where it is not the embedding table)."""
        shapes = {"tok_embeddings.weight": (self.vocab_size, self.dim), "norm.weight": (self.dim,)}
        if not self.tied_embeddings:
            shapes["output.weight"] = (self.vocab_size, self.dim)
        return shapes

    def type_names(self, layer: int) -> list:
        """The type router's columns in layer `layer`, in the authors' fixed order (MoA and instance)."""
        if self.method not in ("moa", "instance"):
            return []
        present = set(self.targets) if layer in self.lora_layer_set else set()
        if layer in self.prompt_layer_set:
            present.add("PROMPT")
        if layer in self.p_adapter_layer_set:
            present.add("PADAPTER")
        return [t for t in TYPE_ORDER if t in present]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_params_json(cls, path: str, **overrides) -> "ModelArgs":
        """Meta's params.json (any extra keys rejected) updated with runtime/MoA overrides."""
        if os.path.isdir(path):
            path = os.path.join(path, "params.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no params.json (a Meta checkpoint directory holds params.json, "
                                    "consolidated.NN.pth and tokenizer.model)")
        params = read_json_object(path, "model parameters")
        unknown = sorted(set(params) - set(META_FIELDS))
        if unknown:
            raise ValueError(f"{path}: unknown field(s) {unknown}; Meta's params.json has {list(META_FIELDS)}")
        params = check_values(cls, params, path)  # each field's rule, naming the file
        try:
            cls(**params)  # the rules joining Meta's fields, on the file alone
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        return cls(**{**params, **overrides})  # the overrides were checked where they came from
