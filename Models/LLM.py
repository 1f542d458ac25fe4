"""TransformerBlock (which owns the routing between expert types) and LLaMA."""
import Utils.jittor_env  # noqa: F401
import jittor as jt
from jittor import nn

from .Block import Attention, FeedForward, RMSNorm, attention_mask
from .Experts import PAdapterLayer
from .ModelArgs import ModelArgs
from .precision import BaseLinear
from .Routing import Gamma, hard_select, type_router
from .utils import rope_tables

SOFT_CLAMP = 65500.0  # the authors' fp16 guard, applied by Soft MoA in fp32 too


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        self.variant = args.variant
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
            if self.variant == "sparse":
                self.adapter_threshold_fn = Gamma(args.dim, args.max_threshold, args.const_threshold)

    def route(self, x: jt.Var):
        """Type weights [B,T,n_types] from the raw residual stream, and Gamma [B,T,1] (Sparse) or None."""
        probs = jt.sigmoid(self.adapter_type_router(x))
        if self.variant == "soft":
            return probs, None
        gamma = self.adapter_threshold_fn(x)
        return probs * hard_select(probs, gamma, self.gamma_grad), gamma

    def execute(self, x, cos, sin, mask, start_pos=None, records=None):
        # x [B,T,D] -> [B,T,D]
        weights, gamma = {}, None
        if self.type_names:
            type_weight, gamma = self.route(x)
            weights = {name: type_weight[:, :, i] for i, name in enumerate(self.type_names)}
            if records is not None:
                records.append({"type_weight": type_weight, "threshold": gamma})
        elif records is not None:
            records.append({"type_weight": None, "threshold": None})
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, weights, start_pos)
        normed = self.ffn_norm(h)
        out = h + self.feed_forward(normed, weights)
        if self.p_adapter is not None:
            out = self.p_adapter(out, normed, weights["PADAPTER"])
        if self.variant == "soft":
            out = jt.clamp(out, -SOFT_CLAMP, SOFT_CLAMP)
        return out


class LLaMA(nn.Module):
    def __init__(self, args: ModelArgs):
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList([TransformerBlock(i, args) for i in range(args.n_layers)])
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = BaseLinear(args.dim, args.vocab_size)
        # Meta precomputes twice the context; kept on the host and sliced per call.
        self._rope_cos, self._rope_sin = rope_tables(args.head_dim, args.max_seq_len * 2, args.rope_theta,
                                                     args.use_scaled_rope)

    def reset_cache(self):
        for layer in self.layers:
            layer.attention.reset_cache()

    def execute(self, tokens: jt.Var, start_pos=None, records=None, last=False) -> jt.Var:
        """tokens [B,T] -> logits [B,T,V], or [B,1,V] of the last position only with last=True
        (decoding needs no more, and [B,T,V] at LLaMA-3's vocabulary is large).

        start_pos None: the whole sequence, no cache (training, scoring).
        start_pos int: tokens sit at start_pos.. and go through the preallocated
        KV cache (eval mode only); attention always spans max_seq_len keys so the
        graph keeps one shape per T.
        records: a list that receives one {type_weight, threshold} dict per layer.
        """
        h = self.hidden(tokens, start_pos, records)  # [B,T,D]
        return self.output(h[:, -1:] if last else h)

    def hidden(self, tokens: jt.Var, start_pos=None, records=None) -> jt.Var:
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
        for layer in self.layers:
            h = layer(h, cos, sin, mask, start_pos, records)
        return self.norm(h)  # [B,T,D] fp32
