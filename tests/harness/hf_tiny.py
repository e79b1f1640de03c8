"""Tiny random Hugging Face models, made locally with transformers (no download), for the
tests that hold meshlm's Llama, GPT-2 and VLM against transformers' own (import, export,
generation).  Their norms and biases are moved off HF's (1, 0) start, so that a mix-up of
them shows in the logits."""

from __future__ import annotations

import torch


def tiny_llama(vocab: int = 256, kv_heads: int = 4, tie: bool = False, layers: int = 2):
    """A grouped-query LlamaForCausalLM of ``layers`` layers: embed 64, 8 heads of 8, mlp 128."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=kv_heads,
        intermediate_size=128,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tie,
        max_position_embeddings=128,
        attention_bias=False,
        mlp_bias=False,
    )
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return m


def tiny_gpt2(
    embed: int = 64, heads: int = 4, vocab: int = 256, tie: bool = True, positions: int = 64, layers: int = 2
):
    """A GPT2LMHeadModel of ``layers`` layers.  initializer_range 0.1, not GPT-2's 0.02:
    activations of order 1, so that GELU's variant or LayerNorm's eps shows in the logits
    (44x and 45x the tolerance of tests/dist/test_hf_gpt2.py), as it would in a trained model."""
    import transformers

    cfg = transformers.GPT2Config(
        n_embd=embed,
        n_layer=layers,
        n_head=heads,
        vocab_size=vocab,
        n_positions=positions,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=tie,
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    m = transformers.GPT2LMHeadModel(cfg).float().eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "ln_" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return m


def tiny_llava(path=None, vision_layers: int = 3, feature_layer: int = -2, tie: bool = False):
    """A LlavaForConditionalGeneration of meshlm's ``vlm_tiny`` shape: a CLIP tower of
    ``vision_layers`` layers (width 32, 4 heads, mlp 64) over 16x16 images of 4x4 patches
    (16 image tokens, id 256), and a 2-layer grouped-query Llama of width 64 over 272
    tokens.  Saved with ``save_pretrained`` to ``path`` when given.  initializer_range is
    0.1 (not 0.02), so that the image features and the projector's activations are of order
    1 in the logits; the tower's LayerNorm eps is 1e-3, not the default 1e-5, so an eps not
    read from the config shows; norms, biases and the class embedding are moved off their
    init."""
    import transformers

    vision = transformers.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=vision_layers,
        num_attention_heads=4,
        num_channels=3,
        image_size=16,
        patch_size=4,
        hidden_act="quick_gelu",
        layer_norm_eps=1e-3,
        initializer_range=0.1,
    )
    text = transformers.LlamaConfig(
        vocab_size=272,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=128,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,  # LLaVA's own tie_word_embeddings ties the head
        max_position_embeddings=128,
        initializer_range=0.1,
    )
    cfg = transformers.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=256,
        image_seq_length=16,
        vision_feature_layer=feature_layer,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    m = transformers.LlavaForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n or n.endswith(("bias", "class_embedding")):
                p.add_(torch.randn_like(p) * 0.1)
    if path is not None:
        m.save_pretrained(path, safe_serialization=True)
    return m


def hf_greedy(m, prompts: list, new: int, until_eos: bool = True) -> list:
    """transformers' greedy ``generate`` of ``prompts`` (lists of ids) left-padded in one
    batch with their attention mask, ``new`` tokens: each row up to its end-of-sequence
    token (kept; transformers pads the rest of the batch), or, with ``until_eos=False``, all
    ``new`` with the end-of-sequence token disabled."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    eos = m.generation_config.eos_token_id
    if not until_eos:
        m.generation_config.eos_token_id = None
    try:
        out = m.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
    finally:
        m.generation_config.eos_token_id = eos
    rows = out[:, width:].tolist()
    if until_eos and eos is not None:
        rows = [r[: r.index(eos) + 1] if eos in r else r for r in rows]
    return rows


def tiny_mixtral(path=None, tie: bool = False):
    """A MixtralForCausalLM of meshlm's ``moe_tiny`` shape: 2 layers of width 64, 8 heads
    of 8 over 4 key-value heads, top-2 of 8 experts of width 32.  Saved with
    ``save_pretrained`` to ``path`` when given (per-expert ``w1``/``w2``/``w3`` tensors).
    initializer_range is 0.1 (not 0.02), so that the experts' outputs and the routing are of
    order 1 in the logits; norms are moved off their init."""
    import transformers

    cfg = transformers.MixtralConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=8,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    m = transformers.MixtralForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    if path is not None:
        m.save_pretrained(path, safe_serialization=True)
    return m


def _qwen_moe(kind: str, path, **extra):
    """A Qwen2-MoE or Qwen3-MoE for causal LM of meshlm's ``moe_tiny`` shape: 2 layers of
    width 64, 8 heads of 8 over 4 key-value heads, top-2 of 8 experts of width 32, every
    layer sparse.  initializer_range 0.1 (as :func:`tiny_mixtral`); norms (the per-head
    query and key norms included) and attention biases are moved off their init."""
    import transformers

    config_cls = getattr(transformers, f"{kind}Config")
    cfg = config_cls(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rms_norm_eps=1e-5,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        initializer_range=0.1,
        **extra,
    )
    torch.manual_seed(0)
    m = getattr(transformers, f"{kind}ForCausalLM")(cfg).float().eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    if path is not None:
        m.save_pretrained(path, safe_serialization=True)
    return m


def tiny_qwen3_moe(path=None):
    """A Qwen3MoeForCausalLM (:func:`_qwen_moe`): per-head query and key norms, head_dim 8,
    no attention bias, the top-2 gates renormalised (``norm_topk_prob``, as Qwen3-MoE's
    checkpoints have it)."""
    return _qwen_moe("Qwen3Moe", path, head_dim=8, norm_topk_prob=True, attention_bias=False)


def tiny_qwen2_moe(path=None):
    """A Qwen2MoeForCausalLM (:func:`_qwen_moe`): query, key and value biases, a shared
    expert of width 64 behind its sigmoid gate, the top-2 gates not renormalised (Qwen2-MoE's
    default)."""
    return _qwen_moe("Qwen2Moe", path, shared_expert_intermediate_size=64, norm_topk_prob=False, qkv_bias=True)
