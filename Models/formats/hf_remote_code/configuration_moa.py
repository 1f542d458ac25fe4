"""The configuration of a MoA adapter exported by MoA-Jittor (scripts/export_hf.py) for stock transformers.

This file is copied into the exported folder and run by transformers (`trust_remote_code=True`), never by
MoA-Jittor. The folder holds no base weights: `base_model_name_or_path` names the LLaMA-3.x or Qwen3 base
(a path, relative to the folder or absolute, or a hub id), and `moa` the adapter's settings as MoA-Jittor
names them (its ModelArgs: method, variant, layers with each kind of expert, ranks, router sizes).
"""
from transformers import PretrainedConfig


class MoAConfig(PretrainedConfig):
    model_type = "moa_jittor"

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        # config.json's model_type is the base's (so that AutoTokenizer, which loads the config without
        # trust_remote_code, asks nothing): read it as this class's without transformers' type warning
        config_dict, kwargs = cls.get_config_dict(pretrained_model_name_or_path, **kwargs)
        return cls.from_dict({**config_dict, "model_type": cls.model_type}, **kwargs)

    def __init__(self, base_model_name_or_path: str = None, moa: dict = None, **kwargs):
        self.base_model_name_or_path = base_model_name_or_path
        self.moa = dict(moa or {})
        super().__init__(**kwargs)
