"""The configuration of a MoA adapter exported by MoA-Jittor (scripts/export_hf.py) for stock transformers.

This file is copied into the exported folder and run by transformers (`trust_remote_code=True`), never by
MoA-Jittor. The folder holds no base weights: `base_model_name_or_path` names the LLaMA-3.x or Qwen3 base
(a path, relative to the folder or absolute, or a hub id), and `moa` the adapter's settings as MoA-Jittor
names them (its ModelArgs: method, variant, layers with each kind of expert, ranks, router sizes).
"""
from transformers import PretrainedConfig


class MoAConfig(PretrainedConfig):
    model_type = "moa_jittor"

    def __init__(self, base_model_name_or_path: str = None, moa: dict = None, **kwargs):
        self.base_model_name_or_path = base_model_name_or_path
        self.moa = dict(moa or {})
        super().__init__(**kwargs)
