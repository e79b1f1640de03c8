"""Llama (RMSNorm, RoPE, SwiGLU, grouped-query attention), written once against logical axes.

Attention weights are stored per head, ``wq: (heads, head_dim, embed)``, so a layout that
shards heads over ``tp`` is checked against the number of heads (6 kv heads over tp=4 is an
error), not against ``heads * head_dim``.  Hugging Face's 2-D ``q_proj`` is a reshape away.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from dataclasses import fields as dataclass_fields
from typing import ClassVar, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshlm.core.annotate import Axes, block, constrain, dropout, init_params

# Positions are whole inside attention and MLP: the tensor-parallel matmuls there need every
# position of this rank's batch, so sequence parallelism (seq over tp) is gathered here.
WHOLE = None


@dataclass(frozen=True)
class LlamaConfig:
    """Architecture hyperparameters only."""

    vocab: int = 256
    embed: int = 64
    layers: int = 2
    heads: int = 8
    kv_heads: int = 4
    mlp: int = 128
    head_dim: Optional[int] = None  # default embed // heads
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    # Residual dropout on the attention and MLP outputs, in training mode only; the same
    # masks under every layout as on one device (meshlm.dropout, NOTE [dropout keys] in
    # meshlm/core/rng.py).  Attention-probability dropout is not offered: SDPA's dropout_p draws
    # from torch's generator per rank, which no layout can make equal to one device.
    dropout: float = 0.0
    # Qwen's attention options, both off for Llama: a bias on the query, key and value
    # projections (Qwen2, Qwen2-MoE), and an RMSNorm over each head's query and key before
    # RoPE (Qwen3, Qwen3-MoE).
    qkv_bias: bool = False
    qk_norm: bool = False

    @property
    def hd(self) -> int:
        return self.head_dim or self.embed // self.heads

    def num_params(self, embedding: bool = True) -> int:
        block = attention_params(self) + 3 * self.embed * self.mlp + 2 * self.embed
        emb = self.vocab * self.embed * (1 if self.tie_embeddings else 2)
        return self.layers * block + self.embed + (emb if embedding else 0)

    def to_dict(self) -> dict:
        return asdict(self)


def attention_params(cfg) -> int:
    """Parameters of one :class:`Attention` of ``cfg`` (a LlamaConfig, or any config with
    its attention fields)."""
    hd = cfg.head_dim or cfg.embed // cfg.heads
    n = cfg.embed * hd * (2 * cfg.heads + 2 * cfg.kv_heads)
    n += hd * (cfg.heads + 2 * cfg.kv_heads) if cfg.qkv_bias else 0
    return n + (2 * hd if cfg.qk_norm else 0)


CONFIGS: dict[str, LlamaConfig] = {
    # tests: every dim divides 4, so every layout fits every mesh of up to 4 ranks
    "llama_tiny": LlamaConfig(vocab=256, embed=64, layers=2, heads=8, kv_heads=4, mlp=128),
    # the CPU demo (byte-level vocabulary)
    "llama_small": LlamaConfig(vocab=256, embed=256, layers=4, heads=8, kv_heads=4, mlp=704),
    # ~1B, for the GPU benchmark
    "llama_1b": LlamaConfig(vocab=32000, embed=2048, layers=16, heads=32, kv_heads=8, mlp=5632, rope_theta=500000.0),
    # published shapes, for planning only (never materialised here)
    "llama3_8b": LlamaConfig(vocab=128256, embed=4096, layers=32, heads=32, kv_heads=8, mlp=14336, rope_theta=500000.0),
    "llama3_70b": LlamaConfig(
        vocab=128256, embed=8192, layers=80, heads=64, kv_heads=8, mlp=28672, rope_theta=500000.0
    ),
    "llama3_405b": LlamaConfig(
        vocab=128256, embed=16384, layers=126, heads=128, kv_heads=8, mlp=53248, rope_theta=500000.0
    ),
}


def llama_fields(**fields) -> LlamaConfig:
    """A LlamaConfig from ``model.<field>`` values (``conf/model/llama_*.yaml``); a field
    Llama does not have, a value of another type than the field's, or a size that is not
    positive, is a ConfigError naming the key."""
    from meshlm.core.arg_types import check_fields
    from meshlm.core.axes import closest
    from meshlm.core.errors import ConfigError

    known = [f.name for f in dataclass_fields(LlamaConfig)]
    for k in fields:
        if k not in known:
            raise ConfigError(
                f"model.{k}: meshlm.models.llama_model takes no argument {k!r}{closest(k, known)}; it takes: "
                f"{', '.join(known)}"
            )
    check_fields(LlamaConfig, fields, "meshlm.models.llama_model")
    for k, v in fields.items():
        if k == "dropout":
            if v is not None and not 0.0 <= v < 1.0:
                raise ConfigError(f"model.dropout={v} must be in [0, 1)")
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0:
            raise ConfigError(f"model.{k}={v} must be positive")
    return LlamaConfig(**{k: v for k, v in fields.items() if v is not None})


def llama_model(device=None, **fields) -> "Llama":
    """The ``_target_`` of ``conf/model/llama_*.yaml``: a :class:`Llama` of the given
    :class:`LlamaConfig` fields, built on ``device``."""
    return Llama(llama_fields(**fields), device=device)


def llama_config(name: str, **overrides) -> LlamaConfig:
    """A named config, optionally with fields overridden."""
    from meshlm.core.errors import ConfigError

    if name not in CONFIGS:
        raise ConfigError(f"model: unknown Llama config {name!r}; choose one of {', '.join(CONFIGS)}")
    return replace(CONFIGS[name], **overrides)


class RMSNorm(nn.Module):
    """Root-mean-square norm over ``embed`` with a learned scale."""

    param_axes: ClassVar[dict[str, Axes]] = {"weight": ("embed",)}

    def __init__(self, dim: int, eps: float = 1e-5, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device=device))

    def init_weights(self, gen: torch.Generator) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


class HeadNorm(RMSNorm):
    """RMSNorm over one attention head's ``head_dim`` (Qwen3's query and key norm)."""

    param_axes: ClassVar[dict[str, Axes]] = {"weight": ("head_dim",)}


def rope_tables(seq: int, head_dim: int, theta: float, device, dtype) -> tuple[Tensor, Tensor]:
    """cos and sin of shape (seq, head_dim // 2)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    ang = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rope_at(positions: Tensor, head_dim: int, theta: float, dtype) -> tuple[Tensor, Tensor]:
    """cos and sin of shape (batch, 1, seq, head_dim // 2) at each row's own ``positions``
    (batch, seq): decoding with a KV cache, where left-padded rows are at different positions."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    ang = positions.float()[..., None] * inv
    return ang.cos().to(dtype)[:, None], ang.sin().to(dtype)[:, None]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate halves (the Hugging Face Llama convention). x: (batch, heads, seq, head_dim)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos2 = torch.cat([cos, cos], dim=-1)
    sin2 = torch.cat([sin, sin], dim=-1)
    rot = torch.cat([-x2, x1], dim=-1)
    return x * cos2 + rot * sin2


class Attention(nn.Module):
    """Causal grouped-query self-attention through scaled_dot_product_attention.  With
    ``cfg.qkv_bias`` the query, key and value projections add ``bq (heads, head_dim)``,
    ``bk``, ``bv (kv_heads, head_dim)``; with ``cfg.qk_norm`` each head's query and key pass
    through ``q_norm``, ``k_norm`` (a :class:`HeadNorm` each) before RoPE."""

    param_axes: ClassVar[dict[str, Axes]] = {
        "wq": ("heads", "head_dim", "embed"),
        "wk": ("kv_heads", "head_dim", "embed"),
        "wv": ("kv_heads", "head_dim", "embed"),
        "wo": ("embed", "heads", "head_dim"),
        "bq": ("heads", "head_dim"),
        "bk": ("kv_heads", "head_dim"),
        "bv": ("kv_heads", "head_dim"),
    }

    def __init__(self, cfg: LlamaConfig, device=None):
        super().__init__()
        self.cfg = cfg
        hd = cfg.hd
        self.wq = nn.Parameter(torch.empty(cfg.heads, hd, cfg.embed, device=device))
        self.wk = nn.Parameter(torch.empty(cfg.kv_heads, hd, cfg.embed, device=device))
        self.wv = nn.Parameter(torch.empty(cfg.kv_heads, hd, cfg.embed, device=device))
        self.wo = nn.Parameter(torch.empty(cfg.embed, cfg.heads, hd, device=device))
        bias = cfg.qkv_bias
        self.bq = nn.Parameter(torch.empty(cfg.heads, hd, device=device)) if bias else None
        self.bk = nn.Parameter(torch.empty(cfg.kv_heads, hd, device=device)) if bias else None
        self.bv = nn.Parameter(torch.empty(cfg.kv_heads, hd, device=device)) if bias else None
        self.q_norm = HeadNorm(hd, cfg.norm_eps, device) if cfg.qk_norm else None
        self.k_norm = HeadNorm(hd, cfg.norm_eps, device) if cfg.qk_norm else None

    def init_weights(self, gen: torch.Generator) -> None:
        for w in (self.wq, self.wk, self.wv):
            nn.init.normal_(w, std=self.cfg.init_std, generator=gen)
        nn.init.normal_(self.wo, std=self.cfg.init_std / math.sqrt(2 * self.cfg.layers), generator=gen)
        for b in (self.bq, self.bk, self.bv):
            if b is not None:
                nn.init.zeros_(b)

    def _project(self, x: Tensor, w: Tensor, b: Optional[Tensor], heads: int) -> Tensor:
        """``x @ w`` (plus ``b``) per head: (batch, heads, seq, head_dim)."""
        y = F.linear(x, w.flatten(0, 1), None if b is None else b.flatten())
        return y.unflatten(-1, (heads, self.cfg.hd)).transpose(1, 2)

    def forward(self, x: Tensor, cache=None) -> Tensor:  # x: (batch, seq, embed)
        """``cache``: this layer's view of a KV cache when decoding (NOTE [KV cache] in
        meshlm/infer/cache.py)."""
        cfg = self.cfg
        b, s, _ = x.shape
        x = constrain(x, ("batch", WHOLE, "embed"))
        q = constrain(self._project(x, self.wq, self.bq, cfg.heads), ("batch", "heads", WHOLE, "head_dim"))
        k = constrain(self._project(x, self.wk, self.bk, cfg.kv_heads), ("batch", "kv_heads", WHOLE, "head_dim"))
        v = constrain(self._project(x, self.wv, self.bv, cfg.kv_heads), ("batch", "kv_heads", WHOLE, "head_dim"))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if cache is None:
            cos, sin = rope_tables(s, cfg.hd, cfg.rope_theta, x.device, q.dtype)
        else:
            cos, sin = rope_at(cache.positions, cfg.hd, cfg.rope_theta, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        mask, causal = None, True
        if cache is not None:  # every position so far: (batch, kv_heads, cached + s, head_dim)
            k, v = cache.update(k, v)
            mask, causal = cache.mask, cache.causal
        rep = cfg.heads // cfg.kv_heads
        if rep > 1:  # each kv head serves `rep` consecutive query heads
            # Repeated here rather than with SDPA's enable_gqa: torch's CPU flash kernel is
            # row-invariant in bf16 on this path only (NOTE [mixed-precision parity] in
            # meshlm/train/tolerances.py); context parallel then exchanges the repeated heads
            # (docs/cp.md, limits).
            n = k.shape[2]
            k = k[:, :, None].expand(b, cfg.kv_heads, rep, n, cfg.hd).flatten(1, 2)
            v = v[:, :, None].expand(b, cfg.kv_heads, rep, n, cfg.hd).flatten(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        o = constrain(o, ("batch", "heads", WHOLE, "head_dim"))
        o = o.transpose(1, 2).flatten(2, 3)  # (batch, seq, heads * head_dim)
        return constrain(F.linear(o, self.wo.flatten(1, 2)), ("batch", "seq", "embed"))


class MLP(nn.Module):
    """SwiGLU feed-forward block: embed -> mlp -> embed."""

    param_axes: ClassVar[dict[str, Axes]] = {
        "w_gate": ("mlp", "embed"),
        "w_up": ("mlp", "embed"),
        "w_down": ("embed", "mlp"),
    }

    def __init__(self, cfg: LlamaConfig, device=None):
        super().__init__()
        self.cfg = cfg
        self.w_gate = nn.Parameter(torch.empty(cfg.mlp, cfg.embed, device=device))
        self.w_up = nn.Parameter(torch.empty(cfg.mlp, cfg.embed, device=device))
        self.w_down = nn.Parameter(torch.empty(cfg.embed, cfg.mlp, device=device))

    def init_weights(self, gen: torch.Generator) -> None:
        nn.init.normal_(self.w_gate, std=self.cfg.init_std, generator=gen)
        nn.init.normal_(self.w_up, std=self.cfg.init_std, generator=gen)
        nn.init.normal_(self.w_down, std=self.cfg.init_std / math.sqrt(2 * self.cfg.layers), generator=gen)

    def forward(self, x: Tensor) -> Tensor:  # x: (batch, seq, embed)
        x = constrain(x, ("batch", WHOLE, "embed"))
        h = F.silu(F.linear(x, self.w_gate)) * F.linear(x, self.w_up)
        h = constrain(h, ("batch", WHOLE, "mlp"))
        return constrain(F.linear(h, self.w_down), ("batch", "seq", "embed"))


@block
class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x)));
    ``drop`` is residual dropout of probability ``cfg.dropout`` in training mode."""

    def __init__(self, cfg: LlamaConfig, device=None):
        super().__init__()
        self.dropout = cfg.dropout
        self.attn_norm = RMSNorm(cfg.embed, cfg.norm_eps, device)
        self.attn = Attention(cfg, device)
        self.mlp_norm = RMSNorm(cfg.embed, cfg.norm_eps, device)
        self.mlp = MLP(cfg, device)

    def forward(self, x: Tensor, cache=None) -> Tensor:  # x: (batch, seq, embed)
        axes = ("batch", "seq", "embed")
        x = x + dropout(self.attn(self.attn_norm(x), cache), self.dropout, axes, self.training)
        x = x + dropout(self.mlp(self.mlp_norm(x)), self.dropout, axes, self.training)
        return constrain(x, axes)


class Llama(nn.Module):
    """Decoder-only Llama.  ``forward(tokens)`` gives logits; with ``labels`` the mean
    next-token cross-entropy over every position of the (global) batch."""

    param_axes: ClassVar[dict[str, Axes]] = {
        "tok_emb": ("vocab", "embed"),
        "lm_head": ("vocab", "embed"),
    }

    def __init__(self, cfg: LlamaConfig, device=None, seed: Optional[int] = 0):
        """Built on ``device`` (``"meta"`` for a model that lowering materialises shard by
        shard).  On a real device the weights are initialised from ``seed`` (None: leave
        them uninitialised)."""
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Parameter(torch.empty(cfg.vocab, cfg.embed, device=device))
        self.layers = nn.ModuleList(TransformerBlock(cfg, device) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.embed, cfg.norm_eps, device)
        if cfg.tie_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Parameter(torch.empty(cfg.vocab, cfg.embed, device=device))
        if seed is not None and torch.device(device or "cpu").type != "meta":
            init_params(self, seed)

    def init_weights(self, gen: torch.Generator) -> None:
        nn.init.normal_(self.tok_emb, std=self.cfg.init_std, generator=gen)
        if self.lm_head is not None:
            nn.init.normal_(self.lm_head, std=self.cfg.init_std, generator=gen)

    def forward(self, tokens: Tensor, labels: Optional[Tensor] = None, cache=None) -> Tensor:
        """``cache``: a KV cache when decoding (NOTE [KV cache] in meshlm/infer/cache.py);
        ``tokens`` are then the new tokens only."""
        return self.from_embeddings(self.embed_tokens(tokens), labels, cache)

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        """The input embeddings ``(batch, seq, embed)`` of ``tokens`` ``(batch, seq)``."""
        return constrain(F.embedding(tokens, self.tok_emb), ("batch", "seq", "embed"))

    def from_embeddings(self, x: Tensor, labels: Optional[Tensor] = None, cache=None) -> Tensor:
        """The rest of :meth:`forward` from input embeddings ``x`` ``(batch, seq, embed)``:
        the blocks, the final norm and the head (and the loss, with ``labels``).  A model
        that builds its own input embeddings (meshlm/models/vlm.py) runs the decoder here."""
        for i, layer in enumerate(self.layers):
            x = layer(x) if cache is None else layer(x, cache=cache.layer(i))
        # The output head needs every position (a vocab-parallel head is column-parallel).
        x = constrain(self.norm(x), ("batch", WHOLE, "embed"))
        if cache is not None and cache.last_only:  # generation reads the last position's logits only
            x = x[:, -1:]
        head = self.tok_emb if self.cfg.tie_embeddings else self.lm_head  # one at-use gather, not two
        logits = constrain(F.linear(x, head), ("batch", "seq", "vocab"))
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
