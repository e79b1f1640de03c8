"""GPT-2 (LayerNorm, biases, GELU MLP, learned positions, fused QKV, tied head), written with
``meshlm.nn`` the way nanoGPT writes it with ``torch.nn``.

Parameter names are nanoGPT's and Hugging Face's (``transformer.h.0.attn.c_attn.weight``),
so a checkpoint key reads the same in all three; the values differ where noted in NOTE [fused
QKV] below and in meshlm/interop/hf/gpt2.py (HF's Conv1D stores weights transposed).

NOTE [fused QKV]
    ``c_attn`` is one Linear ``embed -> 3 * embed`` whose output (the rows of its weight) is
    ordered ``(heads, 3, head_dim)``: each head's query, key and value side by side, as
    Megatron-LM fuses them.  Its output axis is ``heads``, so a layout that shards heads over
    ``tp`` gives each rank whole heads with their q, k and v (a column-parallel matmul, no
    communication); nanoGPT's ``(3, heads, head_dim)`` order would give a rank all of q and
    none of v.  A head count that ``tp`` does not divide is an error when the activation is
    constrained to ``heads``.  Hugging Face's ``(3, heads, head_dim)`` columns are permuted
    into this order on import and back on export, block by block (meshlm/interop/hf/gpt2.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshlm.core import nn as mnn
from meshlm.core.annotate import block, constrain, dropout, init_params

# Positions are whole inside attention and MLP (as in meshlm/models/llama.py): sequence
# parallelism (seq over tp) is gathered at their entry.
WHOLE = None


@dataclass(frozen=True)
class GPT2Config:
    """Architecture hyperparameters only."""

    vocab: int = 256
    block_size: int = 128  # learned positions: the longest sequence the model reads
    embed: int = 64
    layers: int = 2
    heads: int = 4
    mlp: Optional[int] = None  # default 4 * embed
    norm_eps: float = 1e-5
    bias: bool = True  # biases in every Linear and LayerNorm (GPT-2 has them; nanoGPT makes them optional)
    # Dropout on the embeddings and on the attention and MLP outputs (residual), in training
    # mode only; the same masks under every layout as on one device (meshlm.dropout).  As in
    # Llama, attention-probability dropout is not offered (SDPA's draws are per rank).
    dropout: float = 0.0
    tie_embeddings: bool = True  # lm_head.weight is transformer.wte.weight (nanoGPT's tie)
    init_std: float = 0.02

    def __post_init__(self):
        from meshlm.core.errors import ConfigError

        for f in ("vocab", "block_size", "embed", "layers", "heads"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) <= 0:
                raise ConfigError(f"model.{f}={getattr(self, f)!r} must be a positive integer")
        if self.mlp is not None and (not isinstance(self.mlp, int) or self.mlp <= 0):
            raise ConfigError(f"model.mlp={self.mlp!r} must be a positive integer (or null: 4 * embed)")
        if self.embed % self.heads:
            raise ConfigError(
                f"model.embed={self.embed} is not divisible by model.heads={self.heads}: GPT-2's "
                "heads split the width evenly (head_dim = embed / heads)"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout} must be in [0, 1)")

    @property
    def hidden(self) -> int:
        """Width of the MLP."""
        return self.mlp or 4 * self.embed

    @property
    def head_dim(self) -> int:
        return self.embed // self.heads

    def num_params(self, embedding: bool = True) -> int:
        e, m, b = self.embed, self.hidden, int(self.bias)
        norm = e * (1 + b)
        blk = 2 * norm + e * 3 * e + 3 * e * b + e * e + e * b + e * m + m * b + m * e + e * b
        emb = self.vocab * e * (1 if self.tie_embeddings else 2) + self.block_size * e
        return self.layers * blk + norm + (emb if embedding else 0)

    def to_dict(self) -> dict:
        return asdict(self)


CONFIGS: dict[str, GPT2Config] = {
    # tests: every dim divides 4, so every layout fits every mesh of up to 4 ranks
    "gpt2_tiny": GPT2Config(vocab=256, block_size=128, embed=64, layers=2, heads=4),
    # GPT-2 small, the published 124M shape (Hugging Face's vocabulary of 50257)
    "gpt2": GPT2Config(vocab=50257, block_size=1024, embed=768, layers=12, heads=12),
}


class CausalSelfAttention(nn.Module):
    """Causal self-attention through scaled_dot_product_attention, QKV fused per head
    (NOTE [fused QKV])."""

    def __init__(self, cfg: GPT2Config, device=None):
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.head_dim
        self.c_attn = mnn.Linear(
            cfg.embed, 3 * cfg.embed, bias=cfg.bias, axes=("embed", "heads"), init_std=cfg.init_std, device=device
        )
        self.c_proj = mnn.Linear(
            cfg.embed,
            cfg.embed,
            bias=cfg.bias,
            axes=("heads", "embed"),
            init_std=cfg.init_std / math.sqrt(2 * cfg.layers),
            device=device,
        )

    def forward(self, x: Tensor, cache=None) -> Tensor:  # x: (batch, seq, embed)
        """``cache``: this layer's view of a KV cache when decoding (NOTE [KV cache] in
        meshlm/infer/cache.py)."""
        x = constrain(x, ("batch", WHOLE, "embed"))
        qkv = constrain(self.c_attn(x), ("batch", WHOLE, "heads"))  # (batch, seq, heads * 3 * head_dim)
        qkv = qkv.unflatten(-1, (self.heads, 3 * self.head_dim)).transpose(1, 2)
        qkv = constrain(qkv, ("batch", "heads", WHOLE, None))  # (batch, heads, seq, 3 * head_dim)
        q, k, v = qkv.split(self.head_dim, dim=-1)
        mask, causal = None, True
        if cache is not None:  # every position so far: (batch, heads, cached + seq, head_dim)
            k, v = cache.update(k, v)
            mask, causal = cache.mask, cache.causal
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        y = constrain(y, ("batch", "heads", WHOLE, "head_dim")).transpose(1, 2).flatten(2, 3)
        return constrain(self.c_proj(y), ("batch", "seq", "embed"))


class MLP(nn.Module):
    """embed -> mlp -> embed with GELU (tanh approximation, GPT-2's ``gelu_new``)."""

    def __init__(self, cfg: GPT2Config, device=None):
        super().__init__()
        self.c_fc = mnn.Linear(
            cfg.embed, cfg.hidden, bias=cfg.bias, axes=("embed", "mlp"), init_std=cfg.init_std, device=device
        )
        self.c_proj = mnn.Linear(
            cfg.hidden,
            cfg.embed,
            bias=cfg.bias,
            axes=("mlp", "embed"),
            init_std=cfg.init_std / math.sqrt(2 * cfg.layers),
            device=device,
        )

    def forward(self, x: Tensor) -> Tensor:  # x: (batch, seq, embed)
        x = constrain(x, ("batch", WHOLE, "embed"))
        h = constrain(F.gelu(self.c_fc(x), approximate="tanh"), ("batch", WHOLE, "mlp"))
        return constrain(self.c_proj(h), ("batch", "seq", "embed"))


@block
class Block(nn.Module):
    """Pre-norm residual block: x + drop(attn(ln_1(x))), then x + drop(mlp(ln_2(x)))."""

    def __init__(self, cfg: GPT2Config, device=None):
        super().__init__()
        self.dropout = cfg.dropout
        self.ln_1 = mnn.LayerNorm(cfg.embed, cfg.norm_eps, bias=cfg.bias, device=device)
        self.attn = CausalSelfAttention(cfg, device)
        self.ln_2 = mnn.LayerNorm(cfg.embed, cfg.norm_eps, bias=cfg.bias, device=device)
        self.mlp = MLP(cfg, device)

    def forward(self, x: Tensor, cache=None) -> Tensor:  # x: (batch, seq, embed)
        axes = ("batch", "seq", "embed")
        x = x + dropout(self.attn(self.ln_1(x), cache), self.dropout, axes, self.training)
        x = x + dropout(self.mlp(self.ln_2(x)), self.dropout, axes, self.training)
        return constrain(x, axes)


class GPT2(nn.Module):
    """Decoder-only GPT-2.  ``forward(tokens)`` gives logits ``(batch, seq, vocab)``; with
    ``targets`` the mean next-token cross-entropy over every position of the (global)
    batch (targets of -100 are ignored)."""

    def __init__(self, cfg: GPT2Config, device=None, seed: Optional[int] = 0):
        """Built on ``device`` (``"meta"`` for a model that lowering materialises shard by
        shard).  On a real device the weights are initialised from ``seed`` (None: leave
        them uninitialised)."""
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=mnn.Embedding(cfg.vocab, cfg.embed, axes=("vocab", "embed"), init_std=cfg.init_std, device=device),
                wpe=mnn.Embedding(
                    cfg.block_size, cfg.embed, axes=(None, "embed"), init_std=cfg.init_std, device=device
                ),
                h=nn.ModuleList(Block(cfg, device) for _ in range(cfg.layers)),
                ln_f=mnn.LayerNorm(cfg.embed, cfg.norm_eps, bias=cfg.bias, device=device),
            )
        )
        self.lm_head = mnn.Linear(
            cfg.embed, cfg.vocab, bias=False, axes=("embed", "vocab"), init_std=cfg.init_std, device=device
        )
        if cfg.tie_embeddings:  # one Parameter in two modules (NOTE [ties] in meshlm/core/ties.py)
            self.transformer.wte.weight = self.lm_head.weight
        if seed is not None and torch.device(device or "cpu").type != "meta":
            init_params(self, seed)

    def forward(self, tokens: Tensor, targets: Optional[Tensor] = None, cache=None) -> Tensor:
        """``cache``: a KV cache when decoding (NOTE [KV cache] in meshlm/infer/cache.py);
        ``tokens`` are then the new tokens only, at positions ``cache.positions``."""
        s = tokens.shape[1]
        n = s if cache is None else cache.max_len  # a cache holds no more positions than there are
        if n > self.cfg.block_size:
            from meshlm.core.errors import ConfigError

            raise ConfigError(
                f"GPT2: a sequence of {n} tokens is longer than model.block_size="
                f"{self.cfg.block_size} (the learned positions; when decoding, {n} is the KV cache's max_len): "
                "shorten the sequence (train.seq_len) or build the model with a larger block_size"
            )
        pos = torch.arange(s, dtype=torch.long, device=tokens.device) if cache is None else cache.positions
        x = constrain(self.transformer.wte(tokens) + self.transformer.wpe(pos), ("batch", "seq", "embed"))
        x = dropout(x, self.cfg.dropout, ("batch", "seq", "embed"), self.training)
        for i, blk in enumerate(self.transformer.h):
            x = blk(x) if cache is None else blk(x, cache=cache.layer(i))
        # The output head needs every position (a vocab-parallel head is column-parallel).
        x = constrain(self.transformer.ln_f(x), ("batch", WHOLE, "embed"))
        if cache is not None and cache.last_only:  # generation reads the last position's logits only
            x = x[:, -1:]
        logits = constrain(self.lm_head(x), ("batch", "seq", "vocab"))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def gpt2_config(name: str, **overrides) -> GPT2Config:
    """A named config (``CONFIGS``), optionally with fields overridden."""
    from meshlm.core.errors import ConfigError

    if name not in CONFIGS:
        raise ConfigError(f"model: unknown GPT-2 config {name!r}; choose one of {', '.join(CONFIGS)}")
    return replace(CONFIGS[name], **overrides)


def gpt2_fields(**config) -> GPT2Config:
    """A GPT2Config from ``model.<field>`` values (``conf/model/gpt2*.yaml``); a field GPT-2
    does not have, or a value of another type than the field's, is a ConfigError naming the key."""
    from meshlm.core.arg_types import check_fields
    from meshlm.core.axes import closest
    from meshlm.core.errors import ConfigError

    names = [f.name for f in fields(GPT2Config)]
    for k in config:
        if k not in names:
            raise ConfigError(
                f"model.{k}: GPT-2 has no such field{closest(k, names)}; its fields are {', '.join(names)}"
            )
    check_fields(GPT2Config, config, "meshlm.models.gpt2_model")
    return GPT2Config(**config)


def gpt2_model(device=None, seed: Optional[int] = 0, **config) -> GPT2:
    """``GPT2(GPT2Config(**config), device, seed)``: the Hydra ``_target_`` of
    conf/model/gpt2*.yaml (``meshlm.models.gpt2_model``); every other key is a
    :class:`GPT2Config` field."""
    return GPT2(gpt2_fields(**config), device=device, seed=seed)
