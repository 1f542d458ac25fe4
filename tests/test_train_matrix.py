"""Sparse and Soft MoA with each recipe's adapters train on random Hugging Face bases of sizes users have (Qwen3
and LLaMA, tied and untied, a padded vocabulary, FFN widths 352 and 384, head_dim apart from dim / heads, GQA),
in fp32, bf16, int8 and nf4, finite and with the fused kernels' adapter equal to the plain kernels'. Each run trains
with the CPU's denormal modes cleared in the OpenMP pool (tests/kernel_inputs.denormal_mode): the fused AdamW took
NaN there from the first step. A covering set: every recipe in both variants, every base and every precision."""
import numpy as np
import pytest
from conftest import log_records, write_synthetic_splits

from kernel_inputs import denormal_mode
from Data.tiny_base import write_random_hf_base
from Models.formats.pth import load_pth
from Models.kernels import switch

pytestmark = pytest.mark.slow

BASES = {  # name: write_random_hf_base's settings
    "qwen3-128-384": dict(architecture="qwen3", dim=128, ffn_dim=384, n_heads=4, n_kv_heads=2, head_dim=40, tied=True,
                          vocab_size=431),
    "llama-96-256": dict(architecture="llama", dim=96, ffn_dim=256, n_heads=4, n_kv_heads=2, tied=False, vocab_size=420),
    "llama-128-352": dict(architecture="llama", dim=128, ffn_dim=352, n_heads=8, n_kv_heads=2, tied=True),
    "qwen3-80-200": dict(architecture="qwen3", dim=80, ffn_dim=200, n_heads=5, n_kv_heads=1, head_dim=16, tied=False),
}
RUNS = [("demo", "sparse", "fp32", "qwen3-128-384"), ("demo", "soft", "int8", "llama-96-256"),
        ("math", "sparse", "bf16", "llama-96-256"), ("math", "soft", "fp32", "llama-128-352"),
        ("commonsense", "sparse", "int8", "qwen3-80-200"), ("commonsense", "soft", "bf16", "qwen3-128-384"),
        ("code", "sparse", "fp32", "llama-128-352"), ("code", "soft", "bf16", "qwen3-80-200"),
        ("math", "soft", "nf4", "qwen3-80-200")]  # nf4: in-dimensions 80 and 200 end in short groups and blocks
# AdamW's first updates move each weight by about lr whatever its gradient's size, so an element whose gradient is
# near 0 can take either sign from the smallest difference: the adapters agree in their mean absolute difference
# over their mean size, and the losses step by step. fp32: 1% (summation orders); with a bf16, int8 or nf4 base the
# plain side's products are fp32 (bf16 is the fused kernels' rule), so the gradients differ by bf16's rounding of
# the activations: 10%, the losses within 1%
TOLERANCE = {"fp32": 1e-2, "bf16": 0.1, "int8": 0.1, "nf4": 0.1}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return {name: write_random_hf_base(str(tmp_path_factory.mktemp(name)), seed=i, **settings)
            for i, (name, settings) in enumerate(BASES.items())}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_synthetic_splits(tmp_path_factory.mktemp("matrix_data"), 24, 0, seed=7)


@pytest.mark.parametrize("recipe, variant, precision, base", RUNS, ids=["-".join(r) for r in RUNS])
def test_moa_trains_on_hf_bases_with_fused_kernels_as_with_plain(recipe, variant, precision, base, bases, data, tmp_path,
                                                                 monkeypatch):
    import Math
    adapters = {}
    for side in ("fused", "plain"):
        with monkeypatch.context() as patch, denormal_mode(False) as clear_again:
            if side == "plain":
                patch.setattr(switch, "fused_kernels_on", lambda: False)
            clear_again()
            out = tmp_path / side
            argv = ["--recipe", recipe, "--variant", variant, "--precision", precision, "--llama_path", bases[base],
                    "--data_path", data["train"], "--output_dir", out, "--max_steps", 3, "--batch_size", 2,
                    "--max_seq_len", 160, "--eval_interval", 0, "--log_interval", 1, "--val_fraction", 0,
                    *(["--prompt_len", 3] if variant == "soft" else [])]
            assert Math.main([str(a) for a in argv]) == 0, side
        adapters[side] = load_pth(out / "adapter" / "adapter.pth")
    fused, plain = adapters["fused"], adapters["plain"]
    assert set(fused) == set(plain) and ("prompt" in " ".join(fused)) == (variant == "soft")
    assert all(np.isfinite(t).all() for t in fused.values())
    assert max(float(np.abs(t).max()) for k, t in fused.items() if "lora_B" in k) > 0  # it trained
    error = {k: np.abs(fused[k] - plain[k]).mean() / max(np.abs(plain[k]).mean(), 1e-30) for k in fused}
    losses = [[r["train_loss"] for r in log_records(tmp_path / side, "train")] for side in ("fused", "plain")]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-4 if precision == "fp32" else 1e-2)
    worst = max(error, key=error.get)
    assert error[worst] <= TOLERANCE[precision], (worst, error[worst])
