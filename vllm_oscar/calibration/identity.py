"""Model identity: which model (and which attention shapes) a rotation file belongs to.

A rotation file is only valid for a model with the same attention geometry: number of
attention layers, KV heads, query heads and head dimension, and the same architecture.
The model's name (and, when known, a sha256 of its weights) tells models of the same
geometry apart, e.g. a base model and its instruct variant.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

#: Fields that must be equal for a rotation file to fit a model.
SHAPE_FIELDS: tuple[str, ...] = ("architecture", "num_layers", "num_query_heads", "num_kv_heads", "head_dim")


def normalized_name(name: str) -> str:
    """Lower-case alphanumerics only: "SmolLM2-135M-Instruct" -> "smollm2135minstruct"."""
    return re.sub(r"[^0-9a-z]", "", name.lower())


@dataclasses.dataclass(frozen=True)
class ModelIdentity:
    """The attention geometry and name of a model.

    Attributes:
        architecture: transformers class name, e.g. "LlamaForCausalLM".
        num_layers: attention layers (config.num_hidden_layers).
        num_query_heads: query heads per layer (config.num_attention_heads).
        num_kv_heads: KV heads per layer (config.num_key_value_heads).
        head_dim: channels per head D.
        name: the model's own name, e.g. "SmolLM2-135M-Instruct" (may be a path or "").
        weights_sha256: sha256 of the weights the model was loaded from, "" if unknown.
    """

    architecture: str
    num_layers: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    name: str = ""
    weights_sha256: str = ""

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_query_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelIdentity.{field}={value!r} must be a positive integer.")
        if self.num_query_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_query_heads={self.num_query_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}; grouped-query attention needs it to be."
            )

    @property
    def group_size(self) -> int:
        """Query heads sharing one KV head (g = Hq / Hkv)."""
        return self.num_query_heads // self.num_kv_heads

    @property
    def rotation_shape(self) -> tuple[int, int, int]:
        """Shape of one layer's K or V rotation: (Hkv, D, D)."""
        return (self.num_kv_heads, self.head_dim, self.head_dim)

    @classmethod
    def from_hf_config(cls, config: Any, name: str = "", weights_sha256: str = "") -> "ModelIdentity":
        """Identity of a transformers (or vLLM ``hf_config``) model configuration.

        Uses ``config.architectures[0]`` when set (configs loaded from GGUF have none:
        pass the model and use ``from_model`` then), ``num_hidden_layers``,
        ``num_attention_heads``, ``num_key_value_heads`` (default: the query heads) and
        ``head_dim`` (default: hidden_size // num_attention_heads).
        """
        architectures = getattr(config, "architectures", None) or []
        architecture = architectures[0] if architectures else ""
        num_query_heads = int(config.num_attention_heads)
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_query_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_query_heads
        return cls(
            architecture=architecture,
            num_layers=int(config.num_hidden_layers),
            num_query_heads=num_query_heads,
            num_kv_heads=int(num_kv_heads),
            head_dim=int(head_dim),
            name=name,
            weights_sha256=weights_sha256,
        )

    @classmethod
    def from_model(cls, model: Any, name: str = "", weights_sha256: str = "") -> "ModelIdentity":
        """Identity of a loaded transformers model (architecture = its class name if unset)."""
        identity = cls.from_hf_config(model.config, name, weights_sha256)
        if not identity.architecture:
            identity = dataclasses.replace(identity, architecture=type(model).__name__)
        return identity

    def shape_mismatches(self, other: "ModelIdentity") -> list[str]:
        """Human-readable differences of SHAPE_FIELDS between ``self`` and ``other``.

        An empty architecture (a config without ``architectures``, e.g. one converted
        from GGUF) is unknown and matches any; the numeric fields must always agree.
        """
        return [
            f"{field}: {getattr(self, field)!r} vs {getattr(other, field)!r}"
            for field in SHAPE_FIELDS
            if getattr(self, field) != getattr(other, field)
            and not (field == "architecture" and not (self.architecture and other.architecture))
        ]

    def name_matches(self, other_name: str) -> bool:
        """True when this identity's name appears in ``other_name`` (a name or a path),
        comparing lower-case alphanumerics only; False when either name is empty."""
        mine, theirs = normalized_name(self.name), normalized_name(other_name)
        return bool(mine) and bool(theirs) and mine in theirs

    def describe(self) -> str:
        """One line, e.g. "SmolLM2-135M-Instruct (LlamaForCausalLM, 30 layers, 9 q / 3 kv heads, D=64)"."""
        return (
            f"{self.name or '<unnamed>'} ({self.architecture or '<unknown architecture>'}, "
            f"{self.num_layers} layers, {self.num_query_heads} q / {self.num_kv_heads} kv heads, "
            f"D={self.head_dim})"
        )

    def to_metadata(self) -> dict[str, str]:
        """String fields for safetensors metadata (keys prefixed "model.")."""
        return {f"model.{f.name}": str(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_metadata(cls, metadata: dict[str, str], source: str = "metadata") -> "ModelIdentity":
        """Inverse of ``to_metadata``; ValueError naming the missing or bad field."""
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            key = f"model.{field.name}"
            if key not in metadata:
                if field.default is not dataclasses.MISSING:
                    continue
                raise ValueError(f"{source} lacks the model identity field {key!r}.")
            raw: Optional[str] = metadata[key]
            if field.type in ("int", int):
                try:
                    values[field.name] = int(raw)
                except ValueError:
                    raise ValueError(f"{source}: {key}={raw!r} is not an integer.") from None
            else:
                values[field.name] = raw
        return cls(**values)
