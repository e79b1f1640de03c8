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
its own initialisation; sizes, FLOPs and parameter count are the same.  ``build(...,
weights=Llama(cfg, seed=0))`` loads meshlm's weights instead (``load_meshlm_weights``); the
two then compute the same function (in fp32 the same loss to the printed 6 digits).

The loss is torchtitan's trainer's: the local sum over the global token count, because
``parallelize_llama`` turns FSDP's gradient division off (the reduction sums).  (Before,
``step`` divided by the local token count, which left the gradients multiplied by the
data-parallel degree.)
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
        layers.append(
            Llama3TransformerBlock.Config(
                attention_norm=RMSNorm.Config(normalized_shape=cfg.embed, eps=cfg.norm_eps, param_init=tl._NORM_INIT),
                ffn_norm=RMSNorm.Config(normalized_shape=cfg.embed, eps=cfg.norm_eps, param_init=tl._NORM_INIT),
                attention=make_gqa_config(
                    dim=cfg.embed,
                    n_heads=cfg.heads,
                    n_kv_heads=cfg.kv_heads,
                    wqkv_param_init=lin,
                    wo_param_init=tl._depth_init(i),
                    inner_attention=ScaledDotProductAttention.Config(),
                    fuse_qkv=True,
                    rope=ComplexRoPE.Config(dim=cfg.hd, max_seq_len=seq, theta=cfg.rope_theta),
                ),
                feed_forward=make_ffn_config(
                    dim=cfg.embed, hidden_dim=cfg.mlp, w1_param_init=lin, w2w3_param_init=tl._depth_init(i)
                ),
            )
        )
    mc = Llama3Model.Config(
        dim=cfg.embed,
        vocab_size=cfg.vocab,
        tok_embeddings=Embedding.Config(
            num_embeddings=cfg.vocab, embedding_dim=cfg.embed, param_init=tl._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=cfg.embed, eps=cfg.norm_eps, param_init=tl._NORM_INIT),
        lm_head=Linear.Config(
            in_features=cfg.embed, out_features=cfg.vocab, param_init=tl._output_linear_init(cfg.embed)
        ),
        layers=layers,
    )
    par = ParallelismConfig(
        data_parallel_replicate_degree=dp_rep,
        data_parallel_shard_degree=dp_shard,
        tensor_parallel_degree=tp,
        enable_sequence_parallel=sp,
        spmd_backend="partial_dtensor",
    )

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


def build_parts(
    cfg,
    layout: str,
    mesh_sizes: dict,
    seq: int,
    compile_backend: str | None,
    lr: float,
    *,
    param_dtype: str = "float32",
    reduce_dtype: str = "float32",
    reshard: str = "default",
    weights=None,
) -> dict:
    """torchtitan's model for ``layout`` on this rank, as torchtitan's trainer sets it up.

    ``param_dtype`` / ``reduce_dtype``: torchtitan's ``TrainingConfig.mixed_precision_param``
    and ``mixed_precision_reduce`` ("bfloat16" / "float32" is its bf16 training; it applies
    them through FSDP2's ``MixedPrecisionPolicy`` on every layout, DDP included).
    ``reshard``: ``ParallelismConfig.fsdp_reshard_after_forward`` ("default", "never",
    "always").  ``weights``: a one-device ``meshlm.models.Llama`` whose weights replace
    torchtitan's initialisation (``load_meshlm_weights``).

    Returns ``dict(model, opt, loss, shard, n_dp)``: ``loss(x, y)`` is torchtitan's training
    loss, the local sum of token losses over the global token count (its trainer's; FSDP's own
    gradient division is off, so the reduction sums), on this rank's slice ``x, y`` of the
    global batch (``shard(global_tokens)``); ``loss(x, y) * n_dp`` is the local mean."""
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
    par.fsdp_reshard_after_forward = reshard
    dist_utils.set_spmd_backend("partial_dtensor")
    dims = ParallelDims.from_config(par, dist.get_world_size())
    dims.build_mesh()
    with torch.device("meta"):
        model = mc.build()
    training = TrainingConfig(mixed_precision_param=param_dtype, mixed_precision_reduce=reduce_dtype)
    comp = CompileConfig(
        enable=compile_backend is not None, components=["model"], backend=compile_backend or "inductor"
    )
    model = parallelize_llama(
        model,
        parallel_dims=dims,
        training=training,
        parallelism=par,
        compile_config=comp,
        ac_config=None,
        dump_folder="/tmp/meshlm_bench_titan",
    )
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    if weights is not None:
        load_meshlm_weights(model, weights)
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
        return tokens[dp_rank * b : (dp_rank + 1) * b]

    def loss(x, y):
        return cross_entropy_loss(model(x), y) / (y.numel() * n_dp)

    return dict(model=model, opt=opt, loss=loss, shard=shard, n_dp=n_dp)


def build(cfg, layout: str, mesh_sizes: dict, seq: int, compile_backend: str | None, lr: float, **kw):
    """``build_parts`` as ``(model, optimizer, step, shard)``: ``step(x, y)`` runs forward,
    backward and AdamW on this rank's batch slice ``x, y`` (from ``shard(global_tokens)``) and
    returns the local mean loss."""
    p = build_parts(cfg, layout, mesh_sizes, seq, compile_backend, lr, **kw)
    opt, n_dp = p["opt"], p["n_dp"]

    def step(x, y):
        loss = p["loss"](x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach() * n_dp

    return p["model"], opt, step, p["shard"]


def load_meshlm_weights(model, ref, partial: bool = False) -> None:
    """Copy a one-device ``meshlm.models.Llama``'s weights into torchtitan's ``model`` (its
    parameters plain or DTensors, as ``parallelize_llama`` left them), so that both compute
    the same function:

    - meshlm rotates halves of each head (pairs ``(i, i + hd/2)``), torchtitan's complex RoPE
      adjacent pairs ``(2i, 2i + 1)``, with the same frequency for pair ``i``: each head's
      rows of wq and wk are reordered to ``[0, hd/2, 1, hd/2 + 1, ...]`` (the q.k products, and
      so the attention, are unchanged; v and wo keep their order);
    ``partial``: ``model`` is a pipeline stage's part, holding some of the parameters;
    - torchtitan's fused ``wqkv`` holds, per kv head ``g``, its ``heads/kv_heads`` query heads
      (``g * rep ...``, the query heads meshlm's grouping gives kv head ``g``), then k ``g``,
      then v ``g``."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    def rope_order(w):  # (heads, hd, embed), halves -> interleaved pairs
        h, hd, d = w.shape
        return w.view(h, 2, hd // 2, d).transpose(1, 2).reshape(h, hd, d)

    full = {"tok_embeddings.weight": ref.tok_emb, "lm_head.weight": ref.lm_head, "norm.weight": ref.norm.weight}
    for i, r in enumerate(ref.layers):
        a = r.attn
        kv, hd, d = a.wk.shape
        q = rope_order(a.wq.detach()).view(kv, -1, hd, d)
        k = rope_order(a.wk.detach()).view(kv, 1, hd, d)
        v = a.wv.detach().view(kv, 1, hd, d)
        pre = f"layers.{i}."
        full.update(
            {
                pre + "attention.qkv_linear.wqkv.weight": torch.cat([q, k, v], dim=1).reshape(-1, d),
                pre + "attention.wo.weight": a.wo.flatten(1, 2),
                pre + "feed_forward.w1.weight": r.mlp.w_gate,
                pre + "feed_forward.w3.weight": r.mlp.w_up,
                pre + "feed_forward.w2.weight": r.mlp.w_down,
                pre + "attention_norm.weight": r.attn_norm.weight,
                pre + "ffn_norm.weight": r.mlp_norm.weight,
            }
        )
    params = dict(model.named_parameters())
    if partial:  # a pipeline stage's part: the names it kept
        full = {k: v for k, v in full.items() if k in params}
    if set(params) != set(full):
        raise ValueError(f"torchtitan parameters {sorted(set(params) ^ set(full))} have no meshlm counterpart")
    with torch.no_grad():
        for name, p in params.items():
            w = full[name].detach().to(p.dtype)
            if tuple(w.shape) != tuple(p.shape):
                raise ValueError(f"{name}: meshlm {tuple(w.shape)} vs torchtitan {tuple(p.shape)}")
            if isinstance(p, DTensor):
                w = distribute_tensor(w, p.device_mesh, p.placements)
            p.copy_(w)


TITAN_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B", "zbv": "ZBVZeroBubble"}


def build_pipeline(
    cfg,
    mesh_sizes: dict,
    seq: int,
    global_batch: int,
    microbatches: int,
    schedule: str,
    compile_backend: str | None,
    lr: float,
    weights=None,
) -> dict:
    """torchtitan's pipeline parallelism for ``mesh_sizes`` (``pp``, and ``fsdp`` inside each
    stage), as its trainer sets it up: ``pipeline_llm`` (its module split: copies of the
    model with the other stages' layers deleted, its ``parallelize_llama`` per stage, its
    schedule builder), stages of equal block counts (``pipeline_parallel_first_stage_less_
    layers`` and ``last_stage_less_layers`` 0, as meshlm's ``pipeline.split`` in the
    benchmark), ``microbatches`` micro-batches of this rank's rows.

    Returns ``dict(parts, opt, step)``: ``step(x, y)`` runs one schedule step (forward,
    backward) and AdamW over every part on this rank's rows ``x, y``, and returns the step's
    summed loss where this rank holds the last stage (else None)."""
    import torch.distributed as dist

    _import()
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.llama3 import parallelize_llama

    pp, fsdp = mesh_sizes.get("pp", 1), mesh_sizes.get("fsdp", 1)
    mc, par = _model_config(cfg, False, 1, fsdp, 1, seq)
    par.pipeline_parallel_degree = pp
    par.pipeline_parallel_schedule = TITAN_SCHEDULES[schedule]
    local = global_batch // fsdp
    par.pipeline_parallel_microbatch_size = local // microbatches
    par.pipeline_parallel_first_stage_less_layers = 0
    par.pipeline_parallel_last_stage_less_layers = 0
    dist_utils.set_spmd_backend("partial_dtensor")
    dims = ParallelDims.from_config(par, dist.get_world_size())
    dims.build_mesh()
    with torch.device("meta"):
        model = mc.build()
    tokens = global_batch * seq

    def loss_fn(pred, labels):  # its trainer's: the sum over the global token count, and its metrics
        return cross_entropy_loss(pred, labels) / tokens, {}

    comp = CompileConfig(
        enable=compile_backend is not None, components=["model"], backend=compile_backend or "inductor"
    )
    sched, parts, first, last = pipeline_llm(
        model,
        parallel_dims=dims,
        # fp32 as meshlm's run (its default mixed_precision_param is bfloat16)
        training=TrainingConfig(
            local_batch_size=local, mixed_precision_param="float32", mixed_precision_reduce="float32"
        ),
        parallelism=par,
        compile_config=comp,
        ac_config=None,
        dump_folder="/tmp/meshlm_bench_titan",
        device=torch.device("cpu"),
        model_config=mc,
        parallelize_fn=parallelize_llama,
        loss_fn=loss_fn,
    )
    for m in parts:
        m.to_empty(device="cpu")
        with torch.no_grad():
            m.init_weights(buffer_device=None)
        if weights is not None:
            load_meshlm_weights(m, weights, partial=True)
        m.train()
        for sub in m.modules():
            if isinstance(sub, FSDPModule):
                sub.set_force_sum_reduction_for_comms(True)  # gloo: no PREMUL_SUM
    opt = torch.optim.AdamW([p for m in parts for p in m.parameters()], lr=lr)

    def step(x, y):
        losses = []
        if first and last:
            sched.step(x, target=y, losses=losses)
        elif first:
            sched.step(x)
        elif last:
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        opt.step()
        opt.zero_grad()
        return sum(float(v) for v in losses) if last else None

    return dict(parts=parts, opt=opt, step=step, dims=dims)
