"""The authors' adapter files both ways, on files their own code wrote (tests/fixtures/authors)."""
import json
import os
import shutil

import numpy as np
import pytest

import jittor as jt
from tiny_models import max_abs
from Models.formats import CheckpointError
from Models.formats.adapters import (assign_strict, export_authors_adapter, import_authors_adapter, load_adapter,
                                     read_adapter, read_adapter_config)
from Models.formats.authors import AUTHORS_PARAMS
from Models.formats.pth import PlainNamespace, load_pth
from Models.formats.pth_writer import save_pth
from Models.LLaMA_Adapter import LLaMA_adapter
from Models.ModelArgs import ModelArgs
from scripts import authors_adapter

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "authors")
BASE = ModelArgs(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=8, multiple_of=16, precision="fp32")  # parity in fp32
CASES = {"soft_e2_hydra": dict(variant="soft", expert_num=2, hydra_moe=True, p_adapter_hydra=True,
                               prompt_layers="0-1", prompt_len=2),
         "sparse": dict(variant="sparse", max_threshold=0.5, const_threshold=False)}


def fixture(case, name):
    return os.path.join(FIXTURES, case, name)


def their_json(case):
    with open(fixture(case, "adapter_params.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("case", CASES)
def test_their_adapter_imports_without_flags(case, tmp_path):
    """adapter.pth + their adapter_params.json -> our adapter dir, every tensor and setting kept."""
    theirs = load_pth(fixture(case, "adapter.pth"))
    assert all(isinstance(v, np.ndarray) for v in theirs.values())  # their flat dict
    import_authors_adapter(fixture(case, "adapter.pth"), str(tmp_path / "ours"), BASE)
    with open(tmp_path / "ours" / "adapter_params.json") as f:
        ours = json.load(f)
    expected = {"lora_layers": "0-1", "lora_rank": 2, "lora_targets": "Q,V,O,FFN_DOWN", "lora_alpha": 4.0,
                "p_adapter_layers": "0-1", "p_adapter_size": 4, "swi_x": 2, "max_seq_len": 24, **CASES[case]}
    assert {k: ours[k] for k in expected} == expected
    assert {k: ours[k] for k in ("dim", "n_layers", "vocab_size")} == {"dim": 16, "n_layers": 1, "vocab_size": 8}
    back = read_adapter(str(tmp_path / "ours"))
    assert sorted(back) == sorted(theirs) and all(np.array_equal(back[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize("case", CASES)
def test_their_checkpoint_imports_like_their_extracted_adapter(case, tmp_path):
    ckpt = load_pth(fixture(case, "checkpoint-0.pth"))
    assert isinstance(ckpt["args"], PlainNamespace) and vars(ckpt["args"])["lora_rank"] == 2
    assert isinstance(ckpt["optimizer"]["param_groups"][0]["betas"], tuple)
    shutil.copy(fixture(case, "checkpoint-0.pth"), tmp_path / "checkpoint-0.pth")  # no json beside it
    import_authors_adapter(str(tmp_path / "checkpoint-0.pth"), str(tmp_path / "from_ckpt"), BASE)
    import_authors_adapter(fixture(case, "adapter.pth"), str(tmp_path / "from_adapter"), BASE)
    a, b = read_adapter(str(tmp_path / "from_ckpt")), read_adapter(str(tmp_path / "from_adapter"))
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
    assert read_adapter_config(str(tmp_path / "from_ckpt")) == read_adapter_config(str(tmp_path / "from_adapter"))


@pytest.mark.parametrize("case", CASES)
def test_their_weights_give_their_logits(case):
    """Their full checkpoint loads name for name (base and adapter) and our forward gives their logits."""
    ref = np.load(fixture(case, "reference.npz"))
    model = LLaMA_adapter(ModelArgs(**{**BASE.to_dict(), **read_adapter_config(fixture(case, "adapter.pth"))}))
    state = load_pth(fixture(case, "checkpoint-0.pth"))["model"]
    assign_strict(dict(model.named_parameters()), state, case, "model")
    with jt.no_grad():
        logits = model.llama(jt.array(ref["tokens"].astype(np.int32))).numpy()
    assert max_abs(logits, ref["logits"]) <= 1e-4


@pytest.mark.parametrize("case", CASES)
def test_export_writes_their_layout_and_round_trips(case, tmp_path):
    import_authors_adapter(fixture(case, "adapter.pth"), str(tmp_path / "ours"), BASE)
    export_authors_adapter(str(tmp_path / "ours"), str(tmp_path / "theirs" / "adapter.pth"))
    assert their_json(case) == json.loads((tmp_path / "theirs" / "adapter_params.json").read_text())
    assert list(json.loads((tmp_path / "theirs" / "adapter_params.json").read_text())) == \
        list(AUTHORS_PARAMS[CASES[case]["variant"]])  # exactly their fields, so their ModelArgs(**json) takes it
    exported, original = load_pth(tmp_path / "theirs" / "adapter.pth"), load_pth(fixture(case, "adapter.pth"))
    assert sorted(exported) == sorted(original)
    assert all(np.array_equal(exported[k], original[k]) for k in original)
    # and back again: identical tensors; the exported file also loads into a model directly
    import_authors_adapter(str(tmp_path / "theirs" / "adapter.pth"), str(tmp_path / "again"), BASE)
    again = read_adapter(str(tmp_path / "again"))
    assert all(np.array_equal(again[k], original[k]) for k in original)
    model = LLaMA_adapter(ModelArgs(**{**BASE.to_dict(), **read_adapter_config(str(tmp_path / "again"))}))
    load_adapter(model, str(tmp_path / "theirs" / "adapter.pth"))
    assert all(np.array_equal(v.numpy(), original[k]) for k, v in model.adapter_parameters().items())


def write_theirs(tmp_path, case, **changes):
    folder = tmp_path / "theirs"
    folder.mkdir(exist_ok=True)
    shutil.copy(fixture(case, "adapter.pth"), folder / "adapter.pth")
    (folder / "adapter_params.json").write_text(json.dumps({**their_json(case), **changes}))
    return str(folder / "adapter.pth")


@pytest.mark.parametrize("case, option", [("sparse", "w_bias"), ("sparse", "adapter_noisy"), ("soft_e2_hydra", "w_bias")])
def test_unimplemented_option_is_an_error_naming_it(case, option, tmp_path):
    path = write_theirs(tmp_path, case, **{option: True})
    with pytest.raises(CheckpointError, match=rf"adapter_params.json.*'{option}'.*not implement"):
        import_authors_adapter(path, str(tmp_path / "ours"), BASE)


@pytest.mark.parametrize("case, option", [("sparse", "bool_weights"), ("soft_e2_hydra", "expert_weight")])
def test_option_without_effect_is_accepted(case, option, tmp_path):
    path = write_theirs(tmp_path, case, **{option: True})
    import_authors_adapter(path, str(tmp_path / "ours"), BASE)
    assert read_adapter_config(str(tmp_path / "ours"))["variant"] == CASES[case]["variant"]


def test_unknown_variant_and_missing_option_are_errors(tmp_path):
    fields = their_json("sparse")
    path = write_theirs(tmp_path, "sparse", expert_num=2)  # both variants' options
    with pytest.raises(CheckpointError, match="cannot tell which of the authors' methods"):
        import_authors_adapter(path, str(tmp_path / "ours"), BASE)
    (tmp_path / "theirs" / "adapter_params.json").write_text(
        json.dumps({k: v for k, v in fields.items() if k != "lora_rank"}))
    with pytest.raises(CheckpointError, match=r"missing option\(s\) \['lora_rank'\]"):
        import_authors_adapter(path, str(tmp_path / "ours"), BASE)


def test_flat_adapter_without_their_json_is_refused(tmp_path):
    save_pth(load_pth(fixture("sparse", "adapter.pth")), tmp_path / "adapter.pth")
    with pytest.raises(CheckpointError, match="neither the authors' checkpoint-N.pth"):
        import_authors_adapter(str(tmp_path / "adapter.pth"), str(tmp_path / "ours"), BASE)


def test_command_line_import_and_export(tmp_path):
    params = tmp_path / "base" / "params.json"
    params.parent.mkdir()
    params.write_text(json.dumps({k: BASE.to_dict()[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads",
                                                                  "vocab_size", "multiple_of")}))
    authors_adapter.main(["import", fixture("soft_e2_hydra", "checkpoint-0.pth"), str(tmp_path / "ours"),
                      "--llama_path", str(params.parent)])
    authors_adapter.main(["export", str(tmp_path / "ours"), str(tmp_path / "theirs" / "adapter.pth")])
    assert their_json("soft_e2_hydra") == json.loads((tmp_path / "theirs" / "adapter_params.json").read_text())
    exported, original = load_pth(tmp_path / "theirs" / "adapter.pth"), load_pth(fixture("soft_e2_hydra", "adapter.pth"))
    assert sorted(exported) == sorted(original) and all(np.array_equal(exported[k], original[k]) for k in original)
    with pytest.raises(SystemExit) as info:  # an adapter without its json: a clear error, no traceback
        authors_adapter.main(["export", str(tmp_path / "nothing" / "adapter.pth"), str(tmp_path / "x.pth")])
    assert info.value.code == 2
