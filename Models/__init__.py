"""The model. `from Models import load_base_model` opens a base of either layout (Models/formats/base_model.py);
it is imported on first use, so that `import Models.ModelArgs` and the like stay light."""


def __getattr__(name):
    if name == "load_base_model":
        from .formats.base_model import load_base_model
        return load_base_model
    raise AttributeError(f"module 'Models' has no attribute {name!r}")
