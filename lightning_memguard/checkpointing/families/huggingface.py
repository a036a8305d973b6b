"""Hugging Face transformers (any ``transformers.PreTrainedModel``: GPT-2, Llama-style decoders, BERT, ...).

Its blocks are the layers its own switch (``gradient_checkpointing_enable``) checkpoints: the outermost
``GradientCheckpointingLayer`` modules, or where an older version of transformers has none, the classes the model names
in ``_no_split_modules`` that repeat. A block is never a part of a module named there (it would split one). A model that
declares ``supports_gradient_checkpointing = False`` is refused. Where its base model has an ``embeddings`` module that
keeps tensors for backward (a norm layer, a dropout: BERT's, RoBERTa's), that module is a stem: a link of its own before
the first layer (Hugging Face's switch leaves it). While it trains with blocks checkpointed, its base model (the one
that runs the layers) is called with ``use_cache=False``, as Hugging Face's own switch does: a layer that builds or
updates the key/value cache would otherwise do it again when recomputed, and the cache keeps every layer's keys and
values alive through the step. So is every model inside it that takes ``use_cache`` (the language model of a
vision-language model reads its own configuration where its parent passes nothing). In evaluation and without gradients
calls are left as they are (generation keeps its cache); the configuration is never changed."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from lightning_memguard.checkpointing.families._base import (
    Family,
    Named,
    Stem,
    foreign_wrapper,
    loaded,
    original_class,
)


def _layer_class() -> type | None:
    layers = loaded("transformers.modeling_layers")
    return getattr(layers, "GradientCheckpointingLayer", None) if layers is not None else None


def _takes(module: nn.Module, name: str) -> bool:
    """Whether ``module``'s own forward (under this library's mixins) has a parameter ``name``."""
    try:
        parameters = inspect.signature(original_class(module).forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        return False
    return name in parameters


def _keeps(module: nn.Module) -> bool:
    """Whether ``module`` holds a norm layer (which keeps its input for backward) or a dropout that drops."""
    return any("Norm" in type(m).__name__ or (isinstance(m, nn.Dropout) and m.p > 0) for m in module.modules())


class HuggingFace(Family):
    name = "Hugging Face transformers"

    def claims(self, module: nn.Module) -> bool:
        modeling = loaded("transformers.modeling_utils")  # not transformers' lazy top level: that would import it
        return modeling is not None and isinstance(module, modeling.PreTrainedModel)

    def refusal(self, module: nn.Module) -> str | None:
        if getattr(module, "supports_gradient_checkpointing", True) is False:
            return (
                f"{type(module).__name__} declares supports_gradient_checkpointing = False: its layers may not"
                " survive recomputation; pass `units` to checkpoint blocks of your choosing anyway"
            )
        return None

    def blocks(self, module: nn.Module) -> list[Named]:
        layer = _layer_class()
        whole = {name for m in module.modules() for name in getattr(m, "_no_split_modules", None) or ()}  # base model's
        found: list[Named] = []

        def visit(prefix: str, parent: nn.Module) -> None:
            for name, child in parent.named_children():
                path = f"{prefix}{name}"
                if foreign_wrapper(child) or (layer is not None and isinstance(child, layer)):
                    found.append((path, child))
                elif original_class(child).__name__ in whole and (
                    layer is None or any(isinstance(m, layer) for m in child.modules())
                ):
                    found.append((path, child))  # a layer inside a module that must stay whole: the whole module
                else:
                    visit(f"{path}.", child)

        visit("", module)
        if layer is None:  # the declared classes that repeat (layers), not those that appear once (embeddings)
            names = [original_class(block).__name__ for _, block in found]
            found = [named for named, name in zip(found, names, strict=True) if names.count(name) > 1] or found
        return found

    def stem(self, module: nn.Module) -> Stem | None:
        # the base model's ``embeddings`` module (BERT's: the embeddings summed, their LayerNorm and dropout in one
        # module, whose saved tensors the layers' checkpoints leave), before its first layer; only where it keeps
        # something for backward: a norm layer's input or a dropout's mask (a ViT's patches and positions, which
        # keep nothing, would be recomputed for nothing)
        base = getattr(module, "base_model", module)
        embeddings = getattr(base, "embeddings", None)
        if not isinstance(embeddings, nn.Module) or foreign_wrapper(embeddings) or not _keeps(embeddings):
            return None
        if _takes(embeddings, "input_ids") and _takes(embeddings, "pixel_values"):
            # both modalities in one (ViLT's): its checkpoint would hold its inputs, among them the full-size pixel
            # mask the model makes and the plain forward frees (4x the switch's bytes kept, in the coverage table)
            return None
        names = {id(m): name for name, m in module.named_modules()}
        inside = names.get(id(base), "")
        first = [name for name, _ in self.blocks(module) if not inside or name.startswith(f"{inside}.")]
        if id(embeddings) not in names or not first:
            return None
        return Stem(((names[id(embeddings)], embeddings),), first[0])

    def while_checkpointed(self, module: nn.Module) -> list[tuple[nn.Module, dict[str, Any]]]:
        # the base model, and every model inside it that names use_cache (a vision-language model's language
        # model reads its own configuration's use_cache where its parent passes none, as Llava's does)
        modeling = loaded("transformers.modeling_utils")
        base = getattr(module, "base_model", module)
        models = [base] if isinstance(base, nn.Module) else []
        if modeling is not None:
            models += [m for m in module.modules() if isinstance(m, modeling.PreTrainedModel) and m is not base]
        return [(m, {"use_cache": False}) for m in models if _takes(m, "use_cache")]

    def checkpointed_by_family(self, module: nn.Module) -> bool:
        layer = _layer_class()
        return layer is not None and isinstance(module, layer) and vars(module).get("gradient_checkpointing") is True
