"""Models/formats/pth.py and pth_writer.py: the torch-free, allow-list reader and the writer of torch zip checkpoints."""
import argparse
import collections
import os
import pickle
import struct
import zipfile

import numpy as np
import pytest

from conftest import GOLDEN
from Models.formats import CheckpointError
from Models.formats.pth import PlainNamespace, load_pth
from Models.formats.pth_writer import save_pth
from Models.formats.tensor_bytes import bf16_bits_to_float32, float32_to_bf16_bits

# ---- hand-built pickles: torch is not a dependency, so checkpoints are assembled from opcodes


def _global(module, name):
    return f"c{module}\n{name}\n".encode()


def _str(text):
    data = text.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def _int(n):
    return b"J" + struct.pack("<i", n)


def _tuple(*items):
    return b"(" + b"".join(items) + b"t"


def _call(func, *args):
    return func + _tuple(*args) + b"R"


def _tensor(key, numel, offset, size, stride, storage=_global("torch", "FloatStorage"),
            rebuild="_rebuild_tensor_v2", extra=()):
    """torch._utils.<rebuild>(storage, offset, size, stride, False, OrderedDict(), *extra)."""
    pid = _tuple(_str("storage"), storage, _str(key), _str("cpu"), _int(numel)) + b"Q"
    hooks = _call(_global("collections", "OrderedDict"))
    return _call(_global("torch._utils", rebuild), pid, _int(offset), _tuple(*map(_int, size)),
                 _tuple(*map(_int, stride)), b"\x89", hooks, *extra)


def _dict_pickle(**entries):
    return b"\x80\x02}(" + b"".join(_str(k) + v for k, v in entries.items()) + b"u."


def _write_zip(path, data_pkl, storages=None, prefix="archive"):
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{prefix}/data.pkl", data_pkl)
        archive.writestr(f"{prefix}/byteorder", "little")
        for key, raw in (storages or {}).items():
            archive.writestr(f"{prefix}/data/{key}", raw)
        archive.writestr(f"{prefix}/version", "3\n")
    return path


# ---- (a) the golden Meta checkpoint

GOLDEN_SHAPES = {"tok_embeddings.weight": (97, 64), "norm.weight": (64,), "output.weight": (97, 64)}
for _i in range(2):
    GOLDEN_SHAPES.update({
        f"layers.{_i}.attention.wq.weight": (64, 64), f"layers.{_i}.attention.wo.weight": (64, 64),
        f"layers.{_i}.attention.wk.weight": (32, 64), f"layers.{_i}.attention.wv.weight": (32, 64),
        f"layers.{_i}.feed_forward.w1.weight": (176, 64), f"layers.{_i}.feed_forward.w3.weight": (176, 64),
        f"layers.{_i}.feed_forward.w2.weight": (64, 176),
        f"layers.{_i}.attention_norm.weight": (64,), f"layers.{_i}.ffn_norm.weight": (64,)})


def test_golden_meta_checkpoint_loads_as_bf16_valued_float32(tiny_meta):
    state = load_pth(tiny_meta / "consolidated.00.pth")
    assert len(state) == 21
    assert {name: value.shape for name, value in state.items()} == GOLDEN_SHAPES
    for name, value in state.items():
        assert value.dtype == np.float32 and value.flags.c_contiguous, name
        assert not np.any(value.view(np.uint32) & 0xFFFF), f"{name} is not bf16-valued"
        assert np.all(np.isfinite(value)) and np.any(value != 0), name


def test_golden_values_are_the_float32_base_weights_rounded_to_bf16(tiny_meta):
    state = load_pth(tiny_meta / "consolidated.00.pth")
    with np.load(GOLDEN / "sparse_s0.npz", allow_pickle=False) as ref:
        for name, value in state.items():
            expected = bf16_bits_to_float32(float32_to_bf16_bits(ref[f"param/llama.{name}"]))
            np.testing.assert_array_equal(value, expected, err_msg=name)


# ---- (b) round trips through save_pth


def test_fp32_round_trip_is_exact_and_keeps_nested_structure(tmp_path):
    rng = np.random.default_rng(0)
    model = collections.OrderedDict([
        ("w", rng.standard_normal((5, 3)).astype(np.float32)),
        ("transposed", rng.standard_normal((3, 4)).astype(np.float32).T),  # non-contiguous input
        ("steps", np.arange(4, dtype=np.int64)), ("mask", np.array([True, False])),
        ("scalar", np.array(2.5, np.float32)), ("empty", np.zeros((0, 4), np.float32)),
        ("f64", rng.standard_normal(3)), ("f16", np.array([0.1, -2], np.float16))])
    obj = {"model": model, "epoch": 3, "name": "moa", "lr": 1e-4, "big": 2**40,
           "args": {"layers": [0, 1], "span": (0, 2), "flag": None}}
    path = tmp_path / "ckpt.pth"
    save_pth(obj, path)
    back = load_pth(path)
    assert type(back["model"]) is collections.OrderedDict and list(back["model"]) == list(model)
    for name, array in model.items():
        got = back["model"][name]
        assert got.dtype == array.dtype and got.shape == array.shape, name
        np.testing.assert_array_equal(got, array, err_msg=name)
    assert {k: v for k, v in back.items() if k != "model"} == {k: v for k, v in obj.items() if k != "model"}


def test_bf16_save_rounds_to_nearest_even(tmp_path):
    one = np.float32(1)
    values = np.array([
        1 + 2**-8,            # exact tie between 1 and 1+2^-7: stays on the even 1
        1 + 3 * 2**-8,        # exact tie between 1+2^-7 and 1+2^-6: goes up to the even 1+2^-6
        1 + 2**-8 + 2**-20,   # just above a tie: rounds up to 1+2^-7
        1 + 2**-9,            # below half: rounds down to 1
        -(1 + 3 * 2**-8), np.inf, -np.inf, 3.4e38], np.float32)
    expected = np.array([1, 1 + 2**-6, 1 + 2**-7, 1, -(1 + 2**-6), np.inf, -np.inf, np.inf], np.float32)
    path = tmp_path / "bf16.pth"
    save_pth({"model": {"v": values, "nan": np.array([np.nan], np.float32), "ids": np.arange(3)}}, path,
             bf16=True)
    back = load_pth(path)["model"]
    np.testing.assert_array_equal(back["v"], expected)
    assert back["v"][0] == one and np.isnan(back["nan"]).all()
    assert back["ids"].dtype == np.int64  # only floating arrays become bfloat16
    with zipfile.ZipFile(path) as archive:
        assert b"BFloat16Storage" in archive.read("archive/data.pkl")
        assert archive.getinfo("archive/data/0").file_size == 2 * values.size


def test_written_zip_has_torch_layout(tmp_path):
    path = tmp_path / "layout.pth"
    save_pth({"a": np.ones(3, np.float32), "b": np.zeros((2, 2), np.int32)}, path)
    raw = path.read_bytes()
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        assert names[0] == "archive/data.pkl" and names[-1] == "archive/version"
        assert {"archive/data/0", "archive/data/1", "archive/byteorder"} <= set(names)
        for info in archive.infolist():
            assert info.compress_type == zipfile.ZIP_STORED
            name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
            assert (info.header_offset + 30 + name_len + extra_len) % 64 == 0, info.filename
    assert [p.name for p in tmp_path.iterdir()] == ["layout.pth"]  # no temp file left behind


def test_failed_save_leaves_no_file(tmp_path):
    with pytest.raises(CheckpointError, match="object"):
        save_pth({"bad": object()}, tmp_path / "x.pth")
    assert list(tmp_path.iterdir()) == []


# ---- views, shared storages and untyped storages, as torch writes them


def test_strided_views_and_untyped_storage(tmp_path):
    base = np.arange(12, dtype=np.float32)
    data_pkl = _dict_pickle(
        whole=_tensor("0", 12, 0, (3, 4), (4, 1)),
        transposed=_tensor("0", 12, 0, (4, 3), (1, 4)),       # same storage, other view
        sliced=_tensor("0", 12, 5, (2, 2), (4, 2)),
        halves=_tensor("1", 4, 1, (3,), (1,), storage=_global("torch", "BFloat16Storage")),
        u16=_tensor("2", 4, 0, (2,), (1,), storage=_global("torch.storage", "UntypedStorage"),
                    rebuild="_rebuild_tensor_v3", extra=[_global("torch", "uint16")]),
        param=_call(_global("torch._utils", "_rebuild_parameter"),
                    _tensor("0", 12, 0, (2,), (1,)), b"\x88", _call(_global("collections", "OrderedDict"))))
    bf16 = float32_to_bf16_bits(np.array([0.5, 1.5, -2, 3], np.float32))
    path = _write_zip(tmp_path / "views.pth", data_pkl, {
        "0": base.tobytes(), "1": bf16.tobytes(), "2": np.array([7, 65535], np.uint16).tobytes()})
    got = load_pth(path)
    grid = base.reshape(3, 4)
    np.testing.assert_array_equal(got["whole"], grid)
    np.testing.assert_array_equal(got["transposed"], grid.T)
    np.testing.assert_array_equal(got["sliced"], grid[1:, 1::2])
    np.testing.assert_array_equal(got["halves"], np.array([1.5, -2, 3], np.float32))
    np.testing.assert_array_equal(got["u16"], np.array([7, 65535], np.uint16))
    np.testing.assert_array_equal(got["param"], base[:2])


def test_view_past_its_storage_is_refused(tmp_path):
    path = _write_zip(tmp_path / "oob.pth", _dict_pickle(w=_tensor("0", 4, 2, (3,), (1,))),
                      {"0": np.zeros(4, np.float32).tobytes()})
    with pytest.raises(CheckpointError, match="reads element 4 of 4") as info:
        load_pth(path)
    assert str(path) in str(info.value)


def test_short_storage_record_names_file_and_key(tmp_path):
    path = _write_zip(tmp_path / "short.pth", _dict_pickle(w=_tensor("0", 4, 0, (4,), (1,))),
                      {"0": b"\0" * 8})
    with pytest.raises(CheckpointError, match="storage '0' has 8 bytes, expected 16") as info:
        load_pth(path)
    assert str(path) in str(info.value)


def test_shared_and_cyclic_containers_load_quickly(tmp_path):
    nested = b"]q\x00h\x00a"  # a list that contains itself
    for _ in range(60):  # each level holds the previous one twice: 2^60 paths, 60 objects
        nested = b"](" + nested + b"q\x01h\x01e"
    got = load_pth(_write_zip(tmp_path / "dag.pth", b"\x80\x02" + nested + b"."))
    assert got[0] is got[1]


def test_build_cannot_alter_the_allowed_markers(tmp_path):
    """BUILD sets attributes on whatever it is given; the shared markers must not change."""
    poison = _global("torch", "float32") + b"}(" + _str("numpy_code") + _str("i1") + b"ub0"
    path = _write_zip(tmp_path / "poison.pth", b"\x80\x02" + poison + _dict_pickle()[2:])
    with pytest.raises(CheckpointError, match="bad data.pkl"):
        load_pth(path)
    clean = _write_zip(tmp_path / "clean.pth", _dict_pickle(w=_tensor("0", 1, 0, (1,), (1,))),
                       {"0": np.float32(1.5).tobytes()})
    assert load_pth(clean)["w"].dtype == np.float32


# ---- (c) safety: a checkpoint that would run a command under plain pickle


class _RunsCommand:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _payloads(marker):
    touch = f"touch {marker}"
    return {
        "os.system": _call(_global("os", "system"), _str(touch)),
        "builtins.eval": _call(_global("builtins", "eval"), _str(f"__import__('os').system('{touch}')")),
        "subprocess.check_call": _call(_global("subprocess", "check_call"),
                                       b"](" + _str("touch") + _str(str(marker)) + b"e"),
        "numpy.core.multiarray._reconstruct": _call(_global("numpy.core.multiarray", "_reconstruct"),
                                                    _str("x")),
    }


def test_payload_is_live_under_plain_pickle(tmp_path):
    """Control: the os.system payload really runs under pickle.loads, so the refusals below mean something."""
    marker = tmp_path / "ran"
    pickle.loads(b"\x80\x02" + _payloads(marker)["os.system"] + b".")
    assert marker.exists()


@pytest.mark.parametrize("refused", ["os.system", "builtins.eval", "subprocess.check_call",
                                     "numpy.core.multiarray._reconstruct"])
@pytest.mark.parametrize("beside_a_tensor", [False, True])
def test_malicious_global_is_refused_before_it_runs(tmp_path, refused, beside_a_tensor):
    marker = tmp_path / "ran"
    payload = _payloads(marker)[refused]
    if beside_a_tensor:
        data_pkl = _dict_pickle(w=_tensor("0", 2, 0, (2,), (1,)), evil=payload)
    else:
        data_pkl = b"\x80\x02" + payload + b"."
    path = _write_zip(tmp_path / "evil.pth", data_pkl, {"0": np.ones(2, np.float32).tobytes()})
    with pytest.raises(CheckpointError, match=f"refusing to load global '{refused}'") as info:
        load_pth(path)
    assert str(path) in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize("protocol", [2, 4])  # GLOBAL and STACK_GLOBAL opcodes
def test_reduce_object_payload_is_refused(tmp_path, protocol):
    marker = tmp_path / "ran"
    data_pkl = pickle.dumps({"evil": _RunsCommand(f"touch {marker}")}, protocol=protocol)
    path = _write_zip(tmp_path / "evil.pth", data_pkl)
    with pytest.raises(CheckpointError, match=rf"refusing to load global '{os.system.__module__}\.system'"):
        load_pth(path)
    assert not marker.exists()


# ---- argparse.Namespace: the authors' checkpoint-N.pth keeps its run's args as one


def test_namespace_of_plain_values_loads(tmp_path):
    """As torch.save pickles it (protocol 2: GLOBAL, NEWOBJ, BUILD with the attribute dict)."""
    args = argparse.Namespace(lr=None, blr=6e-3, lora_layers="0-32", epochs=2, pin_mem=True,
                              betas=(0.9, 0.95), milestones=[1, 2])
    path = _write_zip(tmp_path / "checkpoint-1.pth", pickle.dumps({"args": args, "epoch": 1}, protocol=2))
    loaded = load_pth(path)
    assert isinstance(loaded["args"], PlainNamespace) and vars(loaded["args"]) == vars(args)
    assert loaded["epoch"] == 1


def _namespace(state):
    """argparse.Namespace() filled by BUILD from `state` (pickle opcodes)."""
    return _global("argparse", "Namespace") + b")\x81" + state + b"b"


@pytest.mark.parametrize("state, why", [
    (b"}(" + _str("w") + _tensor("0", 2, 0, (2,), (1,)) + b"u", "non-plain"),  # a tensor
    (b"}(" + _str("sub") + b"}(" + _str("a") + _int(1) + b"uu", "non-plain"),  # a container
    (b"}(" + _str("__class__") + _str("x") + b"u", "non-plain"),  # a dunder name
    (_str("not a dict"), "non-plain"),
])
def test_namespace_with_anything_but_plain_values_is_refused(tmp_path, state, why):
    path = _write_zip(tmp_path / "ns.pth", _dict_pickle(args=_namespace(state)),
                      {"0": np.ones(2, np.float32).tobytes()})
    with pytest.raises(CheckpointError, match=why) as info:
        load_pth(path)
    assert str(path) in str(info.value)


def test_namespace_built_with_arguments_is_refused(tmp_path):
    path = _write_zip(tmp_path / "ns.pth", _dict_pickle(args=_call(_global("argparse", "Namespace"), _str("x"))))
    with pytest.raises(CheckpointError, match="rebuilt empty"):
        load_pth(path)


def test_payload_inside_a_namespace_is_refused_before_it_runs(tmp_path):
    marker = tmp_path / "ran"
    state = b"}(" + _str("evil") + _payloads(marker)["os.system"] + b"u"
    path = _write_zip(tmp_path / "ns.pth", _dict_pickle(args=_namespace(state)))
    with pytest.raises(CheckpointError, match="refusing to load global 'os.system'"):
        load_pth(path)
    assert not marker.exists()


# ---- (d) files that are not torch zip checkpoints


def test_garbage_file_names_the_file(tmp_path):
    path = tmp_path / "garbage.pth"
    path.write_bytes(np.random.default_rng(0).bytes(1000))
    with pytest.raises(CheckpointError, match="not a torch zip checkpoint") as info:
        load_pth(path)
    assert str(path) in str(info.value)


def test_truncated_zip_names_the_file(tmp_path):
    path = tmp_path / "cut.pth"
    save_pth({"w": np.ones((64, 64), np.float32)}, path)
    path.write_bytes(path.read_bytes()[:9000])
    with pytest.raises(CheckpointError, match="truncated") as info:
        load_pth(path)
    assert str(path) in str(info.value)


def test_zip_without_data_pkl_names_the_file(tmp_path):
    path = tmp_path / "nodata.pth"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/version", "3\n")
    with pytest.raises(CheckpointError, match="data.pkl") as info:
        load_pth(path)
    assert str(path) in str(info.value)


def test_legacy_torch_pickle_is_refused(tmp_path):
    path = tmp_path / "legacy.pth"  # legacy files begin with a protocol-2 pickled magic number
    path.write_bytes(b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19.")
    with pytest.raises(CheckpointError, match="legacy") as info:
        load_pth(path)
    assert str(path) in str(info.value)


def test_missing_file_names_the_file(tmp_path):
    with pytest.raises(CheckpointError, match="missing.pth"):
        load_pth(tmp_path / "missing.pth")
