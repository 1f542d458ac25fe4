"""The README's parity table: for every golden file, the largest differences between our model and the
reference (the authors' PyTorch code, or transformers for the base models) that tests/test_golden.py bounds.

    ~/.venvs/moa-jittor/bin/python tests/parity_table.py        # fp32, the fused kernels (the default path)
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import numpy as np  # noqa: E402

from tiny_models import kv_logits, max_abs  # noqa: E402
from golden_files import golden_forward, golden_model  # noqa: E402
import jittor as jt  # noqa: E402
from Models import load_base_model  # noqa: E402
from test_golden import ADAPTED, BASES, RUNTIME, golden_base  # noqa: E402


def adapted_row(stem) -> list:
    model, data, meta = golden_model(stem)
    loss, logits = golden_forward(model, data)
    adapter = model.adapter_parameters()
    worst = max(max_abs(g.numpy(), data[f"grad/{name}"]) / max(np.abs(data[f"grad/{name}"]).max(), 1e-12)
                for name, g in zip(adapter, jt.grad(loss, list(adapter.values()))) if name not in meta["grad_none"])
    model.eval()
    kv = max_abs(kv_logits(model.llama, data["tokens"].astype(np.int32), meta["kv_prefill"]), data["kv_logits"])
    return [max_abs(logits.numpy(), data["logits"]), abs(float(loss.item()) - float(data["loss"])), worst, kv]


def base_row(stem) -> list:
    folder, data, meta = golden_base(stem)
    model = load_base_model(str(folder), precision="fp32", **RUNTIME)
    tokens = data["tokens"].astype(np.int32)
    logits = max_abs(model.llama(jt.array(tokens)).numpy(), data["logits"])
    model.eval()
    return [logits, None, None, max_abs(kv_logits(model.llama, tokens, meta["kv_prefill"]), data["kv_logits"])]


def main():
    print("| golden file (`tests/golden/`) | logits | loss | gradients (worst tensor, relative) | KV-cache logits |")
    print("| --- | --- | --- | --- | --- |")
    for stem in ADAPTED + BASES:
        row = adapted_row(stem) if stem in ADAPTED else base_row(stem)
        cells = ["-" if v is None else "0" if v == 0 else f"{v:.1e}" for v in row]
        print(f"| `{stem}` | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
