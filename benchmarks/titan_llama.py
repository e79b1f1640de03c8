"""torchtitan 0.3.0 (PyPI, the optional ``bench`` extra) at meshlm's sizes, on CPU gloo.

Uses torchtitan's own Llama 3 model (``Llama3Model``), its ``parallelize_llama`` (its TP
plan, FSDP2 wrapping and per-block compile), its ``ParallelDims`` and its loss.  Nothing
of torchtitan is copied into meshlm; this module only imports it.

What it takes to run torchtitan 0.3.0 on CPU with torch 2.13 (each found by running it):
- ``torchtitan.tools.utils`` asks torch for the available device type at import and falls
  back to "cuda": the probe is made to say "cpu" before the import.
- It imports ``triton`` unconditionally (installed; no triton kernel runs on CPU).
- Its language-model attention configs accept only flex/varlen attention, and flex has no
  CPU backward: its own causal ``ScaledDotProductAttention`` is put in their place.
- gloo has no PREMUL_SUM reduction, which FSDP2 uses to average gradients:
  ``set_force_sum_reduction_for_comms(True)`` sums then divides (the same math).
- The default ``spmd_types`` backend fails with torch 2.13; ``partial_dtensor`` works.

Differences from meshlm's Llama that remain: torchtitan fuses wq/wk/wv into one wqkv
matrix, uses complex-number RoPE (same rotation, interleaved pairs instead of halves) and
its own initialisation; sizes, FLOPs and parameter count are the same.
"""

from __future__ import annotations

import torch


def available() -> str | None:
    """None when torchtitan can be imported, else why not."""
    try:
        _import()
    except Exception as e:  # noqa: BLE001 - any import failure means "skip the column"
        return f"{type(e).__name__}: {e}"
    return None


def _import():
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"  # before torchtitan imports it
    import torchtitan.models.llama3 as tl

    return tl


def _model_config(cfg, sp: bool, tp: int, dp_shard: int, dp_rep: int, seq: int):
    tl = _import()
    from torchtitan.config import ParallelismConfig
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock

    lin = tl._LINEAR_INIT
    layers = []
    for i in range(cfg.layers):
        layers.append(Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=cfg.embed, eps=cfg.norm_eps, param_init=tl._NORM_INIT),
            ffn_norm=RMSNorm.Config(normalized_shape=cfg.embed, eps=cfg.norm_eps, param_init=tl._NORM_INIT),
            attention=make_gqa_config(
                dim=cfg.embed, n_heads=cfg.heads, n_kv_heads=cfg.kv_heads, wqkv_param_init=lin,
                wo_param_init=tl._depth_init(i), inner_attention=ScaledDotProductAttention.Config(),
                fuse_qkv=True, rope=ComplexRoPE.Config(dim=cfg.hd, max_seq_len=seq, theta=cfg.rope_theta)),
            feed_forward=make_ffn_config(dim=cfg.embed, hidden_dim=cfg.mlp, w1_param_init=lin,
                                         w2w3_param_init=tl._depth_init(i)),
        ))
    mc = Llama3Model.Config(
        dim=cfg.embed, vocab_size=cfg.vocab,
        tok_embeddings=Embedding.Config(num_embeddings=cfg.vocab, embedding_dim=cfg.embed,
                                        param_init=tl._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=cfg.embed, eps=cfg.norm_eps, param_init=tl._NORM_INIT),
        lm_head=Linear.Config(in_features=cfg.embed, out_features=cfg.vocab,
                              param_init=tl._output_linear_init(cfg.embed)),
        layers=layers,
    )
    par = ParallelismConfig(data_parallel_replicate_degree=dp_rep, data_parallel_shard_degree=dp_shard,
                            tensor_parallel_degree=tp, enable_sequence_parallel=sp,
                            spmd_backend="partial_dtensor")

    class _Cfg:  # update_from_config needs only `.parallelism` from a non-trainer caller
        parallelism = par

    mc.update_from_config(config=_Cfg())
    return mc, par


# meshlm layout -> (dp_replicate, dp_shard, tp, sequence parallel) on 4 ranks
STRATEGIES = {
    "ddp": lambda m: (m.get("dp", 1), 1, 1, False),
    "fsdp": lambda m: (1, m.get("fsdp", 1), 1, False),
    "hsdp": lambda m: (m.get("dp", 1), m.get("fsdp", 1), 1, False),
    "tp": lambda m: (1, 1, m.get("tp", 1), False),
    "tp_sp": lambda m: (1, 1, m.get("tp", 1), True),
    "fsdp_tp": lambda m: (1, m.get("fsdp", 1), m.get("tp", 1), False),
    "fsdp_tp_sp": lambda m: (1, m.get("fsdp", 1), m.get("tp", 1), True),
}


def build(cfg, layout: str, mesh_sizes: dict, seq: int, compile_backend: str | None, lr: float):
    """torchtitan's model for ``layout`` on this rank: ``(model, optimizer, step, shard)``:
    ``step(x, y)`` runs forward, backward and AdamW on this rank's batch slice ``x, y``
    (from ``shard(global_tokens)``) and returns the loss."""
    import torch.distributed as dist

    _import()
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3 import parallelize_llama

    dp_rep, dp_shard, tp, sp = STRATEGIES[layout](mesh_sizes)
    mc, par = _model_config(cfg, sp, tp, dp_shard, dp_rep, seq)
    dist_utils.set_spmd_backend("partial_dtensor")
    dims = ParallelDims.from_config(par, dist.get_world_size())
    dims.build_mesh()
    with torch.device("meta"):
        model = mc.build()
    training = TrainingConfig(mixed_precision_param="float32", mixed_precision_reduce="float32")
    comp = CompileConfig(enable=compile_backend is not None, components=["model"],
                         backend=compile_backend or "inductor")
    model = parallelize_llama(model, parallel_dims=dims, training=training, parallelism=par,
                              compile_config=comp, ac_config=None, dump_folder="/tmp/meshlm_bench_titan")
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)  # gloo: no PREMUL_SUM
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    if dims.dp_enabled:
        batch_mesh = dims.get_mesh("batch")
        n_dp, dp_rank = batch_mesh.size(), batch_mesh.get_local_rank()
    else:
        n_dp, dp_rank = 1, 0

    def shard(tokens: torch.Tensor) -> torch.Tensor:
        b = tokens.shape[0] // n_dp
        return tokens[dp_rank * b:(dp_rank + 1) * b]

    def step(x, y):
        logits = model(x)
        loss = cross_entropy_loss(logits, y) / y.numel()  # sum / local tokens = the mean
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return model, opt, step, shard


