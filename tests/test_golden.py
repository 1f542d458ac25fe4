"""Every golden file (tests/golden, see its README) against our model: the authors' PyTorch MoA and baselines
(logits, loss and its parts, every router output, every gradient, the KV-cache path, their adapter files both
ways) and the base models alone (Meta's tiny base, transformers' LLaMA-3.1 and Qwen3: logits and KV cache through
the fused kernels and the plain path, bf16). A new golden file is one line in one of the lists below."""
import contextlib
import json

import numpy as np
import pytest

from conftest import GOLDEN
from tiny_models import fused_layer_steps, kv_logits, max_abs
from golden_files import golden_forward, golden_model, golden_params, load_golden
import jittor as jt
from Models import LLM, Routing, load_base_model
from Models.formats.adapters import load_adapter, read_adapter_config
from Models.kernels import switch
from Models.kernels.adamw import build_optimizer
from Models.kernels.precision import set_base_precision
from Models.LLaMA_Adapter import LLaMA_adapter, is_adapter_param
from Models.ModelArgs import ModelArgs

# the authors' MoA: Sparse, Soft (one expert per type), Soft with two experts per type
MOA = ["sparse_s0", "soft_s0", "soft_e2_s3"]
# the authors' baseline methods (tests/golden/baselines/README.md)
BASELINES = [f"baselines/{name}" for name in ("soft_moe_lora_s0", "soft_moe_molora_e2_s0", "soft_moe_hydra_e3_s1",
                                              "soft_moe_ppmoe_e2_s0", "sparse_moe_topk2_e4_s0",
                                              "sparse_moe_adamole_e4_s0", "instance_s0", "unipeft_s0")]
ADAPTED = MOA + BASELINES
# base models alone: the folder beside (or of) the file is the checkpoint
BASES = ["tiny_meta/base_logits", "hf/llama31_tiny", "hf/qwen3_tiny"]
HF_BASES = [stem for stem in BASES if stem.startswith("hf/")]
# the adapter parameters the authors' code gives no gradient (meta["grad_none"])
WITHOUT_GRADIENT = [stem for stem in ADAPTED if load_golden(stem)[1]["grad_none"]]
LEVELS = {"soft_moe": "token", "sparse_moe": "token", "instance": "sequence", "unipeft": "sequence"}
RUNTIME = dict(max_seq_len=32, max_batch_size=4)


@pytest.fixture(params=["fused", "plain"])
def kernels(request, monkeypatch):
    """Both paths of every switch.Kernel: the fused CPU kernels, and the plain-Jittor references."""
    if request.param == "plain":
        monkeypatch.setattr(switch, "fused_kernels_on", lambda: False)
    elif not switch.fused_kernels_on():
        pytest.skip("fused kernels are off (no libdnnl or a GPU run)")
    return request.param


def golden_base(stem):
    """(the checkpoint folder of tests/golden/<stem>.npz: the folder of that name, else the one holding it; npz,
    meta)."""
    data = np.load(GOLDEN / f"{stem}.npz", allow_pickle=False)
    folder = GOLDEN / stem if (GOLDEN / stem).is_dir() else (GOLDEN / stem).parent
    return folder, data, json.loads(str(data["meta"]))


# ---- MoA and the baselines -----------------------------------------------------------------------

@pytest.mark.parametrize("stem", ADAPTED)
def test_forward_loss_and_routers(stem):
    model, data, meta = golden_model(stem)
    records = []
    loss, logits = golden_forward(model, data, records)
    assert max_abs(logits.numpy(), data["logits"]) <= 1e-4
    assert abs(float(loss.item()) - float(data["loss"])) <= 1e-5
    if meta["variant"] in ("sparse", "soft"):
        check_moa_routers(model, records, data, meta)
    else:
        check_baseline_routers(model, records, data, meta)


def check_moa_routers(model, records, data, meta):
    for layer, record in enumerate(records):
        assert model.llama.layers[layer].type_names == meta["type_names"][layer]
        assert max_abs(record["type_weight"].numpy(), data[f"type_weights/{layer}"]) <= 1e-5
        if meta["variant"] == "sparse":
            assert max_abs(record["threshold"].numpy(), data[f"thresholds/{layer}"]) <= 1e-5
            # sigmoid > 0, so a non-zero type weight is exactly a selected expert
            assert np.array_equal(record["type_weight"].numpy() > 0, data[f"selected/{layer}"] > 0)


def expert_keys(data, layer, family):
    """The expert-router arrays a golden file holds for one module: {output name: array}."""
    suffix = f"/{layer}/{family}"
    return {k[:-len(suffix)]: data[k] for k in data.files if k.endswith(suffix) and not k.startswith("aux_loss")}


def check_baseline_routers(model, records, data, meta):
    """The loss's load-balancing part, and every router output the file holds compared (none left out)."""
    compared = set()
    if "aux_loss" in data.files:
        parts = model.last_loss_parts
        assert abs(float(parts["ce"].item()) - float(data["ce_loss"])) <= 1e-5
        assert abs(float(parts["aux"].item()) - float(data["aux_loss"])) <= 1e-5 * max(1.0, float(data["aux_loss"]))
    for layer, record in enumerate(records):
        if LEVELS[meta["variant"]] == "sequence":
            prefix = "type" if meta["variant"] == "instance" else "gate"
            ours = {"pooled": "pooled", "router_logits": f"{'router' if prefix == 'type' else 'gate'}_logits",
                    "sequence_gates": f"{prefix}_weights"}
            for key, golden_key in ours.items():
                assert max_abs(record[key].numpy(), data[f"{golden_key}/{layer}"]) <= 1e-5, (key, layer)
                compared.add(f"{golden_key}/{layer}")
        for key, family_outputs in record.items():
            if not isinstance(family_outputs, dict) or key == "aux_loss":
                continue
            for family, value in family_outputs.items():
                ref = expert_keys(data, layer, family)
                if key == "topk_indices":  # a set per token
                    assert np.array_equal(np.sort(value.numpy(), -1), np.sort(ref[key], -1)), (layer, family)
                elif key in ref:
                    assert max_abs(value.numpy(), ref[key]) <= 1e-5, (key, layer, family)
                else:
                    continue
                compared.add(f"{key}/{layer}/{family}")
        for family, value in record.get("aux_loss", {}).items():
            ref = float(data[f"aux_loss_modules/{layer}/{family}"])
            assert abs(float(value.item()) - ref) <= 1e-5 * max(1.0, abs(ref))
            compared.add(f"aux_loss_modules/{layer}/{family}")
    # topk_weights and topk_margin are expert_weights and expert_probs read at topk_indices
    router_keys = {k for k in data.files if "/" in k and not k.startswith(("param/", "grad/", "kv_", "topk_weights",
                                                                           "topk_margin"))}
    assert router_keys <= compared, sorted(router_keys - compared)
    assert router_keys or meta["expert_num"] == 1, "a mixture whose routers the file does not hold"


@pytest.mark.parametrize("stem", ADAPTED)
def test_gradients(stem):
    """Every trainable tensor's gradient against the golden file's (1e-3 relative); those the authors' code
    gives no gradient (meta["grad_none"]) exactly zero."""
    model, data, meta = golden_model(stem)
    loss, _ = golden_forward(model, data)
    adapter = model.adapter_parameters()
    assert sorted(adapter) == sorted(meta["trainable"])
    for name, grad in zip(adapter, jt.grad(loss, list(adapter.values()))):
        ref, got = data[f"grad/{name}"], grad.numpy()
        if name in meta["grad_none"]:
            assert np.all(got == 0), f"{name}: the authors' code gives it no gradient"
        else:
            assert max_abs(got, ref) / np.abs(ref).max() <= 1e-3, name


@pytest.mark.parametrize("stem", WITHOUT_GRADIENT)
def test_parameters_without_gradient_keep_their_values(stem):
    """A training step (our AdamW, weight decay on) leaves the parameters the authors' code gives no gradient where
    they were, as the authors' AdamW does (it skips them), and moves every other adapter parameter."""
    model, data, meta = golden_model(stem)
    adapter = model.adapter_parameters()
    before = {name: p.numpy().copy() for name, p in adapter.items()}
    optimizer = build_optimizer(model, 1e-2, 0.1)
    optimizer.backward(golden_forward(model, data)[0])
    optimizer.step()
    moved = {name for name, p in adapter.items() if not np.array_equal(p.numpy(), before[name])}
    assert moved == set(adapter) - set(meta["grad_none"]), sorted(moved ^ (set(adapter) - set(meta["grad_none"])))


@pytest.mark.parametrize("generating", [False, True], ids=["gradients", "no_grad"])
@pytest.mark.parametrize("stem", ADAPTED)
def test_kv_cache(stem, generating, monkeypatch):
    """Token-level methods: the KV path equals the full forward. Sequence-level ones: the gates of
    the 6-token prefill are kept for every decode step, so the KV logits are the authors' KV logits. With
    gradients on the layers run op by op; under no_grad, as generation runs, every layer (one expert per family,
    or mixtures of LoRA, prompt and adapter experts) takes the decode layer (LLM.layer_step's fused side, where it
    is on)."""
    model, data, meta = golden_model(stem)
    model.eval()
    calls = fused_layer_steps(monkeypatch)
    with jt.no_grad() if generating else contextlib.nullcontext():
        got = kv_logits(model.llama, data["tokens"].astype(np.int32), meta["kv_prefill"])
    assert len(calls) == (len(model.llama.layers) * (data["tokens"].shape[1] - meta["kv_prefill"] + 1)
                          if generating and LLM.layer_step.on() else 0)
    assert max_abs(got, data["kv_logits"]) <= 1e-4
    if LEVELS.get(meta["variant"]) == "sequence":
        assert max_abs(got, data["logits"][:, meta["kv_prefill"] - 1:]) > 0.1  # the prefill's gates, not the full mean's
        prefix = "kv_type" if meta["variant"] == "instance" else "kv_gate"
        for layer, block in enumerate(model.llama.layers):
            assert max_abs(block._sequence_gates.numpy(), data[f"{prefix}_weights/{layer}"]) <= 1e-5


@pytest.mark.parametrize("stem", ADAPTED)
def test_authors_adapter_export_import(stem, tmp_path):
    """Ours -> their adapter.pth (flat, their names) + adapter_params.json (their folder's fields and values) ->
    ours again, unchanged; their pair also loads into a model directly."""
    from Models.formats.authors import AUTHORS_PARAMS
    from Models.formats.adapters import export_authors_adapter, import_authors_adapter, save_adapter
    from Models.formats.pth import load_pth
    model, data, meta = golden_model(stem)
    params = golden_params(data)
    instance = meta["variant"] == "instance"  # it writes Soft MoA's options and names
    save_adapter(model, str(tmp_path / "ours"))
    theirs_path = str(tmp_path / "theirs" / "adapter.pth")
    export_authors_adapter(str(tmp_path / "ours"), theirs_path)
    theirs = load_pth(theirs_path)
    assert sorted(theirs) == sorted(meta["adapter_only_names"]) and all(is_adapter_param(n) for n in theirs)
    assert all(np.array_equal(theirs[n], params[n]) for n in theirs)
    with open(tmp_path / "theirs" / "adapter_params.json") as f:
        assert json.load(f) == {k: meta["model_args"][k] for k in AUTHORS_PARAMS[meta["variant"]]}
    assert read_adapter_config(theirs_path)["method"] == ("moa" if instance else model.args.method)
    import_authors_adapter(theirs_path, str(tmp_path / "back"), model.args, "instance" if instance else None)
    for source in (str(tmp_path / "back"), theirs_path):  # ours again, and their pair read directly
        fresh = LLaMA_adapter(model.args)
        load_adapter(fresh, source)
        assert all(np.array_equal(var.numpy(), params[n]) for n, var in fresh.adapter_parameters().items()), source


def test_learning_gamma_gets_the_straight_through_gradient(monkeypatch):
    """gamma_grad="ste": the forward is the authors' step; the gradient reaching each token's Gamma is
    sum over types of dL/dselect * d/dgamma sigmoid((p - gamma) / T) = -sum dL/dselect * s (1 - s) / T,
    recomputed here from the forward's probabilities and Gamma, and it reaches the threshold Linear's bias as
    dGamma/db = Gamma (1 - Gamma / max_threshold)."""
    selections = []  # (probabilities, Gamma, selection) of each layer, as the router made them
    real = Routing.hard_select

    def recorded(probs, gamma, gamma_grad):
        selections.append((probs, gamma, real(probs, gamma, gamma_grad)))
        return selections[-1][2]
    monkeypatch.setattr(Routing, "hard_select", recorded)
    model, data, _ = golden_model("sparse_s0", gamma_grad="ste")
    loss, logits = golden_forward(model, data)
    assert max_abs(logits.numpy(), data["logits"]) <= 1e-4  # same forward as the authors'
    assert len(selections) == len(model.llama.layers)
    biases = [block.adapter_threshold_fn.bias for block in model.llama.layers]
    grads = jt.grad(loss, [v for _, gamma, select in selections for v in (gamma, select)] + biases)
    T, top = Routing.STE_TEMPERATURE, model.args.max_threshold
    for layer, (probs, gamma, _) in enumerate(selections):
        d_gamma, d_select = grads[2 * layer].numpy(), grads[2 * layer + 1].numpy()  # [B,T,1], [B,T,n]
        p, g = probs.numpy().astype(np.float64), gamma.numpy().astype(np.float64)
        s = 1 / (1 + np.exp(-(p - g) / T))
        expected = (d_select * -s * (1 - s) / T).sum(-1, keepdims=True)
        assert np.abs(expected).max() > 1e-3 and np.abs(d_gamma).max() > 0  # the surrogate really acts
        np.testing.assert_allclose(d_gamma, expected, rtol=1e-4, atol=1e-6 * np.abs(expected).max())
        d_bias = (expected * g * (1 - g / top)).sum()
        np.testing.assert_allclose(grads[2 * len(selections) + layer].numpy(), [d_bias], rtol=1e-4)


# ---- the base models alone -----------------------------------------------------------------------

@pytest.mark.parametrize("stem", BASES)
def test_base_logits_and_kv_cache(stem, kernels):
    folder, data, meta = golden_base(stem)
    model = load_base_model(str(folder), precision="fp32", **RUNTIME)
    assert model.adapter_parameters() == {}
    tokens = data["tokens"].astype(np.int32)
    assert max_abs(model.llama(jt.array(tokens)).numpy(), data["logits"]) <= 1e-4
    model.eval()
    assert max_abs(kv_logits(model.llama, tokens, meta["kv_prefill"]), data["kv_logits"]) <= 1e-4


# ---- bf16 ----------------------------------------------------------------------------------------

def test_parity_models_are_fp32():
    _, _, args = load_golden("sparse_s0")
    assert args.precision == "fp32" and ModelArgs().precision == "fp32"  # also the default
    model, _, _ = golden_model("sparse_s0")
    assert {str(p.dtype) for _, p in model.named_parameters()} == {"float32"}


@pytest.mark.parametrize("stem", MOA)
def test_adapted_loss_in_bf16_within_one_percent(stem):
    model, data, _ = golden_model(stem, precision="bf16")
    kinds = {name: str(p.dtype) for name, p in model.named_parameters()}
    assert kinds["llama.layers.0.attention.wq.weight"] == "bfloat16"
    assert kinds["llama.tok_embeddings.weight"] == "bfloat16" and kinds["llama.output.weight"] == "bfloat16"
    assert kinds["llama.layers.0.attention_norm.weight"] == "float32"
    assert all(dtype == "float32" for name, dtype in kinds.items() if name in model.adapter_parameters())
    loss, logits = golden_forward(model, data)
    assert logits.dtype == "float32"
    fp32_loss = float(data["loss"])
    assert abs(float(loss.item()) - fp32_loss) <= 0.01 * abs(fp32_loss)
    # the rounding is real: bf16 weights do not give the fp32 logits bit for bit
    assert np.abs(logits.numpy() - data["logits"]).max() > 1e-5


@pytest.mark.parametrize("stem", HF_BASES)
def test_base_in_bf16_within_bf16_tolerance(stem):
    """The bf16 files stay bf16 in the base; products take bf16 operands (fp32 sums), as autocast does."""
    folder, data, meta = golden_base(stem)
    model = load_base_model(str(folder), precision="bf16", **RUNTIME)
    assert all(p.dtype == "bfloat16" for p in model.base_parameters().values() if len(p.shape) == 2)
    tokens, bound = data["tokens"].astype(np.int32), 1e-2 * np.abs(data["logits"]).max()
    assert max_abs(model.llama(jt.array(tokens)).numpy(), data["logits"]) <= bound
    model.eval()
    assert max_abs(kv_logits(model.llama, tokens, meta["kv_prefill"]), data["kv_logits"]) <= bound


# ---- int8 ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("stem", BASES)
def test_base_in_int8_next_token_as_in_bf16(stem):
    """An int8 base (its matrices quantized as the checkpoint streams in, the embedding bf16) predicts every
    golden position's next token as the bf16 base does, its logits within 5% of their largest magnitude
    (they came within 1.4-2.0%), through the KV cache too."""
    folder, data, meta = golden_base(stem)
    logits, cached = {}, {}
    for precision in ("bf16", "int8"):
        model = load_base_model(str(folder), precision=precision, **RUNTIME)
        tokens = data["tokens"].astype(np.int32)
        with jt.no_grad():  # predicting, as Infer.py does (training's forward keeps gate and up in bf16)
            logits[precision] = model.llama(jt.array(tokens)).numpy()
        model.eval()
        cached[precision] = kv_logits(model.llama, tokens, meta["kv_prefill"])
    kinds = {name: str(p.dtype) for name, p in model.base_parameters().items()}
    assert kinds["llama.layers.0.feed_forward.w2.weight"] == "int8" and kinds["llama.tok_embeddings.weight"] == "bfloat16"
    bound = 5e-2 * np.abs(data["logits"]).max()
    for ours in (logits, cached):
        assert (ours["int8"].argmax(-1) == ours["bf16"].argmax(-1)).all()
        assert 1e-3 < max_abs(ours["int8"], ours["bf16"]) <= bound  # quantized, not the bf16 weights


@pytest.mark.parametrize("stem", MOA)
def test_adapted_loss_and_gradients_on_an_int8_base(stem):
    """The golden MoA models with their base quantized to int8: the loss within 1% of the authors' fp32 loss
    and every adapter gradient pointing as theirs (cosine at least 0.99; 0.998-0.9995 when written)."""
    model, data, _ = golden_model(stem)
    set_base_precision(model, "int8")
    assert model.llama.layers[0].attention.wq.weight.dtype == "int8"
    loss, _ = golden_forward(model, data)
    fp32_loss = float(data["loss"])
    assert abs(float(loss.item()) - fp32_loss) <= 0.01 * abs(fp32_loss)
    adapters = model.adapter_parameters()
    for name, grad in zip(adapters, jt.grad(loss, list(adapters.values()))):
        want = data[f"grad/{name}"].ravel().astype(np.float64)
        if np.abs(want).max() > 0:
            got = grad.numpy().ravel()
            assert got @ want / np.linalg.norm(got) / np.linalg.norm(want) >= 0.99, name
