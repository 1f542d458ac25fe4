"""The router records `Infer.py --save_weights` writes, and how they are read back (Utils/plots.py draws them,
Utils/router_report.py builds the router report from them).

`Infer.py --save_weights` writes two pickles (plain Python lists/dicts, numpy
arrays and None; nothing else) into its output directory:

    type_weight.pkl = {
        "kind": "type_weight",
        "method": "moa" | "moe" | "topk" | "adamole" | "instance" | "unipeft",
        "variant": "soft" | "sparse",     # MoA's
        "layer_types": [[str, ...], ...],  # per layer, the router's column names in order,
                                           # e.g. ["Q", "K", "V", "O", "FFN_DOWN", "PADAPTER"]
                                           # (UniPEFT: ["LORA", "PROMPT", "PADAPTER"]); [] for a
                                           # layer without experts or a method without a type router
        "examples": [                      # in input order (data files in the order given)
            {"dataset": str,               # e.g. "AddSub" or "synthetic"
             "index": int,                 # position of the example in its data file
             "tokens": [str, ...],         # text of each token (prompt then generation), n_tokens long
             "token_ids": [int, ...],      # n_tokens ids; token 0 is bos
             "n_prompt": int,              # the first n_prompt tokens are the prompt
             "generation": str,            # decoded generated text (stop token excluded)
             "weights": [np.ndarray float32 [n_tokens, n_types_of_layer] or None, ...]},  # per layer
            ...]}

    token_weight.pkl = the same, with "kind": "token_weight" and "weights" per layer
        np.ndarray float32 [n_tokens, 1]: Sparse MoA's per-token threshold Gamma, or None
        (Soft MoA, or a layer without experts).

    expert_weight.pkl (only for a model with families of several experts: MoE-LoRA, top-k,
    AdaMoLE, or expert_num > 1) = the same, with "kind": "expert_weight", "layer_types"
    listing per layer the families that mix experts, and "weights" per layer a dict
    {family: np.ndarray float32 [n_tokens, expert_num]}: the weight each expert's output got
    (top-k and AdaMoLE: 0 for an unselected expert).

Instance-level methods (instance, unipeft) decide once per sequence: their type weights
repeat the sequence's gates on every token, and the heatmaps show them per example.

Row t of a weight array belongs to token t: the values the router computed when
that token was fed to the model (a token's weights decide how the experts
process it, and thereby what comes next). type_weight is the weight w each
expert type's output is multiplied by (Sparse: 0 for an unselected expert).
"""
import pickle

import numpy as np

TYPE_ORDER = ("Q", "K", "V", "PROMPT", "O", "FFN_UP", "FFN_GATE", "FFN_DOWN", "PADAPTER")


def weight_pickles(test_sets, tok, results, model):
    """The --save_weights dicts (the structure above) from Infer.py's results: type_weight and
    token_weight, and expert_weight or None when no family mixes several experts."""
    base = {"method": model.args.method, "variant": model.args.variant,
            "layer_types": [list(layer.router_columns) for layer in model.llama.layers]}
    type_data = {"kind": "type_weight", **base, "examples": []}
    token_data = {"kind": "token_weight", **base, "examples": []}
    families = [sorted(layer["expert_weight"], key=family_order) for layer in results[0]["records"]] if results else []
    expert_data = {"kind": "expert_weight", **base, "layer_types": families, "examples": []}
    for name, _, _, first, count in test_sets:
        for i in range(first, first + count):
            r = results[i]
            common = {"dataset": name, "index": i - first, "token_ids": r["token_ids"],
                      "tokens": [tok.decode([t]) if t < tok.n_words else f"<id {t}>" for t in r["token_ids"]],
                      "n_prompt": r["n_prompt"],
                      "generation": r["generation"]}
            type_data["examples"].append({**common, "weights": [layer["type_weight"] for layer in r["records"]]})
            token_data["examples"].append({**common, "weights": [layer["token_weight"] for layer in r["records"]]})
            expert_data["examples"].append({**common, "weights": [layer["expert_weight"] for layer in r["records"]]})
    return type_data, token_data, (expert_data if any(families) else None)


def family_order(name: str) -> int:
    return TYPE_ORDER.index(name) if name in TYPE_ORDER else len(TYPE_ORDER)


class WeightsUnpickler(pickle.Unpickler):
    """Plain unpickling would call whatever a crafted file names: these pickles are read through an
    allow-list, numpy arrays (and their dtypes and scalars) besides the containers pickle builds itself."""
    ALLOWED = {(f"numpy.{core}.{module}", name) for core in ("core", "_core")  # numpy 1 and 2
               for module, name in [("multiarray", "_reconstruct"), ("multiarray", "scalar"),
                                    ("numeric", "_frombuffer")]} | {("numpy", "ndarray"), ("numpy", "dtype")}

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which a --save_weights pickle never holds")
        return super().find_class(module, name)


def load_pickle(path, kind: str = None):
    """A --save_weights pickle; with `kind` (type_weight, token_weight) its structure is checked against
    the one above, so a damaged file, or one of another kind under this name, is a ValueError naming it."""
    with open(path, "rb") as f:
        try:
            data = WeightsUnpickler(f).load()
        except Exception as e:  # whatever a damaged or crafted file makes the unpickler raise
            raise ValueError(f"{path}: not a --save_weights pickle ({type(e).__name__}: {e})") from None
    if kind is not None:
        check_weights(data, path, kind)
    return data


class NonFiniteWeights(ValueError):
    """A --save_weights pickle whose router weights hold NaN or inf (exit 3, as other non-finite numbers)."""


def check_weights(data, path, kind: str):
    """Refuse a type_weight or token_weight dict that is not the structure above, naming the file and where: every
    weight array real numbers of its shape, finite (else NonFiniteWeights), and what keys an example (dataset,
    index, token_ids) of its kind."""
    def bad(where, what):
        raise ValueError(f"{path}: {where} {what}, not the {kind} structure Infer.py --save_weights writes")
    if not isinstance(data, dict) or data.get("kind") != kind:
        bad("is", f"kind {data.get('kind') if isinstance(data, dict) else type(data).__name__!r}")
    if not (isinstance(data.get("method", "moa"), str) and isinstance(data.get("variant", ""), str)
            and (data.get("method", "moa") != "moa" or "variant" in data)):
        bad("its method and variant", "are not names (MoA's with its variant)")
    layers = data.get("layer_types")
    if not (isinstance(layers, list) and all(isinstance(n, list) and all(isinstance(t, str) for t in n) for n in layers)):
        bad("its layer_types", "are not per layer a list of type names")
    if not isinstance(data.get("examples"), list):
        bad("its examples", "are not a list")
    for i, ex in enumerate(data["examples"]):
        ids = ex.get("token_ids") if isinstance(ex, dict) else None
        if not (isinstance(ids, list) and all(type(t) is int for t in ids) and type(ex.get("n_prompt")) is int
                and 0 <= ex["n_prompt"] <= len(ids) and isinstance(ex.get("weights"), list)
                and len(ex["weights"]) == len(layers) and isinstance(ex.get("dataset"), str)
                and type(ex.get("index")) is int):
            bad(f"example {i}", f"has no dataset name, index, integer token_ids, n_prompt within them and weights "
                                f"for each of {len(layers)} layers")
        for layer, (names, w) in enumerate(zip(layers, ex["weights"])):
            columns = len(names) if kind == "type_weight" else 1
            if w is None:
                continue
            if not (isinstance(w, np.ndarray) and w.shape == (len(ids), columns)):
                bad(f"example {i} layer {layer}", f"weights {getattr(w, 'shape', type(w).__name__)}, expected "
                                                  f"[{len(ids)} tokens, {columns}]")
            if w.dtype.kind not in "fiu":  # complex, bool, strings, objects: no router weighs with them
                bad(f"example {i} layer {layer}", f"weights of dtype {w.dtype}, not real numbers")
            if not np.isfinite(w).all():
                raise NonFiniteWeights(f"{path}: example {i} layer {layer}: the weights hold NaN or inf")
