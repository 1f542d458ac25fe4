"""Activation recomputation (--recompute, Models/recompute.py): a layer that keeps only its input gives the gradients
of the stored path, to the bit (the same kernels run on the same numbers a second time), holds one layer's
activations at the step's peak, and the memory check counts and chooses it."""
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, log_records, squeezed_memory, train, write_synthetic_splits
from tiny_models import BASELINES, MIXTURES, MOA, randomize_adapters

import Utils.jittor_env  # noqa: F401
import jittor as jt
from Data.tiny_base import ensure_default_base, write_random_hf_base
from Models import memory, recompute
from Models.formats.base_model import load_base_model
from Models.formats.pth import load_pth
from Models.ModelArgs import ModelArgs

TOKENS = np.random.default_rng(3).integers(0, 387, (2, 40))  # the tiny bases' tokenizers have 387 tokens


def adapter_gradients(path, settings, recompute_on, monkeypatch) -> tuple:
    """(loss, {name: gradient}, the layers recomputed, the model's layers) of one training step's loss on TOKENS,
    adapters random."""
    model = load_base_model(path, max_seq_len=64, recompute=recompute_on, **settings)
    model.train()
    randomize_adapters(model, seed=0, scale=0.05)
    rebuilt = []
    grad = recompute.Recomputed.grad
    monkeypatch.setattr(recompute.Recomputed, "grad", lambda self, *g: rebuilt.append(self) or grad(self, *g))
    loss, _ = model(jt.array(TOKENS), jt.ones(TOKENS.shape), with_logits=False)
    trained = {name: p for name, p in model.adapter_parameters().items() if not p.is_stop_grad()}
    gradients = dict(zip(trained, (g.numpy() for g in jt.grad(loss, list(trained.values())))))
    return loss.item(), gradients, len(rebuilt), model.args.n_layers


CASES = {"sparse-fp32": (MOA["sparse"], "fp32"), "soft-bf16": (dict(MOA["soft"], prompt_len=3), "bf16"),
         "sparse-int8": (MOA["sparse"], "int8"), "topk-fp32": (MIXTURES["topk"], "fp32"),  # topk: its aux loss
         "unipeft-fp32": (BASELINES["unipeft"], "fp32"), "hydralora-bf16": (MIXTURES["hydralora"], "bf16")}


@pytest.mark.parametrize("case", list(CASES))
def test_recomputed_layers_give_the_stored_gradients_to_the_bit(case, tiny_qwen3, monkeypatch):
    """Each layer's second forward runs the kernels the first ran on the same input, so every adapter gradient
    equals the stored path's exactly, the load-balancing term's (topk, an output of the layer) included; and the
    backward did rebuild every layer."""
    settings, precision = CASES[case]
    stored = adapter_gradients(tiny_qwen3, {**settings, "precision": precision}, False, monkeypatch)
    rebuilt = adapter_gradients(tiny_qwen3, {**settings, "precision": precision}, True, monkeypatch)
    assert stored[2] == 0 and rebuilt[2] == rebuilt[3] == 2
    assert stored[0] == rebuilt[0] and set(stored[1]) == set(rebuilt[1])
    assert max(float(np.abs(g).max()) for g in stored[1].values()) > 1e-4  # they are gradients, not zeros
    for name, gradient in stored[1].items():
        np.testing.assert_array_equal(rebuilt[1][name], gradient, err_msg=name)


PEAK_OF_A_STEP = """
import sys
import numpy as np
import Utils.jittor_env
import jittor as jt
from Models.LLaMA_Adapter import LLaMA_adapter
from Models.ModelArgs import ModelArgs
args = ModelArgs(dim=128, n_layers=int(sys.argv[1]), n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=64,
                 max_seq_len=128, recompute=sys.argv[2] == "on", lora_layers="all", p_adapter_layers="all")
model = LLaMA_adapter(args)
model.train()
tokens = jt.array(np.random.default_rng(0).integers(0, 256, (8, 128)).astype(np.int32))
jt.flags.profile_memory_enable = 1
loss, _ = model(tokens, jt.ones((8, 128)), with_logits=False)
jt.sync(jt.grad(loss, list(model.adapter_parameters().values())))
weights = sum(p.nbytes for p in model.parameters()) + sum(p.nbytes for p in model.adapter_parameters().values())
print(int(jt.get_max_memory_info().split("[")[0]) - weights)  # less the weights and the adapters' gradients
"""


def peak_bytes(n_layers: int, recompute_on: bool) -> int:
    """Jittor's allocations at the peak of a training step's forward and backward, 8 x 128 tokens, dim 128, less the
    model's weights and its adapters' gradients (in a process of its own: the profiler keeps its process's peak)."""
    run = subprocess.run([sys.executable, "-c", PEAK_OF_A_STEP, str(n_layers), "on" if recompute_on else "off"],
                         cwd=REPO, capture_output=True, text=True, check=True)
    return int(run.stdout.split()[-1])


def test_a_recomputed_step_holds_each_layers_input_and_one_layers_activations():
    """Per layer (3 against 7 layers: the peak is the top layer's backward either way) the stored step's peak grows by
    every activation a layer keeps, 16 times its input here; the recomputed one's by its input and a little (1.6
    times; before Models/recompute.released dropped the Functions' references, by the stored figure)."""
    x = 4 * 1024 * 128  # a layer's input: fp32, 8 x 128 tokens of dim 128
    stored = (peak_bytes(7, False) - peak_bytes(3, False)) / 4
    recomputed = (peak_bytes(7, True) - peak_bytes(3, True)) / 4
    assert stored > 12 * x and x <= recomputed <= 2 * x, (stored / x, recomputed / x)


QWEN3_32B = dict(architecture="qwen3", dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, head_dim=128, ffn_dim=25600,
                 vocab_size=151936, qk_norm=True, max_seq_len=300)


def test_the_memory_check_counts_the_activations_kept_or_recomputed():
    """A step's activations: every layer's, or each layer's input (twice) and one layer's; each layer's graph and the
    loss's logits either way. Qwen3-32B at 1 x 300 tokens: 9.9 GB kept, 1.34 GB recomputed (fp32; 7.1 GB kept in
    int8)."""
    args = ModelArgs(**QWEN3_32B)
    one = memory.layer_activation_bytes(args, 300)
    assert one == 4 * 300 * (8 * 5120 + 2 * 8192 + 2 * 1024 + 2.5 * 25600)
    loss = memory.loss_bytes(args, 300)
    assert loss == 2 * 2 * memory.LOGIT_BYTES  # 300 x 151936 logits pass the two lazy chunks
    graphs = 64 * (4 << 20)
    assert memory.activation_bytes(args, 1, 300, False) == 64 * one + graphs + loss
    assert memory.activation_bytes(args, 1, 300, True) == 64 * 2 * 4 * 300 * 5120 + one + graphs + loss
    assert round(memory.activation_bytes(args, 1, 300, False) / 1e9, 2) == 9.88
    assert round(memory.activation_bytes(args, 1, 300, True) / 1e9, 2) == 1.34
    int8 = ModelArgs(**QWEN3_32B, precision="int8")  # bf16 products: the FFN's branches kept as bf16 bits
    assert memory.layer_activation_bytes(int8, 300) == 4 * 300 * (6 * 5120 + 2 * 8192 + 2 * 1024 + 1.5 * 25600)
    assert round(memory.activation_bytes(int8, 1, 300, False) / 1e9, 2) == 7.13


def test_the_memory_check_chooses_recompute_where_kept_activations_would_not_fit():
    """--recompute's default: off while the step fits with every layer's activations kept, on past that by one byte;
    a step that fits only recomputed is refused with --no-recompute, naming the flag that makes it fit."""
    args = ModelArgs(dim=256, n_layers=16, n_heads=4, vocab_size=1000, multiple_of=64, max_seq_len=300)
    fixed = memory.base_bytes(args) + memory.rope_table_bytes(args)
    kept = fixed + memory.activation_bytes(args, 4, 300, False)
    assert fixed + memory.activation_bytes(args, 4, 300, True) < kept
    assert not memory.needs_recompute(args, 4, 300, available=kept)
    assert memory.needs_recompute(args, 4, 300, available=kept - 1)
    memory.check_memory(ModelArgs(**{**args.to_dict(), "recompute": False}), "f", 4, 300, available=kept,
                        training=True)
    memory.check_memory(ModelArgs(**{**args.to_dict(), "recompute": True}), "f", 4, 300, available=kept - 1,
                        training=True)
    with pytest.raises(ValueError, match=r"f: the model needs .*the activations of 4 rows x 300 tokens a rank \(every "
                                         r"layer's\) .*: use --recompute, or lower --batch_size or --max_seq_len"):
        memory.check_memory(ModelArgs(**{**args.to_dict(), "recompute": False}), "f", 4, 300, available=kept - 1,
                            training=True)


# ---- whole runs: the same adapter after three steps ------------------------------------------------------------

BASES = {  # write_random_hf_base's settings (tests/test_train_matrix.py's shapes), and the demo's own base
    "qwen3-128-384": dict(architecture="qwen3", dim=128, ffn_dim=384, n_heads=4, n_kv_heads=2, head_dim=40, tied=True,
                          vocab_size=431),
    "llama-96-256": dict(architecture="llama", dim=96, ffn_dim=256, n_heads=4, n_kv_heads=2, tied=False,
                         vocab_size=420),
    "demo": None,
}
RUNS = [("qwen3-128-384", "sparse", "fp32"), ("qwen3-128-384", "soft", "bf16"), ("llama-96-256", "soft", "fp32"),
        ("llama-96-256", "sparse", "bf16"), ("demo", "sparse", "fp32"), ("demo", "soft", "bf16")]


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return {name: ensure_default_base() if settings is None else
            write_random_hf_base(str(tmp_path_factory.mktemp(name)), seed=i, **settings)
            for i, (name, settings) in enumerate(BASES.items())}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_synthetic_splits(tmp_path_factory.mktemp("recompute_data"), 12, 0, seed=7)


@pytest.mark.slow
@pytest.mark.parametrize("base, variant, precision", RUNS, ids=["-".join(r) for r in RUNS])
def test_training_with_recompute_makes_the_stored_paths_adapter(base, variant, precision, bases, data, tmp_path):
    """Math.py for three steps with --recompute and with --no-recompute: the same losses and the same adapter, to
    the bit (fp32 and bf16: the second forward repeats the first's rounding, so nothing is left to round apart)."""
    import Math
    adapters, losses = {}, {}
    for flag in ("--recompute", "--no-recompute"):
        out = tmp_path / flag.strip("-")
        argv = ["--recipe", "demo", "--variant", variant, "--precision", precision, "--llama_path", bases[base],
                "--data_path", data["train"], "--output_dir", out, "--max_steps", 3, "--batch_size", 2,
                "--max_seq_len", 160, "--eval_interval", 0, "--log_interval", 1, "--val_fraction", 0, flag,
                *(["--prompt_len", 3] if variant == "soft" else [])]
        assert Math.main([str(a) for a in argv]) == 0, flag
        adapters[flag] = load_pth(out / "adapter" / "adapter.pth")
        losses[flag] = [r["train_loss"] for r in log_records(out, "train")]
    assert len(losses["--recompute"]) == 3 and losses["--recompute"] == losses["--no-recompute"]
    kept, rebuilt = adapters["--no-recompute"], adapters["--recompute"]
    assert set(kept) == set(rebuilt) and max(float(np.abs(t).max()) for k, t in kept.items() if "lora_B" in k) > 0
    for name, tensor in kept.items():
        np.testing.assert_array_equal(rebuilt[name], tensor, err_msg=name)


@pytest.mark.slow
def test_math_recomputes_by_default_where_kept_activations_would_not_fit(tiny_base, synthetic_data, tmp_path,
                                                                          monkeypatch, capsys):
    """With less memory than a step takes with every layer's activations kept and more than it takes recomputed,
    Math.py turns --recompute on by itself, says so, and trains with every layer rebuilt in the backward."""
    squeezed_memory(monkeypatch)
    rebuilt = []
    grad = recompute.Recomputed.grad
    monkeypatch.setattr(recompute.Recomputed, "grad", lambda self, *g: rebuilt.append(self) or grad(self, *g))
    assert train(tiny_base, synthetic_data, tmp_path / "out", "--max_steps", 1) == 0
    assert "--recompute on: with every layer's activations kept a step would not fit" in capsys.readouterr().out
    assert len(rebuilt) == 2  # the tiny base's two layers, one step
