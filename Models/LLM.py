"""TransformerBlock (which owns the routing between expert types) and LLaMA."""
import Utils.jittor_env  # noqa: F401
import jittor as jt
from jittor import nn

from .Block import Attention, FeedForward, RMSNorm, attention_mask
from .kernels.decode_layer import decode_layer, fuses_decode_step
from .kernels.switch import Kernel
from .Experts import PAdapterLayer
from .kernels.elementwise import branches, residual_add
from .kernels.linear import Linear
from .ModelArgs import BF16_PRODUCTS, INSTANCE_METHODS, ModelArgs
from .recompute import recomputed
from .kernels.precision import BaseLinear
from .Routing import UNIPEFT_GATES, Gamma, LayerRoute, sequence_mean, type_router, type_weights
from .rope import rope_tables

SOFT_CLAMP = 65500.0  # the authors' fp16 guard, applied in fp32 too (not by Sparse MoA, not in bf16 or int8)


class TransformerBlock(nn.Module):
    """One layer, h = x + Attention(attention_norm(x)), out = h + FeedForward(ffn_norm(h)), with the
    experts mixed in under the weights of the layer's own routing (route()). Each projection with
    experts beside it (wq, wk, wv, wo; w1, w3, w2 of the FFN) computes, on its input x [B,T,in],

        y = x W^T + sum over its families f of  w_f(x) * expert_f(x)              [B,T,out]

        LoRA (Q, K, V, O, FFN_*):  expert(x) = s * (x A^T) B^T     A [r,in], B [out,r], s = alpha / r
                                   (one expert: a kernels.projections.ExpertTerm of its Projection)
    and beside the attention and the FFN:
        PROMPT:    attention += w * gate[h] * softmax(q (P W_k^T)^T / sqrt(hd)) (P W_v^T)   [B,T,H,hd]
                   for the learned prompt rows P [L,D] (Soft MoA only)
        PADAPTER:  out += w * up(silu(down(ffn_norm(h))))                                  [B,T,D]
    and out is clamped to +-SOFT_CLAMP where self.clamp says so (the authors' fp16 guard).

    The type weights w [B,T,n_types], one column per family in the authors' order, come from the
    raw residual stream x [B,T,D] (router: SwiGLU, or Linear with swi_x 0):
        Soft MoA:    w = sigmoid(router(x))
        Sparse MoA:  w = p * 1[p >= Gamma(x)], p = sigmoid(router(x)),
                     Gamma(x) = max_threshold * sigmoid(x W_g^T + b_g)  [B,T,1]: experts below it are off
    The baselines (docs/baselines.md): instance routes the sequence mean of x with the same router,
    unipeft one gate per family from it; moe, topk and adamole weigh no family (w = 1; their
    experts mix inside a family). Instance-level decisions are taken on a whole sequence or on the
    KV-cache prefill and kept for the decode steps that follow, as the authors' code does.
    """

    def __init__(self, layer_id: int, args: ModelArgs):
        self.method, self.variant = args.method, args.variant
        self.gamma_grad = args.gamma_grad
        self.type_names = args.type_names(layer_id)
        self.attention = Attention(args, layer_id)
        self.feed_forward = FeedForward(args, layer_id)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.p_adapter = None
        if layer_id in args.p_adapter_layer_set:
            self.p_adapter = PAdapterLayer(args.dim, args.p_adapter_size, args.expert_num, args.p_adapter_hydra)
        self.adapter_type_router = self.adapter_threshold_fn = None
        if self.type_names:
            self.adapter_type_router = type_router(args.dim, len(self.type_names), args.swi_x)
            if self.method == "moa" and self.variant == "sparse":
                self.adapter_threshold_fn = Gamma(args.dim, args.max_threshold, args.const_threshold)
        self.lora_targets, self.gate_names = [], []
        if self.method == "unipeft":
            has_lora = layer_id in args.lora_layer_set and bool(args.targets)
            on = {"LORA": has_lora, "PROMPT": layer_id in args.prompt_layer_set, "PADAPTER": self.p_adapter is not None}
            self.gate_names = [name for name in UNIPEFT_GATES if on[name]]
            self.lora_targets = list(args.targets) if has_lora else []
            for linear in dict.fromkeys(UNIPEFT_GATES[name] for name in self.gate_names):
                setattr(self, linear, Linear(args.dim, 1, bias=True))
            if on["PADAPTER"]:
                self.p_adapter_gate = Linear(args.dim, 1, bias=True)  # never read, see Routing.UNIPEFT_GATES
        self.router_columns = self.type_names or self.gate_names  # the families routed, in the router's order
        self.routes_sequences = self.method in INSTANCE_METHODS and bool(self.router_columns)
        # the bound of the authors' fp16 guard: every folder but Sparse MoA's clamps in fp32, and none
        # in their bf16 mode (`if not self.bf16`), which --precision bf16 is, as is int8 with its bf16 products
        # (None: no clamp)
        unclamped = (self.method == "moa" and self.variant == "sparse") or args.precision in BF16_PRODUCTS
        self.clamp = None if unclamped else SOFT_CLAMP
        self._sequence_gates = None  # instance-level decisions of the last prefill
        self.decode_ops = {}  # the decode layer's ops as built for this KV cache (kernels/decode_layer.StepOp)

    def reset_cache(self):
        self.attention.reset_cache()
        self._sequence_gates = None
        self.decode_ops = {}

    def route(self, x: jt.Var, start_pos, record) -> dict:
        """Each family's weight [B,T] from the raw residual stream x [B,T,D] ({} when the method
        weighs no family); fills `record`."""
        if self.method == "moa" and self.type_names:
            return self.route_tokens(x, record)
        if self.routes_sequences:
            return self.route_sequence(x, start_pos, record)
        return {}

    def route_tokens(self, x: jt.Var, record) -> dict:
        # probs [B,T,n_types], gamma [B,T,1] (Sparse) or None, columns n_types x [B,T]
        probs, gamma, columns = type_weights(x, self.adapter_type_router, self.adapter_threshold_fn, self.gamma_grad)
        if record is not None:
            record.update(type_weight=probs, threshold=gamma)
        return dict(zip(self.type_names, columns))

    def route_sequence(self, x: jt.Var, start_pos, record) -> dict:
        gates = self.sequence_gates(x, start_pos, record)  # [B,T,n_columns]
        return {family: gates[:, :, column] for family, column in self.family_columns().items()}

    def sequence_gates(self, x: jt.Var, start_pos, record) -> jt.Var:
        """The instance-level gates [B,T,n_columns] (router_columns' order) of the sequences x [B,T,D] or, in
        the decode steps after a prefill, the prefill's; fills `record`."""
        B, T, _ = x.shape
        if start_pos is None or start_pos == 0:  # a whole sequence or a prefill decides
            pooled = sequence_mean(x)  # [B,1,D]
            if self.method == "instance":
                logits = self.adapter_type_router(pooled)  # [B,1,n_types]
            else:
                logits = jt.concat([getattr(self, UNIPEFT_GATES[name])(pooled) for name in self.gate_names], dim=-1)
            gates = jt.sigmoid(logits)
            if start_pos == 0:
                self._sequence_gates = gates.stop_grad()
            if record is not None:
                record.update(pooled=pooled, router_logits=logits)
        else:
            gates = self._sequence_gates
        per_token = gates.broadcast((B, T, len(self.router_columns)))
        if record is not None:  # type_weight: what each token's families were weighted by
            record.update(sequence_gates=gates, type_weight=per_token)
        return per_token

    def family_columns(self) -> dict:
        """Each weighted family's column of the layer's router (router_columns); families not in it weigh 1.
        UniPEFT's one LoRA gate weighs every LoRA target."""
        if self.method == "unipeft":
            columns = {target: self.gate_names.index("LORA") for target in self.lora_targets}
            columns.update({name: self.gate_names.index(name) for name in ("PROMPT", "PADAPTER")
                            if name in self.gate_names})
            return columns
        return {name: i for i, name in enumerate(self.type_names)}

    def execute(self, x, cos, sin, mask, start_pos=None, records=None, aux=None):
        # x [B,T,D] -> [B,T,D]
        record = {"type_weight": None, "threshold": None} if records is not None else None
        if records is not None:
            records.append(record)
        return layer_step(self, x, cos, sin, mask, start_pos, record, aux)

    def op_by_op(self, x, cos, sin, mask, start_pos, record, aux):
        """The layer's forward through the per-op kernels, in the order of the equation above; fills `record`."""
        # x [B,T,D] -> [B,T,D]
        # x, h and the FFN's normed input each have several readers; the norms hand x and h on to
        # theirs, and `branches` the normed input, so each sums its readers' gradients in one pass.
        # residual_add: x + y in one threaded pass (Jittor's add runs on one thread)
        attention_input, route_input, x = self.attention_norm.with_branches(x, 2)
        route = LayerRoute(self.route(route_input, start_pos, record), record, aux)
        h = residual_add(x, self.attention(attention_input, cos, sin, mask, route, start_pos))
        normed, h = self.ffn_norm.with_branches(h, 1)
        ffn_input, adapter_input = branches(normed, 2) if self.p_adapter is not None else (normed, None)
        out = residual_add(h, self.feed_forward(ffn_input, route))
        if self.p_adapter is not None:
            out = self.p_adapter(out, adapter_input, route)
        if self.clamp is not None:
            out = jt.clamp(out, -self.clamp, self.clamp)
        return out


# One layer's forward: a decode step of a layer with one expert per family or mixtures of them as two ops
# (Models/kernels/decode_layer.py; on a CPU or a GPU), else op by op, which is the fused side's plain reference
layer_step = Kernel(decode_layer, TransformerBlock.op_by_op, when=fuses_decode_step, gpu=True)


class LLaMA(nn.Module):
    def __init__(self, args: ModelArgs):
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList([TransformerBlock(i, args) for i in range(args.n_layers)])
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = BaseLinear(args.dim, args.vocab_size)
        if args.tied_embeddings:  # one Var, loaded, stored and counted once, as tok_embeddings.weight
            self.output.weight = self.tok_embeddings.weight
        # Meta precomputes twice the context; kept on the host and sliced per call.
        self._rope_cos, self._rope_sin = rope_tables(args.head_dim, args.max_seq_len * 2, args.rope_theta,
                                                     args.rope_scaling)

    def reset_cache(self):
        for layer in self.layers:
            layer.reset_cache()

    def execute(self, tokens: jt.Var, start_pos=None, records=None, last=False, aux=None) -> jt.Var:
        """tokens [B,T] -> logits [B,T,V], or [B,1,V] of the last position only with last=True
        (decoding needs no more, and [B,T,V] at LLaMA-3's vocabulary is large).

        start_pos None: the whole sequence, no cache (training, scoring).
        start_pos int: tokens sit at start_pos.. and go through the preallocated
        KV cache (eval mode only); attention always spans max_seq_len keys so the
        graph keeps one shape per T.
        records: a list that receives one dict per layer of its routers' outputs: type_weight and
        threshold (MoA), sequence_gates (instance, unipeft), and per family the expert routers'.
        aux: a list that receives the load-balancing terms of sparse expert mixtures.
        """
        h = self.hidden(tokens, start_pos, records, aux)  # [B,T,D]
        return self.output(h[:, -1:] if last else h)

    def hidden(self, tokens: jt.Var, start_pos=None, records=None, aux=None) -> jt.Var:
        """tokens [B,T] -> the final normed hidden states [B,T,D], before the output matrix."""
        B, T = tokens.shape
        S = T if start_pos is None else self.args.max_seq_len
        first = 0 if start_pos is None else start_pos
        if first + T > self.args.max_seq_len:
            raise ValueError(f"positions {first}..{first + T - 1} exceed max_seq_len={self.args.max_seq_len}")
        if start_pos is not None and self.is_training():
            raise RuntimeError("the KV cache exists only in eval mode: call model.eval() first")
        mask = jt.array(attention_mask(T, S, first))
        cos = jt.array(self._rope_cos[first:first + T])
        sin = jt.array(self._rope_sin[first:first + T])
        h = self.tok_embeddings(tokens).float32()  # [B,T,D]; the table may be stored in bf16
        if not self.tok_embeddings.weight.requires_grad:  # frozen: layer 0's kernels make no gradient for h
            h = h.stop_grad()
        recompute = self.args.recompute and start_pos is None and records is None and not jt.flags.no_grad
        for layer in self.layers:
            h = recomputed(layer, h, cos, sin, mask, aux) if recompute else layer(h, cos, sin, mask, start_pos,
                                                                                   records, aux)
        return self.norm(h)  # [B,T,D] fp32
