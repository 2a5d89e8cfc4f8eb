"""The model kinds the finetune scripts and the standalone trainer fine-tune, in one table (torch-free: the
command line and the scripts' runner read it before anything is imported)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict

# The parameter name of EVA layer ``i``'s MLP, as upstream's demo matches it (lower case).
EVA_MLP_NAME = "mixins.eva.vit_model.transformer.layers.{i}.mlp.dense_h_to_4h.weight"


def _cogvlm_demo_trains(name: str) -> bool:
    """CogVLM's demo: the MLP of EVA layers 46-54."""
    if "vit" not in name or ".mlp" not in name:
        return False
    layer = name[:name.find(".mlp")].rsplit(".", 1)[-1]
    return layer.isdigit() and 45 < int(layer) < 55


def _cogagent_demo_trains(name: str) -> bool:
    """CogAgent's demo: the cross encoder and attention, the GLU adapter, both vision experts, boi/eoi, EVA."""
    return any(key in name for key in ("encoder", "cross_attention", "linear_proj", "mlp.vision", "rotary.vision",
                                       "eoi", "boi", "vit"))


@dataclass(frozen=True)
class ModelKind:
    name: str           # MODEL_KIND, --kind
    title: str          # how the scripts and messages name it
    model_class: str    # model_config.json's model_class, SAT's registry name
    released: str       # the released checkpoint upstream's finetune_*_lora.sh starts from (its MODEL_TYPE)
    upstream_demo: str  # upstream's finetune_demo/ script
    merged_dir: str     # where that demo merges and saves its model, relative to the folder it runs in
    # beyond the adapters, what that demo's disable_untrainable_params trains: a test on the lower-cased
    # parameter name, as upstream writes it (read by the trainer and by the memory plan)
    demo_trains: Callable[[str], bool]

    def demo_eva_mlp_layers(self, eva_layers: int) -> int:
        """How many of ``eva_layers`` EVA layers have their MLP trained by the demo (:attr:`demo_trains`)."""
        return sum(self.demo_trains(EVA_MLP_NAME.format(i=i)) for i in range(eva_layers))


KINDS: Dict[str, ModelKind] = {kind.name: kind for kind in (
    ModelKind("cogvlm", "CogVLM", "CogVLMModel", "cogvlm-base-490", "finetune_cogvlm_demo.py",
              "checkpoints/merged_lora_cogvlm{image_size}", _cogvlm_demo_trains),
    ModelKind("cogagent", "CogAgent", "CogAgentModel", "cogagent-chat", "finetune_cogagent_demo.py",
              "checkpoints/merged_lora_cogagent", _cogagent_demo_trains),
)}
NAMES = tuple(KINDS)


def kind(name: str) -> ModelKind:
    """The kind called ``name``; a ValueError naming the kinds there are otherwise."""
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"model kind must be one of {', '.join(NAMES)}, not {name!r}") from None
