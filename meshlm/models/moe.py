"""A mixture-of-experts decoder: Llama's attention, norms and head, with each block's MLP
replaced by ``meshlm.nn.MoE`` (NOTE [moe routing] in meshlm/core/moe.py).

Two shapes ship: Mixtral's (``moe_tiny``, ``moe_small``: top-2 of 8 experts, no shared
expert) and a fine-grained one with a gated shared expert (``moe_shared_tiny``,
``moe_shared_small``: top-4 of 16 narrow experts, Qwen2-MoE's and DeepSeek's shape).
Qwen's attention options are fields too (``qkv_bias``: Qwen2-MoE, ``qk_norm``: Qwen3-MoE),
so a Hugging Face Mixtral, Qwen2-MoE or Qwen3-MoE directory is a MoETransformer
(meshlm/interop/hf/).

The loss is the next-token cross-entropy plus the mean over the batch's rows of each
block's auxiliary losses (load balancing, router z-loss), declared to ``meshlm.reduce_batch``
as a mean weighted by the count of counted targets, so that data-parallel ranks and
micro-batches combine as one device: the cross-entropy exactly, the auxiliary term exactly
whenever every rank and micro-batch counts the same number of targets per row (always
without ``ignore_index`` targets).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from dataclasses import fields as dataclass_fields
from typing import ClassVar, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshlm.core.annotate import Axes, block, constrain, init_params, reduce_batch
from meshlm.core.moe import MoE
from meshlm.models.llama import WHOLE, Attention, LlamaConfig, RMSNorm, attention_params


@dataclass(frozen=True)
class MoEConfig:
    """Architecture hyperparameters: Llama's (no dense MLP) and the experts'."""

    vocab: int = 256
    embed: int = 64
    layers: int = 2
    heads: int = 8
    kv_heads: int = 4
    head_dim: Optional[int] = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    qkv_bias: bool = False  # biases on the query, key and value projections (Qwen2-MoE)
    qk_norm: bool = False  # RMSNorm of each head's query and key before RoPE (Qwen3-MoE)
    experts: int = 8
    top_k: int = 2
    expert_mlp: int = 64  # each expert's width
    shared_mlp: int = 0  # the shared expert's width (0: none)
    shared_gate: bool = False  # the shared expert's output times sigmoid(gate . x) (Qwen2-MoE)
    capacity_factor: Optional[float] = None  # None: dropless
    norm_topk: bool = True  # renormalise the top-k gates to sum to one
    balance_loss: float = 0.01
    z_loss: float = 0.001

    def attention(self) -> LlamaConfig:
        """The Llama config whose attention and norms each block uses."""
        return LlamaConfig(
            vocab=self.vocab,
            embed=self.embed,
            layers=self.layers,
            heads=self.heads,
            kv_heads=self.kv_heads,
            mlp=1,
            head_dim=self.head_dim,
            rope_theta=self.rope_theta,
            norm_eps=self.norm_eps,
            tie_embeddings=self.tie_embeddings,
            init_std=self.init_std,
            qkv_bias=self.qkv_bias,
            qk_norm=self.qk_norm,
        )

    def num_params(self, embedding: bool = True, active: bool = False) -> int:
        """Parameters in total, or those one token uses (``active``: top_k experts of
        ``experts``)."""
        attn = attention_params(self)
        used = self.top_k if active else self.experts
        moe = self.experts * self.embed + used * 3 * self.embed * self.expert_mlp
        moe += 3 * self.embed * self.shared_mlp + (self.embed if self.shared_gate else 0)
        block = attn + moe + 2 * self.embed
        emb = self.vocab * self.embed * (1 if self.tie_embeddings else 2)
        return self.layers * block + self.embed + (emb if embedding else 0)

    def to_dict(self) -> dict:
        return asdict(self)


CONFIGS: dict[str, MoEConfig] = {
    # tests: every dim divides 4 (experts over ep, heads and expert widths over tp)
    "moe_tiny": MoEConfig(vocab=256, embed=64, layers=2, heads=8, kv_heads=4, experts=8, top_k=2, expert_mlp=32),
    "moe_shared_tiny": MoEConfig(
        vocab=256,
        embed=64,
        layers=2,
        heads=8,
        kv_heads=4,
        experts=16,
        top_k=4,
        expert_mlp=16,
        shared_mlp=32,
        shared_gate=True,
    ),
    # the CPU demos (byte-level vocabulary); llama_small's width, its MLP split into experts
    "moe_small": MoEConfig(vocab=256, embed=256, layers=4, heads=8, kv_heads=4, experts=8, top_k=2, expert_mlp=352),
    "moe_shared_small": MoEConfig(
        vocab=256,
        embed=256,
        layers=4,
        heads=8,
        kv_heads=4,
        experts=16,
        top_k=4,
        expert_mlp=88,
        shared_mlp=352,
        shared_gate=True,
    ),
}


def moe_fields(**fields) -> MoEConfig:
    """A MoEConfig from ``model.<field>`` values (``conf/model/moe_*.yaml``); an unknown
    field, a value of another type, or a size that is not positive is a ConfigError."""
    from meshlm.core.arg_types import check_fields
    from meshlm.core.axes import closest
    from meshlm.core.errors import ConfigError

    known = [f.name for f in dataclass_fields(MoEConfig)]
    for k in fields:
        if k not in known:
            raise ConfigError(
                f"model.{k}: meshlm.models.moe_model takes no argument {k!r}{closest(k, known)}; it takes: "
                f"{', '.join(known)}"
            )
    check_fields(MoEConfig, fields, "meshlm.models.moe_model")
    for k, v in fields.items():
        if k in ("balance_loss", "z_loss", "shared_mlp"):
            if v is not None and v < 0:
                raise ConfigError(f"model.{k}={v} must be >= 0")
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0:
            raise ConfigError(f"model.{k}={v} must be positive")
    cfg = MoEConfig(**{k: v for k, v in fields.items() if v is not None or k == "capacity_factor"})
    if cfg.top_k > cfg.experts:
        raise ConfigError(f"model.top_k={cfg.top_k} is more than model.experts={cfg.experts}")
    return cfg


def moe_model(device=None, **fields) -> "MoETransformer":
    """The ``_target_`` of ``conf/model/moe_*.yaml``."""
    return MoETransformer(moe_fields(**fields), device=device)


def moe_config(name: str, **overrides) -> MoEConfig:
    """A named config, optionally with fields overridden."""
    from meshlm.core.errors import ConfigError

    if name not in CONFIGS:
        raise ConfigError(f"model: unknown MoE config {name!r}; choose one of {', '.join(CONFIGS)}")
    return replace(CONFIGS[name], **overrides)


@block
class MoEBlock(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + moe(norm(x)); returns the new
    residual stream and each row's auxiliary loss ``(batch,)``."""

    def __init__(self, cfg: MoEConfig, device=None):
        super().__init__()
        att = cfg.attention()
        self.attn_norm = RMSNorm(cfg.embed, cfg.norm_eps, device)
        self.attn = Attention(att, device)
        self.mlp_norm = RMSNorm(cfg.embed, cfg.norm_eps, device)
        self.moe = MoE(
            cfg.embed,
            cfg.expert_mlp,
            cfg.experts,
            cfg.top_k,
            shared_mlp=cfg.shared_mlp,
            shared_gate=cfg.shared_gate,
            capacity_factor=cfg.capacity_factor,
            norm_topk=cfg.norm_topk,
            balance_loss=cfg.balance_loss,
            z_loss=cfg.z_loss,
            init_std=cfg.init_std,
            out_std=cfg.init_std / math.sqrt(2 * cfg.layers),
            device=device,
        )

    def forward(self, x: Tensor, cache=None) -> tuple[Tensor, Tensor]:  # x: (batch, seq, embed)
        x = x + self.attn(self.attn_norm(x), cache)
        y, aux = self.moe(self.mlp_norm(x))
        return constrain(x + y, ("batch", "seq", "embed")), aux


class MoETransformer(nn.Module):
    """Decoder-only mixture of experts.  ``forward(tokens)`` gives logits; with ``labels``
    the mean next-token cross-entropy plus the mean auxiliary loss (module docstring)."""

    param_axes: ClassVar[dict[str, Axes]] = {"tok_emb": ("vocab", "embed"), "lm_head": ("vocab", "embed")}

    def __init__(self, cfg: MoEConfig, device=None, seed: Optional[int] = 0):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Parameter(torch.empty(cfg.vocab, cfg.embed, device=device))
        self.layers = nn.ModuleList(MoEBlock(cfg, device) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.embed, cfg.norm_eps, device)
        self.lm_head = None if cfg.tie_embeddings else nn.Parameter(torch.empty(cfg.vocab, cfg.embed, device=device))
        if seed is not None and torch.device(device or "cpu").type != "meta":
            init_params(self, seed)

    def init_weights(self, gen: torch.Generator) -> None:
        nn.init.normal_(self.tok_emb, std=self.cfg.init_std, generator=gen)
        if self.lm_head is not None:
            nn.init.normal_(self.lm_head, std=self.cfg.init_std, generator=gen)

    def forward(self, tokens: Tensor, labels: Optional[Tensor] = None, cache=None) -> Tensor:
        """``cache``: a KV cache when decoding (NOTE [KV cache] in meshlm/infer/cache.py)."""
        x = constrain(F.embedding(tokens, self.tok_emb), ("batch", "seq", "embed"))
        aux = None
        for i, layer in enumerate(self.layers):
            x, a = layer(x) if cache is None else layer(x, cache=cache.layer(i))
            aux = a if aux is None else aux + a
        x = constrain(self.norm(x), ("batch", WHOLE, "embed"))
        if cache is not None and cache.last_only:
            x = x[:, -1:]
        head = self.tok_emb if self.cfg.tie_embeddings else self.lm_head
        logits = constrain(F.linear(x, head), ("batch", "seq", "vocab"))
        if labels is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
        if not (self.cfg.balance_loss or self.cfg.z_loss):
            return loss
        count = (labels != -100).sum()
        return reduce_batch(loss + aux.mean(), "mean", weight=count)
