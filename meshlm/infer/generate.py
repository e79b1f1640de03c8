"""Generating tokens with a KV cache, on one device or under any layout the model was
sharded with (``meshlm.shard``): prefill the prompts in one forward, then one forward per
new token (NOTE [KV cache] in meshlm/infer/cache.py).

Prompts of different lengths are left-padded into one batch; each row stops at its own stop
token (which is kept, as Hugging Face's ``generate`` keeps its ``eos_token_id``) or after
``max_new_tokens``.  Under a sharded model every rank runs the same loop on the same prompts
and gets the same tokens: the logits of the last position are made whole (under a
vocab-parallel head, one all-gather a step) and every rank draws from generators of the same
seed, one per row, so that a row draws what it would alone, in whatever batch.
"""

from __future__ import annotations

import inspect
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from meshlm import _torch_compat as compat
from meshlm.core.errors import ConfigError
from meshlm.infer.cache import KVCache
from meshlm.infer.compiled import decode_step
from meshlm.infer.sample import Sampling, choose, generators
from meshlm.runtime.hooks import original_class


def context_of(model: nn.Module) -> Optional[int]:
    """The longest sequence the model reads (GPT-2's learned positions), or None."""
    cfg = getattr(model, "cfg", None)
    return getattr(cfg, "block_size", None)


def stop_id(tok: Any, text: str, what: str) -> int:
    """The one token ``text`` is under ``tok`` (a stop text); ``what`` names the option."""
    ids = tok.encode(text).tolist()
    if len(ids) != 1:
        raise ConfigError(f"{what} {text!r} is {len(ids)} tokens under this tokenizer; a stop text must be one token")
    return ids[0]


def supports_cache(model: nn.Module) -> bool:
    fwd = getattr(model, "_meshlm_orig_forward", None) or type(model).forward
    return "cache" in inspect.signature(fwd).parameters


def _device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return torch.device(p.device_mesh.device_type) if isinstance(p, DTensor) else p.device
    return torch.device("cpu")


def _check_layout(model: nn.Module) -> None:
    """Every rank decodes the whole batch: a layout that splits the batch over a mesh axis
    would take each rank's prompts for its slice of a larger batch."""
    st = getattr(model, "_meshlm_state", None)
    if st is None:
        return
    pl = st.input_placements(("batch", "seq"))
    split = [f"{n}={st.mesh.size(i)}" for i, (n, p) in enumerate(zip(st.names, pl)) if p.is_shard()]
    if split:
        raise ConfigError(
            f"generate: layout {st.layout.name!r} splits the batch over {', '.join(split)}, but every rank "
            "decodes the whole batch of prompts: use a layout whose compute rules leave `batch` whole "
            "(tp, single), or a mesh without those axes"
        )


def _check(model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> int:
    _check_layout(model)
    if not supports_cache(model):
        raise ConfigError(
            f"generate: {original_class(type(model)).__name__}.forward takes no `cache` argument, so it cannot decode "
            "incrementally: see NOTE [KV cache] in meshlm/infer/cache.py for the contract"
        )
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("generate: every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ConfigError(f"generate: max_new_tokens={max_new_tokens} must be at least 1")
    longest = max(len(p) for p in prompts)
    ctx = context_of(model)
    if ctx is not None and longest + max_new_tokens > ctx:
        raise ConfigError(
            f"generate: a prompt of {longest} tokens + max_new_tokens={max_new_tokens} = "
            f"{longest + max_new_tokens} exceeds the model's context of {ctx} tokens: shorten the prompt "
            "or ask for fewer tokens"
        )
    vocab = getattr(getattr(model, "cfg", None), "vocab", None)
    if vocab is not None:
        bad = [t for p in prompts for t in p if not 0 <= int(t) < vocab]
        if bad:
            raise ConfigError(f"generate: token id {bad[0]} is outside the model's vocabulary of {vocab}")
    return longest


def _last_logits(out: Tensor) -> Tensor:
    last = out[:, -1]
    return last.full_tensor() if isinstance(last, DTensor) else last


@torch.no_grad()
def stream(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    stop: Sequence[int] = (),
    pad: int = 0,
    compile: Optional[str] = None,
    freeze: Optional[bool] = None,
    inputs: Optional[dict[str, Tensor]] = None,
    rows: Optional[Sequence[int]] = None,
) -> Iterator[list[tuple[int, int]]]:
    """Yield, after each decode step, ``(row, token)`` for every row still generating.

    ``compile``: a torch.compile backend (``inductor``; ``aot_eager`` in tests) for the
    decode step (NOTE [compiled decode] in meshlm/infer/compiled.py): traced once, on the
    first decode step; the prefill runs eagerly.  ``freeze``: with inductor, the weights
    frozen into the compiled step (NOTE [frozen decode]): None where it can, True (an error
    where it cannot), False never.  ``inputs``: more keyword inputs of the model's prefill, one row per
    prompt (a vision-language model's ``images``, for the image tokens of its prompts).
    ``rows``: the index of each prompt's sampling stream (NOTE [row streams] in
    meshlm/infer/sample.py; default its position, 0, 1, ...)."""
    longest = _check(model, prompts, max_new_tokens)
    b = len(prompts)
    dev = _device(model)
    tokens = torch.full((b, longest), pad, dtype=torch.long)
    valid = torch.zeros(b, longest, dtype=torch.bool)
    for i, p in enumerate(prompts):
        tokens[i, longest - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        valid[i, longest - len(p) :] = True
    cache = KVCache(b, longest + max_new_tokens, device=dev, last_only=True)
    run = model
    if compile is not None:
        compiled = decode_step(model, compile, freeze)
    elif freeze:
        raise ConfigError("generate: freeze=True freezes the weights of a compiled decode step: set compile='inductor'")
    gens = generators(sampling, b if rows is None else list(rows))
    stops = set(int(t) for t in stop)
    live = [True] * b
    was = model.training
    model.eval()
    try:
        feed, mask = tokens, valid
        for n in range(max_new_tokens):
            cache.begin(mask.to(dev))
            if compile is not None and n > 0:
                if cache.mask is not None:  # its length grows each step: a symbol from the first trace
                    compat.mark_dynamic(cache.mask, 3)
                out = compiled(model, feed.to(dev), cache)
            elif n == 0 and inputs:
                out = run(feed.to(dev), cache=cache, **{k: v.to(dev) for k, v in inputs.items()})
            else:
                out = run(feed.to(dev), cache=cache)
            logits = _last_logits(out)
            cache.end()
            nxt = choose(logits.cpu(), sampling, gens)
            out = [(i, int(nxt[i])) for i in range(b) if live[i]]
            for i, t in out:
                live[i] = t not in stops
            yield out
            if not any(live):
                return
            feed, mask = nxt[:, None], torch.ones(b, 1, dtype=torch.bool)
    finally:
        model.train(was)


def generate(model: nn.Module, prompts: Sequence[Sequence[int]], **options: Any) -> list[list[int]]:
    """The new tokens of each prompt (its stop token included, when it was reached);
    ``options`` are :func:`stream`'s (``max_new_tokens``, ``sampling``, ``stop``, ``pad``,
    ``compile``, ``freeze``, ``inputs``, ``rows``)."""
    new: list[list[int]] = [[] for _ in prompts]
    it = stream(model, prompts, **options)
    for step in it:
        for i, t in step:
            new[i].append(t)
    return new
