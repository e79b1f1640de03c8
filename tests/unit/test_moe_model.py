"""meshlm.models.MoETransformer on one device: the Hydra nodes conf/model/moe*.yaml build the
shipped configs with the parameter counts they state, and the loss is the cross-entropy
plus the mean of the blocks' per-row auxiliary losses, recomputed here in plain torch."""

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from meshlm.models import MOE_CONFIGS, MoETransformer, moe_config, moe_model

CONF = Path(__file__).resolve().parents[2] / "conf" / "model"


@pytest.mark.parametrize("name", sorted(MOE_CONFIGS))
def test_conf_node_instantiates_the_shipped_config(name):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    path = CONF / f"{name}.yaml"
    node = OmegaConf.load(path)
    assert node.name == name and node._target_ == "meshlm.models.moe_model"
    model = instantiate({k: v for k, v in node.items() if k not in ("name", "init_from")}, device="meta")
    assert isinstance(model, MoETransformer) and model.cfg == MOE_CONFIGS[name]
    n = sum(p.numel() for p in model.parameters())
    assert n == model.cfg.num_params()
    # active: the experts a token does not use left out
    experts = sum(p.numel() for k, p in model.named_parameters() if k.split(".")[-1] in ("w_gate", "w_up", "w_down"))
    unused = experts * (model.cfg.experts - model.cfg.top_k) // model.cfg.experts
    assert model.cfg.num_params(active=True) == n - unused
    first = path.read_text().splitlines()[0]
    stated = re.search(r"\(([\d.]+)M parameters, ([\d.]+)M active", first)
    assert stated and float(stated.group(1)) == round(n / 1e6, 1), (stated, n)


def test_loss_is_cross_entropy_plus_mean_aux():
    m = MoETransformer(moe_config("moe_shared_tiny"), seed=0)
    g = torch.Generator().manual_seed(0)
    tokens, labels = torch.randint(0, 256, (3, 12), generator=g), torch.randint(0, 256, (3, 12), generator=g)
    aux = []
    hooks = [blk.moe.register_forward_hook(lambda _m, _i, out: aux.append(out[1])) for blk in m.layers]
    loss = m(tokens, labels)
    for h in hooks:
        h.remove()
    logits = m(tokens)
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten()) + sum(aux).mean()
    assert len(aux) == 2 and float(sum(aux).mean().detach()) > 0
    torch.testing.assert_close(loss, want)


def test_unknown_field_is_a_config_error():
    from meshlm.core.errors import ConfigError

    with pytest.raises(ConfigError, match="model.expert"):
        moe_model(device="meta", expert=4)
    with pytest.raises(ConfigError, match="top_k=9"):
        moe_model(device="meta", top_k=9)


def test_batch_yields_ep_to_experts():
    """The token buffer under fsdp_ep: rows over fsdp, experts over ep; without the experts
    dim the rows take both (NOTE [sequence yields] in meshlm/layout/rules.py)."""
    from meshlm.core.errors import LayoutError
    from meshlm.layout.rules import load_layout, resolve

    lay, mesh = load_layout("fsdp_ep"), {"fsdp": 2, "ep": 2}
    assert resolve(("batch", "experts", None, "embed"), lay.compute, mesh) == (("fsdp",), ("ep",), (), ())
    assert resolve(("batch", None, None, "embed"), lay.compute, mesh) == (("fsdp", "ep"), (), (), ())
    with pytest.raises(LayoutError, match="used twice"):  # any other double use stays an error
        resolve(("batch", "heads"), {"batch": ("fsdp",), "heads": ("fsdp",)}, mesh)
