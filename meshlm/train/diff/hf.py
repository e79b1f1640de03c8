"""A Hugging Face ``transformers`` model as one side of a diff, named as meshlm names it.

``capture_transformers(path, micro_batches, ...)`` loads the directory's model with
``transformers`` (float32, one process), runs the same recorded step on it as a meshlm side
runs (``capture_step`` through a ``PlainOptimizer``: AdamW with the same hyperparameters),
and renames what it recorded to the meshlm model of that directory
(``meshlm.interop.hf.model_of``), so that the two sides meet tensor by tensor:

* parameters (``init``, ``grad``, ``param``) by name: each meshlm parameter's Hugging Face
  tensor, turned into meshlm's shape by the family's own reader (``read_block``, the code
  that loads the weights: reshapes, transposes), so a gradient is compared as the weight is;
* block outputs by module: a meshlm block's Hugging Face module is the common prefix of
  its parameters' Hugging Face names (``layers.3`` <- ``model.layers.3``), whose output
  (the first tensor of a tuple) is the block's;
* the loss as meshlm's models compute it: the mean cross-entropy of the logits against the
  labels at every position (``F.cross_entropy`` on the flattened batch, ``-100`` ignored),
  not transformers' own shifted loss.

What transformers computes inside a block has no meshlm name (there is no ``constrain``), so
only the block outputs of the forward meet (NOTE [implementation tolerance] in
meshlm/train/tolerances.py for the tolerance).  The families whose readers know the
tensors are those of meshlm/interop/hf/ (Llama, GPT-2, LLaVA); tested with Llama.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshlm.core.annotate import outer_blocks
from meshlm.train.diff.record import Capture, Record
from meshlm.train.diff.step import PlainOptimizer, capture_step

_PREFIX = "hf"  # the wrapped transformers model's attribute in _CausalLM


class _CausalLM(nn.Module):
    """``forward(tokens, labels)``: the mean next-token cross-entropy as meshlm's models
    compute it, over a transformers causal LM's logits (module docstring)."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf

    def forward(self, tokens: Tensor, labels: Tensor) -> Tensor:
        logits = self.hf(input_ids=tokens).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def _common_prefix(names: list[str]) -> str:
    parts = [n.split(".")[:-1] for n in names]
    out = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        out.append(level[0])
    return ".".join(out)


class Naming:
    """Hugging Face names -> meshlm names of the model in one directory (module docstring)."""

    def __init__(self, path: str):
        from meshlm.interop.hf import model_of
        from meshlm.interop.hf.family import family_of_class

        self.meshlm = model_of(path)  # meta device
        self.fam = family_of_class(type(self.meshlm).__name__)
        self.cfg = self.meshlm.cfg
        self.params = {n: tuple(p.shape) for n, p in self.meshlm.named_parameters()}
        self.hf_of = {n: self.fam.hf_tensor(self.cfg, n, s) for n, s in self.params.items()}
        paths = {id(m): p for p, m in self.meshlm.named_modules()}
        self.blocks: dict[str, str] = {}  # HF module path -> meshlm block path
        for b in outer_blocks(self.meshlm):
            own = [self.hf_of[f"{paths[id(b)]}.{n}"][0] for n, _p in b.named_parameters()]
            if own:
                self.blocks[_common_prefix(own)] = paths[id(b)]

    def param(self, fqn: str, hf_values: dict[str, Tensor]) -> Optional[Tensor]:
        """meshlm parameter ``fqn``'s tensor read out of ``hf_values`` (HF name -> tensor)."""
        name, hs = self.hf_of[fqn]
        t = hf_values.get(self.fam.canonical(name))
        if t is None:
            return None

        def read(n: str, shape: tuple, box: list) -> Tensor:
            v = hf_values[self.fam.canonical(n)]
            return v.reshape(shape)[tuple(slice(s, s + k) for s, k in box)]

        shape = self.params[fqn]
        return self.fam.read_block(read, self.cfg, fqn, shape, [(0, n) for n in shape])


def capture_transformers(
    path: str,
    micro_batches: list[tuple[tuple, dict]],
    *,
    seed: int = 0,
    hp: dict,
    grad_clip: float = 0.0,
    meta: Optional[dict] = None,
) -> Capture:
    """One recorded step of the ``transformers`` model in the Hugging Face directory ``path``
    on ``micro_batches`` (``((tokens, labels), {})`` each, the whole micro-batch), with AdamW
    of hyperparameters ``hp``, named as meshlm names the model (module docstring)."""
    import transformers

    from meshlm.interop.hf.family import strip_scheme

    path = strip_scheme(path)
    naming = Naming(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.train()
    model = _CausalLM(hf)
    opt = PlainOptimizer(model, torch.optim.AdamW(model.parameters(), **hp))
    blocks = {f"{_PREFIX}.{p}" for p in naming.blocks}
    cap = capture_step(model, opt, micro_batches, seed=seed, grad_clip=grad_clip, meta=meta, blocks=blocks)
    return rename(cap, naming)


def rename(cap: Capture, naming: Naming) -> Capture:
    """``cap`` of the wrapped transformers model with meshlm's names (module docstring), in
    its own order; a tensor with no meshlm name keeps its own."""
    values: dict[str, dict[str, Tensor]] = {}
    for r in cap.records:
        if r.kind in ("init", "grad", "param"):
            values.setdefault(r.kind, {})[naming.fam.canonical(r.where.removeprefix(f"{_PREFIX}."))] = r.value
    fqns_of: dict[str, list[str]] = {}
    for fqn, (name, _shape) in naming.hf_of.items():
        fqns_of.setdefault(naming.fam.canonical(name), []).append(fqn)
    out: list[Record] = []
    for r in cap.records:
        if r.kind in ("init", "grad", "param"):
            hf_name = naming.fam.canonical(r.where.removeprefix(f"{_PREFIX}."))
            for fqn in fqns_of.get(hf_name, []):
                v = naming.param(fqn, values[r.kind])
                if v is not None:
                    module, _, name = fqn.rpartition(".")
                    out.append(Record(r.kind, module, name, None, "transformers", v.clone()))
            continue
        module = r.module.removeprefix(f"{_PREFIX}.") if r.module != _PREFIX else ""
        if r.kind == "block":
            module = naming.blocks.get(module, module)
        out.append(Record(r.kind, module, r.tensor, r.axes, "transformers", r.value))
    return Capture(out, {**cap.meta, "implementation": "transformers"})
