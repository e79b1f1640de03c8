"""The activation formula re-derived for our Llama block (docs/plan.md, "Activations
of our Llama block"): the analytic planner's, and the cross-check of the fake
measurement (NOTE [fake measurement] in measure.py)."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from meshlm.layout.rules import Layout
from meshlm.models import LlamaConfig
from meshlm.plan.cp import CP, cp_degree
from meshlm.plan.report import _bytes
from meshlm.plan.state import _prod


def activation_bytes(
    cfg: LlamaConfig, lay: Layout, sizes: Mapping[str, int], b: int, s: int, ac: str, dtype: torch.dtype
) -> dict[str, Any]:
    """Activation bytes per rank per micro-batch (docs/plan.md, "Activations").

    ``held``: what stays allocated from the end of forward to the start of backward (what
    autograd and checkpointing keep).  ``recompute``: the transient extra while backward
    recomputes one checkpointed block.  Per token of one block, in bytes, with B the
    compute dtype's size, F = 4 (float32), t the tp degree of heads/kv_heads/mlp, ts of seq:

      RMSNorm (x2):  F·h/ts (its float32 input)  + F/ts (rsqrt)  + B·h/ts (normalised x,
                     kept for the weight's gradient) + B·h (its output as the matmuls see
                     it: whole seq, gathered over ts under sequence parallelism)
      attention:     B·(q + k' + v' + o)/t  +  F·a/t (logsumexp)   (q after RoPE, k' and v'
                     as SDPA sees them: expanded to all heads under GQA, so q each, else kv;
                     o the SDPA output, which the o-projection's view reuses)
      MLP:           4·B·f/t  (gate, silu(gate), up, silu·up)
      RoPE tables:   4·s·hd·B per layer (cos and sin, concatenated, for q and for k)

    Under context parallelism (``seq`` over cp of c ranks, NOTE [planned cp] in cp.py) every
    per-token term counts this rank's b·s/c tokens, the norm's output included (no gather),
    and the o-projection saves a copy of the attention output: B·q/t more per token.

    Outside blocks: the final norm (as above) and the float32 log-softmax of the logits
    (F·V/tv per token), plus the loss's 4-byte total weight.

    ``selective`` blocks keep only the block input (B·h/ts) and the matmul and attention
    outputs: B·(q + 2kv + o)/t + F·a/t + B·h (o-projection output, whole seq, before its
    reduction) + 2·B·f/t (gate, up) + B·h (down-projection output).  ``full`` keeps the
    block input only.  Blocks whose parameters are re-gathered (ZeRO-3) add no checkpoint of
    their own in eager mode: they free their gathered parameters after forward and gather
    them again in backward (NOTE [free and re-gather] in bucket/regather.py), so without
    ``train.activation_checkpointing`` they hold what an unchecked block holds, and with it
    what train's checkpoint keeps."""
    h, hd = cfg.embed, cfg.hd
    q, kv, f, a, V, L = cfg.heads * hd, cfg.kv_heads * hd, cfg.mlp, cfg.heads, cfg.vocab, cfg.layers
    t = _prod([x for x in lay.compute.get("heads", ()) if sizes.get(x, 1) > 1], sizes)
    tf = _prod([x for x in lay.compute.get("mlp", ()) if sizes.get(x, 1) > 1], sizes)
    tv = _prod([x for x in lay.compute.get("vocab", ()) if sizes.get(x, 1) > 1], sizes)
    ts = _prod([x for x in lay.compute.get("seq", ()) if sizes.get(x, 1) > 1 and x != CP], sizes)
    c = cp_degree(lay, sizes)
    B, F = _bytes(dtype), 4
    tok = b * s // c  # this rank's tokens
    norm = F * h / ts + F / ts + B * h / ts + B * h
    kv_sdpa = q if cfg.heads != cfg.kv_heads else kv
    attn = B * (2 * q + 2 * kv_sdpa) / t + F * a / t + (B * q / t if c > 1 else 0)
    mlp = 4 * B * f / tf
    rope = 4 * s * hd * B
    full_block = tok * (2 * norm + attn + mlp) + rope
    saved_block = tok * (B * h / ts + B * (2 * q + 2 * kv) / t + F * a / t + 2 * B * h + 2 * B * f / tf)
    input_block = tok * B * h / ts
    outside = tok * (norm + F * V / tv) + 4
    if ac == "full":
        per_block, mode = input_block, "full"
    elif ac == "selective":
        per_block, mode = saved_block, "selective"
    else:
        per_block, mode = full_block, "none"
    held = per_block * L + outside
    recompute = max(full_block - per_block, 0) if mode != "none" else 0
    text = {
        "none": "per layer sb·(2·[(F+B)h/ts + F/ts + Bh] + B(2q+2k')/t + F·a/t + 4B·f/t) + 4s·hd·B",
        "selective": "per layer sb·(Bh/ts + B(2q+2kv)/t + F·a/t + 2Bh + 2B·f/t) (matmul/SDPA outputs)",
        "full": "per layer sb·B·h/ts (block input)",
    }[mode]
    # Korthikanti et al. (GPT block, 16-bit, bytes per layer) for the same regime, for scale.
    sbh = s * b * h / c
    if mode == "full":
        korthikanti = 2 * sbh / ts
    elif mode == "selective":
        korthikanti = 34 * sbh / ts if (t == 1 or ts > 1) else sbh * (10 + 24 / t)
    else:
        korthikanti = (
            sbh * (34 + 5 * a * s / h)
            if t == 1
            else (sbh * (10 + 24 / t + 5 * a * s / (h * t)) if ts == 1 else sbh * (34 / t + 5 * a * s / (h * t)))
        )
    return {
        "held": int(held),
        "recompute": int(recompute),
        "layers": L,
        "per_layer": per_block,
        "outside_blocks": outside,
        "checkpointing": mode,
        "text": text
        + f", q={q}, kv={kv}, f={f}, t={t}, ts={ts}"
        + (f"; cp={c}: s/cp tokens, + B·q/t per token (the attention output's copy)" if c > 1 else ""),
        "korthikanti_gpt_16bit_per_layer": korthikanti,
    }
