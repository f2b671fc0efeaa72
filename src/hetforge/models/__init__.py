"""Model zoo: named models built offline from ``transformers`` configs with seeded random weights,
plus local Hugging Face folders with real weights."""

from hetforge.models.zoo import ZOO, LoadedModel, ModelSpec, example_inputs, list_models, load_model

__all__ = ["ZOO", "LoadedModel", "ModelSpec", "example_inputs", "list_models", "load_model"]
