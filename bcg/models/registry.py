"""Maps the `architectures` name of a Hugging Face config to our model class."""

from __future__ import annotations

from bcg.models.base import CausalLM
from bcg.models.llama import LlamaForCausalLM
from bcg.models.nemotron_h import NemotronHForCausalLM
from bcg.models.qwen2 import Qwen2ForCausalLM
from bcg.models.qwen3 import Qwen3ForCausalLM
from bcg.models.qwen3_moe import Qwen3MoeForCausalLM

ARCHITECTURES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "NemotronHForCausalLM": NemotronHForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def model_class(architecture: str) -> type[CausalLM]:
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: "
            f"{', '.join(sorted(ARCHITECTURES))}"
        )
    return ARCHITECTURES[architecture]
