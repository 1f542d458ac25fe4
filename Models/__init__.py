"""The model. `from Models import load_base_model, load_trained_model` opens a base of either layout, alone or
with a trained adapter (Models/formats/base_model.py); imported on first use, so that `import Models.ModelArgs`
and the like stay light."""

PUBLIC = ("load_base_model", "load_trained_model")


def __getattr__(name):
    if name in PUBLIC:
        from .formats import base_model
        return getattr(base_model, name)
    raise AttributeError(f"module 'Models' has no attribute {name!r}")
