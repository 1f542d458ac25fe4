"""The frozen base's precision: its projections as BaseLinear, their storage (fp32, bf16, int8, nf4) and product.

`--precision bf16` stores the frozen base's matrices (projections, embedding,
output) in bf16 (bf16.py: the bf16 rule of their products, the rounding); `--precision int8` stores the
projections and an untied output matrix as int8 values with a scale per row (int8.py), `--precision nf4` as
4-bit codes with bf16 group scales (nf4.py); either keeps the embedding in bf16. Adapters, routers, Gamma,
norms, softmax, loss and the optimizer stay fp32. A base projection runs `base_linear`, which picks the
storage's matmul.
"""
import Utils.jittor_env  # noqa: F401
import jittor as jt
from jittor import nn

from . import cpp
from .bf16 import bf16_linear, cast_to
from .int8 import Int8Linear, dequantized, int8_linear, quantize
from .linear import fused_linear_input_grad, linear
from .nf4 import Nf4Linear, nf4_dequantized, nf4_linear, nf4_quantize, nf4_width

# --precision: the frozen base matrices' storage type (int8, nf4: the projections' and an untied output's;
# the embedding table takes bf16)
STORAGE_DTYPES = {"bf16": "bfloat16", "fp32": "float32", "int8": "int8", "nf4": "uint8"}
# each storage type's name in C++ (cpp/storage.h)
STORAGES = {"float32": "FP32", "bfloat16": "BF16", "int8": "INT8", "uint8": "NF4"}


def bf16_rule(weight: jt.Var) -> bool:
    """Whether products with this base weight (and attention beside it) take the bf16 rule: a bf16, int8 or
    nf4 base."""
    return weight.dtype != "float32"


def matrix_code(inputs: cpp.CodeInputs, weight: jt.Var, scale=None) -> str:
    """The C++ BaseMatrix (cpp/storage.h) of a base weight and a quantized weight's scales, their Vars and
    storage added to `inputs`."""
    storage = STORAGES[str(weight.dtype)]
    inputs.storages.add(storage)
    return f"BaseMatrix{{{inputs.pointer(weight)}, {inputs.pointer(scale)}, {storage}}}"


# each quantized storage's quantization and its inverse (the fp32 matrix it stands for)
QUANTIZERS = {"int8": quantize, "uint8": nf4_quantize}
DEQUANTIZERS = {"int8": dequantized, "uint8": nf4_dequantized}


def matrix_shape(weight: jt.Var) -> tuple:
    """The shape [N,K] of the matrix a base weight stands for (an nf4 one holds two weights a byte)."""
    return (weight.shape[0], 2 * weight.shape[1]) if weight.dtype == "uint8" else tuple(weight.shape)


def base_linear(x: jt.Var, weight: jt.Var, scale=None) -> jt.Var:
    """x [..., K] fp32 @ weight [N,K]^T -> [..., N] fp32, for a weight in the base's storage: fp32, bf16, int8
    with its row scales `scale` [N], or nf4 codes with their group scales."""
    if weight.dtype == "int8":
        return int8_linear(x, weight, scale)
    if weight.dtype == "uint8":
        return nf4_linear(x, weight, scale)
    return linear(x, weight) if weight.dtype == "float32" else bf16_linear(x, weight)


def base_input_grad(grad_out: jt.Var, weight: jt.Var, scale=None) -> jt.Var:
    """grad_out [M,N] fp32 @ weight [N,K] -> [M,K] fp32 for an fp32, int8 or nf4 base weight, fused."""
    if weight.dtype == "int8":
        return Int8Linear.input_grad(grad_out, weight, scale)
    if weight.dtype == "uint8":
        return Nf4Linear.input_grad(grad_out, weight, scale)
    return fused_linear_input_grad(grad_out, weight)


class BaseLinear(nn.Module):
    """A frozen base projection without bias (Meta's wq, w1, output, ...): `weight` [out,in], fp32, bf16 or
    int8, or nf4 codes [out,in/2]; beside int8 values `weight_scale` [out] (fp32), row n of the matrix being
    weight[n] * weight_scale[n], beside nf4 codes their bf16 group scales [out, ceil(in/64)]."""

    def __init__(self, in_features: int, out_features: int):
        self.weight = nn.Linear(in_features, out_features, bias=False).weight
        self.weight_scale = None

    def execute(self, x: jt.Var) -> jt.Var:
        # x [..., in] -> [..., out] fp32
        return base_linear(x, self.weight, self.weight_scale)


SCALE_SUFFIX = "_scale"  # a quantized matrix `<name>.weight` keeps its scales as `<name>.weight_scale`


def split_scales(base: dict) -> tuple:
    """A base's parameters (name -> Var) as (the tensors a checkpoint holds, {quantized matrix's name: its
    scales}): the scales are made from the matrix as it loads."""
    scales = {name[:-len(SCALE_SUFFIX)]: var for name, var in base.items() if name.endswith(SCALE_SUFFIX)}
    return {name: var for name, var in base.items() if not name.endswith(SCALE_SUFFIX)}, scales


def set_base_precision(model, precision: str):
    """Store the frozen base's matrices in the precision's storage (int8, nf4: the BaseLinears' whose matrix is
    not an embedding table, the tables in bf16); 1-D norm weights stay fp32."""
    if precision not in STORAGE_DTYPES:
        raise ValueError(f"precision={precision!r}: expected one of {tuple(STORAGE_DTYPES)}")
    dtype = STORAGE_DTYPES[precision]
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for name, module in model.named_modules():
        if not isinstance(module, BaseLinear):
            continue
        stored = str(module.weight.dtype)
        if module.weight_scale is not None and stored != dtype:  # back from int8 or nf4: fp32 here, cast below
            module.weight.assign(DEQUANTIZERS[stored](module.weight, module.weight_scale).stop_grad())
            module.weight_scale = None
        if dtype in QUANTIZERS and module.weight_scale is None and id(module.weight) not in tables:
            if dtype == "uint8":
                nf4_width(module.weight.shape[1], f"{name}.weight")
            values, scale = QUANTIZERS[dtype](module.weight)
            module.weight.assign(values.stop_grad())
            module.weight_scale = scale.stop_grad()
    table_dtype = "bfloat16" if dtype in QUANTIZERS else dtype
    for param in model.base_parameters().values():
        if len(param.shape) == 2 and param.dtype not in (table_dtype, *QUANTIZERS):
            param.assign(cast_to(param, table_dtype).stop_grad())
    model.freeze_base()
